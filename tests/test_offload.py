"""``zero_offload.offload(optimizer_class, ...)`` end to end: each rule through the whole machinery (flat buckets,
runs split by step count, clipping, accumulation, GradScaler, LR schedulers, a param group added mid-run) against
the wrapped class with ``foreach=False`` on a copy of the model (``zero_offload.Lion(foreach=False)`` for Lion),
params and every state tensor compared after every step at default tolerance; on the CPU and with streamed
gradients through the CUDA stand-ins (tests/cuda_standins.py); state dicts in the class's own format, loaded in
both directions mid-run; sharded at gloo world 2 (tests/test_distributed.py's harness); refusals.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Any, Dict

import pytest
import torch

import cuda_standins
import test_distributed as td
from test_optimizer import Recipe, Run, TinyTransformer, loss_fn, param_groups
import zero_offload
from zero_offload import Lion, OffloadOptimizer, offload

O = torch.optim
STEPS = 16

# (class, hyperparameters given to both): the Lion rule, the generic rule over torch's classes, and Adam(W) (the
# fused kernel, an OffloadOptimizer).
CASES = [
    (Lion, dict(lr=1e-3, weight_decay=0.1)),
    (Lion, dict(lr=3e-4, betas=(0.95, 0.98), maximize=True)),
    (O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (O.SGD, dict(lr=0.05, momentum=0.8, dampening=0.2)),
    (O.SGD, dict(lr=0.05)),
    (O.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    (O.RMSprop, dict(lr=0.005, momentum=0.5, centered=True)),
    (O.RMSprop, dict(lr=0.005, foreach=True)),
    (O.Adamax, dict(lr=0.01)),
    (O.RAdam, dict(lr=0.01, decoupled_weight_decay=True)),
    (O.Adadelta, dict(lr=0.5)),
    (O.Rprop, dict(lr=0.001)),
    (O.Adam, dict(lr=0.01, fused=True)),
    (O.Adam, dict(lr=0.01)),
    (O.AdamW, dict(lr=0.01, amsgrad=True)),
]
RECIPES = [
    Recipe("plain"),
    Recipe("clip", clip=0.5),
    Recipe("accumulate", accumulate=3, clip=1.0),
    Recipe("scaler", scaler="step", inf_at=7),
    Recipe("scheduler", scheduler=lambda o: O.lr_scheduler.SequentialLR(
        o, [O.lr_scheduler.LinearLR(o, 0.1, total_iters=5), O.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)],
        milestones=[5])),
    Recipe("add_param_group", add_group_at=6),
]


def _id(case):
    cls, kw = case
    return cls.__name__ + "".join(f"-{k}={v}" for k, v in kw.items())


def _reference(cls, groups, **kw):
    return cls(groups, foreach=False, **{k: v for k, v in kw.items() if k not in ("foreach", "fused")})


def _runs(case, recipe: Recipe, **ours_kw):
    cls, kw = case
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    which = (0,) if recipe.add_group_at is not None else (0, 1)
    ours = offload(cls, param_groups(model, which), **kw, **ours_kw)
    ref = _reference(cls, param_groups(ref_model, which), **kw)
    return Run(recipe, model, ours, "cpu", True), Run(recipe, ref_model, ref, "cpu", False)


# Centered RMSprop's denominator sqrt(v - m^2) cancels: the clip coefficient's float rounding (ours from a norm
# accumulated in double, torch's in float, see test_optimizer) is amplified to a few 1e-6 relative in its state.
LOOSE = dict(rtol=2e-5, atol=1e-4)


def _loose(case, recipe) -> bool:
    return case[1].get("centered", False) and recipe.clip is not None


def _same(model, ref_model, ours, ref, where, tol=None):
    """test_optimizer.assert_same (``tol``: a documented looser tolerance), except that an entry torch's Adagrad
    creates at construction (step 0, ``sum`` at ``initial_accumulator_value``) is expected where the parameter has
    stepped only, or where ours loaded it from torch's (docs/other-optimizers.md)."""
    eager = {q for q, e in ref.state.items() if "step" in e and float(e["step"]) == 0}
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{where}, param {name}: {m}", **(tol or {}))
        expected = {} if q in eager and p not in ours.state else ref.state.get(q, {})
        actual = ours.state.get(p, {})
        assert set(actual) - {"master"} == set(expected), f"{where}, {name}: keys {set(actual)} vs {set(expected)}"
        for key, value in expected.items():
            assert actual[key].device.type == "cpu", f"{where}, {name}: {key} left the host"
            torch.testing.assert_close(actual[key], value, msg=lambda m: f"{where}, {name}, {key}: {m}",
                                       **(tol or {}))


