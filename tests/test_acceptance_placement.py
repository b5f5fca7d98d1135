"""Acceptance of issue 52 (the parked home and placement), as a tester who read only the issue, README.md,
docs/placement.md and docs/options.md would check it: through the public API (``OffloadOptimizer``, ``offload``,
``state_dict``, ``clip_grad_norm_``, ``estimate_host_memory``, ``record_timeline``/``timeline``, the INFO log,
``benchmarks/step_model.py``), against ``torch.optim.AdamW(foreach=False)`` (or the torch class itself) every step,
parameters and state. The GPU is the stand-in of tests/cuda_standins.py (its ``cuda_branches`` fixture).

These exercise combinations the focused tests do not: the three homes in ONE param group with bf16 parameters, a
GradScaler's overflows landing in each home, clipping and an LR set after backward, all in one run; each ``nonfinite``
mode with the inf in each home, in one process and sharded over a gloo group of 2; ``opt.state`` edited in place
between backward and ``step()`` (in one process, and through FSDP2's DTensors at world 2 with the three homes); a
checkpoint saved parked and resumed under other shares, ``"auto"`` and through DCP, beside AdamW resumed from the same
checkpoint; Muon parked with weight decay, a scheduler and a parameter without a gradient every other step;
``"auto"``'s move as ``estimate_host_memory`` and the log tell it, and its memory contract; each GPU home's bytes in
the estimate against what a step holds (``gpu_state_bytes``); the timeline under gradient accumulation; the step
model's printed table as the docs quote it.

Which home holds a parameter is not public: ``_home_of`` (and the sharded and FSDP2 workers) peek at the buckets, only
to aim an inf at each home and to say that a run had all three. Tolerance: default fp32 (host buckets run our kernel, GPU-stepped ones torch's fused kernel: AdamW
within rounding, docs/twin-flow.md); bitwise for Muon (the class's own code on both sides, as the issue asks).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import subprocess
import sys
from itertools import chain

import pytest
import torch

import cuda_standins
from test_optimizer import TinyTransformer, loss_fn, param_groups
from zero_offload import OffloadOptimizer, offload

BUCKET = 300  # TinyTransformer in a dozen buckets
MIX = {"resident": 0.3, "parked": 0.4}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cuda_branches(monkeypatch):
    yield from cuda_standins.fixture_body(monkeypatch)


def _home_of(opt, p):
    return next(b.home.kind for b in chain.from_iterable(opt._buckets) if any(q is p for q in b.params))


def _homes(opt):
    return {kind: cost.buckets for kind, cost in opt.estimate_host_memory().homes.items() if cost.buckets}


def _same(params, ref_params, opt, ref, where, master=False, equal_nan=False):
    """Each parameter and its state against the reference's (``master``: the reference steps fp32 copies, which our
    fp32 masters must equal, the parameters being them rounded)."""
    for i, (p, q) in enumerate(zip(params, ref_params)):
        ours, theirs = opt.state.get(p, {}), ref.state.get(q, {})
        assert set(ours) - {"master"} == set(theirs), (where, i, set(ours), set(theirs))
        if master and theirs:
            torch.testing.assert_close(ours["master"], q.detach(), msg=lambda m: f"{where}, master {i}: {m}")
            assert torch.equal(p.detach(), ours["master"].to(p.dtype)), f"{where}: parameter {i} is not its master"
        elif master:  # (never stepped: as it was)
            assert torch.equal(p.detach(), q.detach().to(p.dtype)), f"{where}: parameter {i} changed"
        else:
            torch.testing.assert_close(p.detach(), q.detach(), equal_nan=equal_nan,
                                       msg=lambda m: f"{where}, param {i}: {m}")
        for key, value in theirs.items():
            torch.testing.assert_close(ours[key].cpu(), value.cpu(), equal_nan=equal_nan,
                                       msg=lambda m: f"{where}, param {i}, {key}: {m}")


def _pair(placement, **kw):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    opt = OffloadOptimizer(param_groups(model), bucket_numel=BUCKET, placement=placement, **kw)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    return model, ref_model, opt, ref


def _step_both(model, ref_model, opt, ref, step, clip=0.5):
    for o, m in ((opt, model), (ref, ref_model)):
        o.zero_grad()
        loss_fn(m, step, 0, "cpu").backward()
    if clip is not None:
        norm = opt.clip_grad_norm_(clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip, foreach=False)
        torch.testing.assert_close(torch.as_tensor(norm).float(), ref_norm, msg=lambda m: f"step {step} norm: {m}")
    opt.step()
    ref.step()


# -- the three homes in one param group, bf16 parameters, a GradScaler's overflows, clipping, an LR after backward --
def test_three_homes_in_one_group_bf16_scaler_overflow_clip_and_late_lr_are_adamw_on_fp32_masters(cuda_branches):
    """One param group over a bf16 model, placed resident / parked / host. Every step: the loss scaled, the gradients
    unscaled (``scaler.unscale_``) and clipped with ``opt.clip_grad_norm_``, the LR set after backward (when the
    parked state is already up), then ``scaler.step``. Three overflows, each an inf in a parameter of another home:
    the scaler skips the step, no home updates. Reference: AdamW on fp32 copies fed the same gradients (upcast,
    exact), under its own scaler."""
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad) for p in params]
    opt = OffloadOptimizer(model.parameters(), lr=2e-3, weight_decay=0.1, bucket_numel=BUCKET, placement=MIX)
    ref = torch.optim.AdamW(masters, lr=2e-3, weight_decay=0.1, foreach=False)
    assert _homes(opt).keys() == {"host", "parked", "resident"}, _homes(opt)
    trained = [p for p in params if p.requires_grad]
    targets = {}
    for p in (trained[0], trained[len(trained) // 2], trained[-1], *trained):
        targets.setdefault(_home_of(opt, p), p)
    assert targets.keys() == {"host", "parked", "resident"}
    overflow = dict(zip((2, 4, 6), targets.values()))  # (steps at which an inf lands in each home)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) for _ in range(2)]
    for step in range(8):
        opt.zero_grad()
        ref.zero_grad()
        scalers[0].scale(loss_fn(model, step, 0, "cpu")).backward()
        scalers[1].scale(torch.ones(()))  # (AdamW's gradients are ours, scaled by the same scale)
        if step in overflow:
            overflow[step].grad.view(-1)[1] = float("inf")
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float()
        for scaler, o in zip(scalers, (opt, ref)):
            scaler.unscale_(o)
        norm = opt.clip_grad_norm_(0.5)
        ref_norm = torch.nn.utils.clip_grad_norm_(masters, 0.5, foreach=False)
        if step not in overflow:
            torch.testing.assert_close(torch.as_tensor(norm).float(), ref_norm)
        for o in (opt, ref):
            for group in o.param_groups:
                group["lr"] = 1e-3 * (1 + step % 3)
        for scaler, o in zip(scalers, (opt, ref)):
            scaler.step(o)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        _same(params, masters, opt, ref, f"step {step}", master=True)


# -- nonfinite in each mode, the inf in each home ---------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
def test_each_nonfinite_mode_with_the_inf_in_each_home_is_decided_before_any_home_updates(cuda_branches, policy):
    """``"raise"`` and ``"skip"``: the step with an inf changes nothing in any home (AdamW never saw that step),
    the next goes on beside AdamW; ``"skip"`` counts it. ``"ignore"``: AdamW's behaviour, the inf applied as
    AdamW applies it (a NaN where it landed, the rest updated)."""
    for aim in ("resident", "parked", "host"):
        model, ref_model, opt, ref = _pair(MIX, nonfinite=policy)
        target = next(p for p in chain.from_iterable(g["params"] for g in opt.param_groups)
                      if _home_of(opt, p) == aim)
        index = next(i for i, p in enumerate(model.parameters()) if p is target)
        ref_target = list(ref_model.parameters())[index]
        _step_both(model, ref_model, opt, ref, 0)
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, 3, 0, "cpu").backward()
        target.grad.view(-1)[0] = float("inf")
        if policy == "raise":
            with pytest.raises(RuntimeError, match="non-finite"):
                opt.step()
        else:
            opt.step()
        if policy == "ignore":
            ref_target.grad.view(-1)[0] = float("inf")
            ref.step()
            assert torch.isnan(target).any(), f"{aim}: the inf was not applied"
            _same(model.parameters(), ref_model.parameters(), opt, ref, f"ignore, inf in {aim}", equal_nan=True)
            continue
        assert opt.skipped_steps == (policy == "skip"), aim
        _same(model.parameters(), ref_model.parameters(), opt, ref, f"{policy}, inf in {aim}")
        _step_both(model, ref_model, opt, ref, 4)
        _same(model.parameters(), ref_model.parameters(), opt, ref, f"{policy}, after the inf in {aim}")


# -- opt.state edited in place between backward and step() ---------------------------------------------------------
@pytest.mark.parametrize("placement", ["parked", "mix"])
def test_opt_state_edited_in_place_after_backward_is_the_state_the_step_updates(cuda_branches, placement):
    """A loop that rescales the moments after backward (``opt.state[p]["exp_avg"].mul_(0.5)``), once the parked
    state has come up for the step: AdamW's step updates the edited moments, and so must every home. (The parked home
    stepped the copy brought up before the edit: the edit was lost.)"""
    model, ref_model, opt, ref = _pair(MIX if placement == "mix" else placement)
    for step in range(5):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            for p in m.parameters():
                if step % 2 and p in o.state:
                    o.state[p]["exp_avg"].mul_(0.5)
                    o.state[p]["exp_avg_sq"].add_(1e-6)
            o.step()
        _same(model.parameters(), ref_model.parameters(), opt, ref, f"{placement}, step {step}")


# -- checkpoints do not depend on the placement --------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("into", ["shares", "auto", "dcp"])
def test_a_checkpoint_saved_parked_resumes_under_another_placement_beside_adamw(cuda_branches, into, tmp_path):
    """Saved after three steps under ``"parked"`` (AdamW's format, AdamW's values), resumed under other shares,
    ``"auto"`` (which moves the buckets after its second step) or through DCP's
    ``get/set_optimizer_state_dict`` (into a mix): the resumed run is AdamW resumed from the same checkpoint."""
    model, ref_model, opt, ref = _pair("parked")
    for step in range(3):
        _step_both(model, ref_model, opt, ref, step)
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert [{**g, "foreach": None} for g in sd["param_groups"]] == \
        [{**g, "foreach": None} for g in ref_sd["param_groups"]]  # (the reference runs with foreach=False)
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, entry in ref_sd["state"].items():
        assert sd["state"][k].keys() == entry.keys(), k
        for name, value in entry.items():
            torch.testing.assert_close(sd["state"][k][name], value, msg=lambda m: f"saved {k} {name}: {m}")
    resumed_model = TinyTransformer()
    resumed_model.load_state_dict(model.state_dict())
    placement = {"shares": {"resident": 0.5, "parked": 0.25}, "auto": "auto", "dcp": MIX}[into]
    resumed = OffloadOptimizer(param_groups(resumed_model), bucket_numel=BUCKET, placement=placement)
    if into == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path))
        loaded = {"optim": get_optimizer_state_dict(resumed_model, resumed)}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        set_optimizer_state_dict(resumed_model, resumed, loaded["optim"])
    else:
        resumed.load_state_dict(copy.deepcopy(sd))
    ref_model2 = TinyTransformer()
    ref_model2.load_state_dict(model.state_dict())
    ref2 = torch.optim.AdamW(param_groups(ref_model2), foreach=False)
    ref2.load_state_dict(copy.deepcopy(sd))
    for step in range(3, 7):
        _step_both(resumed_model, ref_model2, resumed, ref2, step)
        _same(resumed_model.parameters(), ref_model2.parameters(), resumed, ref2, f"{into}, step {step}")
    if into == "shares":
        assert _homes(resumed).keys() == {"resident", "parked", "host"}


# -- every class on the parked home: Muon, bitwise -------------------------------------------------------------------
def test_muon_parked_with_weight_decay_a_scheduler_and_a_sometimes_unused_parameter_is_bitwise_muon(cuda_branches):
    """``offload(torch.optim.Muon, placement="parked")`` against ``torch.optim.Muon`` over the same 2-D
    parameters: two groups (Muon's default weight decay, another one), a StepLR, one parameter with no gradient on
    odd steps, the momentum of some halved in place after backward now and then; parameters and every state tensor
    bit for bit, every step."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (33, 9), (4, 70), (1, 12), (13, 1), (20, 20)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]

    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.02, "lr": 0.01}]

    opt = offload(torch.optim.Muon, groups(ours), lr=0.02, placement="parked", bucket_numel=256)
    ref = torch.optim.Muon(groups(theirs), lr=0.02)
    assert _homes(opt).keys() == {"parked"}
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (opt, ref)]
    for step in range(7):
        for o, ps in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            g = torch.Generator().manual_seed(step)
            used = ps if step % 2 == 0 else [p for i, p in enumerate(ps) if i != 1]
            sum((torch.tanh(p) * torch.randn(p.shape, generator=g)).sum() ** 2 for p in used).backward()
            for p in ps[::2] if step % 3 == 2 else ():  # (after backward: the parked state is up)
                if p in o.state:
                    o.state[p]["momentum_buffer"].mul_(0.5)
            o.step()
        for s in scheds:
            s.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            assert torch.equal(p, q), f"step {step}: parameter {i}"
            assert set(opt.state[p]) == set(ref.state[q]), (step, i)
            for key, value in ref.state[q].items():
                assert torch.equal(opt.state[p][key], value), f"step {step}: {key} of parameter {i}"
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]


