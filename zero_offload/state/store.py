"""A bucket's optimizer state, allocated from its rule's declarations: each buffer the rule declares (and the
group's hyperparameters need) is stored by a codec in a tier, with per-parameter views and the per-parameter step
counts. The same declarations give the bytes the host-RAM estimate counts (:func:`state_bytes`): the buffer set is
defined once, by the rule."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import Rule, StateBuffer
from zero_offload.state.codecs import Codec, codec_for
from zero_offload.state.shaped import SHAPED, ShapedState
from zero_offload.state.tiers import Tier

__all__ = ["STEP_DTYPES", "StateStore", "state_bytes"]

Views = Callable[[torch.Tensor], List[torch.Tensor]]
# The dtypes the step counts may be held in (float32 unless a load gave another): each holds every whole count up to
# options.MAX_STEP exactly.
STEP_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


def state_bytes(buffers: Sequence[StateBuffer], state_dtype: torch.dtype, n: int,
                declared: Sequence[StateBuffer] = ()) -> Dict[str, int]:
    """Bytes of ``buffers`` over ``n`` elements each, by buffer name (scales as ``<name>_scale``); the buffers of
    ``declared`` not among them are listed with 0 bytes (so every estimate names the same rows)."""
    wanted = {b.name for b in buffers}
    out: Dict[str, int] = {}
    scales: Dict[str, int] = {}
    for buf in declared or buffers:
        for name, nbytes in codec_for(state_dtype, buf).nbytes(buf, n).items():
            (scales if name != buf.name else out)[name] = nbytes if buf.name in wanted else 0
    out.update(scales)  # (the scale rows after the buffers, as reports list them)
    return out


class StateStore:
    """The rule's state buffers of one bucket (its shard when sharded), ``n`` elements each.

    Attributes:
        rule (Rule): whose buffers these are.
        compact (bool): the state is not float32 (``state_dtype`` bf16 or 8-bit): ``opt.state`` shows no buffer
            of the rule, :meth:`fp32` and :meth:`write` convert.
        flat (Dict[str, Tensor]): each allocated buffer's codes, by name, in declaration order.
        scales (Dict[str, Tensor]): block scales of the buffers that have them.
        views (Dict[str, List[Tensor]]): per-parameter views of each buffer.
        steps (Tensor): per-parameter step counts, float32 (or the dtype a load gave, see
            :meth:`count_steps_in`): ``state["step"]`` is a 0-dim view of an element, so counting a step for a whole
            bucket is one add.
        shaped (ShapedState): the buffers declared with a shape of their own (:mod:`zero_offload.state.shaped`):
            not in ``flat``, ``views`` or a run's ``state``.

    Args:
        rule (Rule): the update rule.
        buffers (Sequence[StateBuffer]): the buffers to allocate now (``rule.needed(hyper)``).
        state_dtype (torch.dtype): the ``state_dtype`` option (a codec per buffer, see :func:`codec_for`).
        tier (Tier): where the buffers live.
        n (int): elements per buffer.
        views (Callable[[Tensor], List[Tensor]]): cuts a flat buffer into per-parameter views.
        count (int): the number of parameters.
        shapes (Sequence[torch.Size], optional): the parameters' shapes, for shaped buffers (None: the bucket
            holds pieces of parameters, a rank's shard, and refuses them). Default: None.
    """

    def __init__(self, rule: Rule, buffers: Sequence[StateBuffer], state_dtype: torch.dtype, tier: Tier, n: int,
                 views: Views, count: int, shapes: Optional[Sequence[torch.Size]] = None):
        self.rule = rule
        self.state_dtype = state_dtype
        self.compact = state_dtype != torch.float32
        self.tier = tier
        self.n = n
        self._cut = views
        self.declared = {b.name: b for b in rule.buffers}
        self.codecs: Dict[str, Codec] = {b.name: codec_for(state_dtype, b) for b in rule.buffers}
        self.flat: Dict[str, torch.Tensor] = {}
        self.scales: Dict[str, torch.Tensor] = {}
        self.views: Dict[str, List[torch.Tensor]] = {}
        self.steps = torch.zeros(count, dtype=torch.float32)
        self._whole: Optional[Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]] = None
        # The buffer whose 8-bit codes carry the poison mark of an element (the first signed one).
        self._marker = next((b.name for b in rule.buffers if b.signed), None)
        self._shapes = shapes
        self.shaped = ShapedState(tier, shapes or ())
        self.ensure(buffers)

    def ensure(self, buffers: Sequence[StateBuffer]) -> List[str]:
        """Allocate those of ``buffers`` not allocated yet (zeroed; e.g. amsgrad's once switched on); returns their
        names."""
        shaped = [b for b in buffers if b.shape is not None]
        if shaped and self._shapes is None:
            raise ValueError(f"{self.rule.name}'s state {shaped[0].name!r} has a shape of its own, not the "
                             "parameter's: a bucket holding pieces of parameters (a rank's shard) cannot hold it")
        new = self.shaped.ensure(shaped, [b.name for b in self.rule.buffers])
        added = [b for b in buffers if b.shape is None and b.name not in self.flat]
        for buf in added:
            codes, scales = self.codecs[buf.name].allocate(buf, self.n, self.tier)
            self.flat[buf.name] = codes
            if scales is not None:
                self.scales[buf.name] = scales
            self.views[buf.name] = self._cut(codes)
        if added:
            order = [b.name for b in self.rule.buffers if b.name in self.flat]
            self.flat = {k: self.flat[k] for k in order}
            self.views = {k: self.views[k] for k in order}
            self._whole = None
        return new + [b.name for b in added]

    def count_steps_in(self, dtype: torch.dtype) -> None:
        """Hold the step counts in ``dtype`` (one of :data:`STEP_DTYPES`: each holds every count up to
        ``MAX_STEP`` exactly), as a load gives them: torch's loader keeps a step tensor's dtype, and AdamW counts on
        in it. The same tensor (``.data`` swapped, values kept), so whatever holds it follows; the entries' 0-dim
        views of it are the old data's: the caller shows the entries anew."""
        if dtype not in STEP_DTYPES:
            raise ValueError(f"step counts are held in {', '.join(map(str, STEP_DTYPES))}, not {dtype}")
        if self.steps.dtype != dtype:
            self.steps.data = self.steps.data.to(dtype)

    @property
    def names(self) -> List[str]:
        """The allocated buffers, in declaration order (the shaped ones too)."""
        held = set(self.flat) | set(self.shaped.names)
        return [b.name for b in self.rule.buffers if b.name in held]

    def slots(self, i: int) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s buffers, by name: views, shaped like the parameter (1-D pieces when sharded), and its
        shaped buffers' tensors, of their own shapes (those it has)."""
        own = {} if self.shaped.flat is None else self.shaped.views[i]  # (none held: a sharded bucket holds none)
        return {**{name: views[i] for name, views in self.views.items()}, **own}

    def run_state(self, a: int, b: int, copies: Optional[Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]]
                  = None) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """The buffers and scales an update of elements ``[a, b)`` reads (``a`` a slot or piece start, so it owns
        whole scale blocks), of ``copies`` (buffers and scales by name) where given. The whole bucket's are cut
        once."""
        whole = a == 0 and b == self.n and copies is None
        if whole and self._whole is not None:
            return self._whole
        flat, scales = copies if copies is not None else (self.flat, self.scales)
        blocks = Codec.blocks(a, b) if scales else None  # (8-bit state only)
        out = ({name: flat[name][a:b] for name in self.flat},
               {name: scales[name][blocks] for name in self.scales})
        if whole:
            self._whole = out
        return out

    def fp32(self, name: str) -> torch.Tensor:
        """Buffer ``name`` whole as float32: the buffer itself for fp32 state, else a new tensor."""
        mark = None
        if self._marker in self.scales:
            mark = (self.flat[self._marker], self.scales[self._marker])
        return self.codecs[name].to_fp32(self.flat[name], self.scales.get(name), mark)

    def write(self, name: str, a: int, b: int, values: Optional[torch.Tensor]) -> None:
        """Store ``values`` (float32, 1-D, in the slot's memory order; None: zeros) into elements ``[a, b)`` of
        buffer ``name`` (a slot or piece)."""
        scales = self.scales.get(name)
        self.codecs[name].write(self.flat[name][a:b], None if scales is None else scales[Codec.blocks(a, b)], values)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor held, by name: the buffers, then their scales as ``<name>_scale``, then the shaped buffer
        (:data:`~zero_offload.state.shaped.SHAPED`)."""
        shaped = {} if self.shaped.flat is None else {SHAPED: self.shaped.flat}
        return {**self.flat, **{name + "_scale": s for name, s in self.scales.items()}, **shaped}

    def nbytes(self) -> Dict[str, int]:
        """Bytes of the buffers held (the estimate of :func:`state_bytes`, from the same declarations)."""
        out = state_bytes([self.declared[n] for n in self.flat], self.state_dtype, self.n, self.rule.buffers)
        out.update(self.shaped.nbytes())
        return out
