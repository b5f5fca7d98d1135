"""The routes of buckets on one GPU: the state on the host (:class:`OffloadRoute`: gradients copied down on a side
stream as backward makes them, parameters uploaded on another), or on the GPU's own tier
(:class:`DeviceTierRoute`, ``gpu_fraction``: updated there, nothing moves).

On CUDA, a copy stream waits for the compute stream, copies the bucket's gradients device-to-host into its pinned
flat buffer and records one event; the bucket's squared norm (for clipping and the inf/nan check) is computed on
the GPU on the same stream, so ``step()`` combines every bucket's with one synchronisation. With ``release``, each
gradient is handed to the copy stream (``record_stream``, so the caching allocator does not reuse its memory before
the copy has read it) and ``p.grad`` is set to None. Uploads run on a second stream, so they never queue behind
gradient copies."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from zero_offload._compat import foreach_norm_fp32
from zero_offload.host_memory import empty_host
from zero_offload.lane import Intake, Lane
from zero_offload.state.layout import view_like
from zero_offload.timeline import NOTHING, Timeline
from zero_offload.transport.base import Route
from zero_offload.transport.channel import Channel, Mark
from zero_offload.transport.host import HostRoute

__all__ = ["CopyChannel", "DeviceTierRoute", "OffloadRoute", "Staged", "device_capacity", "device_room",
           "room_in_backward"]


class CopyChannel(Channel):
    """The channel of a bucket whose state is on the host and parameters on a GPU: beside the copies' marks, its
    landing buffers, made at first use.

    Attributes:
        incoming (Tensor, optional): where a later micro-batch's gradients land (``release``) to be added.
        adds (List[int]): the slots whose copy landed in ``incoming``, still to add.
        norm_host (Tensor, optional), norm_ready (Mark): the bucket's squared norm, copied to the host before the
            gradients themselves, and the point after that copy.
        staged (Staged, optional): its device buffer for new parameters ahead of their commit (holding memory
            only from such an upload to its commit).
    """

    __slots__ = ("incoming", "adds", "norm_host", "norm_ready", "staged")

    def __init__(self) -> None:
        super().__init__()
        self.incoming: Optional[torch.Tensor] = None
        self.adds: List[int] = []
        self.norm_host: Optional[torch.Tensor] = None
        self.norm_ready = Mark()
        self.staged: Optional[Staged] = None

    def read_norm(self, timeline: Optional[Timeline], position: int) -> float:
        """The squared norm backward computed (see :class:`~zero_offload.lane.Arrival`), once its copy landed."""
        self.norm_ready.wait(timeline, "norms", position, query=True)
        return float(self.norm_host[0])


class DeviceTierRoute(HostRoute):
    """A GPU bucket whose state stays on the GPU: read in place and updated there by torch's fused AdamW."""

    upload_reads = True  # (its update runs on the GPU, not by a queued native call)
    hooks = False  # (nothing to hide behind backward)


