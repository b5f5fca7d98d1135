"""OffloadOptimizer sharded over a process group (ZeRO), on CPU with gloo, in processes forked from a fork server
(see :func:`launch`): world sizes 2 and 3 against single-process ``torch.optim.AdamW(foreach=False)`` on the whole
batch, params compared every step at default ``assert_close`` tolerance.

Parameter sizes 1, 7, 17, 119, 51 and 4097 with a small ``bucket_numel`` give several buckets per group,
parameters straddling shard boundaries, and (at world 3) a rank that owns only padding. The global batch (6 rows)
is split evenly over the ranks, each rank's loss is the mean over its rows, so the average over ranks of their
gradients is the whole-batch gradient: the only difference from the reference is the order of the floating-point
sums (each rank's own rows, then across ranks), which default tolerance absorbs on this smooth model. ``aux`` is
used only for rows flagged in the data, so in some steps it has a gradient on one rank only (it must still be
updated on every rank, with the other rank's gradient counted as zero) and in some steps on none (not updated).

Each test is one small launch of its ranks (about 0.2 s of start-up on 2 cores from the fork server, against about
4.5 s when each rank was a fresh interpreter).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import multiprocessing.forkserver
import os
import re
import socket
import tempfile
import time
import traceback
import warnings
from itertools import chain
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import zero_offload.distributed
from zero_offload import OffloadOptimizer

STEPS = 20
BATCH = 6  # divisible by 2 and 3
BUCKET_NUMEL = 200
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        r = lambda *s: torch.randn(*s) * 0.3  # noqa: E731
        self.a = nn.Parameter(1.0 + r(1))
        self.b = nn.Parameter(r(7))
        self.w1 = nn.Parameter(r(17, 7))
        self.c = nn.Parameter(r(17))
        self.big = nn.Parameter(r(4097))
        self.w2 = nn.Parameter(r(3, 17))
        self.aux = nn.Parameter(r(17))
        self.to(dtype)

    def forward(self, x, ids, flag):
        h = torch.tanh((x + self.b) @ self.w1.t() + self.c)
        out = (h @ self.w2.t()).sum(-1) * self.a + self.big[ids].sum(-1)
        if bool(flag.any()):  # only rows flagged in the data use aux
            out = out.index_add(0, flag.nonzero()[:, 0], (h[flag] @ self.aux) * 0.1)
        return out


def groups(model: nn.Module):
    decay = [model.w1, model.big, model.w2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [model.a, model.b, model.c, model.aux], "lr": 2e-2,
                                                      "weight_decay": 0.0}]


def data(step: int, micro: int = 0):
    gen = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(BATCH, 7, generator=gen)
    ids = torch.randint(0, 4097, (BATCH, 5), generator=gen)
    y = torch.randn(BATCH, generator=gen)
    flag = torch.rand(BATCH, generator=gen) < 0.25
    return x, ids, y, flag


def loss_on(model, step, micro, rows, dtype=torch.float32):
    device = next(model.parameters()).device
    x, ids, y, flag = (t[rows].to(device) for t in data(step, micro))
    return F.mse_loss(model(x.to(dtype), ids, flag).float(), y)


def rows_of(rank: int, world: int) -> slice:
    n = BATCH // world
    return slice(rank * n, (rank + 1) * n)


# ----------------------------------------------------------------------------------------------- harness --
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


OUTDIR_VARIABLE = "ZERO_OFFLOAD_TEST_LAUNCH_OUTDIR"


def _entry(rank, world, port, fn, args, outdir, environ):
    os.environ.clear()
    os.environ.update(environ)  # the test's environment now, not the fork server's when it started
    os.environ[OUTDIR_VARIABLE] = outdir  # (where each rank's result appears: see _outlive_rank_0)
    torch.set_num_threads(1)
    warnings.filterwarnings("error", category=FutureWarning)  # as pyproject.toml sets for the test process
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    # Written synchronously, before tearing the group down (which can block when another rank failed).
    torch.save(result, os.path.join(outdir, f"{rank}.tmp"))
    os.replace(os.path.join(outdir, f"{rank}.tmp"), os.path.join(outdir, f"{rank}.pt"))
    if result[0] == "ok":
        dist.destroy_process_group()


# The ranks' start: multiprocessing's fork server, a clean interpreter started once (not pytest's process, whose
# thread pools make forking it unsafe) that imports these modules and forks every rank of every launch from there.
# A rank is then a fresh process with torch (and torch._dynamo, below) already imported: about 0.2 s a launch of 2
# ranks on 2 cores, where "spawn" (an interpreter per rank importing torch) took about 4.5 s. ``fn`` and its
# arguments are pickled as with spawn; each rank takes the test's environment variables as they are at the launch.
# (The fork server goes down on a preload that raises anything but ImportError: only modules every torch imports.)
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "zero_offload", "test_distributed"]


def import_dynamo() -> None:
    """Import ``torch._dynamo`` now: ``torch.optim.Optimizer.add_param_group`` imports it at its first call in a
    process (3.5 s on 2 cores here), so every rank that builds an optimizer paid it. Imported with this module, it
    is in the fork server before any rank is forked. (Where dynamo cannot import, e.g. an old torch on a new
    Python, the optimizer meets that at its first call, as without this.)"""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 (RuntimeError where dynamo does not support this Python)
        pass


import_dynamo()


def _rank_context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    # Python before 3.12 starts the server without this process's sys.path, so it would not find this module (and
    # drop it from the preload without a word): the server is started here, with PYTHONPATH naming this folder and
    # the repository. A server already running is left as it is.
    here = os.path.dirname(os.path.abspath(__file__))
    given = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here)] + ([given] if given else []))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if given is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = given
    return ctx


def launch(fn: Callable, world: int, *args, timeout: float = 90.0, expect_errors: bool = False) -> Dict[int, Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes (forked from the fork server above) joined in one gloo
    group; returns each rank's result, or (``expect_errors``) ``(status, result or traceback)`` per rank. Fails the
    test on a hang."""
    ctx = _rank_context()
    port = _free_port()
    out: Dict[int, Any] = {}
    environ = dict(os.environ)
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, outdir, environ)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world:
                for r in range(world):
                    f = os.path.join(outdir, f"{r}.pt")
                    if r not in out and os.path.exists(f):
                        out[r] = torch.load(f, weights_only=False)
                    elif r not in out and not procs[r].is_alive():
                        out[r] = ("error", f"rank {r} exited with code {procs[r].exitcode} and no result")
                if time.monotonic() > deadline:
                    raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    if expect_errors:
        return out
    errors = {r: res for r, (st, res) in out.items() if st != "ok"}
    if errors:
        raise AssertionError("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return {r: res for r, (_, res) in out.items()}


# ----------------------------------------------------------------------------------------------- workers --
def _make(rank, seed_ours=None, dtype=torch.float32):
    torch.manual_seed(0)
    ref_model = Net()
    torch.manual_seed(seed_ours if seed_ours is not None else 0)
    model = Net(dtype)  # a different init on other ranks: the constructor must broadcast rank 0's
    return model, ref_model


def _step(model, opt, step, rank, world, *, accumulate=1, clip=None, norm_type=2.0, set_to_none=True,
          dtype=torch.float32):
    opt.zero_grad(set_to_none=set_to_none)
    for micro in range(accumulate):
        (loss_on(model, step, micro, rows_of(rank, world), dtype) / accumulate).backward()
    norm = opt.clip_grad_norm_(clip, norm_type) if clip is not None else None
    opt.step()
    return norm


def _ref_step(ref_model, ref, step, *, accumulate=1, clip=None, norm_type=2.0, set_to_none=True):
    ref.zero_grad(set_to_none=set_to_none)
    for micro in range(accumulate):
        (loss_on(ref_model, step, micro, slice(None)) / accumulate).backward()
    norm = (torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip, norm_type, foreach=False)
            if clip is not None else None)
    ref.step()
    return norm


