"""Where each bucket's state lives (``placement``): on the host and stepped there, resident on the GPU, or parked on
the host between steps and stepped on the GPU (zero_offload/state/parked_home.py), alone or mixed in one param
group. On CPU-only machines the GPU is the stand-in of tests/cuda_standins.py (the buckets are told their parameters
are on ``cuda:0``; their "device" buffers are CPU tensors; streams and events order nothing), and torch's fused CPU
kernel stands in for its CUDA kernel: the Python of each home runs for real, against AdamW every step.

Tolerance: default fp32. The host buckets run our kernel, the GPU-stepped ones torch's fused kernel; both are AdamW
within float rounding (docs/twin-flow.md). Parked and resident buckets run the same kernel on the same values: they
are compared bit for bit.
"""

from __future__ import annotations

import copy
from itertools import chain

import pytest
import torch

import cuda_standins
from test_cuda_branches import CUDA_RECIPES
from test_grad_stream import _run_recipe
from test_optimizer import TinyTransformer, assert_same, loss_fn, param_groups
from test_twin_flow import (BUCKET, _buckets, _save, _train, _with, check_an_inf_changes_nothing, check_refused,
                            clipped_step_beside_adamw, fake_gpu_memory, host_only_rule)
from zero_offload import OffloadOptimizer

MIX = {"resident": 0.3, "parked": 0.4}  # TinyTransformer's first group: 1 bucket resident, 2 parked, 3 host


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _homes(opt):
    return [[b.home.kind for b in group] for group in opt._buckets]


# Every recipe of the CUDA branches (clipping in each norm, accumulation, GradScaler with overflow, schedulers,
# closures, add_param_group, release_grads, zero_grad(set_to_none=False), not streamed), every bucket parked; and
# the three homes in one param group.
@pytest.mark.parametrize("placement", ["parked", "mix"])
@pytest.mark.parametrize("recipe", CUDA_RECIPES, ids=lambda r: r.name)
def test_each_placement_matches_adamw_every_step(cuda_branches, recipe, placement):
    opt = _run_recipe(_with(recipe, placement=MIX if placement == "mix" else placement), "cpu", steps=25)
    homes = _homes(opt)
    if placement == "parked":
        assert all(h == "parked" for h in chain.from_iterable(homes)), homes
    else:
        assert set(homes[0]) == {"host", "resident", "parked"}, homes
    # A parked bucket's gradients stay where autograd left them: no gradient buffer of its own (but
    # zero_grad(set_to_none=False) of a bucket not streamed makes the .grad tensors views of one, as on the GPU).
    made = [b.grads.allocated for b in _buckets(opt) if b.home.kind == "parked"]
    keeps = not recipe.set_to_none and recipe.ours_kw.get("stream_grads") is False
    assert all(made) if keeps else not any(made), made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parked_buckets_are_bitwise_the_resident_ones(cuda_branches, dtype):
    """Parked and resident state are stepped by the same kernel from the same values: the same trajectory, bit for
    bit (a bf16 model's fp32 masters parked too), whatever travelled in between."""
    torch.manual_seed(0)
    model = TinyTransformer().to(dtype)
    twin_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
    twin = OffloadOptimizer(param_groups(twin_model), bucket_numel=BUCKET, placement="resident")
    for step in range(5):
        _train(opt, model, 1, start=step, clip=0.5)
        _train(twin, twin_model, 1, start=step, clip=0.5)
        for p, q in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(p, q), step
            for key, value in opt.state[p].items():
                assert torch.equal(value, twin.state[q][key]), (step, key)
    assert ("master" in opt.state[next(model.parameters())]) == (dtype != torch.float32)


