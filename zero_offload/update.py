"""The schedules of the CPU step: one bucket's journey at ``step()`` (:func:`update_bucket`: wait for its
gradients, run its rule (:mod:`zero_offload.apply`), show new state entries, send it back), and when each bucket's
update runs (:class:`Immediate`, the default; :class:`Overlap`, during backward; :class:`Delayed`, during the next
forward and backward). The optimizer picks one at construction.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Sequence, Tuple

import torch

from zero_offload import functional, gate
from zero_offload.apply import run_rule, touched
from zero_offload.buckets import FlatBucket
from zero_offload.checkpoint import Ahead, expose
from zero_offload.gate import Decision
from zero_offload.lane import Intake, Lane, Plans
from zero_offload.state.layout import view_like
from zero_offload.timeline import NOTHING
from zero_offload.transport import Transport

__all__ = ["Delayed", "Immediate", "Overlap", "ensure_buffers", "on_device_first", "preview_bucket",
           "update_bucket"]

logger = logging.getLogger("zero_offload")

State = MutableMapping[torch.Tensor, Dict[str, torch.Tensor]]


def ensure_buffers(state: State, bucket: FlatBucket, hyper: Any, needed: Optional[Sequence[Any]] = None) -> None:
    """A group's hyperparameters need state buffers its bucket lacks (amsgrad switched on since it was built):
    allocate them, show them in the state. ``needed``: ``bucket.rule.needed(hyper)``, where the caller has it (one
    look-up for a group's buckets); the bucket's home keeps it for the update (:meth:`Home.use`)."""
    needed = bucket.rule.needed(hyper) if needed is None else needed
    bucket.home.use(hyper, needed)
    if bucket.ensure_buffers(needed):
        expose(state, bucket, [i for i in range(len(bucket.params)) if bucket.exposed[i]])


def _ensure_buffers(state: State, hypers: Sequence[Any], plans: Plans) -> None:
    for hyper, intakes in zip(hypers, plans):
        needed = intakes[0].bucket.rule.needed(hyper) if intakes else ()  # (one rule for every bucket)
        for intake in intakes:
            ensure_buffers(state, intake.bucket, hyper, needed)


class _Seen:
    """The hyperparameters whose buffers every bucket already has: buffers are only ever added (amsgrad switched
    on), so the same hyperparameters need no new look."""

    __slots__ = ("hypers",)

    def __init__(self) -> None:
        self.hypers: Optional[List[Any]] = None


def on_device_first(hypers: Sequence[Any], plans: Plans, arrivals: Sequence[Lane]) -> List[Tuple[Any, Intake]]:
    """Each intake of ``plans`` with its group's hyperparameters, those of the buckets stepped on a GPU first: their
    updates are only launched there, and the GPU runs them while the host updates the others. Among those, in the
    order backward sent them (``arrivals``; the rest after): a parked bucket's state goes back down in that order, so
    the next backward's first reloads find theirs landed."""
    pairs = [(h, intake) for h, intakes in zip(hypers, plans) for intake in intakes]
    sent = {lane: k for k, lane in enumerate(arrivals)}
    gpu = sorted((p for p in pairs if p[1].bucket.home.on_device), key=lambda p: sent.get(p[1].lane, len(sent)))
    return gpu + [p for p in pairs if not p[1].bucket.home.on_device]


def update_bucket(transport: Transport, lane: Lane, present: Sequence[bool],
                  in_place: Optional[List[Optional[torch.Tensor]]], h: Any, multiplier: float, state: State, *,
                  grad: Optional[torch.Tensor] = None, scatter: bool = True) -> Optional[List[int]]:
    """Update the bucket's parameters that have a gradient (``present``), reading it from ``grad`` (default: the
    bucket's gradient buffer) or ``in_place``: wait for the gradients, bring the state to where its home steps it,
    run the rule, put the state back, show new state entries, and with ``scatter`` send the results to the
    parameters. Returns the indices updated (None: none)."""
    bucket = lane.bucket
    runs = bucket.runs(present)
    if not runs:
        return None
    if grad is None and lane.channel.unsettled:
        # (A delayed update's ``grad`` was waited for at its step(); its bucket's copy event may meanwhile have
        # been recorded again by the next backward, which this must not wait for.)
        lane.route.wait(lane)
    tl = transport.timeline
    lane.channel.up.wait(tl, "h2d", lane.position, query=True)  # the last upload may still read master/staging
    indices = touched(bucket, runs)
    home = bucket.home
    home.bring(transport.streams, tl, lane.position)
    home.refresh(indices)
    # (An update stepped on a GPU is only launched here: the span is the host's part; the GPU runs it later.)
    with NOTHING if tl is None else tl.span("kernel", "gpu launch" if home.on_device else "step", lane.position):
        run_rule(bucket, runs, grad, in_place, h, multiplier)
    bucket.count_steps(runs)
    gained = [i for i in home.hold(indices, bucket.rule, h) if bucket.exposed[i]]  # (amsgrad's buffer, once)
    if not bucket.all_exposed:
        expose(state, bucket, [i for i in indices if not bucket.exposed[i]])
    if gained:
        expose(state, bucket, gained)
    if scatter:  # (before the state goes back: a parameter not bound to its slot may read the master's device copy)
        transport.send_params(lane, indices)
    home.put_back(transport.streams, tl, lane.position)
    return list(indices)


def preview_bucket(bucket: FlatBucket, present: Sequence[bool], h: Any, multiplier: float, *,
                   grad: torch.Tensor) -> Optional[Ahead]:
    """What :func:`update_bucket` would leave in a CPU bucket, computed into copies of its buffers (the bucket,
    its parameters and their recorded versions are left as they are): the state a delayed update will have."""
    runs = bucket.runs(present)
    if not runs:
        return None
    copies = bucket.home.copies()
    flat = copies[0]
    indices = list(touched(bucket, runs))
    bucket.home.refresh(indices, into=[view_like(flat["master"], o, p)
                                       for o, p in zip(bucket.layout.offsets, bucket.params)])
    run_rule(bucket, runs, grad, None, h, multiplier, copies)
    if bucket.compact:  # saved as fp32, as state_dict() does
        for name in bucket.home.names:
            flat[name] = bucket.home.to_fp32(name, flat[name], copies[1].get(name))
    steps = bucket.steps.clone()
    for first, last, _ in runs:
        steps[first : last + 1] += 1
    return Ahead(set(indices), steps, flat, tuple(b.name for b in bucket.rule.needed(h) if b.optional))


class _Worker(ThreadPoolExecutor):
    """One thread (started at the first job): buckets are updated in submission order, each with the kernel's own
    intra-op parallelism (the kernel releases the GIL)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="zero_offload_step")


class Immediate:
    """The default schedule: ``step()`` updates every bucket, sending each back while the next is updated.

    A schedule's hooks (here they do nothing): :meth:`before_send` and :meth:`after_send` around each send from
    backward, :meth:`settle` as ``step()`` begins, :meth:`check_received` once the gradients are received,
    :meth:`end_step` when the step is over. What a schedule keeps of a bucket's step (an update in flight) it keeps
    itself, by lane.
    """

    def __init__(self, transport: Transport):
        self.transport = transport
        self._seen = _Seen()

    def before_send(self, lane: Lane) -> None:
        """The backward hooks are about to send a bucket's gradients (an update of it may be in flight)."""

    def after_send(self, lane: Lane) -> None:
        """The backward hooks have sent a bucket's gradients on their way."""

    def settle(self) -> None:
        """``step()`` has begun: wait for updates started during backward (re-raising the first failure)."""

    def check_received(self, plans: Plans) -> None:
        """Refuse what this schedule cannot take of what ``step()`` received (a gradient edited after its bucket
        was already updated)."""

    def end_step(self, stepped: bool) -> None:
        """The step is over (``stepped``: ``step()`` ran, whatever its outcome) or abandoned (``zero_grad()``),
        before the transport ends every lane's step."""

    def ensure(self, hypers: Sequence[Any], plans: Plans, state: State) -> None:
        """Every bucket has the state buffers its group's hyperparameters need (looked at when they change)."""
        if hypers != self._seen.hypers:
            _ensure_buffers(state, hypers, plans)
            self._seen.hypers = list(hypers)

    def check_scaler(self) -> None:
        """Refuse a GradScaler if this schedule cannot wait for its inf check."""

    def updated(self, lane: Lane) -> bool:
        """Whether the bucket's update for this step has already run."""
        return False

    def check_load(self) -> None:
        """Refuse to replace the state now, if this schedule has already applied part of this step from the
        state being replaced (before anything changes)."""

    def run(self, decision: Decision, hypers: Sequence[Any], plans: Plans, state: State) -> None:
        """Update every bucket of ``plans`` not yet updated with ``decision``'s multiplier, and send the results
        back."""
        self.ensure(hypers, plans, state)
        lanes = [intake.lane for group in plans for intake in group]
        # (Traced steps keep each kernel inside its own span.)
        queue = self.transport.timeline is None and not any(lane.route.upload_reads for lane in lanes)
        with functional.queued_updates() if queue else NOTHING:
            for hyper, intake in on_device_first(hypers, plans, self.transport.arrivals):
                if not self.updated(intake.lane):
                    update_bucket(self.transport, intake.lane, intake.present, intake.in_place, hyper,
                                  decision.multiplier, state)
        self.transport.finish_params(lanes)  # sharded: the all-gathers, each overlapped with the next update

    def flush(self, state: State) -> None:
        """Apply any update still pending."""

    def ahead(self) -> Dict[FlatBucket, Ahead]:
        """The state any pending update will leave, by bucket, without applying it (for saving)."""
        return {}

    def drop(self) -> None:
        """Discard any update still pending (the state is about to be replaced)."""


class Overlap(Immediate):
    """``overlap_step``: each bucket's update runs in a worker thread as soon as
    backward has sent its gradients, with the hyperparameters as they are then (what ``step()`` would read);
    ``step()`` only updates the buckets backward did not launch, and waits.

    Args:
        transport (Transport): the optimizer's transport.
        early_update (Callable[[Lane], None]): runs one bucket's update.
    """

    def __init__(self, transport: Transport, early_update: Callable[[Lane], None]):
        super().__init__(transport)
        self._early_update = early_update
        self._worker = _Worker()
        self._jobs: Dict[Lane, Future] = {}  # this step's updates launched in backward, in launch order
        self._raised = False  # settle() has raised a job's failure this step

    def before_send(self, lane: Lane) -> None:
        if lane in self._jobs:
            raise RuntimeError(
                "OffloadOptimizer(overlap_step=True): a second backward before step() reached a bucket that was "
                "already updated. Run every micro-batch but the last under `with optimizer.no_sync():`."
            )

    def after_send(self, lane: Lane) -> None:
        self._jobs[lane] = self._worker.submit(self._early_update, lane)

    def settle(self) -> None:
        for job in list(self._jobs.values()):
            if job.exception() is not None:
                self._raised = True
            job.result()

    def check_received(self, plans: Plans) -> None:
        if any(self.updated(intake.lane) and any(g is not None for g in intake.pending)
               for intakes in plans for intake in intakes):
            raise RuntimeError(
                "OffloadOptimizer(overlap_step=True): a gradient was assigned or changed in place after "
                "backward (by clipping or unscaling?), but its bucket was already updated during "
                "backward. With overlap_step, clip with optimizer.clip_grad_norm_ is not possible either: "
                "turn overlap_step off to clip or to use a GradScaler."
            )

    def check_scaler(self) -> None:
        raise gate.refuse_overlap_scaler()

    def updated(self, lane: Lane) -> bool:
        return lane in self._jobs

    def check_load(self) -> None:
        if self._jobs:
            raise RuntimeError(
                "OffloadOptimizer(overlap_step=True): load_state_dict() after backward, but this step's update "
                "already ran during backward, from the state being replaced, and its parameters were written. "
                "Load before backward (or after step()), or turn overlap_step off."
            )

    def end_step(self, stepped: bool) -> None:
        jobs, self._jobs = self._jobs, {}
        raised, self._raised = self._raised, False
        if jobs and not stepped:  # (zero_grad() after a backward, whole or interrupted, that updated some buckets)
            _warn_abandoned(jobs)
        for job in jobs.values():
            if job.exception() is not None and not raised:  # (waits for the job) not yet seen by settle()
                job.result()


def _warn_abandoned(jobs: Dict[Lane, Future]) -> None:
    """A step left without ``step()`` (``zero_grad()`` after its backward, or after a backward that raised) whose
    buckets ``jobs`` were already updated during backward: say so, since AdamW skipping the step updates none."""
    names = sorted({lane.bucket.label(0) for lane in jobs})
    logger.warning("OffloadOptimizer(overlap_step=True): a step abandoned without step() (zero_grad() after its "
                   "backward, or after a backward that raised) had already updated %d bucket(s) during backward "
                   "(the first parameters of which: %s): they stepped on its gradients, the others did not. A loop "
                   "that skips steps (after an out-of-memory backward, say) needs overlap_step off to skip them "
                   "whole", len(jobs), "; ".join(names))


@dataclasses.dataclass
class _Pending:
    """A step's update held back by ``delayed_update``: ``run`` computes it; ``job`` is it running in the worker;
    ``work`` (lane, which parameters, hyperparameters) and ``multiplier`` are what it was given. While the next
    backward goes on (with ``stages``, under the schedule's lock): ``done``, the lanes whose kernel has run;
    ``sent``, those whose gradients that backward has sent; ``staged``, the device copies of their new parameters;
    ``closed``, set once ``step()`` takes them (nothing is staged after)."""

    run: Callable[[], List[Tuple[Lane, Optional[List[int]]]]]
    job: Optional[Future]
    work: List[Tuple[Lane, Sequence[bool], Any]]
    multiplier: float
    stages: bool = False  # run in the worker, for GPU buckets: their new parameters may go up before step()
    done: set = dataclasses.field(default_factory=set)
    sent: set = dataclasses.field(default_factory=set)
    staged: Dict[Lane, Any] = dataclasses.field(default_factory=dict)
    closed: bool = False


class Delayed(Immediate):
    """``delayed_update``, ZeRO-Offload's delayed parameter update: ``step()`` applies the *previous* step's update
    (sending its parameters back) and starts this step's from a second gradient buffer, in the worker thread while
    the next forward and backward run (with the model on CPU, at the next ``step()``: the parameters *are* the
    masters there). Hyperparameters, clipping and loss scaling of a step apply to its own gradients.

    On a GPU the new parameters go up during that backward, not at ``step()``: once a bucket's kernel has run *and*
    backward has sent the bucket's gradients (so the memory backward frees makes room),
    they are copied into a device buffer of the bucket's (:meth:`~zero_offload.transport.base.Route.stage`, where
    the device has room for it), and ``step()`` copies them into the parameters device to device. The parameters
    themselves change only at ``step()``, so a second micro-batch, or code between backward and ``step()``, still
    reads the old ones. A bucket without room is uploaded from the host at ``step()``, as before.

    ``exact_steps``: the updates that take a parameter's step count up to this many are applied before ``step()``
    returns, as without delay (counted from the state, so a resumed run goes on where it was)."""

    def __init__(self, transport: Transport, exact_steps: int = 0):
        super().__init__(transport)
        self._worker = _Worker()
        self._pending: Optional[_Pending] = None
        self._exact_steps = exact_steps
        self._lock = threading.Lock()  # the pending update's staging: the worker, backward's hooks, step()

    def run(self, decision: Decision, hypers: Sequence[Any], plans: Plans, state: State) -> None:
        self.flush(state)
        self.ensure(hypers, plans, state)
        work = []
        for hyper, intakes in zip(hypers, plans):
            for intake in intakes:
                if intake.in_place is not None:  # never for streamed buckets, which every bucket is here
                    raise AssertionError("delayed_update with gradients read in place")
                lane = intake.lane
                if lane.bucket.runs(intake.present):
                    lane.route.wait(lane)
                    lane.bucket.grads.swap()
                    work.append((lane, intake.present, hyper))
        transport, multiplier = self.transport, decision.multiplier

        def run() -> List[Tuple[Lane, Optional[List[int]]]]:
            out = []
            for lane, present, h in work:
                idx = update_bucket(transport, lane, present, None, h, multiplier, state,
                                    grad=lane.bucket.grad_prev, scatter=False)
                out.append((lane, idx))
                if idx is not None and pending.stages:
                    with self._lock:
                        pending.done.add(lane)
                        if lane in pending.sent:
                            self._stage(pending, lane)
            return out

        # Read before the worker starts on the step counts; only while a warm-up is asked for (a tensor read per
        # bucket per step otherwise).
        exact = bool(self._exact_steps and work) and max(float(lane.bucket.steps.max())
                                                         for lane, _, _ in work) < self._exact_steps
        on_gpu = any(not lane.bucket.on_cpu for lane, _, _ in work)
        pending = self._pending = _Pending(run, None, work, multiplier, stages=on_gpu)
        if on_gpu:
            pending.job = self._worker.submit(run)
        if exact:
            self.flush(state)

    def after_send(self, lane: Lane) -> None:
        """Backward sent the bucket's gradients: if the pending update of it has run, its new parameters go up."""
        pending = self._pending
        if pending is None or not pending.stages:
            return
        with self._lock:
            if pending.closed:
                return
            pending.sent.add(lane)
            if lane in pending.done:
                self._stage(pending, lane)

    def _stage(self, pending: _Pending, lane: Lane) -> None:
        """(Under the lock.) The lane's new parameters into its device buffer, once, where the device has room."""
        if pending.closed or lane in pending.staged:
            return
        staged = lane.route.stage(lane, lane.bucket.upload_flat, self.transport.lanes, "h2d delayed")
        if staged is not None:
            pending.staged[lane] = staged

    @staticmethod
    def _close(pending: _Pending) -> Dict[Lane, Any]:
        pending.closed = True
        staged, pending.staged = pending.staged, {}
        return staged

    def flush(self, state: State) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            done = [(lane, idx) for lane, idx in (pending.job.result() if pending.job is not None else pending.run())
                    if idx is not None]
        except BaseException:
            self._abandon(pending)
            raise
        with self._lock:
            staged = self._close(pending)
        lanes = [lane for lane, _ in done]
        try:
            self.transport.before_uploads(lanes)
            for lane, indices in done:
                copy = staged.pop(lane, None)
                self.transport.send_params(lane, indices, None if copy is None else copy.views)
                if copy is not None:
                    copy.release()  # (after the copy from it was enqueued on the upload stream, which alone uses it)
        finally:
            _give_back(staged)  # (what an upload that raised left)
        self.transport.finish_params(lanes)

    def end_step(self, stepped: bool) -> None:
        """A step that did not apply the pending update (skipped, refused, ``zero_grad()`` after backward): the
        device copies are given back, so that they do not take memory from the next forward; the next backward
        makes them again (or ``step()`` uploads from the host)."""
        pending = self._pending
        if pending is None or not pending.stages:
            return
        with self._lock:  # (the worker may still be running: what it finishes now waits for the next backward)
            staged, pending.staged = pending.staged, {}
            pending.sent.clear()
        _give_back(staged)

    def ahead(self) -> Dict[FlatBucket, Ahead]:
        """Saving must not change the run, so the pending update is neither applied early nor sent: on CUDA the
        worker writes it into the buffers anyway (waited for here; the parameters still get it at the next
        ``step()``); on the CPU, where the buffers are the parameters the next forward reads, it is computed into
        copies of each bucket's buffers."""
        pending = self._pending
        if pending is None:
            return {}
        if pending.job is not None:
            return {lane.bucket: Ahead(set(idx)) for lane, idx in pending.job.result() if idx is not None}
        out = {}
        for lane, present, hyper in pending.work:
            after = preview_bucket(lane.bucket, present, hyper, pending.multiplier, grad=lane.bucket.grad_prev)
            if after is not None:
                out[lane.bucket] = after
        return out

    def drop(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending.job is not None:
            try:
                pending.job.result()
            finally:
                self._abandon(pending)

    def _abandon(self, pending: _Pending) -> None:
        """The pending update will not be committed from its device copies: close it (nothing is staged after) and
        give them back."""
        with self._lock:
            _give_back(self._close(pending))


def _give_back(staged: Dict[Lane, Any]) -> None:
    """Device copies no commit will read: given back once their upload has read the host buffers."""
    for copy in staged.values():
        copy.done.synchronize()
        copy.release()