def _compare(model, ref_model, where):
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{where}, {name}: {m}")


VARIANTS = {
    "plain": dict(),
    "amsgrad": dict(kw=dict(amsgrad=True)),
    "clip": dict(clip=0.3),
    "clip_inf": dict(clip=0.05, norm_type=math.inf),
    "accumulate_keep_grads": dict(accumulate=2, set_to_none=False, clip=1.0),
    # Reduce-scattered from backward hooks: alone; clipped after (at the first step the fused clip re-reads the
    # gradients left on the parameters, so every rank reduces them again); with release_grads and two
    # micro-batches (the host shard sums them); and with zero_grad(set_to_none=False) (each backward reduces the
    # gradients accumulated so far).
    "stream": dict(ours=dict(stream_grads=True)),
    "stream_clip": dict(ours=dict(stream_grads=True), clip=0.3),
    "stream_release_accumulate": dict(ours=dict(stream_grads=True, release_grads=True), accumulate=2, clip=1.0),
    "stream_accumulate_keep_grads": dict(ours=dict(stream_grads=True), accumulate=2, set_to_none=False),
}


def _trajectory_worker(rank, world, variants):
    return {variant: _trajectory(rank, world, variant) for variant in variants}


def _trajectory(rank, world, variant):
    v = VARIANTS[variant]
    kw = v.get("kw", {})
    model, ref_model = _make(rank, seed_ours=rank)
    # (the host route unless the variant places its buckets (test_twin_flow's): the CUDA stand-ins' worker runs its
    # GPU branches, where the default, "auto", would move the buckets after the second step)
    ours = {"placement": "host", **v.get("ours", {})}
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           timeout=30, **kw, **ours)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False, **kw)
    _compare(model, ref_model, "after construction (broadcast from rank 0)")
    aux_steps = 0
    for step in range(STEPS):
        norm = _step(model, opt, step, rank, world, accumulate=v.get("accumulate", 1), clip=v.get("clip"),
                     norm_type=v.get("norm_type", 2.0), set_to_none=v.get("set_to_none", True))
        ref_norm = _ref_step(ref_model, ref, step, accumulate=v.get("accumulate", 1), clip=v.get("clip"),
                             norm_type=v.get("norm_type", 2.0), set_to_none=v.get("set_to_none", True))
        if norm is not None:
            torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"step {step} norm: {m}")
        _compare(model, ref_model, f"{variant} step {step}")
        aux_steps += ref_model.aux.grad is not None
    # The full, gathered state equals AdamW's, parameter by parameter.
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sd["state"].keys() == rsd["state"].keys()
    for k, expected in rsd["state"].items():
        assert sd["state"][k].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(sd["state"][k][key], value, msg=lambda m: f"state {k} {key}: {m}")
    assert sd["state"][6]["step"].item() == aux_steps
    # Some steps without aux's gradient (zeroed gradients are gradients; two micro-batches nearly always use it).
    assert 0 < aux_steps < STEPS or not v.get("set_to_none", True) or v.get("accumulate", 1) > 1, (variant, aux_steps)
    # Each rank holds a 1/world shard of the state.
    numel = sum(p.numel() for p in model.parameters())
    est = opt.estimate_host_memory()
    return est.state_bytes / numel


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_trajectory_matches_adamw_on_whole_batch(world):
    # Every variant at world 2; at world 3 (a rank owning only padding in one bucket) the two with most logic.
    variants = list(VARIANTS) if world == 2 else ["clip_inf", "accumulate_keep_grads"]
    results = launch(_trajectory_worker, world, variants)
    for rank, per_variant in results.items():
        for variant, bytes_per_param in per_variant.items():
            per_param = 12 + (4 if variant == "amsgrad" else 0)
            # Shards are padded to whole 64-element lines: a little over 12/world for this small model.
            assert per_param / world <= bytes_per_param < per_param / world * 1.25, (variant, rank, bytes_per_param)


def _cuda_branches_worker(rank, world, variants):
    """The sharded CUDA branches run on CPU tensors (tests/cuda_standins.py). On a GPU the copy after a
    collective is ordered after it on the stream; here the host waits for each collective as it is started."""
    import cuda_standins

    cuda_standins.install(setattr)
    start = zero_offload.distributed.Comm.start

    def start_and_wait(comm, what, where, launch, on_device, tensors=()):
        pending = start(comm, what, where, launch, on_device, tensors)
        pending.wait()
        return pending

    zero_offload.distributed.Comm.start = start_and_wait
    opt = OffloadOptimizer([nn.Parameter(torch.zeros(3))], process_group=dist.group.WORLD)
    assert not opt._buckets[0][0].on_cpu, "the stand-in device was not used"
    return {variant: _trajectory(rank, world, variant) for variant in variants}


def test_sharded_cuda_branches_match_adamw_on_cpu():
    """What NCCL runs on a GPU, here over gloo: flatten on the device, reduce-scatter from the hooks, shard
    copied to the host, all-gather back; streamed, released and clipped, against whole-batch AdamW."""
    variants = ["plain", "clip", "accumulate_keep_grads", "stream_clip", "stream_release_accumulate"]
    results = launch(_cuda_branches_worker, 2, variants)
    assert all(set(per_variant) == set(variants) for per_variant in results.values())