# -- "auto": the move, as the log and the estimate tell it ---------------------------------------------------------
def test_auto_moves_after_two_steps_as_its_log_says_and_the_estimate_shows_it(cuda_branches, caplog):
    """``placement="auto"``: the first two steps on the host; then the INFO line's counts are what
    ``estimate_host_memory().homes`` shows, a resident bucket holds no host RAM, the host RAM shrinks by what left
    the host; AdamW's trajectory throughout; the state dict after the move loads into AdamW."""
    model, ref_model, opt, ref = _pair("auto")
    before = opt.estimate_host_memory()
    assert _homes(opt).keys() == {"host"}
    with caplog.at_level(logging.INFO, logger="zero_offload"):
        for step in range(4):
            _step_both(model, ref_model, opt, ref, step)
            _same(model.parameters(), ref_model.parameters(), opt, ref, f"step {step}")
            if step == 0:
                assert _homes(opt).keys() == {"host"}, "moved after one step"
    (line,) = [r.getMessage() for r in caplog.records if "placement='auto'" in r.getMessage()]
    total, resident, parked = map(int, re.search(r"of (\d+) GPU buckets, (\d+) resident, (\d+) parked", line).groups())
    after = opt.estimate_host_memory()
    homes = {k: c.buckets for k, c in after.homes.items()}
    assert (homes.get("resident", 0), homes.get("parked", 0), sum(homes.values())) == (resident, parked, total), line
    assert resident + parked > 0, line
    if resident:
        assert after.homes["resident"].host_bytes == 0 and after.homes["resident"].gpu_bytes > 0
    assert after.total_bytes < before.total_bytes, "the host RAM of the buckets that left the host is still held"
    back = torch.optim.AdamW(param_groups(copy.deepcopy(model)), foreach=False)
    back.load_state_dict(opt.state_dict())
    for (k, entry), theirs in zip(back.state_dict()["state"].items(), ref.state_dict()["state"].values()):
        for name, value in theirs.items():
            torch.testing.assert_close(entry[name], value, msg=lambda m: f"state {k} {name}: {m}")