class OffloadRoute(Route):
    """A GPU bucket whose state lives on the host (see the module docstring)."""

    def channel(self) -> CopyChannel:
        return CopyChannel()

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> Optional[torch.Tensor]:
        bucket, t, channel = lane.bucket, self.transport, lane.channel
        stream = t.streams.down(bucket.device)
        if any(add) and channel.incoming is None:
            channel.incoming = empty_host(bucket.layout.padded_numel, bucket.dtype, pin=bucket.pin)
        views = bucket.grads.grad_views
        landing = [_slot(channel.incoming, bucket, i) if a else views[i] for i, a in zip(idx, add)]
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        if bucket.shares_grad:
            _after_upload(lane, stream)
        norm = None
        with torch.cuda.stream(stream):
            launched = set(idx)
            if grads and not any(add) and all(i in launched for i, has in enumerate(lane.arrival.sent) if has):
                # The bucket's squared norm, on the GPU, and to the host before the gradients themselves: step()'s
                # checks read it without waiting for any gradient copy. Only when this launch carries all of the
                # bucket's gradients (not when they are summed on the host with an earlier micro-batch's).
                norm = torch.stack(foreach_norm_fp32(grads)).double().square().sum()
                if channel.norm_host is None:
                    channel.norm_host = empty_host(1, torch.float64, pin=bucket.pin)
                channel.norm_host.copy_(norm.view(1), non_blocking=True)
                channel.norm_ready.record(stream)
            if grads:
                torch._foreach_copy_(landing, grads, non_blocking=True)
            channel.sent(stream)
        channel.adds = [i for i, a in zip(idx, add) if a]
        if t.release:
            for g in grads:
                g.record_stream(stream)
        return norm

    def wait(self, lane: Lane) -> None:
        channel = lane.channel
        channel.down.wait(self.transport.timeline, "d2h", lane.position)
        if channel.adds:
            b = lane.bucket
            views = b.grads.grad_views
            torch._foreach_add_([views[i] for i in channel.adds], [_slot(channel.incoming, b, i) for i in channel.adds])
            channel.adds = []
        channel.settled()

    def gather(self, intake: Intake) -> Intake:
        """Gradients not streamed (or changed since) copied into the host buffer on the copy stream."""
        lane, t = intake.lane, self.transport
        bucket = lane.bucket
        stream = t.streams.down(bucket.device)
        # Gradients were produced on the compute stream; the side stream must not read them earlier.
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        if bucket.shares_grad:
            lane.channel.up.wait(t.timeline, "h2d", lane.position, query=True)  # slot_copies zeroes slots on the host
        dsts, srcs = self._slot_copies(intake)
        if bucket.shares_grad:
            _after_upload(lane, stream)
        if dsts:  # (nothing copied: the last recording still covers the buffer)
            with torch.cuda.stream(stream):
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                lane.channel.sent(stream)
        return intake

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """Async copies of the master or the staging copy on the upload stream, then an event the next kernel on
        this bucket waits for."""
        bucket, t = lane.bucket, self.transport
        params = bucket.params if len(indices) == len(bucket.params) else [bucket.params[i] for i in indices]
        stream = t.streams.up(bucket.device)
        if srcs is None:
            srcs = bucket.upload_views
        tl = t.timeline
        # no_grad here, not at the callers: grad mode is per thread, and overlap_step uploads from its worker.
        with torch.no_grad(), torch.cuda.stream(stream), NOTHING if tl is None else tl.span("copy", "h2d",
                                                                                         lane.position):
            torch._foreach_copy_(params, [srcs[i] for i in indices], non_blocking=True)
        lane.channel.up.record(stream)

    # -- uploads in backward (delayed_update) ----------------------------------------------------------------------
    def stage(self, lane: Lane, src: torch.Tensor, lanes: Sequence[Lane], label: str) -> Optional[Staged]:
        """Copy a delayed update's new parameters (``src``, flat in the bucket's layout, in pinned
        host memory) up into the lane's device buffer, in one copy, from the worker or backward's hooks, while
        backward goes on; the parameters are not touched (``step()`` copies device to device, then
        :meth:`Staged.release` gives the memory back). Only where the device has room for it beyond the transport's
        ``staging_margin`` (None: never) and the gradients backward has still to make (the buckets not sent yet);
        None otherwise (``step()`` uploads from the host, as without it). ``label``: the copy's name in the
        timeline."""
        bucket, t = lane.bucket, self.transport
        device = bucket.device
        nbytes = bucket.layout.padded_numel * bucket.dtype.itemsize
        if not room_in_backward(t, device, nbytes, lanes):
            return None
        stream = t.streams.up(device)
        channel = lane.channel
        staged = channel.staged
        # (Its memory comes from the upload stream, which alone uses it: given back, it is reused only by later
        # work there.)
        tl = t.timeline
        with torch.cuda.stream(stream), NOTHING if tl is None else tl.span("copy", label, lane.position):
            try:
                if staged is None:
                    flat = torch.empty(bucket.layout.padded_numel, dtype=bucket.dtype, device=device)
                    staged = channel.staged = Staged(flat, bucket.slot_views(flat), torch.cuda.Event())
                else:
                    staged.flat.untyped_storage().resize_(nbytes)
            except torch.cuda.OutOfMemoryError:
                return None
            staged.flat.copy_(src[: staged.flat.numel()], non_blocking=True)
            staged.done.record(stream)
        return staged

    def finish(self, lanes: Sequence[Lane]) -> None:
        """The next forward must read the parameters only after their uploads have landed: the compute stream
        waits for the upload stream's work so far (an event), the host does not wait."""
        t = self.transport
        for device in {lane.bucket.device for lane in lanes}:
            torch.cuda.current_stream(device).wait_stream(t.streams.up(device))


