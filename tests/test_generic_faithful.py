"""Issue 36, section 1: ``zero_offload.offload(cls, ...)`` runs a class it accepts exactly as the class itself, or
refuses it naming why. Each cause the issue found has a small class here that shows it (no third-party package
needed; tests/test_third_party_optimizers.py runs whole collections), run through tests/class_runs.py against the
class itself: two param groups, several buckets, 30 steps at float32's default tolerance with the updates judged
relative to their size, ``maximize=True`` where the class takes it, then checkpoints both ways.

* state the class keeps beyond its per-parameter entries (a step count in its param group, an attribute its
  ``step()`` counts, an entry of ``opt.state`` that is no parameter's) goes on from step to step and is saved;
* constructor flags the class keeps on itself, not in ``defaults``, are honoured;
* the probe clones the gradients it hands out (a class that edits ``p.grad`` in place), runs many steps (state that
  appears late) and several groups and buckets (a statistic over a whole group);
* a class whose ``lr`` has no default, a Muon-style class, a dict-valued or (sharded) string-valued setting;
* refusals leave the model, the optimizer and a checkpoint being loaded as they were.
"""

from __future__ import annotations

import math

import pytest
import torch

import test_distributed as td
from class_runs import check_class
from zero_offload import offload
from zero_offload.rules.torch_class import NotElementwise, Refused


def _equal(cls, **kw):
    for extra in ({}, dict(maximize=True)) if "maximize" in cls.__init__.__code__.co_varnames else ({},):
        outcome = check_class(cls, **kw, **extra)
        assert outcome.status == "equal", (extra, outcome)


# ------------------------------------------------------------------------------------ state kept elsewhere --
class GroupStepAdam(torch.optim.Optimizer):
    """Adam whose step count lives in its param group and whose ``maximize`` lives on the instance, as in
    pytorch_optimizer's classes (its defaults hold neither)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, maximize=False):
        self.maximize = maximize
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if self.maximize else p.grad
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].lerp_(g, 1 - b1)
                state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (state["v"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["m"], denom, value=-group["lr"] / (1 - b1 ** t))


class CountingSGD(torch.optim.SGD):
    """SGD whose subclass ``step()`` counts its calls on the instance and scales the gradients by it."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, lr=lr, momentum=momentum)
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.0 / math.sqrt(self.calls))
        return super().step(closure)


