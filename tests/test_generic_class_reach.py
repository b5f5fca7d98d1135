"""Issue 54: what a wrapped class reaches beyond one parameter's state, run through ``zero_offload.offload(cls, ...)``
against the class itself (every step, parameters and state), or refused naming the real reason with nothing
changed:

* the loss its ``step(closure)`` gets from the closure (a step size scaled by the loss): the class's own code is
  fed the loss the closure returned; a class that calls the closure more than once a step is refused;
* keys its constructor adds to each param group (Lookahead's ``k``, ``alpha``, ``counter``): in our
  ``param_groups`` and ``state_dict()``, loading both ways;
* a sum over all its parameters (D-Adaptation's ``d``): refused, as its update of one parameter depends on others;
* state outside the optimizer (a class attribute counting steps): refused as such, not as random draws.
"""

from __future__ import annotations

import copy

import pytest
import torch

from class_runs import check_class
from zero_offload import offload
from zero_offload.rules.torch_class import Refused


# ------------------------------------------------------------------------------------------ the closure's loss --
class LossScaledSGD(torch.optim.Optimizer):
    """Momentum SGD whose step size is scaled by the loss its closure returns (1 without a closure)."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            _momentum_step(self, group, 1.0 if loss is None else float(loss))
        return loss


def _closure_loss(closure):
    """The closure's loss, run as torch's optimizers run it (None without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _momentum_step(opt, group, scale):
    """Momentum SGD on ``group``'s parameters, the step size times ``scale``."""
    for p in group["params"]:
        if p.grad is None:
            continue
        buf = opt.state[p].setdefault("buf", torch.zeros_like(p))
        buf.mul_(group["momentum"]).add_(p.grad)
        p.add_(buf, alpha=-group["lr"] * scale)


class TwiceClosure(torch.optim.SGD):
    """SGD that evaluates its closure twice a step (as a line search or SAM re-evaluates the model)."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
                closure()
        return super().step()


def _models(seed=0):
    torch.manual_seed(seed)
    ours = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return ours, copy.deepcopy(ours)


def _closure(model, opt, x, y):
    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss
    return closure


def test_a_class_that_uses_its_closures_loss_steps_as_the_class_every_step():
    model, ref_model = _models()
    ours = offload(LossScaledSGD, [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.02}],
                   bucket_numel=16)
    ref = LossScaledSGD([{"params": ref_model[0].parameters()}, {"params": ref_model[2].parameters(), "lr": 0.02}])
    for step in range(12):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        if step % 4 == 3:  # without a closure too: the class's own step() without one
            for m, opt in ((model, ours), (ref_model, ref)):
                _closure(m, opt, x, y)()
            assert ours.step() is None and ref.step() is None
        else:
            mine, theirs = ours.step(_closure(model, ours, x, y)), ref.step(_closure(ref_model, ref, x, y))
            torch.testing.assert_close(mine, theirs)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step}: {m}")
            torch.testing.assert_close(ours.state[p]["buf"], ref.state[q]["buf"])


def test_a_class_using_its_closures_loss_is_refused_where_the_update_runs_before_the_loss_is_known():
    model, _ = _models()
    with pytest.raises(ValueError, match="LossScaledSGD.*uses the loss its closure returns.*delayed_update"):
        offload(LossScaledSGD, model.parameters(), delayed_update=True)


def test_a_class_that_calls_its_closure_twice_a_step_is_refused_naming_it():
    model, _ = _models()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Refused, match="TwiceClosure cannot be offloaded: its step\\(\\) calls its closure 2 times"):
        offload(TwiceClosure, model.parameters(), lr=0.1)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


class PerGroupLossTrend(torch.optim.Optimizer):
    """Momentum SGD whose step size follows the trend of the loss: an average of it in ``opt.state`` (no
    parameter's), moved once per param group (as pytorch_optimizer's EmoNavi does), so a second group sees it moved
    twice a step. Offloaded, each bucket's instance has one group: with a closure it cannot match the class."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        loss = None if loss is None else float(loss)
        for group in self.param_groups:
            scale = 1.0
            if loss is not None:
                avg = self.state["avg"] = 0.5 * self.state.get("avg", loss) + 0.5 * loss
                scale = min(2.0, loss / avg)
            _momentum_step(self, group, scale)
        return loss


def test_a_class_whose_closure_run_cannot_match_is_accepted_and_its_step_with_a_closure_refused():
    outcome = check_class(PerGroupLossTrend)  # (without a closure: equal, checkpoints both ways)
    assert outcome.status == "equal", outcome
    model, _ = _models()
    opt = offload(PerGroupLossTrend, [{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    _closure(model, opt, x, y)()
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    called = []
    with pytest.raises(ValueError, match=r"PerGroupLossTrend: step\(closure\) is refused: its update uses the loss "
                                         r"its closure returns, and, run with closures, .* does not match"):
        opt.step(lambda: called.append(1))
    assert not called and all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.step()  # and it goes on without one


# -------------------------------------------------------------------------- keys its constructor adds to groups --
class LookaheadSGD(torch.optim.Optimizer):
    """Momentum SGD with Lookahead's slow weights; its constructor adds ``k``, ``alpha`` and ``counter`` to each
    param group, and its step counts ``counter`` there."""

    def __init__(self, params, lr=0.05, momentum=0.9, k=3, alpha=0.5):
        super().__init__(params, dict(lr=lr, momentum=momentum))
        for group in self.param_groups:
            group.setdefault("k", k)
            group.setdefault("alpha", alpha)
            group["counter"] = 0

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["counter"] += 1
            sync = group["counter"] % group["k"] == 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"], state["slow"] = torch.zeros_like(p), p.detach().clone()
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])
                if sync:
                    state["slow"].lerp_(p, group["alpha"])
                    p.copy_(state["slow"])


def test_keys_the_constructor_adds_to_param_groups_are_ours_and_load_both_ways():
    outcome = check_class(LookaheadSGD)  # 30 steps, then checkpoints both ways
    assert outcome.status == "equal", outcome
    outcome = check_class(LookaheadSGD, k=4, alpha=0.25)
    assert outcome.status == "equal", outcome


def test_a_checkpoint_of_ours_before_any_step_loads_into_the_class():
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3, 2))]
    ours = offload(LookaheadSGD, [{"params": params[:1]}, {"params": params[1:], "k": 2}])
    ref = LookaheadSGD([{"params": [torch.nn.Parameter(p.detach().clone())]} for p in params])
    assert [(g["k"], g["alpha"], g["counter"]) for g in ours.param_groups] == [(3, 0.5, 0), (2, 0.5, 0)]
    ref.load_state_dict(ours.state_dict())
    for p, q in zip(params, [g["params"][0] for g in ref.param_groups]):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    ours.step()
    ref.step()
    for p, q in zip(params, [g["params"][0] for g in ref.param_groups]):
        torch.testing.assert_close(p, q)
    assert [g["counter"] for g in ours.state_dict()["param_groups"]] == [1, 1]


