"""Every class on the parked home (``offload(cls, placement="parked")``, zero_offload/rules/whole.py): a parked
bucket is stepped at ``step()`` by the class's own code on the GPU copies of its state, each parameter whole, so a
class the elementwise probe refuses runs there (``torch.optim.Muon``), and an elementwise class without a GPU rule
(SGD) runs its own code on its parked buckets. Against the torch class itself stepping the same parameters: params
and every state tensor, every step, bit for bit where nothing but the class's code runs (no clipping); a clipped
step at default fp32 tolerance (our clip coefficient multiplies each gradient as a float, torch's as a 0-d tensor
after a foreach-free clip: the same value, but not promised to round the same way).

On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py (the buckets are told their parameters are on
``cuda:0``, their "device" buffers are CPU tensors); the class then runs its CPU code on both sides. The last test
runs on a real GPU, skipped without one.
"""

from __future__ import annotations

import io
from itertools import chain

import pytest
import torch

import cuda_standins
from zero_offload import Lion, offload

# Odd shapes, one larger than a bucket, one row or one column; several parameters per bucket.
SHAPES = [(5, 7), (3, 130), (64, 17), (1, 9), (11, 1), (16, 16)]
BUCKET = 1024


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


def _params(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _groups(params, second=None):
    """Two param groups: the first half with the defaults, the rest with ``second``'s settings."""
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], **(second or {})}]


def _loss(params, step):
    """A loss over ``params``: the same ops on either side, so the same gradients, bit for bit."""
    gen = torch.Generator().manual_seed(100 + step)
    return sum((torch.tanh(p) * torch.randn(p.shape, generator=gen).to(p.device)).sum() ** 2 for p in params)


def _backward(params, step):
    _loss(params, step).backward()


def _same(ours, opt, theirs, ref, what):
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert torch.equal(p, q), f"{what}: parameter {i} {tuple(p.shape)} differs by {(p - q).abs().max()}"
        assert set(opt.state[p]) == set(ref.state[q]), (what, i, set(opt.state[p]), set(ref.state[q]))
        for key, value in ref.state[q].items():  # (on the host: a parked bucket's state is there, the class's not)
            assert torch.equal(opt.state[p][key].cpu(), value.cpu()), f"{what}: state {key!r} of parameter {i}"


def _homes(opt):
    return [b.home.kind for b in chain.from_iterable(opt._buckets)]


def _step_both(ours, opt, theirs, ref, step, lr=None):
    for o in (opt, ref):
        o.zero_grad()
    _backward(ours, step)
    _backward(theirs, step)
    if lr is not None:  # (set after backward: the step reads it)
        for o in (opt, ref):
            for g in o.param_groups:
                g["lr"] = lr
    opt.step()
    ref.step()


MUON_SECOND = dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.01, nesterov=False, lr=0.05)


@pytest.mark.parametrize("placement,settings", [("parked", {}), ("parked", dict(lr=0.03, momentum=0.9, ns_steps=3)),
                                                ("resident", {})], ids=["parked", "parked-set", "resident"])
def test_muon_parked_is_bitwise_muon_every_step(cuda_branches, placement, settings):
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Muon, _groups(ours, MUON_SECOND), placement=placement, bucket_numel=BUCKET,
                  **settings)
    ref = torch.optim.Muon(_groups(theirs, MUON_SECOND), **settings)
    homes = _homes(opt)
    assert len(homes) > 2 and set(homes) == {placement}, homes
    for step in range(6):
        _step_both(ours, opt, theirs, ref, step, lr=0.02 if step == 3 else None)
        _same(ours, opt, theirs, ref, f"step {step}")
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in ref.param_groups]


def test_a_bf16_model_parked_steps_its_fp32_masters_as_muon_steps_fp32_parameters(cuda_branches):
    """The class steps the fp32 masters (parked with the state); the bf16 parameters are them rounded."""
    bf16_masters_run(torch.optim.Muon, _params(), BUCKET)


def bf16_masters_run(cls, params, bucket_numel, **hparams):
    """Four parked steps of ``cls`` over bf16 copies of ``params`` beside ``cls`` over fp32 ones given the same
    gradients upcast: each master equals the fp32 parameter, each bf16 parameter is it rounded, and every state
    entry of the class equals the class's, bit for bit."""
    ours = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = offload(cls, ours, placement="parked", bucket_numel=bucket_numel, **hparams)
    ref = cls(theirs, **hparams)
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            assert torch.equal(opt.state[p]["master"], q), (step, i)
            assert torch.equal(p, q.to(torch.bfloat16)), (step, i)
            assert set(opt.state[p]) == set(ref.state[q]) | {"master"}, (step, i)
            for key, value in ref.state[q].items():
                assert torch.equal(opt.state[p][key], value), (step, i, key)