@pytest.mark.parametrize("freed,room", [(0, 0), (6400, 0), (6400, 5000), (10**6, 5000)])
def test_auto_keeps_the_memory_contract_resident_in_the_room_left_parked_in_what_backward_freed(
        cuda_branches, freed, room):
    """The contract: resident state only in the memory the steps' peak left free beyond ``gpu_margin_gib``
    (``room``), parked state only in what backward had freed by ``step()`` (``freed``: the peak less what was
    allocated then) and the room the resident state left; with a copy so fast that parking always pays. What the
    estimate says and what a step holds on the GPU (``gpu_state_bytes`` after backward) keep within it; AdamW's
    trajectory throughout. (The allocator's figures are faked, constant through the steps.)"""
    import zero_offload.cost_model as cost_model

    monkeypatch, peak = cuda_branches, 2**24
    monkeypatch.setattr(cost_model, "measure_copy_rate", lambda device, nbytes=0, up=True: 1e15)
    monkeypatch.setattr(cost_model, "measure_kernel_rate", lambda numel=0: 1e6)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30 + peak + room, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: peak - freed)
    model, ref_model, opt, ref = _pair("auto", gpu_margin_gib=1.0)
    held = []
    for step in range(4):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
        held.append(sum(opt.gpu_state_bytes().values()))
        opt.step()
        ref.step()
        _same(model.parameters(), ref_model.parameters(), opt, ref, f"step {step}")
    homes = opt.estimate_host_memory().homes
    resident = homes["resident"].gpu_bytes if "resident" in homes else 0
    parked = homes["parked"].gpu_bytes if "parked" in homes else 0
    assert resident <= room and parked <= freed + room - resident, (homes, freed, room)
    assert max(held) <= room + freed, held
    # (With little freed, a parked bucket's reload waits for step(): in backward the room must cover the gradients
    # still to come too, which the stand-in's static allocation count never sees freed.)
    assert held[-1] == resident + (parked if freed >= 10**6 else 0), held
    assert (resident > 0) == (room >= 3072) and (parked > 0) == (freed > 0), homes  # (3072: the smallest bucket's)


