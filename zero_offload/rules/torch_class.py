"""Any elementwise ``torch.optim``-style optimizer class over flat host buffers, run by the class itself: one
instance of it per bucket, built at the bucket's first update with the constructor arguments given to
:func:`zero_offload.offload` (flags the class keeps on itself included) and kept for the optimizer's life, so that
whatever it keeps beyond the per-parameter state goes on as in the class (see :mod:`zero_offload.rules.instances`).

At each update of a bucket the instance steps once, over one parameter per run (a contiguous range of slots whose
parameters all have a gradient and the same step count): the flat fp32 master slice, its ``.grad`` the run's
gradient (times ``grad_scale``, upcast from bf16/fp16, a copy the class may edit), its state the store's buffers
themselves. A state tensor the class updates in place lands in our buffer; one it rebinds (SGD's first
``momentum_buffer``, a clone of the gradient) is copied back. The padding between slots sees a zero gradient, and
no parameter's view shows it.

Where the probe saw the class's ``step(closure)`` use the closure (a step size scaled by the loss), the instance
steps with a closure that returns the loss of the one ``step()`` called (see :meth:`TorchClassRule.set_loss`), or
without one when ``step()`` had none. Keys the class's constructor adds to its param groups (Lookahead's ``k``)
are added to the optimizer's groups too (:meth:`TorchClassRule.group_keys`), so that a checkpoint loads both ways.

The class is accepted only after the probe (:mod:`zero_offload.rules.probe`) has seen its state, checked that its
update is elementwise, and run this very rule against the class for many steps on parameters of several shapes in
several groups and buckets; otherwise it is refused, naming why.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import Rule, Run, Slots, StateBuffer, flat_grad
from zero_offload.rules.instances import Bound, GroupRecord
from zero_offload.rules.probe import (NotElementwise, Probed, check_scheme, elementwise, independent, kinds,
                                     loss_use, same)
from zero_offload.rules.settings import FAILURES, NOT_SETTINGS, Refused, build, class_defaults, freeze, read_hyper
from zero_offload.rules.whole import check_kept, pieces, probe_whole

__all__ = ["TorchClassRule", "NotElementwise", "Refused", "rule_for", "probe", "probe_group"]

# Classes refused before probing, with why (the probe would say less).
KNOWN_REFUSALS = {
    "LBFGS": "its step() needs a closure that re-evaluates the loss, and it runs a line search over all "
             "parameters together: not elementwise",
    "SparseAdam": "it updates sparse gradients only (its step() refuses dense ones), and the offloaded buffers "
                  "are dense: offload torch.optim.Adam instead",
}


def _structure(value: Hashable) -> Hashable:
    """A setting as far as it can change which state a class keeps: a number only by being zero or not (SGD's
    momentum), so that an LR schedule or a cycled momentum does not probe the class again at every step."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return value != 0


_PROBED: Dict[Tuple, Any] = {}
_LOCK = threading.Lock()


def _cached(key: Tuple, compute) -> Any:
    """A probe's result (or its refusal, raised again), computed once per key."""
    with _LOCK:
        found = _PROBED.get(key)
    if found is None:
        try:
            found = (True, compute())
        except Refused as e:
            found = (False, e)
        with _LOCK:
            _PROBED[key] = found
    if not found[0]:
        raise found[1]
    return found[1]


def _key(cls: type, ctor: Dict[str, Any], groups: Sequence[Dict[str, Any]]) -> Tuple:
    return (cls, freeze(ctor), tuple(tuple((k, _structure(v)) for k, v in freeze(g)) for g in groups))


def probe_group(cls: type, ctor: Dict[str, Any], group: Dict[str, Any]) -> Probed:
    """The kinds and elementwise passes of :mod:`zero_offload.rules.probe` for one group's settings (cached per
    class, constructor arguments and the settings' structure, see :func:`_structure`)."""

    def compute() -> Probed:
        found = kinds(cls, ctor, group)
        elementwise(cls, ctor, group, found)
        independent(cls, ctor, group)
        return dataclasses.replace(found, uses_loss=loss_use(cls, ctor, group))

    return _cached(("group",) + _key(cls, ctor, [group]), compute)


