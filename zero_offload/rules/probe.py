"""The generic rule's probe: what an optimizer class keeps, and whether zero_offload can run it faithfully.

Five passes, each on fresh parameters with cloned gradients (a class may edit ``p.grad`` in place, so no two runs
share a gradient tensor):

* **kinds**: the class steps parameters of two shapes; its per-parameter state must be tensors shaped like the
  parameter plus, optionally, a step count; what it adds to its param group (pytorch_optimizer's ``step``), the
  entries of ``opt.state`` that are no parameter's (MADGRAD's ``k``) and the attributes its ``step()`` changes
  are noted, as state the class's own instance keeps (see :mod:`zero_offload.rules.torch_class`);
* **elementwise**: the class steps a 2-D parameter, and separately the same elements shuffled and split into two
  1-D parameters; they must agree (else an element's update depends on others of its tensor, or on its shape:
  LAMB, LARS, Muon, Shampoo, gradient centralisation), at 24 elements and at 133,120 (else it changes with the
  tensor's size, which the offloaded runs change). Its result must also not change from one run to the next: if
  it does, it draws random numbers (a generator moved) or its step depends on state outside the optimizer (a class
  attribute counting steps), and the refusal says which;
* **independent** (:func:`independent`): the class steps three parameters in two param groups, and again with one
  parameter's gradients replaced by a steady one; the others must step bitwise as before (else its update of one
  parameter depends on other parameters: D-Adaptation's ``d``, a sum over all of them, however small its effect at
  first);
* **closure** (:func:`loss_use`): whether the class steps differently given a closure, or closures returning
  different losses (a step size scaled by the loss, or by its trend: a falling and a rising loss): the rule then
  hands the class's own ``step()`` the loss of the closure ``step()`` called, and the scheme pass runs with such
  closures (where only a run without them matches, ``step(closure)`` is refused). A class that calls its closure
  more than once a step is refused;
* **scheme** (:func:`check_scheme`): the rule itself, over flat buffers laid out as zero_offload lays them (two
  param groups, two buckets each, padding between the slots, a parameter without a gradient at one step), against
  the class stepping the same parameters, for :data:`SCHEME_STEPS` steps: parameters and state every step, the
  updates judged relative to their size (with closures returning a loss, for a class that uses it). A class that
  keeps state anywhere the rule does not carry fails here, and is refused naming the step and the size of the
  difference.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import random
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import Run, Slots, StateShape
from zero_offload.rules.settings import FAILURES, Refused, build
from zero_offload.state.layout import align_up

__all__ = ["NotElementwise", "Probed", "kinds", "elementwise", "independent", "loss_use", "check_scheme",
           "updates_close", "same"]

KIND_STEPS = 24  # a key of its group may start to move late (schedule-free RAdam's weight_sum)
ELEMENTWISE_STEPS = 8
SCHEME_STEPS = 24  # RAdam's rectification starts at step 6; D-Adaptation's d moves from step 2
_WHOLE, _SPLIT = (4, 6), 7  # the elementwise pass: 24 elements, shuffled into parameters of 7 and 17
# ... and again at a size past the thresholds some classes switch at (bitsandbytes' 8-bit state from 4096 elements):
# the offloaded runs span many parameters, so a run is far larger than the parameters the class would step itself.
_LARGE = (256, 520)
# The scheme pass: per group, its buckets, each a list of parameter shapes.
_SCHEME = (([(4, 6), (7,)], [(3, 2, 2)]), ([(5,), (2, 3)], [(9,)]))
_ABSENT = (5, 0, 0, 1)  # at this step, this (group, bucket, parameter) has no gradient
# An update may differ from the class's by this much of its own size (float32 rounding of a different order of
# operations over flat buffers stays orders of magnitude below; a lost step count or statistic is far above).
UPDATE_RTOL = 1e-3
# Attributes every torch.optim.Optimizer has or that torch (its hooks, LR schedulers) sets: not the class's state.
_BOOKKEEPING = {"state", "param_groups", "defaults", "_zero_grad_profile_name", "_opt_called",
                "_warned_capturable_if_run_uncaptured"}


class NotElementwise(Refused):
    """The optimizer class (or one of its settings) does not update each element from that element alone."""


@dataclasses.dataclass(frozen=True)
class Probed:
    """What a class keeps, as the probe saw it.

    Attributes:
        buffers (Tuple[str, ...]): per-parameter state shaped like the parameter, in the class's order.
        step_key (str, optional): the per-parameter step count (None: it keeps none); ``step_is_tensor``: as a
            tensor (torch's classes) or a number.
        group_state (Tuple[str, ...]): keys its ``step()`` adds to its param group or changes there.
        global_state (Tuple[str, ...]): keys of its ``state`` that are no parameter's.
        attributes (Tuple[str, ...]): instance attributes its ``step()`` changes.
        eager (bool): its constructor creates a parameter's state (torch's Adagrad).
        uses_loss (bool): its ``step(closure)`` steps differently with a closure, or with the loss the closure
            returns (see :func:`loss_use`).
        closure_refusal (str): why ``step(closure)`` is refused ("": it is not), for a class whose update uses the
            loss and matches the class only without a closure.
        whole (Tuple[int, ...]): probed to run on whole parameters on a GPU only, of these numbers of dimensions
            (:mod:`zero_offload.rules.whole`); (): probed elementwise.
        shapes (Tuple[Tuple[str, StateShape], ...]): probed whole, the buffers not shaped like the parameter for
            every number of dimensions, with the shape each keeps per parameter (Adafactor's factors).
    """

    buffers: Tuple[str, ...]
    step_key: Optional[str]
    step_is_tensor: bool
    group_state: Tuple[str, ...] = ()
    global_state: Tuple[str, ...] = ()
    attributes: Tuple[str, ...] = ()
    eager: bool = False
    uses_loss: bool = False
    closure_refusal: str = ""
    whole: Tuple[int, ...] = ()
    shapes: Tuple[Tuple[str, StateShape], ...] = ()


def same(a: Any, b: Any) -> bool:
    """Equal values, tensors and containers of them included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def attributes(opt: torch.optim.Optimizer) -> Dict[str, Any]:
    """Copies of the instance's own attributes (not torch.optim's bookkeeping or hooks)."""
    out = {}
    for k, v in vars(opt).items():
        if k in _BOOKKEEPING or k.startswith("_optimizer_"):
            continue
        try:
            out[k] = copy.deepcopy(v)
        except Exception:  # (a module, a lock: kept by identity)
            out[k] = v
    return out


def updates_close(new: torch.Tensor, ref_new: torch.Tensor, prev: Optional[torch.Tensor]) -> Optional[str]:
    """None if ``new`` matches ``ref_new`` (the class's) at float32's default tolerance and, when ``prev`` (the value
    before the step) is given, their updates agree to :data:`UPDATE_RTOL` of the update's size; else what differs."""
    new, ref_new = new.detach().float(), ref_new.detach().float()
    if not torch.allclose(new, ref_new, rtol=1.3e-6, atol=1e-5, equal_nan=True):
        return f"differs by {float((new - ref_new).abs().nan_to_num(float('inf')).max()):.3g}"
    if prev is None:
        return None
    prev = prev.detach().float()
    ours, theirs = new - prev, ref_new - prev
    size = float(theirs.abs().max()) if theirs.numel() else 0.0
    err = float((ours - theirs).abs().max()) if theirs.numel() else 0.0
    # (the last term: the rounding of a value of prev's size, which the update does not resolve below)
    if err > UPDATE_RTOL * size + 4 * torch.finfo(torch.float32).eps * float(prev.abs().max()):
        return f"its update differs by {err / max(size, 1e-30):.3g} of the update's size"
    return None


def _rng_states() -> Tuple[bytes, ...]:
    """The states of the random number generators a class may draw from: torch's default CPU generator, Python's
    and (when imported) NumPy's global one."""
    states = [torch.get_rng_state().numpy().tobytes(), pickle.dumps(random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states.append(pickle.dumps(numpy.random.get_state()))
    return tuple(states)


def _refuse_replay(name: str, drew: bool, what: str) -> None:
    """Refuse a class that steps differently on a replay with identical inputs, naming why as far as the probe
    saw it: ``drew``, a random number generator moved during the runs."""
    if drew:
        raise Refused(f"{name} cannot be offloaded faithfully: {what} (it draws random numbers: a random number "
                      "generator moved while it stepped), so no offloaded run can be checked against it")
    raise Refused(f"{name} cannot be offloaded faithfully: {what}: a replay with identical inputs (a new instance, "
                  "the same parameters and gradients) steps differently from the first run, without drawing random "
                  "numbers (torch's, Python's and NumPy's generators did not move). Its step depends on state "
                  "outside the optimizer (a class attribute, a module global, a count kept outside its instance, "
                  "its param groups and its state), which an offloaded run, one instance per bucket, cannot carry")


def _state_kinds(name: str, state: Dict[str, Any], shape: torch.Size) -> Tuple[List[str], Optional[str], bool]:
    buffers, step_key, step_is_tensor = [], None, False
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == shape:
            buffers.append(key)
        elif key == "step" and (isinstance(value, (int, float)) or
                                (isinstance(value, torch.Tensor) and value.numel() == 1)):
            step_key, step_is_tensor = key, isinstance(value, torch.Tensor)
        elif isinstance(value, torch.Tensor) and value.dim() == 0 or isinstance(value, (int, float)):
            raise NotElementwise(
                f"{name} keeps a per-parameter scalar {key!r} besides the step count; zero_offload holds "
                "per-element buffers and one step count per parameter, so it cannot offload it")
        else:
            what = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise NotElementwise(
                f"{name} is not elementwise: its state {key!r} has {what} for a parameter of shape "
                f"{tuple(shape)} (elementwise state is shaped like the parameter)")
    return buffers, step_key, step_is_tensor


def _build(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], params: List[torch.Tensor]
           ) -> torch.optim.Optimizer:
    try:
        return build(cls, [(params, group)], ctor)
    except FAILURES as e:
        raise Refused(f"{cls.__name__} cannot be offloaded: building it over plain float32 tensors in one group "
                      f"raised {type(e).__name__}: {e}") from e


def _steps(opt: torch.optim.Optimizer, grads: List[List[torch.Tensor]], what: str,
           watch: Optional[Callable[[], None]] = None) -> torch.optim.Optimizer:
    """Step ``opt`` (one group) once per entry of ``grads``, with clones of them (``watch()`` after each step)."""
    try:
        for step_grads in grads:
            for p, g in zip(opt.param_groups[0]["params"], step_grads):
                p.grad = g.clone()
            opt.step()
            if watch is not None:
                watch()
    except NotElementwise:  # (the watch's: what it found, not a failure to step)
        raise
    except FAILURES as e:
        raise Refused(f"{type(opt).__name__} could not be probed: stepping {what} without a closure raised "
                      f"{type(e).__name__}: {e}") from e
    return opt


def _run(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], params: List[torch.Tensor],
         grads: List[List[torch.Tensor]], what: str) -> torch.optim.Optimizer:
    """The class over ``params`` in one group, stepped once per entry of ``grads`` with clones of them."""
    return _steps(_build(cls, ctor, group, params), grads, what)


Classify = Callable[[str, torch.optim.Optimizer, List[torch.Tensor]], Tuple[Any, ...]]


def kinds(cls: type, ctor: Dict[str, Any], group: Dict[str, Any],
          shapes: Optional[Sequence[Tuple[int, ...]]] = None, classify: Optional[Classify] = None) -> Probed:
    """The kinds pass (see the module docstring), over parameters of ``shapes`` (default: a 2-D and a 1-D one; given:
    a class stepped whole, :mod:`zero_offload.rules.whole`). ``classify(name, opt, params)``, where given, reads the
    state after every step instead, as ``(buffers, step key, step is a tensor, shapes, each tensor's shape by key
    and parameter shape)``: it must not change from step to step (else refused, naming the entry and the step)."""
    name = cls.__name__
    gen = torch.Generator().manual_seed(0)
    given, shapes = shapes is not None, list(shapes or [_WHOLE, (_SPLIT,)])
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = _build(cls, ctor, group, params)
    eager = any(opt.state.get(p) for p in params)
    before, attrs = {k: v for k, v in opt.param_groups[0].items() if k != "params"}, attributes(opt)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(KIND_STEPS)]
    seen: List[Tuple[Any, ...]] = []
    watch = None if classify is None else lambda: seen.append(classify(name, opt, params))
    try:
        _steps(opt, grads, f"parameters of shapes {shapes}", watch)
    except Refused as e:
        if given:
            raise
        whole = torch.nn.Parameter(params[0].detach().clone())
        try:
            _run(cls, ctor, group, [whole], [g[:1] for g in grads], f"a {_WHOLE} parameter")
        except Refused:
            raise e from None
        raise NotElementwise(f"{name} is not elementwise: it steps a {_WHOLE} parameter but not a 1-D one "
                             f"({e.__cause__}), and zero_offload hands it flat 1-D runs of its buffers") from e
    after = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    # Keys the class adds to its group, or changes there, as it steps are its state (schedule-free's weight_sum).
    moving = [k for k in after if k not in before or not same(before[k], after[k])]
    if classify is not None:
        changed = next((t for t, kept in enumerate(seen) if kept != seen[0]), None)
        if changed is not None:
            raise NotElementwise(f"{name}'s per-parameter state changes between steps: "
                                 f"{_changed(seen[0][-1], seen[changed][-1], changed + 1)}; a parked bucket holds "
                                 "tensors of a fixed shape")
        buffers, step_key, step_is_tensor, state_shapes = seen[-1][:4]
    else:
        found = [_state_kinds(name, opt.state[p], p.shape) for p in params]
        if any(f != found[0] for f in found):
            raise NotElementwise(f"{name} is not elementwise: it keeps different state for parameters of shapes "
                                 f"{shapes} ({[f[0] for f in found]})")
        (buffers, step_key, step_is_tensor), state_shapes = found[0], ()
    if step_key is not None and {float(opt.state[p][step_key]) for p in params} != {float(KIND_STEPS)}:
        raise NotElementwise(f"{name}'s {step_key!r} is not a count of steps")
    after_attrs = attributes(opt)
    moved = tuple(k for k in after_attrs if k not in attrs or not same(attrs[k], after_attrs[k]))
    return Probed(tuple(buffers), step_key, step_is_tensor,
                  group_state=tuple(moving),
                  global_state=tuple(k for k in opt.state if not isinstance(k, torch.Tensor)),
                  attributes=moved, eager=eager, shapes=state_shapes)