class Staged:
    """A lane's upload in backward: its device buffer (flat, the bucket's layout), the buffer's per-parameter views
    (what ``step()`` copies from), and the event after its copy (until which the host memory it read must not be
    written). The buffer and its views are made once; between uploads the buffer holds no memory (its storage is
    resized to nothing, as FSDP frees its unsharded parameters), so nothing is kept on the device across steps."""

    __slots__ = ("flat", "views", "done")

    def __init__(self, flat: torch.Tensor, views: List[torch.Tensor], done) -> None:
        self.flat, self.views, self.done = flat, views, done

    def release(self) -> None:
        """Give the device memory back (after ``step()``'s copy was enqueued on the upload stream, or the upload
        was waited for): the next allocation on that stream is ordered after what reads it."""
        self.flat.untyped_storage().resize_(0)


def room_in_backward(transport: Any, device: torch.device, nbytes: int, lanes: Sequence[Lane]) -> bool:
    """Whether ``device`` has room, during backward, for ``nbytes`` more beyond the transport's ``staging_margin``
    (None: no such uploads, ``uploads_in_backward=False``) and the gradients backward has still to make (those of the
    streamed buckets of ``lanes`` not sent yet)."""
    if transport.staging_margin is None:
        return False
    coming = sum(o.bucket.layout.numel * o.bucket.dtype.itemsize for o in lanes
                 if o.streamed and not o.arrival.launches and o.bucket.device == device)
    return device_room(device) >= nbytes + coming + transport.staging_margin


def device_room(device: torch.device) -> int:
    """Bytes the device can still hand out to this process: what it may hold (:func:`device_capacity`) less what is
    allocated."""
    return device_capacity(device) - int(torch.cuda.memory_allocated(device))


def device_capacity(device: torch.device) -> int:
    """Bytes this process may hold on ``device`` now: the driver's free memory plus what the caching allocator holds,
    at most the allocator's cap. A process capped with ``torch.cuda.set_per_process_memory_fraction`` (sharing the
    GPU, or standing in for a smaller one, as the lease plan's capped rows do) gets an out-of-memory error beyond
    that cap however much the driver has free, so the free memory alone would promise room that is not there."""
    free, total = torch.cuda.mem_get_info(device)
    held = int(torch.cuda.memory_reserved(device))
    fraction = _memory_fraction(device)
    return int(free + held) if fraction >= 1.0 else min(int(free + held), int(fraction * total))


def _memory_fraction(device: torch.device) -> float:
    """The caching allocator's per-process memory fraction of ``device`` (1.0: uncapped, and on torch < 2.6, which
    cannot tell)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(device))


def _after_upload(lane: Lane, stream) -> None:
    """A gradient buffer that also carries the parameters out (``FlatBucket.shares_grad``) is written again only
    after the last upload has read it: ``stream``, about to copy gradients into it, waits for that."""
    event = lane.channel.up.event
    if lane.bucket.shares_grad and event is not None:
        stream.wait_event(event)


def _slot(flat: torch.Tensor, bucket, i: int) -> torch.Tensor:
    """Parameter ``i``'s slot in another flat buffer laid out like the bucket's gradient buffer."""
    return view_like(flat, bucket.layout.offsets[i], bucket.params[i])
