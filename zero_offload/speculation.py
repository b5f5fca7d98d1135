"""Speculation with validation: each streamed bucket's update runs in a worker thread as soon as backward has sent
its gradients (in arrival order, while backward goes on), and ``step()`` keeps it only if it is exactly what
``step()`` would have computed; otherwise it is dropped and the step runs as without speculation.

**Exact by construction.** The kernel reads the bucket's state and writes the next state (master, moments, 8-bit
scales, the low-precision output) into spare buffers leased from the optimizer's pool (:mod:`zero_offload.undo`:
shared by the buckets of a step, under the ``speculation_memory`` cap; a bucket that finds no room there is updated
at ``step()``), with the hyperparameters and the gradient multiplier that ``step()`` is expected to use. The
bucket's own state is not touched, so ``opt.state``, ``state_dict()`` and the GPU parameters see only committed
values until ``step()``. Where the GPU has room, the new parameters are then copied up into a device buffer of
their own (a *speculative upload*: the PCIe copy overlaps backward; the parameters themselves are untouched).

At ``step()`` a bucket *commits* only if

* the multiplier ``step()`` computes (GradScaler's inverse scale times the clip coefficient) is bit-equal to the
  one the kernel used (without clipping, or with a coefficient of exactly 1.0, it is);
* the hyperparameters read at ``step()`` equal those read when the bucket was sent (an LR set between backward
  and ``step()`` does not);
* the step is not skipped or refused (a GradScaler's ``found_inf``, an inf/nan with ``nonfinite`` "skip" or
  "raise");
* its gradients are those the kernel read: none assigned, edited in place, re-read (``GradScaler.unscale_``) or
  sent again (a second backward without ``no_sync``) since; its step counts unchanged; and its parameters not
  changed on the GPU since the optimizer last wrote them (``p.mul_(0.5)``, ``model.load_state_dict``).

A commit trades memory between the bucket's buffers and the lease's (no byte copied: every view of the state,
``opt.state``'s and a checkpoint's included, reads the new state; see :func:`~zero_offload._compat.take_memory`),
bumps the step counts and makes the parameters the new ones: a device-to-device copy from the speculative upload,
or an upload from the host. Anything else *rolls back*: the lease (and the device buffer) are given back, nothing
else changes, and the bucket is updated at ``step()`` like any other. A rollback also happens where the step never
comes (``zero_grad()`` after backward), and when the state is edited or replaced between backward and ``step()``
(an assignment into ``opt.state``, an in-place write into one of its tensors, ``load_state_dict()``); reading it
(``state_dict()``) needs none.

Speculation stops for the rest of a step once a bucket's gradient norm is not finite (the step will be skipped or
refused, unless ``nonfinite="ignore"``) or the running norm already exceeds the last ``max_norm`` clipped with
(the step will clip): nothing to gain there. A rule that cannot write out of place (the generic rule of another
torch optimizer) is not speculated. See docs/speculation.md for the design, its costs and the model.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.apply import run_rule
from zero_offload.quantize import Q8_BLOCK, q8_scale_numel
from zero_offload.buckets import FlatBucket
from zero_offload.checkpoint import expose
from zero_offload.gate import Decision
from zero_offload.lane import Intake, Lane, Plans
from zero_offload.timeline import NOTHING
from zero_offload.transport import Transport
from zero_offload.undo import Lease, UndoPool
from zero_offload.update import Immediate, State, _Worker, on_device_first, update_bucket

__all__ = ["SCHEDULE", "SpeculationStats", "Speculative"]

# What this schedule costs, as the event model (benchmarks/step_model.py) reads it: the bytes per element a
# speculative kernel moves beyond the update's own (none: it writes out of place, no save copy), and whether the new
# parameters go up during backward (to a device buffer, where the GPU has room).
SCHEDULE = {"kernel_extra_bytes": 0, "uploads_in_backward": True}

logger = logging.getLogger("zero_offload")


@dataclasses.dataclass
class SpeculationStats:
    """Counts of what speculation did, over the optimizer's life (``OffloadOptimizer.speculation_stats``).

    Attributes:
        speculated (int): bucket updates run during backward.
        commits (int): of those, kept by ``step()``.
        rollbacks (int): of those, undone (the bucket then updated as without speculation).
        reasons (Counter[str]): rollbacks by reason: ``"multiplier"`` (clipping active, or the loss scale
            changed), ``"hyperparameters"``, ``"skipped step"`` (inf/nan or GradScaler overflow; also an error
            raised by ``step()``), ``"gradients changed"``, ``"steps changed"``, ``"parameters changed"`` (written
            on the GPU after backward), ``"state edited"`` (an ``opt.state`` tensor written in place),
            ``"state edited or replaced"`` (an ``opt.state`` entry assigned, ``load_state_dict()``), ``"no step"``
            (``zero_grad()`` after backward).
        not_started (Counter[str]): buckets sent but not speculated, by reason (``"stopped"``: an inf/nan or a
            norm over ``max_norm`` earlier in the step; ``"queued at step()"``: ``step()`` came first, the bucket
            is updated there; ``"masters refresh"``: a parameter was changed outside the optimizer;
            ``"sent again"``; ``"rule updates in place"``: a rule that cannot write out of place; ``"undo pool
            full"``: the bucket's spare buffers would take the pool over its cap (``speculation_memory``); ``"undo
            pool growing"``: they are not made yet (after the first speculating step the pool grows between steps,
            see :mod:`zero_offload.undo`); ``"host memory"``: the host could not spare twice the pool's growth...).
    """

    speculated: int = 0
    commits: int = 0
    rollbacks: int = 0
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    not_started: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass
class _Spec:
    """One bucket's speculative update in this step (kept by the schedule, by lane): what it was given, and what
    it did (``runs`` None: it did not run, for ``skipped``; ``lease``: its undo buffers, held while ``runs`` is not
    None)."""

    lane: Lane
    hyper: Any
    multiplier: float
    present: List[bool]
    names: Tuple[str, ...] = ()  # the state buffers the update writes (those ``hyper`` needs)
    staged: Optional[Any] = None  # its speculative upload (a transport.device.Staged), if the device had room
    job: Optional[Future] = None
    runs: Optional[List[Tuple[int, int, int]]] = None
    steps: Optional[torch.Tensor] = None
    versions: Tuple[int, ...] = ()  # the version counters of the state buffers the kernel read
    skipped: Optional[str] = None
    lease: Optional[Lease] = None


@dataclasses.dataclass
class _Round:
    """What speculation keeps of one step, begun afresh when the step ends: each bucket's speculative update (in
    arrival order), the buckets sent twice (not speculated), the inputs read by group, and whether speculation
    stopped for the rest of the step (with the squared norm of the buckets sent so far)."""

    specs: Dict[Lane, _Spec] = dataclasses.field(default_factory=dict)
    barred: Set[Lane] = dataclasses.field(default_factory=set)
    read: Dict[int, Tuple[Any, str]] = dataclasses.field(default_factory=dict)
    stopped: bool = False
    running_sq: float = 0.0


class Speculative(Immediate):
    """The speculating schedule (see the module docstring). Buckets on the CPU (whose parameters *are* the
    masters) and buckets not streamed are updated at ``step()`` as by :class:`Immediate`.

    Args:
        transport (Transport): the optimizer's transport (not sharded).
        inputs (Callable[[int], Tuple[Any, str]]): for a group index, the hyperparameters ``step()`` would read
            now and the ``nonfinite`` policy.
        memory (int, optional): the undo pool's cap in bytes (``speculation_memory``); None: learned.
            Default: None.
    """

    def __init__(self, transport: Transport, inputs: Callable[[int], Tuple[Any, str]],
                 memory: Optional[int] = None):
        super().__init__(transport)
        self._inputs = inputs
        self._worker = _Worker()
        self._round = _Round()
        self.pool = UndoPool(memory)
        # Buckets committed since the worker last took a lease whose upload read leased memory (the speculative
        # upload, or a low-precision output uploaded from the lease): that memory is reused after their h2d event.
        self._uploading: List[Lane] = []
        self._guess = 1.0  # the multiplier expected: the last step's loss-scale inverse
        self._max_norm: Optional[float] = None  # the last max_norm clipped with (2-norm)
        self._broken = False
        self.stats = SpeculationStats()

    # -- backward (the autograd thread) ----------------------------------------------------------------------
    def before_send(self, lane: Lane) -> None:
        spec = self._round.specs.get(lane)
        if spec is not None:  # a second backward (no ``no_sync``): the speculation read a partial gradient
            self._finish(spec)
            self._undo_spec(spec, "gradients changed")
            del self._round.specs[lane]
            self._round.barred.add(lane)

    def after_send(self, lane: Lane) -> None:
        if not lane.route.speculates or self._broken:
            return
        if not lane.bucket.rule.writes_out:
            self.stats.not_started["rule updates in place"] += 1
            return
        if lane in self._round.barred:
            self.stats.not_started["sent again"] += 1
            return
        read = self._round.read.get(lane.group)
        if read is None:  # read once per group and backward (step() checks it reads the same)
            try:
                read = self._round.read[lane.group] = self._inputs(lane.group)
            except Exception:  # (an invalid hyperparameter: step() refuses it; backward must not raise here)
                return
        spec = self._round.specs[lane] = _Spec(lane, read[0], self._guess, list(lane.arrival.sent))
        spec.job = self._worker.submit(self._speculate, spec)

    # -- the worker --------------------------------------------------------------------------------------------
    def _speculate(self, spec: _Spec) -> None:
        lane, transport = spec.lane, self.transport
        bucket = lane.bucket
        lane.route.wait(lane)
        reason = self._why_not(spec)
        if reason is not None:
            spec.skipped = reason
            return
        runs = bucket.runs(spec.present)
        if not runs:
            spec.skipped = "no gradient"
            return
        tl = transport.timeline
        for other in self._uploading:  # uploads from leased memory given back (usually long done: a query each)
            other.channel.up.wait(tl, "h2d", other.position, query=True)
        self._uploading = []
        lease = self.pool.take(self._pieces(bucket, spec.names))
        if isinstance(lease, str):
            spec.skipped = lease
            return
        spec.lease = lease
        spec.steps = bucket.steps.clone()
        # (Views share their base's counter: an in-place write into an ``opt.state`` tensor bumps it.)
        spec.versions = tuple(buf._version for _, buf in bucket.home.written(spec.names))
        _copy_outside(bucket, runs, spec.names, lease.buffers)
        try:
            with NOTHING if tl is None else tl.span("kernel", "speculative", lane.position):
                run_rule(bucket, runs, bucket.grad, None, spec.hyper, spec.multiplier, out=lease.buffers)
        except BaseException:
            self._release(spec)
            raise
        spec.runs = runs
        self.stats.speculated += 1  # (only this thread writes it; step() reads it once every job has ended)
        spec.staged = lane.route.stage(lane, self._new_flat(spec), transport.lanes, "h2d speculative")

    @staticmethod
    def _pieces(bucket: FlatBucket, names: Sequence[str]) -> List[Tuple[str, int, torch.dtype, bool]]:
        """What a speculation of the bucket leases: a spare of each buffer the update writes, the bucket's size and
        pinning (so that the commit can trade their memory), and the low-precision output."""
        pieces = [(name, buf.numel(), buf.dtype, bucket.pin) for name, buf in bucket.home.written(names)]
        if bucket.low_precision:  # uploaded from (shares_grad: never the gradient, which a rollback must redo from)
            pieces.append(("param", bucket.layout.padded_numel, bucket.dtype, bucket.pin))
        return pieces

    @staticmethod
    def _new_flat(spec: _Spec) -> torch.Tensor:
        """The new parameters in the lease, flat in the bucket's layout: the low-precision output, or the fp32
        master."""
        out = spec.lease.buffers
        return out["param"] if spec.lane.bucket.low_precision else out["master"]

    def _why_not(self, spec: _Spec) -> Optional[str]:
        """Why the bucket is not worth (or not safe) speculating on now; None if it is."""
        if self._round.stopped:
            return "stopped"
        lane = spec.lane
        bucket = lane.bucket
        spec.names = tuple(b.name for b in bucket.rule.needed(spec.hyper))
        if not bucket.home.holds(spec.names):
            return "amsgrad switched on"  # (a buffer the hyperparameters now need) its entries are made at step()
        if any(has and fsdp2.version(p) != v for has, p, v in zip(spec.present, bucket.owners, bucket.versions)):
            return "masters refresh"  # first step, or a parameter changed outside: refresh_masters syncs the GPU
        norm_host = getattr(lane.channel, "norm_host", None)  # (the copying route's: on the host once waited for)
        sq = None if lane.arrival.norm is None or norm_host is None else float(norm_host[0])
        if sq is not None:
            if not math.isfinite(sq) and self._round.read[lane.group][1] != "ignore":
                self._round.stopped = True
                return "stopped"
            self._round.running_sq += sq
            if self._max_norm is not None and math.sqrt(self._round.running_sq) * spec.multiplier > self._max_norm:
                self._round.stopped = True
                return "stopped"
        return None

    def _release(self, spec: _Spec) -> None:
        """Give the lease (and the device buffer) back, once no copy reads them."""
        if spec.staged is not None:
            spec.staged.done.synchronize()  # (the speculative upload read the lease; usually long done)
            spec.staged.release()
        spec.staged = None
        if spec.lease is not None:
            self.pool.give_back(spec.lease)
            spec.lease = None

    # -- step() (the main thread) ------------------------------------------------------------------------------
    def _finish(self, spec: _Spec) -> None:
        """Wait for the bucket's speculation (a queued one is cancelled: the bucket is then updated at step())."""
        job = spec.job
        if job is None:
            return
        if job.cancel():
            spec.skipped = spec.skipped or "queued at step()"
        else:
            try:
                job.result()
            except BaseException as exc:  # the exact update runs at step() and meets the same problem if real
                logger.warning("OffloadOptimizer: speculation failed (%r); it is off from now on, every update "
                               "runs at step()", exc)
                self._broken = True
                spec.runs, spec.skipped = None, "failed"
        spec.job = None
        if spec.runs is None and spec.skipped:
            self.stats.not_started[spec.skipped] += 1

    def _finish_all(self) -> None:
        # What is still queued is cancelled before the running one is waited for: waited for first, it would let the
        # worker start the next as it ends, and so on through the whole queue. (From the back: the worker moves on
        # from the front.)
        specs = list(self._round.specs.values())
        for spec in reversed(specs):
            if spec.job is not None and spec.job.cancel():
                spec.skipped = spec.skipped or "queued at step()"
        for spec in specs:
            self._finish(spec)

    def check_received(self, plans: Plans) -> None:
        for intakes in plans if self._round.specs else ():
            for intake in intakes:
                spec = self._round.specs.get(intake.lane)
                if spec is not None and _changed(intake, spec):
                    # The gradients are about to be copied again into the buffer the speculation reads.
                    self._finish(spec)
                    self._undo_spec(spec, "gradients changed")

    def observe(self, decision: Decision) -> None:
        """The next step is expected to look like this one: its loss-scale inverse, and its clipping."""
        clip = decision.clip
        self._guess = decision.inv_scale
        self._max_norm = clip.max_norm if clip is not None and clip.norm_type == 2.0 else None

    def _undo_spec(self, spec: _Spec, reason: str) -> None:
        if spec.runs is None:
            return
        self._release(spec)
        if self.transport.timeline is not None:
            self.transport.timeline.mark("rollback", reason, spec.lane.position)
        spec.runs = None
        self.stats.rollbacks += 1
        self.stats.reasons[reason] += 1

    def run(self, decision: Decision, hypers: Sequence[Any], plans: Plans, state: State) -> None:
        self.observe(decision)
        if not self._round.specs:
            return super().run(decision, hypers, plans, state)
        self._finish_all()  # the one running ends; those still queued are cancelled and updated below
        if hypers != self._seen.hypers:
            self.ensure(hypers, plans, state)
        received = {intake.lane: intake for group in plans for intake in group}
        multiplier = decision.multiplier
        done: Set[Lane] = set()

        def update(intake: Intake) -> None:
            lane = intake.lane
            update_bucket(self.transport, lane, intake.present, intake.in_place, hypers[lane.group], multiplier,
                          state)
            done.add(lane)

        for _, intake in on_device_first(hypers, plans, self.transport.arrivals):  # launched there, run meanwhile
            if not intake.bucket.home.on_device:
                break
            update(intake)
        for lane, spec in self._round.specs.items():  # commits first: their uploads overlap the updates left
            intake = received.get(lane)
            if spec.runs is None or intake is None or not intake.present:  # (not in this step's plan)
                continue
            reason = _verdict(intake, spec, hypers[lane.group], multiplier)
            if reason is not None:
                self._undo_spec(spec, reason)
                continue
            self._commit(spec, state)
            done.add(lane)
        # The rest in arrival order, then what backward did not send.
        specs = self._round.specs
        order = [lane for lane in specs if lane in received] + [lane for lane in received if lane not in specs]
        for lane in order:
            if lane not in done and received[lane].present:
                update(received[lane])
        self.transport.finish_params(list(received))

    def _commit(self, spec: _Spec, state: State) -> None:
        lane, runs, lease = spec.lane, spec.runs, spec.lease
        bucket = lane.bucket
        # The last upload read the memory the lease takes now.
        lane.channel.up.wait(self.transport.timeline, "h2d", lane.position, query=True)
        out = lease.buffers
        bucket.home.trade(spec.names, out)
        # The upload's sources: the device copy (after the speculative upload on one stream), or (a low-precision
        # bucket whose gradient buffer carries the parameters out) the lease; else the bucket's own buffers.
        staged, spec.staged = spec.staged, None
        srcs = staged.views if staged is not None else (
            bucket.slot_views(out["param"]) if bucket.low_precision and bucket.staging is None else None)
        if srcs is not None:  # the lease it read, or that the device copy read, is reused only after this upload
            self._uploading.append(lane)
        indices = bucket.count_steps(runs)
        if not bucket.all_exposed:
            expose(state, bucket, [i for i in indices if not bucket.exposed[i]])
        self.transport.send_params(lane, list(indices), srcs)
        if staged is not None:
            staged.release()
        self.pool.give_back(lease)
        spec.lease = None
        if self.transport.timeline is not None:
            self.transport.timeline.mark("commit", "", lane.position)
        spec.runs = None
        self.stats.commits += 1

    def _roll_back_all(self, reason: str) -> None:
        self._finish_all()
        for spec in self._round.specs.values():
            self._undo_spec(spec, reason)

    def flush(self, state: State) -> None:
        """The state is about to be edited: an update computed from the state before the edit is dropped."""
        self._roll_back_all("state edited or replaced")

    def drop(self) -> None:
        """The state is being replaced (a load): what speculation computed from the old one is dropped."""
        self._roll_back_all("state edited or replaced")

    def end_step(self, stepped: bool) -> None:
        # An update not committed by now belongs to a step that did not happen (skipped, refused, raised, or
        # abandoned by zero_grad()).
        try:
            self._roll_back_all("skipped step" if stepped else "no step")
            self.pool.end_step(record=bool(self._round.specs))
        finally:
            self._round = _Round()


