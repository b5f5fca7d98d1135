r"""Functional CPU-Adam on flat host buffers: validate once, then dispatch to the native kernel or the pure-torch
implementation.

The update, for gradient :math:`g` scaled by ``grad_scale`` :math:`s` (negated when ``maximize``), step :math:`t`:

.. math::
    \begin{aligned}
    g &\leftarrow s\,g \;(+\,\lambda\theta \text{ if L2, i.e. not decoupled}) \\
    \theta &\leftarrow \theta\,(1 - \gamma\lambda) \quad\text{(decoupled weight decay, AdamW)} \\
    m &\leftarrow m + (1-\beta_1)(g - m), \qquad v \leftarrow \beta_2 v + (1-\beta_2)\,g^2 \\
    \hat v &= \max(\hat v_{\text{prev}}, v) \text{ if amsgrad else } v \\
    \theta &\leftarrow \theta - \frac{\gamma}{1-\beta_1^t}\,\frac{m}{\sqrt{\hat v}/\sqrt{1-\beta_2^t} + \epsilon}
    \end{aligned}

which is ``torch.optim.AdamW`` (``decoupled_weight_decay=True``) or ``torch.optim.Adam``, with bias corrections in
double precision.

State dtypes (chosen by the dtype of ``exp_avg``), bytes per element for the two moments together:

* float32 (8 B): exactly the arithmetic above.
* bfloat16 (4 B): each moment is read as bf16, updated in fp32, rounded back to nearest-even bf16.
* 8-bit block-wise (2 B, plus 2 x 4 B per :data:`Q8_BLOCK` = 64 elements for the scales, 2.125 B in all): int8
  ``exp_avg`` and uint8 ``exp_avg_sq`` (and ``max_exp_avg_sq``), each with a float32 scale per block of 64 elements,
  ``*_scale`` tensors of :func:`q8_scale_numel` ``(n)`` elements. Codes compand by a square root so that small values
  keep resolution: :math:`m = s\,c|c|/127^2`, :math:`v = s\,(c/255)^4`, :math:`s` the block's largest magnitude,
  recomputed from the block's new values each step. The parameter is updated from the unquantised new moments;
  the moments are then requantised in the same memory pass. Blocks are independent: a slice that starts at a
  multiple of 64 (with the matching slice of the scales) can be updated alone. An element whose moment turns inf
  or NaN keeps it alone, as in AdamW (it reads back as NaN, its parameter becomes NaN; the rest of its block is
  untouched): see ``_reference`` for how it is marked. :func:`quantize_state_` and :func:`dequantize_state` convert
  to and from float32.

Implementation choice, made in :func:`resolve_path` and nowhere else (:func:`path_reason` says why): the environment
variable ``ZERO_OFFLOAD_SIMD`` (``avx512``, ``avx2``, ``neon``, ``scalar``, ``torch-fused`` or ``torch``) forces a path
and an impossible choice is an error, never a silent substitute; unset (or ``auto``):

* the best SIMD unit of the native kernel this CPU runs (AVX-512, AVX2, NEON);
* on a CPU with none of them (the native kernel then has only its scalar loop: x86 without AVX2, ARM other than
  AArch64, any other architecture), ``torch-fused`` for fp32 state, where torch's vectorized kernel is faster than a
  scalar loop (2x, measured on x86), and ``scalar`` for bf16 and 8-bit state, which torch's kernel does not do and
  the pure-torch reference does 24-42x slower;
* with one warning when the kernel cannot be built, ``torch-fused``: torch's own fused CPU Adam(W) for fp32 state
  (torch >= 2.4, see :mod:`zero_offload._torch_fused`) and the pure-torch reference for bf16 and 8-bit state;
  ``torch`` is the pure-torch reference for everything (on torch 2.3, the fallback).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from zero_offload import _build, _reference, _torch_fused, affinity
from zero_offload._checks import (GRAD_DTYPES, buffers_of, check_buffer, check_grads, check_hparams, check_hyper,
                                  check_out, check_out_vs_grad, check_segments, check_state, overlap)
from zero_offload.quantize import Q8_BLOCK, dequantize_state, q8_scale_numel, quantize_state_

__all__ = ["cpu_adam_", "cpu_adam_segments_", "check_hparams", "grad_sq_norm", "grad_sq_norm_segments",
           "queued_updates", "resolve_path", "path_reason", "PATHS", "OUT_KEYS",
           "Q8_BLOCK", "q8_scale_numel", "quantize_state_", "dequantize_state"]

PATHS = ("avx512", "avx2", "neon", "scalar", "torch-fused", "torch")
_TORCH_PATHS = ("torch-fused", "torch")


_SIMD_ISAS = ("avx512", "avx2", "neon")  # the native kernel's vector units; "scalar" is its portable loop


def resolve_path(state_dtype: torch.dtype = torch.float32) -> str:
    """The implementation the next call will use: an ISA name of the native kernel, ``"torch-fused"`` or
    ``"torch"`` (see the module docstring; :func:`path_reason` says why).

    Args:
        state_dtype (torch.dtype): the dtype of ``exp_avg`` of the update asked about (float32, bfloat16 or int8):
            where the native kernel has no SIMD unit for this CPU, fp32 state goes to torch's fused kernel and the
            compact states to ours. Default: torch.float32.
    """
    return _resolve(state_dtype)[0]


def _resolve(state_dtype: torch.dtype) -> Tuple[str, object]:
    """:func:`resolve_path`'s answer, with the native module (None where the path is not native)."""
    forced = os.environ.get("ZERO_OFFLOAD_SIMD", "").strip().lower()
    if forced in ("", "auto"):
        native, isas = _build.load_native(), _build.native_isas()
        if not isas:
            return "torch-fused" if _torch_fused.AVAILABLE else "torch", None
        if isas[0] not in _SIMD_ISAS and state_dtype == torch.float32 and _torch_fused.AVAILABLE:
            return "torch-fused", None
        return isas[0], native
    if forced not in PATHS:
        raise ValueError(f"Invalid ZERO_OFFLOAD_SIMD={forced!r}: expected one of {', '.join(PATHS)} or auto")
    if forced == "torch-fused" and not _torch_fused.AVAILABLE:
        raise RuntimeError(f"ZERO_OFFLOAD_SIMD=torch-fused needs torch's fused CPU Adam (torch >= 2.4); this is "
                           f"torch {torch.__version__}")
    if forced in _TORCH_PATHS:
        return forced, None
    native, isas = _build.load_native(), _build.native_isas()
    if native is None:
        raise RuntimeError(
            f"ZERO_OFFLOAD_SIMD={forced} asks for the native kernel, which could not be built: "
            f"{_build.status().detail}"
        )
    if forced not in isas:
        raise RuntimeError(
            f"ZERO_OFFLOAD_SIMD={forced}: that ISA is not available on this CPU/build (available: {', '.join(isas)})"
        )
    return forced, native


