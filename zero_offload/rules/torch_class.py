"""Any elementwise ``torch.optim``-style optimizer class over flat host buffers, with the class's own CPU
implementation (single-tensor, foreach or fused, as its flags say): the way torchao's ``CPUOffloadOptimizer``
offloads one tensor at a time, done one *run* at a time.

For a run, the flat fp32 master slice is the parameter the class sees, the run's gradient (times ``grad_scale``,
upcast from bf16/fp16) its ``.grad``, and its state the store's buffers themselves: a state tensor the class
updates in place lands in our buffer; one it rebinds (SGD's first ``momentum_buffer``, created as a clone of the
gradient) is copied back. All parameters of a run share the step count, so the run carries one. The padding between
slots sees a zero gradient; for every torch.optim class allowed here the masters' padding stays zero (Adamax's
``exp_inf`` padding becomes ``eps``, Rprop's ``step_size`` padding ``lr``: values no parameter's view shows).

Which buffers a class keeps is learnt by a *probe*: the class steps a small 2-D parameter, and, separately, the same
elements flattened, shuffled and split into two parameters. A state tensor not shaped like its parameter, a
per-parameter scalar other than the step count, or a result that differs between the two (a per-tensor norm or a
matrix operation: LAMB, LARS, Muon, Shampoo) means the update is not elementwise, and the class is refused naming
why.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch

from zero_offload.rules.base import Rule, Run, StateBuffer

__all__ = ["TorchClassRule", "NotElementwise", "rule_for", "probe"]

# Flags that choose the class's implementation, not its arithmetic: read from the group and passed through.
IMPL_FLAGS = ("foreach", "fused")
# Flags whose True the offloaded update cannot honour.
REFUSED_FLAGS = {
    "differentiable": "differentiable=True is refused: the offloaded update runs outside autograd, on host buffers",
    "capturable": "capturable=True is refused: it makes the step CUDA-graph capturable, and the offloaded update "
                  "runs on the CPU",
}
# Classes refused before probing, with why (the probe would say less).
KNOWN_REFUSALS = {
    "LBFGS": "its step() needs a closure that re-evaluates the loss, and it runs a line search over all "
             "parameters together: not elementwise",
    "SparseAdam": "it updates sparse gradients only (its step() refuses dense ones), and the offloaded buffers "
                  "are dense: offload torch.optim.Adam instead",
}
_PROBE_SHAPE = (4, 6)
_PROBE_SPLIT = 7  # the shuffled elements go to two parameters of 7 and 17
_PROBE_STEPS = 3
_PROBE_LR = 1e-2


class NotElementwise(ValueError):
    """The optimizer class (or one of its settings) does not update each element from that element alone."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=64)
def _defaults(cls: type) -> Dict[str, Any]:
    try:
        return dict(cls([torch.nn.Parameter(torch.zeros(1))]).defaults)
    except Exception as e:  # a class with a required hyperparameter (no default)
        raise TypeError(f"{_name(cls)} cannot be built with its defaults ({e}); pass its required "
                        "hyperparameters") from e


def _fields(defaults: Dict[str, Any]) -> List[Tuple[str, str, str, Optional[int]]]:
    """(field, settings key, user name, tuple index) per number the hyperparameters hold; a pair like ``betas``
    gives two fields."""
    out = []
    for key, value in defaults.items():
        if isinstance(value, (tuple, list)):
            out += [(f"{key}_{i}", key, f"{key}[{i}]", i) for i in range(len(value))]
        else:
            out.append((key, key, key, None))
    return out


def _accepted(cls: type) -> Optional[frozenset]:
    """The keyword arguments ``cls`` takes (None: any): a default it does not take is fixed by the class
    (AdamW's ``decoupled_weight_decay``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


@functools.lru_cache(maxsize=64)
def hyper_class(cls: type) -> type:
    """A frozen dataclass of ``cls``'s hyperparameters as plain values (pairs split into one field each), with
    ``user_names`` and ``settings()`` (the keyword arguments of ``cls`` again)."""
    fields = _fields(_defaults(cls))
    hyper = dataclasses.make_dataclass(f"{cls.__name__}Hyper", [(f, Any) for f, _, _, _ in fields], frozen=True)
    hyper.user_names = {f: user for f, _, user, _ in fields}

    accepted = _accepted(cls)

    def settings(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for f, key, _, i in fields:
            if accepted is not None and key not in accepted:
                continue
            if i is None:
                out[key] = getattr(self, f)
            else:
                out.setdefault(key, []).append(getattr(self, f))
        return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}

    hyper.settings = settings
    return hyper


def read_hyper(cls: type, group: Dict[str, Any]) -> Hashable:
    """The group's settings of ``cls`` as its hyper dataclass, checked by the class itself (its messages)."""
    defaults = _defaults(cls)
    settings = {k: _plain(group.get(k, v)) for k, v in defaults.items()}
    for flag, why in REFUSED_FLAGS.items():
        if settings.get(flag):
            raise ValueError(f"{cls.__name__}: {why}")
    for flag in IMPL_FLAGS:  # None is torch's "choose for me", which for CPU tensors is False
        if flag in settings and settings[flag] is None:
            settings[flag] = False
    settings = {k: tuple(map(_plain, v)) if isinstance(v, (tuple, list)) else v for k, v in settings.items()}
    values = {}
    for f, key, _, i in _fields(defaults):
        values[f] = settings[key] if i is None else settings[key][i]
    h = hyper_class(cls)(**values)
    _check(cls, tuple(h.settings().items()))
    return h


