"""One parameter's Adam step in pieces: an item larger than the optimizer's window, stepped by
element ranges through staging slices, its results streamed to fresh NVMe extents.

`OptimizerService` steps an item whole when it fits its window (its tensors loaded into the CPU
tier, the kernel run over them in place). An item that does not fit (an embedding's parameter,
gradient and moments: gigabytes in a large model) and is not all resident already goes through
`PieceStepper` instead. Its memory is bounded by the window, not by the parameter:

- the element range [0, numel) is cut into pieces of `PiecePlan.elements` (a multiple of the
  1 MiB checksum block in every tensor's dtype, so each piece is whole blocks of every tensor
  and NVMe ranges are read verified and written with their checksums);
- `PiecePlan.sets` sets of staging slices, one slice per tensor that is written (the
  parameter, both moments, the master copy) and one for the gradient when it is not resident,
  are taken from the CPU tier (evicting like any allocation). Three sets make a pipeline: in
  round r the pieces r (read: from NVMe, or copied from a resident version), r - 1 (the kernel)
  and r - 2 (written to NVMe) are all in flight, and the round ends when the slowest is done.
  A window too small for three sets of one block each gets two or one (the stages then take
  turns more: a read goes only into a set whose last piece is written);
- every tensor the step writes gets fresh extents when the item starts (`allocate_disk`), and
  each piece's bytes go there (`NvmeTier.write_part`, checksums computed as written). Nothing
  is written in place, neither in the CPU tier nor on NVMe: the old versions stay whole.

Commit: once the last piece is on NVMe, the new versions are published in one loop-thread turn
(`Catalog.install`, NVMe-only, clean), replacing the old ones. An error before that (an I/O
failure, the tier full, the daemon stopping) frees the new extents and installs nothing: the
item is applied whole or not at all. Durability is the store's usual one: the new copies are
indexed by the next flush (`flush_store`), so a daemon killed at any point of the step comes back
with each tensor as its last flushed version, whole; never a mix of old and new ranges (the
extents the index points at are never written). A parameter with an fp32 master copy reads the
master (the kernel writes the low-precision parameter without reading it), so its old bytes are
not read at all.

The arithmetic is the whole-item kernel's, element by element (the kernel is elementwise), so
the result is bit for bit that of a whole-item step. Loop thread only: the job yields futures of
the engine, the task pool and the tiers.

A speculative step (`OptimizerService`, during the trainer's backward) runs the same pipeline
with `publish=False`: the finished extents are returned as a `Prepared` instead of published,
the old versions untouched, and the step that follows either installs them (`install`: the same
publish, later) or frees them (`discard`).
"""

from __future__ import annotations

import array
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from infinity.daemon.arena import CpuSlice, SpaceShortage
from infinity.daemon.catalog import Catalog, Version
from infinity.daemon.diskcopy import DiskCopy
from infinity.daemon.jobs import Job
from infinity.daemon.tasks import LoopTaskPool
from infinity.daemon.tiers import TierManager
from infinity.errors import InfinityError, TierFullError
from infinity.io.future import IOFuture
from infinity.protocol import dtypes, wire
from infinity.store.nvme import (CRC_BLOCK_BYTES, PAGE_BYTES, TensorLayout, crc_blocks, crc_buffer,
                                 finished_layout)

PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, MASTER = range(5)  # the order of an item's versions
SETS = 3  # staging sets: one piece read, one computed, one written at a time
MAX_PIECE_BYTES = 8 << 20  # of one fp32 tensor's piece: more only lengthens the pipeline's ends
CHUNK_ELEMENTS = 1 << 18  # a thread's share of one piece's kernel


class PutBack(Exception):
    """The tier is full of other items' staging: the item starts again when one is done."""


@dataclass(eq=False)
class Prepared:
    """A step's results written to fresh extents and not published: per written version's
    index, its finished layout."""

    layouts: dict[int, TensorLayout]
    sync_failures_before: int