def test_muon_parked_clipped_matches_muon(cuda_branches):
    """The gate runs first: the clip coefficient multiplies the gradients the class sees."""
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Muon, ours, placement="parked", bucket_numel=BUCKET, lr=0.05)
    ref = torch.optim.Muon(theirs, lr=0.05)
    for step in range(4):
        for o in (opt, ref):
            o.zero_grad()
        _backward(ours, step)
        _backward(theirs, step)
        norm = opt.clip_grad_norm_(1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0, foreach=False)
        torch.testing.assert_close(norm, ref_norm)
        assert float(ref_norm) > 1.0  # (the clip does clip)
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q)
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_muon_parked_under_a_gradscaler_is_bitwise_muon_under_one(cuda_branches):
    """GradScaler's unscale (a power of two: exact either way) and its overflow verdict (step 2 skipped)."""
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Muon, ours, placement="parked", bucket_numel=BUCKET)
    scaled_run(ours, opt, theirs, torch.optim.Muon(theirs), _same)


def scaled_run(ours, opt, theirs, ref, same):
    """Five steps of ``opt`` and ``ref`` under a GradScaler each, an inf in ``ours[1]``/``theirs[1]`` at step 2 (a
    matrix), compared by ``same`` every step."""
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for step in range(5):
        for o, ps, scaler in ((opt, ours, scalers[0]), (ref, theirs, scalers[1])):
            o.zero_grad()
            scaler.scale(_loss(ps, step)).backward()
            if step == 2:
                ps[1].grad[0, 3] = float("inf")
            scaler.step(o)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale(), step
        same(ours, opt, theirs, ref, f"step {step}")
    assert scalers[0].get_scale() != 2.0**10  # (it grew and backed off: the steps did go through it)


def test_a_nonfinite_gradient_leaves_a_parked_class_as_it_was(cuda_branches):
    ours = _params()
    opt = offload(torch.optim.Muon, ours, placement="parked", bucket_numel=BUCKET, nonfinite="skip")
    _backward(ours, 0)
    opt.step()
    before = [p.detach().clone() for p in ours], [opt.state[p]["momentum_buffer"].clone() for p in ours]
    opt.zero_grad()
    _backward(ours, 1)
    ours[2].grad[3, 4] = float("nan")
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(ours, before[0]))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(ours, before[1]))


def test_an_elementwise_class_runs_its_own_code_on_its_parked_buckets(cuda_branches):
    """SGD has no GPU rule: its parked buckets run SGD's own code, each parameter whole, beside host and resident
    buckets in the same group (the host ones by the generic rule over flat runs: SGD's arithmetic is the same)."""
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.SGD, ours, placement={"resident": 0.3, "parked": 0.65}, bucket_numel=BUCKET,
                 **kw)
    ref = torch.optim.SGD(theirs, foreach=False, **kw)
    assert set(_homes(opt)) == {"host", "resident", "parked"}, _homes(opt)
    for step in range(5):
        _step_both(ours, opt, theirs, ref, step)
        _same(ours, opt, theirs, ref, f"step {step}")