def _bf16_worker(rank, world):
    """bf16 parameters: our fp32 masters against AdamW on fp32 copies fed the same reduced gradient (each rank's
    bf16 gradient, summed in bf16 in rank order as the reduce-scatter does for two ranks, upcast, times 1/world)."""
    torch.manual_seed(0)
    init = Net(torch.bfloat16)
    model = Net(torch.bfloat16)
    model.load_state_dict(init.state_dict())
    masters = [nn.Parameter(p.detach().float().clone()) for p in init.parameters()]
    shadow = Net(torch.bfloat16)  # the reference's bf16 model: its masters rounded, to compute every rank's grads
    opt = OffloadOptimizer(model.parameters(), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD)
    ref = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
    scale = torch.tensor(1.0 / world, dtype=torch.float32)
    for step in range(STEPS):
        _step(model, opt, step, rank, world, dtype=torch.bfloat16)
        with torch.no_grad():
            for s, m in zip(shadow.parameters(), masters):
                s.copy_(m)
        total, present = None, [False] * len(masters)
        for r in range(world):
            shadow.zero_grad()
            loss_on(shadow, step, 0, rows_of(r, world), torch.bfloat16).backward()
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in shadow.parameters()]
            present = [was or p.grad is not None for was, p in zip(present, shadow.parameters())]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for m, g, pres in zip(masters, total, present):
            m.grad = g.float() * scale if pres else None  # aux: on some ranks only, or none
        ref.step()
        for (name, p), m in zip(model.named_parameters(), masters):
            torch.testing.assert_close(p.detach(), m.detach().to(torch.bfloat16), msg=lambda x: f"{step} {name}: {x}")
    sd = opt.state_dict()
    for k, m in enumerate(masters):
        if m in ref.state:
            torch.testing.assert_close(sd["state"][k]["master"], m.detach(), msg=lambda x: f"master {k}: {x}")
            torch.testing.assert_close(sd["state"][k]["exp_avg"], ref.state[m]["exp_avg"])
    return True


def test_bf16_params_fp32_masters_sharded():
    launch(_bf16_worker, 2)


