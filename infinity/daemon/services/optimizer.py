"""The optimizer: Adam / AdamW steps run in the daemon, next to the data (the `adam_step` request).

A trainer's `infinity.torch.AdamW.step()` sends one request naming, per parameter, the stored
tensors of its state: the parameter, its gradient (summed there by `offload`'s hooks), its fp32
master copy when the parameter is kept in a lower precision, and both moments. For each item the
service:

1. leases the tensors under the daemon's own identity (`DAEMON_CLIENT_ID`): the gradient shared,
   the rest exclusively, so no client reads a half-updated parameter and the tier writes the
   result back to NVMe as a new copy (written in place marks it dirty);
2. has the tiers load what is only on NVMe (`ensure_resident`), and
3. runs the native kernel (an Adam task on the daemon's native task pool: one pass over memory,
   SIMD, no Python and no GIL) over the item's elements, cut into chunks run by the pool's
   threads; the pool's eventfd wakes the loop when the item is done, which releases the lease.

The stages of one item after its lease read top to bottom in `_step_one`, a job (`infinity.daemon.jobs`)
that yields the loads and the kernel's task and is resumed on the loop thread as each completes.
Items are pipelined within a window of bytes (a quarter of the CPU tier), so the loads of the
next items overlap the arithmetic of this one and a model larger than the tier still steps. The
window is the service's, not a request's: requests are served first come, first served, and a
trainer sends one step as several requests (sub-groups, in the order its forward uses the
parameters) without waiting, so it can go on with the next forward while the daemon steps, and
the forward waits only for the sub-group whose parameters it needs next. An item whose load finds
the tier full while other items hold it is put back and started again when one of them is done,
and the window shrinks to what fitted. A request's reply goes once every item of it is done: one
result per item, None or the error it met (a tensor missing, of the wrong dtype or size, leased
by someone else). The loop thread never computes.

A trainer's step is one or more requests (its sub-groups) under one `step_id` (`wire.AdamStep`):
the service holds the parts of a step until it has all of them, and only then queues them. So a
trainer that dies while sending its step (the daemon then drops the parts it got, `client_gone`)
has none of it applied, and one that dies after sending all of it has all of it applied: the
items run under the daemon's own leases and do not care whether the session that asked is still
there. Never a half-applied step. A step's *commit* comes once its items and every earlier
step's touching one of its namespaces are done: the step's record, when it has one, is written
then into its stored uint8 tensor (in place, under an exclusive lease), and the reply of its
last part goes only after that. A step of no items is a barrier: its reply says every step
received before it in its namespace is applied (a restarted trainer waits for the step its
predecessor left running before it reads the state).

An item larger than the window that is not all in the CPU tier (an embedding: its four fp32
tensors can be gigabytes, more than the whole tier) is not loaded whole: it is stepped in pieces
(`infinity.daemon.services.adam_pieces`): element ranges read (from NVMe, or copied from
resident versions) into staging slices that hold at most the window, the kernel run on each, and
each written to fresh NVMe extents while the next is read and computed; the new versions are
published together at the end. Why this design: writing ranges in place (into the resident
versions or the indexed extents) would leave a torn tensor after an I/O error or a kill, while
fresh extents plus one publish keep what the whole-item step keeps: the item applied all or
none, each tensor's durable copy old or new, never mixed (the index moves at the next flush, as
for any write); and the memory is the staging's, bounded by the window, whatever the
parameter's size. The results are bit for bit the whole-item step's (the kernel is elementwise).
An item that does not fit but is all resident already is stepped whole, in place (no memory to
save, no I/O to do).

A *speculative* step (`wire.AdamStep.speculative`) is a trainer's guess of its coming step, sent
during backward as each sub-group's gradients are final, so the step's I/O and arithmetic
overlap backward instead of the next forward. Its items run the pieces pipeline under shared
leases with nothing published (`PieceStepper.run(publish=False)`): the results wait on fresh
extents in `speculations`, one per (session, namespace, parameter), a newer guess replacing an
older one. When the real step's item for that parameter leases its tensors, the guess is
installed instead of computing if it was made from the same tensors, unchanged since (the same
versions, and no exclusive lease granted on any of them in between: `Version.edits`), with the
same hyperparameters, gradient scale and step number; otherwise it is freed and the item
computed as usual. The check makes a wrong guess (a clipped gradient, another micro-batch
added, a changed learning rate) cost only its I/O, never a different result; the results are
bit for bit the step's (the same kernel over the same bytes). Guesses of a session that ends
are freed.

`daemon.debug_step_delay_s` (a debug setting, 0 by default) makes each item (and each piece of an
item stepped in pieces) wait that long after the one before it, so a test can kill a trainer, or
the daemon, in the middle of the daemon's step.
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from infinity.daemon.catalog import Catalog, Version
from infinity.daemon.jobs import Job, start_job
from infinity.daemon.loop import EventLoop
from infinity.daemon.namespaces import Namespaces
from infinity.daemon.services.adam_pieces import (GRAD, Prepared, PiecePlan, PieceStepper,
                                                  PutBack, plan_pieces, tier_too_small)
from infinity.daemon.services.base import DaemonCounters, Deferred, Routes
from infinity.daemon.sessions import DAEMON_CLIENT_ID, Session
from infinity.daemon.tasks import LoopTaskPool
from infinity.daemon.tiers import TierManager
from infinity.errors import InfinityError, InvalidRequestError, ProtocolError, TierFullError
from infinity.protocol import wire

log = logging.getLogger("infinityd")

ADAM_DTYPES = ("float32", "bfloat16", "float16")
CHUNK_ELEMENTS = 1 << 18  # a thread's share of one item: large enough to stream, small to balance


@dataclass(eq=False)
class _Item:
    """One parameter's step in flight."""

    index: int
    item: wire.AdamItem
    group: wire.AdamGroup
    lease_id: int = 0
    versions: list[Version] = field(default_factory=list)  # param, grad, exp_avg, exp_avg_sq[, master]
    error: InfinityError | None = None
    nbytes: int = 0  # what it holds of the window: its tensors, or its staging when in pieces
    plan: PiecePlan | None = None  # stepped in pieces (larger than the window)
    guess: "_Speculation | None" = None  # a speculative step's results it installs instead
    unguessed: bool = False  # speculative, not guessed (all in the CPU tier, or a small window)


