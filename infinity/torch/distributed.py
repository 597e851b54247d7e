"""The ranks of a `torch.distributed` job as nodes of daemons: who shares a daemon with whom, who
speaks for each node, and the collectives that offload and the optimizer run between them.

Ranks attached to the same infinityd (one per node) form a *node*: they train on one copy of the
parameters and optimizer states, in that daemon's store. The node's lowest rank is its *leader*:
it uploads the parameters, clears the node's gradients, and exchanges the node's share of the
work with the other nodes' leaders. Between nodes the optimizer is partitioned: each node owns
the fp32 master weights and both moments of a part of the parameters (`owner_of`), steps only
those, and sends their new values to the other nodes (every node keeps all parameters, which
its ranks' forwards read). All exchanges are `torch.distributed` collectives on a gloo group of
their own (the store's tensors are host memory, whatever the job's default backend is).

Which ranks share a daemon is asked of the daemons, not of the launcher: every rank says which
daemon it is attached to (host, runtime folder, daemon pid) and the ranks that name the same one
are a node. So two daemons on one machine are two nodes, as the tests run them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from infinity.errors import InvalidRequestError

__all__ = ["NodeRanks", "node_ranks"]


@dataclass(frozen=True, eq=False)
class NodeRanks:
    """This rank's place among the job's nodes (built by `node_ranks`)."""

    rank: int                           # global rank
    world_size: int
    node: int                           # this rank's node, numbered by its lowest rank
    nodes: tuple[tuple[int, ...], ...]  # the global ranks of each node
    world_group: Any                    # gloo, all ranks
    node_group: Any                     # gloo, this node's ranks
    leader_group: Any                   # gloo, each node's lowest rank (None when not in it)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.nodes)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.nodes[self.node][0]

    def node_barrier(self) -> None:
        """Wait until every rank of this node got here."""
        dist.barrier(group=self.node_group)

    def world_barrier(self) -> None:
        dist.barrier(group=self.world_group)

    def owner_of(self, sizes: Sequence[int]) -> list[int]:
        """The node owning each parameter's optimizer state, given the parameters' element
        counts in the optimizer's order: each in turn goes to the node with the fewest elements
        so far (ties to the lower node), so every rank computes the same partition."""
        loads = [0] * self.num_nodes
        owners = []
        for size in sizes:
            node = min(range(self.num_nodes), key=lambda n: (loads[n], n))
            loads[node] += size
            owners.append(node)
        return owners

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag or'ed over all ranks (a collective: every rank calls it with as many)."""
        tensor = torch.tensor([1.0 if flag else 0.0 for flag in flags])
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.world_group)
        return [bool(value) for value in tensor.tolist()]

    def sum_over_ranks(self, value: float) -> float:
        """`value` summed over all ranks (a collective), in double."""
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, group=self.world_group)
        return float(tensor.item())

    def sum_to_owner(self, tensor: torch.Tensor, owner: int) -> None:
        """Leaders only: add this node's `tensor` into the owner node's, in place there."""
        dist.reduce(_as_bits_if_needed(tensor, summing=True), dst=self.leaders[owner],
                    group=self.leader_group)

    def send_from_owner(self, tensor: torch.Tensor, owner: int) -> None:
        """Leaders only: overwrite `tensor` with the owner node's (the owner sends)."""
        dist.broadcast(_as_bits_if_needed(tensor, summing=False), src=self.leaders[owner],
                       group=self.leader_group)


def _as_bits_if_needed(tensor: torch.Tensor, *, summing: bool) -> torch.Tensor:
    """A tensor gloo can carry: a copy of values is carried as raw bits (any dtype of that
    width), a sum needs a dtype gloo adds (the store sums gradients in fp32, bf16 or fp16)."""
    if summing or tensor.dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
        return tensor
    return tensor.view(torch.int16) if tensor.element_size() == 2 else tensor.view(torch.uint8)


def node_ranks(client: Any, process_group: Any = None) -> NodeRanks:
    """Group the job's ranks by the daemon each one's `client` is attached to. A collective:
    every rank of the job calls it, in the same order as its other collectives (it creates
    process groups, which torch asks of all ranks)."""
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidRequestError(
            "process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment)")
    world = dist.group.WORLD if process_group is None else process_group
    if dist.get_world_size(world) != dist.get_world_size():
        raise InvalidRequestError(
            "process_group must span the whole job (offload groups its ranks by node, which "
            "torch asks of every rank); pass torch.distributed.group.WORLD")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    here = f"{socket.gethostname()}|{os.path.realpath(str(client.layout.root))}|{client.daemon_pid}"
    daemons: list[Any] = [None] * world_size
    world_group = dist.new_group(list(range(world_size)), backend="gloo")
    dist.all_gather_object(daemons, here, group=world_group)
    order: dict[str, list[int]] = {}
    for other, daemon in enumerate(daemons):
        order.setdefault(daemon, []).append(other)
    nodes = tuple(tuple(ranks) for ranks in order.values())  # by lowest rank: gathered in order
    node = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    node_group = None
    for ranks in nodes:  # every rank creates every group, in the same order
        group = dist.new_group(list(ranks), backend="gloo")
        if rank in ranks:
            node_group = group
    leader_group = dist.new_group([ranks[0] for ranks in nodes], backend="gloo")
    return NodeRanks(rank=rank, world_size=world_size, node=node, nodes=nodes,
                     world_group=world_group, node_group=node_group,
                     leader_group=leader_group if rank == nodes[node][0] else None)
