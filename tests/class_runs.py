"""Run ``zero_offload.offload(cls, ...)`` beside ``cls`` itself on the same parameters and gradients, the way a
user would build each: several shapes in two param groups (the second with half the learning rate where the class
has a numeric one), several buckets (a small ``bucket_numel``), gradients cloned into both each step.

:func:`check_class` compares, after every step, each parameter at float32's default tolerance and its update
relative to the update's size, every state tensor, and the keys the class keeps in its param groups; then
checkpoints both ways (the class loads our ``state_dict()``, ours loads the class's) and steps on beside the class
loaded from its own state dict, comparing again.
It returns an :class:`Outcome`: accepted and equal, or refused with the reason, or the first difference.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
from typing import Any, Dict, List, Optional, Tuple

import torch

import zero_offload

SHAPES = ([(8, 6), (6,), (3, 4, 2)], [(10,), (5, 3)])  # two param groups
BUCKET_NUMEL = 64  # several buckets per group
STEPS = 30
RESUMED_STEPS = 8
# Hyperparameters without a default that some classes need (pytorch_optimizer's Ranger21 and BSAM).
REQUIRED = {"Ranger21": dict(num_iterations=100), "BSAM": dict(num_data=100)}


@dataclasses.dataclass
class Outcome:
    """``status``: "equal" (accepted, and equal to the class everywhere), "refused" (``reason``: the refusal's
    message), "differs" (accepted but not equal: ``reason`` says where) or "class failed" (the class itself could
    not be built or stepped the way the harness drives it: ``reason``)."""

    status: str
    reason: str = ""


class Differs(AssertionError):
    pass


def takes(cls: type, name: str) -> bool:
    """Whether ``cls``'s constructor takes the keyword argument ``name``."""
    params = inspect.signature(cls.__init__).parameters
    return name in params


def _params(seed: int) -> List[List[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes] for shapes in SHAPES]


def _groups(params: List[List[torch.Tensor]], defaults: Dict[str, Any]) -> List[Dict[str, Any]]:
    lr = defaults.get("lr")
    second = {"lr": lr * 0.5} if isinstance(lr, float) and not isinstance(lr, bool) and lr > 0 else {}
    return [{"params": params[0]}, {"params": params[1], **second}]


def _grads(step: int) -> List[List[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [[torch.randn(s, generator=gen) for s in shapes] for shapes in SHAPES]


def _set_grads(params: List[List[torch.Tensor]], grads: List[List[torch.Tensor]]) -> None:
    for ps, gs in zip(params, grads):
        for p, g in zip(ps, gs):
            p.grad = g.clone()


def _roundtrip(sd: Dict[str, Any]) -> Dict[str, Any]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _close(actual: torch.Tensor, expected: torch.Tensor, prev: Optional[torch.Tensor], where: str) -> None:
    """Float32's default tolerance, and (``prev`` given) the update within 1e-3 of the update's own size."""
    try:
        torch.testing.assert_close(actual.detach(), expected.detach(), equal_nan=True)
    except AssertionError as e:
        raise Differs(f"{where}: {e}") from None
    if prev is None:
        return
    ours, theirs = (actual.detach() - prev).float(), (expected.detach() - prev).float()
    size = float(theirs.abs().max())
    err = float((ours - theirs).abs().max())
    slack = 4 * torch.finfo(torch.float32).eps * float(prev.abs().max())  # prev's own rounding
    if err > 1e-3 * size + slack:
        raise Differs(f"{where}: the update differs by {err:.3g} for an update of size {size:.3g}")


def _compare(ours: torch.optim.Optimizer, ours_params, ref: torch.optim.Optimizer, ref_params, prev, where: str
             ) -> None:
    for gi, (ps, qs) in enumerate(zip(ours_params, ref_params)):
        for i, (p, q) in enumerate(zip(ps, qs)):
            at = f"{where}, group {gi} param {i}"
            _close(p, q, None if prev is None else prev[gi][i], at)
            mine, theirs = ours.state.get(p, {}), ref.state.get(q, {})
            keys = set(theirs) - ({"step"} if "step" not in mine and _eager_empty(theirs) else set())
            if set(mine) - {"master"} != keys:
                raise Differs(f"{at}: state keys {sorted(mine)} vs the class's {sorted(theirs)}")
            for k in keys:
                if isinstance(theirs[k], torch.Tensor):
                    _close(mine[k].float(), theirs[k].float(), None, f"{at}, state {k!r}")
    for gi, (g, h) in enumerate(zip(ours.param_groups, ref.param_groups)):
        for k, v in h.items():
            if k != "params" and not _same(g.get(k), v):
                raise Differs(f"{where}: param group {gi}'s {k!r} is {g.get(k)!r}, the class's {v!r}")


def _eager_empty(state: Dict[str, Any]) -> bool:
    return "step" in state and float(state["step"]) == 0


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.float(), b.float())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _build_both(cls: type, kwargs: Dict[str, Any]) -> Tuple[Any, Any, Any, Any]:
    """Ours (a refusal raises), then the class (its failure raises :class:`ClassFailed`)."""
    ours_params, ref_params = _params(0), _params(0)
    try:
        defaults = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs).defaults
    except (Exception, SystemExit):  # (a class that takes groups of its own kind; lucidrains' Lion exits)
        defaults = {}
    ours = zero_offload.offload(cls, _groups(ours_params, defaults), bucket_numel=BUCKET_NUMEL, **kwargs)
    try:
        ref = cls(_groups(ref_params, defaults), **kwargs)
    except (Exception, SystemExit) as e:
        raise ClassFailed(f"{type(e).__name__}: {e}") from e
    return ours, ours_params, ref, ref_params


