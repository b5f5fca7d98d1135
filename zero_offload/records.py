"""What passes from backward to ``step()``: one typed record per bucket (:class:`BucketGrads`: which gradients,
where they are, whether they went stale), the step's plan (:data:`Plans`: per group, per bucket), and what
``clip_grad_norm_`` leaves for the next step (:class:`PendingClip`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from zero_offload import functional

if TYPE_CHECKING:  # (annotation only: the bucket module does not depend on this one either way)
    from zero_offload.buckets import FlatBucket

__all__ = ["BucketGrads", "PendingClip", "Plans"]


@dataclasses.dataclass
class BucketGrads:
    """One bucket's gradients for one step: what passes from backward (or the step's own gather) to the kernel.

    Attributes:
        bucket (FlatBucket): the bucket.
        present (List[bool]): which parameters have a gradient this step (sharded: on some rank, once gathered).
        pending (List[Optional[Tensor]]): per parameter, the gradient the step still has to read from the
            parameter (it may be the parameter's own slot, after ``zero_grad(set_to_none=False)``); None where it
            is in the host buffer already, or absent.
        in_place (List[Optional[Tensor]], optional): once gathered, a CPU bucket's gradients as the kernel reads
            them, where they are (None: the flat gradient buffer holds them all).
        stale (bool): a gradient was changed or dropped after backward streamed it (its streamed norm, or a
            sharded bucket's reduce-scatter, no longer holds).
    """

    bucket: "FlatBucket"
    present: List[bool]
    pending: List[Optional[torch.Tensor]]
    in_place: Optional[List[Optional[torch.Tensor]]] = None
    stale: bool = False

    def agree(self, present: List[bool]) -> None:
        """Sharded: which parameters have a gradient on some rank, as the group agreed (a gradient missing here
        then counts as zero)."""
        self.present = present

    def host_grads(self) -> List[torch.Tensor]:
        """The tensors holding the gathered gradients (on the host; a device-tier bucket's on its device)."""
        if self.in_place is None:
            return [self.bucket.grad]
        return functional.CheckedGrads(g for g in self.in_place if g is not None)

    def host_sq_norm(self) -> Tuple[float, bool]:
        """Sum of squares of the gathered host gradients, and whether one is inf/nan (the device tier's: see
        :func:`~zero_offload.transport._device_tier_norm`)."""
        if self.in_place is None:
            return functional.grad_sq_norm(self.bucket.grad)
        return functional.grad_sq_norm_segments(self.host_grads())


Plans = List[List[BucketGrads]]


@dataclasses.dataclass
class PendingClip:
    """What ``clip_grad_norm_`` left for the next ``step``: gradients already gathered, and the norm."""

    plans: Plans
    max_norm: float
    norm_type: float
    total_norm: float
    nonfinite: bool
    fresh: bool  # every gradient still on a parameter was read again (see clip_grad_norm_)

    def coefficient(self, unscale: float = 1.0) -> float:
        """``min(max_norm / (norm + 1e-6), 1)`` as torch's clip computes it (1 where that is not finite), with the
        norm multiplied by ``unscale`` first."""
        total = torch.tensor(self.total_norm * unscale, dtype=torch.float32)
        coef = float(torch.clamp(self.max_norm / (total + 1e-6), max=1.0))
        return coef if math.isfinite(coef) else 1.0
