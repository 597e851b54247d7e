"""Many ranks, one copy: the ranks of a torchrun job on a node share their daemon's state, and
nodes (one daemon each) split the optimizer between them (`offload(..., process_group=...)`).

Real torchrun jobs (gloo) against real daemons; two daemons on this machine are two nodes. The
runs train the same tiny Llama on the same global batches (tests/distributed_trainer.py); what
may differ between them is only the order in which the per-row gradients are added:

- 2 ranks on one daemon add their two slices' gradients into the node's sum: a + b, then the
  step scales by 1/2. One process with 2 micro-batches (each loss halved) stores a/2 + b/2.
  Halving is exact in binary floating point and addition of two terms commutes, so the two
  runs must give the same losses bit for bit (any fault in the sum or in the averaging, which
  the trainer's large eps makes visible to Adam, breaks that).
- 2 nodes of 2 ranks add (a + b) + (c + d) (each node's sum, then gloo's sum of the two),
  where one process with 4 micro-batches adds ((a + b) + c) + d: the association differs, so
  each gradient element may differ in its last bits (relative 2^-23 of the sum of the terms'
  magnitudes). Adam turns a gradient into a step of at most lr per element (lr 1e-2 here,
  decaying), so after k steps each parameter differs from the other run's by at most 2 k lr
  in the worst case (a sign flip of an element whose terms cancel), and for all others by a
  relative ~1e-6. Such flips happen only where a gradient element is zero to within rounding,
  so they change the loss in the second order: the losses agree to a relative ~1e-7 (seen:
  at most 1.8e-7 over 4 steps); the bound used is 1e-5, while a node's gradients left out of
  the sum moved the loss by 6e-3 by the third step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any, Callable

import pytest

from conftest import RunningDaemon, clean_environment, daemon_settings_file

HERE = os.path.dirname(os.path.abspath(__file__))
TRAINER = os.path.join(HERE, "distributed_trainer.py")
pytestmark = pytest.mark.timeout(300)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def trainer_env() -> dict[str, str]:
    env = clean_environment()
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_alone(daemon: RunningDaemon, out: str, *, micro_batches: int) -> dict[str, Any]:
    subprocess.run([sys.executable, TRAINER, daemon_settings_file(daemon.root),
                    daemon.runtime_dir, out, "--micro-batches", str(micro_batches)],
                   env=trainer_env(), check=True, timeout=240)
    with open(out) as f:
        return json.load(f)


def torchrun(daemon: RunningDaemon, out: str, *, num_nodes: int, node_rank: int, port: int,
             ranks_per_node: int = 2) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nnodes={num_nodes}",
         f"--node-rank={node_rank}", f"--nproc-per-node={ranks_per_node}",
         "--master-addr=127.0.0.1", f"--master-port={port}", TRAINER,
         daemon_settings_file(daemon.root), daemon.runtime_dir, out],
        env=trainer_env())


def finish(*jobs: subprocess.Popen[bytes]) -> None:
    for job in jobs:
        assert job.wait(timeout=240) == 0, "a torchrun job failed (its output is above)"


def alone_and_two_ranks(daemon_factory: Callable[..., RunningDaemon], tmp_path: Any, *,
                        micro_batches: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """What one process (with `micro_batches`) and 2 ranks on one daemon wrote, each run with
    a daemon of its own."""
    alone = run_alone(daemon_factory(), str(tmp_path / "alone.json"),
                      micro_batches=micro_batches)
    finish(torchrun(daemon_factory(), str(tmp_path / "ranks.json"), num_nodes=1, node_rank=0,
                    port=free_port()))
    with open(tmp_path / "ranks.json") as f:
        ranks = json.load(f)
    assert ranks["world_size"] == 2
    return alone, ranks


def test_two_ranks_on_one_daemon_give_the_losses_and_norms_of_one_process_bit_for_bit(
        daemon_factory: Callable[..., RunningDaemon], tmp_path: Any) -> None:
    alone, ranks = alone_and_two_ranks(daemon_factory, tmp_path, micro_batches=2)
    assert ranks["slice_losses"] == alone["slice_losses"]
    assert ranks["grad_norms"] == alone["grad_norms"]  # clipping saw the same averaged gradient


def test_two_ranks_on_one_daemon_hold_the_cpu_tier_bytes_of_one_process(
        daemon_factory: Callable[..., RunningDaemon], tmp_path: Any) -> None:
    alone, ranks = alone_and_two_ranks(daemon_factory, tmp_path, micro_batches=1)
    assert ranks["cpu_used_bytes"] <= 1.1 * alone["cpu_used_bytes"]


def test_two_nodes_of_two_ranks_give_the_losses_of_one_process_within_rounding(
        daemon_factory: Callable[..., RunningDaemon], tmp_path: Any) -> None:
    alone = run_alone(daemon_factory(), str(tmp_path / "alone.json"), micro_batches=1)
    first, second = daemon_factory(), daemon_factory()
    port = free_port()
    finish(torchrun(first, str(tmp_path / "nodes.json"), num_nodes=2, node_rank=0, port=port),
           torchrun(second, str(tmp_path / "unused.json"), num_nodes=2, node_rank=1, port=port))
    with open(tmp_path / "nodes.json") as f:
        nodes = json.load(f)
    assert nodes["world_size"] == 4
    for step, (slices, (whole,)) in enumerate(zip(nodes["slice_losses"], alone["slice_losses"])):
        mean = sum(slices) / len(slices)  # the slices are equal in size: the global batch's
        assert mean == pytest.approx(whole, rel=1e-5), f"step {step}"
    assert nodes["grad_norms"] == pytest.approx(alone["grad_norms"], rel=1e-5)


@pytest.fixture
def one_rank_job() -> Any:
    """torch.distributed initialised in this process as a job of one rank (gloo), and torn down
    after the test (later tests must find it uninitialised)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_process_group_without_torch_distributed_is_a_typed_error(client: Any) -> None:
    import tiny_models
    from infinity.errors import InvalidRequestError
    import infinity.torch as itorch

    with pytest.raises(InvalidRequestError, match="init_process_group"):
        itorch.offload(tiny_models.llama(), client, namespace="job", process_group=object())


def test_what_a_job_cannot_do_yet_is_a_typed_error_and_the_step_still_works(
        client: Any, one_rank_job: Any) -> None:
    import torch
    import tiny_models
    from infinity.errors import InvalidRequestError
    import infinity.torch as itorch

    model = itorch.offload(tiny_models.llama(), client, namespace="job",
                           process_group=one_rank_job)
    with pytest.raises(InvalidRequestError, match="delay_update"):
        itorch.AdamW(model.parameters(), delay_update=True)
    optimizer = itorch.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(3, 16).reshape(1, 13)
    before = model(input_ids=ids, labels=ids).loss
    before.backward()
    for refused in (optimizer.state_dict, optimizer.resume,
                    lambda: itorch.save_checkpoint(str(client.layout.root) + "/ck", model,
                                                   optimizer)):
        with pytest.raises(InvalidRequestError, match="multi-rank job"):
            refused()
    optimizer.step()
    optimizer.zero_grad()
    assert model(input_ids=ids, labels=ids).loss < before
