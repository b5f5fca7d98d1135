"""ZeRO over a ``process_group`` (:class:`ShardedTransport`): each rank keeps the state of its shard of every
bucket (:class:`~zero_offload.buckets.ShardLayout`).

One bucket's journey with a group of N ranks: its gradients are flattened and reduce-scattered (summed; the 1/N of
the average is folded into the kernel's gradient multiplier), from the backward hooks when streamed or at
``step()``, so each rank holds the sum for the shard it owns; the gradient statistics of all buckets (sum of
squares, a non-finite flag, and which parameters have a gradient on any rank) are combined in *one* all-reduce of
a small tensor per step (a step that reduce-scatters gradients backward did not send begins with one more, of the
same size: a check that every rank is there); the kernel updates the shard; the updated shard is all-gathered into
the full parameters while the next bucket is updated. The collectives themselves, their timeouts and failures are
:mod:`zero_offload.distributed`'s; where ranks part ways, :mod:`~zero_offload.transport.agreement` catches it.

* On CPU the parameters are views of the bucket's ``flat_param``; gradients are copied into (or, after
  ``zero_grad(set_to_none=False)``, accumulated in) ``flat_grad``, which the reduce-scatter reads; the all-gather
  writes ``flat_param`` in place (:class:`ShardedResidentRoute`).
* On CUDA, gradients are flattened into a transient device buffer on the copy stream, the reduce-scatter leaves
  the owned shard on the device and only that shard is copied to pinned host memory; the updated shard goes up on
  the upload stream and is all-gathered into a transient device buffer copied into the parameters
  (:class:`ShardedOffloadRoute`).
* On CUDA with the shard's state stepped on the GPU (``placement="resident"``), the parameters are views of a
  device ``flat_param``, all-gathered in place, and the gradients are flattened when the bucket's are complete (in
  backward when streamed, at ``step()`` otherwise) into a transient device buffer, which the reduce-scatter reads:
  only the rank's shard of the sum is held, on the GPU, until the step is over. Its collectives run on a stream of
  their own, off the compute stream, which waits for a reduce-scatter only where its shard is first read and for
  the all-gathers as the step ends (:class:`ShardedDeviceRoute`). Parked on the host between steps
  (``placement="parked"``), the bucket goes that way and its shard's state comes up in backward and goes back down
  after the update (:class:`ShardedParkedRoute`).

Every rank must issue the collectives in the same order: which parameters have a gradient is agreed over the group
in :meth:`ShardedTransport.gather`, so every rank then updates (and all-gathers) the same buckets.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch

from zero_offload import functional
from zero_offload._compat import increment_version
from zero_offload.buckets import FlatBucket
from zero_offload.distributed import Comm, _dist
from zero_offload.host_memory import copy_many_
from zero_offload.lane import Intake, Lane, Plans, SqNorm
from zero_offload.state.layout import view_like
from zero_offload.timeline import NOTHING
from zero_offload.transport.agreement import (ABANDONED, BACKWARD, STATE_DICT, STATS, STEP_REDUCE, CLIPPED_STEP,
                                              Agreement)
from zero_offload.transport.base import Gathered, Route, Transport
from zero_offload.transport.channel import Channel
from zero_offload.transport.measure import Norm, device_sq_norm, every, first_nonfinite, name_held
from zero_offload.transport.parked import reload_if_room

__all__ = ["ShardedChannel", "ShardedDeviceRoute", "ShardedOffloadRoute", "ShardedParkedRoute", "ShardedResidentRoute",
           "ShardedTransport"]


class ShardedChannel(Channel):
    """The channel of a sharded bucket: beside the copies' marks, its collectives in flight and where a streamed
    micro-batch's shard lands.

    Attributes:
        scatter, gather (Pending, optional): its reduce-scatter and all-gather in flight
            (:class:`~zero_offload.distributed.Pending`).
        shard_in (Tensor, optional): where a later micro-batch's shard of the reduced gradients lands (``release``),
            made at first use; ``adding``: it is still to be added to the gradient.
    """

    __slots__ = ("scatter", "gather", "shard_in", "adding")

    def __init__(self) -> None:
        super().__init__()
        self.scatter: Optional[Any] = None
        self.gather: Optional[Any] = None
        self.shard_in: Optional[torch.Tensor] = None
        self.adding = False


class _ShardedRoute(Route):
    """What both sharded kinds share: a reduce-scatter leaves this rank's shard of the gradients' sum in the
    bucket's gradient buffer (or, for a streamed micro-batch with ``release``, in ``shard_in``, added to it)."""

    def channel(self) -> ShardedChannel:
        return ShardedChannel()

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        """Start the reduce-scatter of a bucket complete in backward. Its shard of the reduced sum is added to an
        earlier micro-batch's with ``release``; otherwise it is recomputed from the gradients accumulated on the
        parameters. The first bucket of each backward (every backward sends every bucket once, in a fixed order)
        is preceded by an agreement check: a rank running one more backward than another meets its ``step()``
        there and both raise, where their reduce-scatters would have met the step's all-reduce and aborted gloo."""
        t = self.transport
        t.count_backward(lane)
        self.reduce_scatter(lane, [p.grad for p in lane.bucket.params], add=t.release and lane.arrival.launches > 0)
        if t.release and not self.resident:
            stream = t.streams.down(lane.bucket.device)
            for g in grads:
                g.record_stream(stream)

    def reduce_scatter(self, lane: Lane, grads: Sequence[Optional[torch.Tensor]], add: bool = False) -> None:
        """Flatten the gradients (absent ones as zeros) and start leaving this rank's shard of their sum over the
        group (or, with ``grads_reduced``, of the already-reduced gradients) in ``grad``; with ``add``, the shard
        is added to what ``grad`` holds (another micro-batch's, streamed). Nothing is waited for: the
        reduce-scatter runs while the caller goes on, and :meth:`wait` finishes it."""
        self.land(lane)  # the previous reduce-scatter may still read its input or write grad
        bucket, channel = lane.bucket, lane.channel
        if add and channel.shard_in is None:  # (beside the shard's gradient: on the GPU for a resident or parked one)
            channel.shard_in = bucket.home.grads_tier.empty(bucket.shard.numel, bucket.dtype)  # (written whole)
        self._scatter(lane, grads, channel.shard_in if add else bucket.grad)
        channel.adding = add
        channel.sent()

    def _scatter(self, lane: Lane, grads: Sequence[Optional[torch.Tensor]], out: torch.Tensor) -> None:
        raise NotImplementedError

    def wait(self, lane: Lane) -> None:
        self.land(lane)

    def land(self, lane: Lane) -> None:
        """Wait for the reduce-scatter (at most the group's timeout, else an error naming rank and bucket) and the
        copy to the host, and add a streamed micro-batch's shard."""
        channel = lane.channel
        if channel.scatter is not None:
            pending, channel.scatter = channel.scatter, None
            pending.wait()
        channel.down.wait(self.transport.timeline, "d2h", lane.position)
        if channel.adding:
            channel.adding = False
            lane.bucket.grad.add_(channel.shard_in)
        channel.settled()

    def gather(self, intake: Intake) -> Intake:
        return intake  # (the shard is in the gradient buffer: ShardedTransport.gather reduced it there)

    def finish(self, lanes: Sequence[Lane]) -> None:
        for lane in lanes:
            channel = lane.channel
            if channel.gather is not None:
                pending, channel.gather = channel.gather, None
                pending.wait()