def test_a_parked_class_checkpoint_loads_into_the_class_and_back(cuda_branches):
    ours, theirs = _params(), _params()
    opt = offload(torch.optim.Muon, _groups(ours, MUON_SECOND), placement="parked", bucket_numel=BUCKET)
    ref = torch.optim.Muon(_groups(theirs, MUON_SECOND))
    for step in range(3):
        _step_both(ours, opt, theirs, ref, step)

    def saved(o):
        buf = io.BytesIO()
        torch.save(o.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    # Ours into the class: a fresh Muon over copies of our parameters goes on as ours does.
    loaded_params = _clone(ours)
    loaded = torch.optim.Muon(_groups(loaded_params, MUON_SECOND))
    loaded.load_state_dict(saved(opt))
    # The class's into ours: a fresh parked optimizer over copies of the class's parameters goes on as the class.
    back_params = _clone(theirs)
    back = offload(torch.optim.Muon, _groups(back_params, MUON_SECOND), placement="parked", bucket_numel=BUCKET)
    back.load_state_dict(saved(ref))
    for step in range(3, 6):
        _step_both(ours, opt, loaded_params, loaded, step)
        _same(ours, opt, loaded_params, loaded, f"loaded into Muon, step {step}")
        _step_both(back_params, back, theirs, ref, step)
        _same(back_params, back, theirs, ref, f"loaded from Muon, step {step}")


class _GlobalNormSGD(torch.optim.Optimizer):
    """SGD on the gradient divided by the norm of all the gradients together: needs the whole model at once."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.sqrt(sum((p.grad ** 2).sum() for p in params))
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["momentum_buffer"] = p.grad / total
                    p.sub_(self.state[p]["momentum_buffer"], alpha=g["lr"])


class _ScalarStateMuon(torch.optim.Muon):
    """Muon that keeps a per-parameter scalar besides its momentum: state that is not a per-parameter tensor of the
    parameter's shape."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["norm"] = self.state[p]["momentum_buffer"].norm()
        return out


@pytest.mark.parametrize("cls,match", [
    (_ScalarStateMuon, r"Nor can it be parked.*per-parameter scalar 'norm'"),
    (_GlobalNormSGD, r"Nor can it be parked.*depends on other parameters"),
])
def test_a_class_that_cannot_be_parked_is_refused_naming_why(cuda_branches, cls, match):
    refused_then_free(cls, _params(), match, torch.optim.Muon)


def refused_then_free(cls, ours, match, good, placement="parked", bucket_numel=BUCKET):
    """``offload(cls, ours, placement=...)`` raises ``ValueError`` matching ``match`` and naming ``cls``, with the
    parameters unchanged and free to use: ``offload(good, ours, placement="parked")`` builds over them."""
    before = [p.detach().clone() for p in ours]
    with pytest.raises(ValueError, match=match) as info:
        offload(cls, ours, placement=placement, bucket_numel=bucket_numel)
    assert cls.__name__ in str(info.value)
    assert all(torch.equal(p, q) for p, q in zip(ours, before))
    return offload(good, ours, placement="parked", bucket_numel=bucket_numel)


@pytest.mark.parametrize("placement", ["host", {"parked": 0.5}, "auto"])
def test_a_class_run_only_whole_is_refused_where_a_bucket_would_be_stepped_on_the_host(cuda_branches, placement):
    ours = _params()
    refused_then_free(torch.optim.Muon, ours, r"Muon.*placement=.parked. runs it", torch.optim.Muon, placement)
    opt = offload(torch.optim.Muon, [{"params": iter(ours)}], placement="parked", bucket_numel=BUCKET)
    assert len(opt.param_groups[0]["params"]) == len(ours)  # (a group's iterator is read once)
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match="probed for parked parameters of \\(2,\\) dimensions"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 3, 4))]})
    assert len(opt.param_groups) == groups == len(opt._buckets)


@pytest.mark.cuda  # (in the lease plan's `pytest -m cuda`; skipped without a GPU, tests/conftest.py)
def test_muon_parked_on_a_gpu_is_bitwise_muon_on_the_gpu():
    ours = [p.cuda() for p in _params()]
    ours = [torch.nn.Parameter(p.detach()) for p in ours]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = offload(torch.optim.Muon, ours, placement="parked", bucket_numel=BUCKET)
    ref = torch.optim.Muon(theirs)
    assert set(_homes(opt)) == {"parked"}
    for step in range(4):
        _step_both(ours, opt, theirs, ref, step)
        torch.cuda.synchronize()
        _same(ours, opt, theirs, ref, f"step {step}")



@pytest.mark.parametrize("placement", ["parked", "resident"])
def test_lion_parked_is_bitwise_lion(cuda_branches, placement):
    """Lion's rule steps a bucket on the GPU with zero_offload.Lion's own code, each parameter whole."""
    kw = dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1)
    shapes = SHAPES + [(130,), (3, 2, 5)]
    ours, theirs = _params(shapes), _params(shapes)
    opt = offload(Lion, _groups(ours, dict(maximize=True)), placement=placement, bucket_numel=BUCKET, **kw)
    ref = Lion(_groups(theirs, dict(maximize=True)), **kw)
    assert set(_homes(opt)) == {placement}
    for step in range(5):
        _step_both(ours, opt, theirs, ref, step, lr=5e-4 if step == 2 else None)
        _same(ours, opt, theirs, ref, f"step {step}")
