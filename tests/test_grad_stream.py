"""Gradient streaming (backward hooks), accumulation, ``overlap_step`` and ``delayed_update`` against AdamW.

The orchestration is the same with the model on CPU (plain copies instead of a side stream), so every ordering
rule is checked here on CPU with ``stream_grads=True``: the recipes of test_optimizer.py (schedulers, clipping,
accumulation, closures, parameters without gradients, param groups added mid-run) run through the hooks and must
follow ``torch.optim.AdamW(foreach=False)`` every step at default tolerance. The same bodies run on CUDA, where
streaming is the default, and CUDA-only tests check the side-stream synchronisation and GPU memory.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from test_optimizer import (DEVICES, RECIPES, STEPS, Recipe, TinyTransformer, assert_same, loss_fn, make_runs,
                            param_groups, snapshot, assert_unchanged)
from zero_offload import OffloadOptimizer

# Recipes whose gradients a GradScaler or torch.nn.utils.clip_grad_norm_ must see on the parameters, or which
# write into .grad after backward: with release_grads=True these are errors (tested below), not trajectories.
NEEDS_GRADS = {"scaler", "scaler_unscale_clip", "scaler_fused_clip", "clip_with_torch_utils"}


def _streamed(recipe: Recipe, **kw) -> Recipe:
    return dataclasses.replace(recipe, name=f"{recipe.name}+{kw}",
                               ours_kw={**recipe.ours_kw, "stream_grads": True, **kw})


STREAM_RECIPES = (
    [_streamed(r, release_grads=True) for r in RECIPES if r.name not in NEEDS_GRADS]
    + [_streamed(r, release_grads=False) for r in RECIPES]
    + [_streamed(Recipe("accumulate_no_sync", accumulate=3, clip=0.5, no_sync=True), release_grads=True),
       _streamed(Recipe("accumulate_no_sync_keep", accumulate=3, no_sync=True, set_to_none=False),
                 release_grads=False)]
)


def _run_recipe(recipe: Recipe, device: str, steps: int = STEPS):
    """Ours and the reference through ``recipe``, compared every step; returns our optimizer."""
    ours, ref = make_runs(recipe, device)
    for step in range(steps):
        ours.step(step)
        ref.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"{recipe.name} step {step}")
    if recipe.clip is not None:
        torch.testing.assert_close(torch.stack(ours.norms), torch.stack(ref.norms))
    if recipe.inf_at is not None:
        assert ours.opt.skipped_steps == 1
    return ours.opt


@pytest.mark.parametrize("recipe", STREAM_RECIPES, ids=lambda r: r.name)
def test_streamed_recipes_match_adamw_every_step(recipe):
    _run_recipe(recipe, "cpu", steps=25)


def _bucketed_model(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(17, 17) for _ in range(6)]).to(device=device, dtype=dtype)


def _data(step, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 17, generator=gen).to(device, dtype), torch.randn(8, 17, generator=gen).to(device, dtype)


def _loss(model, step, device="cpu"):
    dtype = next(model.parameters()).dtype
    x, y = _data(step, device, dtype)
    return (model(x).float() - y.float()).pow(2).mean()


def _record_launches(opt, monkeypatch) -> list:
    """The list every bucket launch of ``opt``'s streamer is appended to (its BucketStream), as it happens."""
    launches = []
    real = opt._streamer._launch
    monkeypatch.setattr(opt._streamer, "_launch", lambda state: (launches.append(state), real(state)))
    return launches


def test_buckets_launch_during_backward_in_backward_order(monkeypatch):
    model = _bucketed_model()
    # Slots of 320 (weight) and 64 (bias) elements: buckets of at most 700 cut the six layers into four.
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=True, bucket_numel=700)
    launches = _record_launches(opt, monkeypatch)
    _loss(model, 0).backward()
    order = [next(i for i, b in enumerate(opt._buckets[0]) if b is state.bucket) for state in launches]
    assert len(opt._buckets[0]) == 4
    assert order == [3, 2, 1, 0], "each bucket must launch once, as soon as backward has produced its gradients"
    # Released: the gradients are in the host buffer only.
    assert all(p.grad is None for p in model.parameters())
    expected = copy.deepcopy(model)
    _loss(expected, 0).backward()
    for bucket in opt._buckets[0]:
        names = [n for n, q in model.named_parameters() if any(q is r for r in bucket.params)]
        for view, p in zip(bucket.grad_views, [dict(expected.named_parameters())[n] for n in names]):
            torch.testing.assert_close(view, p.grad)


