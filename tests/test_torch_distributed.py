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
  where one process with 2 micro-batches of 2 rows adds (a + b) + (c + d) with a and b summed
  inside one micro-batch's matrix products, in another order: the association differs, so
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
import shutil
import socket
import subprocess
import sys
from typing import Any, Iterator

import pytest

from conftest import (RunningDaemon, clean_environment, daemon_settings_file, short_tmp_root,
                      start_daemon_process)

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


class Runs:
    """The training runs the tests compare, each run once per module on a daemon of its own
    (the runs take most of these tests' time)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.daemons: list[RunningDaemon] = []
        self.roots: list[str] = []
        self._done: dict[str, dict[str, Any]] = {}

    def daemon(self) -> RunningDaemon:
        self.roots.append(short_tmp_root())
        self.daemons.append(start_daemon_process(self.roots[-1]))
        return self.daemons[-1]

    def alone(self, *, micro_batches: int) -> dict[str, Any]:
        key = f"alone-{micro_batches}"
        if key not in self._done:
            self._done[key] = run_alone(self.daemon(), os.path.join(self.folder, key + ".json"),
                                        micro_batches=micro_batches)
        return self._done[key]

    def ranks_on(self, *, num_nodes: int) -> dict[str, Any]:
        key = f"nodes-{num_nodes}"
        if key not in self._done:
            out, port = os.path.join(self.folder, key + ".json"), free_port()
            finish(*[torchrun(self.daemon(), out if node == 0 else out + f".{node}",
                              num_nodes=num_nodes, node_rank=node, port=port)
                     for node in range(num_nodes)])
            with open(out) as f:
                self._done[key] = json.load(f)
            assert self._done[key]["world_size"] == 2 * num_nodes
        return self._done[key]

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: Any) -> Iterator[Runs]:
    kept = Runs(str(tmp_path_factory.mktemp("runs")))
    try:
        yield kept
    finally:
        kept.close()


def test_two_ranks_on_one_daemon_give_the_losses_and_norms_of_one_process_bit_for_bit(
        runs: Runs) -> None:
    alone, ranks = runs.alone(micro_batches=2), runs.ranks_on(num_nodes=1)
    assert ranks["slice_losses"] == alone["slice_losses"]
    assert ranks["grad_norms"] == alone["grad_norms"]  # clipping saw the same averaged gradient


def test_two_ranks_on_one_daemon_hold_the_cpu_tier_bytes_of_one_process(runs: Runs) -> None:
    alone, ranks = runs.alone(micro_batches=2), runs.ranks_on(num_nodes=1)
    assert ranks["cpu_used_bytes"] <= 1.1 * alone["cpu_used_bytes"]


def test_two_nodes_of_two_ranks_give_the_losses_of_one_process_within_rounding(
        runs: Runs) -> None:
    alone, nodes = runs.alone(micro_batches=2), runs.ranks_on(num_nodes=2)
    for step, (slices, halves) in enumerate(zip(nodes["slice_losses"], alone["slice_losses"])):
        # The slices are equal in size: their mean is the global batch's loss.
        assert sum(slices) / 4 == pytest.approx(sum(halves) / 2, rel=1e-5), f"step {step}"
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