def path_reason() -> str:
    """One line: the paths :func:`resolve_path` picks for fp32 and for compact (bf16, 8-bit) state, and why (shown
    by ``python -m zero_offload.report``). Raises as :func:`resolve_path` does for an impossible forced choice."""
    fp32, compact = resolve_path(torch.float32), resolve_path(torch.bfloat16)
    forced = os.environ.get("ZERO_OFFLOAD_SIMD", "").strip().lower()
    if forced not in ("", "auto"):
        return f"{fp32}: forced by ZERO_OFFLOAD_SIMD={forced}"
    if fp32 in _SIMD_ISAS:
        return f"{fp32}: the widest SIMD unit of the native kernel that this CPU runs"
    if fp32 == "scalar":
        return (f"scalar: the native kernel has no SIMD unit for this CPU, and torch {torch.__version__} has no fused "
                "CPU AdamW (torch >= 2.4) to take fp32 state instead")
    if fp32 == compact:
        return f"{fp32}: the native kernel is unavailable ({_build.status().detail or 'not built'})"
    return (f"{fp32} for fp32 state, {compact} for bf16/8-bit state: the native kernel has no SIMD unit for this CPU "
            "(only its scalar loop), so fp32 state goes to torch's vectorized fused AdamW, faster than a scalar "
            "loop; torch's kernel has no bf16/8-bit state, and our scalar loop beats the pure-torch reference there")