def test_a_bucket_with_an_unused_parameter_launches_when_backward_ends():
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, bucket_numel=700)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    for step in range(6):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            x, y = _data(step)
            h = x
            for k, layer in enumerate(m):
                if not (k == 3 and step % 2):  # layer 3 is skipped on odd steps: its bucket never completes
                    h = layer(h)
            (h - y).pow(2).mean().backward()
            o.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")


@pytest.mark.parametrize("release", [True, False])
def test_host_accumulation_without_no_sync_equals_device_accumulation(release):
    """Without no_sync every micro-batch streams; the host buffer sums them (release) or is refreshed from .grad."""
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=release, bucket_numel=700)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    for step in range(8):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            for micro in range(3):
                (_loss(m, 10 * step + micro) / 3).backward()
            o.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")


def test_zero_grad_discards_streamed_gradients():
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    for m, o in ((model, opt), (ref_model, ref)):
        _loss(m, 0).backward()
        o.zero_grad()
        _loss(m, 1).backward()
        o.step()
    assert_same(model, ref_model, opt, ref, "after a discarded backward")


def test_gradient_scaler_with_released_gradients_is_refused_and_changes_nothing():
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=True)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    snap = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="release_grads=False"):
        scaler.step(opt)
    assert_unchanged(snap, model, opt)


def test_nonfinite_gradient_is_caught_after_streaming():
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=True, nonfinite="skip")
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    for step in range(5):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            loss = _loss(m, step)
            (loss * float("inf") if step == 2 else loss).backward()
            if not (o is ref and step == 2):
                o.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")
    assert opt.skipped_steps == 1


# ----------------------------------------------------------------------------------------------- overlap_step --
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", [1, 3])
def test_overlap_step_matches_adamw(device, accumulate):
    kw = dict(stream_grads=True, release_grads=True, overlap_step=True, nonfinite="ignore")
    recipe = Recipe(f"overlap_acc{accumulate}", accumulate=accumulate, no_sync=True, ours_kw=kw,
                    scheduler=lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=10))
    _run_recipe(recipe, device, steps=20)


def test_overlap_step_refuses_what_needs_the_whole_step():
    with pytest.raises(ValueError, match="nonfinite='ignore'"):
        OffloadOptimizer(_bucketed_model().parameters(), overlap_step=True)
    with pytest.raises(ValueError, match="alternatives"):
        OffloadOptimizer(_bucketed_model().parameters(), overlap_step=True, delayed_update=True, nonfinite="ignore")
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, overlap_step=True, nonfinite="ignore")
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="cannot clip"):
        opt.clip_grad_norm_(1.0)
    # The updates run in a worker thread: the next forward must see them, or autograd's version check (not ours)
    # refuses that backward, depending on which finishes first.
    opt._mode.settle()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(model, 1).backward()  # a second micro-batch without no_sync: its buckets were already updated
    with pytest.raises(RuntimeError, match="already updated"):
        opt.step()  # that micro-batch's gradients are still on the parameters
    opt.zero_grad()
    _loss(model, 2).backward()
    opt.step()


# --------------------------------------------------------------------------------------------- delayed_update --
class LateAdamW:
    """The reference for ``delayed_update``: AdamW applied one step late. At step t it applies the (clipped)
    gradients of step t-1, with the hyperparameters and clip coefficient they had at step t-1. The first
    ``exact_steps`` steps are AdamW's own (``delayed_update=N``)."""

    def __init__(self, model, exact_steps=0, **kw):
        self.model, self.opt, self.prev = model, torch.optim.AdamW(model.parameters(), foreach=False, **kw), None
        self.exact_steps = exact_steps

    def step(self, clip=None):
        grads = [p.grad.clone() if p.grad is not None else None for p in self.model.parameters()]
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=False)
            grads = [p.grad.clone() if p.grad is not None else None for p in self.model.parameters()]
        else:
            norm = None
        if self.exact_steps:
            self.exact_steps -= 1
            self.opt.step()
            return norm
        if self.prev is not None:
            for p, g in zip(self.model.parameters(), self.prev):
                p.grad = g
            self.opt.step()
        self.prev = grads
        return norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("exact_steps", [0, 3])