# -------------------------------------------------------------------------------------------------------- DDP --
def _ddp_worker(rank, world):
    """Under DDP the gradients arrive averaged: ``grads_reduced=True`` takes each rank's slice (ZeRO-1); the
    default reduce-scatters them again, summing N identical averages then dividing by N: the same gradient up to
    rounding (never a sum left undivided). Both follow the whole-batch AdamW trajectory."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    for grads_reduced in (True, False):
        model, ref_model = _make(rank, seed_ours=rank)
        ddp = DDP(model, find_unused_parameters=True)  # aux is unused on a rank whose rows have no flag
        opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                               grads_reduced=grads_reduced)
        ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
        for step in range(STEPS):
            _step(ddp, opt, step, rank, world, clip=0.5)
            _ref_step(ref_model, ref, step, clip=0.5)
            _compare(model, ref_model, f"grads_reduced={grads_reduced} step {step}")
    return True


def test_ddp_wrapped_model_zero1():
    launch(_ddp_worker, 2)


# ------------------------------------------------------------------------------------------------- ordering --
def _order_worker(rank, world):
    """What a sharded, streamed step does, in order: each layer's reduce-scatter starts from the backward hooks
    (before backward reaches the input), in the fixed reverse-construction order, none is waited for until step();
    each bucket's all-gather is still in flight while the next bucket's kernel runs."""
    from zero_offload import distributed, functional

    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = OffloadOptimizer(layers.parameters(), lr=1e-2, bucket_numel=80, stream_grads=True,
                           process_group=dist.group.WORLD)  # one bucket per Linear (64 + 8 elements each)
    log: List[str] = []
    start, wait, kernel = distributed.Comm.start, distributed.Pending.wait, functional.adam_own_

    def logged_start(comm, what, where, launch, on_device, tensors=()):
        log.append(f"start {what} {where}")
        return start(comm, what, where, launch, on_device, tensors)

    def logged_wait(pending):
        if not pending.done:
            log.append(f"wait {pending.what} {pending.where}")
        wait(pending)

    def logged_kernel(*args, **kw):
        log.append("kernel")
        return kernel(*args, **kw)

    distributed.Comm.start, distributed.Pending.wait, functional.adam_own_ = logged_start, logged_wait, logged_kernel
    try:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
        x.register_hook(lambda g: log.append("backward reaches the input"))
        layers(x).square().mean().backward()
        log.append("backward ended")
        opt.step()
    finally:
        distributed.Comm.start, distributed.Pending.wait, functional.adam_own_ = start, wait, kernel
    return log


def test_streamed_sharding_reduces_in_backward_in_a_fixed_order_and_overlaps_the_all_gathers():
    for rank, log in launch(_order_worker, 2).items():
        starts = [e for e in log if e.startswith("start reduce_scatter")]
        assert starts == [f"start reduce_scatter gradients of param group 0, bucket {b}" for b in (2, 1, 0)], log
        # The last two layers' reduce-scatters are under way before backward reaches the first layer's input.
        assert log.index(starts[1]) < log.index("backward reaches the input"), log
        assert all(log.index(e) > log.index("backward ended") for e in log if e.startswith("wait reduce")), log
        kernels = [i for i, e in enumerate(log) if e == "kernel"]
        gathers = [i for i, e in enumerate(log) if e.startswith("start all_gather")]
        gathered = [i for i, e in enumerate(log) if e.startswith("wait all_gather")]
        assert len(kernels) == len(gathers) == len(gathered) == 3, log
        # Bucket k's all-gather starts after its kernel and is waited for only after bucket k+1's kernel ran.
        assert kernels[0] < gathers[0] < kernels[1] < gathers[1] < kernels[2] < gathers[2] < min(gathered), log


# ------------------------------------------------------------------------------------------------ checkpoints --
CKPT_AT = 10


def _ckpt_opt(model, **kw):
    return OffloadOptimizer(groups(model), lr=1e-2, amsgrad=True, bucket_numel=BUCKET_NUMEL, **kw)


def _ckpt_ref(until: int):
    torch.manual_seed(0)
    ref_model = Net()
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, amsgrad=True, foreach=False)
    for step in range(until):
        _ref_step(ref_model, ref, step, clip=0.5)
    return ref_model, ref


def _save_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp

    model, _ = _make(rank, seed_ours=rank)
    opt = _ckpt_opt(model, process_group=dist.group.WORLD)
    ref_model, ref = _ckpt_ref(0)
    for step in range(STEPS):
        if step == CKPT_AT:
            dcp.save({"optim": opt.sharded_state_dict()}, checkpoint_id=os.path.join(path, "dcp"))
            full = opt.state_dict()  # a collective: every rank calls it
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": full}, os.path.join(path, "full.pt"))
            dist.barrier()
        _step(model, opt, step, rank, world, clip=0.5)
        _ref_step(ref_model, ref, step, clip=0.5)
        _compare(model, ref_model, f"uninterrupted step {step}")
    return True


def _resume(model, opt, rank, world, how, path):
    import torch.distributed.checkpoint as dcp

    if how == "dcp":
        sd = {"optim": opt.sharded_state_dict()}
        dcp.load(sd, checkpoint_id=os.path.join(path, "dcp"), no_dist=world == 1)
        opt.load_sharded_state_dict(sd["optim"])
    else:
        opt.load_state_dict(torch.load(os.path.join(path, "full.pt"), weights_only=True)["opt"])
    ref_model, ref = _ckpt_ref(CKPT_AT)
    for step in range(CKPT_AT, STEPS):
        _step(model, opt, step, rank, world, clip=0.5)
        _ref_step(ref_model, ref, step, clip=0.5)
        _compare(model, ref_model, f"resumed ({how}, world {world}) step {step}")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            if world == 1:  # the state itself, not only its effect on the parameters
                torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def _resume_worker(rank, world, path):
    ckpt = torch.load(os.path.join(path, "full.pt"), weights_only=True)
    for how in ("dcp", "full"):
        model = Net()
        model.load_state_dict(ckpt["model"])
        opt = _ckpt_opt(model, process_group=dist.group.WORLD)
        _resume(model, opt, rank, world, how, path)
    return True


def _state_reset_worker(rank, world):
    """The Adam reset recipe on every rank of a sharded optimizer: each rank's pieces restart, as AdamW's state."""
    model, ref_model = _make(rank)
    opt = _ckpt_opt(model, process_group=dist.group.WORLD)
    ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, amsgrad=True, foreach=False)
    for step in range(5):
        _step(model, opt, step, rank, world)
        _ref_step(ref_model, ref, step)
        if step == 1:
            opt.state.clear()
            ref.state.clear()
        if step == 2:
            del opt.state[model.big]
            del ref.state[ref_model.big]
        _compare(model, ref_model, f"step {step}")
    full = opt.state_dict()
    for k, q in enumerate(chain.from_iterable(g["params"] for g in ref.param_groups)):
        for name, value in ref.state[q].items():
            torch.testing.assert_close(full["state"][k][name], value, msg=lambda m: f"param {k} {name}: {m}")
    return True


def test_resetting_the_state_of_a_sharded_optimizer_restarts_it_as_adamw():
    launch(_state_reset_worker, 2)


V0 = os.path.join(os.path.dirname(__file__), "data", "dcp_v0")  # see make.py there


def _v0_optimizer(process_group=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    extra = nn.Parameter(torch.randn(17).to(torch.bfloat16))
    params = list(m.parameters()) + [extra]
    opt = OffloadOptimizer([{"params": m.parameters()}, {"params": [extra], "lr": 0.02}], lr=0.01, amsgrad=True,
                           bucket_numel=64, process_group=process_group)
    return params, opt


def _load_v0(rank, world):
    import torch.distributed.checkpoint as dcp

    params, opt = _v0_optimizer(dist.group.WORLD if world > 1 else None)
    sd = {"optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(V0, "dcp"), no_dist=world == 1)
    opt.load_sharded_state_dict(sd["optim"])
    full = torch.load(os.path.join(V0, "full.pt"), weights_only=True)
    assert opt.param_groups[1]["lr"] == 0.02
    got = opt.state_dict()  # (a collective with a group: the pieces loaded on every rank, gathered)
    for k, p in enumerate(params):
        assert got["state"][k].keys() == full["state"][k].keys()
        for name, value in full["state"][k].items():
            torch.testing.assert_close(got["state"][k][name], value, msg=lambda m: f"param {k} {name}: {m}")
    return True


def test_a_checkpoint_of_the_shardedtensor_format_still_loads():
    """A sharded checkpoint written by the ShardedTensor-based code (2 ranks) loads into today's, at world 3 and
    in one process, equal to the full state dict the same run saved."""
    launch(_load_v0, 3)
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True says so
        _load_v0(0, 1)


def test_checkpoint_saved_at_world_2_resumes_at_world_3_and_1():
    with tempfile.TemporaryDirectory() as path:
        launch(_save_worker, 2, path)
        launch(_resume_worker, 3, path)
        ckpt = torch.load(os.path.join(path, "full.pt"), weights_only=True)
        # World 1: a plain optimizer without a process group, from the DCP checkpoint and from the full one.
        torch.set_num_threads(1)
        for how in ("dcp", "full"):
            model = Net()
            model.load_state_dict(ckpt["model"])
            _resume(model, _ckpt_opt(model), 0, 1, how, path)
        # The full state dict, gathered from two ranks, continues in plain torch.optim.AdamW.
        model = Net()
        model.load_state_dict(ckpt["model"])
        adamw = torch.optim.AdamW(groups(model), lr=1e-2, amsgrad=True, foreach=False)
        adamw.load_state_dict(ckpt["opt"])
        ref_model, ref = _ckpt_ref(CKPT_AT)
        for step in range(CKPT_AT, STEPS):
            _ref_step(model, adamw, step, clip=0.5)
            _ref_step(ref_model, ref, step, clip=0.5)
            _compare(model, ref_model, f"AdamW from the gathered state, step {step}")


# --------------------------------------------------------------------------------------------------- failures --
FAIL_TIMEOUT = 3.0


def _one_step_then_rank_1_fails(rank, world, **options):
    """One step together, then rank 1 raises (after outliving rank 0's timeout); rank 0 gets its model and
    optimizer back."""
    model, _ = _make(rank)
    opt = OffloadOptimizer(groups(model), bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           timeout=FAIL_TIMEOUT, **options)
    _step(model, opt, 0, rank, world)
    if rank == 1:
        _outlive_rank_0(3 * FAIL_TIMEOUT)  # stays alive without joining: only the timeout can end rank 0's wait
        raise RuntimeError("rank 1 failed before its step")
    return model, opt


def _outlive_rank_0(limit: float) -> None:
    """Wait until rank 0 of this launch has written its result, or ``limit`` seconds."""
    done = os.path.join(os.environ[OUTDIR_VARIABLE], "0.pt")
    deadline = time.monotonic() + limit
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)


def _failing_worker(rank, world, stream):
    model, opt = _one_step_then_rank_1_fails(rank, world, stream_grads=stream)
    t0 = time.monotonic()
    try:
        _step(model, opt, 1, rank, world)
    except RuntimeError as exc:
        return time.monotonic() - t0, str(exc)
    return None


@pytest.mark.parametrize("stream", [False, True], ids=["at_step", "streamed"])
def test_one_rank_failing_ends_the_others_with_an_error_naming_rank_and_bucket(stream):
    # Streamed, rank 0's reduce-scatters were started in backward; waiting for them at step() times out.
    out = launch(_failing_worker, 2, stream, timeout=60, expect_errors=True)
    assert out[1][0] == "error" and "rank 1 failed before its step" in out[1][1]
    status, result = out[0]
    assert status == "ok" and result is not None, result
    elapsed, message = result
    assert FAIL_TIMEOUT * 0.9 <= elapsed < FAIL_TIMEOUT + 5, elapsed
    # Streamed, each backward begins with a check that every rank is there (an all-reduce), before the last
    # bucket's reduce-scatter: that is where rank 0 now waits.
    where = ("the check before the reduce_scatter of gradients of param group 1, bucket 1" if stream
             else "reduce_scatter of gradients of param group 0, bucket 0")
    assert "rank 0 of 2" in message and where in message, message


def _bad_input_worker(rank, world):
    errors = {}
    torch.manual_seed(0)
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters()) + ([nn.Parameter(torch.zeros(3))] if rank == 1 else [])
    try:
        OffloadOptimizer(params, process_group=dist.group.WORLD, timeout=10)
    except ValueError as exc:
        errors["mismatch"] = str(exc)
    for p, b in zip(model.parameters(), before):  # untouched: not broadcast, not rebound
        assert torch.equal(p, b)
    world_group = dist.group.WORLD
    for name, kw in {"type": dict(process_group="world"), "timeout": dict(process_group=world_group, timeout=-1),
                     "stream_reduced": dict(process_group=world_group, grads_reduced=True, stream_grads=True),
                     "delayed": dict(process_group=world_group, delayed_update=True)}.items():
        try:
            OffloadOptimizer(model.parameters(), **kw)
        except (TypeError, ValueError) as exc:
            errors[name] = str(exc)
    # A gradient replaced on one rank after backward reduce-scattered it, with the others' released: every rank
    # refuses the step (none is left waiting) and nothing changes.
    opt = OffloadOptimizer(model.parameters(), bucket_numel=BUCKET_NUMEL, stream_grads=True, release_grads=True,
                           process_group=world_group, timeout=10)
    loss_on(model, 0, 0, rows_of(rank, world)).backward()
    if rank == 0:
        model.b.grad = torch.ones_like(model.b)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
    except RuntimeError as exc:
        errors["stale"] = str(exc)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
    # torch.distributed initialised but no process_group, as under DDP (which averages the gradients only as
    # backward ends): streaming is off by default, and what needs it is refused unless stream_grads=True.
    for name in ("release_grads", "overlap_step", "delayed_update"):
        try:
            OffloadOptimizer(model.parameters(), **{name: True}, nonfinite="ignore")
        except ValueError as exc:
            errors[f"ddp_{name}"] = str(exc)
    # A group that runs NCCL alone cannot shard parameters on the CPU: refused on every rank, nothing changed.
    # (Its small collectives would go through the GPU; this gloo group's stay on the CPU.)
    real, real_device = zero_offload.distributed.moves_host_tensors, zero_offload.distributed.Comm._device
    zero_offload.distributed.moves_host_tensors = lambda backend: False
    zero_offload.distributed.Comm._device = lambda self: torch.device("cpu")
    try:
        OffloadOptimizer(model.parameters(), process_group=world_group)
    except ValueError as exc:
        errors["nccl_cpu"] = str(exc)
    finally:
        zero_offload.distributed.moves_host_tensors = real
        zero_offload.distributed.Comm._device = real_device
    cuda = torch.device("cuda")
    assert not OffloadOptimizer(model.parameters()).options.streams(cuda)
    assert OffloadOptimizer(model.parameters(), stream_grads=True, release_grads=True).options.streams(cuda)
    return errors


def test_bad_input_raises_on_every_rank():
    out = launch(_bad_input_worker, 2)
    for rank, errors in out.items():
        assert "param group 0 differs across ranks" in errors["mismatch"] and "7 parameters" in errors["mismatch"]
        assert "process_group must be a torch.distributed.ProcessGroup" in errors["type"]
        assert "Invalid timeout" in errors["timeout"]
        assert "stream_grads=True cannot take gradients already reduced" in errors["stream_reduced"]
        assert "not yet combined with a process_group" in errors["delayed"]
        assert "cannot be reduced again" in errors["stale"] and "param group 0, bucket 0" in errors["stale"]
        assert "NCCL alone" in errors["nccl_cpu"] and "param group 0" in errors["nccl_cpu"]
        for name in ("release_grads", "overlap_step", "delayed_update"):
            assert f"{name}=True works on gradients streamed" in errors[f"ddp_{name}"]
            assert "(world size 2)" in errors[f"ddp_{name}"] and "DistributedDataParallel" in errors[f"ddp_{name}"]


def _misuse_worker(rank, world):
    errors = {}
    torch.manual_seed(0)
    model = Net()
    try:  # a layout that differs per rank would deadlock in the first collective that does not line up
        OffloadOptimizer(model.parameters(), process_group=dist.group.WORLD, timeout=10,
                         bucket_numel=BUCKET_NUMEL * (rank + 1))
    except ValueError as exc:
        errors["bucket_numel"] = str(exc)
    opt = OffloadOptimizer(groups(model), bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD, timeout=10)
    loss_on(model, 0, 0, rows_of(rank, world)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    try:  # clipping on one rank only would clip half the shards
        if rank == 0:
            opt.clip_grad_norm_(1e-3)
        opt.step()
    except RuntimeError as exc:
        errors["clip"] = str(exc)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and not opt.state
    return errors


def test_misuse_across_ranks_is_refused_on_every_rank():
    out = launch(_misuse_worker, 2)
    for rank, errors in out.items():
        assert "bucket_numel differs across ranks: 200 on rank 0, 400 on rank 1" in errors["bucket_numel"]
        assert "clip_grad_norm_ was called on 1 of 2 ranks" in errors["clip"] and f"rank {rank} of 2" in errors["clip"]


def _gpu_fraction_worker(rank, world):
    """``gpu_fraction`` decides which buckets are updated where and ``"auto"`` adds a collective after the first
    step: ranks that disagree would fail in their first step's collectives, naming nothing (issue 36)."""
    errors = {}
    torch.manual_seed(0)
    model = Net()
    before = [(p.detach().clone(), p.data_ptr()) for p in model.parameters()]
    for name, pair in {"half": (0.5, 0), "auto": ("auto", 0.0)}.items():
        try:
            OffloadOptimizer(model.parameters(), process_group=dist.group.WORLD, timeout=10,
                             gpu_fraction=pair[rank])
        except ValueError as exc:
            errors[name] = str(exc)
        for p, (b, ptr) in zip(model.parameters(), before):  # untouched: not broadcast, not rebound
            assert torch.equal(p, b) and p.data_ptr() == ptr
    return errors


def test_gpu_fraction_differing_across_ranks_is_refused_at_construction():
    out = launch(_gpu_fraction_worker, 2)
    for rank, errors in out.items():
        assert "gpu_fraction differs across ranks: 0.5 on rank 0, 0 on rank 1" in errors.get("half", ""), errors
        assert "gpu_fraction differs across ranks: 'auto' on rank 0, 0.0 on rank 1" in errors.get("auto", ""), errors


def test_which_backends_move_cpu_tensors():
    from zero_offload.distributed import moves_host_tensors

    assert moves_host_tensors("gloo") and moves_host_tensors("mpi")
    assert moves_host_tensors("cpu:gloo,cuda:nccl")  # collectives on CUDA tensors still go to NCCL (Comm.start)
    assert moves_host_tensors("undefined")  # init_process_group() without a backend: that same pair
    assert not moves_host_tensors("nccl")


def test_bad_input_without_a_group():
    p = nn.Parameter(torch.zeros(3))
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="torch.distributed is not initialized"):
            OffloadOptimizer([p], process_group=object())  # (dist.group.WORLD is None before init)
    with pytest.raises(ValueError, match="only apply with a process_group"):
        OffloadOptimizer([p], grads_reduced=True)
    with pytest.raises(ValueError, match="only apply with a process_group"):
        OffloadOptimizer([p], timeout=5)