def _trajectory(case, recipe, **ours_kw):
    ours, ref = _runs(case, recipe, **ours_kw)
    for step in range(STEPS):
        ours.step(step)
        ref.step(step)
        _same(ours.model, ref.model, ours.opt, ref.opt, f"{_id(case)} {recipe.name} step {step}",
              LOOSE if _loose(case, recipe) else None)
        for g_ours, g_ref in zip(ours.opt.param_groups, ref.opt.param_groups):
            assert g_ours["lr"] == g_ref["lr"]
    if recipe.inf_at is not None:
        assert ours.opt.skipped_steps == 1
    return ours, ref


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("case", CASES, ids=map(_id, CASES))
def test_offload_matches_the_class_every_step(case, recipe):
    _trajectory(case, recipe)


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


STREAMED = [(case, recipe, release) for case in (CASES[0], CASES[2], CASES[5], CASES[6])
            for recipe in (RECIPES[1], RECIPES[2], RECIPES[3]) for release in (False, True)
            if not (release and recipe.scaler)]  # (release_grads refuses a GradScaler)


@pytest.mark.parametrize("case,recipe,release", STREAMED,
                         ids=[f"{_id(c)}-{r.name}{'-release' if rel else ''}" for c, r, rel in STREAMED])
def test_offload_streamed_cuda_branches(cuda_branches, case, recipe, release):
    # (the host route, gradients streamed to it: the default, "auto", would place the buckets after the second step;
    # the other homes: test_park_class.py)
    _trajectory(case, recipe, release_grads=release, placement="host")


def _groups(sd):
    """A state dict's param groups but for the implementation flags (the reference runs with foreach=False)."""
    return [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in sd["param_groups"]]


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[5], CASES[6], CASES[11]],
                         ids=map(_id, [CASES[0], CASES[2], CASES[3], CASES[5], CASES[6], CASES[11]]))
def test_offload_state_dict_is_the_class_format_both_ways(case):
    """Mid-run: the plain class loads ours and goes on as the reference does; ours loads the plain class's."""
    cls, kw = case
    recipe = Recipe("plain")
    ours, ref = _runs(case, recipe)
    for step in range(5):
        ours.step(step)
        ref.step(step)
    sd_ours, sd_ref = _roundtrip(ours.opt.state_dict()), _roundtrip(ref.opt.state_dict())
    assert _groups(sd_ours) == _groups(sd_ref)
    eager = {i for i, e in sd_ref["state"].items() if "step" in e and float(e["step"]) == 0}  # (Adagrad's)
    assert sd_ours["state"].keys() == sd_ref["state"].keys() - eager
    for i, state in [(i, e) for i, e in sd_ref["state"].items() if i not in eager]:
        assert sd_ours["state"][i].keys() == state.keys()
    # the plain class, loaded from ours
    plain_model = copy.deepcopy(ref.model)
    plain = Run(recipe, plain_model, _reference(cls, param_groups(plain_model), **kw), "cpu", False)
    plain.opt.load_state_dict(sd_ours)
    # ours, loaded from the plain class
    torch.manual_seed(1)
    back_model = copy.deepcopy(ref.model)
    back = Run(recipe, back_model, offload(cls, param_groups(back_model), **kw), "cpu", True)
    back.opt.load_state_dict(sd_ref)
    for step in range(5, 10):
        for run in (ref, plain, back):
            run.step(step)
        _same(back.model, ref.model, back.opt, ref.opt, f"ours loaded from {cls.__name__}, step {step}")
        _same(plain.model, ref.model, plain.opt, ref.opt, f"{cls.__name__} loaded from ours, step {step}")