@functools.lru_cache(maxsize=256)
def _check(cls: type, items: Tuple[Tuple[str, Any], ...]) -> None:
    cls([torch.nn.Parameter(torch.zeros(1))], **dict(items))  # raises the class's own ValueError


@dataclasses.dataclass(frozen=True)
class Probed:
    """What one step of the class keeps per parameter: ``buffers`` (shaped like it, in the class's order),
    ``step_key`` (its step count, None if it keeps none) and whether that count is a tensor."""

    buffers: Tuple[str, ...]
    step_key: Optional[str]
    step_is_tensor: bool


def _probe_steps(cls: type, settings: Dict[str, Any], params: List[torch.Tensor],
                 grads: List[List[torch.Tensor]]) -> torch.optim.Optimizer:
    opt = cls(params, **settings)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    return opt


def _state_kinds(cls: type, state: Dict[str, Any], shape: torch.Size) -> Probed:
    buffers, step_key, step_is_tensor = [], None, False
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == shape:
            buffers.append(key)
        elif key == "step" and (isinstance(value, (int, float)) or
                                (isinstance(value, torch.Tensor) and value.numel() == 1)):
            step_key, step_is_tensor = key, isinstance(value, torch.Tensor)
        elif isinstance(value, torch.Tensor) and value.dim() == 0 or isinstance(value, (int, float)):
            raise NotElementwise(
                f"{cls.__name__} keeps a per-parameter scalar {key!r} besides the step count; zero_offload holds "
                "per-element buffers and one step count per parameter, so it cannot offload it")
        else:
            what = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise NotElementwise(
                f"{cls.__name__} is not elementwise: its state {key!r} has {what} for a parameter of shape "
                f"{tuple(shape)} (elementwise state is shaped like the parameter)")
    return Probed(tuple(buffers), step_key, step_is_tensor)


@functools.lru_cache(maxsize=128)
def probe(cls: type, items: Tuple[Tuple[str, Any], ...]) -> Probed:
    """Step ``cls`` with settings ``items`` (lr replaced by a fixed one) on a 2-D parameter, and on the same
    elements shuffled and split in two; refuse (:class:`NotElementwise`) unless both agree and the state is
    per-element. The result is cached per class and settings."""
    settings = dict(items, lr=_PROBE_LR)
    gen = torch.Generator().manual_seed(0)
    n = _PROBE_SHAPE[0] * _PROBE_SHAPE[1]
    whole = torch.nn.Parameter(torch.randn(_PROBE_SHAPE, generator=gen))
    grads = [torch.randn(_PROBE_SHAPE, generator=gen) for _ in range(_PROBE_STEPS)]
    perm = torch.randperm(n, generator=gen)
    parts = [torch.nn.Parameter(t.clone()) for t in whole.detach().reshape(-1)[perm].split(
        [_PROBE_SPLIT, n - _PROBE_SPLIT])]
    why = (f"{cls.__name__} is not elementwise: its update of an element depends on other elements of the "
           "parameter (the same elements shuffled and split into two parameters step differently: a per-tensor "
           "norm or a matrix operation, as in LAMB, LARS, Muon or Shampoo)")
    try:
        ref = _probe_steps(cls, settings, [whole], [[g] for g in grads])
    except Exception as e:
        raise NotElementwise(f"{cls.__name__} could not be probed: one step on a {_PROBE_SHAPE} float32 CPU "
                             f"parameter without a closure raised {type(e).__name__}: {e}") from e
    kinds = _state_kinds(cls, ref.state[whole], whole.shape)
    try:
        split = _probe_steps(cls, settings, parts, [list(g.reshape(-1)[perm].split(
            [_PROBE_SPLIT, n - _PROBE_SPLIT])) for g in grads])
    except Exception as e:
        raise NotElementwise(f"{why}; stepping the split parameters raised {type(e).__name__}: {e}") from e
    pairs = [(whole.detach(), [p.detach() for p in parts])]
    pairs += [(ref.state[whole][k], [split.state[p].get(k) for p in parts]) for k in kinds.buffers]
    for full, pieces in pairs:
        if any(p is None for p in pieces) or not torch.allclose(
                full.reshape(-1)[perm], torch.cat([p.reshape(-1) for p in pieces]), rtol=1e-5, atol=1e-6):
            raise NotElementwise(why)
    if kinds.step_key is not None and float(ref.state[whole][kinds.step_key]) != _PROBE_STEPS:
        raise NotElementwise(f"{cls.__name__}'s {kinds.step_key!r} is not a count of steps")
    return kinds


