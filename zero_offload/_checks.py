"""The checks of :mod:`zero_offload.functional`'s arguments, each raising ``ValueError``/``TypeError`` that names the
argument before anything is written: buffers (dense, contiguous, on the CPU, of a supported dtype and size, no
forbidden overlap), out-of-place destinations, hyperparameters (AdamW's own messages), gradients and their segments.
"""

from __future__ import annotations

import itertools
import math
import operator
from numbers import Real
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from zero_offload.quantize import Q8_BLOCK, q8_scale_numel

__all__ = ["CheckedGrads", "GRAD_DTYPES", "OUT_DTYPES", "STATE_DTYPES", "as_float", "buffers_of", "check_buffer",
           "check_grads", "check_hparams", "check_hyper", "check_out", "check_out_vs_grad", "check_segments",
           "check_state", "overlap"]

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_get_layout, _get_dtype = operator.attrgetter("layout"), operator.attrgetter("dtype")


def as_float(value: Union[float, torch.Tensor], name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_buffer(t: object, name: str, numel: int, dtypes: Tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cpu_adam_: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"cpu_adam_: {name} must be a dense tensor, got layout {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"cpu_adam_: {name} must be on the CPU, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"cpu_adam_: {name} must be contiguous (the kernel writes in place; pass a contiguous buffer)")
    if t.numel() != numel:
        raise ValueError(f"cpu_adam_: {name} has {t.numel()} elements but param has {numel}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"cpu_adam_: {name} has unsupported dtype {t.dtype} (supported: {allowed})")


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and lo_a < lo_b + b.nbytes and lo_b < lo_a + a.nbytes


def check_out_vs_grad(param_out: torch.Tensor, grad: torch.Tensor, name: str, caller: str = "cpu_adam_",
                       offset: int = 0) -> None:
    """param_out may be the gradient's own memory slot for slot (each slot is read as a gradient before it is
    written as the parameter), never a partial overlap. ``offset``: the element of param_out that grad's first
    element updates."""
    same_slot = grad.data_ptr() == param_out.data_ptr() + offset * param_out.element_size()
    if grad.numel() and same_slot and grad.element_size() == param_out.element_size():
        return
    if overlap(param_out, grad):
        raise ValueError(f"{caller}: param_out overlaps {name} without being exactly its memory (param_out may "
                         "share the gradient's memory only slot for slot, with the same element size)")


def check_state(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, amsgrad: bool,
                 max_exp_avg_sq: Optional[torch.Tensor], param_out: Optional[torch.Tensor],
                 exp_avg_scale: Optional[torch.Tensor] = None, exp_avg_sq_scale: Optional[torch.Tensor] = None,
                 max_exp_avg_sq_scale: Optional[torch.Tensor] = None) -> int:
    """Check the flat buffers of an update (all but the gradient); returns their number of elements."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"cpu_adam_: param must be a torch.Tensor, got {type(param).__name__}")
    numel = param.numel()
    check_buffer(param, "param", numel, (torch.float32,))
    check_buffer(exp_avg, "exp_avg", numel, STATE_DTYPES)
    q8 = exp_avg.dtype == torch.int8
    sq_dtype = torch.uint8 if q8 else exp_avg.dtype
    check_buffer(exp_avg_sq, "exp_avg_sq", numel, (sq_dtype,))
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("cpu_adam_: amsgrad=True needs max_exp_avg_sq")
        check_buffer(max_exp_avg_sq, "max_exp_avg_sq", numel, (sq_dtype,))
    elif max_exp_avg_sq is not None:
        raise ValueError("cpu_adam_: max_exp_avg_sq was given but amsgrad=False")
    scales = {"exp_avg_scale": exp_avg_scale, "exp_avg_sq_scale": exp_avg_sq_scale,
              "max_exp_avg_sq_scale": max_exp_avg_sq_scale}
    if q8:
        if not amsgrad and max_exp_avg_sq_scale is not None:
            raise ValueError("cpu_adam_: max_exp_avg_sq_scale was given but amsgrad=False")
        for name, t in scales.items():
            if t is None and (amsgrad or name != "max_exp_avg_sq_scale"):
                raise ValueError(f"cpu_adam_: 8-bit state (int8 exp_avg) needs {name}: float32, "
                                 f"q8_scale_numel({numel}) = {q8_scale_numel(numel)} elements")
            if t is not None:
                check_buffer(t, name, q8_scale_numel(numel), (torch.float32,))
    else:
        given = [name for name, t in scales.items() if t is not None]
        if given:
            raise ValueError(f"cpu_adam_: {', '.join(given)} given, but scales belong to 8-bit state only "
                             f"(exp_avg is {exp_avg.dtype})")
    if param_out is not None:
        check_buffer(param_out, "param_out", numel, OUT_DTYPES)
        others = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq,
                  **scales}
        for name, t in others.items():
            if t is not None and overlap(param_out, t):
                raise ValueError(f"cpu_adam_: param_out overlaps {name} (only the gradient may share its memory)")
    return numel


def buffers_of(param, exp_avg, exp_avg_sq, vmax, q8_kw) -> Dict[str, torch.Tensor]:
    """The buffers an update reads and writes, by their ``out`` keys (those it has)."""
    named = dict(param=param, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, max_exp_avg_sq=vmax, **q8_kw)
    return {k: t for k, t in named.items() if t is not None}


def check_out(out: object, sources: Dict[str, torch.Tensor], others: Dict[str, Optional[torch.Tensor]],
               caller: str = "cpu_adam_") -> Optional[Dict[str, torch.Tensor]]:
    """An out-set against the ``sources`` it replaces and the ``others`` the update reads or writes (gradient,
    param_out): a destination for every source, of its dtype and size, dense, contiguous and on the CPU, each
    either its source itself or sharing no memory with any buffer of the update. Returns it as a plain dict (None
    for None: in place)."""
    if out is None:
        return None
    if not isinstance(out, Mapping):
        raise TypeError(f"{caller}: out must be a dict of tensors by name ({', '.join(sources)}), got "
                        f"{type(out).__name__}")
    extra = [k for k in out if k not in sources]
    if extra:
        raise ValueError(f"{caller}: out[{extra[0]!r}] is not a buffer this update writes (it writes "
                         f"{', '.join(sources)})")
    missing = [k for k in sources if k not in out]
    if missing:
        raise ValueError(f"{caller}: out lacks {missing[0]!r}: an out-of-place update needs a destination for "
                         f"every buffer it writes ({', '.join(sources)})")
    checked: Dict[str, torch.Tensor] = {}
    for key, src in sources.items():
        dst, name = out[key], f"out[{key!r}]"
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"{caller}: {name} must be a torch.Tensor, got {type(dst).__name__}")
        if dst.layout != torch.strided or dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError(f"{caller}: {name} must be a dense, contiguous CPU tensor (got {dst.device}, "
                             f"{dst.layout}, contiguous={dst.is_contiguous()})")
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(f"{caller}: {name} must be {src.dtype} with {src.numel()} elements, as {key} is; "
                             f"got {dst.dtype} with {dst.numel()}")
        for other, t in itertools.chain(sources.items(), others.items(), checked.items()):
            if t is None or not overlap(dst, t):
                continue
            if t is src and other == key and dst.data_ptr() == src.data_ptr():
                continue  # this buffer in place
            where = f"out[{other!r}]" if t is checked.get(other) else other
            raise ValueError(f"{caller}: {name} overlaps {where} (a destination is either its own source, exactly, "
                             "or shares no memory with any buffer of the update)")
        checked[key] = dst
    return checked


def check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """AdamW's validation of its hyperparameters, with AdamW's messages. Numbers or one-element tensors."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (expected a pair)")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_hyper(step, lr, betas, eps, weight_decay, grad_scale
                 ) -> Tuple[int, float, float, float, float, float, float]:
    """Validate an update's scalars; returns (step, lr, beta1, beta2, eps, weight_decay, grad_scale) as plain
    numbers."""
    step_f = as_float(step, "step")
    if not step_f.is_integer() or step_f < 1:
        raise ValueError(f"Invalid step: {step_f} (the 1-based count after this update, an integer >= 1)")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas} (expected two values)")
    lr_f, eps_f, wd = as_float(lr, "lr"), as_float(eps, "eps"), as_float(weight_decay, "weight_decay")
    beta1, beta2 = as_float(betas[0], "betas[0]"), as_float(betas[1], "betas[1]")
    check_hparams(lr_f, (beta1, beta2), eps_f, wd)
    scale = as_float(grad_scale, "grad_scale")
    if not math.isfinite(scale):
        raise ValueError(f"Invalid grad_scale: {scale} (must be finite)")
    return int(step_f), lr_f, beta1, beta2, eps_f, wd, scale