# ------------------------------------------------------------------------------------------------------- NCCL --
def gpu_step_beside_adamw(model, opt, ref_model, ref, step, dtype):
    """One clipped step of one rank on a GPU (the whole batch) with ours and with AdamW: the norms and parameters
    agree (AdamW on fp32 copies fed the same gradients, upcast, for a bf16 model)."""
    opt.zero_grad()
    loss_on(model, step, 0, slice(None), dtype).backward()
    norm = opt.clip_grad_norm_(0.5)
    opt.step()
    ref.zero_grad()
    if dtype == torch.float32:
        loss_on(ref_model, step, 0, slice(None)).backward()
    else:  # the same bf16 gradients, upcast
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = None if p.grad is None else p.grad.float()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5, foreach=False)
    ref.step()
    torch.testing.assert_close(norm, ref_norm)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q.to(dtype), msg=lambda m: f"step {step}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,release,backend", [(torch.float32, False, "nccl"), (torch.bfloat16, False, "nccl"),
                                                   (torch.float32, True, "nccl"),
                                                   (torch.float32, True, "cpu:gloo,cuda:nccl")])
def test_nccl_world_1_on_one_gpu(dtype, release, backend, tmp_path):
    """The CUDA path (gradients reduce-scattered from the backward hooks on the copy stream, shard to pinned host,
    all-gather back) over NCCL with one rank, against AdamW on the GPU (fp32) or on fp32 copies of the bf16
    parameters. Without ``release_grads`` the fused clip re-reads the gradients at the first step and reduces
    them again; after it, and with ``release_grads``, the streamed reduction is used as it is. The mixed backend
    runs the small host tensors over gloo and the buckets' collectives, stream-ordered, over NCCL."""
    if not dist.is_nccl_available():
        pytest.skip("NCCL is not available")
    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref_model = Net().cuda()
        model = Net().to(dtype).cuda()
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref_model.parameters()):
                q.copy_(p)  # the reference starts from the (rounded) values ours has
        opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                               release_grads=release)
        ref = torch.optim.AdamW(groups(ref_model), lr=1e-2, foreach=False)
        for step in range(STEPS):
            gpu_step_beside_adamw(model, opt, ref_model, ref, step, dtype)
        sd = opt.state_dict()
        for k, v in ref.state_dict()["state"].items():
            torch.testing.assert_close(sd["state"][k]["exp_avg"], v["exp_avg"].cpu())
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------- disagreements across ranks --
def _snapshot(model, opt):
    """This rank's parameters and its own shard of the state (no collective; the gradient buffers left out)."""
    return ([p.detach().clone() for p in model.parameters()],
            [{k: t.clone() for k, t in b.items() if "grad" not in k} for b in opt.host_buffers()])


