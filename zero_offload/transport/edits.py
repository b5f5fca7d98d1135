"""Gradient edits that move no version counter (see :mod:`zero_offload.transport.base`): ``GradScaler.unscale_``
rewrites gradients in place without moving one, and so do ``foreach`` ops on FSDP2's DTensor gradients. After a
step a ``GradScaler`` drove (and before the first), or always under FSDP2, each streamed gradient's norm is kept at
its copy, on the device; where such an edit may have happened (``clip_grad_norm_`` after a scaler's step; every
``step()`` under FSDP2) the norms are taken again and compared bit for bit, those of every bucket at once (one
synchronisation per device), and a gradient whose norm differs is read again. An edit that keeps every norm (a sign
flip through a ``foreach`` op) is not seen.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload._compat import foreach_norm_fp32
from zero_offload.lane import Lane

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
        self._norms: Dict[Lane, Dict[int, torch.Tensor]] = {}  # this step's, by lane and parameter index
        self._unchecked: List[Tuple[Lane, List[int], List[torch.Tensor]]] = []  # left to compare (read_edited)

    def keep(self, lane: Lane, idx: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        """At a copy of the gradients ``grads`` (the bucket's ``idx``): their norms, while an edit may come."""
        if self.always or self.scaled is not False:
            kept = [(i, g) for i, g in zip(idx, grads) if g.numel()]
            if kept:
                norms = foreach_norm_fp32([g for _, g in kept])
                self._norms.setdefault(lane, {}).update((i, n) for (i, _), n in zip(kept, norms))

    def take(self, lane: Lane) -> Dict[int, torch.Tensor]:
        """The lane's norms at their copy (given up: a second receive of the lane reads every gradient again)."""
        return self._norms.pop(lane, {})

    def defer(self, lane: Lane, pending: Sequence[Optional[torch.Tensor]], norms: Dict[int, torch.Tensor],
              fresh: bool) -> None:
        """Where an edit may have happened (``fresh``, or ``always``): the lane's gradients the version check found
        unchanged, to compare in :meth:`read_edited`."""
        if norms and (fresh or self.always):
            params = lane.bucket.params
            kept = [i for i, g in enumerate(pending) if g is None and i in norms and params[i].grad is not None]
            if kept:
                self._unchecked.append((lane, kept, [norms[i] for i in kept]))

    def read_edited(self) -> None:
        """After every lane's receive: each deferred gradient whose norm differs from the one at its copy is
        pending, to be read again, and its lane's streamed norm stale."""
        unchecked, self._unchecked = self._unchecked, []
        found = [(lane, i, lane.bucket.params[i].grad, then) for lane, kept, thens in unchecked
                 for i, then in zip(kept, thens)]
        for device in {grad.device for _, _, grad, _ in found}:
            mine = [f for f in found if f[2].device == device]
            now = torch.stack(foreach_norm_fp32([grad for _, _, grad, _ in mine]))
            changed = (now != torch.stack([then for _, _, _, then in mine])).tolist()
            for (lane, i, grad, _), c in zip(mine, changed):
                if c:
                    lane.pending[i] = grad
                    lane.stale, lane.norm = True, None

    def reset(self) -> None:
        self._norms, self._unchecked = {}, []
