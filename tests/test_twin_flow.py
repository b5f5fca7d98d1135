"""Twin flow (``gpu_fraction``): the first buckets of each param group keep master and moments on their GPU and
are updated there by torch's fused AdamW, after the same checks as the host buckets, while the host updates the
rest. On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py (the buckets are told their
parameters are on ``cuda:0``; their "device" buffers are CPU tensors), and torch's fused CPU kernel stands in for
its CUDA kernel: the Python of the device tier runs for real, against AdamW every step.

Tolerance: default fp32. The host buckets run our kernel (operation for operation AdamW's), the device buckets
torch's fused kernel; both are AdamW within float rounding, not bit for bit (docs/twin-flow.md).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import weakref
from itertools import chain

import pytest
import torch

import cuda_standins
import test_distributed
import test_optimizer
from test_cuda_branches import CUDA_RECIPES
from test_grad_stream import _run_recipe
from test_optimizer import Recipe, TinyTransformer, assert_same, loss_fn, param_groups
from zero_offload import OffloadOptimizer, _torch_fused
from zero_offload.report import count_plan, memory_plan, meta_params, plan_lines

# The GPU tier's update on the stand-in device is torch's fused CPU kernel, which torch 2.3 lacks.
needs_fused = pytest.mark.skipif(not _torch_fused.AVAILABLE, reason="torch < 2.4 has no fused AdamW for CPU tensors "
                                 "to stand in for the GPU's")

BUCKET = 300  # TinyTransformer in 10 buckets (6 + 4 over its two param groups)


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _buckets(opt):
    return list(chain.from_iterable(opt._buckets))


def _tiers(opt):
    return [b.device_tier for b in _buckets(opt)]


def _with(recipe: Recipe, **ours_kw) -> Recipe:
    return dataclasses.replace(recipe, ours_kw={**recipe.ours_kw, "bucket_numel": BUCKET, **ours_kw})


# Every streamed recipe of the CUDA branches (clipping, accumulation, GradScaler with overflow, schedulers,
# closures, add_param_group, release_grads, zero_grad(set_to_none=False), not streamed), half of each group's
# elements on the GPU tier.
@pytest.mark.parametrize("recipe", CUDA_RECIPES, ids=lambda r: r.name)
def test_mixed_host_and_gpu_buckets_match_adamw_every_step(cuda_branches, recipe):
    opt = _run_recipe(_with(recipe, gpu_fraction=0.5), "cpu", steps=25)
    tiers = _tiers(opt)
    assert any(tiers) and not all(tiers), tiers
    # The GPU tier's gradients are read where autograd left them: no gradient buffer of its own (but
    # zero_grad(set_to_none=False) makes the .grad tensors views of one, which backward then accumulates into).
    made = [b.grads.allocated for b in _buckets(opt) if b.device_tier]
    assert all(made) if not recipe.set_to_none else not any(made), made


@pytest.mark.parametrize("recipe", [r for r in CUDA_RECIPES if r.name in (
    "adamw", "amsgrad", "clip_inf_norm", "scaler_fused_clip", "zero_grad_keep", "accumulate_no_sync+release")],
    ids=lambda r: r.name)
def test_everything_on_the_gpu_tier_matches_adamw(cuda_branches, recipe):
    opt = _run_recipe(_with(recipe, gpu_fraction=1.0), "cpu", steps=25)
    assert all(_tiers(opt))
    assert opt.estimate_host_memory().total_bytes == 0


def _train(opt, model, steps, start=0, clip=None):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()


def test_host_buckets_are_bitwise_the_all_host_run(cuda_branches):
    """Without clipping, nothing a host bucket computes in a step depends on the GPU tier: from the same
    parameters, the host buckets end the step bit for bit as without it. (Later steps differ in rounding: the
    model's outputs, hence every gradient, depend on the GPU tier's parameters, updated by another kernel.)"""
    torch.manual_seed(0)
    model = TinyTransformer()
    twin_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="host")
    twin = OffloadOptimizer(param_groups(twin_model), bucket_numel=BUCKET, gpu_fraction=0.5)
    for step in range(4):
        twin_model.load_state_dict(model.state_dict())  # (in place: into the parameters' bound storage)
        _train(opt, model, 1, start=step)
        _train(twin, twin_model, 1, start=step)
        for a, b in zip(_buckets(opt), _buckets(twin)):
            if b.device_tier:
                continue
            for p, q in zip(a.params, b.params):
                assert torch.equal(p, q), step
                for key, value in opt.state[p].items():
                    assert torch.equal(value, twin.state[q][key]), (step, key)
        twin.load_state_dict(opt.state_dict())


def step_on_an_inf(opt, policy):
    """``step()`` with an inf gradient: raises under ``nonfinite="raise"``, else is skipped (the first skip)."""
    if policy == "raise":
        with pytest.raises(RuntimeError, match="non-finite gradient"):
            opt.step()
    else:
        opt.step()
        assert opt.skipped_steps == 1


def check_an_inf_changes_nothing(opt, model, param, policy):
    """The fourth step's backward (``loss_fn``'s step 3), then an inf in ``param``'s gradient: ``step()`` raises or
    skips as ``policy`` says, and no parameter and no state entry changes (read once every write-back has
    landed)."""
    before = ([p.detach().clone() for p in model.parameters()],
              {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()})
    opt.zero_grad()
    loss_fn(model, 3, 0, "cpu").backward()
    param.grad.view(-1)[0] = float("inf")
    step_on_an_inf(opt, policy)
    for p, q in zip(model.parameters(), before[0]):
        assert torch.equal(p.detach(), q)
    opt.flush()
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, before[1][id(p)][k]), k


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradient_in_the_gpu_tier_updates_nothing(cuda_branches, policy):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction=0.5, nonfinite=policy)
    _train(opt, model, 3)
    check_an_inf_changes_nothing(opt, model, next(b.params[0] for b in _buckets(opt) if b.device_tier), policy)


@pytest.mark.parametrize("kw", [dict(gpu_fraction=0.5), dict(gpu_fraction=1.0), dict(placement="parked")],
                         ids=["0.5", "1.0", "parked"])
def test_the_gpu_tiers_gradients_are_let_go_with_the_step(cuda_branches, kw):
    """The device tier (and the parked home) reads its gradients in place: after step() and zero_grad() it holds
    none of them (else they would stay allocated on the GPU through the next forward and backward, beside the new
    ones)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, **kw)
    for step in range(2):
        loss_fn(model, step, 0, "cpu").backward()
        grads = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        assert [g() is None for g in grads] == [True] * len(grads), "a gradient outlived the step"