def _changed(first: Dict[Tuple[str, Tuple[int, ...]], Tuple[int, ...]],
             then: Dict[Tuple[str, Tuple[int, ...]], Tuple[int, ...]], step: int) -> str:
    """The first entry whose shape differs between two readings of :func:`kinds` (``(key, parameter's shape)`` to
    the tensor's shape), as a message names it."""
    for (key, shape) in dict.fromkeys([*first, *then]):
        a, b = first.get((key, shape)), then.get((key, shape))
        if a != b:
            return (f"its state {key!r} of a parameter of shape {shape} is "
                    f"{'absent' if a is None else f'of shape {a}'} after step 1 and "
                    f"{'absent' if b is None else f'of shape {b}'} after step {step}")
    return "its step count or its kinds of state changed"


def elementwise(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], probed: Probed) -> None:
    """The elementwise pass (see the module docstring), at :data:`_WHOLE` and at :data:`_LARGE`: raises
    :class:`NotElementwise` or :class:`Refused`."""
    _split_steps_alike(cls, ctor, group, probed, _WHOLE, twice=True)
    _split_steps_alike(cls, ctor, group, probed, _LARGE)


def _split_steps_alike(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], probed: Probed,
                       shape: Tuple[int, int], twice: bool = False) -> None:
    """A ``shape`` parameter and the same elements shuffled into two 1-D parameters (:data:`_SPLIT` and the rest)
    step alike; ``twice``: two runs of the whole one step alike too."""
    name = cls.__name__
    gen = torch.Generator().manual_seed(1)
    n = shape[0] * shape[1]
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(ELEMENTWISE_STEPS)]
    perm = torch.randperm(n, generator=gen)
    cut = [_SPLIT, n - _SPLIT]
    wholes = [torch.nn.Parameter(start.clone()) for _ in range(2 if twice else 1)]
    refs, drew = [], False
    for w in wholes:
        rng = _rng_states()
        refs.append(_run(cls, ctor, group, [w], [[g] for g in grads], f"a {shape} parameter"))
        drew = drew or _rng_states() != rng
    if twice and not same(wholes[0].detach(), wholes[1].detach()):
        _refuse_replay(name, drew, "two runs of it on the same parameter and gradients step differently")
    parts = [torch.nn.Parameter(t.clone()) for t in start.reshape(-1)[perm].split(cut)]
    why = (f"{name} is not elementwise: its update of an element depends on other elements of the parameter, on "
           f"its shape or on its size (a {shape} parameter and the same elements shuffled and split into two "
           f"parameters of {cut[0]} and {cut[1]} step differently: a per-tensor norm, a mean over rows, a matrix "
           "operation, as in LAMB, LARS, Muon, Shampoo or gradient centralisation, or a rule that changes with "
           "the tensor's size, which the offloaded runs, spanning many parameters, would change)")
    try:
        split = _run(cls, ctor, group, parts, [list(g.reshape(-1)[perm].split(cut)) for g in grads],
                     "the same elements split into two 1-D parameters")
    except Refused as e:
        raise NotElementwise(f"{why}; {e}") from e
    ref = refs[0]
    pairs = [(wholes[0].detach(), [p.detach() for p in parts])]
    pairs += [(ref.state[wholes[0]][k], [split.state[p].get(k) for p in parts]) for k in probed.buffers]
    for full, pieces in pairs:
        if any(p is None for p in pieces) or not torch.allclose(
                full.reshape(-1)[perm], torch.cat([p.reshape(-1) for p in pieces]), rtol=1e-5, atol=1e-6):
            raise NotElementwise(why)


