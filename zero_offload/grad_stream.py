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
from typing import Any, Iterator, List, Optional

import torch

from zero_offload.holders import Holding
from zero_offload.lane import Lane
from zero_offload.transport import Transport

__all__ = ["GradStreamer"]


class _Watch:
    """The hooks' record of one streamed bucket: its lane, the hooks' handles, and their count in the current
    backward (``epoch`` the backward it counts for; ``fired`` of ``expected`` parameters; ``ready``: the backward
    in which a sharded bucket was found complete, to launch in its turn)."""

    __slots__ = ("lane", "handles", "epoch", "fired", "expected", "ready", "__weakref__")

    def __init__(self, lane: Lane):
        self.lane = lane
        self.handles: List[Any] = []
        self.epoch, self.fired, self.expected, self.ready = -1, 0, 0, -1


class GradStreamer:
    """Backward hooks of one optimizer (see the module docstring).

    Args:
        transport (Transport): sends a launched bucket's gradients.
        mode: the update schedule (:mod:`zero_offload.update`), told before and after each launch.
    """

    def __init__(self, transport: Transport, mode) -> None:
        self._transport = transport
        self._mode = mode
        self._watches: List[_Watch] = []  # one per bucket streamed
        self._no_sync = 0
        self._epoch = 0
        # A backward is counting (or raised and never ran its end-of-backward callback): see reset().
        self.in_backward = False
        self._touched: List[_Watch] = []
        self._armed: Optional[weakref.ref] = None  # the end-of-backward callback last queued (see _arm)
        self._sharded: List[_Watch] = []  # sharded buckets in launch order
        self._next = 0  # how many of them this backward has launched
        self._lock = threading.Lock()
        self._holding = Holding(transport)  # (the claim on the parameters: zero_offload.holders)

    # -- registration --------------------------------------------------------------------------------------------
    def add(self, lane: Lane) -> None:
        """Take note of a new bucket of the optimizer's, and watch it where backward streams it (``lane.streamed``);
        refused where another optimizer has taken its gradients (see :mod:`zero_offload.holders`)."""
        self._holding.add(lane)
        if not lane.streamed:
            return
        watch = _Watch(lane)
        self._watches.append(watch)
        if lane.bucket.sharded:
            self._sharded.insert(0, watch)  # added in construction order, launched in reverse
        for p in lane.bucket.owners:  # (FSDP2: its DTensor parameters, whose hooks FSDP runs)
            # A frozen parameter cannot take a hook; if it is unfrozen later, its bucket launches when backward
            # ends, and its gradient is gathered at step() like any gradient assigned by hand.
            if p.requires_grad:
                watch.handles.append(p.register_post_accumulate_grad_hook(_hook(weakref.ref(self),
                                                                                weakref.ref(watch))))

    def drop(self, lane: Lane) -> None:
        """Stop streaming the bucket (between steps): its gradients are read at ``step()`` from now on."""
        for watch in [w for w in self._watches if w.lane is lane]:
            for h in watch.handles:
                h.remove()
            watch.handles = []
            self._watches.remove(watch)
            if watch in self._sharded:
                self._sharded.remove(watch)

    def remove(self) -> None:
        """Unregister every hook (the optimizer's finaliser calls this; a dropped optimizer's hooks do nothing)."""
        for watch in self._watches:
            for h in watch.handles:
                h.remove()
            watch.handles = []
        self._holding.let_go()

    # -- backward ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def _on_grad(self, watch: _Watch) -> None:
        if self._no_sync:
            return
        with self._lock:
            if not self.in_backward:  # (the first hook of a backward: refuse taking another optimizer's gradients)
                self._holding.check(w.lane for w in self._watches)
                if self._holding.dropped:  # (the check collected this optimizer's garbage: it is no more)
                    return
            if self.in_backward and self._armed() is None:
                # The backward that armed us was destroyed without running its callback: it raised, and this hook
                # belongs to a new backward (a retry without zero_grad(), which accumulates onto what the failed
                # one left, as autograd does). Its counts start afresh, or no bucket would complete in it.
                self._forget_backward()
            # Buckets with parameters that get no gradient in this backward never complete: launch them when the
            # backward ends.
            self._arm()
            if watch.epoch != self._epoch:
                watch.epoch = self._epoch
                watch.fired = 0
                watch.expected = sum(p.requires_grad for p in watch.lane.bucket.owners)
                self._touched.append(watch)
            watch.fired += 1
            if watch.fired == watch.expected:
                try:
                    if watch.lane.bucket.sharded:
                        watch.ready = self._epoch
                        self._launch_in_order(upto=None)
                    else:
                        self._launch(watch.lane)
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
                for watch in self._touched:
                    # (An FSDP2 bucket is launched by its hooks alone: FSDP runs the root unit's in its own final
                    # callback, which may come after this one; what is not sent is gathered at step().)
                    bucket = watch.lane.bucket
                    if watch.fired != watch.expected and not bucket.sharded and not bucket.fsdp:
                        self._launch(watch.lane)
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
            self._launch(order[self._next - 1].lane)

    def _launch(self, lane: Lane) -> None:
        """Send the bucket's gradients (see :meth:`Transport.send_grads`)."""
        mode = self._mode
        mode.before_send(lane)  # (an update of it may be in flight: the schedule's to undo)
        self._transport.send_grads(lane)
        mode.after_send(lane)

    def reset(self, abandon: bool = False) -> None:
        """The step is over: a backward that raised (an OOM the loop skips, say) never ran its end-of-backward
        callback, so its counts are forgotten here, or no later backward would find a bucket complete. ``abandon``
        (``zero_grad()``, not ``step()``): the transport then meets the other ranks, if any, to check that they
        abandon it too (:meth:`Transport.abandon`)."""
        with self._lock:
            raised = self.in_backward
            if raised:
                self._forget_backward()
        if raised and abandon:
            self._transport.abandon()


class _EndOfBackward:
    """The callback queued on a backward: calls ``_end_backward``. Its own object (not a bound method, which dies at
    once) so that a weak reference to it tells whether autograd still holds it."""

    __slots__ = ("streamer", "__weakref__")

    def __init__(self, streamer: GradStreamer) -> None:
        self.streamer = streamer

    def __call__(self) -> None:
        self.streamer._end_backward()


def _hook(streamer_ref: "weakref.ref[GradStreamer]", watch_ref: "weakref.ref[_Watch]"):
    # The hook lives on the parameter, which usually outlives the optimizer: it must not keep the streamer or the
    # lane (and through them the host buffers) alive.
    def hook(p: torch.Tensor) -> None:
        streamer, watch = streamer_ref(), watch_ref()
        if streamer is not None and watch is not None:
            with torch.no_grad():  # under backward(create_graph=True) autograd would record the hook's copies
                streamer._on_grad(watch)

    return hook


def _current_node():
    """The autograd node whose execution the calling code is nested in (None outside any backward, and in the
    final callbacks of an outermost one); None where torch does not expose it."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None
