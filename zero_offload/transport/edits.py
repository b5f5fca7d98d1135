"""Gradient edits that move no version counter (see :mod:`zero_offload.transport.base`): ``GradScaler.unscale_``
rewrites gradients in place without moving one, and so do ``foreach`` ops on FSDP2's DTensor gradients. After a
step a ``GradScaler`` drove (and before the first), or always under FSDP2, each streamed gradient's norm is kept at
its copy, on the device (in the lane's :class:`~zero_offload.lane.Arrival`); where such an edit may have happened
(``clip_grad_norm_`` after a scaler's step; every ``step()`` under FSDP2) the norms are taken again and compared bit
for bit, those of every bucket at once (one synchronisation per device), and a gradient whose norm differs is read
again. An edit that keeps every norm (a sign flip through a ``foreach`` op) is not seen.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload._compat import foreach_norm_fp32
from zero_offload.lane import Intake, Plans

__all__ = ["EditWatch"]


class EditWatch:
    """One transport's watch over edits that move no version counter (see the module docstring).

    Args:
        always (bool): keep the norms at every step (FSDP2), not only while a ``GradScaler`` may unscale.

    Attributes:
        scaled (bool, optional): whether a ``GradScaler`` drove the last ``step()`` (None: no step yet).
    """

    def __init__(self, always: bool):
        self.always = always
        self.scaled: Optional[bool] = None
        # This round of receives' gradients to compare (see read_edited): the intake, the parameters, their norms.
        self._unchecked: List[Tuple[Intake, List[int], List[torch.Tensor]]] = []

    def norms(self, idx: Sequence[int], grads: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
        """At a copy of the gradients ``grads`` (the bucket's ``idx``): their norms by parameter, while an edit may
        come (else none)."""
        if not (self.always or self.scaled is not False):
            return {}
        kept = [(i, g) for i, g in zip(idx, grads) if g.numel()]
        if not kept:
            return {}
        return dict(zip((i for i, _ in kept), foreach_norm_fp32([g for _, g in kept])))

    def defer(self, intake: Intake, norms: Dict[int, torch.Tensor], fresh: bool) -> None:
        """Where an edit may have happened (``fresh``, or ``always``): the intake's gradients the version check
        found unchanged, to compare in :meth:`read_edited`."""
        if norms and (fresh or self.always):
            params = intake.bucket.params
            kept = [i for i, g in enumerate(intake.pending) if g is None and i in norms and params[i].grad is not None]
            if kept:
                self._unchecked.append((intake, kept, [norms[i] for i in kept]))

    def read_edited(self, plans: Plans) -> Plans:
        """After every lane's receive: ``plans`` where each deferred gradient whose norm differs from the one at its
        copy is pending, to be read again, and its bucket's streamed norm stale. Each compared gradient's norm now
        is kept in its lane's arrival, for a later receive in the same step (``step()`` after ``clip_grad_norm_``
        under a ``GradScaler`` whose ``unscale_`` may have come between them)."""
        unchecked, self._unchecked = self._unchecked, []
        found = [(intake, i, intake.bucket.params[i].grad, then) for intake, kept, thens in unchecked
                 for i, then in zip(kept, thens)]
        edited: Dict[Intake, List[Tuple[int, torch.Tensor]]] = {}  # (by intake: each read again once)
        for device in {grad.device for _, _, grad, _ in found}:
            mine = [f for f in found if f[2].device == device]
            nows = foreach_norm_fp32([grad for _, _, grad, _ in mine])
            changed = (torch.stack(nows) != torch.stack([then for _, _, _, then in mine])).tolist()
            for (intake, i, grad, _), c, now in zip(mine, changed, nows):
                intake.lane.arrival.norms[i] = now
                if c:
                    edited.setdefault(intake, []).append((i, grad))
        if not edited:
            return plans
        return [[_read_again(intake, edited[intake]) if intake in edited else intake for intake in intakes]
                for intakes in plans]

    def reset(self) -> None:
        self._unchecked = []


def _read_again(intake: Intake, edited: Sequence[Tuple[int, torch.Tensor]]) -> Intake:
    """``intake``, with its gradients ``edited`` (by position) pending, and its streamed norm stale."""
    pending = list(intake.pending)
    for i, grad in edited:
        pending[i] = grad
    return intake.but(pending=pending, stale=True)