def probe(cls: type, ctor: Dict[str, Any], groups: Sequence[Dict[str, Any]]) -> Probed:
    """What ``cls`` keeps, built with ``ctor`` and stepped in param groups with the settings ``groups``, after all
    the passes of :mod:`zero_offload.rules.probe` (:class:`Refused` otherwise; cached as :func:`probe_group`). A class
    whose update uses its closure's loss and matches the class only without closures is accepted with
    ``closure_refusal`` set: ``step(closure)`` is refused, naming why."""

    def compute() -> Probed:
        found = [probe_group(cls, ctor, g) for g in groups]
        merged = Probed(tuple(dict.fromkeys(b for p in found for b in p.buffers)),
                        next((p.step_key for p in found if p.step_key), None),
                        any(p.step_is_tensor for p in found),
                        tuple(dict.fromkeys(k for p in found for k in p.group_state)),
                        tuple(dict.fromkeys(k for p in found for k in p.global_state)),
                        tuple(dict.fromkeys(k for p in found for k in p.attributes)),
                        any(p.eager for p in found), any(p.uses_loss for p in found))
        try:
            check_scheme(lambda: TorchClassRule(cls, groups, ctor, probed=merged), cls, ctor, groups)
        except Refused as e:
            if not merged.uses_loss:
                raise
            plain = dataclasses.replace(merged, uses_loss=False)
            check_scheme(lambda: TorchClassRule(cls, groups, ctor, probed=plain), cls, ctor, groups)
            return dataclasses.replace(plain, closure_refusal=(
                f"{cls.__name__}: step(closure) is refused: its update uses the loss its closure returns, and, run "
                f"with closures, the offloaded update does not match the class's ({e}); step() without a closure "
                "matches it"))
        return merged

    return _cached(("scheme",) + _key(cls, ctor, groups), compute)


def probe_parked(cls: type, ctor: Dict[str, Any], groups: Sequence[Dict[str, Any]], ndims: Tuple[int, ...]
                 ) -> Probed:
    """What ``cls`` keeps stepped whole (:func:`~zero_offload.rules.whole.probe_whole`) in groups with the settings
    ``groups``, over stand-ins of ``ndims`` dimensions (cached as :func:`probe_group`)."""

    def one(group: Dict[str, Any]) -> Probed:
        return _cached(("whole", ndims) + _key(cls, ctor, [group]), lambda: probe_whole(cls, ctor, group, ndims))

    found = [one(g) for g in groups]
    return Probed(tuple(dict.fromkeys(b for p in found for b in p.buffers)),
                  next((p.step_key for p in found if p.step_key), None), any(p.step_is_tensor for p in found),
                  tuple(dict.fromkeys(k for p in found for k in p.group_state)),
                  tuple(dict.fromkeys(k for p in found for k in p.global_state)),
                  tuple(dict.fromkeys(k for p in found for k in p.attributes)),
                  any(p.eager for p in found), any(p.uses_loss for p in found), whole=ndims,
                  shapes=tuple({k: v for p in reversed(found) for k, v in p.shapes}.items()))


def _declared(probed: Probed, needs: Any) -> Tuple[StateBuffer, ...]:
    """The state buffers of what the probe found, each allocated where ``needs(name, hyper)``; those of a class
    stepped whole that are not shaped like the parameter with their shapes (:class:`StateShape`)."""
    shapes = dict(probed.shapes)
    return tuple(StateBuffer(k, compactable=False, needed=functools.partial(needs, k), shape=shapes.get(k))
                 for k in probed.buffers)


def _gradient(run: Run) -> torch.Tensor:
    """The run's gradient as a new float32 tensor times ``grad_scale`` (zeros between the slots when it comes as
    per-parameter gradients), so that the class may change it and ``param_out`` may share the gradient's memory."""
    grad = flat_grad(run)  # (gathered on the run's device: a new tensor)
    if run.grads is None:
        grad = grad.to(torch.float32, copy=True)
    if run.grad_scale != 1.0:
        grad.mul_(run.grad_scale)
    return grad


