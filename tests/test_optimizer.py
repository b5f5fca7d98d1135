"""OffloadOptimizer against its reference, ``torch.optim.AdamW`` / ``Adam`` with ``foreach=False``, on a small
transformer-like model (embeddings, attention, MLP, LayerNorms, biases, a no-decay group, a head that only some
steps use): parameters and every state tensor are compared at default ``torch.testing.assert_close`` tolerance
after every step, for every feature. Then checkpoints in both directions, bf16 masters against AdamW on fp32
copies, host memory, and bad input that must raise and leave everything unchanged.

Every body runs on CPU; the same bodies run on CUDA where one exists (``cuda`` marker, skipped otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import io
import itertools
import json
import logging
import math
import os
import pickle
import subprocess
import sys
import weakref
from typing import Any, Callable, Dict, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from aliasing import lies_in
from zero_offload import OffloadOptimizer, functional, host_memory
from zero_offload.buckets import ALIGN

STEPS = 50
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
VOCAB, SEQ, D, FF, BATCH = 31, 8, 16, 40, 4


class TinyTransformer(nn.Module):
    """One pre-LN transformer block. ``aux`` sits between the decay weights and is used every third step only, so
    its parameters alternate between having and not having a gradient (and fall behind in step count)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(SEQ, D) * 0.1)
        self.ln1 = nn.LayerNorm(D)
        # No qkv bias: the key bias has a mathematically zero gradient (softmax is shift invariant), so its gradient
        # is round-off noise that Adam normalises to +-lr, different in any two runs that differ by one ulp.
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.ff1 = nn.Linear(D, FF)
        self.ff2 = nn.Linear(FF, D)
        self.aux = nn.Linear(D, 3)
        self.lnf = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos[:t]
        q, k, v = (z.view(b, t, 2, D // 2).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(D // 2)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1), float("-inf"))
        x = x + self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D))
        x = x + self.ff2(F.gelu(self.ff1(self.ln2(x))))
        h = self.lnf(x)
        return self.head(h), self.aux(h)


def param_groups(model: nn.Module, which=(0, 1)):
    """A decay group (matrices) and a no-decay group (embeddings, LayerNorms, biases) with its own lr."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok", "pos"))]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("tok", "pos")))]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]
    return [groups[i] for i in which]


def batch(step: int, micro: int, device):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    tgt = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    aux = torch.randint(0, 3, (BATCH, SEQ), generator=gen)
    return idx.to(device), tgt.to(device), aux.to(device)


def loss_fn(model: nn.Module, step: int, micro: int, device) -> torch.Tensor:
    idx, tgt, aux_tgt = batch(step, micro, device)
    logits, aux = model(idx)
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tgt.reshape(-1))
    if step % 3 == 0:
        loss = loss + F.cross_entropy(aux.float().reshape(-1, 3), aux_tgt.reshape(-1))
    return loss


def assert_same(model, ref_model, ours, ref, where: str) -> None:
    """Parameters and every state tensor of ``ours`` against the reference optimizer's, at default tolerance."""
    # (State on the GPU tier, gpu_fraction, lives with its parameter; the rest on the host. The step count lives
    # where the reference keeps its own: torch's AdamW keeps it on the host unless fused or capturable.)
    on_device = {id(q) for b in itertools.chain.from_iterable(getattr(ours, "_buckets", ())) if b.device_tier
                 for q in b.params}
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{where}, param {name}: {m}")
        expected, actual = ref.state.get(q, {}), ours.state.get(p, {})
        assert set(actual) - {"master"} == set(expected), f"{where}, {name}: keys {set(actual)} vs {set(expected)}"
        home = p.device.type if id(p) in on_device else "cpu"
        for key, value in expected.items():
            want = value.device.type if key == "step" else home
            assert actual[key].device.type == want, f"{where}, {name}: {key} on {actual[key].device}, not {want}"
            torch.testing.assert_close(actual[key].cpu(), value.cpu(), msg=lambda m: f"{where}, {name}, {key}: {m}")


@dataclasses.dataclass
class Recipe:
    """One training configuration, applied identically to ours and to the reference."""

    name: str
    kw: Dict[str, Any] = dataclasses.field(default_factory=dict)  # to both optimizers
    ref_cls: type = torch.optim.AdamW
    clip: Optional[float] = None
    norm_type: float = 2.0
    scaler: Optional[str] = None  # "step": scaler.step only; "unscale": scaler.unscale_ before clipping (both);
    # "fused": both clip the still-scaled gradients with no unscale_ (torch's order: the scaled norm's coefficient,
    # then scaler.step unscales)
    accumulate: int = 1
    scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None
    closure: bool = False
    set_to_none: bool = True
    inf_at: Optional[int] = None
    add_group_at: Optional[int] = None
    torch_clip: bool = False  # ours is clipped with torch.nn.utils.clip_grad_norm_ on the model, like the reference
    ours_kw: Dict[str, Any] = dataclasses.field(default_factory=dict)  # to ours only
    no_sync: bool = False  # ours runs every micro-batch but the last under opt.no_sync()


RECIPES = [
    Recipe("adamw"),
    # torch.optim.Adam is L2 by default; its own decoupled_weight_decay argument is newer than torch 2.5.
    Recipe("adam_l2", kw=dict(weight_decay=0.05), ours_kw=dict(decoupled_weight_decay=False), ref_cls=torch.optim.Adam),
    Recipe("amsgrad", kw=dict(amsgrad=True)),
    Recipe("maximize", kw=dict(maximize=True)),
    Recipe("tensor_lr", kw=dict(lr=torch.tensor(1e-3))),
    Recipe("clip", clip=0.5),
    Recipe("clip_inf_norm", clip=0.05, norm_type=math.inf),
    Recipe("clip_p3_norm", clip=0.2, norm_type=3.0),
    Recipe("clip_with_torch_utils", clip=0.5, torch_clip=True),
    Recipe("accumulate", accumulate=3),
    Recipe("zero_grad_keep", set_to_none=False, accumulate=2, clip=0.5),
    Recipe("closure", closure=True),
    Recipe("add_param_group", add_group_at=10),
    Recipe("scaler", scaler="step", inf_at=7),
    Recipe("scaler_unscale_clip", scaler="unscale", clip=0.5, inf_at=12),
    Recipe("scaler_fused_clip", scaler="fused", clip=0.5, inf_at=20, accumulate=2),
    Recipe("onecycle", kw=dict(amsgrad=True),
           scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 2e-2], total_steps=STEPS)),
    Recipe("cyclic_betas", scheduler=lambda o: torch.optim.lr_scheduler.CyclicLR(
        o, base_lr=1e-4, max_lr=5e-3, step_size_up=7, cycle_momentum=True, base_momentum=0.8, max_momentum=0.95)),
    Recipe("warmup_cosine", clip=1.0, scheduler=lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=10),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS)], milestones=[10])),
    Recipe("plateau", scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=2, factor=0.5)),
]