OUT_KEYS = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale",
            "max_exp_avg_sq_scale")


def _copy_sources(sources: Dict[str, torch.Tensor], out: Dict[str, torch.Tensor], elems: slice,
                  blocks: slice) -> Dict[str, torch.Tensor]:
    """The torch paths' out-of-place update: the slice (``blocks`` for the scales) of every source copied into its
    destination, for an in-place update there. Returns the destinations' slices."""
    views = {}
    for key, src in sources.items():
        sl = blocks if key.endswith("_scale") else elems
        dst, part = out[key].view(-1)[sl], src.view(-1)[sl]
        if dst.data_ptr() != part.data_ptr():
            dst.copy_(part)
        views[key] = dst
    return views


def _q8_kwargs(exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq_scale, amsgrad: bool) -> dict:
    return dict(exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale,
                max_exp_avg_sq_scale=max_exp_avg_sq_scale if amsgrad else None)


def cpu_adam_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    step: Union[int, torch.Tensor], lr: Union[float, torch.Tensor], betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8, weight_decay: float = 0.0, decoupled_weight_decay: bool = True, amsgrad: bool = False,
    max_exp_avg_sq: Optional[torch.Tensor] = None, maximize: bool = False, grad_scale: float = 1.0,
    param_out: Optional[torch.Tensor] = None, exp_avg_scale: Optional[torch.Tensor] = None,
    exp_avg_sq_scale: Optional[torch.Tensor] = None, max_exp_avg_sq_scale: Optional[torch.Tensor] = None,
    out: Optional[Mapping[str, torch.Tensor]] = None,
) -> None:
    """One fused Adam/AdamW update of flat CPU buffers, in place (or into ``out``), in one memory pass.

    Every argument is checked before anything is written; a bad one raises ``ValueError``/``TypeError`` naming it
    and leaves every tensor untouched.

    Args:
        param (Tensor): fp32 master weights, updated in place.
        grad (Tensor): gradient, fp32, bf16 or fp16, same number of elements; never written.
        exp_avg (Tensor): first moment: fp32, bf16 (saves 4 bytes per element of state, at bf16 accuracy), or int8
            codes of 8-bit block-wise state (saves 5.875 bytes; see the module docstring).
        exp_avg_sq (Tensor): second moment, same dtype as ``exp_avg``; uint8 codes when ``exp_avg`` is int8.
        step (int or Tensor): the 1-based step count *after* this update (``torch.optim``'s ``state["step"]``).
        lr (float or Tensor): learning rate, >= 0.
        betas (Tuple[float, float]): coefficients of the running averages. Default: (0.9, 0.999).
        eps (float): added to the denominator. Default: 1e-8.
        weight_decay (float): weight decay coefficient. Default: 0.
        decoupled_weight_decay (bool): True for AdamW's decay of the weights, False for Adam's L2 term added to
            the gradient. Default: True.
        amsgrad (bool): use the running maximum of ``exp_avg_sq``, kept in ``max_exp_avg_sq``. Default: False.
        max_exp_avg_sq (Tensor, optional): amsgrad's buffer, same dtype as ``exp_avg_sq``; required iff amsgrad.
        maximize (bool): ascend instead of descend. Default: False.
        grad_scale (float): multiplies the gradient first, in the same pass: a loss-scale inverse times a
            clipping coefficient. Default: 1.
        param_out (Tensor, optional): receives the updated parameter rounded (nearest-even) to its dtype, fp32,
            bf16 or fp16: the low-precision copy to send back to the GPU. It may be ``grad`` itself (same memory,
            same element size, e.g. a bf16 gradient buffer that then carries the bf16 parameter back); any other
            overlap with an argument is an error. Default: None.
        exp_avg_scale (Tensor, optional): 8-bit state only (then required): float32, ``q8_scale_numel(n)``
            elements, one per block of 64 of ``exp_avg``. Default: None.
        exp_avg_sq_scale (Tensor, optional): the same for ``exp_avg_sq``. Default: None.
        max_exp_avg_sq_scale (Tensor, optional): the same for ``max_exp_avg_sq``; 8-bit state with amsgrad only.
            Default: None.
        out (Dict[str, Tensor], optional): write the update here, bit-identical, the arguments left as they were
            (a ping-pong between two buffer sets): for each buffer the call updates, by keyword (:data:`OUT_KEYS`, no other),
            one of its dtype and size, contiguous, that very buffer or sharing no memory with any other. Native:
            the same single pass; torch paths: a copy into ``out``, then in place there. Default: None (in place).
    """
    numel = check_state(param, exp_avg, exp_avg_sq, amsgrad, max_exp_avg_sq, param_out, exp_avg_scale,
                         exp_avg_sq_scale, max_exp_avg_sq_scale)
    check_buffer(grad, "grad", numel, GRAD_DTYPES)
    if param_out is not None:
        check_out_vs_grad(param_out, grad, "grad")
    step_i, lr_f, beta1, beta2, eps_f, wd, scale = check_hyper(step, lr, betas, eps, weight_decay, grad_scale)
    vmax = max_exp_avg_sq if amsgrad else None
    q8_kw = _q8_kwargs(exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq_scale, amsgrad)
    out = check_out(out, buffers_of(param, exp_avg, exp_avg_sq, vmax, q8_kw), dict(grad=grad, param_out=param_out))
    path, native = _resolve(exp_avg.dtype)
    if numel == 0:
        return
    _adam_dispatch(path, native, (param, grad, exp_avg, exp_avg_sq, vmax, param_out), q8_kw, step_i, lr_f, beta1,
                   beta2, eps_f, wd, bool(decoupled_weight_decay), bool(maximize), scale, out)


