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

from typing import List, Optional, Sequence

import torch

from zero_offload._compat import foreach_norm_fp32
from zero_offload.host_memory import empty_host
from zero_offload.lane import Lane
from zero_offload.state.layout import view_like
from zero_offload.timeline import NOTHING
from zero_offload.transport.base import Route
from zero_offload.transport.host import HostRoute

__all__ = ["DeviceTierRoute", "OffloadRoute", "Staged", "device_room"]


class DeviceTierRoute(HostRoute):
    """A GPU bucket whose state stays on the GPU: read in place and updated there by torch's fused AdamW."""

    upload_reads = True  # (its update runs on the GPU, not by a queued native call)


class OffloadRoute(Route):
    """A GPU bucket whose state lives on the host (see the module docstring)."""

    speculates = True

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        bucket, t = lane.bucket, self.transport
        stream = t.streams.get(bucket.device) or t.stream(bucket.device)
        if any(add) and lane.incoming is None:
            lane.incoming = empty_host(bucket.layout.padded_numel, bucket.dtype, pin=bucket.pin)
        views = bucket.grads.grad_views
        landing = [_slot(lane.incoming, bucket, i) if a else views[i] for i, a in zip(idx, add)]
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        if bucket.shares_grad:
            _after_upload(lane, stream)
        with torch.cuda.stream(stream):
            launched = set(idx)
            if grads and not any(add) and all(i in launched for i, has in enumerate(lane.sent) if has):
                # The bucket's squared norm, on the GPU, and to the host before the gradients themselves: step()'s
                # checks (and speculation's early stops) read it without waiting for any gradient copy. Only when
                # this launch carries all of the bucket's gradients (not when they are summed on the host with an
                # earlier micro-batch's).
                norms = foreach_norm_fp32(grads)
                lane.norm = torch.stack(norms).double().square().sum()
                if lane.norm_host is None:
                    lane.norm_host = empty_host(1, torch.float64, pin=bucket.pin)
                lane.norm_host.copy_(lane.norm.view(1), non_blocking=True)
                if lane.norm_ev is None:
                    lane.norm_ev = torch.cuda.Event()
                lane.norm_ev.record(stream)
            else:
                lane.norm = None
            if grads:
                torch._foreach_copy_(landing, grads, non_blocking=True)
            if lane.d2h is None:
                lane.d2h = torch.cuda.Event()
            lane.d2h.record(stream)
            lane.d2h_gen += 1
        lane.adds = [i for i, a in zip(idx, add) if a]
        lane.unsettled = True
        if t.release:
            for g in grads:
                g.record_stream(stream)

    def wait(self, lane: Lane) -> None:
        if lane.d2h_gen != lane.d2h_seen:
            lane.wait_d2h(self.transport.timeline)
        if lane.adds:
            b = lane.bucket
            views = b.grads.grad_views
            torch._foreach_add_([views[i] for i in lane.adds], [_slot(lane.incoming, b, i) for i in lane.adds])
            lane.adds = []
        lane.unsettled = False

    def gather(self, lane: Lane) -> None:
        """Gradients not streamed (or changed since) copied into the host buffer on the copy stream."""
        bucket, t = lane.bucket, self.transport
        lane.in_place = None
        stream = t.streams.get(bucket.device) or t.stream(bucket.device)
        # Gradients were produced on the compute stream; the side stream must not read them earlier.
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        if bucket.shares_grad and lane.h2d_gen != lane.h2d_seen:
            lane.wait_h2d(t.timeline)  # slot_copies zeroes slots on the host
        dsts, srcs = self._slot_copies(lane)
        if bucket.shares_grad:
            _after_upload(lane, stream)
        if dsts:  # (nothing copied: the last recording still covers the buffer)
            with torch.cuda.stream(stream):
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                lane.record_d2h(stream)

    def upload(self, lane: Lane, indices: Sequence[int], srcs: Optional[Sequence[torch.Tensor]]) -> None:
        """Async copies of the master or the staging copy on the upload stream, then an event the next kernel on
        this bucket waits for."""
        bucket, t = lane.bucket, self.transport
        params = bucket.params if len(indices) == len(bucket.params) else [bucket.params[i] for i in indices]
        stream = t.upload_streams.get(bucket.device) or t.stream(bucket.device, upload=True)
        if srcs is None:
            srcs = bucket.upload_views
        tl = t.timeline
        # no_grad here, not at the callers: grad mode is per thread, and overlap_step uploads from its worker.
        with torch.no_grad(), torch.cuda.stream(stream), NOTHING if tl is None else tl.span("copy", "h2d",
                                                                                         lane.position):
            torch._foreach_copy_(params, [srcs[i] for i in indices], non_blocking=True)
        if lane.h2d is None:
            lane.h2d = torch.cuda.Event()
        lane.h2d.record(stream)
        lane.h2d_gen += 1

    # -- speculative uploads (zero_offload.speculation) -------------------------------------------------------------
    def stage(self, lane: Lane, src: torch.Tensor, lanes: Sequence[Lane], label: str) -> Optional[Staged]:
        """Copy a speculative or delayed update's new parameters (``src``, flat in the bucket's layout, in pinned
        host memory) up into the lane's device buffer, in one copy, from the worker or backward's hooks, while
        backward goes on; the parameters are not touched (the commit copies device to device, then
        :meth:`Staged.release` gives the memory back). Only where the device has room for it beyond the transport's
        ``staging_margin`` (None: never) and the gradients backward has still to make (the buckets not sent yet);
        None otherwise (the commit uploads from the host, as without it). ``label``: the copy's name in the
        timeline."""
        bucket, t = lane.bucket, self.transport
        if t.staging_margin is None:
            return None
        device = bucket.device
        nbytes = bucket.layout.padded_numel * bucket.dtype.itemsize
        coming = sum(o.bucket.layout.numel * o.bucket.dtype.itemsize for o in lanes
                     if o.streamed and not o.launches and o.bucket.device == device)
        if device_room(device) < nbytes + coming + t.staging_margin:
            return None
        stream = t.upload_streams.get(device) or t.stream(device, upload=True)
        staged = lane.staged
        # (Its memory comes from the upload stream, which alone uses it: given back, it is reused only by later
        # work there.)
        tl = t.timeline
        with torch.cuda.stream(stream), NOTHING if tl is None else tl.span("copy", label, lane.position):
            try:
                if staged is None:
                    flat = torch.empty(bucket.layout.padded_numel, dtype=bucket.dtype, device=device)
                    staged = lane.staged = Staged(flat, bucket.slot_views(flat), torch.cuda.Event())
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
            torch.cuda.current_stream(device).wait_stream(t.upload_streams.get(device) or t.stream(device, True))


