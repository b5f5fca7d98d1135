"""Gradients leave the device while backward is still running, bucket by bucket, and the CPU step can follow them.

One :class:`GradStreamer` per optimizer. It puts a ``register_post_accumulate_grad_hook`` on every parameter of
the buckets it streams. When every parameter of a bucket that requires a gradient has fired in this backward
(or when the backward ends, for buckets some of whose parameters got no gradient), the bucket is *launched*:

* on CUDA, a dedicated copy stream waits for the compute stream, copies the bucket's gradients device-to-host
  into its pinned flat buffer, and records one event; the bucket's squared norm (for clipping and the inf/nan
  check) is computed on the GPU on the same stream, as a 0-dim tensor, so ``step()`` combines every bucket's with
  one synchronisation. With ``release``, each gradient is handed to the copy stream (``record_stream``, so the
  caching allocator does not reuse its memory before the copy has read it) and ``p.grad`` is set to None: the
  GPU holds only the gradients of buckets whose backward is still running, never all of them;
* on CPU, the same ordering with plain copies into the flat buffer (this is what CPU-only CI exercises);
* sharded over a process group (:class:`~zero_offload.buckets.ShardedBucket`), the bucket's gradients are
  flattened and their reduce-scatter is started (on CUDA, on the copy stream, followed by the copy of this rank's
  shard to the host); nothing waits for it until ``step()``. Collectives must be issued in the same order on
  every rank, whatever order the hooks fire in, so sharded buckets launch in a fixed order, the reverse of their
  construction order (the order backward usually reaches them, as DDP assumes): a bucket complete before its
  predecessors waits for them, and when backward ends every sharded bucket not yet launched is, in that order,
  so each backward reduce-scatters every bucket once on every rank.

**Checkpointing.** ``torch.utils.checkpoint(use_reentrant=True)`` runs each segment's backward as a backward of
its own, inside the outer one. The end of such a nested backward is not the end of the step's backward: buckets
left incomplete launch when the outermost backward ends.

**Accumulation.** Inside :meth:`no_sync` the hooks do nothing, so micro-batches accumulate in ``.grad`` as usual
and only the last backward streams. Without it, every backward streams: with ``release`` each later copy is
*added* to what the host buffer already holds for this step (fp32 gradients add exactly as they would on the
GPU, since a float addition gives the same bits on either side); without ``release`` the host copy is simply
refreshed from ``.grad``, which accumulated on the device.

**The update.** With ``overlap_step``, a launched bucket is also handed to a worker thread that waits for its
copy, runs the CPU kernel (the kernel releases the GIL) and enqueues its upload, while backward goes on.

The stream's state is per step: :meth:`consume` hands a bucket's gradients to ``step()`` (or ``clip_grad_norm_``)
and :meth:`reset` forgets them (after ``step()``, or at ``zero_grad()``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from zero_offload.buckets import FlatBucket, copy_many_, view_like
from zero_offload.host_memory import empty_host

__all__ = ["GradStreamer", "BucketStream"]


class BucketStream:
    """What streaming knows about one bucket during the current step."""

    __slots__ = ("bucket", "group", "epoch", "fired", "expected", "present", "had", "launches", "sources", "adds",
                 "incoming", "norm", "job", "updated", "ready")

    def __init__(self, bucket: FlatBucket, group: int):
        self.bucket = bucket
        self.group = group
        self.epoch = -1  # the backward in which ``fired`` was last counted
        self.fired = 0
        self.expected = 0
        self.present: List[bool] = [False] * len(bucket.params)  # holds a gradient for this step
        self.had: List[bool] = list(self.present)  # ``present`` of the last step that had any
        self.launches = 0
        # Without release: the gradient tensor and its version at the copy, to notice later in-place edits
        # (GradScaler.unscale_, torch.nn.utils.clip_grad_norm_) that the host copy has not seen.
        self.sources: List[Optional[tuple]] = [None] * len(bucket.params)
        self.adds: List[int] = []  # CUDA: slots whose copy landed in ``incoming`` and must be added to ``grad``
        self.incoming: Optional[torch.Tensor] = None  # CUDA: landing buffer for copies that accumulate
        self.norm: Optional[torch.Tensor] = None  # CUDA: squared norm of the bucket, valid after one launch
        self.job: Optional[Future] = None  # overlap_step: the bucket's update in the worker
        self.updated = False  # overlap_step: the bucket's update for this step has been launched
        self.ready = -1  # sharded: the backward in which the bucket became complete, waiting for its turn

    def clear(self) -> None:
        if any(self.present):
            self.had = self.present
        self.present = [False] * len(self.present)
        self.launches = 0
        self.sources = [None] * len(self.sources)
        self.adds = []
        self.norm = None
        self.job = None
        self.updated = False
        if self.bucket.sharded:
            self.bucket.launched = self.bucket.stale = False


class GradStreamer:
    """Backward hooks, the copy stream and the update worker of one optimizer (see the module docstring).

    Args:
        release (bool): set ``p.grad`` to None once a gradient is on its way to the host.
        stream_for (Callable[[torch.device], torch.cuda.Stream]): the optimizer's copy stream for a device.
        update (Callable[[BucketStream], None], optional): with ``overlap_step``, runs a launched bucket's update
            (called in the worker thread).
    """

    def __init__(self, *, release: bool, stream_for: Callable[[torch.device], object],
                 update: Optional[Callable[[BucketStream], None]] = None):
        self.release = release
        self._stream_for = stream_for
        self._update = update
        self._states: Dict[int, BucketStream] = {}  # id(bucket) -> state
        self._handles: List[object] = []
        self._no_sync = 0
        self._epoch = 0
        self._in_backward = False
        self._touched: List[BucketStream] = []
        self._sharded: List[BucketStream] = []  # sharded buckets in launch order
        self._next = 0  # how many of them this backward has launched
        self._lock = threading.Lock()
        self._pool: Optional[ThreadPoolExecutor] = None

    # -- registration --------------------------------------------------------------------------------------------
    def add(self, bucket: FlatBucket, group: int) -> None:
        state = self._states[id(bucket)] = BucketStream(bucket, group)
        if bucket.sharded:
            self._sharded.insert(0, state)  # added in construction order, launched in reverse
        for i, p in enumerate(bucket.params):
            # A frozen parameter cannot take a hook; if it is unfrozen later, its bucket launches when backward
            # ends, and its gradient is gathered at step() like any gradient assigned by hand.
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(_hook(weakref.ref(self), id(bucket), i)))

    def remove(self) -> None:
        """Unregister every hook (the optimizer's finaliser calls this; a dropped optimizer's hooks do nothing)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def state(self, bucket: FlatBucket) -> Optional[BucketStream]:
        return self._states.get(id(bucket))

    # -- backward ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def _on_grad(self, state: BucketStream, i: int) -> None:
        if self._no_sync:
            return
        with self._lock:
            # Buckets with parameters that get no gradient in this backward never complete: launch them when the
            # backward ends.
            self._arm()
            if state.epoch != self._epoch:
                state.epoch = self._epoch
                state.fired = 0
                state.expected = sum(p.requires_grad for p in state.bucket.params)
                self._touched.append(state)
            state.fired += 1
            if state.fired == state.expected:
                try:
                    if state.bucket.sharded:
                        state.ready = self._epoch
                        self._launch_in_order(upto=None)
                    else:
                        self._launch(state)
                except BaseException:
                    # The backward is aborted with this error and its end-of-backward callback will not run.
                    self._forget_backward()
                    raise

    def _end_backward(self) -> None:
        node = _current_node()
        if node is not None:
            # This backward ran inside a node of another: a reentrant backward, one per segment of
            # torch.utils.checkpoint(use_reentrant=True). The outer backward may still bring gradients of the
            # same buckets, so nothing launches now: once that node has finished, the end of the outer backward
            # is waited for instead.
            with self._lock:
                self._in_backward = False
            self._rearm_after(node)
            return
        with self._lock, torch.no_grad():
            try:
                for state in self._touched:
                    if state.fired != state.expected and not state.bucket.sharded:
                        self._launch(state)
                self._launch_in_order(upto=len(self._sharded))
            finally:
                self._forget_backward()

    def _rearm_after(self, node) -> None:
        handle = None

        def rearm(grad_inputs, grad_outputs) -> None:
            handle.remove()
            with self._lock:
                self._arm()  # (unless a hook of a later segment has queued the callback already)

        handle = node.register_hook(rearm)

    def _arm(self) -> None:
        """Have ``_end_backward`` run when the current backward finishes (a callback queued from a hook or a node
        runs then), once per backward."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _forget_backward(self) -> None:
        """The backward is over (or was aborted): the next one counts its gradients afresh."""
        self._touched, self._in_backward, self._next = [], False, 0
        self._epoch += 1

    def _launch_in_order(self, upto: Optional[int]) -> None:
        """Launch sharded buckets in their fixed order: the ready ones at the head of the line, or (``upto``)
        every one up to that position, ready or not (see the module docstring)."""
        order = self._sharded
        while self._next < len(order) and ((upto is not None and self._next < upto)
                                            or order[self._next].ready == self._epoch):
            self._next += 1
            self._launch(order[self._next - 1])

    def _launch(self, state: BucketStream) -> None:
        """Send the bucket's present gradients to the host (see the module docstring)."""
        if state.updated:
            raise RuntimeError(
                "OffloadOptimizer(overlap_step=True): a second backward before step() reached a bucket that was "
                "already updated. Run every micro-batch but the last under `with optimizer.no_sync():`."
            )
        bucket = state.bucket
        self._settle(state)
        idx = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        grads = [bucket.params[i].grad for i in idx]
        _check_dense(bucket, idx, grads)
        if bucket.sharded:
            self._launch_reduce_scatter(state, grads)
        else:
            # With release, a slot already holding this step's gradient is added to; otherwise it is overwritten.
            add = [self.release and state.present[i] for i in idx]
            (self._launch_cpu if bucket.on_cpu else self._launch_cuda)(state, idx, grads, add)
        for i, g in zip(idx, grads):
            state.present[i] = True
            bucket.grad_slot_zero[i] = False
            if not self.release:
                state.sources[i] = (g, g._version)
        if self.release:
            for i in idx:
                bucket.params[i].grad = None
        state.launches += 1
        if self._update is not None and not self._no_sync:
            state.updated = True
            state.job = self._worker().submit(self._update, state)

    def _launch_reduce_scatter(self, state: BucketStream, grads: List[torch.Tensor]) -> None:
        """Start the reduce-scatter of a sharded bucket. Its shard of the reduced sum is added to an earlier
        micro-batch's with ``release``; otherwise it is recomputed from the gradients accumulated on the
        parameters."""
        bucket = state.bucket
        stream = None if bucket.on_cpu else self._stream_for(bucket.device)
        bucket.gather_grads([p.grad for p in bucket.params], stream, add=self.release and state.launches > 0)
        bucket.launched = True
        if self.release and stream is not None:
            for g in grads:
                g.record_stream(stream)

    def _launch_cpu(self, state: BucketStream, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        views, numels = state.bucket.grad_views, state.bucket.layout.numels
        copy = [k for k, a in enumerate(add) if not a]
        if copy:
            copy_many_([views[idx[k]] for k in copy], [grads[k] for k in copy], [numels[idx[k]] for k in copy])
        summed = [k for k, a in enumerate(add) if a]
        if summed:
            torch._foreach_add_([views[idx[k]] for k in summed], [grads[k] for k in summed])

    def _launch_cuda(self, state: BucketStream, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> None:
        bucket = state.bucket
        stream = self._stream_for(bucket.device)
        if any(add) and state.incoming is None:
            state.incoming = empty_host(bucket.layout.padded_numel, bucket.dtype, pin=bucket.pin)
        landing = [_slot(state.incoming, bucket, i) if a else bucket.grad_views[i] for i, a in zip(idx, add)]
        stream.wait_stream(torch.cuda.current_stream(bucket.device))
        with torch.cuda.stream(stream):
            if grads:
                torch._foreach_copy_(landing, grads, non_blocking=True)
            launched = set(idx)
            if grads and not any(add) and all(i in launched for i, has in enumerate(state.present) if has):
                # The bucket's squared norm, on the GPU, while the copies run: step() reads every bucket's in one
                # synchronisation. Only when this launch carries all of the bucket's gradients (not when it is
                # summed on the host with an earlier micro-batch's).
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                state.norm = torch.stack(norms).double().square().sum()
            else:
                state.norm = None
            if bucket.d2h_event is None:
                bucket.d2h_event = torch.cuda.Event()
            bucket.d2h_event.record(stream)
        state.adds = [i for i, a in zip(idx, add) if a]
        if self.release:
            for g in grads:
                g.record_stream(stream)

    def _settle(self, state: BucketStream) -> None:
        """Wait for the bucket's copies and add any that landed in ``incoming`` to its gradient buffer."""
        if state.bucket.sharded:
            state.bucket.wait_grads()  # the reduce-scatter, the copy and the add of a streamed micro-batch
            return
        if state.bucket.on_cpu:
            return
        state.bucket.wait_grads()
        if state.adds:
            b = state.bucket
            torch._foreach_add_([b.grad_views[i] for i in state.adds],
                                [_slot(state.incoming, b, i) for i in state.adds])
            state.adds = []

    # -- step ----------------------------------------------------------------------------------------------------
    def consume(self, bucket: FlatBucket, grads: List[Optional[torch.Tensor]], *, fresh: bool = False
                ) -> Optional[List[object]]:
        """The bucket's gradients for ``step()``: None if nothing was streamed this step (the caller gathers
        ``grads`` as usual). Otherwise waits for the copies and returns, per parameter, ``True`` (its gradient is
        in the flat buffer), None (no gradient) or the tensor still to be gathered: a gradient assigned or
        edited in place after its copy (without ``release``), e.g. by ``GradScaler.unscale_`` or
        ``torch.nn.utils.clip_grad_norm_``. With ``fresh`` (and without ``release``), every gradient still on its
        parameter is gathered again: ``GradScaler.unscale_`` rewrites gradients without bumping their version."""
        state = self._states.get(id(bucket))
        if state is None or not (state.launches or any(state.present)):
            return None
        self._settle(state)
        out: List[object] = []
        for i, g in enumerate(grads):
            if g is None:
                out.append(True if state.present[i] and self.release else None)
            elif self.release or not state.present[i]:
                out.append(g)  # assigned after the stream: gathered like any gradient (overwrites the slot)
            else:
                src = state.sources[i]
                same = not fresh and src is not None and src[0] is g and src[1] == g._version
                out.append(True if same else g)
        # A gradient changed or dropped since its launch: the streamed norm (a sharded bucket's reduced sum) is
        # stale.
        stale = any(isinstance(x, torch.Tensor) for x in out) or any(
            x is None and has for x, has in zip(out, state.present))
        if stale:
            state.norm = None
        if bucket.sharded:
            bucket.stale = stale
        return out

    def norms(self, buckets: Sequence[FlatBucket]) -> Dict[int, float]:
        """The GPU-computed squared norms of the given streamed buckets, fetched in one synchronisation."""
        have = [(id(b), self._states[id(b)].norm) for b in buckets
                if id(b) in self._states and self._states[id(b)].norm is not None]
        if not have:
            return {}
        # One synchronisation per device holding streamed buckets (usually one).
        by_device: Dict[torch.device, List[tuple]] = {}
        for key, n in have:
            by_device.setdefault(n.device, []).append((key, n))
        out: Dict[int, float] = {}
        for items in by_device.values():
            out.update(zip((k for k, _ in items), torch.stack([n for _, n in items]).cpu().tolist()))
        return out

    def wait_updates(self) -> None:
        """Wait for the updates launched during backward (``overlap_step``); re-raises the first failure."""
        for state in self._states.values():
            if state.job is not None:
                state.job.result()

    def updated(self, bucket: FlatBucket) -> bool:
        state = self._states.get(id(bucket))
        return state is not None and state.updated

    def reset(self) -> None:
        with self._lock:
            if self._in_backward:
                # A backward that raised (an OOM the loop skips, say) never runs its end-of-backward callback:
                # forget its counts, or no later backward would find a bucket complete.
                self._forget_backward()
        for state in self._states.values():
            if state.launches or any(state.present) or state.adds or state.job is not None:
                if state.job is not None:
                    state.job.result()
                if state.bucket.sharded or not state.bucket.on_cpu:
                    state.bucket.wait_grads()
                state.clear()

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` in the worker thread, after the bucket updates already queued there."""
        return self._worker().submit(fn)

    def keep_zero_grads(self) -> None:
        """``zero_grad(set_to_none=False)`` with ``release``: the parameters that had a gradient last step keep a
        zero one (AdamW still steps them), held as zeroed slots of the host buffer."""
        self.reset()
        for state in self._states.values():
            if self.release and any(state.had):
                state.present = list(state.had)
                for i, has in enumerate(state.had):
                    if has and not state.bucket.grad_slot_zero[i]:
                        state.bucket.grad_views[i].zero_()
                        state.bucket.grad_slot_zero[i] = True

    def _worker(self) -> ThreadPoolExecutor:
        # One thread: buckets are updated in launch order, each with the kernel's own intra-op parallelism.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_offload_step")
        return self._pool


def _hook(streamer_ref: "weakref.ref[GradStreamer]", key: int, i: int):
    # The hook lives on the parameter, which usually outlives the optimizer: it must not keep the streamer (and
    # through it the host buffers) alive.
    def hook(p: torch.Tensor) -> None:
        streamer = streamer_ref()
        if streamer is not None:
            with torch.no_grad():  # under backward(create_graph=True) autograd would record the hook's copies
                streamer._on_grad(streamer._states[key], i)

    return hook


def _current_node():
    """The autograd node whose execution the calling code is nested in (None outside any backward, and in the
    final callbacks of an outermost one); None where torch does not expose it."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


def _slot(flat: torch.Tensor, bucket: FlatBucket, i: int) -> torch.Tensor:
    """Parameter ``i``'s slot in another flat buffer laid out like the bucket's gradient buffer."""
    return view_like(flat, bucket.layout.offsets[i], bucket.params[i])


def _check_dense(bucket: FlatBucket, idx: List[int], grads: List[torch.Tensor]) -> None:
    for i, g in zip(idx, grads):
        if g.layout != torch.strided:
            raise RuntimeError(f"OffloadOptimizer does not support sparse gradients (parameter of shape "
                               f"{tuple(bucket.params[i].shape)} has a {g.layout} gradient)")
