"""Speculation with validation (``speculate``), on CPU tensors with the CUDA stand-ins of test_cuda_branches.py.

Two references: ``torch.optim.AdamW`` (foreach=False) at default tolerance, as every test; and the same optimizer
with ``speculate=False``, *bitwise*, every step, parameters and state: a commit must be exactly the update
``step()`` computes, a rollback must leave exactly the state a run without speculation has.

Most tests make each speculation finish before backward goes on (the ``eager`` fixture), so which buckets were
speculated does not depend on thread timing and the commit/rollback counts can be asserted. One test runs the
worker freely and checks that the kernels start before ``step()`` is called, in the order backward sent them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import threading
import time

import pytest
import torch
import torch.nn as nn

import cuda_standins
from test_cuda_branches import CUDA_RECIPES
from test_optimizer import Recipe, Run, assert_same, make_runs
from zero_offload import OffloadOptimizer, speculation, undo
from zero_offload.options import Options
from zero_offload.transport.device import OffloadRoute

N_BUCKETS = 6


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch, needs_fused=False)


@pytest.fixture
def eager(cuda_branches, monkeypatch):
    """Each speculation completes (in the worker) before the hook that started it returns."""
    real = speculation._Worker.submit

    def submit(self, fn, *args):
        job = real(self, fn, *args)
        concurrent.futures.wait([job])
        return job

    monkeypatch.setattr(speculation._Worker, "submit", submit)


def assert_bitwise(model, other, opt, other_opt, where):
    """Parameters and every state tensor identical, bit for bit (NaN where the other has NaN)."""
    exact = dict(rtol=0, atol=0, equal_nan=True)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(p, q, **exact, msg=lambda m: f"{where}, param {name}: {m}")
        mine, theirs = opt.state.get(p, {}), other_opt.state.get(q, {})
        assert set(mine) == set(theirs), f"{where}, {name}: keys {set(mine)} vs {set(theirs)}"
        for key, value in theirs.items():
            torch.testing.assert_close(mine[key], value, **exact, msg=lambda m: f"{where}, {name}, {key}: {m}")


# -- the recipes of the streamed/optimizer tests --------------------------------------------------------------------
# Every recipe of the CUDA-branch tests (the streamed ones: speculate=True refuses stream_grads=False).
SPEC_RECIPES = [r for r in CUDA_RECIPES if r.ours_kw.get("stream_grads") is not False]


@pytest.mark.parametrize("recipe", SPEC_RECIPES, ids=lambda r: r.name)
def test_recipes_match_adamw_and_the_run_without_speculation(eager, recipe):
    steps = 14
    ours, ref = make_runs(dataclasses.replace(recipe, ours_kw={**recipe.ours_kw, "speculate": True}), "cpu")
    plain, _ = make_runs(dataclasses.replace(recipe, ours_kw={**recipe.ours_kw, "speculate": False}), "cpu")
    assert plain.opt.speculation_stats is None
    for step in range(steps):
        for run in (ours, ref, plain):
            run.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"{recipe.name} step {step}")
        assert_bitwise(ours.model, plain.model, ours.opt, plain.opt, f"{recipe.name} step {step}")
    stats = ours.opt.speculation_stats
    # (A recipe that clips every step stops speculating from its second step on: the norm passes max_norm.)
    assert stats.speculated > 0 or stats.not_started["stopped"] > 0, stats
    assert stats.commits + stats.rollbacks == stats.speculated, stats
    if recipe.clip is None and recipe.scaler is None and recipe.scheduler is None and recipe.accumulate == 1:
        # Nothing to refuse: every speculation is kept (the first step only initialises the masters). (A second
        # backward without no_sync is refused: test_a_second_backward_without_no_sync_is_not_speculated.)
        assert stats.rollbacks == 0 and stats.commits > 0, stats


# -- forced rollbacks, against the run without speculation ----------------------------------------------------------
def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(17, 17) for _ in range(N_BUCKETS)]).to(dtype)


def _loss(model, step):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 17, generator=gen), torch.randn(8, 17, generator=gen)
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).pow(2).mean()


def _pair(dtype=torch.float32, **kw):
    """(model, optimizer) with speculation, and an identical pair without."""
    a = _model(dtype)
    b = copy.deepcopy(a)
    spec = OffloadOptimizer(a.parameters(), bucket_numel=400, speculate=True, **kw)
    plain = OffloadOptimizer(b.parameters(), bucket_numel=400, speculate=False, **kw)
    assert len(spec._buckets[0]) == N_BUCKETS and not spec._buckets[0][0].on_cpu
    return (a, spec), (b, plain)


def _worker_done(step, model, opt):
    """Wait (as ``_drive``'s ``between``) until the speculation worker has done what backward gave it. In warm-up
    steps this also makes the undo pool learn a window of every bucket: a worker that a loaded machine left behind
    at the first speculating step would cap the next steps' leases at what it reached then."""
    if isinstance(opt._mode, speculation.Speculative):
        opt._mode._worker.submit(lambda: None).result()


def _drive(pairs, steps, between=None, scaler=False):
    """Train both pairs alike; ``between(step, model, opt)`` runs after backward, before ``step()``; returns how
    many steps raised, per pair."""
    raised = [0, 0]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3) if scaler else None
               for _ in pairs]
    for step in range(steps):
        for k, ((model, opt), sc) in enumerate(zip(pairs, scalers)):
            opt.zero_grad()
            loss = _loss(model, step)
            (sc.scale(loss) if sc else loss).backward()
            if between is not None:
                between(step, model, opt)
            try:
                if sc:
                    sc.step(opt)
                    sc.update()
                else:
                    opt.step()
            except RuntimeError as exc:
                assert "non-finite" in str(exc)
                raised[k] += 1
        (a, spec), (b, plain) = pairs
        assert_bitwise(a, b, spec, plain, f"step {step}")
    return raised


