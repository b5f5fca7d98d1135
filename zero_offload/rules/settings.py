"""What the generic rule reads of an optimizer class: its constructor's keyword arguments, kept whole (a flag the
class keeps on itself rather than in ``defaults``, ``maximize`` in many third-party classes or lucidrains' Lion's
``decoupled_weight_decay``, reaches every instance the rule builds), its ``defaults`` (what a param group holds),
and a group's settings as one frozen, hashable value that the ranks of a process group agree on field by field (a
string, a dict or None included: see :class:`Opaque`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

__all__ = ["Opaque", "Refused", "freeze", "plain", "build", "class_defaults", "hyper_class", "read_hyper",
           "REFUSED_FLAGS"]

# Flags whose True the offloaded update cannot honour.
REFUSED_FLAGS = {
    "differentiable": "differentiable=True is refused: the offloaded update runs outside autograd, on host buffers",
    "capturable": "capturable=True is refused: it makes the step CUDA-graph capturable, and the offloaded update "
                  "runs on the CPU",
}
# Keys of a param group that are the optimizer's bookkeeping, not the class's settings.
NOT_SETTINGS = ("params", "param_names")


# What building or stepping a class may raise that is its failure, not the process's end: lucidrains' Lion calls
# exit() when use_triton=True finds no triton.
FAILURES = (Exception, SystemExit)


class Refused(ValueError):
    """The optimizer class (or one of its settings) cannot be offloaded faithfully; the message says why."""


def _canonical(value: Any) -> str:
    """A text that is equal exactly when the values are (dicts in key order, tensors by their values)."""
    if isinstance(value, dict):
        items = sorted((_canonical(k), _canonical(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[" + ",".join(map(_canonical, value)) + "]"
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()},{value.dtype})"
    return f"{type(value).__name__}:{value!r}"


class Opaque:
    """A setting that is not a number (a string, None, a dict, a list): hashable and compared by its canonical text,
    and, for the ranks' agreement (which compares settings as floats), a float: a 48-bit digest of that text, exact
    in a float64."""

    __slots__ = ("value", "text")

    def __init__(self, value: Any):
        self.value, self.text = value, _canonical(value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Opaque) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __float__(self) -> float:
        return float(int.from_bytes(hashlib.blake2b(self.text.encode(), digest_size=6).digest(), "little"))

    def __repr__(self) -> str:
        return repr(self.value)


def plain(value: Any) -> Hashable:
    """A setting as a plain hashable value: a number as itself (a one-element tensor as its number), anything else
    wrapped in :class:`Opaque`."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float)):
        return value
    return Opaque(value)


def unwrap(value: Any) -> Any:
    return value.value if isinstance(value, Opaque) else value


def freeze(settings: Dict[str, Any]) -> Tuple[Tuple[str, Hashable], ...]:
    """Keyword arguments as a hashable key (for caches), in name order."""
    return tuple(sorted((k, plain(v)) for k, v in settings.items()))


def thaw(items: Sequence[Tuple[str, Any]]) -> Dict[str, Any]:
    return {k: unwrap(v) for k, v in items}


def _stand_in(ndim: int = 1) -> torch.nn.Parameter:
    """A one-element parameter of ``ndim`` dimensions (a class that steps whole parameters may want 2-D: Muon)."""
    return torch.nn.Parameter(torch.zeros((1,) * ndim))


def build(cls: type, groups: Sequence[Tuple[List[torch.Tensor], Dict[str, Any]]], ctor: Dict[str, Any]
          ) -> torch.optim.Optimizer:
    """``cls`` over parameter groups ``(params, settings)``, with its constructor's keyword arguments ``ctor``: the
    way a user builds it, so its flags, defaults and validation are its own."""
    return cls([{"params": list(params), **settings} for params, settings in groups], **ctor)


@functools.lru_cache(maxsize=128)
def class_defaults(cls: type, ctor_items: Tuple[Tuple[str, Hashable], ...],
                   group_items: Tuple[Tuple[str, Hashable], ...] = (), ndim: int = 1) -> Dict[str, Any]:
    """``cls``'s ``defaults`` when built with keyword arguments ``ctor_items`` over one stand-in parameter (and, if
    the class needs more than a list of tensors, in a group with the settings ``group_items``: Muon's ``use_muon``).
    A class that needs an argument not given raises its TypeError, naming it; one that cannot be built over plain
    tensors is refused (:class:`Refused`) with the class's own error. ``ndim``: the stand-in's dimensions (a class
    run on whole parameters, see :mod:`zero_offload.rules.whole`, is built over parameters it takes)."""
    ctor = thaw(ctor_items)
    try:
        return dict(cls([_stand_in(ndim)], **ctor).defaults)
    except FAILURES as e:  # (a class that wants parameter groups of its own kind, say)
        error: BaseException = e
    try:
        cls([torch.nn.Parameter(torch.zeros(4, 4))], **ctor)
    except FAILURES:
        pass
    else:
        if ndim == 1:
            raise Refused(f"{cls.__name__} is not elementwise: it takes a 2-D parameter but not a 1-element one "
                          f"({type(error).__name__}: {error}), and zero_offload hands it flat 1-D runs of its "
                          "buffers") from error
    if group_items:
        try:
            return dict(build(cls, [([_stand_in(ndim)], thaw(group_items))], ctor).defaults)
        except FAILURES:
            pass
    if isinstance(error, TypeError) and ("required" in str(error) or "missing" in str(error)):
        raise TypeError(f"{cls.__name__} needs an argument that was not given ({error}): pass it to "
                        "zero_offload.offload() with the other hyperparameters") from error
    if isinstance(error, (TypeError, ValueError)) and not isinstance(error, Refused):
        raise error  # the class's own check of its arguments (an unknown one, a value out of range)
    cause = f" (after {type(error.__context__).__name__}: {error.__context__})" if error.__context__ else ""
    raise Refused(f"{cls.__name__} cannot be offloaded: zero_offload runs it over plain float32 tensors (its flat "
                  f"buffers) in parameter groups with the given settings, and building it so raised "
                  f"{type(error).__name__}: {error}{cause}") from error