class CheckedGrads(list):
    """A list of gradients its maker has already checked as :func:`check_grads` would (dense, contiguous CPU
    tensors of one supported dtype): the optimizer's hand-off of a step's gradients, which it checks once when it
    collects them, so that the norm and the kernel do not check thousands of tensors again."""


def check_grads(grads: Sequence[torch.Tensor], caller: str) -> None:
    """Every gradient a dense, contiguous CPU tensor of a supported dtype, all of one dtype."""
    if type(grads) is CheckedGrads:
        return
    if not isinstance(grads, (list, tuple)):
        raise TypeError(f"{caller}: grads must be a list of tensors, got {type(grads).__name__}")
    # Thousands of tensors per step: the common all-good case runs in C-level loops, the slow one finds the culprit.
    if (all(map(isinstance, grads, itertools.repeat(torch.Tensor)))
            and all(map(operator.attrgetter("is_cpu"), grads))
            and all(map(torch.Tensor.is_contiguous, grads))
            and set(map(_get_layout, grads)) <= {torch.strided}
            and len(dtypes := set(map(_get_dtype, grads))) <= 1 and dtypes <= set(GRAD_DTYPES)):
        return
    dtype = grads[0].dtype if isinstance(grads[0], torch.Tensor) else None
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{caller}: grads[{i}] must be a torch.Tensor, got {type(g).__name__}")
        if g.layout != torch.strided or g.device.type != "cpu" or not g.is_contiguous():
            raise ValueError(f"{caller}: grads[{i}] must be a dense, contiguous CPU tensor (got {g.device}, "
                             f"{g.layout}, contiguous={g.is_contiguous()})")
        if g.dtype != dtype:
            raise TypeError(f"{caller}: grads[{i}] is {g.dtype}, grads[0] is {dtype} (all must share one dtype)")
    raise TypeError(f"{caller}: unsupported gradient dtype {dtype}")


