"""Pure-torch Adam(W) on flat CPU buffers: the fallback when the native kernel is unavailable, and the oracle the
tests hold the kernel to.

It performs torch.optim.AdamW's single-tensor arithmetic (lerp, mul + addcmul, sqrt / bias correction + eps,
addcdiv) with the bias corrections in double, on chunks of the buffer so that low-precision inputs never need a
full-size fp32 temporary.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

# Elements per chunk: large enough that per-op overhead is noise, small enough that fp32 temporaries stay in cache.
_CHUNK = 1 << 18


def adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    max_exp_avg_sq: Optional[torch.Tensor],
    maximize: bool,
    grad_scale: float,
    param_out: Optional[torch.Tensor],
) -> None:
    """Reference update on already-validated 1-D views (see functional.cpu_adam_ for the arguments)."""
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    p_all, g_all = param.view(-1), grad.view(-1)
    m_all, v_all = exp_avg.view(-1), exp_avg_sq.view(-1)
    vmax_all = None if max_exp_avg_sq is None else max_exp_avg_sq.view(-1)
    out_all = None if param_out is None else param_out.view(-1)
    for start in range(0, p_all.numel(), _CHUNK):
        sl = slice(start, start + _CHUNK)
        p = p_all[sl]
        g = g_all[sl].float()
        if grad_scale != 1.0:
            g = g * grad_scale  # out of place, like everything below: the caller's gradient is never written
        if maximize:
            g = -g
        if weight_decay != 0.0:
            if decoupled_weight_decay:
                p.mul_(1.0 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m, v = m_all[sl].float(), v_all[sl].float()  # views for fp32 state, copies for bf16
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if vmax_all is not None:
            vmax = torch.maximum(vmax_all[sl].float(), v)
            vmax_all[sl].copy_(vmax)
            denom = (vmax.sqrt() / bc2_sqrt).add_(eps)
        else:
            denom = (v.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        if m.data_ptr() != m_all[sl].data_ptr():
            m_all[sl].copy_(m)
            v_all[sl].copy_(v)
        if out_all is not None:
            out_all[sl].copy_(p)


def grad_sq_norm(grad: torch.Tensor) -> Tuple[float, bool]:
    """(sum of squares in float64, whether any element is inf or nan) of a gradient buffer."""
    g = grad.view(-1)
    total, nonfinite = 0.0, False
    for start in range(0, g.numel(), _CHUNK):
        chunk = g[start : start + _CHUNK].float()
        nonfinite = nonfinite or not bool(torch.isfinite(chunk).all())
        total += float(chunk.double().square().sum())
    return total, nonfinite