def _fields(defaults: Dict[str, Any]) -> List[Tuple[str, str, str, Optional[int]]]:
    """(field, settings key, user name, tuple index) per value the settings hold; a pair of numbers like ``betas``
    gives two fields, so that the ranks' agreement names ``betas[1]``."""
    out = []
    for key, value in defaults.items():
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, (int, float)) for v in value):
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


@functools.lru_cache(maxsize=128)
def hyper_class(cls: type, layout: Tuple[Tuple[str, Optional[int]], ...]) -> type:
    """A frozen dataclass of ``cls``'s group settings as plain values (pairs split into one field each) plus
    ``extra`` (the group's other keys, one :class:`Opaque`), with ``user_names``, ``group()`` (the settings as a
    param group holds them) and ``settings()`` (those the constructor takes)."""
    fields = [(f"{key}_{i}" if i is not None else key, key, f"{key}[{i}]" if i is not None else key, i)
              for key, i in layout]
    hyper = dataclasses.make_dataclass(f"{cls.__name__}Hyper", [(f, Any) for f, _, _, _ in fields] + [
        ("extra", Any)], frozen=True)
    hyper.user_names = {**{f: user for f, _, user, _ in fields}, "extra": "other settings"}
    accepted = _accepted(cls)

    def group(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for f, key, _, i in fields:
            if i is None:
                out[key] = unwrap(getattr(self, f))
            else:
                out.setdefault(key, []).append(getattr(self, f))
        out = {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}
        return {**out, **self.extra.value}

    def settings(self) -> Dict[str, Any]:
        return {k: v for k, v in group(self).items() if accepted is None or k in accepted}

    hyper.group, hyper.settings = group, settings
    return hyper


def read_hyper(cls: type, defaults: Dict[str, Any], group: Dict[str, Any], state_keys: Sequence[str] = ()
               ) -> Hashable:
    """The group's settings of ``cls`` as its hyper dataclass (the keys of ``defaults``, and the group's other keys
    as ``extra``, but for ``state_keys``: what the class itself keeps and changes in its group as it steps, which are
    its state, not settings: see :mod:`zero_offload.rules.instances`). Flags the offload
    cannot honour are refused here; the values are checked by the class itself (its messages). The group is kept
    as ``hyper.live`` (not a field: not compared, not agreed), where the rule shows what the class keeps in it."""
    defaults = {k: v for k, v in defaults.items() if k not in state_keys}
    values: Dict[str, Any] = {}
    for f, key, user, i in _fields(defaults):
        value = group.get(key, defaults[key])
        if i is None:
            values[f] = plain(value)
        elif not isinstance(value, (tuple, list)) or len(value) != len(defaults[key]):
            raise ValueError(f"{cls.__name__}: {key}={value!r} (expected {len(defaults[key])} values, as its "
                             f"default {defaults[key]!r})")
        else:
            values[f] = plain(value[i])
    for flag, why in REFUSED_FLAGS.items():
        if unwrap(values.get(flag)):
            raise ValueError(f"{cls.__name__}: {why}")
    extra = {k: v for k, v in group.items() if k not in defaults and k not in NOT_SETTINGS and k not in state_keys}
    layout = tuple((key, i) for _, key, _, i in _fields(defaults))
    h = hyper_class(cls, layout)(**values, extra=Opaque(extra))
    _check(cls, freeze(h.settings()))
    object.__setattr__(h, "live", group)
    return h


@functools.lru_cache(maxsize=256)
def _check(cls: type, items: Tuple[Tuple[str, Hashable], ...]) -> None:
    """The class's own ValueError for settings it refuses, from its constructor (which is where classes validate).
    A class that cannot be built over a plain list of tensors (it was built in groups, see :func:`class_defaults`)
    is left to validate at its steps. A 2-D stand-in too, where a 1-D one is refused (Muon's settings)."""
    error: Optional[ValueError] = None
    for ndim in (1, 2):
        try:
            cls([_stand_in(ndim)], **thaw(items))
            return
        except ValueError as e:
            error = error or e
        except FAILURES:
            return
    raise error
