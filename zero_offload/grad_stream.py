"""When gradients may leave the device: backward hooks that notice, bucket by bucket, that backward has made a
bucket's gradients final, and hand it to :mod:`zero_offload.transport` (and to the update schedule, for
``overlap_step``) while backward is still running.

One :class:`GradStreamer` per optimizer. It puts a ``register_post_accumulate_grad_hook`` on every parameter of
the buckets it streams. When every parameter of a bucket that requires a gradient has fired in this backward
(or when the backward ends, for buckets some of whose parameters got no gradient), the bucket is *launched*.

Sharded buckets (collectives) must launch in the same order on every rank, whatever order the hooks fire in, so
they launch in a fixed order, the reverse of their construction order (the order backward usually reaches them,
as DDP assumes): a bucket complete before its predecessors waits for them, and when backward ends every sharded
bucket not yet launched is, in that order, so each backward reduce-scatters every bucket once on every rank.

**Checkpointing.** ``torch.utils.checkpoint(use_reentrant=True)`` runs each segment's backward as a backward of
its own, inside the outer one. The end of such a nested backward is not the end of the step's backward: buckets
left incomplete launch when the outermost backward ends.

**Accumulation.** Inside :meth:`GradStreamer.no_sync` the hooks do nothing, so micro-batches accumulate in
``.grad`` as usual and only the last backward streams.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator, List, Optional

import torch

from zero_offload.lane import Lane
from zero_offload.transport import Transport

__all__ = ["GradStreamer"]


class GradStreamer:
    """Backward hooks of one optimizer (see the module docstring).

    Args:
        transport (Transport): sends a launched bucket's gradients.
        mode: the update schedule (:mod:`zero_offload.update`), told before and after each launch.
    """

    def __init__(self, transport: Transport, mode) -> None:
        self._transport = transport
        self._mode = mode
        self._lanes: List[Lane] = []  # the lanes streamed (each counts its hooks: epoch, fired, expected, ready)
        self._no_sync = 0
        self._epoch = 0
        # A backward is counting (or raised and never ran its end-of-backward callback): see reset().
        self.in_backward = False
        self._touched: List[Lane] = []
        self._armed: Optional[weakref.ref] = None  # the end-of-backward callback last queued (see _arm)
        self._sharded: List[Lane] = []  # sharded buckets in launch order
        self._next = 0  # how many of them this backward has launched
        self._lock = threading.Lock()

    # -- registration --------------------------------------------------------------------------------------------
    def add(self, lane: Lane) -> None:
        self._lanes.append(lane)
        if lane.bucket.sharded:
            self._sharded.insert(0, lane)  # added in construction order, launched in reverse
        for p in lane.bucket.owners:  # (FSDP2: its DTensor parameters, whose hooks FSDP runs)
            # A frozen parameter cannot take a hook; if it is unfrozen later, its bucket launches when backward
            # ends, and its gradient is gathered at step() like any gradient assigned by hand.
            if p.requires_grad:
                lane.handles.append(p.register_post_accumulate_grad_hook(_hook(weakref.ref(self), weakref.ref(lane))))

    def drop(self, lane: Lane) -> None:
        """Stop streaming the bucket (between steps): its gradients are read at ``step()`` from now on."""
        for h in lane.handles:
            h.remove()
        lane.handles = []
        if lane in self._lanes:
            self._lanes.remove(lane)
        if lane in self._sharded:
            self._sharded.remove(lane)

    def remove(self) -> None:
        """Unregister every hook (the optimizer's finaliser calls this; a dropped optimizer's hooks do nothing)."""
        for lane in self._lanes:
            for h in lane.handles:
                h.remove()
            lane.handles = []

    # -- backward ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def _on_grad(self, lane: Lane) -> None:
        if self._no_sync:
            return
        with self._lock:
            if self.in_backward and self._armed() is None:
                # The backward that armed us was destroyed without running its callback: it raised, and this hook
                # belongs to a new backward (a retry without zero_grad(), which accumulates onto what the failed
                # one left, as autograd does). Its counts start afresh, or no bucket would complete in it.
                self._forget_backward()
            # Buckets with parameters that get no gradient in this backward never complete: launch them when the
            # backward ends.
            self._arm()
            if lane.epoch != self._epoch:
                lane.epoch = self._epoch
                lane.fired = 0
                lane.expected = sum(p.requires_grad for p in lane.bucket.owners)
                self._touched.append(lane)
            lane.fired += 1
            if lane.fired == lane.expected:
                try:
                    if lane.bucket.sharded:
                        lane.ready = self._epoch
                        self._launch_in_order(upto=None)
                    else:
                        self._launch(lane)
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
                self.in_backward = False
            self._rearm_after(node)
            return
        with self._lock, torch.no_grad():
            try:
                for lane in self._touched:
                    # (An FSDP2 bucket is launched by its hooks alone: FSDP runs the root unit's in its own final
                    # callback, which may come after this one; what is not sent is gathered at step().)
                    if lane.fired != lane.expected and not lane.bucket.sharded and not lane.bucket.fsdp:
                        self._launch(lane)
                self._launch_in_order(upto=len(self._sharded))
            finally:
                self._forget_backward()

    def _rearm_after(self, node) -> None:
        """Arm again on the outer backward once ``node`` has run: from a post-hook of ``node`` and, because torch
        before 2.4 ignores a post-hook registered while its node runs (checked on 2.3.1), from a pre-hook of each
        node that receives its output, which can only run after it, in the outer backward. The first to fire
        wins."""
        handles = []

        def rearm(*_) -> None:
            for h in handles:
                h.remove()
            handles.clear()
            with self._lock:
                self._arm()  # (unless a hook of a later segment has queued the callback already)

        handles.append(node.register_hook(rearm))
        handles.extend(nxt.register_prehook(rearm) for nxt, _ in node.next_functions if nxt is not None)

    def _arm(self) -> None:
        """Have ``_end_backward`` run when the current backward finishes (a callback queued from a hook or a node
        runs then), once per backward."""
        if not self.in_backward:
            self.in_backward = True
            callback = _EndOfBackward(self)
            self._armed = weakref.ref(callback)  # dead once autograd has dropped it: run, or the backward raised
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    def _forget_backward(self) -> None:
        """The backward is over (or was aborted): the next one counts its gradients afresh."""
        self._touched, self.in_backward, self._next = [], False, 0
        self._epoch += 1

    def _launch_in_order(self, upto: Optional[int]) -> None:
        """Launch sharded buckets in their fixed order: the ready ones at the head of the line, or (``upto``)
        every one up to that position, ready or not (see the module docstring)."""
        order = self._sharded
        while self._next < len(order) and ((upto is not None and self._next < upto)
                                            or order[self._next].ready == self._epoch):
            self._next += 1
            self._launch(order[self._next - 1])

    def _launch(self, lane: Lane) -> None:
        """Send the bucket's gradients (see :meth:`Transport.send_grads`)."""
        mode = self._mode
        if (lane.spec is not None or lane.job is not None) and mode.before_send is not None:
            mode.before_send(lane)  # (an update of it is in flight: the schedule's to undo)
        self._transport.send_grads(lane)
        if mode.after_send is not None:
            mode.after_send(lane)

    def reset(self) -> None:
        """The step is over: a backward that raised (an OOM the loop skips, say) never ran its end-of-backward
        callback, so its counts are forgotten here, or no later backward would find a bucket complete."""
        with self._lock:
            if self.in_backward:
                self._forget_backward()


class _EndOfBackward:
    """The callback queued on a backward: calls ``_end_backward``. Its own object (not a bound method, which dies at
    once) so that a weak reference to it tells whether autograd still holds it."""

    __slots__ = ("streamer", "__weakref__")

    def __init__(self, streamer: GradStreamer) -> None:
        self.streamer = streamer

    def __call__(self) -> None:
        self.streamer._end_backward()


def _hook(streamer_ref: "weakref.ref[GradStreamer]", lane_ref: "weakref.ref[Lane]"):
    # The hook lives on the parameter, which usually outlives the optimizer: it must not keep the streamer or the
    # lane (and through them the host buffers) alive.
    def hook(p: torch.Tensor) -> None:
        streamer, lane = streamer_ref(), lane_ref()
        if streamer is not None and lane is not None:
            with torch.no_grad():  # under backward(create_graph=True) autograd would record the hook's copies
                streamer._on_grad(lane)

    return hook


def _current_node():
    """The autograd node whose execution the calling code is nested in (None outside any backward, and in the
    final callbacks of an outermost one); None where torch does not expose it."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None
