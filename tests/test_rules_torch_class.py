"""The generic rule (:mod:`zero_offload.rules.torch_class`) over flat buffers against the same torch.optim class
with ``foreach=False`` stepping the same parameters one tensor each (tests/rule_runs.py): params, every state buffer
and the step count every step, the SIMD tail sizes in one run with padding, bf16/fp16 gradients with a multiplier
and ``param_out``, gradients read where they lie, the class's foreach/fused implementations; then the probe's
declarations and its refusals (torch's non-elementwise classes, third-party LAMB-like and Muon-like classes, a
setting that makes a class non-elementwise, flags the offload cannot honour)."""

from __future__ import annotations

import functools

import pytest
import torch

from rule_runs import compare
from zero_offload.rules.torch_class import NotElementwise, rule_for

SIZES = [1, 7, 15, 17, 4097, 278011]
O = torch.optim

# (class, settings, buffers whose padding stays zero); each also runs with foreach=True (and fused=True where
# torch has a fused CPU kernel for the class).
CASES = [
    (O.SGD, dict(lr=0.1), ()),
    (O.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1), ("momentum_buffer",)),
    (O.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, maximize=True), ("momentum_buffer",)),
    (O.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), ("momentum_buffer",)),
    (O.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.5), ()),
    (O.Adagrad, dict(lr=0.1, maximize=True), ("sum",)),
    (O.RMSprop, dict(lr=0.01, alpha=0.9, weight_decay=0.1), ("square_avg",)),
    (O.RMSprop, dict(lr=0.01, momentum=0.9, centered=True), ("square_avg", "momentum_buffer", "grad_avg")),
    (O.Adam, dict(lr=0.01, weight_decay=0.1, amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    (O.AdamW, dict(lr=0.01, betas=(0.8, 0.99), maximize=True), ("exp_avg", "exp_avg_sq")),
    (O.Adamax, dict(lr=0.01, weight_decay=0.1), ("exp_avg",)),  # exp_inf's padding becomes eps
    (O.RAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1), ("exp_avg", "exp_avg_sq")),
    (O.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.1), ("square_avg", "acc_delta")),
    (O.Rprop, dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0)), ("prev",)),  # step_size's padding is lr
]
FUSED_CPU = {O.SGD, O.Adagrad, O.Adam, O.AdamW}


def _id(case):
    cls, settings, _ = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in settings.items())


def _ref(cls, settings):
    return functools.partial(cls, foreach=False, **settings)


@pytest.mark.parametrize("case", CASES, ids=map(_id, CASES))
def test_generic_rule_matches_class_tail_sizes_in_one_run(case):
    cls, settings, zero = case
    rule = rule_for(cls, settings, ctor=settings)
    compare(rule, settings, _ref(cls, settings), SIZES, steps=4, zero_padding=zero)


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("case", CASES, ids=map(_id, CASES))
def test_generic_rule_honours_foreach_and_fused(case, impl):
    cls, settings, zero = case
    if impl == "fused" and cls not in FUSED_CPU:
        pytest.skip(f"torch has no fused CPU {cls.__name__}")
    group = dict(settings, **{impl: True})
    compare(rule_for(cls, group, ctor=group), group, _ref(cls, settings), [7, 4097, 17], steps=3,
            zero_padding=zero)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[7], CASES[8]], ids=_id)
def test_generic_rule_low_precision_grads_scale_and_param_out(case, grad_dtype, segments):
    cls, settings, zero = case
    compare(rule_for(cls, settings, ctor=settings), settings, _ref(cls, settings), [15, 4097, 300],
            grad_dtype=grad_dtype,
            grad_scale=0.25, segments=segments, out_dtype=grad_dtype, zero_padding=zero)