# The cross-parameter pass: two param groups (with the same settings), the first with two parameters.
_CROSS = ((_WHOLE, (_SPLIT,)), ((5,),))


def _trace(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], starts: List[List[torch.Tensor]],
           grads: List[List[List[torch.Tensor]]]) -> List[List[Tuple[torch.Tensor, Dict[str, Any]]]]:
    """The class over parameters starting at ``starts`` (one list per param group), stepped with clones of
    ``grads``: after each step, each parameter and its state, copied."""
    params = [[torch.nn.Parameter(t.clone()) for t in ts] for ts in starts]
    try:
        opt = build(cls, [(ps, group) for ps in params], ctor)
        out = []
        for step_grads in grads:
            for ps, gs in zip(params, step_grads):
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
            opt.step()
            out.append([(_bits(p), {k: _bits(v) for k, v in opt.state[p].items()}) for ps in params for p in ps])
    except FAILURES as e:
        raise Refused(f"{cls.__name__} could not be probed: stepping parameters of several shapes in two param "
                      f"groups raised {type(e).__name__}: {e}") from e
    return out


def _bits(value: Any) -> Any:
    """A copy of a tensor's bytes (compared bitwise, NaNs included), or of any other value."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    return copy.deepcopy(value)


def independent(cls: type, ctor: Dict[str, Any], group: Dict[str, Any],
                cross: Tuple[Tuple[Tuple[int, ...], ...], ...] = _CROSS) -> None:
    """The cross-parameter pass: the class steps three parameters in two param groups, and again with the first
    parameter's gradients replaced by one gradient, three times larger, at every step; the other two must step
    bitwise as before, parameters and state (else its update of one parameter depends on others: a sum over all of
    them, as D-Adaptation's ``d``, however small its effect). A gradient that keeps its direction is what moves
    D-Adaptation's ``d`` off ``d0`` (random ones, uncorrelated from step to step, leave it there for many steps).
    ``cross``: the shapes of the three parameters by group. Raises :class:`Refused`."""
    name = cls.__name__
    gen = torch.Generator().manual_seed(4)
    starts = [[torch.randn(s, generator=gen) for s in shapes] for shapes in cross]
    grads = [[[torch.randn(s, generator=gen) for s in shapes] for shapes in cross] for _ in range(SCHEME_STEPS)]
    plain = _trace(cls, ctor, group, starts, grads)
    steady = torch.randn(cross[0][0], generator=gen).mul_(3)
    changed = [[[steady if (gi, i) == (0, 0) else g for i, g in enumerate(gs)] for gi, gs in enumerate(step)]
               for step in grads]
    other = _trace(cls, ctor, group, starts, changed)
    where = ["another parameter of its param group", "a parameter of another param group"]
    for t, (a, b) in enumerate(zip(plain, other)):
        for j, what in zip((1, 2), where):
            if not same(a[j], b[j]):
                raise Refused(
                    f"{name} cannot be offloaded faithfully: its update of one parameter depends on other parameters "
                    f"(a sum over all parameters, or another statistic over all the parameters of its param groups, "
                    f"as D-Adaptation's and Prodigy's step size d): changing the gradients of a {cross[0][0]} "
                    f"parameter changed the update of {what} (shape {cross[j // 2][j % 2]}) at step {t + 1}; "
                    "zero_offload updates the parameters bucket by bucket, each bucket's instance of the class seeing "
                    "its own")


def loss_use(cls: type, ctor: Dict[str, Any], group: Dict[str, Any], shape: Tuple[int, ...] = _WHOLE) -> bool:
    """The closure pass: whether the class steps differently given a closure, or given closures returning
    different losses (a step size scaled by the loss, or by its trend: a falling loss and a rising one). Raises
    :class:`Refused` for a class that calls its closure more than once a step; a class that cannot step with a
    closure is taken not to use one. ``shape``: the parameter's."""
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(KIND_STEPS)]
    seen = []
    for loss in (None, (2.0, 0.8), (0.5, 1.25)):  # (none; the first loss and its ratio from step to step)
        calls = [0]

        def closure(loss=loss):
            calls[0] += 1
            return torch.tensor(loss[0] * loss[1] ** (calls[0] - 1))

        param = torch.nn.Parameter(start.clone())
        try:
            opt = build(cls, [([param], group)], ctor)
            for g in grads:
                param.grad = g.clone()
                opt.step() if loss is None else opt.step(closure)
        except FAILURES:
            return False
        if calls[0] > len(grads):
            raise Refused(f"{cls.__name__} cannot be offloaded: its step() calls its closure {calls[0] / len(grads):g} "
                          "times a step (it evaluates the model again: a line search, a sharpness-aware step), and "
                          "zero_offload's step() calls the closure once, then updates")
        seen.append((param.detach(), copy.deepcopy(dict(opt.state[param]))))
    return not (same(seen[0], seen[1]) and same(seen[1], seen[2]))