@dataclass(eq=False)
class _Speculation:
    """A speculative step's results for one parameter, not published."""

    item: wire.AdamItem
    group: wire.AdamGroup
    versions: list[Version]
    edits: list[int]  # each version's `edits` when the guess leased it
    prepared: Prepared


@dataclass(eq=False)
class _Step:
    """One step of a trainer: its requests (parts), applied all or none, and its record."""

    session: Session
    step_id: int
    parts: int
    jobs: dict[int, "_Job"] = field(default_factory=dict)  # by part
    record: tuple[str, str, bytes] | None = None  # (namespace, tensor name, bytes)
    error: InfinityError | None = None  # a part was refused: every item answers it
    namespaces: frozenset[str] = frozenset()
    items_left: int = 0
    committing: bool = False

    def last(self) -> "_Job":
        return self.jobs[self.parts - 1]


@dataclass(eq=False)
class _Job:
    """One adam_step request: its items and which of them are not started yet."""

    session: Session
    namespace: str
    items: list[_Item]
    deferred: Deferred
    step: _Step
    speculative: bool = False
    next: int = 0
    queued: bool = False  # in the service's queue: it has items to start
    retry: list[_Item] = field(default_factory=list)  # put back: the tier was full of our own

    def has_more(self) -> bool:
        return bool(self.retry) or self.next < len(self.items)