def _adam_dispatch(path: str, native, tensors: tuple, q8_kw: dict, step: int, lr: float, beta1: float,
                   beta2: float, eps: float, wd: float, decoupled: bool, maximize: bool, scale: float,
                   out: Optional[Dict[str, torch.Tensor]] = None) -> None:
    """:func:`cpu_adam_`'s update on validated arguments by ``path`` (``native``: the module of a native path, as
    :func:`_resolve` gives them): ``tensors`` are (param, grad, exp_avg, exp_avg_sq, the amsgrad maximum or None,
    param_out or None); ``out`` (checked; native paths only) the destinations."""
    param, grad, exp_avg, exp_avg_sq, vmax, param_out = tensors
    if out is not None and path in _TORCH_PATHS:  # copy, then in place there
        views = _copy_sources(buffers_of(param, exp_avg, exp_avg_sq, vmax, q8_kw), out, slice(None), slice(None))
        param, exp_avg, exp_avg_sq, vmax = (views.get(k) for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        q8_kw = {k: views.get(k) for k in q8_kw}
    if path == "torch-fused" and _torch_fused.handles(exp_avg):
        _torch_fused.adam_(
            [param], [grad], [exp_avg], [exp_avg_sq], None if vmax is None else [vmax], step=step, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd, decoupled_weight_decay=decoupled,
            maximize=maximize, grad_scale=scale, param_outs=None if param_out is None else [param_out],
        )  # fmt: skip
    elif path in _TORCH_PATHS:
        _reference.adam_(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=wd, decoupled_weight_decay=decoupled, max_exp_avg_sq=vmax, maximize=maximize,
            grad_scale=scale, param_out=param_out, **q8_kw,
        )  # fmt: skip
    else:
        affinity.ensure(native)
        _native_call(
            native.adam_step, path, param, grad, exp_avg, exp_avg_sq, vmax, param_out, step, lr, beta1, beta2, eps,
            wd, decoupled, maximize, scale, **q8_kw, out=out,
        )  # fmt: skip


class _Queue(threading.local):
    calls: Optional[List[Tuple[Callable[..., Any], tuple, dict]]] = None


_QUEUE = _Queue()


@contextlib.contextmanager
def queued_updates() -> Iterator[None]:
    """Within this context (in this thread), the native kernel's updates are queued, then run back to back, in
    order, when it exits: also when its body raises, before the error goes on, so that what the body recorded of
    them (step counts) stays true. Each update streams tens of MB past the caches, and the Python and torch work
    between two of them then runs cold: a small torch op takes 90-170 us after a pass against 5 us warm (measured
    on a 2-core EPYC VM), about 0.5 ms of a step per bucket. Queued, that work all runs before the first pass.

    Only for a caller whose code between the calls neither reads nor writes what they update (the step on buckets
    whose parameters are the kernel's output: :attr:`~zero_offload.transport.base.Route.upload_reads` False).
    The torch paths run at once. Nested, the outermost runs the queue."""
    if _QUEUE.calls is not None:
        yield
        return
    calls: List[Tuple[Callable[..., Any], tuple, dict]] = []
    _QUEUE.calls = calls
    try:
        yield
    finally:
        _QUEUE.calls = None
        for fn, args, kw in calls:
            fn(*args, **kw)


def _native_call(fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
    """``fn(*args, **kw)`` now, or queued by :func:`queued_updates`."""
    calls = _QUEUE.calls
    if calls is None:
        fn(*args, **kw)
    else:
        calls.append((fn, args, kw))


def grad_sq_norm(grad: torch.Tensor) -> Tuple[float, bool]:
    """Squared L2 norm of a flat CPU gradient buffer, and whether it holds inf or nan, in one read.

    Args:
        grad (Tensor): contiguous CPU tensor, fp32, bf16 or fp16.

    Returns:
        (float, bool): the sum of squares (float partial sums over short blocks, accumulated in float64) and the
        non-finite flag. The flag is exact: finite values whose squares overflow fp32 give an infinite sum, as
        torch's fp32 norm does, without setting it.
    """
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad_sq_norm: grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.layout != torch.strided or grad.device.type != "cpu" or not grad.is_contiguous():
        raise ValueError(f"grad_sq_norm: grad must be a dense, contiguous CPU tensor (got {grad.device}, "
                         f"{grad.layout}, contiguous={grad.is_contiguous()})")
    if grad.dtype not in GRAD_DTYPES:
        raise TypeError(f"grad_sq_norm: unsupported dtype {grad.dtype}")
    path, native = _resolve(torch.float32)
    if grad.numel() == 0:
        return 0.0, False
    if path in _TORCH_PATHS:
        return _reference.grad_sq_norm(grad)
    affinity.ensure(native)
    total, nonfinite = native.grad_sq_norm(path, grad)
    return float(total), bool(nonfinite)


def cpu_adam_segments_(
    param: torch.Tensor, grads: Sequence[torch.Tensor], offsets: Sequence[int], exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor, *, step: Union[int, torch.Tensor], lr: Union[float, torch.Tensor],
    betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True, amsgrad: bool = False, max_exp_avg_sq: Optional[torch.Tensor] = None,
    maximize: bool = False, grad_scale: float = 1.0, param_out: Optional[torch.Tensor] = None,
    exp_avg_scale: Optional[torch.Tensor] = None, exp_avg_sq_scale: Optional[torch.Tensor] = None,
    max_exp_avg_sq_scale: Optional[torch.Tensor] = None, out: Optional[Mapping[str, torch.Tensor]] = None,
) -> None:
    """:func:`cpu_adam_` on the flat buffers where the gradient of elements
    ``[offsets[i], offsets[i] + grads[i].numel())`` is read from ``grads[i]`` itself, so gradients that live in
    separate tensors need no copy into one buffer first. Elements outside every segment are not touched.

    Validation is :func:`cpu_adam_`'s, plus: every ``grads[i]`` a dense, contiguous CPU tensor, all of one dtype
    (fp32, bf16 or fp16); ``offsets`` sorted, segments non-overlapping and within the buffers; with 8-bit state,
    every offset a multiple of :data:`Q8_BLOCK`, so that each segment owns its scale blocks. ``param_out`` may hold
    the gradients (``grads[i]`` exactly ``param_out[offsets[i]:...]``). The result on each segment is bit-identical
    to :func:`cpu_adam_` on that segment's slices alone (and, for 8-bit state, its slice of the scales,
    ``[offset // 64, ceil(end / 64))``). With ``out`` (as :func:`cpu_adam_`'s; no destination may overlap a
    gradient), the segments' elements (and their blocks' scales) of the destinations are written; the rest of
    them is left as it was.
    """
    numel = check_state(param, exp_avg, exp_avg_sq, amsgrad, max_exp_avg_sq, param_out, exp_avg_scale,
                         exp_avg_sq_scale, max_exp_avg_sq_scale)
    check_grads(grads, "cpu_adam_segments_")
    offsets = check_segments(grads, offsets, numel, exp_avg.dtype == torch.int8)
    step_i, lr_f, beta1, beta2, eps_f, wd, scale = check_hyper(step, lr, betas, eps, weight_decay, grad_scale)
    vmax = max_exp_avg_sq if amsgrad else None
    q8_kw = _q8_kwargs(exp_avg_scale, exp_avg_sq_scale, max_exp_avg_sq_scale, amsgrad)
    # (against the gradients too: in C++ on the native path, without a Python loop; in _torch_segments else)
    out = check_out(out, buffers_of(param, exp_avg, exp_avg_sq, vmax, q8_kw), dict(param_out=param_out),
                     "cpu_adam_segments_")
    _segments_dispatch(param, grads, offsets, (exp_avg, exp_avg_sq, vmax), param_out, q8_kw,
                       (step_i, lr_f, beta1, beta2, eps_f, wd, bool(decoupled_weight_decay), bool(maximize), scale),
                       out)


def adam_own_(param: torch.Tensor, grads: Union[torch.Tensor, Sequence[torch.Tensor]],
              offsets: Optional[Sequence[int]], state: Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
              param_out: Optional[torch.Tensor], q8_kw: Dict[str, Optional[torch.Tensor]], hyper: tuple) -> None:
    """:func:`cpu_adam_` (``offsets`` None: ``grads`` one flat gradient buffer) or :func:`cpu_adam_segments_` on
    the optimizer's own buffers, which it allocated to size and checked once: ``param`` (the master), ``state``
    (exp_avg, exp_avg_sq, the amsgrad maximum or None), ``param_out``, a flat gradient buffer and the 8-bit scales
    ``q8_kw`` are not checked again, nor ``hyper`` (step, lr, beta1, beta2, eps, weight_decay, decoupled, maximize,
    grad_scale; the group's are validated when read); gradients where the user left them, and their segments, are. Spares every bucket of every step the Python checks of its buffers."""
    if math.isinf(hyper[-1]):  # (NaN passes: a clip coefficient of a NaN norm makes every gradient NaN, as torch's)
        raise ValueError(f"Invalid grad_scale: {hyper[-1]} (must be finite)")
    if offsets is None:
        path, native = _resolve(state[0].dtype)
        if param.numel():
            _adam_dispatch(path, native, (param, grads, *state, param_out), q8_kw, *hyper)
        return
    check_grads(grads, "cpu_adam_segments_")
    offsets = check_segments(grads, offsets, param.numel(), state[0].dtype == torch.int8)
    _segments_dispatch(param, grads, offsets, state, param_out, q8_kw, hyper)


def _segments_dispatch(param, grads, offsets, state, param_out, q8_kw, hyper, out=None) -> None:
    """:func:`cpu_adam_segments_`'s update on checked arguments, by the path :func:`_resolve` picks."""
    path, native = _resolve(state[0].dtype)
    if not grads:
        return
    if path in _TORCH_PATHS:
        kw = dict(zip(("step", "lr", "beta1", "beta2", "eps", "weight_decay", "decoupled_weight_decay", "maximize",
                       "grad_scale"), hyper))
        _torch_segments(path, param, grads, offsets, state, param_out, q8_kw, kw, out)
    else:
        affinity.ensure(native)
        _native_call(native.adam_step_segments, path, param, list(grads), offsets, *state, param_out, *hyper,
                     **q8_kw, out=out)


def _torch_segments(path, param, grads, offsets, state, param_out, q8_kw, kw, out=None) -> None:
    """:func:`cpu_adam_segments_` on a torch path: ``state`` is (exp_avg, exp_avg_sq, the amsgrad maximum or
    None), ``kw`` the validated hyperparameters, ``out`` the checked destinations or None."""
    exp_avg, exp_avg_sq, vmax = state
    if param_out is not None:  # the native path checks this in C++, without a Python loop
        for i, (o, g) in enumerate(zip(offsets, grads)):
            check_out_vs_grad(param_out, g, f"grads[{i}]", "cpu_adam_segments_", o)
    if out is not None:
        bad = next(((key, i) for key, dst in out.items() for i, g in enumerate(grads) if overlap(dst, g)), None)
        if bad is not None:
            raise ValueError(f"cpu_adam_segments_: out[{bad[0]!r}] overlaps grads[{bad[1]}]")
        sources, out = buffers_of(param, exp_avg, exp_avg_sq, vmax, q8_kw), {k: t.view(-1) for k, t in out.items()}
        for o, g in zip(offsets, grads):
            _copy_sources(sources, out, slice(o, o + g.numel()), slice(o // Q8_BLOCK, q8_scale_numel(o + g.numel())))
        param, exp_avg, exp_avg_sq, vmax = (out.get(k) for k in ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        q8_kw = {k: out.get(k) for k in q8_kw}
    if path == "torch-fused" and _torch_fused.handles(exp_avg):
        _torch_fused.adam_segments_(param, grads, offsets, exp_avg, exp_avg_sq, vmax, param_out, kw)
        return
    for o, g in zip(offsets, grads):
        n = g.numel()
        if n == 0:
            continue
        sl, bl = slice(o, o + n), slice(o // Q8_BLOCK, q8_scale_numel(o + n))
        _reference.adam_(
            param[sl], g, exp_avg[sl], exp_avg_sq[sl], max_exp_avg_sq=None if vmax is None else vmax[sl],
            param_out=None if param_out is None else param_out[sl],
            **{k: None if t is None else t[bl] for k, t in q8_kw.items()}, **kw,
        )  # fmt: skip


def grad_sq_norm_segments(grads: Sequence[torch.Tensor]) -> Tuple[float, bool]:
    """:func:`grad_sq_norm` of several gradient tensors taken as one vector (each a dense, contiguous CPU
    tensor, all of one dtype), without gathering them into one buffer. The combination order is fixed, so the
    result does not depend on thread timing."""
    check_grads(grads, "grad_sq_norm_segments")
    path, native = _resolve(torch.float32)
    if path in _TORCH_PATHS:
        total, nonfinite = 0.0, False
        for g in grads:
            if g.numel():
                s, bad = _reference.grad_sq_norm(g)
                total, nonfinite = total + s, nonfinite or bad
        return total, nonfinite
    if not grads:
        return 0.0, False
    affinity.ensure(native)
    total, nonfinite = native.grad_sq_norm_segments(path, list(grads))
    return float(total), bool(nonfinite)