def _save(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _steps(runs, start, stop, clip=0.5):
    for step in range(start, stop):
        for o, m in runs:
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            if isinstance(o, OffloadOptimizer):
                o.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip, foreach=False)
            o.step()
        yield step


@pytest.mark.parametrize("into", ["twin", "host_only", "adamw"])
def test_state_dict_round_trips_with_the_gpu_part(cuda_branches, into):
    """AdamW's format whatever the tier: saved mid-run, loaded into another twin-flow optimizer, one without a GPU
    tier, or AdamW, the runs go on together with the uninterrupted one; and AdamW's loads into twin flow."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction=0.5)
    _train(opt, model, 5, clip=0.5)
    ckpt = _save({"model": model.state_dict(), "opt": opt.state_dict()})
    assert set(ckpt["opt"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    resumed_model = TinyTransformer()
    resumed_model.load_state_dict(ckpt["model"])
    if into == "adamw":
        resumed = torch.optim.AdamW(param_groups(resumed_model), foreach=False)
    else:
        resumed = OffloadOptimizer(param_groups(resumed_model), bucket_numel=BUCKET,
                                   gpu_fraction=0.5 if into == "twin" else 0.0)
    resumed.load_state_dict(ckpt["opt"])
    for step in _steps([(opt, model), (resumed, resumed_model)], 5, 10):
        assert_same(model, resumed_model, opt, resumed, f"resumed into {into}, step {step}")
    if into == "adamw":  # and back: AdamW's state dict into twin flow
        back_model = copy.deepcopy(resumed_model)
        back = OffloadOptimizer(param_groups(back_model), bucket_numel=BUCKET, gpu_fraction=0.5)
        back.load_state_dict(resumed.state_dict())
        for step in _steps([(back, back_model), (resumed, resumed_model)], 10, 13):
            assert_same(back_model, resumed_model, back, resumed, f"AdamW's state dict in twin flow, step {step}")


def test_low_precision_masters_on_the_gpu_tier_match_adamw_on_fp32_copies(cuda_branches):
    """The existing test body (bf16 parameters, fp32 masters against AdamW on fp32 copies, resumed from a
    checkpoint halfway), with every parameter's state on the GPU tier."""
    kw = dict(OffloadOptimizer.__init__.__kwdefaults__, gpu_fraction=1.0)
    cuda_branches.setattr(OffloadOptimizer.__init__, "__kwdefaults__", kw)
    test_optimizer.test_low_precision_params_have_fp32_masters_matching_adamw_on_fp32_copies(torch.bfloat16, "cpu")