def test_generic_rule_declarations_follow_the_class():
    assert [b.name for b in rule_for(O.SGD, dict(momentum=0.9)).buffers] == ["momentum_buffer"]
    assert rule_for(O.SGD, dict(momentum=0.9)).step_key is None
    sgd = rule_for(O.SGD, dict(momentum=0.0), dict(momentum=0.9))  # two groups: the union, needed per group
    assert [b.name for b in sgd.needed(sgd.hyper(dict(momentum=0.0)))] == []
    assert [b.name for b in sgd.needed(sgd.hyper(dict(momentum=0.9)))] == ["momentum_buffer"]
    ada = rule_for(O.Adagrad)
    assert ada.step_key == "step" and [b.name for b in ada.buffers] == ["sum"]
    assert ada.defaults == O.Adagrad([torch.nn.Parameter(torch.zeros(1))]).defaults
    adam = rule_for(O.Adam, dict(amsgrad=False), dict(amsgrad=True))
    assert [b.name for b in adam.needed(adam.hyper(dict(lr=0.1)))] == ["exp_avg", "exp_avg_sq"]
    assert [b.name for b in adam.needed(adam.hyper(dict(lr=0.1, amsgrad=True)))] == [
        "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    h = adam.hyper(dict(lr=0.1, betas=(0.5, 0.6)))
    assert (h.betas_0, h.betas_1, h.lr) == (0.5, 0.6, 0.1) and h.user_names["betas_1"] == "betas[1]"
    # foreach=None reaches the class as None: its own choice for the CPU tensors it steps (torch's: the loop)
    assert h.settings()["betas"] == (0.5, 0.6) and h.settings()["foreach"] is None


def test_generic_rule_refuses_a_group_needing_state_it_was_not_built_with():
    sgd = rule_for(O.SGD, dict(momentum=0.0))
    with pytest.raises(ValueError, match=r"keep state \['momentum_buffer'\]"):
        sgd.hyper(dict(lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"keep state \['max_exp_avg_sq'\]"):
        rule_for(O.Adam).hyper(dict(lr=0.1, amsgrad=True))


def test_generic_rule_validation_is_the_class_own():
    with pytest.raises(ValueError, match="Invalid momentum value: -1"):
        rule_for(O.SGD, dict(momentum=-1))
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        rule_for(O.SGD).hyper(dict(lr=0.1, nesterov=True))
    for flag in ("differentiable", "capturable"):
        with pytest.raises(ValueError, match=f"{flag}=True is refused"):
            rule_for(O.Adam).hyper(dict(lr=0.1, **{flag: True}))


@pytest.mark.parametrize("cls,match", [
    (O.LBFGS, "LBFGS cannot be offloaded: its step\\(\\) needs a closure"),
    (O.SparseAdam, "SparseAdam cannot be offloaded: it updates sparse gradients only"),
    (O.Adafactor, "Adafactor is not elementwise: its state 'row_var' has shape \\(4, 1\\)"),
    (O.NAdam, "NAdam keeps a per-parameter scalar 'mu_product'"),
    (O.ASGD, "ASGD keeps a per-parameter scalar 'eta'"),
])
def test_torch_classes_that_are_not_elementwise_are_refused(cls, match):
    with pytest.raises(NotElementwise, match=match):
        rule_for(cls)


class LambLike(torch.optim.Optimizer):
    """Adam's moments (shaped like the parameter) scaled by a per-tensor trust ratio, as LAMB does."""

    def __init__(self, params, lr=1e-3, trust=True):
        super().__init__(params, dict(lr=lr, trust=trust))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 0.1)
                update = state["exp_avg"].sign()
                ratio = p.norm() / update.norm().clamp(min=1e-8) if group["trust"] else 1.0
                p.add_(update, alpha=-group["lr"] * float(ratio))


class MuonLike(torch.optim.Optimizer):
    """Momentum (shaped like the parameter) orthogonalised as a matrix, as Muon does; 2-D parameters only."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError("MuonLike updates 2-D parameters only")
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                u, _, v = torch.linalg.svd(buf, full_matrices=False)
                p.add_(u @ v, alpha=-group["lr"])


def test_third_party_classes_that_are_not_elementwise_are_refused_by_probing():
    with pytest.raises(NotElementwise, match="LambLike is not elementwise: its update of an element depends on"):
        rule_for(LambLike)
    with pytest.raises(NotElementwise, match="MuonLike is not elementwise.*2-D parameters only"):
        rule_for(MuonLike)
    # the same class with the per-tensor ratio switched off is elementwise, and runs
    rule = rule_for(LambLike, dict(trust=False))
    compare(rule, dict(lr=0.01, trust=False), functools.partial(LambLike, lr=0.01, trust=False), [7, 300], steps=3)
    with pytest.raises(NotElementwise, match="LambLike is not elementwise"):
        rule.hyper(dict(lr=0.01, trust=True))


@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
def test_per_parameter_gradients_are_gathered_on_the_runs_device(grad_scale):
    """A run with per-parameter gradients (a parked bucket reads them where autograd left them, on the GPU) gathers
    them on the master's device, for the class's own GPU code and for Lion's: never on the host. (The CUDA stand-ins
    cannot tell the GPU from the host; the meta device can.)"""
    from zero_offload.rules.base import Run, flat_grad
    from zero_offload.rules.torch_class import _gradient

    master = torch.zeros(16, device="meta")
    grads = [torch.ones(5, device="meta"), torch.ones(2, 3, device="meta")]
    run = Run(master=master, grad=None, grads=grads, offsets=[0, 8], state={}, scales={}, step=1,
              grad_scale=grad_scale, param_out=None)
    for grad in (flat_grad(run), _gradient(run)):
        assert grad.device == master.device and grad.shape == (16,) and grad.dtype == torch.float32