def _unchanged(model, opt, before):
    params, buffers = _snapshot(model, opt)
    return (all(torch.equal(a, b) for a, b in zip(params, before[0]))
            and all(torch.equal(x[k], y[k]) for x, y in zip(buffers, before[1]) for k in x))


HYPER_EDITS = {  # a hyperparameter of param group 1 set differently on rank 1 (AdamW's names), and its value
    "lr": ("lr", 0.04), "betas": ("betas", (0.8, 0.999)), "eps": ("eps", 1e-6), "weight_decay": ("weight_decay", 0.5),
    "maximize": ("maximize", True), "amsgrad": ("amsgrad", True), "decoupled": ("decoupled_weight_decay", False),
}


def _hyper_worker(rank, world, clip):
    """Each hyperparameter set differently on rank 1 (an LR scheduler stepped there only, say), then the
    nonfinite policy and the clip settings: every rank raises at the step, naming it, and nothing changes."""
    torch.manual_seed(0)
    model = Net()
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           timeout=20)
    _step(model, opt, 0, rank, world, clip=clip)
    errors, unchanged = {}, {}
    cases = {**HYPER_EDITS, "nonfinite": None, "clip_max_norm": None}
    for step, (name, edit) in enumerate(cases.items(), start=1):
        if name == "clip_max_norm" and clip is None:
            continue
        saved = {k: v for k, v in opt.param_groups[1].items() if k != "params"}
        if rank == 1 and edit is not None:
            opt.param_groups[1][edit[0]] = edit[1]
        if rank == 1 and name == "nonfinite":
            opt.nonfinite = "skip"
        before = _snapshot(model, opt)
        try:
            max_norm = clip * (1 + rank) if name == "clip_max_norm" else clip
            _step(model, opt, step, rank, world, clip=max_norm)
        except RuntimeError as exc:
            errors[name] = str(exc)
        unchanged[name] = _unchanged(model, opt, before)
        opt.param_groups[1].update(saved)
        opt.nonfinite = "raise"
        opt.zero_grad()
    _step(model, opt, 50, rank, world, clip=clip)  # the ranks go on together
    return errors, unchanged, torch.cat([p.detach().flatten() for p in model.parameters()])


def _nonfinite_named_worker(rank, world):
    """An inf in one element of ``big``'s gradient on rank 1 only, under the default ``nonfinite="raise"``: the
    reduce-scatter carries it into one rank's shard; every rank raises, naming the same parameter and that rank."""
    torch.manual_seed(0)
    model = Net()
    opt = OffloadOptimizer(model.named_parameters(), lr=1e-2, bucket_numel=BUCKET_NUMEL,
                           process_group=dist.group.WORLD, timeout=20)
    opt.zero_grad()
    loss_on(model, 0, 0, rows_of(rank, world)).backward()
    if rank == 1:
        model.big.grad[4000] = float("inf")
    before = _snapshot(model, opt)
    try:
        opt.step()
        message = None
    except RuntimeError as exc:
        message = str(exc)
    return message, _unchanged(model, opt, before)


def test_an_inf_reduced_into_one_ranks_shard_is_named_alike_on_every_rank():
    out = launch(_nonfinite_named_worker, 2, timeout=120)
    messages = {rank: message for rank, (message, _) in out.items()}
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert re.search(r"parameter \d+ \('big'\) of shape \(4097,\) \(in rank [01]'s shard\)", messages[0]), messages
    assert all(unchanged for _, unchanged in out.values())