def test_bf16_model_on_both_tiers_tracks_fp32_run(cuda_branches):
    kw = dict(OffloadOptimizer.__init__.__kwdefaults__, gpu_fraction=0.5, bucket_numel=BUCKET)
    cuda_branches.setattr(OffloadOptimizer.__init__, "__kwdefaults__", kw)
    test_optimizer.test_bf16_model_tracks_fp32_run_better_than_bf16_adamw("cpu")


def fake_gpu_memory(monkeypatch, free, reserved=0, peak=0, allocated=None):
    """What the allocator reports: ``free`` bytes, ``reserved`` in its cache, the ``peak`` allocated (and, where
    given, what is ``allocated`` now)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    if allocated is not None:
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)


def clipped_step_beside_adamw(opt, model, ref, ref_model, step):
    """One training step of ours and of AdamW (``ref``), both clipped to 0.5, and their parameters and state
    compared."""
    for o, m in ((opt, model), (ref, ref_model)):
        o.zero_grad()
        loss_fn(m, step, 0, "cpu").backward()
    opt.clip_grad_norm_(0.5)
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, foreach=False)
    opt.step()
    ref.step()
    assert_same(model, ref_model, opt, ref, f"step {step}")


def test_auto_moves_the_last_arriving_buckets_that_fit(cuda_branches):
    """``gpu_fraction="auto"``: after the first step, the buckets backward sent last move to the GPU tier, as many
    as fit in the free memory (plus the allocator's cache, less the step's peak and the margin); the trajectory
    stays AdamW's across the move."""
    monkeypatch = cuda_branches
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction="auto", gpu_margin_gib=1.0)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    arrivals = []
    real_reset = opt._transport.reset

    def reset():
        if not arrivals:
            arrivals.extend(lane.bucket for lane in opt._transport.arrivals)
        real_reset()

    monkeypatch.setattr(opt._transport, "reset", reset)
    room = 9000
    fake_gpu_memory(monkeypatch, free=2**30 + room + 5000, reserved=3000, peak=8000)
    host_before = opt.estimate_host_memory().total_bytes
    for step in range(6):
        clipped_step_beside_adamw(opt, model, ref, ref_model, step)
        if step == 0:
            moved = [b for b in _buckets(opt) if b.device_tier]
            expected, used = [], 0
            for b in reversed(arrivals):  # the last to arrive first, while they fit
                if used + b.device_cost() > room:
                    break
                used += b.device_cost()
                expected.append(b)
            assert moved and {id(b) for b in moved} == {id(b) for b in expected}
            assert sum(opt.gpu_state_bytes().values()) == used
            assert opt.estimate_host_memory().total_bytes < host_before
    assert _tiers(opt) == [any(b is m for m in moved) for b in _buckets(opt)]  # placed once, after the first step


def test_auto_without_room_keeps_everything_on_the_host(cuda_branches):
    fake_gpu_memory(cuda_branches, free=2**30, peak=0)  # exactly the margin
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction="auto", gpu_margin_gib=1.0)
    _train(opt, model, 2)
    assert not any(_tiers(opt)) and opt.gpu_state_bytes() == {}


def test_gpu_fraction_places_each_groups_first_buckets(cuda_branches):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction=0.3)
    for group in opt._buckets:
        tiers = [b.device_tier for b in group]
        n = sum(tiers)
        assert tiers == [True] * n + [False] * (len(tiers) - n)  # a prefix
        total = sum(b.layout.numel for b in group)
        on_gpu = sum(b.layout.numel for b in group[:n])
        assert on_gpu <= 0.3 * total < on_gpu + group[n].layout.numel
    assert opt.gpu_state_bytes() == {name: sum(b.device_bytes().get(name, 0) for b in _buckets(opt))
                                     for name in ("exp_avg", "exp_avg_sq")}
    held = opt.estimate_host_memory()
    assert held.numel == sum(p.numel() for p in model.parameters())
    assert held.total_bytes == sum(b.estimate().total_bytes for b in _buckets(opt) if not b.device_tier)
    # Planned before building, the same bytes.
    planned = OffloadOptimizer.estimate_host_memory(param_groups(model), bucket_numel=BUCKET, gpu_fraction=0.3)
    assert planned.total_bytes == held.total_bytes