def test_what_the_estimate_says_a_gpu_home_holds_is_what_a_step_holds(cuda_branches):
    """``estimate_host_memory().homes``: a resident bucket's GPU bytes always, a parked one's from its reload in
    backward to its write-back in ``step()``; ``gpu_state_bytes()`` measured then says the same, fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = TinyTransformer().to(dtype)
        opt = OffloadOptimizer(model.parameters(), bucket_numel=BUCKET, placement=MIX)
        homes = opt.estimate_host_memory().homes
        for step in range(3):
            opt.zero_grad()
            loss_fn(model, step, 0, "cpu").backward()
            assert sum(opt.gpu_state_bytes().values()) == homes["resident"].gpu_bytes + homes["parked"].gpu_bytes
            opt.step()
            assert sum(opt.gpu_state_bytes().values()) == homes["resident"].gpu_bytes, (dtype, step)


# -- the timeline: reload in backward, GPU step and write-back in step(), under accumulation ------------------------
def test_under_accumulation_each_parked_bucket_comes_up_once_in_backward_and_goes_down_in_step(cuda_branches):
    """Three micro-batches a step, no ``no_sync``: per step each parked bucket that has gradients has one
    ``reload`` (issued in backward, before ``step()``), one ``gpu launch`` and one ``write-back`` inside ``step()``,
    in that order; nothing of it after ``step()`` returns, before the next forward; AdamW on the summed gradients."""
    model, ref_model, opt, ref = _pair("parked")
    opt.record_timeline()
    for step in range(3):
        for o, m in ((opt, model), (ref, ref_model)):
            o.zero_grad()
            for micro in range(3):
                (loss_fn(m, step, micro, "cpu") / 3).backward()
        backward = opt.timeline()
        opt.step()
        ref.step()
        stepping = opt.timeline()
        (span,) = [e for e in stepping if e.kind == "step"]
        reloads = [e.bucket for e in backward if e.what == "reload"]
        assert reloads and sorted(reloads) == sorted(set(reloads)), f"step {step}: {reloads}"
        assert not [e for e in stepping if e.what == "reload"], f"step {step}: a reload waited for step()"
        for bucket in reloads:
            (launch,) = [e for e in stepping if e.bucket == bucket and e.what == "gpu launch"]
            (written,) = [e for e in stepping if e.bucket == bucket and e.what == "write-back"]
            assert span.start <= launch.start <= launch.end <= written.start <= written.end <= span.end
        assert not opt.timeline(), "something ran after step() returned"
        _same(model.parameters(), ref_model.parameters(), opt, ref, f"step {step}")


# -- sharded over a process group (gloo, world 2): the three homes in one group, each nonfinite mode -------------
def _sharded_nonfinite_worker(rank, world, policy):
    """Each rank steps its shard of a mix (resident, parked, host in the first group) beside single-process AdamW on
    the whole batch, clipped, the LR set after backward; at step 2 an inf in rank 1's gradient of a parameter of
    each home in turn (steps 2, 3, 4): ``"skip"`` and ``"raise"`` change nothing anywhere (AdamW never saw those
    steps), ``"ignore"`` applies it as AdamW does to the summed gradient (a NaN where it landed)."""
    import test_distributed as td
    from test_placement_sharded import MIX as SHARDED_MIX, _make, _on_standins, _same as _same_sharded, groups

    _on_standins()
    model, opt, ref_model = _make(rank, SHARDED_MIX, nonfinite=policy)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
    homes = {b.home.kind: b.params[0] for b in opt._buckets[0]}  # (the peek: a parameter of each home)
    assert homes.keys() == {"resident", "parked", "host"}, homes
    aims = dict(zip((2, 3, 4), homes.values()))
    for step in range(6 if policy != "ignore" else 3):
        for o, m, rows in ((opt, model, td.rows_of(rank, world)), (ref, ref_model, slice(None))):
            o.zero_grad()
            td.loss_on(m, step, 0, rows).backward()
        bad = step in aims
        if bad:
            index = next(i for i, p in enumerate(model.parameters()) if p is aims[step])
            if rank == 1:
                aims[step].grad.view(-1)[0] = float("inf")
            list(ref_model.parameters())[index].grad.view(-1)[0] = float("inf")
        if not bad:
            norm = opt.clip_grad_norm_(0.3)
            torch.testing.assert_close(torch.as_tensor(norm).float(),
                                       torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.3, foreach=False))
        for o in (opt, ref):
            for group in o.param_groups:
                group["lr"] = 1e-3 * (step + 2)
        if bad and policy == "raise":
            with pytest.raises(RuntimeError, match="non-finite"):
                opt.step()
        else:
            opt.step()
        if not bad or policy == "ignore":
            ref.step()
        if policy == "ignore" and bad:
            td_params = list(zip(model.parameters(), ref_model.parameters()))
            assert any(torch.isnan(p).any() for p, _ in td_params), "the inf was not applied"
            for p, q in td_params:
                torch.testing.assert_close(p.detach(), q.detach(), equal_nan=True)
            sd, rsd = opt.state_dict()["state"], ref.state_dict()["state"]
            for k, entry in rsd.items():
                for name, value in entry.items():
                    torch.testing.assert_close(sd[k][name], value, equal_nan=True, msg=lambda m: f"{k} {name}: {m}")
        else:
            _same_sharded(model, ref_model, opt, ref, f"{policy}, step {step}")
    return opt.skipped_steps


@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
def test_sharded_three_homes_in_one_group_decide_each_nonfinite_mode_before_any_home_updates(policy):
    import test_distributed as td

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    skipped = td.launch(_sharded_nonfinite_worker, 2, policy)
    assert skipped[0] == skipped[1] == (3 if policy == "skip" else 0)


# -- under FSDP2 (gloo, world 2): the three homes in one group, opt.state edited in place after backward -----------
def _fsdp2_worker(rank, world):
    """Each rank's shards in a mix (resident, parked, host) beside FSDP2 + AdamW on the same model: clipped (ours by
    ``opt.clip_grad_norm_``, AdamW's by torch's), the LR set after backward, and on odd steps the moments edited in
    place through ``opt.state`` (DTensors) after backward; full parameters and moments compared every step."""
    import fsdp2_harness as h
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    with cuda_standins.installed():
        model, ref_model = h.build_model(world, h.Recipe()), h.build_model(world, h.Recipe())
        opt = OffloadOptimizer(model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY, bucket_numel=16,
                               placement=MIX)
        ref = torch.optim.AdamW(ref_model.parameters(), lr=h.LR, weight_decay=h.WEIGHT_DECAY, foreach=False)
        homes = sorted({b.home.kind for g in opt._buckets for b in g})
        for step in range(5):
            for o, m in ((opt, model), (ref, ref_model)):
                o.zero_grad()
                h.loss_on(m, step, 0, rank, world).backward()
            norm = opt.clip_grad_norm_(h.CLIP)
            torch.testing.assert_close(full(norm), full(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), h.CLIP)))
            for o, m in ((opt, model), (ref, ref_model)):
                for p in m.parameters():
                    if step % 2 and p in o.state:
                        o.state[p]["exp_avg"].mul_(0.5)
                for group in o.param_groups:
                    group["lr"] = h.LR * (step + 1)
                o.step()
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                torch.testing.assert_close(full(p).detach(), full(q).detach(), msg=lambda m: f"{step} {name}: {m}")
                assert set(opt.state.get(p, {})) == set(ref.state.get(q, {})), (step, name)
                for key in set(ref.state.get(q, {})) - {"step"}:
                    torch.testing.assert_close(full(opt.state[p][key]), full(ref.state[q][key]),
                                               msg=lambda m: f"step {step}, {name} {key}: {m}")
    return homes


def test_fsdp2_three_homes_with_opt_state_edited_in_place_after_backward_are_adamw():
    import fsdp2_harness as h
    import test_distributed as td

    if h.fully_shard is None or not torch.distributed.is_available():
        pytest.skip("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6 and torch.distributed")
    homes = td.launch(_fsdp2_worker, 2, timeout=200)
    assert homes[0] == homes[1] == ["host", "parked", "resident"], homes


# -- the step model prints what the docs quote ---------------------------------------------------------------------
def test_the_step_models_capped_rows_are_the_ones_docs_placement_quotes():
    """``benchmarks/step_model.py`` prints the homes' rows (the all-host, all-parked and ``"auto"`` placements, at a
    GPU capped at the all-host peak + 1 GiB); docs/placement.md's table and the README quote its figures. (The event
    model it runs lives beside the repository, in ``../shared/gpu/model``: skipped where that is absent.)"""
    if not os.path.exists(os.path.join(os.path.dirname(ROOT), "shared", "gpu", "model", "sim.py")):
        pytest.skip("benchmarks/step_model.py's event model (../shared/gpu/model/sim.py) is not here")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "step_model.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, check=True).stdout
    printed = {}
    for line in out.splitlines():
        m = re.match(r"placement='(\w+)'(, \w+( GPU)?)?\s+(\S+)\s+(\d+)/(\d+)/(\d+)\s+([\d.]+)\s+([\d.]+)x", line)
        if m:
            printed[(m.group(1), (m.group(2) or "").strip(", "))] = m.group(4, 5, 6, 7, 8, 9)
    assert len(printed) == 4, out
    with open(os.path.join(ROOT, "docs", "placement.md")) as f:
        docs = f.read()
    for (placement, which), (gib, host, parked, resident, ms, ratio) in printed.items():
        label = f'`"{placement}"`' + (f", {which}" if which else "")
        row = f"| {label} | {'all' if gib == 'all' else gib} | {host} / {parked} / {resident} | {ms} | {ratio}x |"
        assert row in docs, f"docs/placement.md does not quote {row}"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert f"{printed[('auto', 'capped')][5]}x at the all-host peak + 1 GiB" in readme