@dataclasses.dataclass(eq=False)  # (hashed by identity: the rule keeps the class's instance per bucket)
class _Bucket:
    """One bucket of the scheme pass, laid out as the state home lays one: aligned slots, zero padding."""

    shapes: List[Tuple[int, ...]]
    offsets: List[int]
    master: torch.Tensor
    state: Dict[str, torch.Tensor]
    steps: torch.Tensor

    @staticmethod
    def of(values: Sequence[torch.Tensor], names: Sequence[str], padded: bool = True) -> "_Bucket":
        offsets, cursor = [], 0
        for v in values:
            offsets.append(cursor)
            cursor = align_up(cursor + v.numel()) if padded else cursor + v.numel()
        master = torch.zeros(cursor)
        for o, v in zip(offsets, values):
            master[o:o + v.numel()] = v.reshape(-1)
        return _Bucket([tuple(v.shape) for v in values], offsets, master,
                       {n: torch.zeros(cursor) for n in names}, torch.zeros(len(values)))

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]:self.offsets[i] + torch.Size(self.shapes[i]).numel()].view(self.shapes[i])

    def step(self, rule: Any, hyper: Any, group: int, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """One update of the parameters with a gradient, in runs (equal step counts, contiguous) as a bucket's."""
        flat = torch.zeros_like(self.master)
        for i, g in enumerate(grads):
            if g is not None:
                self.slot(flat, i).copy_(g)
        runs, first = [], None
        for i, g in enumerate(list(grads) + [None]):
            if first is not None and (g is None or self.steps[i] != self.steps[first]):
                runs.append((first, i - 1))
                first = None
            if g is not None and first is None:
                first = i
        steps_before = self.steps.clone()
        for index, (first, last) in enumerate(runs):
            a = self.offsets[first]
            b = self.offsets[last + 1] if last + 1 < len(self.offsets) else self.master.numel()
            slots = Slots(self, group, self.steps, index, len(runs))
            rule.update(Run(self.master[a:b], flat[a:b], None, (), {k: v[a:b] for k, v in self.state.items()}, {},
                            int(steps_before[first]) + 1, 1.0, None, slots=slots), hyper)
        for first, last in runs:
            self.steps[first:last + 1] += 1


class _ClassRaised(Exception):
    """The class itself raised in the scheme pass (at the step without a gradient: it does not skip one)."""


def _scheme_diff(make_rule: Callable[[], Any], cls: type, ctor: Dict[str, Any], groups: Sequence[Dict[str, Any]],
                 merged: bool, absent: Tuple[int, ...] = _ABSENT) -> Optional[str]:
    """Step the rule over :data:`_SCHEME`'s buckets against the class; None if they agree every step, else where
    they first differ. ``merged``: one bucket per group, without padding (a statistic over the group's elements
    then sees what the class sees)."""
    rule = make_rule()
    uses_loss = rule.uses_loss
    gen = torch.Generator().manual_seed(2)
    layout = [[[s for b in buckets for s in b]] if merged else list(buckets) for buckets in _SCHEME]
    values = [[[torch.randn(s, generator=gen) for s in b] for b in buckets] for buckets in layout]
    live = [dict(g) for g in groups]
    hypers = [rule.hyper(g) for g in live]
    ours = [[_Bucket.of(vs, [n.name for n in rule.needed(h)], padded=not merged) for vs in buckets]
            for buckets, h in zip(values, hypers)]
    params = [[torch.nn.Parameter(v.clone()) for b in buckets for v in b] for buckets in values]
    ref = build(cls, list(zip(params, groups)), ctor)
    for t in range(SCHEME_STEPS):
        hypers = [rule.hyper(g) for g in live]
        grads = [[[None if (t, gi, bi, i) == absent else torch.randn(s, generator=gen) for i, s in enumerate(b)]
                  for bi, b in enumerate(buckets)] for gi, buckets in enumerate(layout)]
        prev = [[p.detach().clone() for p in ps] for ps in params]
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, [g for b in gs for g in b]):
                p.grad = None if g is None else g.clone()
        loss = torch.tensor(1.0 + 0.25 * (t % 5))  # (a closure's loss, for a class that uses it)
        try:
            ref.step(lambda: loss) if uses_loss else ref.step()
        except Exception as e:
            raise _ClassRaised(f"{type(e).__name__}: {e}") from e
        if uses_loss:
            rule.set_loss((loss,))
        try:
            for gi, (buckets, h) in enumerate(zip(ours, hypers)):
                for bucket, gs in zip(buckets, grads[gi]):
                    bucket.step(rule, h, gi, [None if g is None else g.clone() for g in gs])
        except Exception as e:
            return f"at step {t + 1} the offloaded run raised {type(e).__name__}: {e}"
        where = _compare(ours, params, prev, ref, hypers, rule)
        if where is not None:
            return f"it steps differently from step {t + 1} on: {where}"
    return None