class ClassFailed(Exception):
    pass


def _step_all(runs, step: int) -> None:
    grads = _grads(step)
    for opt, params in runs:
        _set_grads(params, grads)
        opt.step()


def _fresh(cls: type, kwargs: Dict[str, Any], ref, ref_params, sd: Dict[str, Any], ours: bool):
    """A new optimizer (ours or the class) over copies of the class's parameters, loaded from ``sd``."""
    params = [[torch.nn.Parameter(q.detach().clone()) for q in qs] for qs in ref_params]
    groups = _groups(params, ref.defaults)
    opt = (zero_offload.offload(cls, groups, bucket_numel=BUCKET_NUMEL, **kwargs) if ours else cls(groups, **kwargs))
    opt.load_state_dict(sd)
    return opt, params


def _resume(cls: type, kwargs: Dict[str, Any], ours, ref, ref_params):
    """The reference from here on: a new instance of the class loaded from its own state dict (what it keeps on
    itself, outside its state dict, starts afresh there as it would in any resumed run). Beside it: the class loaded
    from our state dict, and ours loaded from the class's."""
    sd_ours, sd_ref = _roundtrip(ours.state_dict()), _roundtrip(ref.state_dict())
    reference = _fresh(cls, kwargs, ref, ref_params, copy.deepcopy(sd_ref), ours=False)
    plain = _fresh(cls, kwargs, ref, ref_params, sd_ours, ours=False)
    back = _fresh(cls, kwargs, ref, ref_params, sd_ref, ours=True)
    return reference, [(*plain, "the class loaded from ours"), (*back, "ours loaded from the class")]


def check_class(cls: type, **kwargs: Any) -> Outcome:
    """See the module docstring."""
    kwargs = {**REQUIRED.get(cls.__name__, {}), **kwargs}
    try:
        ours, ours_params, ref, ref_params = _build_both(cls, kwargs)
    except ClassFailed as e:
        return Outcome("class failed", str(e))
    except (TypeError, ValueError) as e:  # (Refused is a ValueError)
        return Outcome("refused", f"{type(e).__name__}: {e}")
    try:
        for step in range(STEPS):
            prev = [[q.detach().clone() for q in qs] for qs in ref_params]
            _step_all([(ref, ref_params), (ours, ours_params)], step)
            _compare(ours, ours_params, ref, ref_params, prev, f"step {step + 1}")
        (ref, ref_params), resumed = _resume(cls, kwargs, ours, ref, ref_params)
        for step in range(STEPS, STEPS + RESUMED_STEPS):
            prev = [[q.detach().clone() for q in qs] for qs in ref_params]
            _step_all([(ref, ref_params)] + [(o, ps) for o, ps, _ in resumed], step)
            for opt, params, what in resumed:
                _compare(opt, params, ref, ref_params, prev, f"{what}, step {step + 1}")
    except Differs as e:
        return Outcome("differs", str(e))
    return Outcome("equal")


def classes_of(module: Any) -> List[type]:
    """The optimizer classes a collection offers (pytorch_optimizer: its registry of supported optimizers)."""
    names = module.get_supported_optimizers()
    return [module.load_optimizer(n) for n in names]