class Run:
    """A model and its optimizer (ours or the reference) driven through a recipe, step by step."""

    def __init__(self, recipe: Recipe, model: nn.Module, opt: torch.optim.Optimizer, device: str, ours: bool):
        self.recipe, self.model, self.opt, self.device, self.ours = recipe, model, opt, device, ours
        self.sched = recipe.scheduler(opt) if recipe.scheduler else None
        self.scaler = (torch.amp.GradScaler(device, init_scale=2.0**12, growth_interval=5)
                       if recipe.scaler else None)
        self.norms = []

    def step(self, step: int) -> None:
        r, model, opt, scaler = self.recipe, self.model, self.opt, self.scaler
        if r.add_group_at == step:
            opt.add_param_group(param_groups(model, which=(1,))[0])
        if r.closure:
            def closure():
                opt.zero_grad()
                loss = loss_fn(model, step, 0, self.device)
                loss.backward()
                return loss

            loss = opt.step(closure)
            assert isinstance(loss, torch.Tensor)
        else:
            opt.zero_grad(set_to_none=r.set_to_none)
            for micro in range(r.accumulate):
                quiet = r.no_sync and self.ours and micro < r.accumulate - 1
                with opt.no_sync() if quiet else contextlib.nullcontext():
                    loss = loss_fn(model, step, micro, self.device) / r.accumulate
                    (scaler.scale(loss) if scaler else loss).backward()
            if r.inf_at == step:
                model.ff1.weight.grad[0, 0] = float("inf")
            if r.clip is not None:
                if scaler is not None and r.scaler == "unscale":
                    scaler.unscale_(opt)
                if self.ours and not r.torch_clip:
                    norm = opt.clip_grad_norm_(r.clip, r.norm_type)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), r.clip, r.norm_type, foreach=False)
                self.norms.append(norm.cpu())
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        if self.sched is not None:
            if isinstance(self.sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                # Rounded, so that ulp-level loss differences between the two runs cannot flip a decision.
                self.sched.step(round(float(loss.detach()), 3))
            else:
                self.sched.step()


def make_runs(recipe: Recipe, device: str, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyTransformer().to(device)
    ref_model = copy.deepcopy(model)
    which = (0,) if recipe.add_group_at is not None else (0, 1)
    ours = OffloadOptimizer(param_groups(model, which), **recipe.kw, **recipe.ours_kw)
    ref = recipe.ref_cls(param_groups(ref_model, which), foreach=False, **recipe.kw)
    return Run(recipe, model, ours, device, True), Run(recipe, ref_model, ref, device, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_matches_reference_every_step(recipe, device):
    ours, ref = make_runs(recipe, device)
    for step in range(STEPS):
        ours.step(step)
        ref.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"{recipe.name} step {step}")
        for g_ours, g_ref in zip(ours.opt.param_groups, ref.opt.param_groups):
            assert g_ours["lr"] == g_ref["lr"] and tuple(g_ours["betas"]) == tuple(g_ref["betas"])
    if recipe.clip is not None:
        # Our norm is accumulated in double, torch's in float: equal to float rounding.
        torch.testing.assert_close(torch.stack(ours.norms), torch.stack(ref.norms))
    if recipe.inf_at is not None:
        assert ours.opt.skipped_steps == 1
    if not recipe.set_to_none:
        return  # zeroed gradients are gradients: nothing is skipped
    # The aux head (every third step) really was skipped in between: fewer steps than the rest.
    aux_steps = ours.opt.state[ours.model.aux.weight]["step"].item()
    assert aux_steps < ours.opt.state[ours.model.qkv.weight]["step"].item()


def odd_params(device):
    """Tail sizes around the 64-element alignment, a scalar, an empty tensor, and non-contiguous layouts."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    tensors = [r(()), r(0, 3), r(1), r(63), r(64), r(65), r(8, 3, 3, 3).to(memory_format=torch.channels_last),
               r(5, 7).t(), r(20)[::2], r(130, 3)]
    return [nn.Parameter(t.to(device)) for t in tensors]


@pytest.mark.parametrize("device", DEVICES)
def test_odd_shapes_and_layouts_match_adamw(device):
    params = odd_params(device)
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    ours = OffloadOptimizer(params, lr=1e-2, amsgrad=True)
    ref = torch.optim.AdamW(refs, lr=1e-2, amsgrad=True, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        for i, (p, q) in enumerate(zip(params, refs)):
            if i == 3 and step % 4 == 1:
                p.grad = q.grad = None  # skipped this step, like AdamW
                continue
            g = torch.randn(p.shape, generator=gen).to(device)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, refs)):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step} param {i}: {m}")
            assert p.stride() == q.stride()  # the memory format survives (dense layouts are kept)
            for key, value in ref.state.get(q, {}).items():
                torch.testing.assert_close(ours.state[p][key], value.cpu(), msg=lambda m: f"step {step} {i} {key}: {m}")


def test_many_tensors_gathered_in_parallel_match_adamw():
    """Hundreds of small gradients plus a few large ones, fresh every step: read in place by one kernel call whose
    threads split the bucket's range across tensor boundaries."""
    gen = torch.Generator().manual_seed(0)
    sizes = [1000] * 300 + [40000, 7, 70000]
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    ours, ref = OffloadOptimizer(params), torch.optim.AdamW(refs, foreach=False)
    for step in range(5):
        for p, q in zip(params, refs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, refs)):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step} param {i}: {m}")
            torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"])


def test_hooks_and_state_dict_format():
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(model), amsgrad=True)
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False, amsgrad=True)
    calls = []
    ours.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    ours.register_step_post_hook(lambda o, a, k: calls.append("post"))
    for m, o in ((model, ours), (ref_model, ref)):
        o.zero_grad()
        loss_fn(m, 0, 0, "cpu").backward()
        o.step()
    assert calls == ["pre", "post"]
    sd, rsd = ours.state_dict(), ref.state_dict()
    for g, rg in zip(sd["param_groups"], rsd["param_groups"]):
        # AdamW's groups carry decoupled_weight_decay only after torch 2.5; ours always do (it is our option too).
        assert g["decoupled_weight_decay"] is True
        rg = {"decoupled_weight_decay": True, **rg}
        assert set(g) == set(rg) and g["params"] == rg["params"]
        assert {k: v for k, v in g.items() if k != "foreach"} == {k: v for k, v in rg.items() if k != "foreach"}
    assert sd["state"].keys() == rsd["state"].keys()
    for k, expected in rsd["state"].items():
        assert sd["state"][k].keys() == expected.keys()
        for key, value in expected.items():
            got = sd["state"][k][key]
            assert (got.shape, got.dtype, got.device) == (value.shape, value.dtype, value.device), key
    assert sd["state"][0]["step"].dim() == 0 and sd["state"][0]["step"].dtype == torch.float32


# ------------------------------------------------------------------------------------------------ checkpoints --
def _save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _onecycle(o):
    return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 2e-2], total_steps=STEPS)