def _reasons(opt):
    return dict(opt.speculation_stats.reasons)


def test_clipping_active_rolls_back_then_stops_speculating(eager):
    pairs = _pair()
    _drive(pairs, 6, between=lambda step, m, opt: opt.clip_grad_norm_(1e-3) if step >= 2 else None)
    stats = pairs[0][1].speculation_stats
    # Step 1 commits; step 2, the first to clip, speculates every bucket and rolls back (coefficient < 1); from
    # then on the running norm passes the max_norm of the last step at the first bucket: speculation stops.
    assert _reasons(pairs[0][1]) == {"multiplier": N_BUCKETS}, stats
    assert stats.commits == N_BUCKETS and stats.not_started["stopped"] == 3 * N_BUCKETS, stats


def test_clipping_inactive_commits(eager):
    pairs = _pair()
    _drive(pairs, 6, between=lambda step, m, opt: opt.clip_grad_norm_(1e6))  # coefficient exactly 1.0
    stats = pairs[0][1].speculation_stats
    assert stats.rollbacks == 0 and stats.commits == 5 * N_BUCKETS, stats


def test_gradscaler_with_the_fused_clip_keeps_speculating(eager):
    """GradScaler and opt.clip_grad_norm_ with no unscale_ (clipping the still-scaled gradients, as torch's clip in
    that order): the clip finds the gradients as they were streamed (their norms unchanged since their copy), so
    the speculations stand; only a step whose scale changed (growth every 3 steps) rolls back, for its
    multiplier."""
    pairs = _pair()
    _drive(pairs, 7, between=lambda step, m, opt: opt.clip_grad_norm_(1e6), scaler=True)
    stats = pairs[0][1].speculation_stats
    assert set(_reasons(pairs[0][1])) <= {"multiplier"}, stats
    assert stats.commits >= 4 * N_BUCKETS, stats


@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_nonfinite_gradient_in_the_last_bucket(eager, policy, value):
    pairs = _pair(nonfinite=policy)
    for model, _ in pairs:
        model.training_step = 0  # the hook below reads it; set to the next step's number after each backward
        # The first layer's gradient is the last backward sends: every other bucket has been speculated.
        model[0].weight.register_hook(lambda g, model=model: g * value if model.training_step == 3 else g)
    raised = _drive(pairs, 6, between=lambda step, m, opt: setattr(m, "training_step", step + 1))
    spec = pairs[0][1]
    stats = spec.speculation_stats
    if policy == "ignore":  # applied, as AdamW would: the NaN/inf is in both runs' state, bit for bit
        assert stats.rollbacks == 0, stats
        assert raised == [0, 0]
    else:
        assert _reasons(spec) == {"skipped step": N_BUCKETS - 1}, stats
        assert stats.not_started["stopped"] == 1, stats
        assert raised == ([1, 1] if policy == "raise" else [0, 0])
        assert spec.skipped_steps == pairs[1][1].skipped_steps == (policy == "skip")


def test_gradscaler_overflow_rolls_back(eager):
    pairs = _pair()
    for model, _ in pairs:
        model.training_step = 0
        model[2].weight.register_hook(lambda g, model=model: g * float("inf") if model.training_step == 4 else g)
    _drive(pairs, 9, between=lambda step, m, opt: setattr(m, "training_step", step + 1), scaler=True)
    spec, plain = pairs[0][1], pairs[1][1]
    assert spec.skipped_steps == plain.skipped_steps
    reasons = _reasons(spec)
    # The overflow skips the step; the next one's scale (halved) is not the one guessed; growth every 3 steps
    # changes it again.
    assert reasons.get("skipped step", 0) >= 1 and reasons.get("multiplier", 0) >= 1, reasons
    assert spec.speculation_stats.commits > 0


def test_lr_changed_between_backward_and_step_rolls_back(eager):
    pairs = _pair()

    def halve_lr(step, model, opt):
        if step % 2:
            for g in opt.param_groups:
                g["lr"] *= 0.5

    _drive(pairs, 6, between=halve_lr)
    stats = pairs[0][1].speculation_stats
    assert _reasons(pairs[0][1]) == {"hyperparameters": 3 * N_BUCKETS}, stats
    assert stats.commits == 2 * N_BUCKETS, stats


