"""What the per-step host work of a bucket stepped on the GPU saves must not change what it computes
(benchmarks/parked_overhead.py times it):

* Lion's device update steps per-parameter gradients where autograd left them (no flat copy of the bucket's
  gradients): bitwise ``zero_offload.Lion`` every step, fp32 and bf16 models, under a GradScaler; the views of
  the master and ``exp_avg`` it steps are the home's, cut once (parked: into each reload's memory; resident too).
* A parked bucket's per-parameter views of its device copies are cut once and kept while those copies' memory is
  the same: after every reload they are views into the memory that reload filled (never into memory given back),
  and the device memory is given back between steps.
* A class stepped whole that keeps another shape, or another key, at a later step than the probe saw is still
  refused, with the same message, though the shapes are checked only where the class replaced a tensor.

On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py.
"""

from __future__ import annotations

from itertools import chain

import pytest
import torch

import cuda_standins
import test_park_class as park_class
import test_park_factored as park_factored
import zero_offload.rules.lion as lion_rule
from test_park_class import _homes, _same, _step_both
from zero_offload import Lion, offload
from zero_offload.state.shaped import SHAPED as SHAPED_NAME

SHAPES = park_class.SHAPES + [(130,), (3, 2, 5)]
LION_KW = dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


def _buckets(opt):
    return list(chain.from_iterable(opt._buckets))


# ------------------------------------------------------------------------------------------------------------ Lion --
def test_lion_parked_steps_the_gradients_where_autograd_left_them(cuda_branches, monkeypatch):
    """No flat copy of the bucket's gradients: the update reads each parameter's ``.grad`` itself (fp32, no scale),
    and is bitwise ``zero_offload.Lion`` every step, parameters and ``exp_avg``."""
    read = []
    single = lion_rule._single_tensor_lion

    def spy(params, grads, exp_avgs, **kw):
        read.append([g.untyped_storage().data_ptr() for g in grads])
        return single(params, grads, exp_avgs, **kw)

    monkeypatch.setattr(lion_rule, "_single_tensor_lion", spy)
    ours, theirs = park_class._params(SHAPES), park_class._params(SHAPES)
    opt = offload(Lion, park_class._groups(ours, dict(maximize=True)), placement="parked",
                  bucket_numel=park_class.BUCKET, **LION_KW)
    ref = Lion(park_class._groups(theirs, dict(maximize=True)), **LION_KW)
    assert set(_homes(opt)) == {"parked"} and len(_homes(opt)) > 2
    for step in range(4):
        read.clear()
        _step_both(ours, opt, theirs, ref, step)
        _same(ours, opt, theirs, ref, f"step {step}")
        grads = {p.grad.untyped_storage().data_ptr() for p in ours}
        assert read and all(ptr in grads for ptrs in read for ptr in ptrs), f"step {step}: a gradient was copied"
        assert sum(len(ptrs) for ptrs in read) == len(ours), step


def test_lion_parked_on_a_bf16_model_steps_its_masters_as_lion_steps_fp32_parameters(cuda_branches):
    """bf16 gradients upcast per parameter: the fp32 masters equal Lion's fp32 parameters bit for bit."""
    park_class.bf16_masters_run(Lion, park_class._params(SHAPES), park_class.BUCKET, **LION_KW)


def test_lion_parked_under_a_gradscaler_is_bitwise_lion_under_one(cuda_branches):
    """The unscale multiplies each parameter's gradient (a power of two: exact); the overflow step is skipped."""
    ours, theirs = park_class._params(), park_class._params()
    opt = offload(Lion, ours, placement="parked", bucket_numel=park_class.BUCKET, **LION_KW)
    park_class.scaled_run(ours, opt, theirs, Lion(theirs, **LION_KW), _same)


# ------------------------------------------------------------------------------------- views of the device copies --
def _into(view, twin):
    """Whether ``view`` lies inside the memory ``twin``'s storage holds now."""
    lo = twin.untyped_storage().data_ptr()
    hi = lo + twin.untyped_storage().nbytes()
    return lo <= view.data_ptr() and view.data_ptr() + view.numel() * view.element_size() <= hi