@pytest.mark.parametrize("kw, match", [
    (dict(gpu_fraction=-0.1), "Invalid gpu_fraction"),
    (dict(gpu_fraction=1.5), "Invalid gpu_fraction"),
    (dict(gpu_fraction="half"), "Invalid gpu_fraction"),
    (dict(gpu_fraction=True), "Invalid gpu_fraction"),
    (dict(gpu_margin_gib=-1.0), "Invalid gpu_margin_gib"),
    (dict(gpu_fraction=0.5, state_dtype=torch.bfloat16), "fp32 state only"),
    (dict(gpu_fraction="auto", delayed_update=True), "not combined"),
    (dict(gpu_fraction=0.5, overlap_step=True, nonfinite="ignore"), "not combined"),
])
def test_bad_gpu_tier_options_are_refused(kw, match):
    check_refused(kw, match)


def check_refused(kw, match):
    """Building the optimizer with ``kw`` raises a ValueError matching ``match`` and leaves the model as it was."""
    model = TinyTransformer()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer(model.parameters(), **kw)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def host_only_rule():
    """A rule without a GPU update (every rule zero_offload ships has one: Lion's rule, stripped of it)."""
    from zero_offload.rules.lion import Lion as LionRule

    class HostOnly(LionRule):
        name = "HostOnly"
        device_update = False

    return HostOnly()


def test_a_rule_without_a_gpu_update_refuses_gpu_fraction():
    rule = host_only_rule()
    with pytest.raises(ValueError, match="HostOnly has no GPU update"):
        OffloadOptimizer._with_rule(TinyTransformer().parameters(), rule, dict(rule.defaults), gpu_fraction=0.5)


def test_memory_plan_splits_the_state_between_gpu_and_host():
    params = meta_params(10_000_000, torch.bfloat16, 10**6)
    plain = memory_plan(params, bucket_numel=10**6)
    plan = memory_plan(params, bucket_numel=10**6, gpu_fraction=0.25)
    assert plan.gpu_tier_numel == 2_000_000
    # The GPU holds the tier's fp32 moments and master (12 B/param); the host loses the same buffers and the
    # tier's share of the gradient buffer.
    assert plan.total("ours", "gpu") - plain.total("ours", "gpu") == 12 * 2_000_000
    assert plain.total("ours", "host") - plan.total("ours", "host") == 14 * 2_000_000
    for fraction in (0.25, 0.5, 1.0):
        for world in (1, 2):
            a = count_plan(10_500_000, torch.float32, bucket_numel=10**6, gpu_fraction=fraction, world_size=world)
            b = memory_plan(meta_params(10_500_000, torch.float32, 10**6), bucket_numel=10**6,
                            gpu_fraction=fraction, world_size=world)
            assert (a.ours, a.host, a.gpu_tier_numel) == (b.ours, b.host, b.gpu_tier_numel), (fraction, world)
    assert any(line.startswith("GPU state") for line in plan_lines(plan))
    with pytest.raises(ValueError, match="Invalid gpu_fraction"):
        memory_plan(params, gpu_fraction="auto")


# -- sharded: gloo world 2, the CUDA branches on stand-ins (test_distributed's harness) ---------------------------
SHARDED = {
    "twin_plain": dict(ours=dict(gpu_fraction=0.99)),
    "twin_clip": dict(ours=dict(gpu_fraction=0.5), clip=0.3),
    "twin_stream_clip": dict(ours=dict(stream_grads=True, gpu_fraction=0.99), clip=0.3),
    "twin_keep_grads": dict(ours=dict(gpu_fraction=1.0), accumulate=2, set_to_none=False, clip=1.0),
    "resident_share_clip": dict(ours=dict(placement={"resident": 0.5}), clip=0.3),  # (gpu_fraction's alias)
}


def _sharded_worker(rank, world):
    import test_distributed

    test_distributed.VARIANTS.update(SHARDED)
    # Every rank against AdamW on the whole batch, every step, and the gathered state at the end.
    return test_distributed._cuda_branches_worker(rank, world, list(SHARDED))


@needs_fused
def test_sharded_twin_flow_matches_adamw():
    results = test_distributed.launch(_sharded_worker, 2)
    for per_variant in results.values():  # host state bytes per parameter on each rank: the GPU tier has the rest
        assert set(per_variant) == set(SHARDED)
        assert per_variant["twin_keep_grads"] == 0 and per_variant["twin_plain"] < 1.0 < per_variant["twin_clip"]