@pytest.mark.parametrize("clip", [None, 0.5], ids=["step", "clipped"])
def test_hyperparameters_differing_across_ranks_are_refused_at_the_step(clip):
    out = launch(_hyper_worker, 2, clip, timeout=120)
    for rank, (errors, unchanged, _) in out.items():
        for name, (key, value) in HYPER_EDITS.items():
            msg = errors.get(name, f"no error for {name}")
            shown = {"betas": "betas[0] of param group 1: 0.9 on rank 0, 0.8 on rank 1",
                     "lr": "lr of param group 1: 0.02 on rank 0, 0.04 on rank 1",
                     "eps": "eps of param group 1: 1e-08 on rank 0, 1e-06 on rank 1",
                     "weight_decay": "weight_decay of param group 1: 0.0 on rank 0, 0.5 on rank 1",
                     "maximize": "maximize of param group 1: 0.0 on rank 0, 1.0 on rank 1",
                     "amsgrad": "amsgrad of param group 1: 0.0 on rank 0, 1.0 on rank 1",
                     "decoupled": "decoupled_weight_decay of param group 1: 1.0 on rank 0, 0.0 on rank 1"}[name]
            assert f"rank {rank} of 2: the ranks step with different hyperparameters" in msg and shown in msg, msg
            assert "Nothing was updated" in msg and unchanged[name], (name, msg)
        assert "nonfinite (0: raise, 1: skip, 2: ignore): 0.0 on rank 0, 1.0 on rank 1" in errors["nonfinite"]
        assert unchanged["nonfinite"]
        if clip is not None:
            assert "clip_grad_norm_ max_norm: 0.5 on rank 0, 1.0 on rank 1" in errors["clip_max_norm"]
            assert unchanged["clip_max_norm"]
    torch.testing.assert_close(out[0][2], out[1][2], rtol=0, atol=0)


def _invalid_on_one_rank_worker(rank, world, stream):
    """A negative LR on rank 1 only, which rank 1 refuses before its first collective of the step: rank 0 raises
    too, naming rank 1, instead of waiting for it until the group's timeout; nothing changes, and with a valid LR
    again the ranks go on together."""
    torch.manual_seed(0)
    model = Net()
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           stream_grads=stream, timeout=20)
    _step(model, opt, 0, rank, world)
    if rank == 1:
        opt.param_groups[1]["lr"] = -1.0
    before = _snapshot(model, opt)
    error = None
    try:
        _step(model, opt, 1, rank, world)
    except (RuntimeError, ValueError) as exc:
        error = (type(exc).__name__, str(exc))
    unchanged = _unchanged(model, opt, before)
    opt.param_groups[1]["lr"] = 1e-2
    _step(model, opt, 2, rank, world)
    return error, unchanged, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not_streamed"])
def test_a_rank_refusing_its_hyperparameters_makes_the_others_raise_not_wait(stream):
    # (The step's first collective is the statistics' all-reduce or, before reduce-scattering what backward did not
    # send, a check of its size: a failed rank meets either. The group's timeout is 20 s, the test's 120.)
    out = launch(_invalid_on_one_rank_worker, 2, stream, timeout=120)
    (kind0, message0), unchanged0, params0 = out[0]
    (kind1, message1), unchanged1, params1 = out[1]
    assert kind1 == "ValueError" and "Invalid learning rate: -1.0" in message1, message1
    assert kind0 == "RuntimeError" and "rank 1 is raised at step() before its first collective" in message0, message0
    assert unchanged0 and unchanged1
    torch.testing.assert_close(params0, params1, rtol=0, atol=0)


def _edited_after_clip_on_one_rank_worker(rank, world, stream):
    """Rank 1 edits a gradient after ``opt.clip_grad_norm_``, which its ``step()`` refuses (torch's clip would have
    scaled it before the edit) before its first collective: rank 0 raises too, naming rank 1, instead of waiting for
    it until the group's timeout; nothing changes on either, and after ``zero_grad()`` the ranks go on together."""
    torch.manual_seed(0)
    model = Net()
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           stream_grads=stream, timeout=20)
    _step(model, opt, 0, rank, world, clip=1.0)
    before = _snapshot(model, opt)
    error = None
    opt.zero_grad()
    loss_on(model, 1, 0, rows_of(rank, world)).backward()
    opt.clip_grad_norm_(1.0)
    if rank == 1:
        next(model.parameters()).grad.mul_(2.0)
    try:
        opt.step()
    except RuntimeError as exc:
        error = str(exc)
    unchanged = _unchanged(model, opt, before)
    _step(model, opt, 2, rank, world, clip=1.0)
    return error, unchanged, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not_streamed"])
def test_a_gradient_edited_after_clip_on_one_rank_makes_the_others_raise_not_wait(stream):
    out = launch(_edited_after_clip_on_one_rank_worker, 2, stream, timeout=120)
    (message0, unchanged0, params0), (message1, unchanged1, params1) = out[0], out[1]
    assert message1 is not None and "the gradients changed after opt.clip_grad_norm_" in message1, message1
    assert message0 is not None and "rank 1 is raised at step() before its first collective" in message0, message0
    assert unchanged0 and unchanged1
    torch.testing.assert_close(params0, params1, rtol=0, atol=0)


def _invalid_after_a_redone_clip_worker(rank, world, stream):
    """Clipping every step, then a GradScaler's mark appearing (``found_inf``, its unscale done) makes step() redo
    clip_grad_norm_ (collectives on every rank) before it reads the hyperparameters; rank 1 then refuses its LR:
    rank 0 raises too, naming it, instead of waiting for it in the step's next collective until the timeout."""
    torch.manual_seed(0)
    model = Net()
    opt = OffloadOptimizer(groups(model), lr=1e-2, bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD,
                           stream_grads=stream, timeout=20)
    _step(model, opt, 0, rank, world, clip=1.0)
    if rank == 1:
        opt.param_groups[1]["lr"] = -1.0
    before = _snapshot(model, opt)
    error = None
    try:
        opt.zero_grad()
        loss_on(model, 1, 0, rows_of(rank, world)).backward()
        opt.clip_grad_norm_(1.0)
        opt.found_inf = torch.tensor(0.0)  # as GradScaler.step marks it, having unscaled the gradients
        opt.step()
    except (RuntimeError, ValueError) as exc:
        error = (type(exc).__name__, str(exc))
    return error, _unchanged(model, opt, before)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not_streamed"])