CKPT = Recipe("checkpoint", kw=dict(amsgrad=True), clip=0.5, scheduler=_onecycle)


def _resumed(run: Run, ckpt, cls, device, **kw) -> Run:
    """A fresh model and optimizer of class ``cls`` restored from ``ckpt`` (model, optimizer, scheduler)."""
    model = TinyTransformer().to(device)
    model.load_state_dict(ckpt["model"])
    opt = cls(param_groups(model), amsgrad=True, **kw)
    new = Run(run.recipe, model, opt, device, cls is OffloadOptimizer)
    opt.load_state_dict(ckpt["opt"])  # after the scheduler was built: the loaded lr/betas win
    new.sched.load_state_dict(ckpt["sched"])
    new.scaler = run.scaler
    return new


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["ours->ours", "adamw->ours", "ours->adamw"])
def test_checkpoint_resume_continues_reference_trajectory(direction, device):
    ours, ref = make_runs(CKPT, device)
    half = STEPS // 2
    src = ref if direction == "adamw->ours" else ours
    for step in range(half):
        ours.step(step)
        ref.step(step)
    ckpt = _save_load({"model": src.model.state_dict(), "opt": src.opt.state_dict()})
    # Not through weights-only loading: torch 2.3's OneCycleLR keeps a bound method in its state, which it refuses.
    ckpt["sched"] = copy.deepcopy(src.sched.state_dict())
    if direction == "ours->adamw":
        resumed = _resumed(src, ckpt, torch.optim.AdamW, device, foreach=False)
    else:
        resumed = _resumed(src, ckpt, OffloadOptimizer, device)
        # Loaded state stays in the optimizer's own host buffers.
        bufs = [t for b in resumed.opt.host_buffers() for t in b.values()]
        for st in resumed.opt.state.values():
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                assert lies_in(st[key], bufs)
    for step in range(half, STEPS):
        resumed.step(step)
        ref.step(step)
        if direction == "ours->adamw":
            for (name, p), q in zip(resumed.model.named_parameters(), ref.model.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m: f"{direction} step {step} {name}: {m}")
                for key, value in ref.opt.state.get(q, {}).items():
                    torch.testing.assert_close(resumed.opt.state[p][key].cpu(), value.cpu())
        else:
            assert_same(resumed.model, ref.model, resumed.opt, ref.opt, f"{direction} step {step}")


def test_state_dict_roundtrip_into_itself_changes_nothing():
    ours, ref = make_runs(Recipe("self"), "cpu")
    for step in range(5):
        ours.step(step)
        ref.step(step)
    ours.opt.load_state_dict(ours.opt.state_dict())
    for step in range(5, 10):
        ours.step(step)
        ref.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"step {step}")