def test_state_dict_between_backward_and_step_shows_the_state_before_the_step(eager):
    pairs = _pair()
    saved = []
    _drive(pairs, 4, between=lambda step, m, opt: saved.append(opt.state_dict()) if step == 2 else None)
    mine, theirs = saved
    for k, entry in theirs["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(mine["state"][k][name], value, rtol=0, atol=0)
    # The speculative state is in leased buffers until the commit: reading the state costs nothing, the step's
    # speculation is kept.
    stats = pairs[0][1].speculation_stats
    assert not stats.rollbacks and stats.commits == 3 * N_BUCKETS, stats


def test_zero_grad_after_backward_rolls_back(eager):
    pairs = _pair()
    _drive(pairs, 2)
    for model, opt in pairs:
        _loss(model, 7).backward()
        opt.zero_grad()  # the step never comes
    (a, spec), (b, plain) = pairs
    assert_bitwise(a, b, spec, plain, "after zero_grad")
    assert _reasons(spec) == {"no step": N_BUCKETS}
    _drive(pairs, 3)


def test_a_second_backward_without_no_sync_is_not_speculated(eager):
    pairs = _pair(release_grads=True)
    for step in range(4):
        for model, opt in pairs:
            opt.zero_grad()
            _loss(model, step).backward()
            _loss(model, step + 100).backward()  # accumulates: the first speculation read half the gradient
            opt.step()
        assert_bitwise(pairs[0][0], pairs[1][0], pairs[0][1], pairs[1][1], f"step {step}")
    stats = pairs[0][1].speculation_stats
    assert _reasons(pairs[0][1]) == {"gradients changed": 3 * N_BUCKETS}, stats
    assert stats.not_started["sent again"] == 4 * N_BUCKETS and stats.commits == 0


@pytest.mark.parametrize("kw", [dict(dtype=torch.bfloat16), dict(state_dtype=torch.int8, amsgrad=True),
                                dict(state_dtype=torch.bfloat16)], ids=["bf16_params", "int8_state", "bf16_state"])
def test_low_precision_params_and_compact_state(eager, kw):
    """bf16 parameters: the kernel's rounded output goes to a buffer of its own, not over the gradient (which a
    rollback needs); compact state: the 8-bit scales are saved and restored with the codes."""
    pairs = _pair(**kw)
    _drive(pairs, 6, between=lambda step, m, opt: opt.clip_grad_norm_(1e-3) if step in (2, 3) else None)
    stats = pairs[0][1].speculation_stats
    # Steps 1 and 5 commit, 2 rolls back (clipped); 3 and 4 stop at once (each expects a clip as the last step
    # had).
    assert stats.commits == 2 * N_BUCKETS and _reasons(pairs[0][1]) == {"multiplier": N_BUCKETS}, stats
    assert stats.not_started["stopped"] == 2 * N_BUCKETS, stats


# -- when the kernels run ---------------------------------------------------------------------------------------
def test_kernels_start_before_step_in_arrival_order(cuda_branches, monkeypatch):
    (model, opt), _ = _pair()
    ran = []
    real_kernel = speculation.run_rule

    def kernel(bucket, *args, **kw):
        ran.append((id(bucket), threading.current_thread() is threading.main_thread()))
        return real_kernel(bucket, *args, **kw)

    monkeypatch.setattr(speculation, "run_rule", kernel)
    sent = []
    real_send = opt._transport.send_grads
    monkeypatch.setattr(opt._transport, "send_grads", lambda lane: (sent.append(id(lane.bucket)), real_send(lane)))
    for step in range(3):
        opt.zero_grad()
        ran.clear()
        sent.clear()
        _loss(model, step).backward()
        if step == 0:
            opt.step()  # (the first step initialises the masters: nothing to speculate)
            continue
        deadline = time.monotonic() + 120
        while len(ran) < N_BUCKETS and time.monotonic() < deadline:
            time.sleep(0.01)  # step() is not called: the kernels run on their own
        assert [k for k, _ in ran] == sent, "kernels not run in the order backward sent the buckets"
        assert not any(main for _, main in ran), "a speculative kernel ran on the main thread"
        assert sent == [id(b) for b in reversed(opt._buckets[0])]
        opt.step()
    assert opt.speculation_stats.commits == 2 * N_BUCKETS


# -- options ---------------------------------------------------------------------------------------------------
def test_options():
    with pytest.raises(ValueError, match="alternatives"):
        Options(speculate=True, overlap_step=True, nonfinite="ignore").validate()
    with pytest.raises(ValueError, match="alternatives"):
        Options(speculate=True, delayed_update=True).validate()
    with pytest.raises(ValueError, match="process_group"):
        Options(speculate=True, sharded=True).validate()
    with pytest.raises(ValueError, match="streamed"):
        Options(speculate=True, stream_grads=False).validate()
    with pytest.raises(ValueError, match="Invalid speculate"):
        Options(speculate="yes").validate()
    # Off by default (measured slower than the plain step on an H100, docs/benchmarks.md); on when asked for.
    assert not Options().speculates and Options(speculate=True).speculates
    assert not Options(speculate=False).speculates and not Options(sharded=True).speculates


def test_cpu_model_is_not_speculated():
    model = _model()
    opt = OffloadOptimizer(model.parameters(), stream_grads=True, speculate=True)
    _loss(model, 0).backward()
    opt.step()
    assert opt.speculation_stats.speculated == 0 and not opt.speculation_stats.not_started


# -- the step timeline -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize("clip", [None, 1e6])
def test_host_waits_per_step_at_most_buckets_plus_two(eager, speculate, clip):
    """Each bucket's gradient copy is waited for once per step (by the worker or by step()), plus the one fetch
    of the GPU norms; an upload is waited for only if not complete, and a wait on an event already waited for
    and not recorded since is not made."""
    (model, opt), (plain_model, plain) = _pair()
    if not speculate:
        model, opt = plain_model, plain
    opt.record_timeline()
    for step in range(4):
        opt.timeline()
        opt.zero_grad()
        _loss(model, step).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
        events = opt.timeline()
        if step == 0:
            continue  # (the first step: masters initialised, and a clip re-reads the gradients for a scaler)
        waits = [e for e in events if e.kind == "wait"]
        assert len(waits) <= N_BUCKETS + 2, (step, [(e.what, e.bucket) for e in waits])
        assert sorted(e.bucket for e in waits if e.what == "d2h") == list(range(N_BUCKETS))
        kernels = [e for e in events if e.kind == "kernel"]
        assert sorted(e.bucket for e in kernels) == list(range(N_BUCKETS))
        if speculate:  # every kernel ran before step() began, in the order backward sent them
            (step_event,) = [e for e in events if e.kind == "step"]
            assert all(e.what == "speculative" and e.end <= step_event.start for e in kernels)
            assert [e.bucket for e in kernels] == list(reversed(range(N_BUCKETS)))
            assert sum(e.kind == "commit" for e in events) == N_BUCKETS
    opt.record_timeline(False)
    opt.zero_grad()
    _loss(model, 9).backward()
    opt.step()
    assert opt.timeline() == []


def test_timeline_shows_rollbacks_and_writes_a_chrome_trace(eager, tmp_path):
    from zero_offload import timeline

    (model, opt), _ = _pair()
    opt.record_timeline()
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        if step == 2:
            opt.clip_grad_norm_(1e-3)
        opt.step()
    events = opt.timeline()
    rolled = [e for e in events if e.kind == "rollback"]
    assert [e.what for e in rolled] == ["multiplier"] * N_BUCKETS
    assert not any(e.what in ("save", "restore") for e in events)  # (the update writes out of place: no copies)
    assert sum(e.kind == "copy" and e.what == "h2d speculative" for e in events) == 2 * N_BUCKETS
    table = timeline.breakdown(events)
    assert table["kernel speculative"]["count"] == 2 * N_BUCKETS and table["kernel step"]["count"] == 2 * N_BUCKETS
    path = tmp_path / "trace.json"
    timeline.chrome_trace(events, str(path))
    import json
    assert len(json.loads(path.read_text())["traceEvents"]) == len(events)


def test_no_speculation_without_host_memory_for_the_undo_buffers(eager, monkeypatch):
    monkeypatch.setattr(undo, "available_host_bytes", lambda: 1000)
    pairs = _pair()
    _drive(pairs, 3)
    stats = pairs[0][1].speculation_stats
    assert stats.speculated == 0 and stats.not_started["host memory"] == 2 * N_BUCKETS, stats


# -- the undo pool (speculation_memory) ------------------------------------------------------------------------------
def _lease_bytes(bucket):
    """What one speculation of ``bucket`` leases: master, state and scales (and a bf16/fp16 output), each from a
    64-byte boundary."""
    out = [bucket.layout.padded_numel * bucket.dtype.itemsize] if bucket.low_precision else []
    sizes = [bucket.master.nbytes, *(t.nbytes for t in bucket.store.flat.values()),
             *(t.nbytes for t in bucket.store.scales.values()), *out]
    return sum(-(-n // 64) * 64 for n in sizes)


@pytest.fixture
def pool_watch(monkeypatch):
    """Every lease taken (after it): (bytes held, cap), and every arena allocated, in bytes and by the name of the
    thread that made it."""
    seen = {"held": [], "made": [], "made_on": []}
    real_take, real_empty = undo.UndoPool.take, undo.empty_host

    def take(self, pieces):
        got = real_take(self, pieces)
        seen["held"].append((self.held_bytes, self.limit()))
        return got

    def empty_host(numel, dtype, *, pin=False):
        seen["made"].append(numel * dtype.itemsize)
        seen["made_on"].append(threading.current_thread().name)
        return real_empty(numel, dtype, pin=pin)

    monkeypatch.setattr(undo.UndoPool, "take", take)
    monkeypatch.setattr(undo, "empty_host", empty_host)
    return seen


@pytest.mark.parametrize("kw", [{}, dict(dtype=torch.bfloat16), dict(state_dtype=torch.int8, amsgrad=True)],
                         ids=["fp32", "bf16_params", "int8_state"])
def test_a_capped_pool_speculates_what_fits_and_updates_the_rest_at_step(eager, pool_watch, kw):
    one = _lease_bytes(_pair(**kw)[0][1]._buckets[0][0])  # (every bucket of _pair has one layout)
    cap = 2 * one + one // 2
    pairs = _pair(speculation_memory=cap, **kw)
    spec = pairs[0][1]
    _drive(pairs, 6, between=lambda step, m, opt: opt.clip_grad_norm_(1e-3) if step == 3 else None)
    stats = spec.speculation_stats
    # Each step from the second: the two buckets backward sends first fit, the four others are updated at step();
    # step 3 clips (its two roll back) and step 4 expects a clip (stopped at once).
    assert stats.not_started["undo pool full"] == 4 * (N_BUCKETS - 2), stats
    assert stats.commits == 3 * 2 and _reasons(spec) == {"multiplier": 2}, stats
    held = [h for h, _ in pool_watch["held"]]
    assert held and max(held) <= cap and all(limit == cap for _, limit in pool_watch["held"])
    assert spec.estimate_host_memory().buffers["undo"] == spec._mode.pool.held_bytes == 2 * one


def test_capped_pool_matches_adamw_every_step(eager, pool_watch):
    """A cap that holds some buckets of a model with buckets of several sizes: AdamW's trajectory (default
    tolerance), and the run without speculation's, bitwise."""
    cap = 20_000
    recipe = Recipe("capped", clip=1e6, ours_kw={"bucket_numel": 500, "speculation_memory": cap})
    ours, ref = make_runs(dataclasses.replace(recipe, ours_kw={**recipe.ours_kw, "speculate": True}), "cpu")
    plain, _ = make_runs(dataclasses.replace(recipe, ours_kw={"bucket_numel": 500, "speculate": False}), "cpu")
    sizes = {_lease_bytes(b) for bs in ours.opt._buckets for b in bs}
    assert len(sizes) > 2 and min(sizes) < cap < sum(sizes), sizes
    for step in range(8):
        for run in (ours, ref, plain):
            run.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"capped step {step}")
        assert_bitwise(ours.model, plain.model, ours.opt, plain.opt, f"capped step {step}")
    stats = ours.opt.speculation_stats
    assert stats.commits > 0 and stats.not_started["undo pool full"] > 0 and stats.rollbacks == 0, stats
    assert max(h for h, _ in pool_watch["held"]) <= cap


def test_the_default_pool_is_reused_step_after_step(eager, pool_watch):
    pairs = _pair()
    spec = pairs[0][1]
    held = []
    for step in range(12):
        _drive(pairs, 1) if step == 0 else _drive(pairs, 1, between=None)
        held.append((len(pool_watch["made"]), spec._mode.pool.held_bytes))
    # The first step initialises the masters; the second, the first to speculate, measures the window (here every
    # bucket: each speculation ends before backward goes on) and makes a spare set for each of the six buckets;
    # every later step reuses them: nothing allocated from then on.
    every = N_BUCKETS * _lease_bytes(spec._buckets[0][0])
    assert held[2:] == [held[2]] * 10 and held[2][1] == every, held
    assert spec.speculation_stats.commits == 11 * N_BUCKETS and not spec.speculation_stats.not_started["undo pool full"]
    est = spec.estimate_host_memory()
    assert est.buffers["undo"] == every and "undo" in est.describe()
    assert est.state_bytes == pairs[1][1].estimate_host_memory().state_bytes  # (the pool is not optimizer state)
    # The plan's row, given a cap above it, is every GPU bucket speculated at once: what the pool holds here.
    metas = [torch.empty_like(p, device="meta") for p in pairs[0][0].parameters()]
    planned = OffloadOptimizer.estimate_host_memory(metas, bucket_numel=400, speculation_memory=10**9)
    assert planned.buffers["undo"] == every
    assert OffloadOptimizer.estimate_host_memory(metas, bucket_numel=400, speculation_memory=1000).buffers["undo"] \
        == 1000
    assert "undo" not in OffloadOptimizer.estimate_host_memory(metas, bucket_numel=400).buffers


def test_speculation_memory_zero_turns_speculation_off(cuda_branches):
    (a, _), (b, plain) = _pair()
    off = OffloadOptimizer(a.parameters(), bucket_numel=400, speculation_memory=0)  # (speculate: None)
    assert off.speculation_stats is None and type(off._mode) is type(plain._mode)
    _drive([(a, off), (b, plain)], 3)
    with pytest.raises(ValueError, match="speculation_memory=0"):
        OffloadOptimizer(_model().parameters(), speculate=True, speculation_memory=0)


@pytest.mark.parametrize("value", [-1, 1.5, "1GB", True, float("nan"), float("inf")])
def test_bad_speculation_memory_is_refused_and_nothing_changes(cuda_branches, value):
    model = _model()
    before = [(p.data_ptr(), p._post_accumulate_grad_hooks) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"Invalid speculation_memory: .* \(a whole number of bytes >= 0"):
        OffloadOptimizer(model.parameters(), speculation_memory=value)
    with pytest.raises(ValueError, match="Invalid speculation_memory"):
        OffloadOptimizer.estimate_host_memory(model.parameters(), speculation_memory=value)
    assert [(p.data_ptr(), p._post_accumulate_grad_hooks) for p in model.parameters()] == before
    # (Where speculation is off, a cap has nothing to cap: accepted, as the same options may serve both.)
    assert OffloadOptimizer(model.parameters(), speculate=False, speculation_memory=2**30).speculation_stats is None
    assert OffloadOptimizer(model.parameters(), speculate=True, speculation_memory=8e3)._mode.pool.fixed == 8000


def test_learned_cap_grows_to_the_window_between_steps_and_gives_memory_back(pool_watch):
    """The pool alone: the first speculating step is measured (its buffers made as they are leased); after it, a
    lease that lacks a buffer is refused and what it lacked is made once the step has ended, on the pool's own
    thread; a wider window is found by doubling; steps that lease nothing let the cap, and the memory held, fall
    back to one bucket's."""
    made_on = pool_watch["made_on"]
    pool = undo.UndoPool()
    x = 4096
    piece = [("master", x // 4, torch.float32, False)]

    def step(n):
        leases = [pool.take(piece) for _ in range(n)]
        got = [lease for lease in leases if isinstance(lease, undo.Lease)]
        refused = collections.Counter(lease for lease in leases if isinstance(lease, str))
        held = pool.held_bytes
        for lease in got:
            pool.give_back(lease)
        pool.end_step(record=True)
        pool.wait_grown(60)
        return len(got), held, dict(refused)

    assert step(0) == (0, 0, {})  # (a step that sends buckets but asks for no lease, before any: not counted)
    assert step(3) == (3, 3 * x, {}) and pool.limit() == 4 * x
    # The window widens to 8. The five leases without buffers are refused, and count as one bucket more: the cap
    # becomes 5, and two buffers are made after the step.
    assert step(8) == (3, 3 * x, {"undo pool growing": 5}) and pool.limit() == 5 * x and pool.held_bytes == 5 * x
    # Five fit, three are over the cap: 2 * 5 + 1 demanded, and the three made after the step.
    assert step(8) == (5, 5 * x, {"undo pool full": 3}) and pool.limit() == 12 * x and pool.held_bytes == 8 * x
    assert step(8) == (8, 8 * x, {}) and pool.held_bytes == 8 * x
    assert made_on == [threading.current_thread().name] * 3 + ["zero_offload undo pool"] * 5
    for _ in range(undo.RECENT_STEPS):
        last = step(0)
    # Ten steps that lease nothing: the cap falls to one bucket's slack, and the free buffers beyond it go.
    assert last == (0, 8 * x, {}) and pool.limit() == x and pool.held_bytes <= x
    # A buffer given back serves the next lease of its size and pinning (whatever it holds); a piece of another
    # size is made after the step that asked for it.
    two = [("master", x // 4, torch.float32, False), ("exp_avg", 7, torch.bfloat16, False)]
    assert pool.take(two) == "undo pool growing"
    pool.end_step(record=True)
    pool.wait_grown(60)
    a = pool.take(two)
    assert isinstance(a, undo.Lease) and a.nbytes == x + 64 and a.buffers["exp_avg"].dtype == torch.bfloat16
    held, ptr = pool.held_bytes, a.buffers["master"].data_ptr()
    pool.give_back(a)
    b = pool.take(piece)
    assert b.buffers["master"].data_ptr() == ptr and pool.held_bytes == held
    pool.give_back(b)


def test_the_pool_grows_after_the_step_not_in_the_worker(eager, pool_watch, monkeypatch):
    """The first speculating step reaches one bucket (the worker is held back from the others). In the next, the
    buckets the pool has no buffers for are updated at step() ("undo pool growing") and their buffers made after
    it, on the pool's own thread, never the worker's; two steps later every bucket is speculated. Bit for bit the
    run without speculation at every step."""
    made_on = pool_watch["made_on"]
    pairs = _pair()
    (model, opt), _ = pairs
    real_why = speculation.Speculative._why_not
    allowed = [None]  # buckets the worker may still speculate this step (None: all)

    def why_not(self, spec):
        if allowed[0] is not None:
            if allowed[0] == 0:
                return "held back"
            allowed[0] -= 1
        return real_why(self, spec)

    monkeypatch.setattr(speculation.Speculative, "_why_not", why_not)
    pool = opt._mode.pool
    speculated = []
    for step in range(5):
        allowed[0] = 1 if step == 1 else None  # (step 0 initialises the masters: nothing is speculated)
        before = opt.speculation_stats.speculated
        for m, o in pairs:
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
        pool.wait_grown(60)
        speculated.append(opt.speculation_stats.speculated - before)
        assert_bitwise(pairs[0][0], pairs[1][0], opt, pairs[1][1], f"step {step}")
    stats = opt.speculation_stats
    # Step 2 finds one bucket's buffers and two more made after it (the cap: what it leased plus the bucket it
    # lacked, plus one bucket of slack); step 3 three, over the cap past them: 2 * 3 + 1 demanded.
    assert speculated == [0, 1, 1, 3, N_BUCKETS], (speculated, stats)
    assert stats.not_started["undo pool growing"] == N_BUCKETS - 1, stats
    assert stats.not_started["undo pool full"] == N_BUCKETS - 3, stats
    assert stats.commits == stats.speculated and stats.rollbacks == 0, stats
    per_lease = len(made_on) // N_BUCKETS
    assert pool.held_bytes == N_BUCKETS * _lease_bytes(opt._buckets[0][0])
    assert made_on[per_lease:] == ["zero_offload undo pool"] * (N_BUCKETS - 1) * per_lease, made_on
    assert made_on[0] != "zero_offload undo pool", made_on


def test_step_cancels_what_is_still_queued_before_waiting_for_the_running_one(cuda_branches, monkeypatch):
    """The worker is still on the first bucket backward sent when step() comes: the five queued behind it are
    updated at step() (waiting for each in turn let the worker start the next as the last ended: step() waited for
    the whole queue, and the undo pool was sized to every bucket)."""
    pairs = _pair()
    (model, opt), _ = pairs
    release, entered = threading.Event(), threading.Event()
    real_kernel, real_finish = speculation.run_rule, speculation.Speculative._finish

    def kernel(*args, **kw):
        entered.set()
        assert release.wait(120), "never released"
        return real_kernel(*args, **kw)

    def finish(self, spec):  # the first wait of step(): only now may the running speculation end
        release.set()
        return real_finish(self, spec)

    monkeypatch.setattr(speculation, "run_rule", kernel)
    monkeypatch.setattr(speculation.Speculative, "_finish", finish)
    _drive(pairs, 1)  # (the masters are initialised: nothing speculated, how far the worker got depends on timing)
    queued = opt.speculation_stats.not_started["queued at step()"]
    for step in range(1, 4):
        release.clear()
        entered.clear()
        for m, o in pairs:
            o.zero_grad()
            _loss(m, step).backward()
            if o is opt:  # (step() must find the worker on the first bucket, not yet started)
                assert entered.wait(120)
            o.step()
        assert_bitwise(pairs[0][0], pairs[1][0], opt, pairs[1][1], f"step {step}")
    stats = opt.speculation_stats
    assert stats.commits == 3 and stats.not_started["queued at step()"] - queued == 3 * (N_BUCKETS - 1), stats
    assert opt._mode.pool.held_bytes == _lease_bytes(opt._buckets[0][0])


# -- out of place, and the speculative uploads (issue 35) --------------------------------------------------------
def test_a_rollback_leaves_the_state_and_the_parameters_untouched(eager, monkeypatch):
    """The kernel writes into the lease: until the commit, nothing of the bucket changes (no save copy, no
    restore); a rollback (here every step clips) gives the lease back and the step runs as without speculation."""
    pairs = _pair()
    (a, spec), _ = pairs
    seen = []

    def between(step, model, opt):
        if opt is spec:  # every bucket speculated by now; its state and parameters as before
            seen.append([(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                         for p in model.parameters()])
        opt.clip_grad_norm_(1e-3)

    _drive(pairs, 2)
    before = [(p.detach().clone(), {k: v.clone() for k, v in spec.state[p].items()}) for p in a.parameters()]
    _drive(pairs, 1, between=lambda step, m, opt: between(step + 1, m, opt))
    for (p0, s0), (p1, s1) in zip(before, seen[0]):
        assert torch.equal(p0, p1) and all(torch.equal(s0[k], s1[k]) for k in s0)
    assert _reasons(spec) == {"multiplier": N_BUCKETS}


def test_speculative_uploads_go_up_before_step_and_wait_for_no_other_bucket(cuda_branches):
    """Each speculated bucket's new parameters are copied up right after its own kernel, in the worker, before
    step() is called; nothing the worker waits for between a bucket's kernel and its upload is another bucket's.
    The commit then copies device to device (the parameters change only at step())."""
    pairs = _pair()
    (a, spec), _ = pairs
    _drive(pairs, 2, between=_worker_done)
    spec.record_timeline()
    for model, opt in pairs:
        opt.zero_grad()
        _loss(model, 2).backward()
    _worker_done(2, None, spec)
    before = [p.detach().clone() for p in a.parameters()]
    events = spec.timeline()  # (taken before step(): all of this happened during backward)
    uploads = [e for e in events if e.kind == "copy" and e.what == "h2d speculative"]
    kernels = [e for e in events if e.kind == "kernel" and e.what == "speculative"]
    assert len(uploads) == len(kernels) == N_BUCKETS
    for kernel, upload in zip(kernels, uploads):
        assert kernel.bucket == upload.bucket and kernel.end <= upload.start
        between = [e for e in events if e.thread == kernel.thread and kernel.end <= e.start <= upload.start
                   and e.kind == "wait"]
        assert all(e.bucket == kernel.bucket for e in between), between
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))  # untouched until step()
    stats = spec.speculation_stats
    speculated, commits = stats.speculated, stats.commits
    assert speculated == stats.commits + stats.rollbacks + N_BUCKETS, stats  # (counted as each kernel ends)
    for _, opt in pairs:
        opt.step()
    (a, spec), (b, plain) = pairs
    assert_bitwise(a, b, spec, plain, "after the commit of staged uploads")
    assert stats.commits == commits + N_BUCKETS and stats.speculated == speculated, stats


def test_the_device_buffers_of_speculative_uploads_hold_memory_only_from_upload_to_commit(cuda_branches):
    """Each lane's device buffer (made once, with its views) holds its bytes from its speculative upload until the
    commit, or the rollback, gives them back: nothing stays on the device across steps."""
    pairs = _pair()
    (a, spec), _ = pairs
    _drive(pairs, 2, between=_worker_done)

    def held():
        return [lane.staged.flat.untyped_storage().nbytes() for lane in spec._transport.lanes
                if lane.staged is not None]

    for commit in (True, False):
        for model, opt in pairs:
            opt.zero_grad()
            _loss(model, 2).backward()
        _worker_done(2, None, spec)
        assert len(held()) == N_BUCKETS and all(held()), held()  # uploaded during backward
        if commit:
            for _, opt in pairs:
                opt.step()
            assert spec.speculation_stats.rollbacks == 0
        else:
            spec.zero_grad()  # the step abandoned: its speculation rolled back
        assert held() == [0] * N_BUCKETS, held()
    assert_bitwise(a, pairs[1][0], spec, pairs[1][1], "after a commit and an abandoned step")


def test_no_speculative_upload_without_room_on_the_device(eager, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 40))  # 1 MiB free
    staged = []
    real = OffloadRoute.stage
    monkeypatch.setattr(OffloadRoute, "stage", lambda *a: staged.append(real(*a)) or staged[-1])
    pairs = _pair()
    _drive(pairs, 3)
    assert pairs[0][1].speculation_stats.commits == 2 * N_BUCKETS
    assert staged == [None] * (2 * N_BUCKETS)  # no device buffer made: every commit uploaded from the host


@pytest.mark.parametrize("edit", ["mul_", "load_state_dict"])
def test_parameters_edited_between_backward_and_step_roll_back(eager, edit):
    """An edit of the parameters on the GPU after backward (issue 36) is seen by the commit, which rolls back: the
    step then reads the edited parameters, as AdamW and the run without speculation do."""
    pairs = _pair()
    ckpt = copy.deepcopy(pairs[0][0].state_dict())

    def between(step, model, opt):
        if step == 2:
            with torch.no_grad():
                if edit == "mul_":
                    model[3].weight.mul_(0.5)
                else:
                    model.load_state_dict(ckpt)

    _drive(pairs, 4, between=between)
    reasons = _reasons(pairs[0][1])
    assert reasons.get("parameters changed", 0) >= 1, reasons


def test_a_state_assignment_between_backward_and_step_reads_the_committed_state(eager):
    """``opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"] * 0.5`` after backward (issue 36) reads the state
    before this step's update (the speculative one is in the lease), then the speculation is dropped."""
    pairs = _pair()

    def between(step, model, opt):
        if step == 2:
            p = model[1].weight
            opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"] * 0.5

    _drive(pairs, 4, between=between)
    assert _reasons(pairs[0][1]) == {"state edited or replaced": N_BUCKETS}


@pytest.mark.parametrize("edit", ["zero_", "copy_"])
def test_a_state_edited_in_place_between_backward_and_step_rolls_back(eager, edit):
    """An in-place write into an ``opt.state`` tensor after backward is seen by the commit (the buffer's version
    counter), which rolls back: the step then reads the edited state, as the run without speculation does."""
    pairs = _pair()

    def between(step, model, opt):
        if step == 2:
            p = model[1].weight
            with torch.no_grad():
                if edit == "zero_":
                    opt.state[p]["exp_avg"].zero_()
                else:
                    opt.state[p]["exp_avg_sq"].copy_(opt.state[p]["exp_avg_sq"] * 2)

    _drive(pairs, 4, between=between)
    reasons = _reasons(pairs[0][1])
    assert reasons.get("state edited", 0) >= 1, reasons


@pytest.mark.parametrize("lr", ["0.1", None])
def test_an_invalid_lr_set_after_backward_is_refused_at_step_not_in_backward(eager, lr):
    (model, opt), _ = _pair()
    _drive([(model, opt)], 0)
    opt.param_groups[0]["lr"] = lr
    _loss(model, 0).backward()  # (the hooks read the hyperparameters to speculate: they must not raise)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((TypeError, ValueError)):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_amsgrad_switched_on_then_off_keeps_speculating(eager):
    pairs = _pair()

    def flip(step, model, opt):
        for g in opt.param_groups:
            g["amsgrad"] = step in (1, 2)

    _drive(pairs, 6, between=flip)  # (the bitwise check against the run without speculation, every step)
    stats = pairs[0][1].speculation_stats
    assert stats.commits > 0 and not stats.not_started["failed"], stats


def test_a_closure_that_raises_after_backward_leaves_the_state_as_it_was(eager):
    pairs = _pair()
    _drive(pairs, 2)
    for model, opt in pairs:
        before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state.items()}

        def closure(model=model):
            _loss(model, 5).backward()
            raise RuntimeError("data loader failed")

        with pytest.raises(RuntimeError, match="data loader"):
            opt.step(closure)
        for k, v in before.items():
            assert all(torch.equal(opt.state[k][n], t) for n, t in v.items())
    _drive(pairs, 2)