def _key(hyper: Any) -> Tuple[Tuple[str, Any], ...]:
    """The probe's cache key of a hyper: the settings, lr left out (the probe uses its own)."""
    return tuple((k, v) for k, v in hyper.settings().items() if k != "lr")


def _gradient(run: Run) -> torch.Tensor:
    """The run's gradient as a new float32 tensor times ``grad_scale`` (zeros between the slots when it comes as
    per-parameter gradients), so that the class may change it and ``param_out`` may share the gradient's memory."""
    n = run.master.numel()
    if run.grads is None:
        grad = run.grad.to(torch.float32, copy=True)
    else:
        grad = torch.zeros(n, dtype=torch.float32)
        if run.grads:
            torch._foreach_copy_([grad[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)],
                                 [g.reshape(-1) for g in run.grads])
    if run.grad_scale != 1.0:
        grad.mul_(run.grad_scale)
    return grad.view(run.master.shape)


class TorchClassRule(Rule):
    """The update of one elementwise ``torch.optim``-style class (see the module docstring), fp32 state only.

    Args:
        optimizer_class (type): the class; its state-dict format, defaults and validation are the rule's.
        groups (Sequence[Dict[str, Any]]): the parameter groups' settings known now: the declared buffers are the
            union of what the class keeps under each (a group that later needs another is refused at step()).
    """

    state_dtypes = (torch.float32,)

    def __init__(self, optimizer_class: type, groups=()):
        if optimizer_class.__name__ in KNOWN_REFUSALS:
            raise NotElementwise(f"{optimizer_class.__name__} cannot be offloaded: "
                                 f"{KNOWN_REFUSALS[optimizer_class.__name__]}")
        self.name = optimizer_class.__name__
        self.optimizer_class = optimizer_class
        self.defaults = _defaults(optimizer_class)
        probes = [probe(optimizer_class, _key(read_hyper(optimizer_class, {**self.defaults, **g})))
                  for g in (groups or ({},))]
        names = list(dict.fromkeys(k for p in probes for k in p.buffers))
        self.buffers = tuple(StateBuffer(k, compactable=False, needed=functools.partial(self._needs, k))
                             for k in names)
        steps = {(p.step_key, p.step_is_tensor) for p in probes if p.step_key is not None}
        self.step_key, self._step_is_tensor = next(iter(steps), (None, False))

    def _needs(self, name: str, hyper: Any) -> bool:
        return name in probe(self.optimizer_class, _key(hyper)).buffers

    def hyper(self, group: Dict[str, Any]) -> Hashable:
        h = read_hyper(self.optimizer_class, group)
        probed = probe(self.optimizer_class, _key(h))
        missing = [k for k in probed.buffers if k not in {b.name for b in self.buffers}]
        if missing:
            raise ValueError(f"{self.name}: these settings keep state {missing} that the optimizer was not built "
                             "with; set them when building it")
        return h

    def _step_value(self, step: int) -> Any:
        return torch.tensor(float(step), dtype=torch.float32) if self._step_is_tensor else step

    def update(self, run: Run, hyper: Any) -> None:
        self.refuse_out(run)
        param = run.master.view(run.master.shape)  # a new tensor object: its .grad is ours to set
        param.grad = _gradient(run)
        names = [b.name for b in self.needed(hyper)]
        if run.step == 1:  # the class initialises its state (SGD's clone, Rprop's lr, Adagrad's initial sum)
            opt = self.optimizer_class([param], **hyper.settings())
        else:
            # Built on a one-element stand-in, so that a class that creates its state at construction (Adagrad)
            # does not allocate and fill a run-sized buffer only to have it replaced by ours.
            opt = self.optimizer_class([torch.nn.Parameter(torch.zeros(1))], **hyper.settings())
            opt.state.clear()
            opt.param_groups[0]["params"] = [param]
            state = {k: run.state[k] for k in names}
            if self.step_key is not None:
                state = {self.step_key: self._step_value(run.step - 1), **state}
            opt.state[param] = state
        opt.step()
        state = opt.state[param]
        for k in names:
            if state[k] is not run.state[k]:
                run.state[k].copy_(state[k])
        if self.step_key is not None and float(state[self.step_key]) != run.step:
            raise RuntimeError(f"{self.name} counted step {float(state[self.step_key])}, expected {run.step}")
        if run.param_out is None:
            return
        if run.grads is None:
            run.param_out.copy_(run.master)
        elif run.grads:
            torch._foreach_copy_([run.param_out[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)],
                                 [run.master[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)])


def rule_for(optimizer_class: type, *groups: Dict[str, Any]) -> TorchClassRule:
    """The generic rule of ``optimizer_class`` for parameter groups with settings ``groups`` (refuses a class or a
    setting that is not elementwise, :class:`NotElementwise`, naming why)."""
    return TorchClassRule(optimizer_class, groups)