# ---------------------------------------------------------------------------------------------- bf16 masters --
SHAPES = [(1,), (7,), (65,), (130, 3), (4, 4, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_have_fp32_masters_matching_adamw_on_fp32_copies(dtype, device):
    """Reference: AdamW on fp32 copies of the low-precision parameters, fed the same gradients (upcast, exact),
    with the parameter being the fp32 copy rounded to its dtype. Resumed from a checkpoint halfway."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    params = [nn.Parameter(t.clone().to(device)) for t in init]
    masters = [nn.Parameter(t.float().to(device)) for t in init]
    ours = OffloadOptimizer(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        if step == STEPS // 2:
            ckpt = _save_load({"opt": ours.state_dict(), "params": [p.detach().cpu() for p in params]})
            params = [nn.Parameter(t.to(device)) for t in ckpt["params"]]
            ours = OffloadOptimizer(params, lr=1e-2, weight_decay=0.1)
            ours.load_state_dict(ckpt["opt"])
        for p, m in zip(params, masters):
            g = torch.randn(p.shape, generator=gen).to(dtype).to(device)
            p.grad, m.grad = g, g.float()
        ours.step()
        ref.step()
        for p, m in zip(params, masters):
            st = ours.state[p]
            torch.testing.assert_close(st["master"], m.detach().cpu(), msg=lambda s: f"step {step} master: {s}")
            torch.testing.assert_close(st["exp_avg"], ref.state[m]["exp_avg"].cpu())
            torch.testing.assert_close(st["exp_avg_sq"], ref.state[m]["exp_avg_sq"].cpu())
            assert p.dtype == dtype
            torch.testing.assert_close(p, m.detach().to(dtype), msg=lambda s: f"step {step} param: {s}")


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_model_tracks_fp32_run_better_than_bf16_adamw(device):
    torch.manual_seed(0)
    model32 = TinyTransformer().to(device)
    ours_model = copy.deepcopy(model32).bfloat16()
    adamw_model = copy.deepcopy(model32).bfloat16()
    runs = [(model32, torch.optim.AdamW(param_groups(model32), foreach=False)),
            (ours_model, OffloadOptimizer(param_groups(ours_model))),
            (adamw_model, torch.optim.AdamW(param_groups(adamw_model), foreach=False))]
    for step in range(STEPS):
        for model, opt in runs:
            opt.zero_grad()
            loss_fn(model, step, 0, device).backward()
            opt.step()

    def distance(model):
        return math.sqrt(sum(float((p.detach().float() - q.detach()).square().sum())
                             for p, q in zip(model.parameters(), model32.parameters())))

    d_ours, d_adamw = distance(ours_model), distance(adamw_model)
    # bf16 AdamW loses most updates of LayerNorm gains near 1 (bf16 spacing 2^-7 > lr); fp32 masters keep them.
    assert d_ours < 0.5 * d_adamw, (d_ours, d_adamw)


def test_parameter_changed_outside_the_optimizer_reinitialises_its_master():
    """Reference: AdamW on an fp32 copy, whose copy is set to the same new value."""
    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(100, generator=gen).bfloat16())
    m = nn.Parameter(p.detach().float())
    ours, ref = OffloadOptimizer([p]), torch.optim.AdamW([m], foreach=False)
    for step in range(10):
        if step == 5:
            new = torch.randn(100, generator=gen).bfloat16()
            with torch.no_grad():
                p.copy_(new)  # what model.load_state_dict does
                m.copy_(new.float())
        g = torch.randn(100, generator=gen).bfloat16()
        p.grad, m.grad = g, g.float()
        ours.step()
        ref.step()
        torch.testing.assert_close(ours.state[p]["master"], m.detach())
        torch.testing.assert_close(p, m.detach().bfloat16())
    # Rewriting a parameter with the value it already has keeps the master's fp32 bits.
    master = ours.state[p]["master"].clone()
    with torch.no_grad():
        p.copy_(p.detach().clone())
    ours._buckets[0][0].masters.refresh([0])
    assert torch.equal(ours.state[p]["master"], master)


# ------------------------------------------------------------------------------------------------ host memory --
def test_host_memory_estimate_is_exact_and_logged(caplog):
    torch.manual_seed(0)
    model = TinyTransformer()
    half = TinyTransformer().bfloat16()
    groups = param_groups(model) + [{"params": list(half.parameters()), "amsgrad": True}]
    estimate = OffloadOptimizer.estimate_host_memory(groups)
    with caplog.at_level(logging.INFO, logger="zero_offload"):
        opt = OffloadOptimizer(groups)
    assert "host RAM" in caplog.text and "B/param" in caplog.text
    actual: Dict[str, int] = {}
    for buffers in opt.host_buffers():
        for name, t in buffers.items():
            actual[name] = actual.get(name, 0) + t.nbytes
    assert {k: v for k, v in estimate.buffers.items() if v} == actual
    assert estimate == opt.estimate_host_memory()
    n = sum(p.numel() for g in groups for p in g["params"])
    assert estimate.numel == n
    # fp32 master + 2 moments = 12 B/element (+4 for amsgrad's max on the bf16 group), gradients besides.
    fp32 = OffloadOptimizer.estimate_host_memory(param_groups(TinyTransformer()))
    assert fp32.state_bytes == 12 * fp32.padded_numel and fp32.buffers["grad"] == 4 * fp32.padded_numel
    assert fp32.pinned_bytes == 0


def test_buckets_are_aligned_and_fp32_cpu_params_live_in_the_master():
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), bucket_numel=600)
    assert sum(len(b) for b in opt._buckets) > 2  # the cap splits the decay group
    for bucket in (b for bs in opt._buckets for b in bs):
        assert all(o % ALIGN == 0 for o in bucket.layout.offsets)
        for i, p in enumerate(bucket.params):
            assert p.data_ptr() == bucket.master_views[i].data_ptr()
            for views in (bucket.store.views["exp_avg"], bucket.grad_views):
                assert views[i].data_ptr() % 64 == 0  # every slot starts on a cache line
                assert views[i].shape == p.shape


def test_one_kernel_call_per_bucket_and_per_run_when_grads_are_missing(monkeypatch):
    calls = []
    # The optimizer's one entry to the kernel (fresh CPU gradients read in place, in-buffer ones flat); the step
    # count after the update leads its hyperparameters.
    real = functional.adam_own_
    monkeypatch.setattr(functional, "adam_own_", lambda *a, **k: (calls.append(a[6][0]), real(*a, **k)))
    torch.manual_seed(0)
    model = TinyTransformer()
    groups = param_groups(model)
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not model.frozen]
    opt = OffloadOptimizer(groups)
    n_buckets = sum(len(b) for b in opt._buckets)
    expected = {
        0: [1, 1],  # the aux head is used: every parameter has a gradient, one call per bucket
        1: [2, 2, 2, 2],  # no aux: each group's bucket runs before and after aux.weight / aux.bias
        3: [4, 2, 4] * 2,  # aux again, one step behind: runs split where the step count changes
    }
    for step in range(4):
        calls.clear()
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
        if step in expected:
            assert calls == expected[step], step
    assert n_buckets == 2


def test_zero_grad_keep_makes_gradients_views_of_the_flat_buffer():
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model))
    loss_fn(model, 0, 0, "cpu").backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    bucket = opt._buckets[0][0]
    for i, p in enumerate(bucket.params):
        assert p.grad is bucket.grad_views[i] and not p.grad.any()
    assert model.frozen.grad is None


def test_import_is_cheap():
    code = ("import torch, zero_offload; from zero_offload import _build; "
            "assert not torch.cuda.is_initialized(); assert not _build._attempted; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


class FakeCudart:
    """Stands in for torch.cuda.cudart() with the driver's page rule: a page can be registered once."""

    PAGE = 4096

    def __init__(self):
        self.pages = {}  # page -> ptr of the registration holding it

    def cudaHostRegister(self, ptr, size, flags):
        pages = range(ptr // self.PAGE, (ptr + size + self.PAGE - 1) // self.PAGE)
        if any(pg in self.pages for pg in pages):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.pages.update({pg: ptr for pg in pages})
        return 0

    def cudaHostUnregister(self, ptr):
        self.pages = {pg: p for pg, p in self.pages.items() if p != ptr}
        return 0


def test_pinned_buffers_register_whole_pages_of_their_own_and_unregister_on_free(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    # Small buffers come from the same heap pages; each must still register without overlapping another.
    kinds = [(n, dtype) for n in (1, 3, 17, 1000, 5000) for dtype in (torch.float32, torch.bfloat16)]
    bufs = [host_memory.empty_host(n, dtype, pin=True) for n, dtype in kinds]
    assert all(b.numel() == n and b.dtype == dtype for b, (n, dtype) in zip(bufs, kinds))
    assert all(b.data_ptr() % FakeCudart.PAGE == 0 and host_memory.is_registered(b) for b in bufs)
    ptr = bufs[-1].data_ptr()
    view = bufs[-1][100:200]
    bufs.clear()
    assert ptr in host_memory._registered and ptr in fake.pages.values()  # alive through the view
    del view
    assert ptr not in host_memory._registered and ptr not in fake.pages.values()
    assert not fake.pages  # every buffer released


@pytest.mark.cuda
def test_cuda_buffers_are_pinned_at_exact_size_and_unregistered_when_freed():
    small = [host_memory.empty_host(n, torch.float32, pin=True) for n in (1, 3, 1000)]  # may share heap pages
    t = host_memory.empty_host(1000003, torch.float32, pin=True)
    assert all(x.is_pinned() and host_memory.is_registered(x) for x in small + [t])
    assert t.numel() == 1000003 and t.nbytes == 4 * 1000003
    assert t.untyped_storage().nbytes() <= 4 * 1000003 + 2 * 4096 * 16  # exact size, to within two pages
    ptr, view = t.data_ptr(), t[10:20]
    del t
    assert ptr in host_memory._registered  # the view keeps the buffer (and its registration) alive
    del view
    assert ptr not in host_memory._registered
    model = TinyTransformer().cuda()
    opt = OffloadOptimizer(param_groups(model))
    for buffers in opt.host_buffers():
        assert all(b.is_pinned() for b in buffers.values())
    assert opt.estimate_host_memory().pinned_bytes == opt.estimate_host_memory().total_bytes


# ------------------------------------------------------------------------------------------------- bad input --
def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()), len(opt.param_groups)


def assert_unchanged(snap, model, opt):
    params, sd, n_groups = snap
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p, before)
    now = opt.state_dict()
    assert len(opt.param_groups) == n_groups and now["param_groups"] == sd["param_groups"]
    assert now["state"].keys() == sd["state"].keys()
    for k, entry in sd["state"].items():
        for key, value in entry.items():
            assert torch.equal(now["state"][k][key], value), (k, key)


def trained(steps=3, **kw):
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = OffloadOptimizer(param_groups(model), **kw)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, step, 0, "cpu").backward()
        opt.step()
    opt.zero_grad()
    loss_fn(model, steps, 0, "cpu").backward()
    return model, opt


@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(lr=float("nan")), dict(eps=-1e-8), dict(betas=(1.0, 0.999)),
                                dict(betas=(0.9, -0.1)), dict(weight_decay=-0.1), dict(betas=(0.9, 1))])
