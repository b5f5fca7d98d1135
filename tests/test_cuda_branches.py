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
import math
import threading

import pytest
import torch

import cuda_standins
import test_clip_order
from test_grad_stream import LateAdamW, _run_recipe
import test_optimizer
from test_optimizer import RECIPES, Recipe, TinyTransformer, assert_same, loss_fn, make_runs
from zero_offload import OffloadOptimizer
from zero_offload.transport import Route
from zero_offload.transport.device import OffloadRoute


@pytest.fixture
def cuda_branches(monkeypatch):
    # (the host route's CUDA branches: the default placement kept at the host, as on torch < 2.4, which has no fused
    # CPU AdamW to stand in for the GPU's; the other homes: test_placement.py)
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False, default_host=True)


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


def _log_uploads(monkeypatch) -> list:
    """Log every device copy made ahead of a commit (``("stage", bucket, made)``) and every upload (``("upload",
    bucket, from_device_copy)``), in order."""
    log = []
    stage, upload = OffloadRoute.stage, OffloadRoute.upload

    def logged_stage(self, lane, src, lanes, label):
        out = stage(self, lane, src, lanes, label)
        log.append(("stage", lane.position, out is not None))
        return out

    def logged_upload(self, lane, indices, srcs):
        staged = lane.staged
        on_device = (srcs is not None and staged is not None
                     and srcs[0].untyped_storage().data_ptr() == staged.flat.untyped_storage().data_ptr())
        log.append(("upload", lane.position, on_device))
        return upload(self, lane, indices, srcs)

    monkeypatch.setattr(OffloadRoute, "stage", logged_stage)
    monkeypatch.setattr(OffloadRoute, "upload", logged_upload)
    return log


def _worker_done(ours) -> None:
    """Wait for the pending delayed update's worker (what a real forward and backward would take long enough for)."""
    pending = ours._mode._pending
    if pending is not None and pending.job is not None:
        pending.job.result()