def test_a_parked_buckets_views_are_into_the_memory_each_reload_filled(cuda_branches, monkeypatch):
    """Adafactor parked: at every update the class's shaped state is views into the memory that step's reload was
    given, though the memory the last one was given is held by another tensor meanwhile (filled with NaN, which
    must stay untouched); between steps the views of a finished step reach no memory. Bitwise Adafactor every step."""
    from zero_offload.state.parked_home import ParkedHome
    from zero_offload.state.shaped import SHAPED

    seen, update = [], ParkedHome.update

    def checked(home, rule, run, hyper):
        twin = home.twins[SHAPED]
        views = [t for mine in run.shaped for t in mine.values()]
        assert views and all(_into(t, twin) for t in views), "a view outside the memory the reload filled"
        seen.append((twin.untyped_storage().data_ptr(), views))
        return update(home, rule, run, hyper)

    monkeypatch.setattr(ParkedHome, "update", checked)
    ours, theirs = park_factored._params(), park_factored._params()
    opt = offload(torch.optim.Adafactor, park_factored._groups(ours), placement="parked",
                  bucket_numel=park_factored.BUCKET)
    ref = torch.optim.Adafactor(park_factored._groups(theirs))
    blockers, addresses = [], []
    for step in range(5):
        seen.clear()
        _step_both(ours, opt, theirs, ref, step)
        park_factored._same(ours, opt, theirs, ref, f"step {step}")
        assert len(seen) == len(_buckets(opt)), step
        addresses.append([ptr for ptr, _ in seen])
        assert all(t.untyped_storage().nbytes() == 0 for _, views in seen for t in views), "memory kept"
        assert all(b.home.twins is None for b in _buckets(opt))
        assert all(torch.isnan(b).all() for b in blockers), "written into memory given back"
        # The memory just given back, taken by someone else: the next reload must be given other memory.
        blockers = [torch.full((b.home.store.shaped.flat.numel(),), float("nan")) for b in _buckets(opt)]
    moved = sum(a != b for a, b in zip(addresses, addresses[1:]))
    assert moved, "every reload was given the same memory: the test proves nothing here"


@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_lions_per_parameter_views_are_cut_once_and_follow_each_reloads_memory(cuda_branches, monkeypatch, placement):
    """Lion on the GPU (parked, resident): the per-parameter views of the master and ``exp_avg`` its update steps
    were cut from the flat run at every update of every bucket; now they are the home's, the same tensors from step
    to step, and, parked, views into the memory each reload filled (the memory the last one was given held by
    another tensor meanwhile, filled with NaN, which must stay untouched), none left between steps. Bitwise
    ``zero_offload.Lion`` every step."""
    seen, update, addresses, problems = [], lion_rule.Lion.update_on_device, [], []

    def checked(rule, run, hyper):
        # (what is wrong is noted, not raised here: a failure's traceback would print this frame's tensors once
        # their memory is given back)
        home, views = run.slots.owner.home, getattr(run, "views", None)
        if views is None:
            problems.append("the views were not the home's")
            return update(rule, run, hyper)
        twins = getattr(home, "twins", None)
        if twins is not None:
            inside = [_into(t, twins[name]) for name in ("exp_avg", "master") if name in twins for t in views[name]]
            if not all(inside):
                problems.append("a view outside the memory the reload filled")
            addresses.append(twins["exp_avg"].untyped_storage().data_ptr())
        seen.append((home, [*views["master"], *views["exp_avg"]]))
        return update(rule, run, hyper)

    monkeypatch.setattr(lion_rule.Lion, "update_on_device", checked)
    ours, theirs = park_class._params(SHAPES), park_class._params(SHAPES)
    opt = offload(Lion, park_class._groups(ours, dict(maximize=True)), placement=placement,
                  bucket_numel=park_class.BUCKET, **LION_KW)
    ref = Lion(park_class._groups(theirs, dict(maximize=True)), **LION_KW)
    assert set(_homes(opt)) == {placement} and len(_homes(opt)) > 2
    first, blockers = None, []
    for step in range(5):
        seen.clear()
        _step_both(ours, opt, theirs, ref, step)
        assert not problems, (step, problems)
        _same(ours, opt, theirs, ref, f"step {step}")
        assert len(seen) == len(_buckets(opt)), step
        views = {home: ts for home, ts in seen}
        if first is not None:
            assert all(len(ts) == len(first[home]) and all(map(lambda a, b: a is b, ts, first[home]))
                       for home, ts in views.items()), f"step {step}: views cut anew"
        first = views
        if placement == "parked":
            assert all(b.home.twins is None for b in _buckets(opt))
            assert all(torch.isnan(b).all() for b in blockers), "written into memory given back"
            blockers = [torch.full((b.home.store.flat["exp_avg"].numel(),), float("nan")) for b in _buckets(opt)]
    if placement == "parked":
        n = len(_buckets(opt))
        steps = [addresses[k:k + n] for k in range(0, len(addresses), n)]
        assert any(a != b for a, b in zip(steps, steps[1:])), "every reload was given the same memory: proves nothing"


