"""``zero_offload.offload(optimizer_class, params, **kwargs)``: any elementwise torch.optim-style optimizer with
zero_offload's machinery (flat pinned buckets, streamed gradients, sharding, clipping, GradScaler, state dicts in
the class's own format), the way torchao's ``CPUOffloadOptimizer(params, optimizer_class, **kwargs)`` and
``ZeroRedundancyOptimizer(params, optimizer_class=..., **defaults)`` take a class and its keyword arguments.

Which update runs:

* ``torch.optim.AdamW`` and ``torch.optim.Adam``: the fused SIMD CPU-Adam kernel (an :class:`OffloadOptimizer`
  with the class's defaults: Adam's are ``weight_decay=0`` and ``decoupled_weight_decay=False``).
* :class:`zero_offload.Lion`: the Lion rule (:mod:`zero_offload.rules.lion`).
* any other class: the generic rule (:mod:`zero_offload.rules.torch_class`), the class's own CPU implementation over
  the flat buffers, after a probe has checked that its update is elementwise (refused, naming why, otherwise).
* on a bucket stepped on the GPU (``placement="parked"``, ``"resident"``), Lion's and the generic rule run the
  class's own code there: an elementwise class over the bucket's flat runs (a rank's shard too), a class the
  elementwise probe refuses (Muon, Adafactor) each parameter whole (:mod:`zero_offload.rules.whole`), where every
  bucket is stepped on a GPU and each holds whole parameters; state not shaped like the parameter (Adafactor's
  factors) in a layout of its own (:mod:`zero_offload.state.shaped`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch

from zero_offload.lion import Lion
from zero_offload.optimizer import OFFLOAD_OPTIONS, OffloadOptimizer
from zero_offload.options import check_removed

__all__ = ["offload"]


def _group_settings(params: Any) -> List[Dict[str, Any]]:
    """The hyperparameters each parameter group overrides (empty when ``params`` is a list of tensors)."""
    if isinstance(params, torch.Tensor):
        return []
    params = list(params) if not isinstance(params, list) else params
    return [{k: v for k, v in g.items() if k != "params"} for g in params if isinstance(g, dict)]


def offload(optimizer_class: type, params: Iterable[Any], **kwargs: Any) -> OffloadOptimizer:
    """Offload ``optimizer_class``: its fp32 masters and state in pinned host memory, updated on the CPU.

    ``kwargs`` are the class's own hyperparameters (its defaults apply, it validates them with its own messages)
    and any offload option of :class:`~zero_offload.OffloadOptimizer` (``nonfinite``, ``bucket_numel``,
    ``pin_memory``, ``stream_grads``, ``release_grads``, ``overlap_step``, ``delayed_update``, ``process_group``,
    ``grads_reduced``, ``timeout``, ``state_dtype``, ``gpu_margin_gib``, ``uploads_in_backward``, ``gpu_fraction``,
    ``placement``: a bucket stepped on the GPU, parked or resident, runs the class's own code there, each parameter
    whole, see docs/placement.md). The result is an
    ``OffloadOptimizer``: the same ``step``, ``clip_grad_norm_``, GradScaler support and sharding, with
    ``defaults``, ``param_groups`` and ``state_dict()`` in the format of ``optimizer_class`` (so LR schedulers work
    and a checkpoint of the plain torch optimizer loads, and the other way round).

    Args:
        optimizer_class (type): ``torch.optim.AdamW`` / ``Adam`` (the fused Adam kernel), ``zero_offload.Lion``,
            or any elementwise ``torch.optim.Optimizer`` subclass (``SGD``, ``Adagrad``, ``RMSprop``, ``Adamax``,
            ``RAdam``, ``Adadelta``, ``Rprop``, ...) run by its own CPU implementation (``foreach``/``fused`` as
            given). Refused with a ``ValueError`` naming why: ``LBFGS`` (a closure and a line search over all
            parameters), ``SparseAdam`` (sparse gradients), ``NAdam`` and ``ASGD`` (per-parameter scalar state
            besides the step count), classes whose update of an element depends on other elements (LAMB, LARS,
            Muon, Shampoo, Adafactor: found by probing) where a bucket would be stepped on the host
            (``placement="parked"`` runs those whose per-parameter state is tensors of fixed shapes that follow the
            parameter's, a step count aside, each parameter whole on the GPU: ``torch.optim.Muon``,
            ``torch.optim.Adafactor`` and its factored ``row_var``/``col_var``; a per-parameter scalar, a list, a
            shape that changes between steps or a tensor shared by parameters is refused there), classes whose
            update of one parameter depends on other parameters (D-Adaptation's ``d``, a sum over all of them), classes that step
            differently on a replay with identical inputs (random draws, or state outside the optimizer such as a
            class attribute), classes whose ``step(closure)`` calls the closure more than once,
            ``differentiable=True``, ``capturable=True``. Keys the class's constructor adds to its param groups
            (Lookahead's ``k``) are in ours too; a class whose update uses the loss its closure returns gets, in
            ``step(closure)``, the loss of the closure ``step()`` called (not with ``overlap_step`` or
            ``delayed_update``; where only a run without a closure matches the class, ``step(closure)`` is refused).
        params (iterable): parameters or parameter groups, as for ``optimizer_class``.
        **kwargs: the class's hyperparameters and the offload options.

    ``state_dtype``: fp32, bf16 and int8 for Adam(W); fp32 and bf16 for Lion; fp32 only for the generic rule.
    """
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(f"offload() takes a torch.optim.Optimizer subclass, not {optimizer_class!r}")
    check_removed(kwargs, "offload")  # (not passed on to the class, whose error would not say what replaced it)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OFFLOAD_OPTIONS}
    if optimizer_class in (torch.optim.AdamW, torch.optim.Adam, Lion):
        # The class checks its own arguments (its TypeError for an unknown one, its ValueErrors), gives its defaults.
        defaults = dict(optimizer_class([torch.nn.Parameter(torch.zeros(1))], **kwargs).defaults)
        if optimizer_class is not Lion:
            return OffloadOptimizer(params, **defaults, **options)
        from zero_offload.rules.lion import LION

        return OffloadOptimizer._with_rule(params, LION, defaults, **options)
    params = list(params) if not isinstance(params, torch.Tensor) else [params]
    rule = _class_rule(optimizer_class, params, kwargs, options)
    opt = OffloadOptimizer._with_rule(params, rule, rule.defaults, **options)
    # What the class keeps beyond its per-parameter state and param groups (MADGRAD's global count) is saved and
    # loaded in its own format through the optimizer's public hooks.
    opt.register_state_dict_post_hook(rule.state_dict_hook)
    opt.register_load_state_dict_post_hook(rule.load_hook)
    return opt


def _ndims(params: List[Any]) -> Tuple[int, ...]:
    """The numbers of dimensions of the parameters ``params`` (tensors, ``(name, tensor)`` pairs or groups) give. A
    group's ``params`` given as an iterator becomes a list (as ``add_param_group`` makes it), read once here."""
    found = set()
    for item in params:
        if isinstance(item, dict) and not isinstance(item["params"], (torch.Tensor, list, tuple)):
            item["params"] = list(item["params"])
        tensors = item["params"] if isinstance(item, dict) else [item]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        found.update(t[1].dim() if isinstance(t, tuple) else t.dim() for t in tensors)
    return tuple(sorted(found))


def _class_rule(optimizer_class: type, params: List[Any], kwargs: Dict[str, Any], options: Dict[str, Any]) -> Any:
    """The generic rule of ``optimizer_class`` over ``params``: elementwise (stepped anywhere), else run only on whole
    parameters on a GPU (a parked or resident bucket, :mod:`zero_offload.rules.whole`) where ``options`` ask for a
    GPU placement, else refused naming why (the elementwise probe's refusal, of its type, saying whether
    ``placement="parked"`` would run it)."""
    from zero_offload.rules.settings import Refused, class_defaults, freeze
    from zero_offload.rules.torch_class import KNOWN_REFUSALS, TorchClassRule

    groups = _group_settings(params)
    extras = {k: v for k, v in (groups[0] if groups else {}).items() if k != "param_names"}
    try:
        # ``kwargs`` are the class's constructor arguments, whole: every instance of it the rule builds gets them.
        defaults = class_defaults(optimizer_class, freeze(kwargs), freeze(extras))
        return TorchClassRule(optimizer_class, [{**defaults, **g} for g in groups or [{}]], kwargs)
    except Refused as e:
        if optimizer_class.__name__ in KNOWN_REFUSALS:
            raise
        refused = e
    name, ndims = optimizer_class.__name__, _ndims(params) or (1,)
    runs = (f"placement='parked' runs it: each parked bucket is stepped on its GPU by {name}'s own code, each "
            "parameter whole")
    try:
        defaults = class_defaults(optimizer_class, freeze(kwargs), freeze(extras), ndims[0])
        rule = TorchClassRule(optimizer_class, [{**defaults, **g} for g in groups or [{}]], kwargs, parked=ndims,
                              host_refusal=f"{name} cannot be stepped on the host: {refused}. {runs}")
    except Refused as e:
        raise type(refused)(f"{refused}. Nor can it be parked (stepped on the GPU by its own code, each parameter "
                            f"whole): {e}") from None
    if options.get("placement", "host") == "host" and not options.get("gpu_fraction"):
        raise type(refused)(f"{refused}. {runs}") from None  # (every bucket on the host: refused as it was)
    return rule