# ---------------------------------------------------------------------------------- a sum over all parameters --
class DAdaptLike(torch.optim.Optimizer):
    """D-Adaptation-style momentum SGD: a step size ``d`` (kept in the first param group) that grows, by at most
    ``growth_rate`` a step, with sums over every parameter of every group, and scales every parameter's update. At
    its defaults ``d`` stays near ``d0`` for many steps, so an offloaded run (one ``d`` per bucket) stays within
    float32's tolerance of the class for a while; it is still not the class's update."""

    def __init__(self, params, lr=1.0, d0=1e-6, growth_rate=1.001, momentum=0.9):
        super().__init__(params, dict(lr=lr, d0=d0, growth_rate=growth_rate, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        first = self.param_groups[0]
        d = first.setdefault("d", first["d0"])
        numerator, denominator = 0.0, 0.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["s"], state["buf"] = torch.zeros_like(p), torch.zeros_like(p)
                numerator += float(torch.dot(p.grad.flatten(), state["s"].flatten()))
                state["s"].add_(p.grad, alpha=d * group["lr"])
                denominator += float(state["s"].abs().sum())
        if denominator > 0:
            first["d"] = d = min(d * first["growth_rate"], max(d, d + d * numerator / denominator))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p]["buf"]
                    buf.mul_(group["momentum"]).add_(p.grad)
                    p.add_(buf, alpha=-d * group["lr"])


def test_a_class_that_sums_over_all_its_parameters_is_refused_naming_it():
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Refused, match=r"DAdaptLike cannot be offloaded faithfully: its update of one parameter "
                                      r"depends on other parameters \(a sum over all parameters"):
        offload(DAdaptLike, model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def test_d_adaptation_in_one_param_group_is_refused_though_random_gradients_leave_its_d_alone():
    """pytorch_optimizer's DAdaptAdaGrad keeps ``d`` at ``d0`` under gradients that change direction every step, so
    a probe with random gradients sees no dependence; under a steady gradient (as in training) ``d`` grows, and an
    offloaded run in one group drifted from the class (1.2e-5 by step 15, 5.8e-4 by step 40)."""
    po = pytest.importorskip("pytorch_optimizer")
    model = torch.nn.Linear(4, 3)
    with pytest.raises(Refused, match="DAdaptAdaGrad cannot be offloaded faithfully: its update of one parameter "
                                      "depends on other parameters"):
        offload(po.DAdaptAdaGrad, model.parameters())


# ----------------------------------------------------------------------------- state outside the optimizer --
class ClassCountedSGD(torch.optim.Optimizer):
    """SGD whose step size decays with a count kept on the class (shared by every instance, never reset)."""

    calls = 0

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        type(self).calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] / type(self).calls ** 0.5)


class NoisySGD(torch.optim.SGD):
    """SGD with gradient noise from torch's global generator."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(torch.randn_like(p.grad), alpha=0.01)
        return super().step()


def test_a_class_counting_steps_outside_the_optimizer_is_refused_as_such_not_as_random():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(Refused, match="ClassCountedSGD cannot be offloaded faithfully: .*replay .*identical "
                                      ".*without drawing random numbers.*outside the optimizer") as info:
        offload(ClassCountedSGD, model.parameters())
    assert "it draws random numbers" not in str(info.value)
    with pytest.raises(Refused, match="NoisySGD cannot be offloaded faithfully: .*it draws random numbers"):
        offload(NoisySGD, model.parameters(), lr=0.1)