def test_delayed_update_is_adamw_one_step_late(device, clip, exact_steps):
    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), delayed_update=exact_steps or True)
    ref = LateAdamW(ref_model, exact_steps)
    for step in range(30):
        ours.zero_grad()
        ref.opt.zero_grad()
        loss_fn(model, step, 0, device).backward()
        loss_fn(ref_model, step, 0, device).backward()
        norm = ours.clip_grad_norm_(clip) if clip is not None else None
        ref_norm = ref.step(clip)
        ours.step()
        if clip is not None:
            torch.testing.assert_close(norm.cpu(), ref_norm.cpu())
        if device == "cpu":
            assert_same(model, ref_model, ours, ref.opt, f"step {step}")
        else:  # the update runs in the worker: the state is only settled once flushed
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m: f"step {step}: {m}")
    ours.flush()
    ref.step()
    assert_same(model, ref_model, ours, ref.opt, "after flush")


def test_delayed_update_warmup_counts_from_the_state():
    """``delayed_update=N``: a run resumed during the N exact steps does the rest of them, not N more."""
    torch.manual_seed(0)
    model = TinyTransformer()
    resumed = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), delayed_update=4)
    other = OffloadOptimizer(resumed.parameters(), delayed_update=4)
    for step in range(8):
        if step == 2:
            saved = other.state_dict()
            other = OffloadOptimizer(resumed.parameters(), delayed_update=4)
            other.load_state_dict(saved)
        for m, opt in ((model, ours), (resumed, other)):
            opt.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            opt.step()
        for p, q in zip(model.parameters(), resumed.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("value", [-1, 2.5, "yes"])
def test_delayed_update_refuses_what_is_not_a_bool_or_a_count(value):
    with pytest.raises(ValueError, match="Invalid delayed_update"):
        OffloadOptimizer(TinyTransformer().parameters(), delayed_update=value)


@pytest.mark.parametrize("how", ["state_dict", "sharded_state_dict"])
def test_delayed_update_saving_shows_the_pending_update_and_leaves_it_pending(how):
    """The checkpoint holds the state after the pending update; the live optimizer still has it pending (the
    trajectory against a run that does not save is in test_delayed_save.py)."""
    torch.manual_seed(0)
    model = _bucketed_model()
    ours = OffloadOptimizer(model.parameters(), delayed_update=True)
    _loss(model, 0).backward()
    ours.step()
    before = [p.detach().clone() for p in model.parameters()]
    sd = getattr(ours, how)()
    assert len(sd["state"]) == len(before) and all(s["step"].item() == 1 for s in sd["state"].values())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not ours.state
    ours.zero_grad()
    ours.step()  # no new gradients: only the pending update lands
    assert all(s["step"].item() == 1 for s in ours.state.values()) and len(ours.state) == len(before)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("outer_params", [True, False], ids=["input_layer_outside", "all_checkpointed"])
@pytest.mark.parametrize("kw", [dict(release_grads=True), dict(release_grads=False),
                                dict(release_grads=True, overlap_step=True, nonfinite="ignore")],
                         ids=["release", "keep", "overlap"])
def test_activation_checkpointing_streams_each_bucket_once_per_backward(reentrant, outer_params, kw, monkeypatch):
    """checkpoint(use_reentrant=True) runs a backward per segment inside the outer one: its end must not be
    taken for the end of the step's backward (a bucket launched early would be launched again, and overlap_step
    would find it already updated). The first hooks fire inside a segment's backward; with ``outer_params`` the
    last ones fire in the outer backward itself."""
    from torch.utils.checkpoint import checkpoint

    model = _bucketed_model()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, bucket_numel=10**6, **kw)  # one bucket
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    launches = _record_launches(opt, monkeypatch)

    def forward(m, x):
        run = lambda lo, hi: (lambda h: m[lo:hi](h).relu())  # noqa: E731
        h = m[0](x) if outer_params else x.requires_grad_(reentrant)  # an input-side layer outside, as embeddings
        h = checkpoint(run(1 if outer_params else 0, 3), h, use_reentrant=reentrant)
        return checkpoint(run(3, 6), h, use_reentrant=reentrant)

    for step in range(4):
        x, y = _data(step)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            (forward(m, x.clone()) - y).pow(2).mean().backward()
            o.step()
        assert len(launches) == step + 1, "the bucket must launch once per backward"
        assert_same(model, ref_model, opt, ref, f"step {step}")


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed halfway")