class Staged:
    """A lane's speculative upload: its device buffer (flat, the bucket's layout), the buffer's per-parameter views
    (what the commit copies from), and the event after its copy (until which the host memory it read must not be
    written). The buffer and its views are made once; between uploads the buffer holds no memory (its storage is
    resized to nothing, as FSDP frees its unsharded parameters), so nothing is kept on the device across steps."""

    __slots__ = ("flat", "views", "done")

    def __init__(self, flat: torch.Tensor, views: List[torch.Tensor], done) -> None:
        self.flat, self.views, self.done = flat, views, done

    def release(self) -> None:
        """Give the device memory back (after the commit's copy was enqueued on the upload stream, or the upload
        was waited for): the next allocation on that stream is ordered after what reads it."""
        self.flat.untyped_storage().resize_(0)


def device_room(device: torch.device) -> int:
    """Bytes the device can still hand out: free memory plus what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _after_upload(lane: Lane, stream) -> None:
    """A gradient buffer that also carries the parameters out (``FlatBucket.shares_grad``) is written again only
    after the last upload has read it: ``stream``, about to copy gradients into it, waits for that."""
    if lane.bucket.shares_grad and lane.h2d is not None:
        stream.wait_event(lane.h2d)


def _slot(flat: torch.Tensor, bucket, i: int) -> torch.Tensor:
    """Parameter ``i``'s slot in another flat buffer laid out like the bucket's gradient buffer."""
    return view_like(flat, bucket.layout.offsets[i], bucket.params[i])