def _compare(ours: List[List[_Bucket]], params: List[List[torch.Tensor]], prev: List[List[torch.Tensor]],
             ref: torch.optim.Optimizer, hypers: Sequence[Any], rule: Any) -> Optional[str]:
    for gi, (buckets, ps, pv) in enumerate(zip(ours, params, prev)):
        flat = [(b, i) for b in buckets for i in range(len(b.shapes))]
        for j, ((bucket, i), p) in enumerate(zip(flat, ps)):
            diff = updates_close(bucket.slot(bucket.master, i), p, pv[j])
            if diff is not None:
                return f"parameter {j} of group {gi} (shape {tuple(p.shape)}) {diff}"
            for name in [b.name for b in rule.needed(hypers[gi])]:
                theirs = ref.state.get(p, {}).get(name)
                if theirs is None:
                    continue
                diff = updates_close(bucket.slot(bucket.state[name], i), theirs, None)
                if diff is not None:
                    return f"state {name!r} of parameter {j} of group {gi} {diff}"
    return None


def check_scheme(make_rule: Callable[[], Any], cls: type, ctor: Dict[str, Any],
                 groups: Sequence[Dict[str, Any]]) -> None:
    """The scheme pass (see the module docstring): raises :class:`Refused` naming why the rule's run of the class
    cannot match the class. ``make_rule`` builds a rule of its own (what it keeps per bucket is the pass's)."""
    groups = list(groups) * (2 if len(groups) == 1 else 1)
    absent = _ABSENT
    try:
        diff = _scheme_diff(make_rule, cls, ctor, groups, merged=False)
    except _ClassRaised:  # the class itself cannot step a group where a parameter has no gradient: no such step
        absent = ()
        try:
            diff = _scheme_diff(make_rule, cls, ctor, groups, merged=False, absent=absent)
        except _ClassRaised as e:
            raise Refused(f"{cls.__name__} could not be probed: stepping parameters of several shapes in two "
                          f"param groups raised {e}") from e
    if diff is None:
        return
    head = (f"{cls.__name__} cannot be offloaded faithfully: run over zero_offload's flat buffers (two param "
            f"groups of two buckets) beside the class itself, {diff}")
    if _scheme_diff(make_rule, cls, ctor, groups, merged=True, absent=absent) is None:
        raise Refused(f"{head}. With each param group in one bucket and no padding it matches: its update uses a "
                      "statistic over all the parameters of its param groups (as D-Adaptation's and Prodigy's step "
                      "size does), and zero_offload updates a group bucket by bucket, with padding between "
                      "parameters")
    raise Refused(f"{head}. Its update depends on something zero_offload does not carry: a statistic over the "
                  "parameters of all its groups, state outside its parameters' entries, its param groups, its "
                  "opt.state and its own attributes, or the parameters' shapes or their order")