def test_a_parked_buckets_state_comes_up_in_backward_and_goes_down_before_the_next_forward(cuda_branches):
    """The reload of each parked bucket is issued by backward's hook once the bucket's gradients are final, before
    ``step()``; its write-back is issued inside ``step()``, so before the next forward; both on the copy streams,
    and only what the state holds travels (no gradient copy, no upload)."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
    opt.record_timeline()
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        backward_end = opt.timeline()  # (taken now: what happened up to here)
        stepped = [i for i, b in enumerate(_buckets(opt)) if any(p.grad is not None for p in b.params)]
        assert len(stepped) > 5 and sorted(e.bucket for e in backward_end if e.what == "reload") == stepped, (
            f"step {step}: not every bucket with a gradient came up in backward")
        opt.step()
        events = opt.timeline()
        (step_span,) = [e for e in events if e.kind == "step"]
        written = [e for e in events if e.what == "write-back"]
        assert sorted(e.bucket for e in written) == stepped
        assert all(step_span.start <= e.start and e.end <= step_span.end for e in written)
        # Down in the order they came up (backward's): the next backward's first reloads find theirs landed.
        came_up = [e.bucket for e in sorted(backward_end, key=lambda e: e.start) if e.what == "reload"]
        assert [e.bucket for e in sorted(written, key=lambda e: e.start)] == came_up
        assert not [e for e in events + backward_end if e.what in ("d2h", "h2d")], "a gradient or parameter moved"


def test_the_timeline_has_each_gpu_buckets_reload_gpu_step_and_write_back_in_order(cuda_branches):
    """Per step, each parked bucket's spans: "reload" issued in backward (before ``step()`` begins), then its GPU
    step ("gpu launch") and its "write-back" inside ``step()``, in that order, each once; a resident bucket's GPU
    step has its span too, a host bucket's kernel its "step". Every write-back is issued before the next backward's
    first hook (the forward runs between them). From the first step: its ``step()`` makes torch's plain
    ``opt.state`` the optimizer's own map without letting go of the state brought up in backward."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=MIX)
    homes = [b.home.kind for b in _buckets(opt)]
    opt.record_timeline()
    last_write_back = None
    for step in range(4):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        backward = opt.timeline()
        stepped = [any(p.grad is not None for p in b.params) for b in _buckets(opt)]
        assert sum(stepped) > 5
        if last_write_back is not None:
            assert backward and min(e.start for e in backward) >= last_write_back, f"step {step}: a write-back late"
        opt.step()
        stepping = opt.timeline()
        (step_span,) = [e for e in stepping if e.kind == "step"]
        for i, home in enumerate(homes):
            spans = {what: [e for e in backward + stepping if e.bucket == i and e.what == what]
                     for what in ("reload", "gpu launch", "write-back", "step")}
            counts = {what: len(found) for what, found in spans.items()}
            if not stepped[i]:  # (no gradient this step: nothing to do)
                assert not any(counts.values()), (step, i, counts)
            elif home == "parked":
                assert counts == {"reload": 1, "gpu launch": 1, "write-back": 1, "step": 0}, (step, i, counts)
                (reload,), (launch,), (written,) = spans["reload"], spans["gpu launch"], spans["write-back"]
                assert reload.end <= step_span.start, (step, i, "the reload was not issued in backward")
                assert reload.end <= launch.start and launch.end <= written.start <= written.end <= step_span.end
            elif home == "resident":
                assert counts == {"reload": 0, "gpu launch": 1, "write-back": 0, "step": 0}, (step, i, counts)
                assert step_span.start <= spans["gpu launch"][0].start
            else:
                assert counts == {"reload": 0, "gpu launch": 0, "write-back": 0, "step": 1}, (step, i, counts)
        last_write_back = max(e.end for e in stepping if e.what == "write-back")