def test_a_rank_refusing_its_hyperparameters_after_a_redone_clip_makes_the_others_raise(stream):
    out = launch(_invalid_after_a_redone_clip_worker, 2, stream, timeout=120)
    (kind0, message0), unchanged0 = out[0]
    (kind1, message1), unchanged1 = out[1]
    assert kind1 == "ValueError" and "Invalid learning rate: -1.0" in message1, message1
    assert kind0 == "RuntimeError" and "rank 1 is raised at step() before its first collective" in message0, message0
    assert unchanged0 and unchanged1


def _extra_backward_worker(rank, world, release, backwards):
    """Rank 0 runs ``backwards[0]`` backward passes before the step, rank 1 ``backwards[1]``, gradients streamed:
    every rank raises a RuntimeError naming itself and the collective (gloo aborted the process), nothing changes,
    and after zero_grad() on every rank the ranks go on in step."""
    torch.manual_seed(0)
    model = Net()
    opt = OffloadOptimizer(groups(model), bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD, timeout=20,
                           stream_grads=True, release_grads=release)
    _step(model, opt, 0, rank, world)
    before = _snapshot(model, opt)
    error = None
    try:
        for micro in range(backwards[rank]):
            loss_on(model, 1, micro, rows_of(rank, world)).backward()
        opt.step()
    except RuntimeError as exc:
        error = str(exc)
    unchanged = _unchanged(model, opt, before)
    opt.zero_grad()
    _step(model, opt, 2, rank, world)
    return error, unchanged, torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("release", [True, False], ids=["release", "keep"])
@pytest.mark.parametrize("backwards", [(2, 1), (1, 0), (3, 1)])
def test_an_extra_streamed_backward_on_one_rank_raises_on_every_rank(release, backwards):
    out = launch(_extra_backward_worker, 2, release, backwards, timeout=120)
    for rank, (error, unchanged, _) in out.items():
        assert error is not None and f"zero_offload: rank {rank} of 2:" in error, error
        assert "refused: the ranks are at different collectives" in error, error
        assert f"rank 0 is in backward {backwards[1] + 1} of this step" in error, error
        assert "Nothing was sent or updated" in error and unchanged, error
    torch.testing.assert_close(out[0][2], out[1][2], rtol=0, atol=0)


def _amsgrad_worker(rank, world):
    errors = {}
    torch.manual_seed(0)
    model = Net()
    differing = {"amsgrad": dict(amsgrad=rank == 1), "nonfinite": dict(nonfinite=("raise", "ignore")[rank])}
    for name, kw in differing.items():
        try:
            OffloadOptimizer(model.parameters(), process_group=dist.group.WORLD, timeout=20, **kw)
        except ValueError as exc:
            errors[name] = str(exc)
    try:  # a group added later
        opt = OffloadOptimizer([model.a], process_group=dist.group.WORLD, timeout=20)
        opt.add_param_group({"params": [model.b], "amsgrad": rank == 0})
    except ValueError as exc:
        errors["added_group"] = str(exc)
    # Set on one rank after construction: refused at the step, and state_dict() still gathers on both.
    opt = OffloadOptimizer(groups(model), bucket_numel=BUCKET_NUMEL, process_group=dist.group.WORLD, timeout=20)
    _step(model, opt, 0, rank, world)
    opt.param_groups[0]["amsgrad"] = rank == 1
    try:
        _step(model, opt, 1, rank, world)
    except RuntimeError as exc:
        errors["step"] = str(exc)
    sd = opt.state_dict()
    keys = sorted(sd["state"][0])
    # A state dict with amsgrad loaded on one rank only (which allocates the buffer there): state_dict() refuses on
    # every rank instead of gathering unlike sizes.
    opt.param_groups[0]["amsgrad"] = False
    if rank == 1:
        sd["param_groups"][0]["amsgrad"] = True
        for k in sd["param_groups"][0]["params"]:
            if k in sd["state"]:
                sd["state"][k]["max_exp_avg_sq"] = sd["state"][k]["exp_avg_sq"].clone()
    opt.load_state_dict(sd)
    try:
        opt.state_dict()
    except RuntimeError as exc:
        errors["loaded"] = str(exc)
    return errors, keys


def test_amsgrad_differing_across_ranks_is_refused_at_construction():
    out = launch(_amsgrad_worker, 2, timeout=120)
    for rank, (errors, keys) in out.items():
        assert "amsgrad of param group 0 differs across ranks: False on rank 0, True on rank 1" in errors["amsgrad"]
        assert "nonfinite differs across ranks: 'raise' on rank 0, 'ignore' on rank 1" in errors["nonfinite"]
        assert "amsgrad of param group 1 differs across ranks: True on rank 0, False on rank 1" in errors[
            "added_group"]
        assert "amsgrad of param group 0: 0.0 on rank 0, 1.0 on rank 1" in errors["step"]
        assert f"rank {rank} of 2: the ranks hold different state buffers" in errors["loaded"], errors["loaded"]
        assert "max_exp_avg_sq buffer of param group 0, bucket 0: 0.0 on rank 0, 1.0 on rank 1" in errors["loaded"]
        assert keys == ["exp_avg", "exp_avg_sq", "step"]


def _compact_failure_worker(rank, world, state_dtype):
    model, opt = _one_step_then_rank_1_fails(rank, world, state_dtype=state_dtype)
    try:
        _step(model, opt, 1, rank, world)
    except RuntimeError:
        pass
    try:
        opt.step()
    except RuntimeError as exc:
        refusal = str(exc)
    # Every way of getting the state that the refusal says still works, tried.
    works = {}
    for call in ("sharded_state_dict", "host_buffers"):
        if f"{call}() still gives" in refusal or f"stays in {call}()" in refusal:
            try:
                getattr(opt, call)()
                works[call] = True
            except RuntimeError as exc:
                works[call] = str(exc)
    return refusal, works


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=["fp32", "bf16", "int8"])
def test_after_a_failure_the_refusal_says_what_still_works_for_every_state_dtype(state_dtype):
    out = launch(_compact_failure_worker, 2, state_dtype, timeout=60, expect_errors=True)
    status, result = out[0]
    assert status == "ok", result
    refusal, works = result
    assert "refused: an earlier collective failed" in refusal, refusal
    assert works and all(v is True for v in works.values()), (refusal, works)


def test_gloo_sharding_on_a_torch_without_use_count_is_refused_naming_it(tmp_path, monkeypatch):
    """torch 2.3 has no ``Tensor._use_count``, which a gloo collective's host tensors need to be let go of safely
    (see distributed._Held): the constructor refuses, naming it, before any hook is placed (it raised
    AttributeError at the first collective)."""
    monkeypatch.setattr(zero_offload.distributed, "_use_count", None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Net()
        with pytest.raises(RuntimeError, match=r"process_group sharding over gloo needs Tensor\._use_count, which "
                                               r"this torch \(.*\) lacks"):
            OffloadOptimizer(model.parameters(), lr=1e-2, process_group=dist.group.WORLD)
        assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    finally:
        dist.destroy_process_group()
