"""The CUDA-only branches of the optimizer's Python code, run on CPU tensors in CPU-only CI.

Without a GPU the ``cuda`` tests skip, and with them every line that runs only for parameters on CUDA: launches
on the copy stream, the landing buffer of host accumulation, the bucket norms computed beside the copies, the
uploads (from ``step()``, from the ``overlap_step`` worker, from a ``delayed_update`` flush). Here those branches
run on CPU tensors: the buckets are told their parameters are on ``cuda:0``, and streams and events are
stand-ins that do nothing (a CPU copy is complete when it returns). That catches what the Python in those
branches can get wrong (grad mode in the worker thread, a buffer swapped the wrong way, a wrong argument),
against AdamW at default tolerance like every other test. It cannot catch a missing stream wait or
``record_stream``: the ``cuda`` tests, with a layer large enough to expose one, are for that.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import cuda_standins
from test_grad_stream import LateAdamW, _run_recipe
import test_optimizer
from test_optimizer import RECIPES, Recipe, TinyTransformer, assert_same, loss_fn, make_runs
from zero_offload import OffloadOptimizer
from zero_offload.transport import Route


@pytest.fixture
def cuda_branches(monkeypatch):
    planned = cuda_standins.install(monkeypatch.setattr)
    yield
    assert planned, "no optimizer was built on the stand-in device"


# Streaming is the default for CUDA parameters: no stream_grads here.
CUDA_RECIPES = (
    [dataclasses.replace(r, name=f"{r.name}+release", ours_kw={**r.ours_kw, "release_grads": True}) for r in RECIPES
     if r.name in ("adamw", "amsgrad", "clip", "clip_inf_norm", "accumulate", "closure", "add_param_group")]
    + [dataclasses.replace(r, ours_kw={**r.ours_kw, "release_grads": False}) for r in RECIPES]
    + [Recipe("accumulate_no_sync+release", accumulate=3, clip=0.5, no_sync=True, ours_kw={"release_grads": True}),
       Recipe("accumulate_host+release", accumulate=3, clip=0.5, ours_kw={"release_grads": True}),
       Recipe("not_streamed", clip=0.5, ours_kw={"stream_grads": False})]
)


@pytest.mark.parametrize("recipe", CUDA_RECIPES, ids=lambda r: r.name)
def test_cuda_branches_match_adamw_every_step(cuda_branches, recipe):
    _run_recipe(recipe, "cpu", steps=25)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_cuda_branches_overlap_step_uploads_from_the_worker(cuda_branches, accumulate):
    kw = dict(release_grads=True, overlap_step=True, nonfinite="ignore")
    recipe = Recipe(f"overlap_acc{accumulate}", accumulate=accumulate, no_sync=True, ours_kw=kw,
                    scheduler=lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=10))
    _run_recipe(recipe, "cpu", steps=12)


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("exact_steps", [0, 3])
def test_cuda_branches_delayed_update_is_adamw_one_step_late(cuda_branches, clip, exact_steps):
    """On CUDA the delayed update runs in the worker thread and uploads at the next step() or flush():
    parameters are compared every step, the whole state once flushed."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), delayed_update=exact_steps or True, release_grads=True)
    assert not ours._buckets[0][0].on_cpu
    ref = LateAdamW(ref_model, exact_steps)
    for step in range(12):
        ours.zero_grad()
        ref.opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        loss_fn(ref_model, step, 0, "cpu").backward()
        norm = ours.clip_grad_norm_(clip) if clip is not None else None
        ref_norm = ref.step(clip)
        ours.step()
        if clip is not None:
            torch.testing.assert_close(norm, ref_norm)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step}: {m}")
        if step == 6:
            ours.flush()  # applies the pending update (and uploads it) from the main thread
            ref.step()
            ref.prev = None
            assert_same(model, ref_model, ours, ref.opt, f"flush at step {step}")
    ours.flush()
    ref.step()
    assert_same(model, ref_model, ours, ref.opt, "after flush")


# Low precision: uploads of the bf16/fp16 staging copy, and masters (re)initialised from parameters on the device.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_branches_low_precision_masters_match_adamw_on_fp32_copies(cuda_branches, dtype):
    test_optimizer.test_low_precision_params_have_fp32_masters_matching_adamw_on_fp32_copies(dtype, "cpu")


def test_cuda_branches_bf16_model_tracks_fp32_run(cuda_branches):
    test_optimizer.test_bf16_model_tracks_fp32_run_better_than_bf16_adamw("cpu")


def test_cuda_branches_reinitialise_a_master_changed_outside(cuda_branches):
    test_optimizer.test_parameter_changed_outside_the_optimizer_reinitialises_its_master()


def test_cuda_branches_clip_reuses_streamed_copies_and_notices_a_late_scaler(cuda_branches, monkeypatch, caplog):
    """Without release_grads, clip_grad_norm_ re-reads the gradients only until a step has run without a
    GradScaler (whose unscale_ is the one in-place edit version counters miss). A scaler that appears later is
    noticed at step(), which clips again from the unscaled gradients: the trajectory stays AdamW's."""
    gathers = []  # gradients copied again at clip_grad_norm_ or step() (not the ones streamed already)
    real = Route._slot_copies

    def slot_copies(bg):
        dsts, srcs = real(bg)
        gathers.extend(srcs)
        return dsts, srcs

    monkeypatch.setattr(Route, "_slot_copies", staticmethod(slot_copies))
    ours, ref = make_runs(Recipe("late_scaler", scaler="unscale", clip=0.5), "cpu")
    scalers = ours.scaler, ref.scaler
    ours.scaler = ref.scaler = None
    for step in range(12):
        if step == 6:
            ours.scaler, ref.scaler = scalers
        gathers.clear()
        ours.step(step)
        ref.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"step {step}")
        if 1 <= step < 6:
            assert not gathers, f"step {step}: gradients streamed in backward were copied again"
        if step != 6:  # at the switch, the norm clip_grad_norm_ returned was of the scaled gradients
            torch.testing.assert_close(ours.norms[-1], ref.norms[-1])
    assert "clip_grad_norm_ was redone" in caplog.text