class GlobalCountSGD(torch.optim.Optimizer):
    """Momentum SGD whose step count is an entry of ``opt.state`` that is no parameter's (MADGRAD's ``k``)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        if "k" not in self.state:
            self.state["k"] = torch.tensor([0], dtype=torch.long)
        scale = math.sqrt(float(self.state["k"]) + 1)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"] / scale)
        self.state["k"].add_(1)


@pytest.mark.parametrize("cls", [GroupStepAdam, CountingSGD, GlobalCountSGD])
def test_state_the_class_keeps_beyond_its_parameters_goes_on_and_is_saved(cls):
    _equal(cls)


def test_the_class_keys_of_a_param_group_and_global_entries_are_in_the_state_dict():
    params = [torch.nn.Parameter(torch.randn(5))]
    opt = offload(GroupStepAdam, [{"params": params}])
    glob = offload(GlobalCountSGD, [torch.nn.Parameter(torch.randn(3))])
    for _ in range(3):
        params[0].grad = torch.randn(5)
        opt.step()
        glob.param_groups[0]["params"][0].grad = torch.randn(3)
        glob.step()
    assert opt.param_groups[0]["step"] == 3 and opt.state_dict()["param_groups"][0]["step"] == 3
    assert int(glob.state_dict()["state"]["k"]) == 3 and "k" not in glob.state


# ----------------------------------------------------------------------------------------- flags and errors --
class NoDefaultLr(torch.optim.Optimizer):
    """``lr`` without a default; ``nesterov`` kept on the instance only."""

    def __init__(self, params, lr, momentum=0.5, nesterov=False):
        self.nesterov = nesterov
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(p.grad.add(buf, alpha=group["momentum"]) if self.nesterov else buf, alpha=-group["lr"])


def test_a_class_without_a_default_lr_takes_the_lr_given_and_flags_on_the_instance_are_honoured():
    _equal(NoDefaultLr, lr=0.05)
    _equal(NoDefaultLr, lr=0.05, nesterov=True)
    with pytest.raises(TypeError, match="NoDefaultLr needs an argument that was not given.*lr"):
        offload(NoDefaultLr, [torch.nn.Parameter(torch.zeros(2))])


class DictSchedule(torch.optim.Optimizer):
    """SGD with a dict-valued setting (a warm-up schedule) and a string-valued one (``mode``)."""

    def __init__(self, params, lr=0.1, schedule=None, mode="sign"):
        super().__init__(params, dict(lr=lr, schedule=schedule or {"warmup": 3}, mode=mode))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["step"] = state.get("step", 0) + 1
                scale = min(1.0, state["step"] / group["schedule"]["warmup"])
                update = p.grad.sign() if group["mode"] == "sign" else p.grad
                p.add_(update, alpha=-group["lr"] * scale)


class StringMode(torch.optim.Optimizer):
    """Momentum SGD with a string-valued setting only (what the ranks of a process group must agree on)."""

    def __init__(self, params, lr=0.05, mode="sign"):
        super().__init__(params, dict(lr=lr, mode=mode))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad.sign() if group["mode"] == "sign" else p.grad)
                    p.add_(buf, alpha=-group["lr"])


def test_dict_and_string_valued_settings():
    _equal(DictSchedule)
    _equal(DictSchedule, schedule={"warmup": 5}, mode="plain")


class MuonStyle(torch.optim.Optimizer):
    """Takes only parameter groups flagged ``use_muon`` (as Muon and its variants do: a plain list of tensors fails
    its ``'use_muon' in group`` with torch's ``Tensor.__contains__`` error), orthogonalising 2-D momentum."""

    def __init__(self, params, lr=0.02):
        params = list(params)
        for group in params:
            if "use_muon" not in group:
                raise ValueError("`use_muon` must be set.")
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                if group["use_muon"]:
                    u, _, v = torch.linalg.svd(buf.view(p.shape[0], -1), full_matrices=False)
                    p.add_((u @ v).view_as(p), alpha=-group["lr"])
                else:
                    p.add_(buf, alpha=-group["lr"])


def test_muon_style_classes_are_refused_with_a_reason():
    w = torch.nn.Parameter(torch.randn(4, 6))
    with pytest.raises(Refused, match="MuonStyle cannot be offloaded: .*plain float32 tensors.*Tensor.__contains__"):
        offload(MuonStyle, [w])
    with pytest.raises(NotElementwise, match="MuonStyle is not elementwise"):
        offload(MuonStyle, [dict(params=[w], use_muon=True)])


def test_muon_style_groups_without_orthogonalisation_are_accepted():
    from class_runs import _params  # the harness's parameters, in one group flagged use_muon=False

    ours_params, ref_params = _params(0), _params(0)
    ours = offload(MuonStyle, [dict(params=sum(ours_params, []), use_muon=False)], bucket_numel=64)
    ref = MuonStyle([dict(params=sum(ref_params, []), use_muon=False)])
    for step in range(10):
        gen = torch.Generator().manual_seed(step)
        for p, q in zip(sum(ours_params, []), sum(ref_params, [])):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = q.grad.clone()
        ours.step()
        ref.step()
        for p, q in zip(sum(ours_params, []), sum(ref_params, [])):
            torch.testing.assert_close(p, q)


# ------------------------------------------------------------------------------------------------ the probe --
class CentralisedSGD(torch.optim.SGD):
    """SGD with gradient centralisation done in place on ``p.grad`` (each row's mean removed), as Ranger does."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))
        return super().step(closure)


class DecayIntoGrad(torch.optim.Optimizer):
    """Elementwise (as Adan): momentum of the gradient with weight decay folded into ``p.grad`` in place."""

    def __init__(self, params, lr=0.05, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.add_(p, alpha=group["weight_decay"])
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.lerp_(p.grad, 0.2)
                p.add_(buf, alpha=-group["lr"])


class LateScalar(torch.optim.Optimizer):
    """Keeps a per-parameter float from its 5th step on (a probe of 3 steps does not see it)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["n"] = state.get("n", torch.zeros_like(p)).add_(1)
                if float(state["n"].flatten()[0]) >= 5:
                    state["scale"] = state.get("scale", 1.0) * 0.5
                p.add_(p.grad, alpha=-group["lr"] * state.get("scale", 1.0))


class GroupMeanSign(torch.optim.Optimizer):
    """Sign descent scaled by the mean absolute gradient over all its group's parameters (a group-wide
    statistic)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if not grads:
                continue
            scale = float(torch.cat([g.reshape(-1) for g in grads]).abs().mean())
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"] * scale)


def test_the_probe_clones_gradients():
    with pytest.raises(NotElementwise, match="CentralisedSGD is not elementwise"):
        offload(CentralisedSGD, [torch.nn.Parameter(torch.randn(4, 6))], lr=0.1)
    _equal(DecayIntoGrad)


def test_the_probe_runs_long_enough_to_see_late_state():
    with pytest.raises(NotElementwise, match="LateScalar keeps a per-parameter scalar 'scale'"):
        offload(LateScalar, [torch.nn.Parameter(torch.randn(3))])


def test_the_probe_sees_a_statistic_over_the_whole_group():
    with pytest.raises(Refused, match="GroupMeanSign cannot be offloaded faithfully.*statistic over all the "
                                      "parameters of its param groups"):
        offload(GroupMeanSign, [torch.nn.Parameter(torch.randn(3))])


# ---------------------------------------------------------------------------------------------- refusals --
def test_a_construction_refusal_leaves_the_model_as_it_was():
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Refused):
        offload(GroupMeanSign, model.parameters())
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


class TrustSwitch(torch.optim.Optimizer):
    """Elementwise unless its ``trust`` flag scales each tensor's update by a per-tensor ratio (as LAMB)."""

    def __init__(self, params, lr=0.05, trust=False):
        super().__init__(params, dict(lr=lr, trust=trust))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.lerp_(p.grad, 0.1)
                ratio = float(p.norm() / buf.norm().clamp(min=1e-8)) if group["trust"] else 1.0
                p.add_(buf.sign(), alpha=-group["lr"] * ratio)


class SizeGatedAdamW(torch.optim.AdamW):
    """AdamW that halves the gradient of tensors of 1,000 elements or more (as bitsandbytes keeps 8-bit state from
    4,096): elementwise on the probe's 24 elements, but the offloaded runs, spanning several parameters, would cross
    the threshold where none of the parameters does."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.numel() >= 1000:
                    p.grad.mul_(0.5)
        return super().step(closure)


def test_a_rule_that_changes_with_the_tensors_size_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(33, 15), torch.nn.Linear(15, 7))  # 495 and 105 elements: below
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NotElementwise, match=r"SizeGatedAdamW is not elementwise: .* or on its size \(a \(256, 520\)"):
        offload(SizeGatedAdamW, model.parameters(), lr=1e-2)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


def test_a_refusal_at_step_or_at_load_leaves_the_optimizer_model_and_checkpoint_as_they_were():
    model = torch.nn.Linear(4, 3)
    opt = offload(TrustSwitch, model.parameters(), lr=0.05)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    model(torch.ones(2, 4)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    opt.param_groups[0]["trust"] = True
    with pytest.raises(NotElementwise, match="TrustSwitch is not elementwise"):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(opt.state[model.weight][k], v) for k, v in state.items())
    opt.param_groups[0]["trust"] = False
    bad = {"state": saved["state"], "param_groups": [dict(saved["param_groups"][0], trust=True)]}
    kept = {k: v.clone() for k, v in saved["state"][0].items()}
    with pytest.raises(ValueError, match="TrustSwitch is not elementwise"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["trust"] is False and all(torch.equal(bad["state"][0][k], v) for k, v in kept.items())
    assert all(torch.equal(opt.state[model.weight][k], v) for k, v in state.items())
    opt.step()  # and it goes on


# ----------------------------------------------------------------------------------------- sharded, gloo --
def _sharded_worker(rank, world):
    out = []
    for cls, kw in ((StringMode, dict(mode="sign")), (GroupStepAdam, dict(maximize=True))):
        model, ref_model = td._make(rank, seed_ours=rank)
        opt = offload(cls, td.groups(model), bucket_numel=td.BUCKET_NUMEL, process_group=td.dist.group.WORLD,
                      timeout=30, **kw)
        ref = cls(td.groups(ref_model), **kw)
        for step in range(8):
            td._step(model, opt, step, rank, world, clip=0.5 if step % 2 else None)
            td._ref_step(ref_model, ref, step, clip=0.5 if step % 2 else None)
            td._compare(model, ref_model, f"{cls.__name__} step {step}")
        sd = opt.state_dict()
        out.append([g.get("step") for g in sd["param_groups"]] == [g.get("step") for g in ref.param_groups])
    return out


def test_sharded_string_settings_and_group_state_match_the_class():
    assert td.launch(_sharded_worker, 2, timeout=180) == {0: [True, True], 1: [True, True]}


@pytest.mark.parametrize("cls", [GroupStepAdam, GlobalCountSGD, CountingSGD])
def test_delayed_update_previews_for_saving_change_nothing(cls):
    """delayed_update: step t applies the gradients of step t-1; a state_dict() in between computes the pending
    update on copies (its param-group count included: the saved state is the state after it) and changes nothing
    of the run: parameters every step against the class one step late."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours, ref = offload(cls, ps, bucket_numel=16, delayed_update=True), cls(qs)
    prev = None
    for t in range(10):
        grads = [torch.randn(p.shape) for p in ps]
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        if prev is not None:
            for q, g in zip(qs, prev):
                q.grad = g.clone()
            ref.step()
        prev = grads
        ours.step()
        saved = ours.state_dict()
        if cls is GroupStepAdam and t:
            assert saved["param_groups"][0]["step"] == ref.param_groups[0]["step"] + 1  # the pending one counted
        for p, q in zip(ps, qs):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {t}: {m}")
