"""A bucket's lane: everything one bucket carries through a step, in one record (:class:`Lane`).

A step moves each bucket down its lane: backward's hooks count its gradients (:mod:`zero_offload.grad_stream`),
the transport sends them to the host and records the copy's event and the bucket's norm
(:mod:`zero_offload.transport`), ``step()`` receives them (which gradients are present, which must be read again,
whether the streamed norm went stale), gathers them where the kernel reads them, and the schedule updates the
bucket, speculatively or at ``step()`` (:mod:`zero_offload.update`, :mod:`zero_offload.speculation`), before the
transport sends the result back. Every module along the way writes what it learnt into the lane, and
:meth:`Lane.end` forgets the step in one place, once the step is over.

A lane lives as long as its bucket (one per bucket, made when the transport takes charge of it, in the optimizer's
order: ``position``); what it keeps from step to step is the copies' machinery (CUDA events and the landing
buffers of accumulated copies) and which parameters had a gradient in the last step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from zero_offload import functional
from zero_offload._checks import CheckedGrads

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.buckets import FlatBucket

__all__ = ["Lane", "Lanes", "record_event"]


def record_event(event, stream):
    """``event`` (created if None) recorded on ``stream``."""
    if event is None:
        event = torch.cuda.Event()
    event.record(stream)
    return event


class Lane:
    """One bucket's record (see the module docstring).

    For the optimizer's life:
        bucket (FlatBucket), group (int): the bucket and its param group's index; position (int): its place among
            all buckets (the timeline names buckets by it).
        route: how its bytes move (a :class:`~zero_offload.transport.routes.Route`: the bucket's kind).
        streamed (bool): backward's hooks send its gradients.
        d2h, h2d: CUDA events after its last gradient copy down and its last upload; ``*_gen`` count their
            recordings and ``*_seen`` the recording the host last waited for (a complete event is not waited for
            again).
        unsettled (bool): something was sent that the host has not waited for (a copy, a collective, a sum to
            add): the route's ``wait`` has work to do.
        incoming, norm_host, shard_in: landing buffers (accumulated copies, the norm for the host, a sharded
            micro-batch's shard), made at first use.
        had (List[bool]): ``sent`` of the last step that sent any.
        handles (list): its parameters' hook handles; epoch, fired, expected, ready: the hooks' count in the
            current backward (see :mod:`zero_offload.grad_stream`).

    For one step (forgotten by :meth:`end`):
        sent (List[bool]): which parameters had a gradient sent in this step's backward; launches: how many
            times it was sent; sources: the gradient and its version at each copy (to notice later in-place
            edits); adds: slots whose copy landed in ``incoming``, to add; norm: its gradients' squared norm on
            the GPU (one launch carrying all of them), copied to ``norm_host`` before the gradients themselves, with
            the event ``norm_ev`` (reading it waits for no gradient copy); stale: a gradient changed after it was
            sent.
        present, pending, in_place: what ``step()`` received: which parameters have a gradient (sharded: on some
            rank), the gradient still to read from the parameter (None: in the host buffer already, or absent),
            and after gathering, a CPU bucket's gradients where the kernel reads them in place (None: the flat
            buffer holds them).
        sq (float, optional): the squared norm as the host read it at ``step()``.
        spec: its speculative update (:mod:`zero_offload.speculation`); job: ``overlap_step``'s update running;
            barred: sent twice, not speculated; staged: its device buffer for speculative uploads
            (:class:`~zero_offload.transport.device.Staged`, holding memory only from an upload to its commit).
        rs, ag, adding: a sharded bucket's reduce-scatter and all-gather in flight, and whether ``shard_in`` is
            still to be added to the gradient.
    """

    __slots__ = ("bucket", "group", "position", "route", "streamed", "unsettled", "d2h", "h2d", "norm_ev", "d2h_gen",
                 "d2h_seen",
                 "h2d_gen", "h2d_seen", "incoming", "norm_host", "shard_in", "had", "handles", "epoch", "fired",
                 "expected", "ready", "sent", "launches", "sources", "adds", "norm", "stale", "present", "pending",
                 "in_place", "sq", "spec", "job", "barred", "rs", "ag", "adding", "staged", "__weakref__")

    def __init__(self, bucket: "FlatBucket", group: int, position: int, route: Any, streamed: bool):
        self.bucket, self.group, self.position, self.route, self.streamed = bucket, group, position, route, streamed
        n = len(bucket.params)
        self.unsettled = False
        self.d2h = self.h2d = self.norm_ev = None
        self.d2h_gen = self.d2h_seen = self.h2d_gen = self.h2d_seen = 0
        self.incoming: Optional[torch.Tensor] = None
        self.norm_host: Optional[torch.Tensor] = None
        self.shard_in: Optional[torch.Tensor] = None
        self.had: List[bool] = [False] * n
        self.handles: List[Any] = []
        self.epoch, self.fired, self.expected, self.ready = -1, 0, 0, -1
        self.job = self.spec = self.staged = None
        self._forget()

    def _forget(self) -> None:
        n = len(self.bucket.params)
        self.sent: List[bool] = [False] * n
        self.launches = 0
        self.sources: List[Optional[Tuple[torch.Tensor, int]]] = [None] * n
        self.adds: List[int] = []
        self.norm: Optional[torch.Tensor] = None
        self.stale = False
        self.present: List[bool] = []
        self.pending: List[Optional[torch.Tensor]] = []
        self.in_place: Optional[List[Optional[torch.Tensor]]] = None
        self.sq: Optional[float] = None
        self.barred = False
        self.rs = self.ag = None
        self.adding = False

    def end(self) -> None:
        """The step is over (its copies landed): forget it. The one place a lane's step ends."""
        if any(self.sent):
            self.had = self.sent
        self._forget()

    # -- events ------------------------------------------------------------------------------------------------
    def record_d2h(self, stream) -> None:
        """Mark, on ``stream``, the point after which the host gradients hold what was sent."""
        self.d2h = record_event(self.d2h, stream)
        self.d2h_gen += 1
        self.unsettled = True

    def record_h2d(self, stream) -> None:
        """Mark, on ``stream``, the point after which the last upload has read master and staging."""
        self.h2d = record_event(self.h2d, stream)
        self.h2d_gen += 1

    def wait_d2h(self, timeline=None) -> None:
        """Wait until the host gradient buffer holds what was sent (not again for a recording waited for)."""
        gen = self.d2h_gen
        if self.d2h is not None and self.d2h_seen != gen:
            if timeline is None:
                self.d2h.synchronize()
            else:
                with timeline.span("wait", "d2h", self.position):
                    self.d2h.synchronize()
            self.d2h_seen = gen  # (if recorded again meanwhile, the newer recording is still to be waited for)

    def wait_h2d(self, timeline=None) -> None:
        """Wait until the last upload has read master and staging (usually long done: ``query`` first)."""
        gen = self.h2d_gen
        if self.h2d is not None and self.h2d_seen != gen:
            if not self.h2d.query():
                if timeline is None:
                    self.h2d.synchronize()
                else:
                    with timeline.span("wait", "h2d", self.position):
                        self.h2d.synchronize()
            self.h2d_seen = gen

    # -- what step() received -----------------------------------------------------------------------------------
    def host_grads(self) -> List[torch.Tensor]:
        """The tensors holding the gathered gradients (on the host; a device-tier bucket's on its device)."""
        if self.in_place is None:
            # (a bucket whose buffer is made at its first use, with no gradient this step, has nothing to read)
            return [self.bucket.grad] if self.bucket.grads.allocated else []
        return CheckedGrads(g for g in self.in_place if g is not None)

    def host_sq_norm(self) -> Tuple[float, bool]:
        """Sum of squares of the gathered gradients, and whether one is inf/nan."""
        if self.in_place is None and self.bucket.grads.allocated:
            return functional.grad_sq_norm(self.bucket.grad)
        return functional.grad_sq_norm_segments(self.host_grads())


# Per param group, its lanes (a step's plan).
Lanes = List[List[Lane]]