def _param_out(run: Run) -> None:
    if run.param_out is None:
        return
    if run.grads is None:
        run.param_out.copy_(run.master)
    elif run.grads:
        torch._foreach_copy_([run.param_out[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)],
                             [run.master[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)])


class TorchClassRule(Rule):
    """The update of one elementwise ``torch.optim``-style class (see the module docstring), fp32 state only; on a
    bucket stepped on a GPU (parked, resident), the class's own code over whole parameters
    (:mod:`zero_offload.rules.whole`), which is all a class that is not elementwise runs (``parked``).

    Args:
        optimizer_class (type): the class; its state-dict format, defaults and validation are the rule's.
        groups (Sequence[Dict[str, Any]]): the parameter groups' settings known now: the declared buffers are the
            union of what the class keeps under each (a group that later needs another is refused at step()).
        ctor (Dict[str, Any]): the keyword arguments the class is built with (every instance of it the rule makes).
        probed (Probed, optional): what the probe found (default: probe now, refusing what cannot be matched).
        parked (Tuple[int, ...], optional): the class is run only on whole parameters on a GPU, whose numbers of
            dimensions these are (probed by :func:`probe_parked` instead); ``host_refusal`` says why not on the host.
    """

    state_dtypes = (torch.float32,)
    device_update = True

    def __init__(self, optimizer_class: type, groups: Sequence[Dict[str, Any]] = (),
                 ctor: Optional[Dict[str, Any]] = None, *, probed: Optional[Probed] = None,
                 parked: Optional[Tuple[int, ...]] = None, host_refusal: str = ""):
        if optimizer_class.__name__ in KNOWN_REFUSALS:
            raise NotElementwise(f"{optimizer_class.__name__} cannot be offloaded: "
                                 f"{KNOWN_REFUSALS[optimizer_class.__name__]}")
        self.name = optimizer_class.__name__
        self.optimizer_class, self.ctor = optimizer_class, dict(ctor or {})
        self.host_refusal = host_refusal
        self._probed = Probed((), None, False, whole=parked or ())  # (until probed: what _stand_in reads)
        extras = {k: v for k, v in (groups[0] if groups else {}).items() if k not in NOT_SETTINGS}
        self.defaults = class_defaults(optimizer_class, freeze(self.ctor), freeze(extras), (parked or (1,))[0])
        # Keys the class adds to its param groups or changes there: its state, not settings (grown as its
        # instances show more).
        self._state_keys = set(() if probed is None else probed.group_state)
        groups = [{**self.defaults, **g} for g in (groups or ({},))]
        groups = [{**g, **self.group_keys(g)} for g in groups]
        if parked:
            probed = probe_parked(optimizer_class, self.ctor, [self._settings(g) for g in groups], parked)
        if probed is None:  # (those keys first, so that the whole probe runs on the settings hyper() will read)
            self._state_keys.update(k for g in groups for k in probe_group(
                optimizer_class, self.ctor, self._settings(g)).group_state)
        # (a rule built by the probe itself, ``probed`` given, checks later settings with the first two passes only)
        self._full = probed is None
        self._probed = probed if probed is not None else probe(optimizer_class, self.ctor,
                                                               [self._settings(g) for g in groups])
        self._state_keys.update(self._probed.group_state)
        self.buffers = _declared(self._probed, self._needs)
        self.step_key, self._step_is_tensor = self._probed.step_key, self._probed.step_is_tensor
        self.uses_loss, self.closure_refusal = self._probed.uses_loss, self._probed.closure_refusal
        self._loss: Optional[Tuple[Any]] = None  # (the closure's loss, while step() runs: see set_loss)
        self._lock = threading.Lock()
        self._bounds: "weakref.WeakKeyDictionary[Any, Bound]" = weakref.WeakKeyDictionary()
        self._unowned: Optional[Bound] = None  # the instance of runs driven without a bucket
        self._groups: Dict[int, GroupRecord] = {}
        self._globals: Tuple[int, Dict[str, Any]] = (0, {})  # (generation, values) loaded by load_state_dict
        self._ticks = 0

    def _stand_in(self) -> torch.Tensor:
        """What its instances are built over (their params are set at each update): one element, of a shape the
        class takes."""
        return torch.zeros((1,) * (self._probed.whole or (1,))[0])

    def _settings(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """A group's settings as the class is built with them (what the probe steps)."""
        return read_hyper(self.optimizer_class, self.defaults, group, tuple(self._state_keys)).group()

    def _needs(self, name: str, hyper: Any) -> bool:
        return name in self._probe_for(hyper).buffers

    def _probe_for(self, hyper: Any) -> Probed:
        """The probe of a group's settings (the construction-time probe covers the settings it was built with)."""
        if self._probed.whole:
            return probe_parked(self.optimizer_class, self.ctor, [hyper.group()], self._probed.whole)
        check = probe if self._full else lambda cls, ctor, groups: probe_group(cls, ctor, groups[0])
        return check(self.optimizer_class, self.ctor, [hyper.group()])

    def hyper(self, group: Dict[str, Any]) -> Hashable:
        h = read_hyper(self.optimizer_class, self.defaults, group, tuple(self._state_keys))
        probed = self._probe_for(h)
        missing = [k for k in probed.buffers if k not in {b.name for b in self.buffers}]
        if missing:
            raise ValueError(f"{self.name}: these settings keep state {missing} that the optimizer was not built "
                             "with; set them when building it")
        if probed.uses_loss and not self.uses_loss and self._full and not self.closure_refusal:
            raise ValueError(f"{self.name}: with these settings its step() uses the loss its closure returns, which "
                             "the optimizer was not built to hand it; set them when building it")
        return h

    def group_keys(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """As :meth:`Rule.group_keys`: the keys the class's constructor, building it over a stand-in parameter in a
        group with ``group``'s settings, leaves in that group beyond its defaults and the settings given (or sets
        there over the given value), with their values."""
        given = {k: v for k, v in group.items() if k not in NOT_SETTINGS}
        try:
            built = build(self.optimizer_class, [([torch.nn.Parameter(self._stand_in())], given)], self.ctor)
        except FAILURES:  # (the class refuses these settings: its own error comes from check())
            return {}
        return {k: v for k, v in built.param_groups[0].items() if k not in NOT_SETTINGS and k not in self.defaults
                and (k not in given or not same(given[k], v))}

    def set_loss(self, loss: Optional[Tuple[Any]]) -> None:
        self._loss = loss

    def check(self, group: Dict[str, Any], where: str = "") -> None:
        """As :meth:`Rule.check`; the defaults themselves are only read (the class's own checks), not probed: a
        class may need group keys its defaults lack (Muon-style ``use_muon``), which every group then gives. A class
        run on whole parameters refuses parameters of other numbers of dimensions than it was probed with."""
        whole, given = self._probed.whole, group.get("params", ())
        given = [given] if isinstance(given, torch.Tensor) else given if isinstance(given, (list, tuple)) else ()
        ndims = {p.dim() for p in given if isinstance(p, torch.Tensor)}  # (an iterator is not read: it is the group's)
        if whole and not ndims <= set(whole):
            raise ValueError(f"{self.name} was probed for parked parameters of {whole} dimensions, not "
                             f"{sorted(ndims - set(whole))}: give parameters of every number of dimensions when "
                             "building the optimizer")
        if same({k: v for k, v in group.items() if k not in NOT_SETTINGS}, self.defaults):
            read_hyper(self.optimizer_class, self.defaults, group, tuple(self._state_keys))
            return
        super().check(group, where)

    def _step_value(self, step: int) -> Any:
        return torch.tensor(float(step), dtype=torch.float32) if self._step_is_tensor else step

    # ----------------------------------------------------------------------------------- the class's instances --
    def _bound(self, slots: Optional[Slots], hyper: Any) -> Bound:
        owner = None if slots is None else slots.owner
        with self._lock:
            bound = self._unowned if owner is None else self._bounds.get(owner)
        if bound is None:
            # Built over a one-element stand-in (its params are set at each update): a constructor that makes state
            # (Adagrad's) would otherwise allocate and fill a run-sized buffer only to have it replaced by ours.
            opt = build(self.optimizer_class, [([self._stand_in()], hyper.group())], self.ctor)
            opt.state.clear()
            bound = Bound(opt, 0 if slots is None else slots.group, None if slots is None else slots.steps,
                          self._probed.attributes)
            bound.settings |= set(opt.param_groups[0]) - self._state_keys
            bound.initial = bound.capture().group
            with self._lock:
                if owner is None:
                    self._unowned = bound
                else:
                    self._bounds[owner] = bound
        return bound

    def _adopt(self, bound: Bound, hyper: Any) -> None:
        """Bring the instance in line with a replaced or edited param group, and with loaded global entries."""
        live = getattr(hyper, "live", None)
        with self._lock:
            record = self._groups.setdefault(bound.group, GroupRecord())
            if live is not None:
                record.observe(live, self._state_keys)
            generation, adopted = record.generation, record.adopted
            global_generation, global_values = self._globals
        if bound.group_generation != generation:
            bound.set_group_state(adopted)
            bound.group_generation = generation
        if bound.global_generation != global_generation:
            bound.set_global_state(global_values)
            bound.global_generation = global_generation

    def _publish(self, bound: Bound, hyper: Any) -> None:
        """Show the class's keys of its param group in the optimizer's (what ``state_dict()`` saves)."""
        live = getattr(hyper, "live", None)
        values = bound.post.group
        with self._lock:
            self._state_keys.update(values)
            record = self._groups.setdefault(bound.group, GroupRecord())
            if live is None or record.live is not live:
                return
            for k in record.published:
                if k not in values:
                    live.pop(k, None)
            live.update({k: plain_copy(v) for k, v in values.items()})
            record.published = {k: plain_copy(v) for k, v in values.items()}

    # ---------------------------------------------------------------------------------------------- the update --
    def update(self, run: Run, hyper: Any) -> None:
        if self.host_refusal:
            raise ValueError(self.host_refusal)
        self._update([run], run, hyper)

    def update_on_device(self, run: Run, hyper: Any) -> None:
        """The class's own code on the GPU copies of the state: a class run whole (not elementwise), each parameter of
        the run whole (:func:`~zero_offload.rules.whole.pieces`); an elementwise one on the run as it is, as on the
        host (a sharded run holds pieces of parameters)."""
        self._update(pieces(run) if self.host_refusal else [run], run, hyper)

    def _update(self, parts: List[Run], run: Run, hyper: Any) -> None:
        slots = run.slots
        bound = self._bound(slots, hyper)
        bound.stash.extend(parts)
        if slots is not None and slots.index < slots.count - 1:
            return  # the class steps once per update of the bucket, over all its runs
        runs, bound.stash = bound.stash, []
        steps = None if slots is None or slots.steps is None else tuple(slots.steps.tolist())
        key = (steps, tuple((r.step, r.master.numel()) for r in runs))
        if bound.key == key and bound.pre is not None:
            bound.restore(bound.pre)  # the last update did not count (rolled back, or a preview on copies)
        self._adopt(bound, hyper)
        pre = bound.capture()
        try:
            self._step_class(bound, runs, hyper)
        except BaseException:
            bound.restore(pre)
            bound.key = None
            raise
        with self._lock:
            self._ticks += 1
            bound.tick = self._ticks
        bound.key, bound.pre, bound.dry = key, pre, slots is not None and slots.dry
        bound.post = bound.capture()
        if not bound.dry:
            self._publish(bound, hyper)

    def _step_class(self, bound: Bound, runs: Sequence[Run], hyper: Any) -> None:
        opt, names = bound.opt, [b.name for b in self.needed(hyper)]
        group = opt.param_groups[0]
        settings = hyper.group()
        bound.settings |= set(settings)
        group.update(settings)  # (an LR scheduler's lr, a group's own settings)
        params = []
        for run in runs:
            param = run.master.view(run.master.shape)  # a new tensor object: its .grad is ours to set
            param.grad = _gradient(run)
            opt.state[param] = self._entry(run, param, names, settings)
            params.append(param)
        group["params"] = params
        loss = self._loss if self.uses_loss else None
        try:
            if loss is None:
                opt.step()
            else:  # (the class's own code gets the loss of the closure that step() called, as the class would)
                opt.step(lambda: loss[0])
            for run, param in zip(runs, params):
                self._collect(run, opt.state[param], names)
        finally:
            group["params"] = []
            for param in params:
                opt.state.pop(param, None)

    def _entry(self, run: Run, param: torch.Tensor, names: List[str], settings: Dict[str, Any]) -> Dict[str, Any]:
        """The state the class finds for a run's parameter: fresh on its first step (what the class's constructor
        makes, Adagrad's ``sum`` at ``initial_accumulator_value``, or nothing), else our buffers and the count."""
        if run.step == 1:
            if not self._probed.eager:
                return {}
            return dict(build(self.optimizer_class, [([param], settings)], self.ctor).state[param])
        state = {k: run.state[k] for k in names if k in run.state}  # (a shaped buffer: the parameters it has)
        if self.step_key is not None:
            state = {self.step_key: self._step_value(run.step - 1), **state}
        return state

    def _collect(self, run: Run, state: Dict[str, Any], names: List[str]) -> None:
        if self.host_refusal:  # (stepped whole: what it keeps must be what we hold)
            check_kept(self.name, self.step_key, run, state)
        for k in [k for k in names if k in run.state]:  # (a shaped buffer: the parameters it has)
            if k not in state:
                raise RuntimeError(f"{self.name} kept no {k!r} for a parameter it stepped")
            if state[k] is not run.state[k]:
                run.state[k].copy_(state[k].reshape(run.state[k].shape))
        if self.step_key is not None and float(state[self.step_key]) != run.step:
            raise RuntimeError(f"{self.name} counted step {float(state[self.step_key])}, expected {run.step}")
        _param_out(run)

    # ----------------------------------------------------------------------------------------------- saving --
    def class_state(self, groups: Sequence[Dict[str, Any]]) -> Tuple[Dict[int, Dict[str, Any]], Dict[str, Any]]:
        """What the class's instances keep beyond the per-parameter state, as the buckets' state stands: the
        class's keys of each param group (of those whose group dict they last saw) and its global entries."""
        with self._lock:
            bounds = sorted(list(self._bounds.values()), key=lambda b: b.tick)
            records = dict(self._groups)
            global_generation, global_values = self._globals
        by_group: Dict[int, Dict[str, Any]] = {}
        global_state: Dict[str, Any] = dict(global_values)
        for bound in bounds:  # the latest last
            snap = bound.current()
            if snap is None:
                continue
            record = records.get(bound.group)
            if record is not None and bound.group < len(groups) and record.live is groups[bound.group]:
                by_group[bound.group] = snap.group
            if bound.global_generation == global_generation:
                global_state = snap.globals
        return by_group, global_state

    def state_dict_hook(self, opt: torch.optim.Optimizer, sd: Dict[str, Any]) -> None:
        """``register_state_dict_post_hook``: the class's group keys and global entries into the saved dict."""
        by_group, global_state = self.class_state(opt.param_groups)
        for gi, values in by_group.items():
            sd["param_groups"][gi].update({k: plain_copy(v) for k, v in values.items()})
        sd["state"].update({k: plain_copy(v) for k, v in global_state.items()})

    def load_hook(self, opt: torch.optim.Optimizer) -> None:
        """``register_load_state_dict_post_hook``: the loaded global entries of the class go to its instances (and
        leave ``opt.state``, where they would not follow the steps)."""
        keys = set(self._probed.global_state)
        with self._lock:
            for bound in self._bounds.values():
                keys |= set(bound.global_state())
            values = {k: opt.state.pop(k) for k in list(opt.state) if not isinstance(k, torch.Tensor) and k in keys}
            self._globals = (self._globals[0] + 1, values)


def plain_copy(value: Any) -> Any:
    """A copy to show outside the class's instance (a tensor cloned, so the instance's own is not shared)."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def rule_for(optimizer_class: type, *groups: Dict[str, Any], ctor: Optional[Dict[str, Any]] = None
             ) -> TorchClassRule:
    """The generic rule of ``optimizer_class`` built with ``ctor`` for parameter groups with settings ``groups``
    (refuses a class or a setting it cannot run faithfully, :class:`Refused`, naming why)."""
    return TorchClassRule(optimizer_class, groups, ctor)