@dataclass(eq=False)
class PiecePlan:
    """How an item is stepped in pieces."""

    numel: int
    elements: int  # per piece (the last may be shorter)
    sets: int
    staged: list[int]  # indexes of the versions that go through staging slices
    written: list[int]  # indexes of the versions the step writes
    staging_bytes: int  # all the sets together: what the item holds of the window
    slices: list[dict[int, CpuSlice]] = field(default_factory=list)
    layouts: dict[int, TensorLayout] = field(default_factory=dict)
    crcs: dict[int, "array.array[int]"] = field(default_factory=dict)
    sync_failures_before: int = 0  # the NVMe tier's, when the extents were taken (`DiskCopy`)

    @property
    def count(self) -> int:
        return -(-self.numel // self.elements)

    def range_of(self, piece: int) -> tuple[int, int]:
        start = piece * self.elements
        return start, min(self.numel, start + self.elements)


def tier_too_small(full: TierFullError, param: Version, need_bytes: int) -> TierFullError:
    """The tier-full error of a parameter's step with no other item running: how much of the
    tier its step needs at once (its tensors leased there, staging), beside the trainer's own
    leases, and what to do. (Measured on a GPT-2 whose largest parameter is 16 MB: a tier of
    twice that failed, three times passed, with and without delay_update.)"""
    return TierFullError(
        f"{full}. The step of {param.key[1]!r} needs {need_bytes} bytes of the CPU tier at once "
        f"beside the trainer's own leases: make cpu.budget_bytes at least 3 times the largest "
        f"parameter's fp32 bytes")


def _slice_bytes(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def plan_pieces(versions: list[Version], numel: int, window_bytes: int) -> PiecePlan:
    """The pieces of an item whose tensors are `versions` (param, grad, exp_avg, exp_avg_sq[,
    master]) so that its staging sets take at most `window_bytes` (or one block's worth)."""
    sizes = [dtypes.itemsize(v.dtype) for v in versions]
    unit = CRC_BLOCK_BYTES // min(sizes)  # elements: whole checksum blocks of every tensor
    written = [PARAM, EXP_AVG, EXP_AVG_SQ] + ([MASTER] if len(versions) > MASTER else [])
    staged = written + ([GRAD] if versions[GRAD].cpu is None else [])
    per_element = sum(sizes[i] for i in staged)
    # Fewer sets where the window cannot hold three of one block each (a small tier): slower,
    # as reads, kernel and writes then take turns, but within the window.
    sets = max(1, min(SETS, window_bytes // (unit * per_element)))
    fitting = window_bytes // (sets * per_element) // unit * unit
    elements = max(unit, min(fitting, MAX_PIECE_BYTES // 4 // unit * unit))
    elements = min(elements, -(-numel // unit) * unit)
    sets = min(sets, -(-numel // elements))
    staging = sets * sum(_slice_bytes(elements * sizes[i]) for i in staged)
    return PiecePlan(numel, elements, sets, staged, written, staging)


class PieceStepper:
    """Runs items in pieces (see the module's docstring). Loop thread only."""

    def __init__(self, catalog: Catalog, tiers: TierManager, tasks: LoopTaskPool) -> None:
        self.catalog = catalog
        self.tiers = tiers
        self.tasks = tasks
        self.items = 0  # items stepped in pieces
        self.pieces = 0  # pieces computed
        self.bytes_read = 0  # read from NVMe by pieces
        self.bytes_written = 0  # written to NVMe by pieces

    def run(self, plan: PiecePlan, versions: list[Version], group: wire.AdamGroup, step: int, *,
            others_running: Callable[[], bool], delay: Callable[[], Future[None] | None],
            stopping: Callable[[], InfinityError | None],
            publish: bool = True) -> Job[Prepared | None]:
        """The step of one leased item in pieces, committed at its end (`publish=False`: its
        results returned, unpublished, for `install` or `discard`). Raises PutBack when the
        tier is full of other items' staging (`others_running()`), nothing changed; `delay` is
        waited for before each piece's kernel (a debug setting; None: no wait); `stopping`
        returns the error to end with when the daemon stops."""
        try:
            yield from self._take_room(plan, versions, others_running)
            count, sets = plan.count, plan.sets
            read = computed = written = 0  # pieces through each stage, as of the last round
            while written < count:
                error = stopping()
                if error is not None:
                    raise error
                # This round: the next piece of each stage whose previous stage is done, and a
                # read only into a set whose last piece is written (with three sets: piece r
                # read, r - 1 computed and r - 2 written, all at once).
                write = written < computed
                compute = computed < read
                fetch = read < count and read - sets < written
                if compute:
                    wait = delay()
                    if wait is not None:
                        yield wait
                stage: list[IOFuture | Future[Any]] = []
                try:
                    if fetch:
                        self._read(plan, versions, read, stage)
                    if compute:
                        stage.append(self._compute(plan, versions, computed, group, step))
                    if write:
                        self._write(plan, versions, written, stage)
                except BaseException:
                    if stage:
                        try:
                            yield stage  # nothing is freed under I/O still in flight
                        except Exception:
                            pass
                    raise
                yield stage
                read, computed, written = read + fetch, computed + compute, written + write
            self.items += 1
            if not publish:
                layouts = {i: finished_layout(plan.layouts[i], plan.crcs[i]) for i in plan.written}
                plan.layouts = {}  # theirs now: `_give_back` leaves them
                return Prepared(layouts, plan.sync_failures_before)
            self._commit(plan, versions)
            return None
        finally:
            self._give_back(plan)

    # --- room ----------------------------------------------------------------------------

    def _take_room(self, plan: PiecePlan, versions: list[Version],
                   others_running: Callable[[], bool]) -> Job[None]:
        """Staging slices for every set, then fresh extents for every tensor written."""
        for _ in range(plan.sets):
            slices: dict[int, CpuSlice] = {}
            plan.slices.append(slices)
            for i in plan.staged:
                nbytes = _slice_bytes(plan.elements * dtypes.itemsize(versions[i].dtype))
                what = f"a staging slice of the step of {versions[PARAM].key[1]!r}"
                while True:
                    try:
                        slices[i] = self.tiers.allocate_slice(nbytes, what=what)
                        break
                    except SpaceShortage:
                        yield self._when_space()
                    except TierFullError as exc:
                        if others_running():
                            raise PutBack() from None
                        resident = sum(v.nbytes for v in versions if v.cpu is not None)
                        raise tier_too_small(exc, versions[PARAM],
                                             resident + plan.staging_bytes) from None
        nvme = self.tiers.nvme
        assert nvme is not None  # an item is stepped in pieces only with an NVMe tier
        plan.sync_failures_before = nvme.sync_failures
        for i in plan.written:
            version = versions[i]
            extents = self._disk(version.nbytes)
            yield extents
            plan.layouts[i] = extents.result()
            plan.crcs[i] = crc_buffer(crc_blocks(version.nbytes))

    def _when_space(self) -> Future[None]:
        future: Future[None] = Future()
        self.tiers.when_space(lambda error: future.set_result(None) if error is None
                              else future.set_exception(error))
        return future

    def _disk(self, nbytes: int) -> Future[TensorLayout]:
        future: Future[TensorLayout] = Future()

        def then(layout: TensorLayout | None, error: InfinityError | None) -> None:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(layout)  # type: ignore[arg-type]

        self.tiers.allocate_disk(nbytes, then)
        return future

    def _give_back(self, plan: PiecePlan) -> None:
        """Free the staging slices, and the extents not published (an item that failed)."""
        for slices in plan.slices:
            for piece in slices.values():
                self.tiers.free_slice(piece)
        plan.slices = []
        for layout in plan.layouts.values():
            self.tiers.free_disk(layout)
        plan.layouts = {}

    # --- one piece's stages --------------------------------------------------------------

    def _read(self, plan: PiecePlan, versions: list[Version], piece: int,
              stage: list[IOFuture | Future[Any]]) -> None:
        """Bring piece `piece` of each staged tensor the kernel reads into its set's slices: a
        copy from a resident version, or a verified read of its NVMe copy."""
        start, end = plan.range_of(piece)
        slices = plan.slices[piece % plan.sets]
        address = self.tiers.address_of
        master = len(versions) > MASTER
        for i in plan.staged:
            if i == PARAM and master:
                continue  # written from the master copy, never read
            version = versions[i]
            size = dtypes.itemsize(version.dtype)
            offset, nbytes = start * size, (end - start) * size
            if version.cpu is not None:
                stage.append(self.tasks.pool.submit_copy(
                    dst=address(slices[i]), src=address(version.cpu) + offset, nbytes=nbytes))
                continue
            future: Future[None] = Future()

            def done(error: InfinityError | None, future: Future[None] = future) -> None:
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)

            self.tiers.read_part(version, slices[i], offset_bytes=offset, nbytes=nbytes,
                                 done=done)
            self.bytes_read += nbytes
            stage.append(future)

    def _compute(self, plan: PiecePlan, versions: list[Version], piece: int,
                 group: wire.AdamGroup, step: int) -> IOFuture:
        start, end = plan.range_of(piece)
        slices = plan.slices[piece % plan.sets]
        address = self.tiers.address_of
        master = len(versions) > MASTER
        grad = versions[GRAD]
        if GRAD in slices:
            grad_address = address(slices[GRAD])
        else:
            assert grad.cpu is not None  # leased while resident: it stays
            grad_address = address(grad.cpu) + start * dtypes.itemsize(grad.dtype)
        self.pieces += 1
        return self.tasks.pool.submit_adam(
            param=address(slices[MASTER if master else PARAM]), grad=grad_address,
            grad_dtype=grad.dtype, exp_avg=address(slices[EXP_AVG]),
            exp_avg_sq=address(slices[EXP_AVG_SQ]), numel=end - start, lr=group.lr,
            beta1=group.beta1, beta2=group.beta2, eps=group.eps, weight_decay=group.weight_decay,
            step=step, decoupled=group.decoupled, grad_scale=group.grad_scale,
            low=address(slices[PARAM]) if master else 0,
            low_dtype=versions[PARAM].dtype if master else "none", chunk_elements=CHUNK_ELEMENTS)

    def _write(self, plan: PiecePlan, versions: list[Version], piece: int,
               stage: list[IOFuture | Future[Any]]) -> None:
        """Write piece `piece` of each tensor the step writes to its fresh extents."""
        start, end = plan.range_of(piece)
        slices = plan.slices[piece % plan.sets]
        nvme = self.tiers.nvme
        assert nvme is not None
        for i in plan.written:
            version = versions[i]
            size = dtypes.itemsize(version.dtype)
            offset, nbytes = start * size, (end - start) * size
            if end == plan.numel:  # the tail's 4 KiB padding goes to disk too: zeros
                self.tiers.zero(slices[i], nbytes, _slice_bytes(nbytes))
            stage.append(nvme.write_part(plan.layouts[i], self.tiers.address_of(slices[i]),
                                         offset_bytes=offset, nbytes=nbytes, crcs=plan.crcs[i]))
            self.tiers.note_stream_write(nbytes)
            self.bytes_written += nbytes

    # --- the commit ----------------------------------------------------------------------

    def _commit(self, plan: PiecePlan, versions: list[Version]) -> None:
        """Every piece is on NVMe: publish the new versions, in one turn of the loop. A tensor
        that a client replaced meanwhile (a put over the leased version) keeps the client's
        version, as a whole-item step's in-place write of the replaced version would."""
        for i in plan.written:
            version = versions[i]
            if not version.current:
                continue  # its extents are freed with the rest
            layout = finished_layout(plan.layouts.pop(i), plan.crcs[i])
            self._install(version, layout, plan.sync_failures_before)

    def install(self, prepared: Prepared, versions: list[Version]) -> None:
        """Publish a speculative step's results over `versions` (each still current: the
        caller checked), in one turn of the loop."""
        layouts, prepared.layouts = prepared.layouts, {}
        for i, layout in layouts.items():
            self._install(versions[i], layout, prepared.sync_failures_before)

    def discard(self, prepared: Prepared) -> None:
        """Free a speculative step's extents: its results are not wanted."""
        layouts, prepared.layouts = prepared.layouts, {}
        for layout in layouts.values():
            self.tiers.free_disk(layout)

    def _install(self, version: Version, layout: TensorLayout, sync_failures_before: int) -> None:
        copy = DiskCopy(layout, sync_failures_before=sync_failures_before)
        self.catalog.install(version.key, version.dtype, version.shape, version.nbytes,
                             cpu=None, dirty=False, nvme=copy)