class ShardedResidentRoute(_ShardedRoute):
    """A sharded CPU bucket: its parameters views of ``flat_param``, its gradients gathered into ``flat_grad`` (or
    accumulated there, after ``zero_grad(set_to_none=False)``), which the reduce-scatter reads."""

    resident = True

    def bind(self, lane: Lane) -> None:
        """Rank 0's values on every rank (broadcast, as DDP does at construction), the parameters views of
        ``flat_param``. A collective: every rank binds its buckets in the same order."""
        bucket = lane.bucket
        bucket.home.fill_param_slots()
        self.transport.comm.broadcast(bucket.flat_param, f"initial parameters of {bucket.where}")
        bucket.home.bind()

    def _scatter(self, lane: Lane, grads: Sequence[Optional[torch.Tensor]], out: torch.Tensor) -> None:
        bucket, comm = lane.bucket, self.transport.comm
        targets, numels = bucket.grads.targets, bucket.full.numels
        dsts, srcs, sizes = [], [], []
        for i, g in enumerate(grads):
            if g is None:
                bucket.grads.clear(i)
                continue
            bucket.grads.filled(i)
            if g is not targets[i]:  # a view installed by zero_grad(set_to_none=False) needs no copy
                dsts.append(targets[i])
                srcs.append(g)
                sizes.append(numels[i])
        if dsts:
            copy_many_(dsts, srcs, sizes)
        lo, shard = bucket.shard.lo, bucket.shard.numel
        if comm.grads_reduced:
            out.copy_(bucket.flat_grad[lo : lo + shard])
        else:
            lane.channel.scatter = comm.start_reduce_scatter(out, bucket.flat_grad, f"gradients of {bucket.where}")
            lane.channel.sent()

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """Start all-gathering the updated shard into ``flat_param`` in place (the shard is its own slice)."""
        bucket = lane.bucket
        lo, shard = bucket.shard.lo, bucket.shard.numel
        comm = self.transport.comm
        lane.channel.gather = comm.start_all_gather(bucket.flat_param, bucket.flat_param[lo : lo + shard],
                                                    f"parameters of {bucket.where}")
        increment_version([bucket.params[i] for i in indices])


