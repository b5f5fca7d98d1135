"""8-bit block-wise state, the form the CPU-Adam kernel reads and writes for ``state_dtype=torch.int8`` (see
:mod:`zero_offload.functional` for the companding): conversion from and to float32, a chunk at a time."""

from __future__ import annotations

from typing import Optional

import torch

from zero_offload import _reference

__all__ = ["Q8_BLOCK", "dequantize_state", "q8_scale_numel", "quantize_state_"]

Q8_BLOCK = _reference.Q8_BLOCK  # elements per scale of 8-bit state: the buckets' 64-element slot alignment


def q8_scale_numel(numel: int) -> int:
    """Number of float32 scales 8-bit state of ``numel`` elements needs: one per started block of 64."""
    return -(-int(numel) // Q8_BLOCK)


def _check_codes(codes: object, scale: object, caller: str) -> int:
    for name, t in (("codes", codes), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{caller}: {name} must be a dense, contiguous CPU tensor (got {t.device}, {t.layout}, "
                             f"contiguous={t.is_contiguous()})")
    if codes.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"{caller}: codes must be int8 (exp_avg) or uint8 (exp_avg_sq, max_exp_avg_sq), got "
                        f"{codes.dtype}")
    n = codes.numel()
    if scale.dtype != torch.float32 or scale.numel() != q8_scale_numel(n):
        raise ValueError(f"{caller}: scale must be float32 with q8_scale_numel({n}) = {q8_scale_numel(n)} elements, "
                         f"got {scale.dtype} with {scale.numel()}")
    return n


def quantize_state_(codes: torch.Tensor, scale: torch.Tensor, values: torch.Tensor) -> None:
    """Quantise a moment into 8-bit block-wise state in place: the form :func:`cpu_adam_` reads and writes.

    The mapping follows the dtype of ``codes``: int8 is the first moment's signed code, uint8 the second moment's
    (see the module docstring), the kernel's requantisation (to a few ulps of the code position). An inf or NaN first
    moment is kept per element as the kernel keeps it (poisoned: it reads back as NaN); a second moment must be
    finite, as its codes cannot mark an element alone. Works a chunk at a time, so a whole bucket needs no full-size
    float temporary.

    Args:
        codes (Tensor): int8 (``exp_avg``) or uint8 (``exp_avg_sq``, ``max_exp_avg_sq``), n elements, contiguous,
            CPU; written.
        scale (Tensor): float32, ``q8_scale_numel(n)`` elements, contiguous, CPU; written.
        values (Tensor): the moment, any floating dtype, n elements (any shape, contiguous), CPU; >= 0 for uint8
            codes, and finite. Never written.
    """
    n = _check_codes(codes, scale, "quantize_state_")
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError("quantize_state_: values must be a floating-point torch.Tensor")
    if values.device.type != "cpu" or not values.is_contiguous() or values.numel() != n:
        raise ValueError(f"quantize_state_: values must be a contiguous CPU tensor of {n} elements, got "
                         f"{values.numel()} on {values.device}, contiguous={values.is_contiguous()}")
    signed = codes.dtype == torch.int8
    flat, c, chunk = values.reshape(-1), codes.view(-1), _reference.CHUNK
    if not signed and bool((flat < 0).any()):
        raise ValueError("quantize_state_: a second moment (uint8 codes) must be >= 0; values holds negatives")
    if not signed and not bool(torch.isfinite(flat).all()):
        raise ValueError("quantize_state_: a second moment (uint8 codes) must be finite; values holds inf or NaN")
    for start in range(0, n, chunk):
        x = flat[start : start + chunk].float()
        sl, bl = slice(start, start + chunk), slice(start // Q8_BLOCK, q8_scale_numel(start + chunk))
        bad = _reference.nonfinite_elements(x)
        if signed:
            _reference.quantize_m_(c[sl], scale[bl], x, bad)
        else:
            _reference.quantize_v_(c[sl], scale[bl], x, bad)


def dequantize_state(codes: torch.Tensor, scale: torch.Tensor, *, out: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """The float32 values of 8-bit block-wise state (the inverse of :func:`quantize_state_`, up to rounding).

    Args:
        codes (Tensor): int8 (``exp_avg``) or uint8 (``exp_avg_sq``, ``max_exp_avg_sq``), n elements, contiguous.
        scale (Tensor): float32, ``q8_scale_numel(n)`` elements.
        out (Tensor, optional): float32, n elements (any shape), contiguous, CPU: written and returned, so a
            bucket can be dequantised straight into, e.g., a state_dict's tensors. Default: a new 1-D tensor.

    Returns:
        Tensor: ``out``, or a new float32 tensor of n elements.
    """
    n = _check_codes(codes, scale, "dequantize_state")
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.device.type != "cpu"
          or not out.is_contiguous() or out.numel() != n):
        raise ValueError(f"dequantize_state: out must be a contiguous float32 CPU tensor of {n} elements")
    deq = _reference.dequantize_m if codes.dtype == torch.int8 else _reference.dequantize_v
    flat, c, chunk = out.view(-1), codes.view(-1), _reference.CHUNK
    for start in range(0, n, chunk):
        sl, bl = slice(start, start + chunk), slice(start // Q8_BLOCK, q8_scale_numel(start + chunk))
        flat[sl] = deq(c[sl], scale[bl], torch.float32)
    return out