@pytest.mark.parametrize("case", ["room", "no_room", "margin", "off"])
def test_cuda_branches_delayed_update_uploads_during_backward(cuda_branches, monkeypatch, case):
    """delayed_update's new parameters go up during the next backward, into a device buffer per bucket, as soon as
    both the bucket's kernel has run and backward has sent the bucket's gradients; step() then copies them into the
    parameters device to device, so the parameters change only at step(). Where the device has no room (none, or
    not beyond gpu_margin_gib), or with uploads_in_backward=False, step() uploads from the host as before. Either
    way: AdamW one step late, every step, and nothing held on the device after step()."""
    log = _log_uploads(monkeypatch)
    room = case == "room"
    free = {"no_room": 0, "margin": 3 << 30}.get(case, 1 << 40)
    monkeypatch.setattr("zero_offload.transport.device.device_room", lambda device: free)
    kw = {"margin": dict(gpu_margin_gib=3.0), "off": dict(uploads_in_backward=False)}.get(case, {})
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), delayed_update=True, release_grads=True, bucket_numel=600, **kw)
    ref = LateAdamW(ref_model)
    lanes = ours._transport.lanes
    assert len(lanes) > 3
    for step in range(10):
        ours.zero_grad()
        ref.opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        loss_fn(model, step, 0, "cpu").backward()
        loss_fn(ref_model, step, 0, "cpu").backward()
        _worker_done(ours)
        for p, q in zip(model.parameters(), before):
            assert torch.equal(p, q), f"step {step}: a parameter changed before step()"
        staged_early = {b for kind, b, made in log if kind == "stage" and made}
        log.append(("step", None, None))
        ours.step()
        ref.step()
        at_step = log[log.index(("step", None, None)):]
        log.clear()
        uploaded = {b: on_device for kind, b, on_device in at_step if kind == "upload"}
        assert not [e for e in at_step if e[0] == "stage"], f"step {step}: staged during step()"
        if step == 0:
            assert not uploaded and not staged_early  # nothing pending yet
        else:
            assert uploaded, f"step {step}: no upload"
            # (A bucket without a gradient in the last step, aux's every third, has nothing pending.)
            assert staged_early == (set(uploaded) if room else set()), f"step {step}"
            assert all(uploaded[b] == room for b in uploaded), f"step {step}: {uploaded}"
        assert all(lane.staged is None or lane.staged.flat.untyped_storage().nbytes() == 0 for lane in lanes)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step}: {m}")
    ours.flush()
    ref.step()
    assert_same(model, ref_model, ours, ref.opt, "after flush")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_branches_delayed_update_low_precision_device_copies_equal_host_uploads(cuda_branches, monkeypatch,
                                                                                     dtype):
    """A low-precision model's device copies carry the kernel's rounded output (the gradient buffer that also
    carries the parameters out): the run equals, bit for bit, the same run uploading from the host."""
    log = _log_uploads(monkeypatch)
    torch.manual_seed(0)
    models = [TinyTransformer().to(dtype) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [OffloadOptimizer(m.parameters(), delayed_update=True, release_grads=True, bucket_numel=600)
            for m in models]
    stage = OffloadRoute.stage
    monkeypatch.setattr(OffloadRoute, "stage", lambda self, lane, src, lanes, label: (
        None if self.transport is opts[1]._transport else stage(self, lane, src, lanes, label)))
    for step in range(8):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss_fn(model, step, 0, "cpu").backward()
            _worker_done(opt)
            opt.step()
        for opt in opts:
            _worker_done(opt)  # (the state then holds the update pending in both)
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(p, q), f"step {step}: {name}"
            for key, value in opts[1].state[q].items():
                assert torch.equal(opts[0].state[p][key], value), f"step {step}: {name} {key}"
    assert any(e[0] == "upload" and e[2] for e in log), "no upload from a device copy"


def test_cuda_branches_delayed_update_gives_device_copies_back_when_the_step_does_not_come(cuda_branches,
                                                                                          monkeypatch):
    """A backward whose step() never comes (zero_grad() after it) or is skipped (an inf/nan with nonfinite="skip")
    gives the device copies it made back at once (the next forward does not hold them); the next backward makes
    them again, and the run is AdamW one step late over the steps that happened. A second micro-batch (no no_sync)
    reads the old parameters while the copies wait."""
    log = _log_uploads(monkeypatch)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(model.parameters(), delayed_update=True, release_grads=True, bucket_numel=600,
                            nonfinite="skip")
    ref = LateAdamW(ref_model)
    lanes = ours._transport.lanes
    held = lambda: sum(lane.staged.flat.untyped_storage().nbytes() for lane in lanes if lane.staged is not None)
    for step in range(9):
        ours.zero_grad()
        ref.opt.zero_grad()
        for micro in range(2):
            poison = float("nan") if (step, micro) == (6, 1) else 1.0  # step 6 is skipped: an inf/nan gradient
            (loss_fn(model, step, micro, "cpu") * poison).backward()
            loss_fn(ref_model, step, micro, "cpu").backward()
            _worker_done(ours)
        if step in (3, 6):
            assert held() > 0, f"step {step}: nothing staged"
            if step == 3:
                ours.zero_grad()  # the step is abandoned
            else:
                ours.step()  # skipped: counted, nothing applied
                assert ours.skipped_steps == 1
            assert held() == 0, f"step {step}: device copies kept after the step did not come"
            log.clear()
            continue
        log.clear()
        ours.step()
        ref.step()
        if step in (4, 7):  # the pending update, from before the step that did not come, staged again
            assert [e for e in log if e[0] == "upload"] and all(e[2] for e in log if e[0] == "upload")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step}: {m}")
    ours.flush()
    ref.step()
    assert_same(model, ref_model, ours, ref.opt, "after flush")


