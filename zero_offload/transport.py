"""Every byte that moves between the device and the host buffers: gradients down (from backward hooks or at
``step()``), updated parameters up, and the side streams and events that order those copies. The one owner of
streams and events; :mod:`zero_offload.distributed` extends it with the collectives of a sharded optimizer.

A bucket's trip: :meth:`Transport.send_grads` (called by :mod:`zero_offload.grad_stream` when backward has made a
bucket's gradients final) starts the copy; at ``step()``, :meth:`Transport.receive` hands over one
:class:`BucketGrads` per bucket, :meth:`Transport.gather` makes every gradient readable on the host (and checks
them), the kernel updates the bucket (:mod:`zero_offload.update`), and :meth:`Transport.send_params` sends the
result back while the next bucket is updated.

* On CUDA, a copy stream waits for the compute stream, copies the bucket's gradients device-to-host into its
  pinned flat buffer and records one event; the bucket's squared norm (for clipping and the inf/nan check) is
  computed on the GPU on the same stream, so ``step()`` combines every bucket's with one synchronisation. With
  ``release``, each gradient is handed to the copy stream (``record_stream``, so the caching allocator does not
  reuse its memory before the copy has read it) and ``p.grad`` is set to None. Uploads run on a second stream,
  so they never queue behind gradient copies.
* On CPU, the same ordering with plain copies (this is what CPU-only CI exercises).

**Accumulation.** Without ``no_sync`` every backward streams: with ``release`` each later copy is *added* to what
the host buffer already holds for this step (fp32 gradients add exactly as they would on the GPU); without it
the host copy is simply refreshed from ``.grad``, which accumulated on the device.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from itertools import chain, repeat
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from zero_offload import functional
from zero_offload._compat import foreach_norm_fp32, increment_version
from zero_offload.buckets import FlatBucket
from zero_offload.grads import check_grads
from zero_offload.records import BucketGrads, PendingClip, Plans
from zero_offload.state.layout import view_like
from zero_offload.host_memory import copy_many_, empty_host
from zero_offload.timeline import Timeline, span

__all__ = ["BucketGrads", "PendingClip", "Plans", "Transport", "record_event"]


class _Link:
    """What the transport knows of one bucket: the copies and collectives in flight, and what backward sent this
    step."""

    __slots__ = ("bucket", "streamed", "present", "had", "launches", "sources", "adds", "incoming", "norm", "d2h",
                 "h2d", "stale", "norm_host", "d2h_gen",
                 "d2h_seen", "h2d_gen", "h2d_seen")

    def __init__(self, bucket: FlatBucket, streamed: bool):
        self.bucket, self.streamed = bucket, streamed
        n = len(bucket.params)
        self.present: List[bool] = [False] * n  # holds a gradient sent in this step's backward
        self.had: List[bool] = list(self.present)  # ``present`` of the last step that had any
        self.launches = 0
        # Without release: the gradient tensor and its version at the copy, to notice later in-place edits
        # (GradScaler.unscale_, torch.nn.utils.clip_grad_norm_) that the host copy has not seen.
        self.sources: List[Optional[tuple]] = [None] * n
        self.adds: List[int] = []  # CUDA: slots whose copy landed in ``incoming`` and must be added to ``grad``
        self.incoming: Optional[torch.Tensor] = None  # CUDA: landing buffer for copies that accumulate
        self.norm: Optional[torch.Tensor] = None  # CUDA: squared norm of the bucket, valid after one launch
        self.d2h = None  # torch.cuda.Event after the last gradient copy to the host
        self.h2d = None  # torch.cuda.Event after the last upload had read master/staging
        self.stale = False  # sharded: this rank's gradients changed after backward reduce-scattered them
        self.norm_host: Optional[torch.Tensor] = None  # with ``host_norms``: ``norm``, copied before ``d2h``
        # How often d2h/h2d was recorded, and the recording the host last waited for: an event waited for and not
        # recorded since is complete, so waiting again would be a host call for nothing.
        self.d2h_gen = self.d2h_seen = self.h2d_gen = self.h2d_seen = 0

    def clear(self) -> None:
        if any(self.present):
            self.had = self.present
        self.present = [False] * len(self.present)
        self.launches = 0
        self.sources = [None] * len(self.sources)
        self.adds = []
        self.norm = None
        self.stale = False


class Transport:
    """The transfers of one optimizer whose buckets are not sharded (see the module docstring).

    Args:
        release (bool): set ``p.grad`` to None once a gradient is on its way to the host.
    """

    sharded = False
    # Copy each streamed bucket's GPU norm to the host before its d2h event, so a reader that waited for the
    # gradients has it too, without a device synchronisation (speculation's early stops read it).
    host_norms = False

    def __init__(self, *, release: bool):
        self.release = release
        self.timeline: Optional[Timeline] = None  # OffloadOptimizer.record_timeline()
        self._links: Dict[int, _Link] = {}
        # Per device: the stream of the copies off the GPU (and a sharded bucket's reduce-scatter), and the stream
        # of the uploads back (and all-gathers).
        self._streams: Dict[torch.device, object] = {}
        self._upload_streams: Dict[torch.device, object] = {}
        self.arrivals: List[FlatBucket] = []  # the buckets backward sent in this step, in the order it sent them

    def add(self, bucket: FlatBucket, streamed: bool) -> None:
        """Take charge of a new bucket; ``streamed``: backward sends its gradients (:meth:`send_grads`)."""
        self._links[id(bucket)] = _Link(bucket, streamed)

    def unstream(self, bucket: FlatBucket) -> None:
        """Backward no longer sends the bucket's gradients (it moved to the device tier, between steps)."""
        link = self._links[id(bucket)]
        link.streamed, link.incoming, link.norm_host = False, None, None  # (host buffers it no longer needs)

    def sent(self, bucket: FlatBucket) -> List[bool]:
        """Which of the bucket's parameters had a gradient sent in this step's backward."""
        return list(self._links[id(bucket)].present)

    def launched(self, bucket: FlatBucket) -> bool:
        """Whether backward sent the bucket's gradients in this step."""
        return self._links[id(bucket)].launches > 0

    def record_d2h(self, bucket: FlatBucket, stream) -> None:
        """Mark, on ``stream``, the point after which the bucket's host gradients hold what was sent."""
        link = self._links[id(bucket)]
        link.d2h = record_event(link.d2h, stream)
        link.d2h_gen += 1

    def record_h2d(self, bucket: FlatBucket, stream) -> None:
        """Mark, on ``stream``, the point after which the bucket's last upload has read master and staging."""
        link = self._links[id(bucket)]
        link.h2d = record_event(link.h2d, stream)
        link.h2d_gen += 1

    def stream(self, device: torch.device, upload: bool = False):
        streams = self._upload_streams if upload else self._streams
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = torch.cuda.Stream(device=device)
        return stream

    def bind(self, bucket: FlatBucket) -> None:
        """Make CPU parameters views of their slots (see :meth:`~zero_offload.state.params.Masters.bind`)."""
        bucket.masters.fill_param_slots()
        bucket.masters.bind()

    # -- gradients, from backward ----------------------------------------------------------------------------
    def send_grads(self, bucket: FlatBucket) -> None:
        """Start sending the bucket's gradients (those on its parameters now) to the host."""
        link = self._links[id(bucket)]
        self._settle(link)
        if not link.launches:
            self.arrivals.append(bucket)
        idx = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        grads = [bucket.params[i].grad for i in idx]
        check_grads(grads, [bucket.params[i] for i in idx], label=lambda k: bucket.label(idx[k]))
        with span(self.timeline, "copy", "d2h", bucket):
            self._send(link, idx, grads)
        for i, g in zip(idx, grads):
            link.present[i] = True
            bucket.grads.filled(i)
            if not self.release:
                link.sources[i] = (g, g._version)
        if self.release:
            for i in idx:
                bucket.params[i].grad = None
        link.launches += 1

    def _send(self, link: _Link, idx: List[int], grads: List[torch.Tensor]) -> None:
        # With release, a slot already holding this step's gradient is added to; otherwise it is overwritten.
        add = [self.release and link.present[i] for i in idx]
        (self._send_cpu if link.bucket.resident else self._send_cuda)(link, idx, grads, add)

    @staticmethod
    def _send_cpu(link: _Link, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        views, numels = link.bucket.grad_views, link.bucket.layout.numels
        copy = [k for k, a in enumerate(add) if not a]
        if copy:
            copy_many_([views[idx[k]] for k in copy], [grads[k] for k in copy], [numels[idx[k]] for k in copy])
        summed = [k for k, a in enumerate(add) if a]
        if summed:
            torch._foreach_add_([views[idx[k]] for k in summed], [grads[k] for k in summed])

    def _send_cuda(self, link: _Link, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        bucket = link.bucket
        stream = self.stream(bucket.device)
        if any(add) and link.incoming is None:
            link.incoming = empty_host(bucket.layout.padded_numel, bucket.dtype, pin=bucket.pin)
        landing = [_slot(link.incoming, bucket, i) if a else bucket.grad_views[i] for i, a in zip(idx, add)]
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        self._after_upload(link, stream)
        with torch.cuda.stream(stream):
            if grads:
                torch._foreach_copy_(landing, grads, non_blocking=True)
            launched = set(idx)
            if grads and not any(add) and all(i in launched for i, has in enumerate(link.present) if has):
                # The bucket's squared norm, on the GPU, while the copies run: step() reads every bucket's in one
                # synchronisation. Only when this launch carries all of the bucket's gradients (not when it is
                # summed on the host with an earlier micro-batch's).
                norms = foreach_norm_fp32(grads)
                link.norm = torch.stack(norms).double().square().sum()
                if self.host_norms:
                    if link.norm_host is None:
                        link.norm_host = empty_host(1, torch.float64, pin=bucket.pin)
                    link.norm_host.copy_(link.norm.view(1), non_blocking=True)
            else:
                link.norm = None
            self.record_d2h(bucket, stream)
        link.adds = [i for i, a in zip(idx, add) if a]
        if self.release:
            for g in grads:
                g.record_stream(stream)

    def _settle(self, link: _Link) -> None:
        """Wait for the bucket's copies and add any that landed in ``incoming`` to its gradient buffer."""
        if link.bucket.resident:
            return
        self.wait_grads(link.bucket)
        if link.adds:
            b = link.bucket
            torch._foreach_add_([b.grad_views[i] for i in link.adds], [_slot(link.incoming, b, i) for i in link.adds])
            link.adds = []

    def wait_grads(self, bucket: FlatBucket) -> None:
        """Wait until the bucket's host gradient buffer holds what was sent."""
        link = self._links[id(bucket)]
        gen = link.d2h_gen
        if link.d2h is not None and link.d2h_seen != gen:
            with span(self.timeline, "wait", "d2h", bucket):
                link.d2h.synchronize()
            link.d2h_seen = gen  # (if recorded again meanwhile, the newer recording is still to be waited for)

    def host_norm(self, bucket: FlatBucket) -> Optional[float]:
        """The squared norm of the gradients backward streamed for the bucket, read on the host (None: not
        known). Only after :meth:`wait_grads`, and with :attr:`host_norms`."""
        link = self._links[id(bucket)]
        if link.bucket.resident or link.norm is None or link.norm_host is None:
            return None
        return float(link.norm_host[0])

    # -- gradients, at step() --------------------------------------------------------------------------------
    def receive(self, bucket: FlatBucket, *, fresh: bool = False) -> BucketGrads:
        """The bucket's gradients for this step. Streamed ones are waited for; a gradient assigned or edited in
        place after its copy (without ``release``: ``GradScaler.unscale_``, ``torch.nn.utils.clip_grad_norm_``)
        is left pending, to be read again. With ``fresh`` (and without ``release``) every gradient still on its
        parameter is read again: ``GradScaler.unscale_`` rewrites gradients without bumping their version."""
        grads = bucket.collect_grads()
        link = self._links[id(bucket)]
        if not link.streamed or not (link.launches or any(link.present)):
            return BucketGrads(bucket, [g is not None for g in grads], grads)
        self._settle(link)
        present: List[bool] = []
        pending: List[Optional[torch.Tensor]] = []
        for i, g in enumerate(grads):
            if g is None:
                present.append(link.present[i] and self.release)
                pending.append(None)
            elif self.release or not link.present[i]:
                present.append(True)
                pending.append(g)  # assigned after the stream: gathered like any gradient (overwrites the slot)
            else:
                src = link.sources[i]
                same = not fresh and src is not None and src[0] is g and src[1] == g._version
                present.append(True)
                pending.append(None if same else g)
        # A gradient changed or dropped since its launch: the streamed norm (a sharded bucket's reduced sum) is
        # stale.
        stale = any(t is not None for t in pending) or any(was and not has for has, was in zip(present, link.present))
        if stale:
            link.norm = None
        link.stale = stale
        return BucketGrads(bucket, present, pending, stale=stale)

    def gather(self, plans: Plans, check: bool = False, clipping: bool = False,
               settings: Sequence[Tuple[str, float]] = ()) -> bool:
        """Make every bucket's gradients readable on the host (a CUDA bucket's copied into its buffer; a CPU
        bucket's where they are, in ``in_place``); with ``check``, return whether any is inf/nan. A CPU bucket is
        checked right after its own gather, when whatever it copied is still in cache. ``clipping``: called by
        ``clip_grad_norm_`` (which the sharded transport checks every rank does). ``settings``: what the step
        uses, as (name, value) pairs, which the sharded transport checks every rank agrees on."""
        entries = list(chain.from_iterable(plans))
        waited = set()
        # CUDA copies are only enqueued, so they go first and overlap the CPU buckets' copies.
        for bg in entries:
            bucket = bg.bucket
            if bucket.resident:
                continue
            stream = self.stream(bucket.device)
            if bucket.device not in waited:
                # Gradients were produced on the compute stream; the side stream must not read them earlier.
                stream.wait_stream(torch.cuda.current_stream(bucket.device))
                waited.add(bucket.device)
            self._gather_cuda(bg, stream)
        bad = False
        for bg in entries:
            if bg.bucket.resident:
                bg.in_place = self._gather_cpu(bg)
                if check and not bad and not bg.bucket.device_tier:
                    bad = bg.host_sq_norm()[1]
        if check and not bad:
            bad = _device_tier_norm(entries)[1]
        if check and not bad:
            bad = self._cuda_nonfinite([bg for bg in entries if not bg.bucket.resident])
        return bad

    def _cuda_nonfinite(self, entries: List[BucketGrads]) -> bool:
        gpu_norms = self.streamed_norms(entries)  # one synchronisation for every streamed bucket
        if any(not math.isfinite(v) for v in gpu_norms.values()):
            return True
        for bg in entries:
            if id(bg.bucket) not in gpu_norms:
                self.wait_grads(bg.bucket)
                if functional.grad_sq_norm(bg.bucket.grad)[1]:
                    return True
        return False

    def _gather_cuda(self, bg: BucketGrads, stream) -> None:
        bucket = bg.bucket
        if bucket.shares_grad:
            self.before_update(bucket)  # _slot_copies zeroes slots on the host
        dsts, srcs = self._slot_copies(bg)
        self._after_upload(self._links[id(bucket)], stream)
        if dsts:  # (nothing copied: the last recording still covers the buffer)
            with torch.cuda.stream(stream):
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                self.record_d2h(bucket, stream)

    @staticmethod
    def _slot_copies(bg: BucketGrads) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Zero the slots of absent gradients; return the (slot, gradient) copies still to make."""
        bucket, views = bg.bucket, bg.bucket.grad_views
        dsts, srcs = [], []
        for i, (has, g) in enumerate(zip(bg.present, bg.pending)):
            if not has:
                bucket.grads.clear(i)
                continue
            bucket.grads.filled(i)
            if g is not None and g is not views[i]:  # (in its slot already: a view from zero_grad(False))
                dsts.append(views[i])
                srcs.append(g)
        return dsts, srcs

    def _gather_cpu(self, bg: BucketGrads) -> Optional[List[Optional[torch.Tensor]]]:
        """A CPU bucket's gradients for the kernel: None when the flat buffer holds every one (each is its slot,
        or absent); otherwise the tensors the kernel reads in place (see :meth:`_in_place`). Streamed buckets
        copy into the buffer, where the streamed gradients already are."""
        bucket = bg.bucket
        if not bucket.grads.allocated:  # a device-tier bucket whose gradients are all read where they are
            return self._in_place(bg) if any(g is not None for g in bg.pending) else None
        views = bucket.grad_views
        if all(map(operator.is_, bg.pending, views)):
            # The zero_grad(set_to_none=False) steady state: backward accumulated into the slots already.
            bucket.grads.all_filled()
            return None
        if not self._links[id(bucket)].streamed and any(g is not None and g is not v
                                                         for g, v in zip(bg.pending, views)):
            return self._in_place(bg)
        dsts, srcs = self._slot_copies(bg)
        if dsts:
            copy_many_(dsts, srcs, [d.numel() for d in dsts])
        return None

    @staticmethod
    def _in_place(bg: BucketGrads) -> List[Optional[torch.Tensor]]:
        """Each gradient where the kernel can read it: itself where it is contiguous like its slot, else the
        slot's flat range after a copy into it (a channels-last or transposed gradient). Copying fresh gradients
        into the buffer first would add 8 bytes of memory traffic per element to the update's 28. Returned as
        checked: they passed ``collect_grads`` (dense, the parameter's shape), are contiguous, and autograd gives a
        CPU parameter's gradient its dtype and device."""
        bucket, grads = bg.bucket, bg.pending
        offsets, numels = bucket.layout.offsets, bucket.layout.numels
        # (A device-tier bucket's buffer may not exist: then no gradient is its slot.)
        views = bucket.grad_views if bucket.grads.allocated else [None] * len(grads)
        # The usual case, checked in C-level loops: every gradient fresh, present and contiguous like its slot.
        if (bucket.grads.all_slots_contiguous and not any(map(operator.is_, grads, repeat(None)))
                and not any(map(operator.is_, grads, views)) and all(map(torch.Tensor.is_contiguous, grads))):
            return functional.CheckedGrads(grads)
        out: List[Optional[torch.Tensor]] = []
        dsts, srcs, sizes = [], [], []
        for i, g in enumerate(grads):
            if g is None:
                out.append(None)
            elif g is not views[i] and bucket.grads.slot_contiguous[i] and g.is_contiguous():
                out.append(g)
            else:
                # The state's slots have the parameter's memory order; a gradient in any other order (or already
                # in its slot) is read from the slot, whose flat range is in that order.
                flat, views = bucket.grad, bucket.grad_views
                if g is not views[i]:
                    dsts.append(views[i])
                    srcs.append(g)
                    sizes.append(numels[i])
                bucket.grads.filled(i)
                out.append(flat[offsets[i] : offsets[i] + numels[i]])
        if dsts:
            copy_many_(dsts, srcs, sizes)
        return functional.CheckedGrads(out)

    def check_scaler(self, plans: Plans) -> None:
        """A GradScaler finds infs in, and unscales, the gradients on the parameters: released ones it never saw."""
        if self.release and any(has and g is None for bg in chain.from_iterable(plans)
                                for has, g in zip(bg.present, bg.pending)):
            raise RuntimeError(
                "OffloadOptimizer: a GradScaler drives this step, but the gradients were released from the "
                "parameters as backward streamed them (release_grads=True), so the scaler could not check them for "
                "inf/nan. Pass release_grads=False to use a GradScaler (or use bf16 autocast, which needs none). "
                "Nothing was updated."
            )

    def streamed_norms(self, entries: Sequence[BucketGrads]) -> Dict[int, float]:
        """The GPU-computed squared norms of the streamed buckets among ``entries`` (keyed by ``id(bucket)``),
        fetched with one synchronisation per device."""
        by_device: Dict[torch.device, List[tuple]] = {}
        for bg in entries:
            link = self._links.get(id(bg.bucket))
            if link is not None and link.norm is not None:
                by_device.setdefault(link.norm.device, []).append((id(bg.bucket), link.norm))
        out: Dict[int, float] = {}
        for items in by_device.values():
            with span(self.timeline, "wait", "norms"):
                out.update(zip((k for k, _ in items), torch.stack([n for _, n in items]).cpu().tolist()))
        return out

    def agree(self, settings: Sequence[Tuple[str, float]]) -> None:
        """``step()`` after ``clip_grad_norm_``: the sharded transport checks the ranks agree on ``settings``."""

    def wait_all(self, plans: Plans) -> None:
        for bg in chain.from_iterable(plans):
            self.wait_grads(bg.bucket)

    def total_norm(self, plans: Plans, norm_type: float) -> Tuple[float, bool]:
        """``clip_grad_norm_``'s total norm of the gathered gradients, and whether any is inf/nan."""
        entries = list(chain.from_iterable(plans))
        if norm_type == 2.0:
            # Streamed GPU buckets brought their squared norms along (one synchronisation for all of them).
            gpu_norms = self.streamed_norms([bg for bg in entries if not bg.bucket.resident])
            self.wait_all(plans)
            sq, nonfinite = _device_tier_norm(entries)  # (one synchronisation for the device tier too)
            for bg in entries:
                if bg.bucket.device_tier:
                    continue
                if id(bg.bucket) in gpu_norms:
                    s = gpu_norms[id(bg.bucket)]
                    bad = not math.isfinite(s)
                else:
                    s, bad = bg.host_sq_norm()
                sq, nonfinite = sq + s, nonfinite or bad
            return math.sqrt(sq), nonfinite
        self.wait_all(plans)
        # Padding is zero in the gradient buffers, so it changes neither a max nor a p-norm.
        host = [t for bg in entries for t in bg.host_grads() if t.numel()]
        if norm_type == math.inf:
            return max((float(t.abs().max()) for t in host), default=0.0), False
        norms = [torch.linalg.vector_norm(t.float(), norm_type) for t in host]
        return (float(torch.linalg.vector_norm(torch.stack(norms), norm_type)) if norms else 0.0), False

    def describe_nonfinite(self, plans: Plans, names: Sequence[Optional[Sequence[str]]]) -> str:
        """Which parameter holds the first inf/nan gradient, for an error message (``names``: each group's
        ``param_names``, or None)."""
        for gi, group_plan in enumerate(plans):
            for bg in group_plan:
                bucket = bg.bucket
                for i, has in enumerate(bg.present):
                    if not has:
                        continue
                    host = bucket.grad_views[i] if bg.in_place is None else bg.in_place[i]
                    if host is not None and not bool(torch.isfinite(host).all()):
                        j = bucket.layout.indices[i]
                        label = f" ({names[gi][j]!r})" if names[gi] else ""
                        return f"param group {gi}, parameter {j}{label} of shape {tuple(bucket.params[i].shape)}"
        return "the gradients"

    # -- parameters, back ------------------------------------------------------------------------------------
    def before_uploads(self, buckets: Iterable[FlatBucket]) -> None:
        """Uploads overwrite the parameters, so their stream first waits for what the compute stream has queued
        since backward, which may still read them (an EMA of the weights, a norm for logging, an eval forward
        before ``state_dict()``). Not needed for ``overlap_step``'s uploads in backward: every use of a parameter
        was queued before the hook that found its gradient final."""
        for device in {b.device for b in buckets if not b.resident}:
            self.stream(device, upload=True).wait_stream(torch.cuda.current_stream(device))

    @staticmethod
    def _after_upload(link: _Link, stream) -> None:
        """A gradient buffer that also carries the parameters out (``FlatBucket.shares_grad``) is written again
        only after the last upload has read it: ``stream``, about to copy gradients into it, waits for that."""
        if link.bucket.shares_grad and link.h2d is not None:
            stream.wait_event(link.h2d)

    def before_update(self, bucket: FlatBucket) -> None:
        """Wait until the bucket's last upload has read master and staging, which the kernel is about to write.
        (Usually it has long since: ``query`` first, which does not block.)"""
        link = self._links[id(bucket)]
        gen = link.h2d_gen
        if link.h2d is not None and link.h2d_seen != gen:
            if not link.h2d.query():
                with span(self.timeline, "wait", "h2d", bucket):
                    link.h2d.synchronize()
            link.h2d_seen = gen

    def send_params(self, bucket: FlatBucket, indices: Sequence[int],
                    srcs: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Make the updated values visible in the parameters ``indices``: on CUDA, async copies of the master or
        the staging copy on the upload stream, then an event the next kernel on this bucket waits for; on CPU,
        where the kernel already wrote the parameter's storage, only the autograd version bump an in-place op would
        have made (so a stale saved tensor is still caught). ``srcs``: per parameter, where to upload from instead
        of :attr:`FlatBucket.upload_views` (a speculative update's own low-precision output)."""
        params = bucket.params if len(indices) == len(bucket.params) else [bucket.params[i] for i in indices]
        if bucket.resident:
            increment_version(params)
        else:
            stream = self.stream(bucket.device, upload=True)
            srcs = bucket.upload_views if srcs is None else srcs
            # no_grad here, not at the callers: grad mode is per thread, and overlap_step uploads from its worker.
            with torch.no_grad(), torch.cuda.stream(stream), span(self.timeline, "copy", "h2d", bucket):
                torch._foreach_copy_(params, [srcs[i] for i in indices], non_blocking=True)
            self.record_h2d(bucket, stream)
        bucket.masters.record_versions(indices)

    def finish_params(self, buckets: Iterable[FlatBucket]) -> None:
        """The next forward must read the parameters only after their uploads have landed: the compute stream
        waits for the upload stream's work so far (an event), the host does not wait."""
        for device in {b.device for b in buckets if not b.resident}:
            torch.cuda.current_stream(device).wait_stream(self.stream(device, upload=True))

    def synchronize(self) -> None:
        """Wait for copies in flight from the host buffers (before anything rewrites them)."""
        for stream in chain(self._streams.values(), self._upload_streams.values()):
            with span(self.timeline, "wait", "streams"):
                stream.synchronize()

    # -- between steps ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget what was sent for this step (after ``step()``, or at ``zero_grad()``), once it has landed."""
        self.arrivals = []
        for link in self._links.values():
            if link.launches or any(link.present) or link.adds:
                if link.bucket.sharded or not link.bucket.resident:
                    self.wait_grads(link.bucket)
                link.clear()

    def keep_zero_grads(self) -> None:
        """``zero_grad(set_to_none=False)``: CPU buckets not streamed take their gradients as views of the flat
        buffer; with ``release``, the parameters that had a gradient last step keep a zero one (AdamW still steps
        them), held as zeroed slots of the host buffer; other gradients are zeroed where they are. After
        :meth:`reset`."""
        for link in self._links.values():
            bucket = link.bucket
            if bucket.resident and not link.streamed:
                bucket.grads.zero_as_views()
                continue
            if self.release and any(link.had):
                if bucket.shares_grad:
                    self.before_update(bucket)  # the slots cleared below may still be uploading parameters
                link.present = list(link.had)
                for i, has in enumerate(link.had):
                    if has:
                        bucket.grads.clear(i)
            grads = []
            for p in bucket.params:
                if p.grad is not None:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    grads.append(p.grad)
            if grads:
                torch._foreach_zero_(grads)


def record_event(event, stream):
    """``event`` (created if None) recorded on ``stream``."""
    if event is None:
        event = torch.cuda.Event()
    event.record(stream)
    return event


def _slot(flat: torch.Tensor, bucket: FlatBucket, i: int) -> torch.Tensor:
    """Parameter ``i``'s slot in another flat buffer laid out like the bucket's gradient buffer."""
    return view_like(flat, bucket.layout.offsets[i], bucket.params[i])


def _device_tier_norm(entries: Sequence[BucketGrads]) -> Tuple[float, bool]:
    """The squared norm of the device tier's gathered gradients (``gpu_fraction``: they stay on the GPU), all
    buckets at once, and whether one is inf/nan."""
    # (A bucket with no gradient and no buffer has nothing to read: its host_grads() would make the buffer.)
    grads = [t for bg in entries if bg.bucket.device_tier and (bg.in_place is not None or bg.bucket.grads.allocated)
             for t in bg.host_grads()]
    return functional.device_sq_norm(grads) if grads else (0.0, False)