def test_offload_adam_and_adamw_are_offload_optimizers_with_the_class_defaults():
    p = [torch.nn.Parameter(torch.zeros(3))]
    adam = offload(O.Adam, p)
    assert type(adam) is OffloadOptimizer
    assert adam.defaults["weight_decay"] == 0 and adam.defaults["decoupled_weight_decay"] is False
    assert offload(O.AdamW, [torch.nn.Parameter(torch.zeros(3))]).defaults["weight_decay"] == 0.01
    sgd = offload(O.SGD, [torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    assert isinstance(sgd, OffloadOptimizer)
    assert sgd.defaults == O.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9).defaults
    lion = offload(Lion, [torch.nn.Parameter(torch.zeros(3))], state_dtype=torch.bfloat16)
    assert lion.defaults == Lion([torch.nn.Parameter(torch.zeros(1))]).defaults


@pytest.mark.parametrize("cls,kw,error,match", [
    (O.LBFGS, {}, ValueError, "LBFGS cannot be offloaded: its step\\(\\) needs a closure"),
    (O.SparseAdam, {}, ValueError, "SparseAdam cannot be offloaded"),
    (O.Adafactor, {}, ValueError, "Adafactor is not elementwise: its state 'row_var'"),
    (O.NAdam, {}, ValueError, "NAdam keeps a per-parameter scalar 'mu_product'"),
    (O.SGD, dict(lr=0.1, differentiable=True), ValueError, "differentiable=True is refused"),
    (O.SGD, dict(lr=0.1, momentum=-1.0), ValueError, "Invalid momentum value: -1.0"),
    (O.SGD, dict(lr=0.1, betas=(0.9, 0.99)), TypeError, "betas"),
    (O.SGD, dict(lr=0.1, momentum=0.9, state_dtype=torch.bfloat16), ValueError, "state_dtype"),
    (Lion, dict(state_dtype=torch.int8), ValueError, "state_dtype"),
    (torch.nn.Linear, {}, TypeError, "torch.optim.Optimizer subclass"),
])
def test_offload_refusals(cls, kw, error, match):
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        offload(cls, model.parameters(), **kw)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_offload_a_group_that_needs_state_the_optimizer_was_not_built_with():
    model = torch.nn.Linear(3, 2)
    opt = offload(O.SGD, [{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    opt.param_groups[1]["momentum"] = 0.9  # no group was built with momentum: no momentum_buffer declared
    model(torch.ones(1, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "momentum": 0.5})


# ------------------------------------------------------------------------------------------ sharded, gloo --
def _sharded_worker(rank, world, cls_name, kw):
    cls = Lion if cls_name == "Lion" else getattr(O, cls_name)
    model, ref_model = td._make(rank, seed_ours=rank)
    opt = offload(cls, td.groups(model), bucket_numel=td.BUCKET_NUMEL, process_group=td.dist.group.WORLD,
                  timeout=30, **kw)
    ref = _reference(cls, td.groups(ref_model), **kw)
    for step in range(10):
        td._step(model, opt, step, rank, world, clip=0.5 if step % 2 else None)
        td._ref_step(ref_model, ref, step, clip=0.5 if step % 2 else None)
        td._compare(model, ref_model, f"{cls_name} step {step}")
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert _groups(sd) == _groups(rsd)
    for k, expected in rsd["state"].items():
        if float(expected.get("step", 1)) == 0:  # torch's Adagrad: an entry before the first step
            assert k not in sd["state"]
            continue
        assert sd["state"][k].keys() == expected.keys(), (k, sd["state"][k].keys(), expected.keys())
        for key, value in expected.items():
            torch.testing.assert_close(sd["state"][k][key], value, msg=lambda m: f"state {k} {key}: {m}")
    return True


@pytest.mark.parametrize("cls_name,kw", [("Lion", dict(lr=1e-3, weight_decay=0.1)),
                                         ("SGD", dict(lr=0.02, momentum=0.9)),
                                         ("Adagrad", dict(lr=0.05))])
def test_offload_sharded_world_2_matches_the_class_on_the_whole_batch(cls_name, kw):
    assert td.launch(_sharded_worker, 2, cls_name, kw, timeout=120) == {0: True, 1: True}


class RoundedLion(Lion):
    """zero_offload.Lion with ``exp_avg`` rounded to bf16 after every step: what bf16 state stores."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        for state in self.state.values():
            state["exp_avg"].copy_(state["exp_avg"].bfloat16())


@pytest.mark.parametrize("recipe", [RECIPES[0], RECIPES[2]], ids=lambda r: r.name)
def test_offload_lion_bf16_state_is_lion_with_its_momentum_rounded(recipe):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    kw = dict(lr=1e-3, weight_decay=0.1)
    ours = Run(recipe, model, offload(Lion, param_groups(model), state_dtype=torch.bfloat16, **kw), "cpu", True)
    ref = Run(recipe, ref_model, RoundedLion(param_groups(ref_model), foreach=False, **kw), "cpu", False)
    for step in range(STEPS):
        ours.step(step)
        ref.step(step)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step}, {name}: {m}")
            assert "exp_avg" not in ours.opt.state.get(p, {})  # compact state: not an fp32 tensor anywhere
    sd, rsd = ours.opt.state_dict(), ref.opt.state_dict()
    assert sd["state"].keys() == rsd["state"].keys()
    for k, expected in rsd["state"].items():
        assert sd["state"][k].keys() == {"exp_avg"}
        torch.testing.assert_close(sd["state"][k]["exp_avg"], expected["exp_avg"], rtol=0, atol=0)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=map(_id, [CASES[0], CASES[2], CASES[5]]))
def test_offload_delayed_update_is_the_class_one_step_late(case):
    """delayed_update: step t applies the gradients of step t-1 (tests/test_grad_stream.py's LateAdamW, with the
    wrapped class); parameters every step, the whole state once flushed."""
    cls, kw = case
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = offload(cls, model.parameters(), delayed_update=True, **kw)
    ref = _reference(cls, ref_model.parameters(), **kw)
    prev = None
    for step in range(8):
        ours.zero_grad()
        ref.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        loss_fn(ref_model, step, 0, "cpu").backward()
        grads = [None if q.grad is None else q.grad.clone() for q in ref_model.parameters()]
        if prev is not None:
            for q, g in zip(ref_model.parameters(), prev):
                q.grad = g
            ref.step()
        prev = grads
        ours.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step}, {name}: {m}")
    ours.flush()
    for q, g in zip(ref_model.parameters(), prev):
        q.grad = g
    ref.step()
    _same(model, ref_model, ours, ref, "after flush")