def check_segments(grads: Sequence[torch.Tensor], offsets: Sequence[int], numel: int, q8: bool) -> List[int]:
    """:func:`cpu_adam_segments_`'s checks of the segments; returns the offsets as ints."""
    offsets = list(map(operator.index, offsets))
    if len(offsets) != len(grads):
        raise ValueError(f"cpu_adam_segments_: {len(grads)} grads but {len(offsets)} offsets")
    ends = list(map(operator.add, offsets, map(torch.Tensor.numel, grads)))
    if offsets and (offsets[0] < 0 or not all(map(operator.le, ends, offsets[1:]))):
        i = next(i for i in range(len(offsets)) if offsets[i] < (ends[i - 1] if i else 0))
        raise ValueError(f"cpu_adam_segments_: segment {i} at offset {offsets[i]} starts before the previous one "
                         f"ends (segments must be sorted, must not overlap, and must start at 0 or later)")
    if ends and ends[-1] > numel:
        raise ValueError(f"cpu_adam_segments_: the last segment ends at {ends[-1]}, past the buffers' {numel} "
                         "elements")
    if q8 and any(map(operator.mod, offsets, itertools.repeat(Q8_BLOCK))):
        i = next(i for i, o in enumerate(offsets) if o % Q8_BLOCK)
        raise ValueError(f"cpu_adam_segments_: segment {i} starts at offset {offsets[i]}, not a multiple of "
                         f"{Q8_BLOCK}: 8-bit state needs each segment to own whole scale blocks")
    return offsets