@pytest.mark.parametrize("release", [True, False])
def test_streaming_recovers_after_a_backward_that_raised(release, monkeypatch):
    """A loop that skips a batch whose backward raised (an OOM, say) and goes on: the aborted backward's end
    never came, and the next ones must still stream every bucket as it completes."""
    model = _bucketed_model()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=release, bucket_numel=700)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    launched = _record_launches(opt, monkeypatch)
    for m, o in ((model, opt), (ref_model, ref)):
        x, _ = _data(0)
        with pytest.raises(RuntimeError, match="halfway"):
            m[3:](_FailingBackward.apply(m[:3](x))).pow(2).mean().backward()  # buckets of layers 3-5 went out
        o.zero_grad()
    assert launched
    for step in range(1, 4):
        launched.clear()
        for m, o in ((model, opt), (ref_model, ref)):
            _loss(m, step).backward()
            o.step()
            o.zero_grad()
        assert len(launched) == len(opt._buckets[0]), "every bucket streams once per backward"
        assert_same(model, ref_model, opt, ref, f"step {step}")


def test_hooks_record_nothing_under_create_graph():
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=True)
    _loss(model, 0).backward(create_graph=True)
    assert not any(b.grad.requires_grad for b in opt._buckets[0]), "the host copy became part of a graph"
    opt.step()


