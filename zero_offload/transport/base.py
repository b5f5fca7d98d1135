"""Every byte that moves between the parameters and the host buffers, for one optimizer: the side streams that
order the copies (the events each bucket's copies record are its lane's channel's), and the bucket kinds' routes
behind one small interface.

**Routes.** A bucket's kind says how its bytes move, and each kind is a :class:`Route` (one file each): parameters
on the host (:mod:`~zero_offload.transport.host`, nothing moves), one GPU with the state on the host or on the
GPU's own tier (:mod:`~zero_offload.transport.device`) or parked on the host between steps
(:mod:`~zero_offload.transport.parked`), our ``process_group`` sharding
(:mod:`~zero_offload.transport.sharded`), FSDP2's shards (:mod:`~zero_offload.transport.fsdp2`). A route sends a
bucket's gradients (from backward, or at ``step()``), waits for them, gathers them where the kernel reads them,
and sends the updated values back; what it keeps for the optimizer's life is the lane's channel
(:mod:`~zero_offload.transport.channel`), what backward sent the lane's :class:`~zero_offload.lane.Arrival`, and what
``step()`` received an :class:`~zero_offload.lane.Intake` it returns.

**The transport** (:class:`Transport`) takes a step's lanes through their routes in the order that overlaps
work (device copies are only enqueued, so they go first), and measures what arrived
(:mod:`~zero_offload.transport.measure`): the gradients' norm (the GPU-computed norms of streamed buckets with one
synchronisation), and whether one is inf/nan. What the step then does with those measurements is the gate's
(:mod:`zero_offload.gate`). Where a parameter lives across ranks, and so which collectives the step makes, is the
transport's topology's (:mod:`zero_offload.topology`).

**Edits.** A gradient assigned or edited in place after its copy is read again at ``step()``, found by its version
counter, or, for the edits that move none (``GradScaler.unscale_``, ``foreach`` ops on FSDP2's DTensors), by its
norm (:mod:`~zero_offload.transport.edits`).

**Accumulation.** Without ``no_sync`` every backward streams: with ``release`` each later copy is *added* to what
the host buffer already holds for this step (fp32 gradients add exactly as they would on the GPU); without it
the host copy is simply refreshed from ``.grad``, which accumulated on the device.
"""

from __future__ import annotations

import math
import time
from itertools import chain
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from zero_offload import functional
from zero_offload.buckets import FlatBucket
from zero_offload.grads import check_grads
from zero_offload.lane import Intake, Lane, Plans, SqNorm
from zero_offload.timeline import NOTHING, Timeline
from zero_offload.transport.channel import Channel, Streams
from zero_offload.transport.edits import EditWatch
from zero_offload.transport.measure import (Norm, every, first_nonfinite, host_norm, name_param, on_device_sq_norm,
                                            sq_norm_by_dtype, streamed_norms, two_norm)

__all__ = ["Gathered", "Route", "Transport"]


class Gathered(NamedTuple):
    """What :meth:`Transport.gather` returns: the step's intakes with every gradient where the kernel reads it, and
    whether one is inf/nan (where checked); what :meth:`Transport.measure` returns also says whether a GradScaler
    found an inf/nan on any rank the step's exchange met (``overflow``: then every rank skips the step)."""

    plans: Plans
    nonfinite: bool
    overflow: bool = False


