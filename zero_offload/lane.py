"""A bucket's step, told in records by phase: what lives as long as the optimizer (:class:`Lane`: the bucket, its
route and the route's channel), what backward sent in this step (:class:`Arrival`, begun afresh when the step ends)
and what ``step()`` received (:class:`Intake`, immutable: returned by the transport's ``receive`` and ``gather``,
passed down the step and dropped with it). Each schedule keeps its own records (``overlap_step``'s jobs,
``delayed_update``'s pending updates) and the backward hooks theirs (:mod:`zero_offload.grad_stream`).

A bucket moves down its lane: backward's hooks find its gradients final, the transport sends them and notes what it
sent in the :class:`Arrival` (its route the copy's event and landing buffers in the channel); ``step()`` receives
them as an :class:`Intake` (which gradients are present, which must be read again, whether the streamed norm went
stale), gathers them where the kernel reads them (a new intake), and the schedule updates the bucket before the
transport sends the result back. :meth:`Lane.end` ends the step in one place.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from zero_offload import functional
from zero_offload._checks import CheckedGrads

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.buckets import FlatBucket

__all__ = ["Arrival", "Intake", "Lane", "Plans", "SqNorm"]


class SqNorm(NamedTuple):
    """A sum of squares of gradients, and whether one of them is inf/nan."""

    sq: float
    nonfinite: bool


class Arrival:
    """What backward sent of one bucket in this step (written by the transport as it sends).

    Attributes:
        sent (List[bool]): which parameters had a gradient sent.
        launches (int): how many times the bucket was sent (micro-batches streamed without ``no_sync``).
        sources (List[Optional[Tuple[Tensor, int]]]): each gradient and its version at its copy (an in-place edit
            after it is found at ``step()``); None with ``release``, whose gradients are gone.
        norm (Tensor, optional): the bucket's squared gradient norm, computed on the GPU as one launch carried all of
            its gradients (read at ``step()`` without waiting for any gradient copy).
        norms (Dict[int, Tensor]): each gradient's norm at its copy, by parameter, where an edit that moves no
            version counter may come (see :mod:`~zero_offload.transport.edits`).
        at (float, optional): when it was first sent (``time.perf_counter()``, the host's clock: on a GPU the hooks
            run ahead of the device), what ``placement="auto"`` reads of the second step.
    """

    __slots__ = ("sent", "launches", "sources", "norm", "norms", "at")

    def __init__(self, n: int):
        self.sent: List[bool] = [False] * n
        self.launches = 0
        self.sources: List[Optional[Tuple[torch.Tensor, int]]] = [None] * n
        self.norm: Optional[torch.Tensor] = None
        self.norms: Dict[int, torch.Tensor] = {}
        self.at: Optional[float] = None


class Lane:
    """One bucket's record for the optimizer's life (see the module docstring).

    Attributes:
        bucket (FlatBucket), group (int): the bucket and its param group's index; position (int): its place among
            all buckets (the timeline names buckets by it).
        route: how its bytes move (a :class:`~zero_offload.transport.base.Route`: the bucket's kind), and
            ``channel`` what its copies keep (:class:`~zero_offload.transport.channel.Channel`, the route's).
        streamed (bool): backward's hooks send its gradients.
        arrival (Arrival): what backward sent in this step.
        had (List[bool]): ``arrival.sent`` of the last step that sent any.
    """

    __slots__ = ("bucket", "group", "position", "route", "channel", "streamed", "arrival", "had", "__weakref__")

    def __init__(self, bucket: "FlatBucket", group: int, position: int, route: Any, streamed: bool):
        self.bucket, self.group, self.position, self.streamed = bucket, group, position, streamed
        self.route, self.channel = route, route.channel()
        self.arrival = Arrival(len(bucket.params))
        self.had: List[bool] = [False] * len(bucket.params)

    def end(self) -> None:
        """The step is over (its copies landed): what backward sent is forgotten. The one place a lane's step
        ends."""
        sent = self.arrival.sent
        if any(sent):
            self.had = sent
        self.arrival = Arrival(len(sent))

    @property
    def staged(self) -> Optional[Any]:
        """The device copy of new parameters ahead of their commit, if its channel holds one."""
        return self.channel.staged


@dataclasses.dataclass(frozen=True, eq=False)
class Intake:
    """What ``step()`` received for one bucket: made by the transport's ``receive``, replaced by a new one where a
    later stage learns more (``gather``: where the kernel reads the gradients; the sharded transports: which
    parameters have a gradient on some rank; the edit watch: which gradients to read again), never edited.

    Attributes:
        lane (Lane): the bucket's lane.
        present (Sequence[bool]): which parameters have a gradient (sharded: on some rank).
        pending (Sequence[Optional[Tensor]]): the gradient still to read from the parameter (None: in the host
            buffer already, or absent).
        stale (bool): a gradient changed or went away after it was sent: the streamed norm is not this step's.
        in_place (List[Optional[Tensor]], optional): after ``gather``, the gradients where the kernel reads them
            in place (None: the flat buffer holds them).
    """

    lane: Lane
    present: Sequence[bool]
    pending: Sequence[Optional[torch.Tensor]]
    stale: bool = False
    in_place: Optional[List[Optional[torch.Tensor]]] = None

    @property
    def bucket(self) -> "FlatBucket":
        return self.lane.bucket

    def but(self, **changes: Any) -> "Intake":
        """This intake with ``changes``: what a later stage learnt."""
        return dataclasses.replace(self, **changes)

    @property
    def norm(self) -> Optional[torch.Tensor]:
        """The squared norm backward computed of the bucket's gradients, if it is this step's."""
        return None if self.stale else self.lane.arrival.norm

    def host_grads(self) -> List[torch.Tensor]:
        """The tensors holding the gathered gradients (on the host; a device-tier bucket's on its device)."""
        bucket = self.lane.bucket
        if self.in_place is None:
            # (a bucket whose buffer is made at its first use, with no gradient this step, has nothing to read)
            return [bucket.grad] if bucket.grads.allocated else []
        return CheckedGrads(g for g in self.in_place if g is not None)

    def host_sq_norm(self) -> SqNorm:
        """Sum of squares of the gathered gradients, and whether one is inf/nan."""
        if self.in_place is None and self.lane.bucket.grads.allocated:
            return SqNorm(*functional.grad_sq_norm(self.lane.bucket.grad))
        return SqNorm(*functional.grad_sq_norm_segments(self.host_grads()))


# Per param group, the intakes of its buckets: what one step works on.
Plans = List[List[Intake]]