def test_invalid_hyperparameters_raise_adamws_errors(kw):
    model = TinyTransformer()
    with pytest.raises(ValueError) as expected:
        torch.optim.AdamW(model.parameters(), **kw)
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError) as got:
        OffloadOptimizer(model.parameters(), **kw)
    assert str(got.value) == str(expected.value)
    assert ptrs == [p.data_ptr() for p in model.parameters()]  # nothing rebound


@pytest.mark.parametrize("kw, match", [(dict(capturable=True), "capturable"), (dict(differentiable=True), "autograd"),
                                       (dict(nonfinite="warn"), "nonfinite"), (dict(bucket_numel=0), "bucket_numel")])
def test_unsupported_options_are_rejected_with_a_reason(kw, match):
    # differentiable: AdamW's own failure is a RuntimeError (at step(), on any leaf that requires grad)
    with pytest.raises(RuntimeError if "differentiable" in kw else ValueError, match=match):
        OffloadOptimizer(TinyTransformer().parameters(), **kw)


@pytest.mark.parametrize("flag", ["foreach", "fused"])
def test_foreach_and_fused_are_accepted_and_ignored(flag):
    torch.manual_seed(0)
    model = TinyTransformer()
    ref_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(model), **{flag: True})
    ref = torch.optim.AdamW(param_groups(ref_model), foreach=False)
    assert ours.param_groups[0][flag] is True
    for step in range(5):
        for m, o in ((model, ours), (ref_model, ref)):
            o.zero_grad()
            loss_fn(m, step, 0, "cpu").backward()
            o.step()
        assert_same(model, ref_model, ours, ref, f"step {step}")


@pytest.mark.parametrize("case", ["complex", "integer", "non_leaf", "twice_in_group", "two_groups", "sparse_param"])
def test_bad_parameters_raise_and_leave_the_model_untouched(case):
    model = TinyTransformer()
    good = list(model.parameters())
    bad = {
        "complex": lambda: [nn.Parameter(torch.randn(3, dtype=torch.complex64))],
        "integer": lambda: [torch.zeros(3, dtype=torch.int64)],
        "non_leaf": lambda: [(torch.randn(3, requires_grad=True) * 2).requires_grad_()],
        "twice_in_group": lambda: [model.qkv.weight],
        "two_groups": None,
        "sparse_param": lambda: [torch.randn(3, 3).to_sparse().requires_grad_()],
    }[case]
    ptrs = [p.data_ptr() for p in good]
    if case == "two_groups":
        with pytest.raises(ValueError, match="more than one parameter group"):
            OffloadOptimizer([{"params": good}, {"params": [model.qkv.weight]}])
    else:
        with pytest.raises((ValueError, TypeError)):
            OffloadOptimizer(good + bad())
    assert ptrs == [p.data_ptr() for p in good]
    # add_param_group after construction: same checks, optimizer unchanged.
    model2, opt = trained()
    snap = snapshot(model2, opt)
    extra = [model2.qkv.weight] if case in ("twice_in_group", "two_groups") else bad()
    with pytest.raises((ValueError, TypeError)):
        opt.add_param_group({"params": extra})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "lr": -1.0})
    assert_unchanged(snap, model2, opt)


def test_sparse_gradient_raises_and_changes_nothing():
    model, opt = trained()
    snap = snapshot(model, opt)
    model.tok.weight.grad = model.tok.weight.grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    assert_unchanged(snap, model, opt)


def test_invalid_hyperparameter_set_later_raises_at_step_and_changes_nothing():
    model, opt = trained()
    snap = snapshot(model, opt)
    opt.param_groups[1]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        opt.step()
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    assert_unchanged(snap, model, opt)


def test_optimizer_cannot_be_pickled():
    _, opt = trained(steps=1)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)


def _other_state_dicts(opt):
    """State dicts that do not fit ``opt``'s model, each with the error it must produce."""
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    o = torch.optim.AdamW(other.parameters(), foreach=False)
    other(torch.randn(2, 3)).sum().backward()
    o.step()
    good = opt.state_dict()
    wrong_shape = copy.deepcopy(good)
    wrong_shape["state"][0]["exp_avg"] = torch.zeros(2, 2)
    sgd_model = TinyTransformer()
    sgd = torch.optim.SGD(param_groups(sgd_model), lr=0.1, momentum=0.9)
    loss_fn(sgd_model, 0, 0, "cpu").backward()
    sgd.step()
    bad_step = copy.deepcopy(good)
    bad_step["state"][1]["step"] = torch.tensor(-3.0)
    bad_lr = copy.deepcopy(good)
    bad_lr["param_groups"][0]["lr"] = -1.0
    unknown_id = copy.deepcopy(good)
    unknown_id["state"][999] = unknown_id["state"][0]
    no_max = copy.deepcopy(good)
    no_max["param_groups"][0]["amsgrad"] = True
    return [
        (o.state_dict(), "different number of parameter groups"),
        ({"state": {}, "param_groups": [dict(good["param_groups"][0], params=[0]), good["param_groups"][1]]},
         "doesn't match the size"),
        (wrong_shape, "another model"),
        (sgd.state_dict(), "not Adam"),
        (bad_step, "invalid step"),
        (bad_lr, "Invalid learning rate"),
        (unknown_id, "none of its param_groups"),
        (no_max, "lacks"),
        ({"state": {}}, "param_groups"),
    ]


def test_loading_a_state_dict_of_another_model_raises_and_changes_nothing():
    model, opt = trained()
    for sd, match in _other_state_dicts(opt):
        snap = snapshot(model, opt)
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert_unchanged(snap, model, opt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
def test_nonfinite_gradient_policy(policy, device):
    """Reference: AdamW that is simply not stepped where ours must skip (or, for "ignore", is stepped)."""
    ours, ref = make_runs(Recipe("nonfinite", kw=dict()), device)
    ours.opt.nonfinite = policy
    for step in range(8):
        for run in (ours, ref):
            run.opt.zero_grad()
            loss_fn(run.model, step, 0, device).backward()
            if step == 4:
                run.model.ff2.weight.grad[1, 2] = float("nan")
        if step == 4 and policy == "raise":
            snap = snapshot(ours.model, ours.opt)
            with pytest.raises(RuntimeError, match=r"non-finite gradient .* parameter 3 .*shape \(16, 40\)"):
                ours.opt.step()
            assert_unchanged(snap, ours.model, ours.opt)
            continue
        ours.opt.step()
        if not (step == 4 and policy != "ignore"):
            ref.opt.step()
        if policy == "ignore" and step >= 4:
            assert torch.isnan(ours.model.ff2.weight).any() and torch.isnan(ref.model.ff2.weight).any()
            return
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"{policy} step {step}")
    assert ours.opt.skipped_steps == (1 if policy == "skip" else 0)


