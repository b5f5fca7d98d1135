"""How a state buffer is stored (``state_dtype``): a codec allocates a buffer's codes (and block scales) in a tier,
says how many bytes that takes, converts them to float32 and back, and cuts the arguments an update reads.

* :data:`FP32`: float32, exactly as the wrapped optimizer holds it.
* :data:`BF16`: bfloat16, half the bytes, rounded to nearest even at every write.
* :data:`BLOCK8`: 8-bit block-wise (see :mod:`zero_offload.functional`): int8 codes for a signed buffer, uint8 for
  a non-negative one, and a float32 scale per :data:`~zero_offload.functional.Q8_BLOCK` elements. A non-finite
  value is kept per element as a *poison* mark in the codes of the rule's first signed buffer (and the sign of its
  block's scale): the other buffers of that element read back as NaN through :meth:`Codec.to_fp32`'s ``mark``.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from zero_offload._reference import poisoned_elements
from zero_offload.functional import Q8_BLOCK, dequantize_state, q8_scale_numel, quantize_state_
from zero_offload.rules.base import StateBuffer
from zero_offload.state.tiers import Tier

__all__ = ["BF16", "BLOCK8", "FP32", "Codec", "codec_for"]

Mark = Optional[Tuple[torch.Tensor, torch.Tensor]]


class Codec:
    """One storage format of state buffers.

    Attributes:
        state_dtype (torch.dtype): the ``state_dtype`` option that selects it.
        scaled (bool): its buffers come with float32 block scales.
    """

    def __init__(self, state_dtype: torch.dtype, scaled: bool = False):
        self.state_dtype = state_dtype
        self.scaled = scaled

    def code_dtype(self, buf: StateBuffer) -> torch.dtype:
        """The dtype of ``buf``'s codes."""
        if self.scaled:
            return torch.int8 if buf.signed else torch.uint8
        return self.state_dtype

    def nbytes(self, buf: StateBuffer, n: int) -> Dict[str, int]:
        """Bytes of ``buf`` over ``n`` elements, by buffer name (``<name>_scale`` for the scales)."""
        out = {buf.name: n * self.code_dtype(buf).itemsize}
        if self.scaled:
            out[buf.name + "_scale"] = 4 * q8_scale_numel(n)
        return out

    def allocate(self, buf: StateBuffer, n: int, tier: Tier) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Zeroed codes of ``buf`` for ``n`` elements, and its zeroed scales (None unless :attr:`scaled`)."""
        codes = tier.zeros(n, self.code_dtype(buf))
        return codes, tier.zeros(q8_scale_numel(n), torch.float32) if self.scaled else None

    def to_fp32(self, codes: torch.Tensor, scales: Optional[torch.Tensor], mark: Mark = None) -> torch.Tensor:
        """A whole buffer as float32: ``codes`` itself for fp32, else a new tensor converted in one pass (8-bit:
        chunk by chunk, NaN where ``mark``, the poison-carrying buffer's codes and scales, marks an element)."""
        if not self.scaled:
            return codes if codes.dtype == torch.float32 else codes.float()
        out = dequantize_state(codes, scales)
        if mark is not None and mark[0] is not codes and bool(torch.signbit(mark[1]).any()):
            out.masked_fill_(poisoned_elements(*mark).view(-1)[: out.numel()], math.nan)
        return out

    def write(self, codes: torch.Tensor, scales: Optional[torch.Tensor], values: Optional[torch.Tensor]) -> None:
        """Store ``values`` (float32, the codes' memory order; None: zeros) into ``codes`` (a slot or piece that
        starts on a block) and ``scales`` (the blocks covering it)."""
        if values is None:
            codes.zero_()
            if scales is not None:
                scales.zero_()
        elif self.scaled:
            quantize_state_(codes, scales, values)
        else:
            codes.copy_(values)

    @staticmethod
    def blocks(a: int, b: int) -> slice:
        """The scale blocks covering elements ``[a, b)`` (``a`` a multiple of the block)."""
        return slice(a // Q8_BLOCK, q8_scale_numel(b))


FP32 = Codec(torch.float32)
BF16 = Codec(torch.bfloat16)
BLOCK8 = Codec(torch.int8, scaled=True)
_BY_DTYPE = {c.state_dtype: c for c in (FP32, BF16, BLOCK8)}


def codec_for(state_dtype: torch.dtype, buf: StateBuffer) -> Codec:
    """The codec of ``buf`` under the ``state_dtype`` option: fp32 for a buffer that is not compactable."""
    return _BY_DTYPE[state_dtype] if buf.compactable else FP32