def _sharded_auto_worker(rank, world):
    import test_distributed as td
    cuda_standins.install_in_rank()
    # Rank 1 has room for less than rank 0: both move what rank 1 can take.
    room = {0: 10**9, 1: 4000}[rank]
    torch.cuda.mem_get_info = lambda device=None: (room, 80 * 2**30)
    torch.cuda.memory_reserved = lambda device=None: 0
    torch.cuda.max_memory_allocated = lambda device=None: 0
    model, ref_model = td._make(rank, seed_ours=rank)
    opt = OffloadOptimizer(td.groups(model), lr=1e-2, bucket_numel=td.BUCKET_NUMEL, gpu_fraction="auto",
                           gpu_margin_gib=0, process_group=td.dist.group.WORLD, stream_grads=True)
    ref = torch.optim.AdamW(td.groups(ref_model), lr=1e-2, foreach=False)
    for step in range(6):
        td._step(model, opt, step, rank, world, clip=0.3)
        td._ref_step(ref_model, ref, step, clip=0.3)
        td._compare(model, ref_model, f"auto, step {step}")
    costs = [b.device_cost() for b in _buckets(opt)]
    return _tiers(opt), costs


@needs_fused
def test_sharded_auto_moves_the_same_buckets_on_every_rank():
    results = test_distributed.launch(_sharded_auto_worker, 2)
    (tiers0, costs), (tiers1, _) = results[0], results[1]
    assert tiers0 == tiers1 and any(tiers0) and not all(tiers0)
    assert sum(c for c, t in zip(costs, tiers0) if t) <= 4000


def _cpu_model_auto_worker(rank, world):
    import test_distributed as td

    model, ref_model = td._make(rank, seed_ours=rank)
    opt = OffloadOptimizer(td.groups(model), lr=1e-2, bucket_numel=td.BUCKET_NUMEL, gpu_fraction="auto",
                           process_group=td.dist.group.WORLD, stream_grads=True)
    ref = torch.optim.AdamW(td.groups(ref_model), lr=1e-2, foreach=False)
    for step in range(3):
        td._step(model, opt, step, rank, world, clip=0.3)
        td._ref_step(ref_model, ref, step, clip=0.3)
        td._compare(model, ref_model, f"step {step}")
    return _tiers(opt)


def test_auto_on_a_streamed_cpu_model_moves_nothing():
    """Streamed CPU buckets arrive in backward too: "auto" places CUDA buckets only (sharded, the ranks still
    agree on the count)."""
    for tiers in test_distributed.launch(_cpu_model_auto_worker, 2).values():
        assert tiers and not any(tiers)


# -- on a real GPU (skipped without one; in the runbook's `pytest -m cuda`) ----------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [r for r in CUDA_RECIPES if r.name in (
    "adamw", "clip", "scaler", "zero_grad_keep", "accumulate_no_sync+release", "not_streamed")], ids=lambda r: r.name)
def test_mixed_tiers_on_a_gpu_match_adamw(recipe):
    """The device tier on CUDA: torch's fused CUDA kernel, GPU norms, in-place gradients, with host buckets
    streamed beside it."""
    opt = _run_recipe(_with(recipe, gpu_fraction=0.5), "cuda", steps=25)
    tiers = _tiers(opt)
    assert any(tiers) and not all(tiers), tiers
    gpu_buffers = [t for b in _buckets(opt) if b.device_tier for t in b.store.tensors().values()]
    assert gpu_buffers and all(t.is_cuda for t in gpu_buffers)


@pytest.mark.cuda
def test_auto_on_a_gpu_moves_buckets_and_keeps_adamw():
    torch.manual_seed(0)
    model = TinyTransformer().cuda()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction="auto", gpu_margin_gib=0.5)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(6):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cuda").backward()
            o.step()
        assert_same(model, ref_model, opt, ref, f"auto on a GPU, step {step}")
    assert all(_tiers(opt)), "a tiny model fits on any GPU with half a GiB to spare"
    assert sum(opt.gpu_state_bytes().values()) > 0


def test_auto_stops_at_a_bucket_the_gpu_cannot_take(cuda_branches, caplog):
    """Out of GPU memory while moving (the free memory was misjudged): that bucket and the later ones stay on the
    host, whole, and training goes on as AdamW."""
    from zero_offload.state import tiers

    monkeypatch = cuda_branches
    fake_gpu_memory(monkeypatch, free=10**9)
    calls = []
    real_zeros = tiers.DeviceTier.zeros

    def zeros(self, n, dtype):
        calls.append(n)
        if len(calls) > 4:  # the second bucket's allocations fail
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real_zeros(self, n, dtype)

    monkeypatch.setattr(tiers.DeviceTier, "zeros", zeros)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction="auto", gpu_margin_gib=0)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in _steps([(opt, model), (ref, ref_model)], 0, 5):
        assert_same(model, ref_model, opt, ref, f"step {step}")
    assert sum(_tiers(opt)) == 1 and "ran out of memory" in caplog.text
