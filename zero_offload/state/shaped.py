"""A bucket's per-parameter state tensors that are not shaped like their parameter: the second state layout, for a
class stepped on whole parameters on a GPU (:mod:`zero_offload.rules.whole`). Adafactor keeps, for a matrix, a row
factor and a column factor of its second moment (the matrix's shape with the last, or the second-to-last,
dimension reduced to 1) and, for a vector, a vector: none of them fits the bucket's per-element buffers, whose
slots are the parameters' size.

Each such tensor gets a slot of its own, its shape's elements, in one flat buffer of the bucket (allocated in the
home's tier: pinned host memory for a parked bucket, which parks and reloads it with its other buffers; the GPU for
a resident one), at an offset a multiple of :data:`~zero_offload.state.layout.ALIGN` elements; the entries
``opt.state`` shows and checkpoints save are views of those slots, shaped as the class keeps them. The shapes come
from the rule's declarations (:class:`~zero_offload.rules.base.StateShape`, found by the probe), one per buffer and
number of dimensions, applied to each parameter's shape.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import StateBuffer
from zero_offload.state.layout import align_up
from zero_offload.state.tiers import Tier

__all__ = ["SHAPED", "ShapedState"]

# The name the shaped buffer goes by among a home's flat buffers (parked, copied): not a Python identifier, so no
# class's state key takes it.
SHAPED = "<shaped>"


class ShapedState:
    """The shaped state of one bucket (see the module docstring).

    Attributes:
        flat (Tensor, optional): the one flat buffer (None while no buffer is declared shaped).
        names (List[str]): the shaped buffers held, in declaration order.
        places (List[Dict[str, Tuple[int, torch.Size]]]): per parameter, each of its tensors' offset and shape.
        views (List[Dict[str, Tensor]]): per parameter, its tensors: views of ``flat``.

    Args:
        tier (Tier): where to allocate.
        shapes (Sequence[torch.Size]): the bucket's parameters' shapes.
    """

    def __init__(self, tier: Tier, shapes: Sequence[torch.Size]):
        self.tier, self.shapes = tier, [torch.Size(s) for s in shapes]
        self.flat: Optional[torch.Tensor] = None
        self.names: List[str] = []
        self.places: List[Dict[str, Tuple[int, torch.Size]]] = [{} for _ in self.shapes]
        self.views: List[Dict[str, torch.Tensor]] = [{} for _ in self.shapes]

    def ensure(self, buffers: Sequence[StateBuffer], order: Sequence[str]) -> List[str]:
        """Hold the shaped ``buffers`` not held yet (zeroed), the layout redone with the values held kept; ``order``
        is the declaration order of every buffer. Returns the names added."""
        added = [b for b in buffers if b.name not in self.names]
        if not added:
            return []
        wanted = {b.name: b for b in added}
        names = [n for n in order if n in wanted or n in self.names]
        places: List[Dict[str, Tuple[int, torch.Size]]] = []
        cursor = 0
        for i, shape in enumerate(self.shapes):
            mine = {}
            for name in names:
                size = wanted[name].shape_for(shape) if name in wanted else self.places[i].get(name, (0, None))[1]
                if size is None:
                    continue
                mine[name] = (cursor, size)
                cursor = align_up(cursor + size.numel())
            places.append(mine)
        flat = self.tier.zeros(cursor, torch.float32)
        old = self.views
        self.flat, self.names, self.places = flat, names, places
        self.views = self.cut(flat)
        for new, before in zip(self.views, old):
            for name, view in before.items():
                new[name].copy_(view)
        return [b.name for b in added]

    def cut(self, flat: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
        """Per parameter, its tensors as views of ``flat`` (the buffer, a device copy of it or a clone)."""
        return [{name: flat[o:o + size.numel()].view(size) for name, (o, size) in mine.items()}
                for mine in self.places]

    def nbytes(self) -> Dict[str, int]:
        """Bytes of each shaped buffer's tensors (their padding not counted)."""
        out = {name: 0 for name in self.names}
        for mine in self.places:
            for name, (_, size) in mine.items():
                out[name] += 4 * size.numel()
        return out
