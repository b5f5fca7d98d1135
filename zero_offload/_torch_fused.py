"""torch's own fused CPU Adam(W) (``torch._fused_adamw_`` / ``torch._fused_adam_``, torch >= 2.4) as the fallback
when the native kernel cannot be built: about 20x faster than the pure-torch reference, which stays the fallback
for what torch's kernel does not do (bf16 and 8-bit state) and on older torch.

Where its arithmetic matches ours (checked by tests/test_kernel.py, every mode at the SIMD tail sizes, against
``torch.optim.AdamW``/``Adam`` at default fp32 tolerance):

* fp32 master and fp32 moments (its kernel wants every tensor in one dtype);
* AdamW and Adam (L2) decay, amsgrad, maximize: the same operations in the same order, bias corrections in double;
* the gradient: torch's kernel *divides* by its ``grad_scale`` while ours multiplies, so a gradient that is not
  fp32, or a multiplier other than 1, is first made an fp32 temporary ``grad * grad_scale`` (our rounding
  exactly), and the kernel runs unscaled;
* ``param_out``: the master cast to its dtype afterwards (nearest-even, as ours rounds).
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence

import torch

__all__ = ["AVAILABLE", "available_on", "handles", "adam_", "adam_segments_", "scaled_fp32"]

AVAILABLE = hasattr(torch, "_fused_adamw_") and torch.__version__ >= (2, 4)  # CPU kernels arrived in torch 2.4


def available_on(device: torch.device) -> bool:
    """Whether torch has the fused kernel for tensors on ``device`` (CUDA's since torch 2.0, the CPU's since 2.4)."""
    return AVAILABLE if device.type == "cpu" else hasattr(torch, "_fused_adamw_")


def handles(exp_avg: torch.Tensor) -> bool:
    """Whether an update with this state goes to torch's fused kernel (fp32 state) or the reference."""
    return AVAILABLE and exp_avg.dtype == torch.float32


_dtype = operator.attrgetter("dtype")
_FP32 = {torch.float32}


def scaled_fp32(grads: Sequence[torch.Tensor], scale: float) -> List[torch.Tensor]:
    """The gradients as fp32 times ``scale``: themselves where they are fp32 and ``scale`` is 1, else new tensors.
    Upcast (exact) then multiply in fp32: the native kernel's order, so the same rounding. One multi-tensor call
    multiplies them all (a CUDA kernel or a few, not one per gradient; the same product, the scale rounded to fp32
    as ``g * scale`` rounds it); a multiplier of 1 multiplies nothing."""
    if set(map(_dtype, grads)) == _FP32:  # (C-level passes: thousands of gradients a step)
        return list(grads) if scale == 1.0 else list(torch._foreach_mul(list(grads), scale))
    ups = [g.to(torch.float32, copy=True) for g in grads]
    if scale != 1.0:
        torch._foreach_mul_(ups, scale)
    return ups


def adam_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
          exp_avg_sqs: Sequence[torch.Tensor], max_exp_avg_sqs: Optional[Sequence[torch.Tensor]], *, step: int,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool,
          maximize: bool, grad_scale: float, param_outs: Optional[Sequence[torch.Tensor]]) -> None:
    """One update of several same-length lists of fp32 tensors on one device (validated by the caller) in one
    kernel call.

    ``grad_scale`` multiplies the gradients; ``param_outs`` (optional) receive the updated params in their dtype.
    """
    if not params:
        return
    grads = scaled_fp32(grads, grad_scale)
    # Read, not written, by the kernel; on the tensors' device (a fill there, no host synchronisation).
    steps = [torch.full((), float(step), dtype=torch.float32, device=params[0].device)] * len(params)
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    amsgrad = max_exp_avg_sqs is not None
    kernel(list(params), grads, list(exp_avgs), list(exp_avg_sqs), list(max_exp_avg_sqs) if amsgrad else [],
           steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
           maximize=maximize)
    if param_outs is not None:
        for out, p in zip(param_outs, params):
            out.view(-1).copy_(p.view(-1))  # (an out-of-place update hands its flat destinations)


def adam_segments_(param: torch.Tensor, grads: Sequence[torch.Tensor], offsets: Sequence[int], exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, vmax: Optional[torch.Tensor], param_out: Optional[torch.Tensor],
                   kw: dict) -> None:
    """:func:`adam_` of gradient segments at ``offsets`` of flat buffers (validated by the caller), each segment a
    slice of them, all in one kernel call; ``kw``: :func:`adam_`'s keyword arguments but ``param_outs``."""
    live = [(o, g) for o, g in zip(offsets, grads) if g.numel()]
    sls = [slice(o, o + g.numel()) for o, g in live]
    adam_(
        [param[sl] for sl in sls], [g for _, g in live], [exp_avg[sl] for sl in sls], [exp_avg_sq[sl] for sl in sls],
        None if vmax is None else [vmax[sl] for sl in sls],
        param_outs=None if param_out is None else [param_out[sl] for sl in sls], **kw,
    )  # fmt: skip