@pytest.mark.parametrize("placement", ["parked", "mix"])
def test_the_first_step_updates_the_state_brought_up_in_backward(cuda_branches, placement):
    """The first ``step()`` (torch's plain ``opt.state`` still in place) steps each parked bucket from the copy its
    backward brought up, as every later step: one reload per parked bucket with a gradient, issued before
    ``step()``, none at ``step()``; parameters and state are AdamW's."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET,
                           placement=MIX if placement == "mix" else placement)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    parked = [i for i, b in enumerate(_buckets(opt)) if b.home.kind == "parked"]
    assert parked
    opt.record_timeline()
    for step in range(3):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
        backward = [e for e in opt.timeline() if e.what == "reload"]
        stepped = [i for i in parked if any(p.grad is not None for p in _buckets(opt)[i].params)]
        assert stepped and sorted(e.bucket for e in backward) == stepped, f"step {step}: not brought up in backward"
        opt.step()
        ref.step()
        again = [e.bucket for e in opt.timeline() if e.what == "reload"]
        assert not again, f"step {step}: buckets {again} brought up again at step()"
        assert_same(model, ref_model, opt, ref, f"{placement}, step {step}")


def test_an_edit_of_the_first_opt_state_is_the_state_the_first_step_updates(cuda_branches):
    """An entry put into torch's plain ``opt.state`` between backward and the first ``step()`` lands in the host
    buffers, and the state brought up in backward (before the edit) is let go: the step updates the edited state,
    as AdamW's does."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    (p, q) = next((p, q) for p, q in zip(model.parameters(), ref_model.parameters()) if p.dim() == 2)
    edit = {"step": torch.tensor(4.0), "exp_avg": torch.randn_like(p) * 1e-2,
            "exp_avg_sq": torch.rand_like(p) * 1e-4}
    for o, m, w in ((opt, model, p), (ref, ref_model, q)):
        o.zero_grad()
        loss_fn(m, 0, 0, "cpu").backward()
        o.state[w] = {k: v.clone() for k, v in edit.items()}
    assert any(b.home.twins is not None for b in _buckets(opt)), "nothing came up in backward"
    opt.step()
    ref.step()
    assert_same(model, ref_model, opt, ref, "edited before the first step")
    _train(opt, model, 1, start=1)
    _train(ref, ref_model, 1, start=1)
    assert_same(model, ref_model, opt, ref, "the step after")


@pytest.mark.parametrize("read", ["[]", "get", "items", "values"])
def test_reading_opt_state_after_step_waits_for_the_write_backs(cuda_branches, read):
    """A parked bucket's state goes back down after ``step()`` returns: the first read of ``opt.state`` after it
    waits for those copies (every home settled), later reads wait for nothing; the values are AdamW's."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    settled = []
    for bucket in _buckets(opt):
        real = bucket.home.settle
        cuda_branches.setattr(bucket.home, "settle", lambda real=real, b=bucket: (settled.append(b), real())[1])
    first = next(iter(model.parameters()))
    reads = {"[]": lambda: opt.state[first], "get": lambda: opt.state.get(first),
             "items": lambda: list(opt.state.items()), "values": lambda: list(opt.state.values())}
    for step in range(2):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
        opt.step()
        ref.step()
        settled.clear()
        reads[read]()
        assert [id(b) for b in settled] == [id(b) for b in _buckets(opt)], "the first read waited for nothing"
        settled.clear()
        reads[read]()
        assert not settled, "a later read waited again"
        assert_same(model, ref_model, opt, ref, f"step {step}")


def test_without_room_in_backward_the_state_comes_up_at_step(cuda_branches):
    """Where the GPU has no room for a bucket's state during backward (beyond ``gpu_margin_gib`` and the gradients
    still to come), or with ``uploads_in_backward=False``, it comes up at ``step()``: the same trajectory."""
    cuda_branches.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 1 << 40))  # 1 MiB free
    for kw in ({}, {"uploads_in_backward": False}):
        torch.manual_seed(0)
        model = TinyTransformer()
        ref_model = copy.deepcopy(model)
        opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked", gpu_margin_gib=0.5,
                               **kw)
        ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
        opt.record_timeline()
        for step in range(3):
            for o, m in ((opt, model), (ref, ref_model)):
                o.zero_grad()
                loss_fn(m, step, 0, "cpu").backward()
            assert not [e for e in opt.timeline() if e.what == "reload"], kw
            stepped = [i for i, b in enumerate(_buckets(opt)) if any(p.grad is not None for p in b.params)]
            opt.step()
            ref.step()
            assert_same(model, ref_model, opt, ref, f"{kw}, step {step}")
            assert sorted(e.bucket for e in opt.timeline() if e.what == "reload") == stepped


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nonfinite_gradient_leaves_every_home_as_it_was(cuda_branches, policy):
    """The gate decides before any home updates: an inf in a parked bucket's gradient (its state already brought
    up in backward) changes no parameter and no state, in any home, and the next step goes on from there."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=MIX, nonfinite=policy)
    _train(opt, model, 3)
    check_an_inf_changes_nothing(opt, model, next(b.params[0] for b in _buckets(opt) if b.home.kind == "parked"),
                                 policy)
    assert all(b.home.twins is None for b in _buckets(opt) if b.home.kind == "parked"), "device copies kept"
    _train(opt, model, 1, start=4)