def test_dropping_the_optimizer_frees_its_buffers_and_disarms_its_hooks():
    model = _bucketed_model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True)
    master = weakref.ref(opt.host_buffers()[0]["exp_avg"])
    del opt
    gc.collect()
    assert master() is None, "the hooks on the parameters keep the optimizer's host buffers alive"
    _loss(model, 0).backward()  # hooks of a dropped optimizer do nothing
    assert all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------------------------------------ CUDA --
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_streaming_matches_gpu_adamw_with_an_oversized_layer(dtype):
    """A 32 x 131072 layer makes each copy long enough that a missing wait shows up as wrong numbers. A bf16
    model is compared with AdamW on an fp32 copy fed the same (upcast) bf16 gradients: ours keeps fp32 masters,
    so its parameters are the reference's rounded to bf16, to one bf16 ulp (rtol 2**-7; atol for values
    crossing zero, where the two fp32 trajectories may round differently)."""
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 131072), nn.Linear(131072, 8, bias=False))
    model = big.to("cuda", dtype)
    ref_model = copy.deepcopy(model).float()
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_numel=1 << 20)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, foreach=False)
    for step in range(32):
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.zero_grad()
        model(x.to(dtype)).float().pow(2).mean().backward()
        ref.zero_grad()
        if dtype == torch.float32:
            ref_model(x).pow(2).mean().backward()
        else:
            for p, q in zip(model.parameters(), ref_model.parameters()):
                q.grad = p.grad.float()
        opt.step()
        ref.step()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            if dtype == torch.float32:
                torch.testing.assert_close(p, q)
            else:
                torch.testing.assert_close(p, q.to(dtype), atol=1e-6, rtol=2**-7)
            torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"].cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_delayed_update_uploads_during_backward_with_an_oversized_layer(dtype):
    """delayed_update's new parameters copied up during the next backward (uploads_in_backward, the default) and
    into the parameters at step(), with a 32 x 131072 layer, so that a missing stream wait shows up as wrong
    numbers: AdamW one step late on an fp32 copy fed the same (upcast) gradients, every step (bf16: to one bf16
    ulp, as above); the copies were made during backward (the timeline's "h2d delayed"), and none holds device
    memory after step()."""
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 131072), nn.Linear(131072, 8, bias=False))
    model = big.to("cuda", dtype)
    ref_model = copy.deepcopy(model).float()
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_numel=1 << 20, delayed_update=True)
    opt.record_timeline()
    ref = LateAdamW(ref_model, lr=1e-3)
    staged = 0
    for step in range(24):
        x = torch.randn(16, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.zero_grad()
        model(x.to(dtype)).float().pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        staged += sum(e.kind == "copy" and e.what == "h2d delayed" for e in opt.timeline())
        assert all(lane.staged is None or lane.staged.flat.untyped_storage().nbytes() == 0
                   for lane in opt._transport.lanes), f"step {step}: a device copy held after step()"
        for p, q in zip(model.parameters(), ref_model.parameters()):
            if dtype == torch.float32:
                torch.testing.assert_close(p, q, msg=lambda m: f"step {step}: {m}")
            else:
                torch.testing.assert_close(p, q.to(dtype), atol=1e-6, rtol=2**-7, msg=lambda m: f"step {step}: {m}")
    assert staged > 0, "no device copy was made during backward"


@pytest.mark.cuda
def test_cuda_memory_holds_no_state_and_no_released_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(64, 1024, device="cuda")
    # A backward before the optimizer exists, dropped: cuBLAS takes its workspaces (allocated through PyTorch's
    # allocator and kept, one per thread and stream) here, so they are in the baseline.
    model(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # parameters, input, workspaces
    opt = OffloadOptimizer(model.parameters(), bucket_numel=1 << 20, release_grads=True)
    for _ in range(3):
        opt.zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        assert all(p.grad is None for p in model.parameters())
        # After backward: nothing more than before (activations freed); no gradients, no optimizer state.
        assert torch.cuda.memory_allocated() - base < 1 << 20
        # Peak during backward: activations plus at most a few buckets of gradients (4 MiB each), never all
        # 32 MiB of them.
        assert torch.cuda.max_memory_allocated() - base < param_bytes // 2
        opt.step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base < 1 << 20, "the optimizer keeps something on the GPU"


def test_delayed_update_host_memory_estimate_counts_its_second_gradient_buffer():
    model = _bucketed_model()
    est = OffloadOptimizer.estimate_host_memory(model.parameters(), delayed_update=True)
    opt = OffloadOptimizer(model.parameters(), delayed_update=True)
    assert est.total_bytes == opt.estimate_host_memory().total_bytes
    assert est.buffers["grad_prev"] == est.buffers["grad"] > 0
    assert est.total_bytes == sum(t.numel() * t.element_size() for b in opt.host_buffers() for t in b.values())


@pytest.mark.parametrize("release", [True, False])
@pytest.mark.parametrize("bucket_numel", [700, 10**6, 1])
def test_a_backward_retried_after_one_that_raised_sums_both_as_adamw(release, bucket_numel, monkeypatch):
    """A backward raises half-way (after some buckets streamed, with their gradients released), and the loop
    retries it without zero_grad(): AdamW steps with the sum of both passes for every parameter, and so must the
    streaming optimizer, whichever buckets the failed pass had sent, and its hooks must stream the retry."""
    model = _bucketed_model()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=release, bucket_numel=bucket_numel)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False)
    launched = _record_launches(opt, monkeypatch)
    for step in range(3):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            x, _ = _data(step)
            with pytest.raises(RuntimeError, match="halfway"):
                m[3:](_FailingBackward.apply(m[:3](x))).pow(2).mean().backward()
            if step == 0 and o is opt:
                assert launched or len(opt._buckets[0]) == 1, "the failed pass streamed some buckets"
                launched.clear()
            _loss(m, step).backward()  # the retry, without zero_grad()
            o.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")
    assert len(launched) >= len(opt._buckets[0]), "the retries streamed"