class Route:
    """How the bytes of one kind of bucket move (see the module docstring). One instance per kind and optimizer,
    shared by its buckets; every method takes the bucket's lane (or its intake).

    Attributes:
        resident (bool): the state lives with the parameters (no copies between them).
        upload_reads (bool): :meth:`upload` reads what the update wrote (a copy from the master); False where the
            kernel wrote the parameters' storage itself, so a step may queue its kernels
            (:func:`~zero_offload.functional.queued_updates`).
        hooks (bool): backward's hooks have work for its buckets (where gradients stream; False: they are read at
            ``step()``).
        reads_in_place (bool): ``step()`` reads its gradients where autograd left them, whatever backward sent
            (what backward's hooks do for it is no copy: :meth:`send` may bring its state up instead).
    """

    resident = False
    upload_reads = True
    hooks = True
    reads_in_place = False

    def __init__(self, transport: "Transport"):
        self.transport = transport

    def channel(self) -> Channel:
        """A new lane's channel (what its copies keep for the optimizer's life)."""
        return Channel()

    def bind(self, lane: Lane) -> None:
        """At construction: tie the parameters to their slots (CPU parameters become views of them)."""

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> Optional[torch.Tensor]:
        """Start moving these gradients (parameters ``idx``) to the host buffer; ``add``: sum into it. Returns the
        bucket's squared norm where the route computed it on the way (see :class:`~zero_offload.lane.Arrival`),
        else None."""
        raise NotImplementedError

    def wait(self, lane: Lane) -> None:
        """Wait until the host buffer holds everything sent (and add what landed elsewhere)."""
        lane.channel.settled()

    def land(self, lane: Lane) -> None:
        """Before the bucket is sent again: what was sent has landed where the next send may write (here, and for
        most kinds, :meth:`wait`; a kind whose sends are ordered on a side stream orders nothing else)."""
        self.wait(lane)

    def gather(self, intake: Intake) -> Intake:
        """At ``step()``: every present gradient where the kernel reads it; returns the intake that says where
        (``in_place``, or None: the buffer)."""
        raise NotImplementedError

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """Make the updated values visible in the parameters ``indices``."""
        raise NotImplementedError

    def finish(self, lanes: Sequence[Lane]) -> None:
        """After every upload of a step: order what reads the parameters next after them."""

    def end(self, lane: Lane) -> None:
        """The step is over (whatever its outcome): let go of what the lane's step held (here: nothing)."""

    def stage(self, lane: Lane, src: torch.Tensor, lanes: Sequence[Lane], label: str) -> Optional[Any]:
        """Copy new parameters (``src``, flat in the bucket's layout) ahead of their commit into a device buffer of
        the lane's (``label``: the copy's name in the timeline); None where there is none (this kind: the commit
        uploads from the host)."""
        return None

    @staticmethod
    def _slot_copies(intake: Intake) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Zero the slots of absent gradients; return the (slot, gradient) copies still to make."""
        bucket = intake.bucket
        views = bucket.grads.grad_views
        dsts, srcs = [], []
        zero = bucket.grads.zero
        for i, (has, g) in enumerate(zip(intake.present, intake.pending)):
            if not has:
                if not zero[i]:
                    bucket.grads.clear(i)
                continue
            zero[i] = False
            if g is not None and g is not views[i]:  # (in its slot already: a view from zero_grad(False))
                dsts.append(views[i])
                srcs.append(g)
        return dsts, srcs


class Transport:
    """The transfers of one optimizer (see the module docstring).

    Args:
        release (bool): set ``p.grad`` to None once a gradient is on its way to the host.
    """

    unversioned_edits = False  # edits that move no version counter may come at any step (FSDP2), see EditWatch

    def __init__(self, *, release: bool):
        self.release = release
        self.edits = EditWatch(always=self.unversioned_edits)
        self.timeline: Optional[Timeline] = None  # OffloadOptimizer.record_timeline()
        self.lanes: List[Lane] = []
        self.streams = Streams()
        self.arrivals: List[Lane] = []  # the lanes backward sent in this step, in the order it sent them
        self.moved = False  # a lane's step began (something was sent or received) since the last reset
        # The device memory (bytes) an upload during backward leaves free (gpu_margin_gib); None: no such uploads
        # (uploads_in_backward=False).
        self.staging_margin: Optional[int] = None
        # A sharded transport's last gather's statistics over every rank: the sum of squares of the (averaged)
        # gradient over every bucket, and whether some rank's shard holds an inf or nan.
        self.stats = SqNorm(0.0, False)
        self._routes: Dict[type, Route] = {}

    def route(self, kind: type) -> Route:
        """This optimizer's route of ``kind`` (made once)."""
        route = self._routes.get(kind)
        if route is None:
            route = self._routes[kind] = kind(self)
        return route

    def route_for(self, bucket: FlatBucket) -> Route:
        """The route of a bucket: each transport kind's own."""
        raise NotImplementedError

    def add(self, bucket: FlatBucket, group: int, streamed: bool) -> Lane:
        """Take charge of a new bucket: its lane (``streamed``: backward sends its gradients)."""
        route = self.route_for(bucket)
        if bucket.device.type == "cuda":
            self.streams.note_compute(bucket.device)  # (built in the user's thread: see Streams.compute)
        lane = Lane(bucket, group, len(self.lanes), route, streamed and route.hooks)
        self.lanes.append(lane)
        return lane

    def rehome(self, lane: Lane) -> None:
        """The bucket's state moved to another home (between steps): its new route and channel (without the host
        buffers it no longer needs); backward sends it still only where the new route has work for its hooks."""
        lane.route = self.route_for(lane.bucket)
        lane.channel, lane.streamed = lane.route.channel(), lane.streamed and lane.route.hooks

    # -- gradients, from backward ----------------------------------------------------------------------------
    def send_grads(self, lane: Lane) -> None:
        """Start sending the bucket's gradients (those on its parameters now) to the host."""
        bucket, arrival = lane.bucket, lane.arrival
        if lane.channel.unsettled:
            lane.route.land(lane)
        self.moved = True
        if not arrival.launches:
            self.arrivals.append(lane)
            arrival.at = time.perf_counter()
        idx = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        grads = [bucket.params[i].grad for i in idx]
        shapes = bucket.grads.shapes if len(idx) == len(bucket.params) else [bucket.grads.shapes[i] for i in idx]
        check_grads(grads, [bucket.params[i] for i in idx], shapes, lambda k: bucket.label(idx[k]))
        # With release, a slot already holding this step's gradient is added to; otherwise it is overwritten.
        add = [self.release and arrival.sent[i] for i in idx]
        tl = self.timeline
        with NOTHING if tl is None or lane.route.reads_in_place else tl.span("copy", "d2h", lane.position):
            arrival.norm = lane.route.send(lane, idx, grads, add)
        if not self.release and not lane.route.resident:
            arrival.norms.update(self.edits.norms(idx, grads))
        zero = bucket.grads.zero
        for i, g in zip(idx, grads):
            arrival.sent[i] = True
            zero[i] = False
            if not self.release:
                arrival.sources[i] = (g, g._version)
        if self.release and not lane.route.reads_in_place:
            for i in idx:
                bucket.params[i].grad = None
        arrival.launches += 1

    # -- gradients, at step() --------------------------------------------------------------------------------
    def collect(self, lane: Lane) -> List[Optional[torch.Tensor]]:
        """The bucket's ``.grad`` tensors, checked, once its parameters are checked to live where the optimizer
        put them (:meth:`~zero_offload.buckets.FlatBucket.collect_grads`)."""
        return lane.bucket.collect_grads()

    def receive(self, lane: Lane, *, fresh: bool = False) -> Intake:
        """The bucket's gradients for this step. Streamed ones are waited for; a gradient assigned or edited in
        place after its copy (without ``release``: ``GradScaler.unscale_``, ``torch.nn.utils.clip_grad_norm_``) is
        left pending, to be read again. With ``fresh`` (and without ``release``) every gradient still on its
        parameter is read again, but for those whose norm at their copy was kept, to be compared by
        :meth:`EditWatch.read_edited` once every lane is received."""
        arrival = lane.arrival
        norms, arrival.norms = arrival.norms, {}  # (given up: a second receive reads every gradient again)
        grads = self.collect(lane)
        self.moved = True
        if not lane.streamed or lane.route.reads_in_place or not (arrival.launches or any(arrival.sent)):
            return Intake(lane, [g is not None for g in grads], grads)
        if lane.channel.unsettled:
            lane.route.wait(lane)
        present: List[bool] = []
        pending: List[Optional[torch.Tensor]] = []
        sent, sources = arrival.sent, arrival.sources
        for i, g in enumerate(grads):
            if g is None:
                present.append(sent[i] and self.release)
                pending.append(None)
            elif self.release or not sent[i]:
                present.append(True)
                pending.append(g)  # assigned after the stream: gathered like any gradient (overwrites the slot)
            else:
                src = sources[i]
                same = src is not None and src[0] is g and src[1] == g._version and (not fresh or i in norms)
                present.append(True)
                pending.append(None if same else g)
        # A gradient changed or dropped since its launch: the streamed norm (a sharded bucket's reduced sum) is
        # stale.
        stale = any(t is not None for t in pending) or any(was and not has for has, was in zip(present, sent))
        intake = Intake(lane, present, pending, stale)
        self.edits.defer(intake, norms, fresh)
        return intake

    def receive_all(self, lanes: Sequence[Sequence[Lane]], fresh: bool = False) -> Plans:
        """:meth:`receive` of every lane, by group, then the edits that moved no version counter found
        (:meth:`EditWatch.read_edited`). ``step()`` (or ``clip_grad_norm_``) begins: its stream is the compute
        stream."""
        self.streams.note_compute()
        return self.edits.read_edited([[self.receive(lane, fresh=fresh) for lane in group] for group in lanes])

    def measure(self, plans: Plans, settings: Sequence[Tuple[str, float]], check: bool,
                clip: Optional[Any] = None, overflow: bool = False) -> Gathered:
        """The step's intake, measured: every gradient gathered where the kernel reads it and, with ``check``,
        whether one is inf/nan (after ``clip_grad_norm_``, whose :class:`~zero_offload.gate.PendingClip` is
        ``clip``, what it gathered and found; the ranks then agree on the step's ``settings`` alone). Then the
        uploads to come wait for what the compute stream has queued so far. ``overflow``: this rank's GradScaler
        found an inf/nan: nothing is gathered (the step is skipped; FSDP2's transport meets the others first)."""
        if overflow:
            return Gathered(plans, False, True)
        if clip is None:
            gathered = self.gather(plans, check=check, settings=settings)
        else:
            self.agree(settings)
            gathered = Gathered(plans, check and clip.nonfinite)
        self.before_uploads([intake.lane for intakes in gathered.plans for intake in intakes])
        return gathered

    def gather(self, plans: Plans, check: bool = False, clipping: bool = False,
               settings: Sequence[Tuple[str, float]] = ()) -> Gathered:
        """Make every bucket's gradients readable where the kernel reads them; with ``check``, say whether any
        is inf/nan. A CPU bucket is checked right after its own gather, when what it copied is still in cache; the
        gradients read where they are (FSDP2's host shards, a CPU model's unstreamed ``.grad``) are checked in one call
        after every gather (a call per bucket costs each its cold Python in between: see
        :func:`~zero_offload.functional.queued_updates`).
        ``clipping``: called by ``clip_grad_norm_`` and ``settings`` (name, value) pairs of the step: what the
        sharded transports check every rank agrees on."""
        out = [list(intakes) for intakes in plans]
        places = [(g, k) for g, intakes in enumerate(out) for k in range(len(intakes))]
        for g, k in places:  # device copies are only enqueued: they go first and overlap the host's
            if not out[g][k].lane.route.resident:
                out[g][k] = out[g][k].lane.route.gather(out[g][k])
        bad = False
        read_in_place: List[torch.Tensor] = []
        for g, k in places:
            intake = out[g][k]
            if intake.lane.route.resident:
                intake = out[g][k] = intake.lane.route.gather(intake)
                if check and not bad and not intake.bucket.home.on_device:
                    if intake.in_place is None:
                        bad = intake.host_sq_norm().nonfinite
                    else:
                        read_in_place.extend(intake.host_grads())
        intakes = every(out)
        if check and not bad:
            bad = sq_norm_by_dtype(read_in_place).nonfinite
        if check and not bad:
            bad = on_device_sq_norm(intakes).nonfinite
        if check and not bad:
            bad = self._copied_nonfinite([intake for intake in intakes if not intake.lane.route.resident])
        return Gathered(out, bad)

    def _copied_nonfinite(self, intakes: List[Intake]) -> bool:
        """Whether a gradient copied to the host holds an inf/nan: from the norms backward computed (one
        synchronisation for every streamed bucket), else read on the host."""
        norms = streamed_norms(intakes, self.timeline)
        if any(sq is not None and not math.isfinite(sq) for sq in norms):
            return True
        for intake, sq in zip(intakes, norms):
            if sq is None:
                intake.lane.route.wait(intake.lane)
                if functional.grad_sq_norm(intake.bucket.grad)[1]:
                    return True
        return False

    def agree(self, settings: Sequence[Tuple[str, float]]) -> None:
        """``step()`` after ``clip_grad_norm_``: the sharded transports check the ranks agree on ``settings``."""

    def together(self, skipped: bool = False) -> Any:
        """A context around what ``step()`` does before its exchange with the other ranks (FSDP2's transport: a
        rank that raises there still meets it, so the others raise too instead of waiting; not where the step is
        ``skipped`` on every rank, a GradScaler having found an inf/nan); here nothing."""
        return NOTHING

    def wait_all(self, plans: Plans) -> None:
        for intake in chain.from_iterable(plans):
            intake.lane.route.wait(intake.lane)

    def total_norm(self, plans: Plans, norm_type: float) -> Norm:
        """``clip_grad_norm_``'s total norm of the gathered gradients, and whether any is inf/nan."""
        intakes = every(plans)
        if norm_type == 2.0:
            # Streamed GPU buckets brought their squared norms along (one synchronisation for all of them).
            norms = streamed_norms(intakes, self.timeline)  # (None where the route computed none: resident ones)
            self.wait_all(plans)
            sq, nonfinite = two_norm(intakes, norms)
            return Norm(math.sqrt(sq), nonfinite)
        self.wait_all(plans)
        return Norm(host_norm(intakes, norm_type), False)

    def describe_nonfinite(self, plans: Plans, names: Sequence[Optional[Sequence[str]]]) -> str:
        """Which parameter holds the first inf/nan gradient, for an error message (``names``: each group's
        ``param_names``, or None)."""
        found = first_nonfinite(plans)
        return "the gradients" if found is None else name_param(*found, names)

    # -- parameters, back ------------------------------------------------------------------------------------
    def before_uploads(self, lanes: Iterable[Lane]) -> None:
        """Uploads overwrite the parameters, so their stream first waits for what the compute stream has queued
        since backward, which may still read them (an EMA of the weights, a norm for logging, an eval forward
        before ``state_dict()``). Not needed for ``overlap_step``'s uploads in backward: every use of a parameter
        was queued before the hook that found its gradient final."""
        for device in {lane.bucket.device for lane in lanes if not lane.route.resident}:
            self.streams.up(device).wait_stream(torch.cuda.current_stream(device))

    def send_params(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Make the updated values visible in the parameters ``indices`` (``srcs``: per parameter, where to upload
        from instead of :attr:`FlatBucket.upload_views`: a delayed update's copy already on the device)."""
        lane.route.upload(lane, indices, srcs)
        lane.bucket.home.record_versions(indices)

    def finish_params(self, lanes: Sequence[Lane]) -> None:
        """After a step's uploads: what reads the parameters next waits for them (the host does not)."""
        for route in {id(lane.route): lane.route for lane in lanes}.values():
            route.finish([lane for lane in lanes if lane.route is route])

    def synchronize(self) -> None:
        """Wait for copies in flight from the host buffers (before anything rewrites them)."""
        self.streams.synchronize(self.timeline)

    # -- between steps ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget what was sent for this step (after ``step()``, or at ``zero_grad()``), once it has landed: the
        gradients a lane holds are let go with the step (after zero_grad() the caller's references are the last,
        as with AdamW)."""
        self.arrivals, self.moved = [], False
        self.streams.note_compute()  # (the stream step() ran on: the next backward's hooks allocate there)
        self.edits.reset()
        for lane in self.lanes:
            if lane.channel.unsettled:
                lane.route.wait(lane)
            lane.route.end(lane)
            if lane.arrival.launches or any(lane.arrival.sent) or lane.arrival.norms:
                lane.end()

    def abandon(self) -> None:
        """``zero_grad()`` after a backward that raised on this rank (its end never ran): where ranks must meet,
        meet them first (the sharded transport's ``abandon``); here, nothing to meet."""

    def keep_zero_grads(self) -> None:
        """``zero_grad(set_to_none=False)``: CPU buckets not streamed take their gradients as views of the flat
        buffer; with ``release``, the parameters that had a gradient last step keep a zero one (AdamW still steps
        them), held as zeroed slots of the host buffer; other gradients are zeroed where they are. After
        :meth:`reset`."""
        for lane in self.lanes:
            bucket = lane.bucket
            if bucket.resident and not lane.streamed and not bucket.fsdp and bucket.grads.slotted:
                bucket.grads.zero_as_views()
                continue
            if self.release and any(lane.had):
                if bucket.shares_grad:  # the slots cleared below may still be uploading parameters
                    lane.channel.up.wait(self.timeline, "h2d", lane.position, query=True)
                lane.arrival.sent[:] = lane.had
                for i, has in enumerate(lane.had):
                    if has:
                        bucket.grads.clear(i)
            grads = []
            for p in bucket.owners:  # (FSDP2: its DTensor gradients, whose local shards are ours at step())
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
            if grads:
                torch._foreach_zero_(grads)