def test_cuda_branches_delayed_update_worker_finishing_after_an_abandoned_step_stages_nothing(cuda_branches,
                                                                                            monkeypatch):
    """The worker still running when a backward's step() does not come (zero_grad()): what it finishes later is
    not copied up until the next backward sends its gradients, so the next forward holds no device copy."""
    import zero_offload.update as update

    gate = threading.Event()
    real = update.update_bucket

    def gated(*args, **kwargs):
        gate.wait(timeout=60)
        return real(*args, **kwargs)

    torch.manual_seed(0)
    model = TinyTransformer()
    ours = OffloadOptimizer(model.parameters(), delayed_update=True, release_grads=True, bucket_numel=600)
    lanes = ours._transport.lanes
    held = lambda: sum(lane.staged.flat.untyped_storage().nbytes() for lane in lanes if lane.staged is not None)
    ours.zero_grad()
    loss_fn(model, 0, 0, "cpu").backward()
    ours.step()
    _worker_done(ours)
    monkeypatch.setattr(update, "update_bucket", gated)
    ours.zero_grad()
    loss_fn(model, 1, 0, "cpu").backward()
    ours.step()  # its update waits in the worker
    loss_fn(model, 2, 0, "cpu").backward()  # sends every bucket while the worker is held
    assert held() == 0
    ours.zero_grad()  # that step never comes
    gate.set()
    _worker_done(ours)
    assert held() == 0, "device copies made after the step was abandoned"
    loss_fn(model, 3, 0, "cpu").backward()  # the next backward copies them up
    assert held() > 0
    ours.step()
    assert held() == 0


# Low precision: uploads of the bf16/fp16 staging copy, and masters (re)initialised from parameters on the device.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_branches_low_precision_masters_match_adamw_on_fp32_copies(cuda_branches, dtype):
    test_optimizer.test_low_precision_params_have_fp32_masters_matching_adamw_on_fp32_copies(dtype, "cpu")


def test_cuda_branches_bf16_model_tracks_fp32_run(cuda_branches):
    test_optimizer.test_bf16_model_tracks_fp32_run_better_than_bf16_adamw("cpu")


def test_cuda_branches_reinitialise_a_master_changed_outside(cuda_branches):
    test_optimizer.test_parameter_changed_outside_the_optimizer_reinitialises_its_master()


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_cuda_branches_backward_after_clip_is_refused(cuda_branches, release):
    test_clip_order.backward_after_clip_is_refused(dict(release_grads=release), steps=3)


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released"])
def test_cuda_branches_nan_norm_clipped_under_ignore_matches_torch(cuda_branches, release):
    test_clip_order.nonfinite_clip_under_ignore_matches_torch(dict(release_grads=release), 0.5, math.nan)


@pytest.mark.parametrize("order", ["clip_unscale", "clip_no_unscale", "unscale_clip"])
def test_cuda_branches_clip_before_or_after_unscale_matches_torch(cuda_branches, order):
    test_clip_order.scaler_order_matches_torch({}, order)


@pytest.fixture
def gathers(monkeypatch):
    """The gradients copied into the host slots from here on (at clip_grad_norm_ or step(), not the ones streamed
    in backward)."""
    copied = []
    real = Route._slot_copies

    def slot_copies(bg):
        dsts, srcs = real(bg)
        copied.extend(srcs)
        return dsts, srcs

    monkeypatch.setattr(Route, "_slot_copies", staticmethod(slot_copies))
    return copied


def test_cuda_branches_unscale_then_clip_copies_nothing_again_at_step(cuda_branches, gathers):
    """The usual order (``unscale_``, clip, ``scaler.step``): ``step()`` looks again for an ``unscale_`` after the
    clip by the norms the clip kept, and finding none copies no gradient again."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(test_optimizer.param_groups(model))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(loss_fn(model, step, 0, "cpu")).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm_(0.5)
        gathers.clear()
        scaler.step(opt)
        scaler.update()
        assert not gathers, f"step {step}: {len(gathers)} gradients copied again"


def test_cuda_branches_clip_reuses_streamed_copies_and_notices_a_late_scaler(cuda_branches, gathers, caplog):
    """Without release_grads, clip_grad_norm_ re-reads the gradients only until a step has run without a
    GradScaler (whose unscale_ is the one in-place edit version counters miss). A scaler that appears later is
    noticed at step(), which clips again from the unscaled gradients: the trajectory stays AdamW's."""
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