@pytest.mark.parametrize("path", ["torch", "torch-fused"])
def test_torch_paths_give_the_same_results(monkeypatch, path):
    """The fallbacks without the native kernel: the pure-torch reference, and torch's fused CPU AdamW."""
    if path == "torch-fused" and torch.__version__ < (2, 4):
        pytest.skip(f"torch {torch.__version__} has no fused CPU Adam")
    monkeypatch.setenv("ZERO_OFFLOAD_SIMD", path)
    ours, ref = make_runs(Recipe("torch_path", kw=dict(amsgrad=True), clip=0.5), "cpu")
    for step in range(10):
        ours.step(step)
        ref.step(step)
        assert_same(ours.model, ref.model, ours.opt, ref.opt, f"torch path step {step}")


@pytest.mark.parametrize("kw", [{}, dict(delayed_update=True), dict(stream_grads=True, release_grads=True),
                                dict(stream_grads=True, overlap_step=True, nonfinite="ignore")],
                         ids=["default", "delayed_update", "release_grads", "overlap_step"])
def test_a_dropped_optimizer_is_freed_without_the_garbage_collector(kw):
    """No reference cycle through the optimizer's own machinery (hooks, worker jobs, a pending delayed update):
    its host buffers go the moment the last reference does, as a training loop rebuilding optimizers expects."""
    model = nn.Linear(8, 8)
    OffloadOptimizer(nn.Linear(2, 2).parameters())  # torch's first-use imports leave cycles of their own
    gc.collect()
    gc.disable()
    try:
        opt = OffloadOptimizer(model.parameters(), lr=0.1, **kw)
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        ref = weakref.ref(opt)
        del opt
        assert ref() is None, "the optimizer outlived its last reference"
    finally:
        gc.enable()


@pytest.mark.parametrize("kw", [{}, dict(nonfinite="ignore"), dict(stream_grads=True), dict(delayed_update=True)],
                         ids=["default", "ignore", "streamed", "delayed_update"])
def test_the_gradients_are_let_go_with_the_step(kw):
    """After step() and zero_grad(), the optimizer holds no reference to the step's gradients (AdamW holds none):
    the caller's were the last, so the gradients are freed before the next forward, not kept through it."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    opt = OffloadOptimizer(model.parameters(), lr=0.1, **kw)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        gc.disable()  # (freed by reference counting, not by a collection)
        try:
            assert [g() is None for g in grads] == [True] * len(grads), "a gradient outlived the step"
        finally:
            gc.enable()


def _assert_unchanged(opt, params, snap):
    """The parameters and the state dict are those of ``snap`` = (parameter copies, deep-copied state dict)."""
    assert all(torch.equal(p, q) for p, q in zip(params, snap[0]))
    now = opt.state_dict()["state"]
    for k, entry in snap[1]["state"].items():
        for key, value in entry.items():
            assert torch.equal(now[k][key], value), (k, key)


@pytest.mark.parametrize("shape", [(3, 3), (7, 7), (36,), (6,), (1,)])
@pytest.mark.parametrize("stream", [False, True], ids=["at_step", "streamed"])
def test_a_gradient_shaped_unlike_its_parameter_raises_and_changes_nothing(shape, stream):
    """AdamW refuses such a gradient; a copy into the host buffer (a streaming optimizer's, gathering gradients
    backward did not stream) would broadcast (6,) or (1,) silently, and reading (3, 3) in place would update 9 of
    36 elements."""
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6))
    opt = OffloadOptimizer([w, b], lr=0.1, weight_decay=0, stream_grads=stream)
    w.grad, b.grad = torch.ones(6, 6), torch.ones(6)
    opt.step()
    opt.zero_grad()
    snap = [w.detach().clone(), b.detach().clone()], copy.deepcopy(opt.state_dict())
    w.grad, b.grad = torch.zeros(6, 6), torch.zeros(6)
    w.grad.data = torch.ones(shape)  # (assigning .grad itself checks the shape)
    with pytest.raises(RuntimeError, match=r"of shape \(6, 6\) has a gradient of shape"):
        opt.step()
    opt.zero_grad()
    _assert_unchanged(opt, [w, b], snap)


def test_load_state_dict_with_an_unreadable_tensor_raises_and_changes_nothing():
    model, opt = trained()
    snap = snapshot(model, opt)
    sd = copy.deepcopy(opt.state_dict())
    last = max(sd["state"])
    sd["state"][last]["exp_avg"] = torch.empty_like(sd["state"][last]["exp_avg"], device="meta")
    for entry in sd["state"].values():
        entry["step"] = entry["step"] + 5
        entry["exp_avg_sq"] = entry["exp_avg_sq"] * 2
    with pytest.raises(ValueError, match="meta device"):
        opt.load_state_dict(sd)
    assert_unchanged(snap, model, opt)


def test_construction_refuses_what_cannot_fit_in_host_ram_before_allocating(monkeypatch, caplog):
    """The OOM killer would otherwise end the process mid-allocation, with nothing said."""
    import zero_offload.buckets
    import zero_offload.state.tiers

    allocated = []
    real_empty = host_memory.empty_host
    monkeypatch.setattr(zero_offload.state.tiers, "empty_host", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    monkeypatch.setattr(zero_offload.buckets, "available_host_bytes", lambda: 3 << 20)
    w = nn.Parameter(torch.randn(1 << 18))  # 1 MiB per buffer: master, two moments, amsgrad maximum, gradient
    ptr, before = w.data_ptr(), w.detach().clone()
    with pytest.raises(MemoryError) as info:
        OffloadOptimizer([w], amsgrad=True)
    message = str(info.value)
    assert "needs 5.0 MiB of host RAM" in message and "can take 3.0 MiB" in message, message
    assert "amsgrad=False: 4.0 MiB" in message and "process_group of 2 ranks (per rank)" in message, message
    assert "ZERO_OFFLOAD_ALLOW_OVERCOMMIT=1" in message
    assert not allocated and w.data_ptr() == ptr and torch.equal(w, before)
    monkeypatch.setenv("ZERO_OFFLOAD_ALLOW_OVERCOMMIT", "1")
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        OffloadOptimizer([w], amsgrad=True)
    assert "allocating anyway" in caplog.text


@pytest.mark.parametrize("value, allowed", [("false", False), ("no", False), ("off", False), ("00", False),
                                            ("0", False), ("", False), (" FALSE ", False), ("true", True),
                                            ("yes", True), ("on", True), ("1", True), ("True", True),
                                            ("maybe", None), ("2", None), ("-1", None)])
def test_allow_overcommit_is_read_as_a_boolean(monkeypatch, caplog, value, allowed):
    """``false``, ``no``, ``off`` or ``00`` turned the guard off (issue 36): anything but empty or "0" counted as
    set. A value that is no boolean is refused, naming it, before anything is allocated."""
    import zero_offload.buckets
    import zero_offload.state.tiers

    allocated = []
    real_empty = host_memory.empty_host
    monkeypatch.setattr(zero_offload.state.tiers, "empty_host",
                        lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    monkeypatch.setattr(zero_offload.buckets, "available_host_bytes", lambda: 3 << 20)
    monkeypatch.setenv("ZERO_OFFLOAD_ALLOW_OVERCOMMIT", value)
    w = nn.Parameter(torch.randn(1 << 18))
    ptr, before = w.data_ptr(), w.detach().clone()
    if allowed:
        with caplog.at_level(logging.WARNING, logger="zero_offload"):
            OffloadOptimizer([w], amsgrad=True)
        assert "allocating anyway" in caplog.text
        return
    with pytest.raises(MemoryError if allowed is False else ValueError) as info:
        OffloadOptimizer([w], amsgrad=True)
    if allowed is None:
        assert f"Invalid ZERO_OFFLOAD_ALLOW_OVERCOMMIT={value!r}" in str(info.value), info.value
    assert not allocated and w.data_ptr() == ptr and torch.equal(w, before)


_UNDER_ULIMIT = r"""
import json, resource, sys
import torch
import zero_offload, zero_offload.buckets