class _Factored(torch.optim.Optimizer):
    """A class stepped whole keeping, per matrix, a column factor ``col`` (1, n) of its squared gradients and, with
    ``rows`` set, a row factor ``row`` (m, 1) too (made zero where it is first needed)."""

    def __init__(self, params, lr=0.01, rows=False):
        super().__init__(params, dict(lr=lr, rows=rows))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state, g = self.state[p], p.grad
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["col"] = torch.zeros((1, p.shape[1]), device=p.device)
                state["step"] += 1
                state["col"].mul_(0.9).add_(g.square().mean(0, keepdim=True), alpha=0.1)
                update = g / (state["col"].sqrt() + 1e-3)
                if group["rows"]:
                    if "row" not in state:
                        state["row"] = torch.zeros((p.shape[0], 1), device=p.device)
                    state["row"].mul_(0.8).add_(g.square().mean(1, keepdim=True), alpha=0.2)
                    update = update / (state["row"].sqrt() + 1.0)
                p.add_(update, alpha=-group["lr"])


def test_a_layout_redone_while_the_state_is_up_gives_views_into_the_new_copy(cuda_branches):
    """``rows`` switched on after backward brought the state up: the bucket's shaped buffer is laid out again
    mid-step (its device copy made anew, the values up kept); the class must be handed views of that copy, in the
    new layout, not the views cut of the last one. Bitwise the class every step, before and after."""
    shapes = [(5, 7), (3, 13), (6, 17), (4, 4), (9, 2)]
    ours, theirs = park_class._params(shapes), park_class._params(shapes)
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "rows": True}]  # noqa: E731
    opt = offload(_Factored, groups(ours), placement="parked", bucket_numel=park_class.BUCKET)
    ref = _Factored(groups(theirs))
    first = [b for b in _buckets(opt) if b.group == 0]
    for step in range(5):
        if step == 2:
            for o in (opt, ref):
                o.zero_grad()
            park_class._backward(ours, step)
            park_class._backward(theirs, step)
            assert all(b.home.twins is not None for b in first), "not brought up in backward"
            before = [b.home.twins[SHAPED_NAME] for b in first]
            for o in (opt, ref):
                o.param_groups[0]["rows"] = True
            opt.step()
            ref.step()
            assert all("row" in b.home.store.shaped.names for b in first)
        else:
            _step_both(ours, opt, theirs, ref, step)
        _same(ours, opt, theirs, ref, f"step {step}")
    assert all(b.home._held[SHAPED_NAME] is not t for b, t in zip(first, before)), "the copy was not made anew"


# ------------------------------------------------------------------------------- what a class keeps, checked later --
class _Later(torch.optim.Adafactor):
    """Adafactor that, once ``later`` is set, keeps a matrix's ``row_var`` full-size (``"shape"``) or keeps one more
    key (``"key"``): what the probe saw on its stand-ins no longer holds."""

    later = ""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if type(self).later == "shape" and "row_var" in state:
                    state["row_var"] = torch.zeros(p.shape, device=p.device)
                elif type(self).later == "key":
                    state["extra"] = torch.zeros_like(p)
        return out


@pytest.mark.parametrize("later,message", [
    ("shape", "_Later kept 'row_var' of shape (5, 7) for a parameter of shape (5, 7), not (5, 1) as the probe found"),
    ("key", "_Later kept ['extra'] for a parameter of shape"),
])
def test_a_class_that_changes_what_it_keeps_later_is_still_refused(cuda_branches, monkeypatch, later, message):
    """Checked only where the class put another tensor in place of ours (cheap where it did not), the guarantee
    holds at every step: a later state shape or key the probe did not find is refused, naming it."""
    ours, theirs = park_class._params([(7,), (5, 7)]), park_class._params([(7,), (5, 7)])
    opt = offload(_Later, ours, placement="parked")
    ref = torch.optim.Adafactor(theirs)
    for step in range(3):
        _step_both(ours, opt, theirs, ref, step)
        park_factored._same(ours, opt, theirs, ref, f"step {step}")
    monkeypatch.setattr(_Later, "later", later)
    with pytest.raises(RuntimeError) as info:
        _step_both(ours, opt, theirs, ref, 3)
    assert str(info.value).startswith(message), str(info.value)