def _flatten(bucket: Any, grads: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The bucket's full gradients as one flat buffer on its device, made on the current stream: each present
    gradient in its slot, zeros elsewhere (absent gradients, padding): what a reduce-scatter reads."""
    full = bucket.full
    flat = torch.zeros(full.padded_numel, dtype=bucket.dtype, device=bucket.device)
    present = [i for i, g in enumerate(grads) if g is not None]
    if present:
        torch._foreach_copy_([view_like(flat, full.offsets[i], bucket.params[i]) for i in present],
                             [grads[i] for i in present])
    return flat


class ShardedDeviceRoute(ShardedResidentRoute):
    """A sharded GPU bucket whose shard of the state is stepped on its GPU: the parameters views of a device
    ``flat_param``, all-gathered in place, as a CPU bucket's; but no full gradient buffer is kept. The gradients
    are flattened into a transient buffer once they are complete (in backward when streamed, at ``step()``
    otherwise), which the reduce-scatter reads; the rank's shard of the sum (the bucket's gradient buffer, and with
    ``release`` a later micro-batch's ``shard_in``) is held until the step is over.

    Its collectives run off the compute stream, on the transport's collective stream
    (:meth:`~zero_offload.transport.channel.Streams.collectives`), as DDP's and FSDP2's do: each waits there for the
    compute stream (which wrote the gradients, or the updated shard), and the compute stream waits for a
    reduce-scatter only where its shard is first read (:meth:`wait`: the statistics of ``step()``'s gate, or the
    update) and for the all-gathers only as the step ends (:meth:`finish`). So backward never waits for a bucket's
    reduce-scatter, and each bucket's update runs while the previous bucket's all-gather does."""

    def _scatter(self, lane: Lane, grads: Sequence[Optional[torch.Tensor]], out: torch.Tensor) -> None:
        bucket, t = lane.bucket, self.transport
        comm, stream = t.comm, t.streams.collectives(bucket.device)
        # The gradients were written on the compute stream (by backward, or by DDP's averaging at its end); read on
        # this one, they are handed to it (with release_grads backward drops them as this returns).
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        for g in grads:
            if g is not None:
                g.record_stream(stream)
        lo, shard = bucket.shard.lo, bucket.shard.numel
        with torch.cuda.stream(stream):
            # Made on this stream, not the compute stream: Comm.start's Work.wait(), issued with this stream current,
            # orders this stream after the collective and then lets go of the input NCCL held, which goes back to the
            # pool of the stream it was made on, here only reused by this stream's later work (the next bucket's
            # flatten takes the same block): one full buffer at a time, however many reduce-scatters are in flight,
            # and the compute stream's pool is not touched. (Made on the compute stream it would need record_stream,
            # and the allocator would hold each block until its reduce-scatter had run: a buffer per reduce-scatter in
            # flight.) Absent gradients read as its zeros.
            flat = _flatten(bucket, grads)
            if comm.grads_reduced:
                out.copy_(flat[lo : lo + shard])
            else:
                lane.channel.scatter = comm.start_reduce_scatter(out, flat, f"gradients of {bucket.where}")
            lane.channel.sent(stream)  # (after the reduce-scatter, which the stream waits for: what wait() waits on)

    def land(self, lane: Lane) -> None:
        """The host waits for the reduce-scatter (the group's timeout bounds it) and a later micro-batch's shard
        is added to the gradient's on the collective stream, after it: nothing here orders the compute stream (a
        later micro-batch's reduce-scatter of this bucket follows on the collective stream)."""
        channel = lane.channel
        if channel.scatter is not None:
            pending, channel.scatter = channel.scatter, None
            pending.wait()
        if channel.adding:
            channel.adding = False
            stream = self.transport.streams.collectives(lane.bucket.device)
            with torch.cuda.stream(stream):
                lane.bucket.grad.add_(channel.shard_in)
            channel.down.record(stream)

    def wait(self, lane: Lane) -> None:
        """The shard of the reduced gradients is read next on the compute stream (the gate's statistics, the
        update; or let go of by the step's end): that stream waits for it (:meth:`land`, then the collective
        stream's point after it)."""
        self.land(lane)
        event = lane.channel.down.event
        if event is not None:
            torch.cuda.current_stream(lane.bucket.device).wait_event(event)
        lane.channel.settled()

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """Start all-gathering the updated shard into ``flat_param`` on the collective stream, once that has waited
        for the update (on the compute stream): the next bucket's update runs meanwhile, and :meth:`finish` has the
        compute stream wait."""
        device = lane.bucket.device
        stream = self.transport.streams.collectives(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            super().upload(lane, indices, srcs)

    def finish(self, lanes: Sequence[Lane]) -> None:
        """The host waits for every all-gather (the group's timeout), and what reads the parameters next on the
        compute stream (the next forward) waits for them there."""
        super().finish(lanes)
        for device in {lane.bucket.device for lane in lanes}:
            torch.cuda.current_stream(device).wait_stream(self.transport.streams.collectives(device))

    def end(self, lane: Lane) -> None:
        """The step is over: the shard of the reduced gradients goes (made again by the next reduce-scatter)."""
        lane.channel.shard_in = None
        lane.bucket.grads.release()


class ShardedParkedRoute(ShardedDeviceRoute):
    """A sharded GPU bucket whose shard of the state is parked on the host between steps
    (:class:`~zero_offload.state.parked_home.ParkedHome`): the device route's reduce-scatter (its gradients' shard
    stays on the GPU), update and all-gather, with the shard's state brought up once the reduce-scatter has started
    in backward, where the GPU has room (else at ``step()``), and let go with the step."""

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        super().send(lane, idx, grads, add)
        reload_if_room(self.transport, lane)

    def end(self, lane: Lane) -> None:
        super().end(lane)
        lane.bucket.home.release()


class ShardedOffloadRoute(_ShardedRoute):
    """A sharded GPU bucket whose shard of the state lives on the host."""

    def bind(self, lane: Lane) -> None:
        """Rank 0's values on every rank (broadcast through a flat device buffer)."""
        bucket = lane.bucket
        full = bucket.full
        flat = torch.zeros(full.padded_numel, dtype=bucket.dtype, device=bucket.device)
        views = [view_like(flat, o, p) for o, p in zip(full.offsets, bucket.params)]
        torch._foreach_copy_(views, [p.detach() for p in bucket.params])
        self.transport.comm.broadcast(flat, f"initial parameters of {bucket.where}")
        with torch.no_grad():
            torch._foreach_copy_(bucket.params, views)

    def _scatter(self, lane: Lane, grads: Sequence[Optional[torch.Tensor]], out: torch.Tensor) -> None:
        bucket, t = lane.bucket, self.transport
        comm = t.comm
        lo, shard = bucket.shard.lo, bucket.shard.numel
        stream = t.streams.down(bucket.device)
        # The gradients were written on the compute stream (by backward, or by DDP's averaging at its end).
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.cuda.stream(stream):
            flat = _flatten(bucket, grads)
            if comm.grads_reduced:
                own = flat[lo : lo + shard]
            else:
                own = torch.empty(shard, dtype=bucket.dtype, device=bucket.device)
                lane.channel.scatter = comm.start_reduce_scatter(own, flat, f"gradients of {bucket.where}")
            out.copy_(own, non_blocking=True)  # (the stream waits for the reduce-scatter)
            lane.channel.sent(stream)

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """The updated shard up on the upload stream, all-gathered into a transient device buffer, copied into
        the parameters updated (another's master may not have been initialised from it yet); not waited for:
        the next bucket's update runs meanwhile, and :meth:`finish` waits."""
        bucket, t = lane.bucket, self.transport
        shard, full = bucket.shard.numel, bucket.full
        src = bucket.upload_flat  # (the staging shard, or the master: never a shared gradient buffer when sharded)
        stream = t.streams.up(bucket.device)
        with torch.no_grad(), torch.cuda.stream(stream):
            own = torch.empty(shard, dtype=bucket.dtype, device=bucket.device)
            own.copy_(src, non_blocking=True)
            flat = torch.empty(full.padded_numel, dtype=bucket.dtype, device=bucket.device)
            lane.channel.gather = t.comm.start_all_gather(flat, own, f"parameters of {bucket.where}")  # (waited for)
            torch._foreach_copy_([bucket.params[i] for i in indices],
                                 [view_like(flat, full.offsets[i], bucket.params[i]) for i in indices])
        lane.channel.up.record(stream)

    def finish(self, lanes: Sequence[Lane]) -> None:
        super().finish(lanes)
        for device in {lane.bucket.device for lane in lanes}:
            torch.cuda.current_stream(device).wait_stream(self.transport.streams.up(device))


class ShardedTransport(Transport):
    """The transport of a sharded optimizer (see the module docstring): its own routes, and the step's
    collectives over all buckets (the statistics' all-reduce, the agreement checks).

    Args:
        comm (Comm): the process group's collectives (its topology's).
        release (bool): as for :class:`~zero_offload.transport.base.Transport`.
    """

    def __init__(self, comm: Comm, *, release: bool):
        super().__init__(release=release)
        self.comm = comm
        self.agreement = Agreement(comm, self._stats_numel)

    def route_for(self, bucket: FlatBucket) -> Route:
        if bucket.home.kind == "parked":
            return self.route(ShardedParkedRoute)
        if bucket.resident:
            return self.route(ShardedResidentRoute if bucket.on_cpu else ShardedDeviceRoute)
        return self.route(ShardedOffloadRoute)

    def count_backward(self, lane: Lane) -> None:
        """A bucket is sent in backward: the first of each backward checks the ranks agree first."""
        agreement = self.agreement
        if lane.arrival.launches >= agreement.backwards:
            agreement.check(BACKWARD, (), "reduce_scatter", f"gradients of {lane.bucket.where}")
            agreement.backwards += 1

    def abandon(self) -> None:
        """A backward that raised here may not have raised on the other ranks at the same point: one may be
        reduce-scattering its gradients (waiting in its check for this rank, which would go on to its next backward
        and pair that one's collectives with the abandoned one's, or abort gloo with collectives of different
        sizes). So ``zero_grad()`` meets the others first: where they are not all abandoning the same backward,
        every rank raises, naming where each is."""
        self.agreement.check(ABANDONED, (), "all_reduce", "a backward that raised")

    def reset(self) -> None:
        # All-gathers a step left in flight (its update raised after earlier buckets' were issued: the schedule's
        # finish never ran) are finished as a step that returns finishes them: off the compute stream, nothing else
        # would have the next forward, or a checkpoint of the model, wait for what they write. (Not where a collective
        # failed: this rank is out of step, its collectives refused, and the step's own error is the one to see.)
        if self.comm.failure is None:
            self.finish_params([lane for lane in self.lanes if lane.channel.gather is not None])
        super().reset()
        self.agreement.backwards = 0

    def gather(self, plans: Plans, check: bool = False, clipping: bool = False,
               settings: Sequence[Tuple[str, float]] = ()) -> Gathered:
        """Bring every bucket's reduced gradient shard to the host and combine the sum of squares, the non-finite
        flag and which parameters have a gradient in one all-reduce (each intake's ``present`` becomes the group's
        answer: a gradient on some ranks only counts as zero on the others).

        A bucket whose gradients backward already reduce-scattered (the same on every rank) is only waited for;
        the others' reduce-scatters are all started first (in plan order, the same on every rank), then waited
        for, so they overlap each other and the gradient copies. The all-reduce also carries each streamed
        bucket's ``stale`` flag: a gradient changed on some rank after its reduce-scatter (an in-place clip or
        unscale, or one assigned by hand), and every rank then reduce-scatters that bucket again from the
        gradients on the parameters, with a second all-reduce for the norm (impossible with ``release``, whose
        gradients are gone: an error on every rank).

        The all-reduce also checks that every rank is at the same point with the same ``settings`` (name, value)
        pairs: the hyperparameters a step uses, which the all-gather of the updated shards would otherwise
        silently reconcile (a scheduler stepped on one rank only)."""
        intakes = every(plans)
        todo = [intake for intake in intakes if not intake.lane.arrival.launches]
        if todo and not self.comm.grads_reduced:  # (DDP-reduced gradients: only copied, the statistics come next)
            # Another rank may have sent these from backward already (it is at the statistics, not here), or have
            # raised before its first collective (it meets this, marked failed): the reduce-scatters, of each
            # bucket's size, would abort gloo or wait for it until the timeout.
            self.agreement.check(STEP_REDUCE, (), "reduce_scatter", f"gradients of {todo[0].bucket.where}")
        for intake in todo:
            intake.lane.route.reduce_scatter(intake.lane, intake.pending)
        lanes = [intake.lane for intake in intakes]
        local = [list(intake.present) for intake in intakes]
        sqs, bads = self._shard_stats(lanes)
        stale = [float(intake.lane.arrival.launches > 0 and intake.stale) for intake in intakes]
        where = "the gradient norm, non-finite check and gradient presence"
        vals = self.comm.all_reduce_host([sum(sqs), sum(bads), float(clipping), *map(float, chain.from_iterable(local)),
                                          *stale, *self.agreement.tail(STATS, settings)], _dist().ReduceOp.SUM, where)
        tail = vals[len(vals) - 3 * self.comm.world :]
        self.agreement.check_phases(tail, "all_reduce", where)
        self.agreement.check_clipping(int(vals[2]), clipping)
        self.agreement.check_settings(tail, settings, where)
        del vals[len(vals) - 3 * self.comm.world :]
        k, agreed = 3, []
        for intake in intakes:
            agreed.append(intake.but(present=[v > 0 for v in vals[k : k + len(intake.present)]]))
            k += len(intake.present)
        redo = [i for i, v in enumerate(vals[k:]) if v > 0]
        if redo:
            vals[:2] = self._reduce_again(intakes, local, redo, sqs, bads)
        self.stats = SqNorm(vals[0], vals[1] > 0 or not math.isfinite(vals[0]))
        it = iter(agreed)
        return Gathered([[next(it) for _ in group] for group in plans], check and self.stats.nonfinite)

    def together(self, skipped: bool = False) -> Any:
        """A rank that raises before the step's first collective meets the others' next one, which is of the
        statistics' size (see :meth:`gather`: the statistics, or the check before reduce-scattering what backward
        did not send), so that they raise too; not a step the others skip (``skipped``: a GradScaler found an
        inf/nan)."""
        return NOTHING if skipped else self.agreement.failing()

    def agree(self, settings: Sequence[Tuple[str, float]]) -> None:
        """``step()`` after ``clip_grad_norm_`` (whose all-reduce was the gradient statistics'): check that every
        rank steps with the same ``settings``, in an all-reduce of its own."""
        self.agreement.check(CLIPPED_STEP, settings, "all_reduce", "the hyperparameters of step()")

    def agree_state(self, buckets: Iterable[FlatBucket]) -> None:
        """``state_dict()``, before gathering: every rank is there, and holds the same state buffers (an amsgrad
        buffer on some ranks only, from a state dict loaded there, would gather unlike sizes and abort gloo)."""
        settings = [(f"{buf.name} buffer of {b.where}", float(b.home.holds([buf.name])))
                    for b in buckets for buf in b.rule.buffers if buf.optional]
        self.agreement.check(STATE_DICT, settings, "all_gather", "the state", state=True)

    def _stats_numel(self) -> int:
        """The length of :meth:`gather`'s all-reduce: fixed for the optimizer's life, the same on every rank."""
        return 3 + sum(len(lane.bucket.params) + 1 for lane in self.lanes) + 3 * self.comm.world

    def _reduce_again(self, intakes: List[Intake], local: List[List[bool]], redo: List[int], sqs: List[float],
                      bads: List[float]) -> List[float]:
        if self.release:
            raise RuntimeError(
                f"zero_offload: rank {self.comm.rank} of {self.comm.world}: a gradient was assigned or changed in "
                f"place after backward had reduce-scattered it (in {intakes[redo[0]].bucket.where}), but "
                "release_grads=True dropped the others', so it cannot be reduced again. Clip with "
                "optimizer.clip_grad_norm_ and do not edit gradients after backward, or pass release_grads=False. "
                "Nothing was updated."
            )
        for i in redo:
            intake = intakes[i]
            again = [p.grad if has and g is None else g
                     for p, has, g in zip(intake.bucket.params, local[i], intake.pending)]
            intake.lane.route.reduce_scatter(intake.lane, again)
        redone = self._shard_stats([intakes[i].lane for i in redo])
        for j, i in enumerate(redo):
            sqs[i], bads[i] = redone[0][j], redone[1][j]
        return self.comm.all_reduce_host([sum(sqs), sum(bads)], _dist().ReduceOp.SUM,
                                         "the gradient norm and non-finite check, after reducing again")

    def describe_nonfinite(self, plans: Plans, names: Sequence[Optional[Sequence[str]]]) -> str:
        """As the transport's, but every rank names the same parameter and the rank whose shard of its reduced
        gradient holds the inf/nan (:func:`~zero_offload.transport.measure.name_held`; a collective: every rank refuses
        the step alike)."""
        found = first_nonfinite(plans)
        rows = torch.empty(2 * self.comm.world, dtype=torch.float64)
        mine = torch.tensor([-1.0, -1.0] if found is None else [float(found.group), float(found.index)],
                            dtype=torch.float64)
        self.comm.all_gather_host(rows, mine, "the name of an inf/nan gradient")
        rows = rows.view(-1, 2).tolist()
        return name_held([(int(g), int(j), r) for r, (g, j) in enumerate(rows) if g >= 0], plans, names)

    def _shard_stats(self, lanes: Sequence[Lane]) -> Tuple[List[float], List[float]]:
        """Wait for each bucket's shard; its sum of squares (of the averaged gradient) and non-finite flag."""
        sqs, bads = [], []
        for lane in lanes:
            lane.route.wait(lane)
            bucket = lane.bucket
            s, nonfinite = (device_sq_norm([bucket.grad]) if bucket.home.on_device
                            else functional.grad_sq_norm(bucket.grad))
            sqs.append(s * bucket.grad_multiplier**2)
            bads.append(float(nonfinite))
        return sqs, bads

    def total_norm(self, plans: Plans, norm_type: float) -> Norm:
        """``clip_grad_norm_``'s total norm of the averaged gradient over the group: the 2-norm from the last
        :meth:`gather` (no further collective), other norms with one more all-reduce."""
        self.wait_all(plans)
        stats = self.stats
        if norm_type == 2.0:
            return Norm(math.sqrt(stats.sq), stats.nonfinite)
        dist = _dist()
        buckets = [intake.bucket for intake in every(plans) if intake.bucket.grad.numel()]
        # Padding is zero in the gradient buffers, so it changes neither a max nor a p-norm.
        if norm_type == math.inf:
            local = max((float(b.grad.abs().max()) * b.grad_multiplier for b in buckets), default=0.0)
            total = self.comm.all_reduce_host([local], dist.ReduceOp.MAX, "the gradient inf-norm")[0]
        else:
            local = sum(float(torch.linalg.vector_norm(b.grad.double() * b.grad_multiplier, norm_type)) ** norm_type
                        for b in buckets)
            total = self.comm.all_reduce_host([local], dist.ReduceOp.SUM, f"the gradient {norm_type}-norm")[0]
            total = total ** (1.0 / norm_type)
        return Norm(total, stats.nonfinite or not math.isfinite(total))