def _changed(intake: Intake, spec: _Spec) -> bool:
    """Whether the gradients ``step()`` received for the bucket are not those its speculation read."""
    return intake.stale or list(intake.present) != spec.present or any(g is not None for g in intake.pending)


def _verdict(intake: Intake, spec: _Spec, hyper: Any, multiplier: float) -> Optional[str]:
    """Why ``step()`` cannot keep the speculative update; None if it can."""
    if multiplier != spec.multiplier:
        return "multiplier"
    if hyper != spec.hyper:
        return "hyperparameters"
    if _changed(intake, spec):
        return "gradients changed"
    bucket = intake.bucket
    if not torch.equal(bucket.steps, spec.steps):
        return "steps changed"
    if tuple(buf._version for _, buf in bucket.home.written(spec.names)) != spec.versions:
        return "state edited"  # in place (an ``opt.state`` tensor's ``zero_()``): step() reads the edited state
    if any(has and fsdp2.version(p) != v for has, p, v in zip(spec.present, bucket.owners, bucket.versions)):
        return "parameters changed"  # on the GPU, since the optimizer last wrote them: step() reads them anew
    return None


def _copy_outside(bucket: FlatBucket, runs: Sequence[Tuple[int, int, int]], names: Sequence[str],
                  out: Dict[str, torch.Tensor]) -> None:
    """The lease becomes the bucket's state at the commit, whole: where the update does not write (the slots of
    parameters without a gradient this step), it must hold the bucket's own values. Nothing to copy in the usual
    case, one run over the whole bucket."""
    layout = bucket.layout
    spans = [layout.span(first, last) for first, last, _ in runs]
    if spans == [(0, layout.padded_numel)]:
        return
    gaps, at = [], 0
    for a, b in spans:
        if a > at:
            gaps.append((at, a))
        at = b
    if at < layout.padded_numel:
        gaps.append((at, layout.padded_numel))
    for name, buf in bucket.home.written(names):
        if name.endswith("_scale"):
            pieces = [(a // Q8_BLOCK, q8_scale_numel(b)) for a, b in gaps]
        else:
            pieces = gaps
        for a, b in pieces:
            out[name][a:b].copy_(buf[a:b])