def test_an_lr_set_after_backward_is_the_one_every_home_steps_with(cuda_branches):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=MIX)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for step in range(4):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            for group in o.param_groups:  # (after the parked state came up in backward)
                group["lr"] = 1e-3 * (step + 2)
            o.step()
        assert_same(model, ref_model, opt, ref, f"step {step}")


@pytest.mark.parametrize("saved,loaded", [("parked", "host"), ("host", "parked"), (MIX, "parked"),
                                          ("parked", "adamw"), ("adamw", "parked")])
def test_a_state_dict_loads_under_any_placement(cuda_branches, saved, loaded):
    """AdamW's format whatever the homes: saved mid-run under one placement (or by AdamW), loaded under another
    (or into AdamW), the runs go on together with the uninterrupted one."""

    def make(model, placement):
        if placement == "adamw":
            return torch.optim.AdamW(param_groups(model), foreach=False)
        return OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=placement)

    torch.manual_seed(0)
    model = TinyTransformer()
    opt = make(model, saved)
    for step in range(4):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
    ckpt = _save({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed_model = TinyTransformer()
    resumed_model.load_state_dict(ckpt["model"])
    resumed = make(resumed_model, loaded)
    resumed.load_state_dict(ckpt["opt"])
    for step in range(4, 8):
        for o, m in ((opt, model), (resumed, resumed_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            o.step()
        assert_same(model, resumed_model, opt, resumed, f"{saved} -> {loaded}, step {step}")


def test_a_load_between_backward_and_step_is_the_state_the_step_updates(cuda_branches):
    """The state a parked bucket brought up in backward is let go when another is loaded before ``step()``: the
    step updates the loaded state, as AdamW's does."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    for o, m in ((opt, model), (ref, ref_model)):
        _train(o, m, 3)
    ckpt = copy.deepcopy(ref.state_dict())
    for o, m in ((opt, model), (ref, ref_model)):
        _train(o, m, 2, start=3)
        o.zero_grad()
        loss_fn(m, 5, 0, "cpu").backward()
        o.load_state_dict(ckpt)
        o.step()
    assert_same(model, ref_model, opt, ref, "loaded between backward and step()")


def test_a_parked_bucket_holds_its_state_on_the_host_only(cuda_branches):
    """Host RAM: a parked bucket's moments (and a bf16 model's fp32 master), no gradient or parameter copy; the
    plan before building says the same bytes."""
    for dtype, per_param in ((torch.float32, 8), (torch.bfloat16, 12)):
        torch.manual_seed(0)
        model = TinyTransformer().to(dtype)
        opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="parked")
        held = opt.estimate_host_memory()
        assert held.buffers.get("grad", 0) == 0 and held.buffers.get("staging", 0) == 0
        padded = sum(b.layout.padded_numel for b in _buckets(opt))
        assert held.total_bytes == per_param * padded, dtype
        planned = OffloadOptimizer.estimate_host_memory(param_groups(model), bucket_numel=BUCKET, placement="parked")
        assert planned.total_bytes == held.total_bytes
        mixed = OffloadOptimizer(param_groups(copy.deepcopy(model)), bucket_numel=BUCKET, placement=MIX)
        assert OffloadOptimizer.estimate_host_memory(param_groups(model), bucket_numel=BUCKET,
                                                     placement=MIX).total_bytes == mixed.estimate_host_memory().total_bytes


@pytest.mark.parametrize("kw,match", [
    (dict(placement="gpu"), "Invalid placement"),
    (dict(placement={"parked": 0.7, "resident": 0.4}), "Invalid placement"),
    (dict(placement={"host": 0.5}), "Invalid placement"),
    (dict(placement="parked", gpu_fraction=0.5), "alias"),
    (dict(placement="parked", state_dtype=torch.bfloat16), "fp32 state only"),
    (dict(placement="parked", overlap_step=True, nonfinite="ignore"), "not combined"),
    (dict(placement="parked", delayed_update=True), "not combined"),
])
def test_bad_placements_are_refused(kw, match):
    check_refused(kw, match)


def test_the_resident_share_is_gpu_fractions_alias_with_what_gpu_fraction_takes(cuda_branches):
    """``placement={"resident": f}`` places as ``gpu_fraction=f`` and takes what it takes (a process group, as every
    placement now: tests/test_placement_sharded.py)."""
    import dataclasses

    from zero_offload.options import Options

    model = TinyTransformer()
    alias = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement={"resident": 0.5})
    fraction = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, gpu_fraction=0.5)
    assert _homes(alias) == _homes(fraction) and "resident" in chain.from_iterable(_homes(alias))
    for placement in ({"resident": 0.5}, {"resident": 0.2, "parked": 0.2}, "parked", "auto"):
        dataclasses.replace(Options(placement=placement), sharded=True).validate()


def test_a_rule_without_a_gpu_update_refuses_a_gpu_placement():
    rule = host_only_rule()
    with pytest.raises(ValueError, match="placement='parked': HostOnly has no GPU update"):
        OffloadOptimizer._with_rule(TinyTransformer().parameters(), rule, dict(rule.defaults), placement="parked")


@pytest.mark.parametrize("placement", ["parked", "resident", "auto"])
def test_a_cpu_model_is_stepped_on_the_host_whatever_the_placement(placement):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=placement)
    _train(opt, model, 3)  # ("auto" places after the second step)
    assert all(h == "host" for h in chain.from_iterable(_homes(opt)))


# -- placement="auto": the cost model, and the move after the first step --------------------------------------------
def _cost(numel, arrival, nbytes=None):
    from zero_offload.cost_model import BucketCost

    return BucketCost(numel, 8 * numel if nbytes is None else nbytes, 8 * numel if nbytes is None else nbytes, arrival)


def test_the_cost_model_balances_host_kernels_against_reloads():
    """By hand: four buckets of 100 elements arriving at 0, 1, 2, 3 s; the kernel does 100 elements a second, the
    copies 800 bytes a second each way (one bucket's state a second)."""
    from zero_offload.cost_model import Rates, plan_homes

    buckets = [_cost(100, t) for t in (0.0, 1.0, 2.0, 3.0)]
    rates = Rates(kernel=100.0, upload=800.0, download=800.0)
    # No room anywhere: every bucket on the host (4 s of kernels after backward).
    assert plan_homes(buckets, rates, 0, 0, forward=10.0) == ["host"] * 4
    # Room for one resident bucket: the last to arrive. Then parking: bucket 0 reloads 0-1 s (tail max(2, -2)),
    # bucket 1 1-2 s (tail max(1, -1)), bucket 2 2-3 s (tail max(0, 0) = 0 < 1): all three parked, their
    # write-backs down 3 s after backward, within a 10 s forward.
    assert plan_homes(buckets, rates, 800, 10**6, forward=10.0) == ["parked", "parked", "parked", "resident"]
    # A slow upload (a bucket's state in 4 s): parking bucket 0 ends its reload at 4 s, 1 s after backward, which
    # beats 3 s of kernels (tail 2 s); bucket 1 would end at 8 s (tail 5 s > 2 s): one parked.
    assert plan_homes(buckets, Rates(100.0, 200.0, 200.0), 800, 10**6, forward=10.0) == \
        ["parked", "host", "host", "resident"]
    # Parked room for one bucket's state only: the earliest.
    assert plan_homes(buckets, rates, 0, 800, forward=10.0) == ["parked", "host", "host", "host"]
    # Buckets backward did not send count as arriving at its end: no time to hide a reload.
    late = [_cost(100, None), _cost(100, 0.0), _cost(100, 3.0)]
    assert plan_homes(late, Rates(100.0, 200.0, 200.0), 0, 10**6, forward=10.0) == ["host", "parked", "host"]


def test_the_cost_model_parks_only_what_is_written_back_before_the_forward_needs_it():
    """The next forward claims back what backward freed: the parked state beyond the room the step leaves must be
    down by the forward's end. Four buckets as above, no resident room; each parked bucket's write-back takes 1 s
    once backward has ended."""
    from zero_offload.cost_model import Rates, plan_homes

    buckets = [_cost(100, t) for t in (0.0, 1.0, 2.0, 3.0)]
    rates = Rates(kernel=100.0, upload=800.0, download=800.0)
    # Parking buckets 0-2 leaves a tail of 1 s (bucket 3's kernel); their write-backs end 3 s after backward,
    # within the tail and a 2 s forward.
    assert plan_homes(buckets, rates, 0, 10**6, forward=2.0) == ["parked", "parked", "parked", "host"]
    # No forward to hide them behind: the write-backs must end within the step's tail. Two parked leave 2 s of
    # kernels and their write-backs end at 2 s; a third would end at 3 s, after a 1 s tail.
    assert plan_homes(buckets, rates, 0, 10**6, forward=0.0) == ["parked", "parked", "host", "host"]
    # A slow download (2 s a bucket): the first write-back ends at 2 s, within its 3 s tail; the second at 4 s,
    # after a 2 s tail.
    assert plan_homes(buckets, Rates(100.0, 800.0, 400.0), 0, 10**6) == ["parked", "host", "host", "host"]
    # At 4 s a bucket even the first outlasts the tail: nothing parked.
    assert plan_homes(buckets, Rates(100.0, 800.0, 200.0), 0, 10**6) == ["host"] * 4
    # Room the step leaves beside the resident bucket may stay held through the forward: with a 1.2 s forward, no
    # room leaves two parked (the third write-back would end at 3 s, after a 1 s tail and the forward); 700 bytes
    # to spare (0.875 s of write-back) make it three.
    five = buckets + [_cost(100, 4.0, nbytes=1700)]
    assert plan_homes(five, rates, 1700, 10**6, forward=1.2) == ["parked", "parked", "host", "host", "resident"]
    assert plan_homes(five, rates, 2400, 10**6, forward=1.2) == ["parked", "parked", "parked", "host", "resident"]


def test_the_cost_model_counts_a_sharded_buckets_gradient_shard_in_its_room_not_its_copies():
    """A sharded bucket holds its shard of the reduced gradients on the GPU through the step in either GPU home
    (``held_bytes``): it takes parked room as its state does, but is not copied. The four buckets of the first cost
    test, each with 400 bytes of gradient shard (4 B for each of 100 fp32 elements of the shard)."""
    from zero_offload.cost_model import BucketCost, Rates, plan_homes

    rates = Rates(kernel=100.0, upload=800.0, download=800.0)
    sharded = [BucketCost(100, 800, 1200, t, 400) for t in (0.0, 1.0, 2.0, 3.0)]
    # Room for three buckets' state alone (2400) parks only two with their gradient shards (1200 each).
    assert plan_homes(sharded, rates, 0, 2400, forward=10.0) == ["parked", "parked", "host", "host"]
    assert plan_homes(sharded, rates, 0, 3600, forward=10.0) == ["parked", "parked", "parked", "host"]
    # Not copied: at 200 B/s each way and 200 elements/s (2 s of kernels), bucket 0's 800 bytes of state land 1 s
    # after backward (backward ends at 3 s), a tail of max(1.5, 1) < 2 s: parked. Had its 400 bytes of gradients
    # been copied too, they would land 3 s after backward: a longer tail than the host's, nothing parked.
    slow = Rates(kernel=200.0, upload=200.0, download=200.0)
    assert plan_homes(sharded, slow, 0, 10**6, forward=10.0) == ["parked", "host", "host", "host"]
    copied = [BucketCost(100, 1200, 1200, t) for t in (0.0, 1.0, 2.0, 3.0)]
    assert plan_homes(copied, slow, 0, 10**6, forward=10.0) == ["host"] * 4
    # Resident: the room a bucket takes is its state and its gradient shard (1200): 1199 fits none, 1200 the last.
    assert plan_homes(sharded, rates, 1199, 0, forward=10.0) == ["host"] * 4
    assert plan_homes(sharded, rates, 1200, 0, forward=10.0) == ["host", "host", "host", "resident"]


@pytest.mark.parametrize("upload,expect", [(1e15, {"resident", "parked"}), (1.0, {"resident", "host"})])
def test_auto_moves_each_bucket_to_its_cheapest_home_after_the_first_step(cuda_branches, upload, expect):
    """``placement="auto"``: the first two steps run every bucket on the host and are measured; after them the
    buckets go where the cost model says (here: a fast upload parks everything the resident room left; a slow one parks
    nothing), and the trajectory stays AdamW's across the move."""
    import zero_offload.cost_model as cost_model

    monkeypatch = cuda_branches
    monkeypatch.setattr(cost_model, "measure_copy_rate", lambda device, nbytes=0, up=True: upload)
    monkeypatch.setattr(cost_model, "measure_kernel_rate", lambda numel=0: 1e6)
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement="auto", gpu_margin_gib=1.0)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    last = max(_buckets(opt), key=lambda b: b.device_cost())
    assert set(chain.from_iterable(_homes(opt))) == {"host"}
    # Room for the largest bucket's state beyond the peak (1 MiB) and the margin; backward freed 1 MiB by step().
    free = 2**30 + 2**20 + last.device_cost()
    fake_gpu_memory(monkeypatch, free, peak=2**20, allocated=0)
    for step in range(5):
        clipped_step_beside_adamw(opt, model, ref, ref_model, step)
        homes = set(chain.from_iterable(_homes(opt)))
        assert homes == ({"host"} if step == 0 else expect), (step, homes)  # (placed once, after the second step)
    resident = [b for b in _buckets(opt) if b.home.kind == "resident"]
    assert len(resident) >= 1 and sum(b.device_cost() for b in resident) <= last.device_cost()


# -- on a real GPU (skipped without one; in the lease plan's `pytest -m cuda`) --------------------------------------
GPU_RECIPES = [r for r in CUDA_RECIPES if r.name in ("clip", "accumulate_no_sync+release")]


@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["parked", "mix"])
@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda r: r.name)
def test_each_placement_on_a_gpu_matches_adamw(recipe, placement):
    """On a GPU: every bucket parked, and the three homes in one param group, against AdamW on the GPU every step
    (torch's fused CUDA kernel, the reloads and write-backs on the copy streams, the norm on the GPU); the parked
    state between steps in host memory."""
    opt = _run_recipe(_with(recipe, placement=MIX if placement == "mix" else placement), "cuda", steps=10)
    parked = [b for b in _buckets(opt) if b.home.kind == "parked"]
    assert parked and not any(t.is_cuda for b in parked for t in b.home.parked().values())
    assert all(b.home.twins is None for b in parked)