# Warmed up first (torch's thread pool and allocator arenas), so that what is mapped later is the optimizer's.
small = torch.nn.Parameter(torch.zeros(1024))
opt = zero_offload.OffloadOptimizer([small])
small.grad = torch.ones(1024)
opt.step()
if sys.argv[1] == "allocation":  # room unknown (no /proc/meminfo, say): only the allocation itself can fail
    zero_offload.buckets.available_host_bytes = lambda: None
w = torch.nn.Parameter(torch.zeros(1 << 26))  # 256 MiB: master, 2 moments and gradient take 1 GiB
before = w.detach().clone()
ptr = w.data_ptr()
size = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
limit = size + (400 << 20)  # room for one buffer, not for four
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
out = {}
try:
    zero_offload.OffloadOptimizer([w])
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["unchanged"] = w.data_ptr() == ptr and bool(torch.equal(w, before))
# Nothing of the refused optimizer is left: a buffer as large as its first one still fits under the limit.
del before
out["room_left"] = torch.empty(1 << 26).numel() == 1 << 26
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status are Linux's")
@pytest.mark.parametrize("how", ["estimate", "allocation"])
def test_an_address_space_limit_gives_the_documented_memory_error_and_frees_everything(how):
    """Under ``ulimit -v`` the allocator's RuntimeError came out of the constructor (issue 36). The room left under
    the limit counts in the estimate (``MemoryError`` before anything is allocated); where the room is not known,
    the allocation's own failure becomes the same ``MemoryError``, with what was allocated freed."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _UNDER_ULIMIT, how], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    error = out.get("error", "")
    assert error.startswith("MemoryError: OffloadOptimizer: param group 0 needs 1.0 GiB of host RAM"), error
    assert "state_dtype=torch.bfloat16: 768.0 MiB" in error, error
    if how == "estimate":
        assert "address-space limit, ulimit -v" in error and "ALLOW_OVERCOMMIT" in error, error
    else:
        # (the map of a buffer on huge pages fails with ENOMEM; torch's allocator, below their size, says so)
        assert ("allocating it failed (OSError: [Errno 12] " in error
                or "allocating it failed (RuntimeError: " in error and "can't allocate memory" in error), error
    assert out["unchanged"] and out["room_left"], out


def test_estimate_host_memory_is_one_name_before_and_after_construction():
    """``OffloadOptimizer.estimate_host_memory(params)`` plans, ``opt.estimate_host_memory()`` measures the buffers
    held; the old second name still answers, with a FutureWarning pointing at the documented one."""
    model = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 3))
    planned = OffloadOptimizer.estimate_host_memory(model.parameters(), amsgrad=True)
    opt = OffloadOptimizer(model.parameters(), amsgrad=True)
    assert opt.estimate_host_memory() == planned
    assert opt.estimate_host_memory(model.parameters(), amsgrad=True) == planned  # planning through an instance
    with pytest.raises(TypeError, match="takes no options"):
        opt.estimate_host_memory(amsgrad=False)
    with pytest.warns(FutureWarning, match=r"use|call opt\.estimate_host_memory\(\)"):
        assert opt.host_memory_estimate() == planned
    assert "Two ways to ask, one name" in OffloadOptimizer.estimate_host_memory.__doc__
    assert opt.estimate_host_memory.__doc__ == OffloadOptimizer.estimate_host_memory.__doc__


# ------------------------------------------------------ gradients rebound inside the host buffer's views --
def _rebind(how, grad, value):
    if how == "data":
        grad.data = value
    else:
        grad.set_(value)


def _two_steps_with_rebound_grads(make, how, shape_of=None):
    """Two steps, gradients given after ``zero_grad(set_to_none=False)`` by rebinding ``p.grad`` (``.data =`` or
    ``.set_()``) to new tensors: the steady state in which ``p.grad`` is a view of the flat gradient buffer."""
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6))
    opt = make([w, b])
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        if step == 0:
            w.grad, b.grad = torch.zeros(6, 6), torch.zeros(6)
        gen = torch.Generator().manual_seed(step)
        for p in (w, b):
            _rebind(how, p.grad, torch.randn(p.shape if shape_of is None else shape_of(p), generator=gen))
        opt.step()
    return w, b, opt


@pytest.mark.parametrize("how", ["data", "set_"])
@pytest.mark.parametrize("kw", [dict(), dict(nonfinite="ignore"), dict(state_dtype=torch.int8)],
                         ids=["default", "ignore", "int8"])
def test_a_gradient_rebound_after_zero_grad_keep_is_the_one_stepped(how, kw):
    """``p.grad.data = t`` / ``p.grad.set_(t)`` on a gradient that is a view of the host buffer: AdamW steps with
    ``t``, and so must this optimizer (not with the zeroed buffer the view was rebound away from). 8-bit state is
    held to the same optimizer given the same gradients by assignment, the path the oracle tests check."""
    w, b, opt = _two_steps_with_rebound_grads(lambda ps: OffloadOptimizer(ps, lr=0.1, **kw), how)
    torch.manual_seed(0)
    rw, rb = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6))
    compact = "state_dtype" in kw
    ref = OffloadOptimizer([rw, rb], lr=0.1, **kw) if compact else torch.optim.AdamW([rw, rb], lr=0.1, foreach=False)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        if compact:
            rw.grad, rb.grad = (torch.randn(p.shape, generator=gen) for p in (rw, rb))
        else:
            ref.zero_grad(set_to_none=False)
            if step == 0:
                rw.grad, rb.grad = torch.zeros(6, 6), torch.zeros(6)
            for p in (rw, rb):
                _rebind(how, p.grad, torch.randn(p.shape, generator=gen))
        ref.step()
    torch.testing.assert_close(w.detach(), rw.detach())
    torch.testing.assert_close(b.detach(), rb.detach())
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for k in theirs:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours[k][name], theirs[k][name])


@pytest.mark.parametrize("how", ["data", "set_"])
@pytest.mark.parametrize("kw", [dict(), dict(nonfinite="ignore"), dict(state_dtype=torch.int8)],
                         ids=["default", "ignore", "int8"])
def test_a_rebound_gradient_of_the_wrong_shape_raises_naming_the_parameter(how, kw):
    """AdamW raises on a (3, 3) gradient for a (6, 6) parameter; reading the (zeroed) slot instead would step
    silently. The error names the parameter and both shapes; nothing is updated."""
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6))
    opt = OffloadOptimizer([{"params": [w, b], "param_names": ["w", "b"]}], lr=0.1, **kw)
    w.grad, b.grad = torch.ones(6, 6), torch.ones(6)
    opt.step()
    opt.zero_grad(set_to_none=False)
    b.grad.copy_(torch.ones(6))
    snap = [w.detach().clone(), b.detach().clone()], copy.deepcopy(opt.state_dict())
    _rebind(how, w.grad, torch.ones(3, 3))
    with pytest.raises(RuntimeError, match=r"param group 0, parameter 0 \('w'\) of shape \(6, 6\) has a gradient "
                                           r"of shape \(3, 3\)"):
        opt.step()
    _assert_unchanged(opt, [w, b], snap)
    # Once the gradient is right, the step goes on as AdamW's would.
    w.grad = torch.ones(6, 6)
    opt.step()
    assert not torch.equal(w, snap[0][0])


def test_zero_grad_keep_after_a_rebound_gradient_zeroes_what_backward_accumulates_into():
    """Rebound, then ``zero_grad(set_to_none=False)`` again before any step: the next backward's gradient alone is
    stepped, as in AdamW (whose zero_grad zeroes the rebound tensor in place)."""
    results = []
    for cls in (OffloadOptimizer, functools.partial(torch.optim.AdamW, foreach=False)):
        torch.manual_seed(0)
        lin = nn.Linear(4, 3)
        opt = cls(lin.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad(set_to_none=False)
            if step == 1:
                lin.weight.grad.data = torch.full((3, 4), 7.0)
                opt.zero_grad(set_to_none=False)
            lin(torch.full((2, 4), float(step + 1))).square().sum().backward()
            opt.step()
        results.append([p.detach().clone() for p in lin.parameters()])
    torch.testing.assert_close(results[0], results[1])


# --------------------------------------------------------------------- state tensors that require grad --
def _requiring_grad(sd, keys, names=("exp_avg", "exp_avg_sq")):
    sd = copy.deepcopy(sd)
    for k in keys:
        for name in names:
            sd["state"][k][name] = sd["state"][k][name].clone().requires_grad_(True) * 1.0  # a non-leaf, as well
    return sd


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("which", ["first", "last", "all"])
def test_load_state_dict_takes_the_values_of_tensors_that_require_grad(state_dtype, which):
    """AdamW loads such a state dict and steps; so must this optimizer, with the values only: no host buffer may
    join autograd, and the load goes on from the values as from the same dict without grad."""
    model, opt = trained(state_dtype=state_dtype)
    saved = copy.deepcopy(opt.state_dict())
    keys = sorted(saved["state"])
    keys = {"first": keys[:1], "last": keys[-1:], "all": keys}[which]
    twin_model = copy.deepcopy(model)
    twin = OffloadOptimizer(param_groups(twin_model), state_dtype=state_dtype)
    twin.load_state_dict(saved)
    opt.load_state_dict(_requiring_grad(saved, keys))
    for o in (opt, twin):
        o.zero_grad()
    loss_fn(model, 7, 0, "cpu").backward()
    loss_fn(twin_model, 7, 0, "cpu").backward()
    opt.step()
    twin.step()
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(p, q)
    for entry in opt.state.values():
        assert all(v.grad_fn is None and not v.requires_grad for v in entry.values() if isinstance(v, torch.Tensor))
    for buffers in opt.host_buffers():
        assert all(v.grad_fn is None and not v.requires_grad for v in buffers.values())
    mine, theirs = opt.state_dict()["state"], twin.state_dict()["state"]
    for k in theirs:
        for name, value in theirs[k].items():
            assert torch.equal(mine[k][name], value), (k, name)


def test_load_state_dict_of_tensors_that_require_grad_matches_adamw():
    """The AdamW side of the same load: its state dict, requiring grad, loaded into both, then one step each."""
    torch.manual_seed(0)
    model = TinyTransformer()
    ref = torch.optim.AdamW(param_groups(model), foreach=False)
    loss_fn(model, 0, 0, "cpu").backward()
    ref.step()
    sd = _requiring_grad(ref.state_dict(), sorted(ref.state_dict()["state"]))
    ours_model = copy.deepcopy(model)
    ours = OffloadOptimizer(param_groups(ours_model))
    ours.load_state_dict(sd)
    ref.load_state_dict(sd)
    for m, o in ((model, ref), (ours_model, ours)):
        o.zero_grad()
        loss_fn(m, 1, 0, "cpu").backward()
        o.step()
    for p, q in zip(model.parameters(), ours_model.parameters()):
        torch.testing.assert_close(q, p)


def test_a_failing_load_with_tensors_that_require_grad_changes_nothing():
    """All or nothing: tensors requiring grad in the first entries, an unreadable one in the last."""
    model, opt = trained()
    snap = snapshot(model, opt)
    keys = sorted(opt.state_dict()["state"])
    sd = _requiring_grad(opt.state_dict(), keys[:-1])
    sd["state"][keys[-1]]["exp_avg"] = torch.empty_like(sd["state"][keys[-1]]["exp_avg"], device="meta")
    with pytest.raises(ValueError, match="meta device"):
        opt.load_state_dict(sd)
    assert_unchanged(snap, model, opt)
    for buffers in opt.host_buffers():
        assert all(v.grad_fn is None for v in buffers.values())


def test_param_groups_given_as_generators_keep_their_parameters():
    """``{"params": model.parameters()}``: the generator is read once, into the group (as torch lists it), and
    every group trains as with AdamW."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    extra = nn.Parameter(torch.randn(5))
    ref = copy.deepcopy(m), nn.Parameter(extra.detach().clone())
    opt = OffloadOptimizer([{"params": m.parameters()}, {"params": iter([extra]), "lr": 0.02}], lr=0.01)
    adamw = torch.optim.AdamW([{"params": ref[0].parameters()}, {"params": iter([ref[1]]), "lr": 0.02}], lr=0.01,
                              foreach=False)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]
    for _ in range(3):
        for model, e, o in ((m, extra, opt), (ref[0], ref[1], adamw)):
            o.zero_grad()
            (model(torch.ones(2, 4)).square().sum() + e.square().sum()).backward()
            o.step()
    for a, b in zip([*m.parameters(), extra], [*ref[0].parameters(), ref[1]]):
        torch.testing.assert_close(a, b)