class OptimizerService:
    """Runs `adam_step` requests: the task pool runs the kernels, loop callbacks the rest."""

    def __init__(self, loop: EventLoop, catalog: Catalog, tiers: TierManager,
                 counters: DaemonCounters, namespaces: Namespaces, tasks: LoopTaskPool, *,
                 cpu_tier_bytes: int, item_delay_s: float = 0.0) -> None:
        self.loop = loop
        self.catalog = catalog
        self.tiers = tiers
        self.counters = counters
        self.namespaces = namespaces
        self.tasks = tasks
        self.window_bytes = max(1, cpu_tier_bytes // 4)
        self.pieces_from_bytes = max(1, cpu_tier_bytes // 2)  # items stepped in pieces
        self.queue: deque[_Job] = deque()  # requests with items to start, oldest first
        self.in_flight_bytes = 0           # leased by the items under way, every request's
        self.running = 0                   # items under way
        self._starting = False             # in _start_more (an item failing at once re-enters)
        self.closing = False
        # Steps whose parts are not all here yet, by (session id, step id); steps queued whose
        # commit has not come yet, in the order their last part arrived.
        self.assembling: dict[tuple[int, int], _Step] = {}
        self.unsettled: list[_Step] = []
        self.item_delay_s = item_delay_s  # daemon.debug_step_delay_s
        self._delay_until = 0.0
        self.records = 0        # step records written
        self.steps = 0          # items stepped
        self.elements = 0       # parameters stepped
        self.requeued = 0       # items started again after the tier filled up
        self.pieces = PieceStepper(catalog, tiers, tasks)  # items larger than the window
        # Speculative steps' results by (session id, namespace, parameter name).
        self.speculations: dict[tuple[int, str, str], _Speculation] = {}
        self.guessed = 0        # items a speculative step prepared
        self.guesses_used = 0   # installed by the step that followed
        self.guesses_wasted = 0  # freed: something differed, or replaced by a newer guess

    def routes(self) -> Routes:
        return {wire.AdamStep: self.adam_step}

    def close(self) -> None:
        self.closing = True  # the pool (the daemon's) finishes the steps under way as it closes

    def stats(self) -> dict[str, Any]:
        return {"items_stepped": self.steps, "parameters_stepped": self.elements,
                "items_requeued": self.requeued, "window_bytes": self.window_bytes,
                "items_running": self.running, "requests_queued": len(self.queue),
                "steps_assembling": len(self.assembling), "steps_unsettled": len(self.unsettled),
                "records_written": self.records, "items_in_pieces": self.pieces.items,
                "pieces_stepped": self.pieces.pieces,
                "piece_bytes_read": self.pieces.bytes_read,
                "piece_bytes_written": self.pieces.bytes_written,
                "speculated_items": self.guessed, "speculations_used": self.guesses_used,
                "speculations_wasted": self.guesses_wasted,
                "speculations_held": len(self.speculations),
                "num_threads": self.tasks.pool.num_threads}

    # --- a request -----------------------------------------------------------------------

    def adam_step(self, session: Session, request_id: int, message: wire.AdamStep) -> Deferred:
        key = (session.id, message.step_id)
        step = self.assembling.get(key) if message.step_id else None
        if step is None:
            step = _Step(session, message.step_id, message.parts)
        elif step.parts != message.parts or message.part in step.jobs:
            raise ProtocolError(f"adam_step: part {message.part} of {message.parts} of step "
                                f"{message.step_id} does not fit the parts received; number a "
                                f"step's parts 0 .. parts - 1, each once")
        try:
            self.namespaces.require_writable(session, message.namespace)  # a step writes
        except InfinityError as exc:
            # The parts already here must be answered too. Kept without its traceback, which
            # holds this frame, which holds `step`: a cycle per refused step otherwise.
            step.error = step.error or exc.with_traceback(None)
        last = message.part == message.parts - 1
        results: list[Any] = [None] * (len(message.items) + bool(message.record_name))
        self.counters.deferred_replies += 1
        # One piece per item, one settled below once all started, and on the last part one
        # settled by the step's commit.
        deferred = Deferred(results, len(message.items) + 1 + last)
        job = _Job(session, message.namespace,
                   [_Item(i, item, message.groups[item.group])
                    for i, item in enumerate(message.items)], deferred, step,
                   speculative=message.speculative)
        step.jobs[message.part] = job
        if message.record_name:
            step.record = (message.namespace, message.record_name, message.record)
        if len(step.jobs) < step.parts:
            self.assembling[key] = step
        else:
            self.assembling.pop(key, None)
            self._begin_step(step)
        deferred.settle()
        return deferred

    def client_gone(self, session: Session) -> str | None:
        """A trainer gone before sending all of a step: none of that step is applied."""
        dropped = [key for key in self.assembling if key[0] == session.id]
        for key in dropped:
            self.assembling.pop(key).jobs.clear()  # no cycle left behind (see `_committed`)
        guesses = [guess for guess in self.speculations if guess[0] == session.id]
        for guess in guesses:
            self._waste(self.speculations.pop(guess))
        said = [f"{len(dropped)} optimizer step(s) not all sent, dropped"] if dropped else []
        if guesses:
            said.append(f"{len(guesses)} speculative step result(s) freed")
        return "; ".join(said) or None

    def _begin_step(self, step: _Step) -> None:
        """Every part is here: queue the step's items in the order of its parts."""
        if step.error is not None:
            self._refuse(step, step.error)
            return
        step.namespaces = frozenset(job.namespace for job in step.jobs.values())
        step.items_left = sum(len(job.items) for job in step.jobs.values())
        self.unsettled.append(step)
        for part in range(step.parts):
            job = step.jobs[part]
            if job.items:
                job.queued = True
                self.queue.append(job)
        self._start_more()
        self._commit_ready()

    def _refuse(self, step: _Step, error: InfinityError) -> None:
        """Answer every item of a step (and its record) with the error one part met."""
        for job in step.jobs.values():
            results = job.deferred.results
            for index in range(len(results)):
                results[index] = self.counters.item_error(job.session, error)
            for _ in range(len(job.items) + (job is step.last())):
                job.deferred.settle()
        step.jobs.clear()  # answered: see `_committed`

    # --- a step's commit -----------------------------------------------------------------

    def _commit_ready(self) -> None:
        """Commit each step whose items are done and that no earlier step sharing one of its
        namespaces is still ahead of."""
        blocked: set[str] = set()
        for step in list(self.unsettled):
            ready = not step.items_left and not step.committing and not step.namespaces & blocked
            blocked |= step.namespaces
            if ready:
                step.committing = True
                self._commit(step)

    def _commit(self, step: _Step) -> None:
        if step.record is None:
            self._committed(step, None)
            return

        def written(outcome: Future[None]) -> None:
            self._committed(step, outcome.exception())

        start_job(self.loop, self._write_record(*step.record),
                  name=f"record of step {step.step_id}").add_done_callback(written)

    def _write_record(self, namespace: str, name: str, data: bytes) -> Job[None]:
        """Write `data` at the start of the stored uint8 tensor `name`, in place."""
        lease_id = self.catalog.internal_lease_id()
        _, outcomes = self.catalog.acquire(DAEMON_CLIENT_ID, lease_id, [(namespace, name, True)])
        version = outcomes[0]
        if isinstance(version, InfinityError):
            raise version  # nothing was leased
        try:
            if version.dtype != "uint8" or version.nbytes < len(data):
                raise InvalidRequestError(
                    f"the step's record {name!r} is {version.dtype} of {version.nbytes} bytes; "
                    f"it must be a uint8 tensor of at least {len(data)} bytes")
            if version.cpu is None:
                yield self._resident(version)
            self.catalog.handed_out(DAEMON_CLIENT_ID, version)  # written in place
            ctypes.memmove(self.tiers.address_of(version.cpu), data, len(data))  # type: ignore[arg-type]
            self.records += 1
        finally:
            self.catalog.release(DAEMON_CLIENT_ID, lease_id)

    def _committed(self, step: _Step, error: BaseException | None) -> None:
        self.unsettled.remove(step)
        job = step.last()
        if error is not None:
            if not isinstance(error, InfinityError):
                log.exception("writing the record of a step failed", exc_info=error)
                error = InfinityError(f"infinityd failed to write the step's record "
                                      f"({type(error).__name__}: {error}); see its log")
            job.deferred.results[len(job.items)] = self.counters.item_error(job.session, error)
        job.deferred.settle()
        # A step and its jobs refer to each other: let go of them now, or every step would be
        # a reference cycle that only the daemon's rare full collections free.
        step.jobs.clear()
        self._commit_ready()

    def _debug_delay(self) -> Future[None]:
        """Done `item_delay_s` after the previous item's delay ended (items wait in turn)."""
        now = time.monotonic()
        self._delay_until = max(now, self._delay_until) + self.item_delay_s
        future: Future[None] = Future()
        self.loop.call_later(self._delay_until - now, lambda: future.set_result(None))
        return future

    def _start_more(self) -> None:
        """Start items, the oldest request's first and each request's in order, while the
        window has room (always at least one item runs); items put back because the tier was
        full go first within their request."""
        if self._starting:
            return  # an item that failed at once, inside the loop below: the loop goes on
        self._starting = True
        try:
            while self.queue and (self.running == 0 or self.in_flight_bytes < self.window_bytes):
                job = self.queue[0]
                if not job.has_more():
                    job.queued = False
                    self.queue.popleft()
                    continue
                if job.retry:
                    item = job.retry.pop(0)
                else:
                    item = job.items[job.next]
                    job.next += 1
                self.running += 1
                self._begin(job, item)
        finally:
            self._starting = False

    def _begin(self, job: _Job, item: _Item) -> None:
        """Lease the item's tensors now (so the window counts them before the next item
        starts), then run the rest of its step as a job."""
        try:
            self._lease(job, item)
        except InfinityError as exc:
            # Without its traceback: `_lease` raised it from its own results, so its frame in
            # the traceback holds it, a reference cycle per refused item otherwise.
            self._finish(job, item, exc.with_traceback(None))
            return

        def ended(outcome: Future[str]) -> None:  # on the loop thread, as the job ran there
            self._ended(job, item, outcome)

        start_job(self.loop, self._step_one(job, item), name=f"adam step of {item.item.param!r}"
                  ).add_done_callback(ended)

    def _lease(self, job: _Job, item: _Item) -> None:
        """Lease the tensors as the daemon: exclusive what is written, shared the gradient (a
        speculative step: all shared, as it writes none of them)."""
        ns, names = job.namespace, item.item
        writes = not job.speculative
        wanted = [(ns, names.param, writes), (ns, names.grad, False), (ns, names.exp_avg, writes),
                  (ns, names.exp_avg_sq, writes)]
        if names.master:
            wanted.append((ns, names.master, writes))
        item.lease_id = self.catalog.internal_lease_id()
        _, outcomes = self.catalog.acquire(DAEMON_CLIENT_ID, item.lease_id, wanted)
        item.versions = [o for o in outcomes if isinstance(o, Version)]
        for outcome in outcomes:
            if isinstance(outcome, InfinityError):
                raise outcome
        self._check(item)
        if job.speculative:
            if self.tiers.nvme is None:
                raise InvalidRequestError(
                    "a speculative adam_step needs an NVMe tier (its results wait there until "
                    "the step); this daemon has none, so send plain steps only")
            if all(v.cpu is not None or not v.nbytes for v in item.versions):
                # The step will run in place in memory, with no I/O to overlap: a guess would
                # only move the results to NVMe.
                item.unguessed = True
                return
            # Always in pieces: its results go to fresh extents, the versions stay as they are.
            plan = plan_pieces(item.versions, _numel(item.versions[0]), self.window_bytes)
            if plan.staging_bytes > self.window_bytes:
                # Even one set of one block of each tensor is more than the window (a small
                # tier): a guess would take the trainer's room; the step computes it.
                item.unguessed = True
                return
            item.plan = plan
            item.nbytes = plan.staging_bytes
            self.in_flight_bytes += item.nbytes
            return
        guess = self.speculations.pop((job.session.id, ns, names.param), None)
        if guess is not None:
            if self._guessed_right(guess, item):
                item.guess = guess  # installed by `_step_one`: nothing to hold of the window
                return
            self._waste(guess)
        item.nbytes = sum(v.nbytes for v in item.versions)
        # Only where the whole item could not sit in half the tier: below that the whole-item
        # path (loads put back while the tier is full) served before, and the pieces' staging
        # met TierFullError beside a trainer's leases in an 8 MiB tier (tests/test_torch_optim.py).
        if item.nbytes > self.pieces_from_bytes and any(v.cpu is None and v.nbytes
                                                        for v in item.versions):
            # Larger than the window and not all in the CPU tier: in pieces, holding only
            # staging slices of the window (see infinity.daemon.services.adam_pieces).
            item.plan = plan_pieces(item.versions, _numel(item.versions[0]), self.window_bytes)
            item.nbytes = item.plan.staging_bytes
        self.in_flight_bytes += item.nbytes

    def _step_one(self, job: _Job, item: _Item) -> Job[str]:
        """The rest of one parameter's step once leased, its stages in order: load, compute.
        Returns "done", or "put back" when the tier was too full of this step's other items to
        load it now."""
        if item.guess is not None:
            self.pieces.install(item.guess.prepared, item.versions)
            self.guesses_used += 1
            return "done"
        if item.unguessed:
            return "done"
        if item.plan is not None:
            try:
                prepared = yield from self.pieces.run(
                    item.plan, item.versions, item.group, item.item.step,
                    others_running=lambda: self.running > 1,
                    delay=lambda: self._debug_delay() if self.item_delay_s else None,
                    stopping=self._stopping, publish=not job.speculative)
            except PutBack:
                return "put back"
            if prepared is not None:
                self._keep_guess(job, item, prepared)
            return "done"
        # Bring what is only on NVMe into the CPU tier.
        loads = [self._resident(v) for v in item.versions if v.cpu is None and v.nbytes]
        if loads:
            try:
                yield loads
            except TierFullError as exc:
                if self.running > 1:
                    return "put back"  # other items of steps hold the tier: after them
                raise tier_too_small(exc, item.versions[0],
                                     sum(v.nbytes for v in item.versions)) from None
        if self.item_delay_s:
            yield self._debug_delay()
        stopping = self._stopping()
        if stopping is not None:
            raise stopping
        # The arithmetic, on the native task pool: the fp32 values (the master copy when
        # there is one) and both moments in place, the parameter's own dtype written alongside.
        for version in item.versions[:1] + item.versions[2:]:
            self.catalog.handed_out(DAEMON_CLIENT_ID, version)  # written in place from now on
        param, grad, avg, avg_sq, *rest = item.versions
        master = rest[0] if rest else None
        numel = _numel(param)
        if numel:
            address, group = self.tiers.address_of, item.group
            target = master if master is not None else param
            yield self.tasks.pool.submit_adam(
                param=address(target.cpu), grad=address(grad.cpu), grad_dtype=grad.dtype,  # type: ignore[arg-type]
                exp_avg=address(avg.cpu), exp_avg_sq=address(avg_sq.cpu), numel=numel,  # type: ignore[arg-type]
                lr=group.lr, beta1=group.beta1, beta2=group.beta2, eps=group.eps,
                weight_decay=group.weight_decay, step=item.item.step, decoupled=group.decoupled,
                grad_scale=group.grad_scale,
                low=address(param.cpu) if master is not None else 0,  # type: ignore[arg-type]
                low_dtype=param.dtype if master is not None else "none",
                chunk_elements=CHUNK_ELEMENTS)
        return "done"

    # --- speculative steps ------------------------------------------------------------------

    def _keep_guess(self, job: _Job, item: _Item, prepared: Prepared) -> None:
        key = (job.session.id, job.namespace, item.item.param)
        older = self.speculations.pop(key, None)
        if older is not None:
            self._waste(older)
        if not job.session.alive:
            self.pieces.discard(prepared)  # no step of this session can install it
            return
        self.speculations[key] = _Speculation(item.item, item.group, list(item.versions),
                                              [v.edits for v in item.versions], prepared)
        self.guessed += 1

    def _guessed_right(self, guess: _Speculation, item: _Item) -> bool:
        """Whether `guess` holds this item's results: the same names, hyperparameters and step
        number, made from the versions just leased, none of them written since. The item's
        own exclusive leases (all but the gradient's) each added one to `edits` just now."""
        if guess.item != item.item or guess.group != item.group:
            return False
        if len(guess.versions) != len(item.versions):
            return False
        for index, (then, now) in enumerate(zip(guess.versions, item.versions)):
            own = 0 if index == GRAD else 1
            if then is not now or not now.current or now.edits != guess.edits[index] + own:
                return False
        return True

    def _waste(self, guess: _Speculation) -> None:
        self.pieces.discard(guess.prepared)
        self.guesses_wasted += 1

    def _stopping(self) -> InfinityError | None:
        if not self.closing:
            return None
        return InvalidRequestError("infinityd is stopping; the step was not applied to this "
                                   "parameter")

    def _resident(self, version: Version) -> Future[None]:
        """A future of the version's bytes being in the CPU tier (its load from NVMe done)."""
        future: Future[None] = Future()

        def loaded(error: InfinityError | None) -> None:
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

        try:
            if self.tiers.ensure_resident(version, loaded):
                future.set_result(None)
        except InfinityError as exc:
            future.set_exception(exc)
        return future

    def _ended(self, job: _Job, item: _Item, outcome: Future[str]) -> None:
        error = outcome.exception()
        if error is None and outcome.result() == "put back":
            self._put_back(job, item)
            self._start_more()
            return
        if error is None and job.speculative:
            pass  # prepared, not stepped: counted when a step installs it
        elif error is None:
            numel = _numel(item.versions[0])
            self.steps += 1
            self.elements += numel
            job.session.counters.optimizer_items += 1
            job.session.counters.optimizer_parameters += numel
        elif not isinstance(error, InfinityError):
            log.exception("the optimizer step of %r failed", item.item.param, exc_info=error)
            error = InfinityError(f"infinityd failed on the step of parameter "
                                  f"{item.item.param!r} ({type(error).__name__}: {error}); see "
                                  f"its log")
        self._finish(job, item, error)

    def _put_back(self, job: _Job, item: _Item) -> None:
        """The tier is full while other items hold it: give this one's lease back and start it
        again, first of its request, once one of them is done (and keep the window below what
        it had)."""
        self.catalog.release(DAEMON_CLIENT_ID, item.lease_id)
        self.window_bytes = max(1, min(self.window_bytes, self.in_flight_bytes - item.nbytes))
        self.in_flight_bytes -= item.nbytes
        self.running -= 1
        item.error, item.nbytes, item.versions, item.plan = None, 0, [], None
        job.retry.append(item)
        if not job.queued:  # its last items had started: it goes first again
            job.queued = True
            self.queue.appendleft(job)
        self.requeued += 1

    def _check(self, item: _Item) -> None:
        param, grad, avg, avg_sq, *rest = item.versions
        master = rest[0] if rest else None
        numel = _numel(param)
        described = f"parameter {item.item.param!r}"
        for version, role in ((grad, "gradient"), (avg, "exp_avg"), (avg_sq, "exp_avg_sq"),
                              (master, "master copy")):
            if version is not None and _numel(version) != numel:
                raise InvalidRequestError(
                    f"the {role} of {described} has {_numel(version)} elements, the parameter "
                    f"{numel}; each must match the parameter's shape")
        if param.dtype not in ADAM_DTYPES or grad.dtype not in ADAM_DTYPES:
            raise InvalidRequestError(
                f"{described} is {param.dtype} with a {grad.dtype} gradient; the optimizer steps "
                f"float32, bfloat16 and float16 tensors")
        for version, role in ((avg, "exp_avg"), (avg_sq, "exp_avg_sq"), (master, "master copy")):
            if version is not None and version.dtype != "float32":
                raise InvalidRequestError(f"the {role} of {described} is {version.dtype}; it "
                                          f"must be float32")
        if master is None and param.dtype != "float32":
            raise InvalidRequestError(
                f"{described} is {param.dtype} and has no float32 master copy; name one (the "
                f"optimizer keeps it), or keep the parameter in float32")

    def _finish(self, job: _Job, item: _Item, error: InfinityError | None) -> None:
        try:
            self.catalog.release(DAEMON_CLIENT_ID, item.lease_id)
        except InfinityError:
            pass  # nothing was leased (every item failed to lease)
        if error is not None:
            job.deferred.results[item.index] = self.counters.item_error(job.session, error)
        self.in_flight_bytes -= item.nbytes
        self.running -= 1
        job.deferred.settle()
        job.step.items_left -= 1
        if not job.step.items_left:
            self._commit_ready()
        self._start_more()


def _numel(version: Version) -> int:
    count = 1
    for size in version.shape:
        count *= size
    return count

