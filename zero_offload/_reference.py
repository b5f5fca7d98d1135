"""Pure-torch Adam(W) on flat CPU buffers: the fallback when the native kernel is unavailable, and the oracle the
tests hold the kernel to.

It performs torch.optim.AdamW's single-tensor arithmetic (lerp, mul + addcmul, sqrt / bias correction + eps,
addcdiv) with the bias corrections in double, on chunks of the buffer so that low-precision inputs never need a
full-size fp32 temporary. The arithmetic runs in the master's dtype: float32 normally; the tests pass float64
masters (and scales) to get a float64 oracle of the very same (quantised) arithmetic.

8-bit block-wise state (int8 ``exp_avg``, uint8 ``exp_avg_sq``/``max_exp_avg_sq``, one scale per :data:`Q8_BLOCK`
elements) follows the kernel's mapping (csrc/cpu_adam_kernel.h): dequantisation operation for operation in float32;
requantisation evaluates the same code positions below in float32, where the kernel evaluates them as
:math:`\\sqrt{|m|\\,127^2/s}` and :math:`\\sqrt{\\sqrt{v}\\,255^2/\\sqrt{s}}` with a square root that avoids the
divider (a few ulps from the true root), so the two may round a value that lies within a few ulps of a half-code
boundary to neighbouring codes; both are held to the float64 oracle of this mapping:

* ``exp_avg``: code :math:`c \\in [-127, 127]`, value :math:`s\\,c|c|/127^2`; quantised as
  :math:`\\mathrm{round}(127\\sqrt{|m|/s})` with the sign of :math:`m`.
* ``exp_avg_sq``: code :math:`c \\in [0, 255]`, value :math:`s\\,(c/255)^4`; quantised as
  :math:`\\mathrm{round}(255\\sqrt{\\sqrt{v}/\\sqrt{s}})`.

:math:`s` is the block's largest magnitude after the update; rounding is to nearest, ties to even; a block whose
largest magnitude is below FLT_MIN stores scale 0 and codes 0. Non-finite moments stay per element, as in AdamW: an
element whose new moment is inf or NaN is *poisoned* (``exp_avg`` code :data:`POISON`, which quantisation never
writes; 0 in the other codes) and reads back as NaN; its block's scales come from the finite elements (the second
moments' from the largest :math:`\\sqrt{v}^2`), and the sign bit of its ``exp_avg`` scale flags the block. Before a
flagged block is updated, its poisoned elements' parameters become NaN, what AdamW's NaN moments make of them.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

# Elements per chunk: large enough that per-op overhead is noise, small enough that fp32 temporaries stay in cache.
# A multiple of Q8_BLOCK, so chunks of 8-bit state own whole scale blocks.
CHUNK = 1 << 18
Q8_BLOCK = 64
_M_CODE, _V_CODE = 127.0, 255.0
_FLT_MIN, _FLT_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
POISON = -128  # the exp_avg code of an element whose moments are not finite (see the module docstring)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """(blocks, Q8_BLOCK) view of a 1-D tensor, zero-padded to whole blocks (a copy only when padding is needed)."""
    pad = -x.numel() % Q8_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, Q8_BLOCK)


def dequantize_m(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of int8 first-moment codes (1-D, n) with their block scales (ceil(n / 64)), as ``dtype``; NaN where
    an element is poisoned."""
    n = codes.numel()
    c = _blocks(codes.to(dtype))
    f = c * (1.0 / _M_CODE)  # exactly 1 at the top code: the largest value is the scale
    out = f * f.abs() * scale.to(dtype).abs()[:, None]
    return torch.where(c == POISON, torch.full_like(out, math.nan), out).view(-1)[:n]


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of uint8 second-moment codes (1-D, n) with their block scales (ceil(n / 64)), as ``dtype`` (a
    poisoned element reads 0 here: it is marked in the first moment's codes, see :func:`poisoned_elements`)."""
    n = codes.numel()
    f = _blocks(codes.to(dtype)) * (1.0 / _V_CODE)
    f2 = f * f
    return (f2 * f2 * scale.to(dtype)[:, None]).view(-1)[:n]


def poisoned_elements(m_codes: torch.Tensor, m_scale: torch.Tensor) -> torch.Tensor:
    """(blocks, Q8_BLOCK) mask of the poisoned elements of 8-bit state, from its first moment's codes and scales."""
    return (_blocks(m_codes) == POISON) & torch.signbit(m_scale)[:, None]


def _block_scale(largest: torch.Tensor) -> torch.Tensor:
    return torch.where(largest >= _FLT_MIN, largest, torch.zeros_like(largest))


def quantize_m_(codes: torch.Tensor, scale: torch.Tensor, m: torch.Tensor, poisoned: torch.Tensor) -> None:
    """Write int8 codes and block scales of first-moment values ``m`` (1-D); ``poisoned`` ((blocks, Q8_BLOCK)
    bool) marks the elements stored as :data:`POISON`, whose blocks get a negative scale."""
    n = m.numel()
    x = torch.where(poisoned, torch.zeros_like(poisoned, dtype=m.dtype), _blocks(m))
    s = _block_scale(x.abs().amax(dim=1))
    live = s > 0
    inv = torch.where(live, 1.0 / torch.where(live, s, torch.ones_like(s)), torch.zeros_like(s))
    u = torch.clamp_max(torch.sqrt(x.abs() * inv[:, None]) * _M_CODE, _M_CODE)
    c = torch.where(live[:, None], torch.round(torch.copysign(u, x)), torch.zeros_like(u))
    c = torch.where(poisoned, torch.full_like(c, POISON), c)
    codes.copy_(c.view(-1)[:n])
    scale.copy_(torch.where(poisoned.any(dim=1), -s, s))


def quantize_v_(codes: torch.Tensor, scale: torch.Tensor, v: torch.Tensor, poisoned: torch.Tensor,
                roots: Optional[torch.Tensor] = None) -> None:
    """Write uint8 codes and block scales of second-moment values ``v`` (1-D, >= 0); ``roots`` is ``sqrt(v)`` when
    the caller has it already; ``poisoned`` marks the elements stored as code 0 and left out of the scales."""
    n = v.numel()
    zero = torch.zeros_like(poisoned, dtype=v.dtype)
    r = torch.where(poisoned, zero, _blocks(torch.sqrt(v) if roots is None else roots))
    flagged = poisoned.any(dim=1)
    largest = _blocks(v).amax(dim=1)
    if bool(flagged.any()):
        largest = torch.where(flagged, torch.clamp_max((r * r).amax(dim=1), _FLT_MAX), largest)
    s = _block_scale(largest)
    live = s > 0
    inv_root = torch.where(live, 1.0 / torch.sqrt(torch.where(live, s, torch.ones_like(s))), torch.zeros_like(s))
    u = torch.clamp_max(torch.sqrt(r * inv_root[:, None]) * _V_CODE, _V_CODE)
    c = torch.where(live[:, None] & ~poisoned, torch.round(u), torch.zeros_like(u))
    codes.copy_(c.view(-1)[:n])
    scale.copy_(s)


def nonfinite_elements(*xs: torch.Tensor) -> torch.Tensor:
    """(blocks, Q8_BLOCK) mask of the elements that are inf or NaN in any of ``xs``."""
    bad = None
    for x in xs:
        b = ~torch.isfinite(_blocks(x))
        bad = b if bad is None else bad | b
    return bad


def adam_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool,
    max_exp_avg_sq: Optional[torch.Tensor], maximize: bool, grad_scale: float, param_out: Optional[torch.Tensor],
    exp_avg_scale: Optional[torch.Tensor] = None, exp_avg_sq_scale: Optional[torch.Tensor] = None,
    max_exp_avg_sq_scale: Optional[torch.Tensor] = None,
) -> None:
    """Reference update on already-validated 1-D views (see functional.cpu_adam_ for the arguments). The arithmetic
    runs in ``param.dtype``."""
    cdt = param.dtype
    q8 = exp_avg.dtype == torch.int8
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    p_all, g_all = param.view(-1), grad.view(-1)
    m_all, v_all = exp_avg.view(-1), exp_avg_sq.view(-1)
    vmax_all = None if max_exp_avg_sq is None else max_exp_avg_sq.view(-1)
    out_all = None if param_out is None else param_out.view(-1)
    for start in range(0, p_all.numel(), CHUNK):
        sl = slice(start, start + CHUNK)
        bl = slice(start // Q8_BLOCK, (start + CHUNK) // Q8_BLOCK)  # this chunk's scale blocks (8-bit state)
        p = p_all[sl]
        g = _effective_grad(g_all[sl].to(cdt), p, lr, weight_decay, decoupled_weight_decay, maximize, grad_scale)
        if q8:
            poisoned = poisoned_elements(m_all[sl], exp_avg_scale[bl])
            if bool(poisoned.any()):
                p.masked_fill_(poisoned.view(-1)[: p.numel()], math.nan)
            m = dequantize_m(m_all[sl], exp_avg_scale[bl], cdt)
            v = dequantize_v(v_all[sl], exp_avg_sq_scale[bl], cdt)
        else:
            m, v = m_all[sl].to(cdt), v_all[sl].to(cdt)  # views for state of the compute dtype, copies otherwise
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        vmax = None
        if vmax_all is not None:
            old = dequantize_v(vmax_all[sl], max_exp_avg_sq_scale[bl], cdt) if q8 else vmax_all[sl].to(cdt)
            vmax = torch.maximum(old, v)
            root = vmax.sqrt()
        else:
            root = v.sqrt()
        denom = (root / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if q8:
            bad = poisoned | nonfinite_elements(m, v, *(() if vmax is None else (vmax,)))
            quantize_m_(m_all[sl], exp_avg_scale[bl], m, bad)
            quantize_v_(v_all[sl], exp_avg_sq_scale[bl], v, bad, None if vmax is not None else root)
            if vmax is not None:
                quantize_v_(vmax_all[sl], max_exp_avg_sq_scale[bl], vmax, bad, root)
        else:
            _store(m_all[sl], v_all[sl], None if vmax is None else vmax_all[sl], m, v, vmax)
        if out_all is not None:
            out_all[sl].copy_(p)  # last: param_out may be the gradient's memory, read above


def _effective_grad(g: torch.Tensor, p: torch.Tensor, lr: float, weight_decay: float, decoupled: bool,
                    maximize: bool, grad_scale: float) -> torch.Tensor:
    """The gradient the moments see (scaled, negated for ``maximize``, plus Adam's L2 term), applying AdamW's
    decoupled decay to ``p`` in place. Out of place on ``g``: the caller's gradient is never written."""
    if grad_scale != 1.0:
        g = g * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0.0:
        if decoupled:
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    return g


def _store(m_out: torch.Tensor, v_out: torch.Tensor, vmax_out: Optional[torch.Tensor], m: torch.Tensor,
           v: torch.Tensor, vmax: Optional[torch.Tensor]) -> None:
    """Write unquantised moments back where they are copies (state not in the compute dtype)."""
    if vmax is not None:
        vmax_out.copy_(vmax)
    if m.data_ptr() != m_out.data_ptr():
        m_out.copy_(m)
        v_out.copy_(v)


def grad_sq_norm(grad: torch.Tensor) -> Tuple[float, bool]:
    """(sum of squares in float64, whether any element is inf or nan) of a gradient buffer."""
    g = grad.view(-1)
    total, nonfinite = 0.0, False
    for start in range(0, g.numel(), CHUNK):
        chunk = g[start : start + CHUNK].float()
        nonfinite = nonfinite or not bool(torch.isfinite(chunk).all())
        total += float(chunk.double().square().sum())
    return total, nonfinite
