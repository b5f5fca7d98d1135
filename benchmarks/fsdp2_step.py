"""The optimizer step under FSDP2 (``fully_shard``): ours against what FSDP2 users run today, on the same shards.

CPU mode (no CUDA, or ``--cpu``): ``--world`` ranks (default 2) spawned here, gloo, each layer of a stack of
``--width`` x ``--width`` linear layers its own FSDP unit, with ``CPUOffloadPolicy`` (parameters and gradients of
every rank on the host: what an FSDP2 user who offloads has, and where an offloading optimizer's step runs). Timed:
``opt.step()`` alone, from the moment the last rank starts it to the moment the last rank ends it (the step is
synchronous; ranks leave the barrier before it some ms apart, which is not the step's time: :func:`critical_path`),
median over ``--steps`` after ``--warmup``; ``rank ms``: the slowest rank's own median, that wait
included. Rows, each on a model built from the same seed, fed the same gradients:

  adamw-default   ``torch.optim.AdamW(params)``: what its default resolves to on these parameters is printed
                  (on CPU DTensors: the single-tensor loop: neither fused nor foreach is taken on CPU);
  adamw-foreach   ``foreach=True``;
  adamw-fused     ``fused=True`` (torch's fused CPU kernel);
  ours            ``zero_offload.OffloadOptimizer(params)``: the gradients read where FSDP left them, an inf/nan check
                  of every rank's shard before the update (one all-gather), the kernel writing the shards FSDP
                  all-gathers from (their storage taken over: no copy);
  ours-ignore     ``nonfinite="ignore"``: no inf/nan check, as AdamW (the all-gather stays: it carries every rank's
                  hyperparameters, which must agree).

With ``--clip MAX_NORM`` every row clips each step, and the clip is timed with ``step()`` (a loop that clips pays
for both; ``torch.nn.utils.clip_grad_norm_`` reads every gradient and scales it in place, ours reads them once with
the inf/nan check and folds the coefficient into the kernel): AdamW rows with ``torch.nn.utils.clip_grad_norm_``,
ours with ``opt.clip_grad_norm_``, and one more row, ``ours-torch-clip``: ours clipped by torch's function (a loop
that swaps the optimizer and nothing else).

Also printed: each row's memory traffic rate (28 bytes per element of the rank's shard: read parameter, gradient,
two moments; write parameter and moments, over the timed span, the clip's included), the median time of one small
all-gather over the ranks after a barrier (both ``ours`` rows run one per step; AdamW none; an all-reduce of that
size beside it), and for reference the rate of a plain 512 MiB copy run on all ranks at once (one thread per rank: a
rough bandwidth figure, not a bound: a fused Adam streams seven arrays and can beat it).

GPU mode (CUDA available): ``--world`` ranks (default: every GPU), NCCL, FSDP2 with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; timed: the whole training step (forward,
backward, ``--clip`` if given, step, zero_grad) and ``step()`` alone (with ``--clip``: the clip and
``step()``, as in CPU mode), with peak GPU memory:

  gpu-adamw-fused      fp32 shards, AdamW(fused=True), all on the GPU: the baseline;
  cpuoffload-adamw     + ``CPUOffloadPolicy(pin_memory=True)``, AdamW default (the single-tensor loop on CPU);
  cpuoffload-fused     + ``CPUOffloadPolicy``, AdamW(fused=True) on the CPU;
  ours                 fp32 shards on the GPU, ``OffloadOptimizer(placement="host")`` (state on the host, gradients
                       streamed from FSDP's hooks per unit);
  ours-cpuoffload      + ``CPUOffloadPolicy``, ``OffloadOptimizer`` on the host shards;
  ours-auto            fp32 shards on the GPU, ``OffloadOptimizer(placement="auto")``, the default (each bucket's
                       home chosen after the second step, the same on every rank).

With ``--clip`` under CPUOffloadPolicy, torch's clip meets CPU gradients on a CUDA mesh (issue 33 cites clipping
failures reported there): a row that fails says so with the error. Run once on one H100 (world 1, without
``--clip``): docs/benchmarks.md; several GPUs and ``--clip`` there are still to be run.

    python benchmarks/fsdp2_step.py                        # CPU: 2 ranks, 8 layers of 1024 (4.2M per rank)
    python benchmarks/fsdp2_step.py --width 2048 --layers 8 --steps 20 --json fsdp2.json
    python benchmarks/fsdp2_step.py --gpu-width 4096 --gpu-layers 16   # on GPUs

Ratios are to the first row of the mode (``adamw-default`` on CPU, ``gpu-adamw-fused`` on GPU); > 1 is slower.
Timings on a busy or shared machine drift: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BYTES_PER_ELEMENT = 28  # Adam step: read p, g, m, v (16 B), write p, m, v (12 B), fp32


def _adamw(**kw) -> Callable:
    return lambda params: torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kw)


def _ours(**kw) -> Callable:
    def make(params):
        from zero_offload import OffloadOptimizer

        return OffloadOptimizer(params, lr=1e-4, weight_decay=0.01, **kw)

    return make


# name: (how FSDP2 is applied, the optimizer factory). "offload": CPUOffloadPolicy.
CPU_ROWS = {
    "adamw-default": ("offload", _adamw()),
    "adamw-foreach": ("offload", _adamw(foreach=True)),
    "adamw-fused": ("offload", _adamw(fused=True)),
    "ours": ("offload", _ours()),
    "ours-ignore": ("offload", _ours(nonfinite="ignore")),  # no inf/nan check before the update, as AdamW
    "ours-torch-clip": ("offload", _ours()),  # with --clip only: clipped by torch's clip_grad_norm_, not ours
}
CLIP_ONLY = ("ours-torch-clip",)
GPU_ROWS = {
    "gpu-adamw-fused": ("gpu", _adamw(fused=True)),
    "cpuoffload-adamw": ("offload", _adamw()),
    "cpuoffload-fused": ("offload", _adamw(fused=True)),
    "ours": ("gpu", _ours(placement="host")),
    "ours-cpuoffload": ("offload", _ours()),
    "ours-auto": ("gpu", _ours(placement="auto")),
}


def machine(cuda: bool) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    s = (f"{cpu}, {os.cpu_count()} logical CPUs (this process may use {len(os.sched_getaffinity(0))}), "
         f"torch {torch.__version__}, python {platform.python_version()}")
    if cuda:
        prop = torch.cuda.get_device_properties(0)
        s += (f"; {torch.cuda.device_count()} x {prop.name} ({prop.total_memory / 2**30:.0f} GiB), "
              f"CUDA {torch.version.cuda}")
    return s


def build(args, rank: int, world: int, device: torch.device, placement: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = device.type == "cuda"
    width, layers = (args.gpu_width, args.gpu_layers) if cuda else (args.width, args.layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)])
    kw: Dict[str, Any] = {}
    if cuda:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if placement == "offload":
        # Pinned host memory needs an accelerator: on a CPU-only machine the parameters are plain host memory.
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def resolved(opt: torch.optim.Optimizer) -> str:
    """What AdamW's implementation flags resolve to on these parameters (None: torch chooses at step())."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    group = opt.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is not None:
        return "foreach" if group["foreach"] else "single-tensor"
    fused, foreach = _default_to_fused_or_foreach(list(group["params"]), differentiable=False, use_fused=False)
    return "fused" if fused else "foreach" if foreach else "single-tensor (default resolved: no foreach on CPU)"


def copy_bandwidth(numel: int = 1 << 26, repeats: int = 6) -> float:
    """Bytes per second of a large fp32 copy (read + write; 512 MiB, past any cache), on every rank at once (they
    share the memory bus): the best of ``repeats``, both buffers touched first."""
    src, dst = torch.ones(numel), torch.zeros(numel)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * 4 * numel / best


def exchange_latency(repeats: int = 40) -> Dict[str, float]:
    """Seconds of one small collective over every rank, each after a barrier (the median of ``repeats``): the
    all-gather ours adds to each step (the inf/nan flag and every rank's settings), and an all-reduce of the same
    size for comparison."""
    mine = torch.zeros(8, dtype=torch.float64)
    every = mine.new_empty(dist.get_world_size() * 8)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = {}
    for name, run in (("all_gather", lambda: gather(every, mine)), ("all_reduce", lambda: dist.all_reduce(every))):
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def measure(args, rank: int, world: int, device: torch.device, name: str, placement: str,
            make_opt: Callable) -> Dict[str, Any]:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = build(args, rank, world, device, placement)
    local = sum(p.to_local().numel() for p in model.parameters())
    try:
        opt = make_opt(model.parameters())
    except Exception as exc:  # noqa: BLE001 (the row reports it)
        return dict(status="refused", error=f"{type(exc).__name__}: {exc}", local_numel=local)
    width = args.gpu_width if cuda else args.width
    x = torch.randn(args.batch, width, device=device, generator=torch.Generator(device).manual_seed(rank))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps: List[float] = []
    spans: List[Tuple[float, float]] = []  # each timed step()'s start and end (perf_counter)
    own_clip = name.startswith("ours") and name not in CLIP_ONLY  # ours clips with opt.clip_grad_norm_
    for i in range(args.warmup + args.steps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        model(x).float().square().mean().backward()
        sync()
        dist.barrier()
        t1 = time.perf_counter()
        if args.clip:
            if own_clip:
                opt.clip_grad_norm_(args.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sync()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            steps.append(time.perf_counter() - t0)
            spans.append((t1, t2))
    out = dict(status="ok", spans=spans, opt_s=statistics.median(t2 - t1 for t1, t2 in spans),
               step_s=statistics.median(steps), local_numel=local)
    if name.startswith("adamw") or name.startswith("gpu-adamw") or name.startswith("cpuoffload"):
        out["implementation"] = resolved(opt)
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def worker(rank: int, world: int, port: int, args, queue):
    cuda = not args.cpu and torch.cuda.is_available()
    try:
        if cuda:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(args.threads)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(minutes=10))
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        results: Dict[str, Any] = {}
        if not cuda:
            results["copy_bytes_per_s"] = copy_bandwidth()
            results["exchange_s"] = exchange_latency()
        rows = GPU_ROWS if cuda else CPU_ROWS
        for name in args.rows or default_rows(rows, args):
            placement, make_opt = rows[name]
            try:
                results[name] = measure(args, rank, world, device, name, placement, make_opt)
            except Exception as exc:  # noqa: BLE001 (one row failing does not end the run)
                results[name] = dict(status="failed", error=f"{type(exc).__name__}: {exc}",
                                     traceback=traceback.format_exc())
            # A refusal on some ranks only would leave the others in a collective: agree before going on.
            statuses: List[Any] = [None] * world
            dist.all_gather_object(statuses, results[name]["status"])
            if len(set(statuses)) > 1:
                raise RuntimeError(f"row {name}: ranks disagree ({statuses})")
        queue.put((rank, results))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


def default_rows(rows: Dict[str, Any], args) -> List[str]:
    return [name for name in rows if args.clip or name not in CLIP_ONLY]


def critical_path(spans: List[List[Tuple[float, float]]]) -> float:
    """The median over steps of the time from the last rank's start of a step to the last rank's end of it (each
    rank's ``spans``: perf_counter, one clock for every process of this machine). A rank that leaves the barrier
    before the step early would otherwise count its wait for the others in its own time: ranks leave a gloo
    barrier up to a few ms apart on a 2-core VM, which says nothing of the step (for a row without a collective in
    its step, never more than the slowest rank's own time of the same step)."""
    return statistics.median(max(s[1] for s in step) - max(s[0] for s in step) for step in zip(*spans))


def report(args, cuda: bool, world: int, out: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    rows = args.rows or default_rows(GPU_ROWS if cuda else CPU_ROWS, args)
    merged: Dict[str, Any] = {}
    for name in rows:
        per_rank = [out[r][name] for r in sorted(out)]
        row = dict(per_rank[0])
        row.pop("traceback", None)
        if row["status"] == "ok":  # the slowest rank paces a synchronous step
            for key in ("step_s", "peak_gib"):
                if key in row:
                    row[key] = max(r[key] for r in per_rank)
            row["rank_opt_s"] = max(r["opt_s"] for r in per_rank)
            row["opt_s"] = critical_path([r.pop("spans") for r in per_rank])
            row.pop("spans", None)
            row["local_numel"] = max(r["local_numel"] for r in per_rank)
        merged[name] = row
    anchor = merged.get(rows[0], {})
    base = anchor.get("opt_s") if anchor.get("status") == "ok" else None
    base_step = anchor.get("step_s") if anchor.get("status") == "ok" else None
    local = max(r["local_numel"] for r in merged.values() if "local_numel" in r)
    print(f"\nmedians of {args.steps} steps after {args.warmup}; from the last of {world} ranks to start to the "
          f"last to end; x: ratio to {rows[0]} (> 1 slower); rank ms: the slowest rank's own median")
    head = f"  {'row':<18} {'clip+step ms' if args.clip else 'step() ms':>12} {'x':>6} {'GB/s':>6} {'rank ms':>8}"
    if cuda:
        head += f" {'train step ms':>14} {'x':>6} {'peak GiB':>9}"
    print(head + "  implementation / status")
    for name, row in merged.items():
        if row["status"] != "ok":
            dashes = f" {'-':>14} {'-':>6} {'-':>9}" if cuda else ""
            print(f"  {name:<18} {'-':>12} {'-':>6} {'-':>6} {'-':>8}" + dashes
                  + f"  {row['status']}: {row['error']}")
            continue
        rate = BYTES_PER_ELEMENT * row["local_numel"] / row["opt_s"] / 1e9
        line = (f"  {name:<18} {row['opt_s'] * 1e3:12.2f} {row['opt_s'] / base if base else float('nan'):6.2f}"
                f" {rate:6.1f} {row['rank_opt_s'] * 1e3:8.2f}")
        if cuda:
            line += (f" {row['step_s'] * 1e3:14.2f} {row['step_s'] / base_step if base_step else float('nan'):6.2f}"
                     f" {row['peak_gib']:9.2f}")
        print(line + f"  {row.get('implementation', '')}")
    result: Dict[str, Any] = dict(machine=machine(cuda), mode="gpu" if cuda else "cpu", world=world,
                                  args=vars(args), local_numel=local, rows=merged)
    if not cuda:
        bw = min(out[r]["copy_bytes_per_s"] for r in out)
        result["copy_bytes_per_s"] = bw
        print(f"\nfor reference: a 512 MiB copy on every rank at once, {bw / 1e9:.1f} GB/s per rank (read + write; "
              f"at that rate {BYTES_PER_ELEMENT} B x {local:,} elements would take "
              f"{BYTES_PER_ELEMENT * local / bw * 1e3:.1f} ms)")
        ex = {k: max(out[r]["exchange_s"][k] for r in out) for k in out[0]["exchange_s"]}
        result["exchange_s"] = ex
        print(f"for reference: one small all-gather over the ranks (what ours adds to each step: the inf/nan flag "
              f"and every rank's settings; AdamW runs none) takes {ex['all_gather'] * 1e3:.2f} ms here (median; gloo "
              f"over TCP; an all-reduce of the same size: {ex['all_reduce'] * 1e3:.2f} ms)")
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU mode even where CUDA is available")
    ap.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, every GPU on GPU)")
    ap.add_argument("--width", type=int, default=1024, help="CPU: layer width (default 1024)")
    ap.add_argument("--layers", type=int, default=8, help="CPU: layers, one FSDP unit each (default 8)")
    ap.add_argument("--gpu-width", type=int, default=4096, help="GPU: layer width (default 4096)")
    ap.add_argument("--gpu-layers", type=int, default=16, help="GPU: layers (default 16: 268M parameters)")
    ap.add_argument("--batch", type=int, default=64, help="rows per rank and step (default 64)")
    ap.add_argument("--steps", type=int, default=30,
                    help="timed steps (default 30: medians of 8 drifted by 20%% between runs on a 2-core VM)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads per rank (default 1)")
    ap.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                    help="clip every step, timed with step(): AdamW rows with torch.nn.utils.clip_grad_norm_, ours "
                         "with opt.clip_grad_norm_, ours-torch-clip with torch's (default: none)")
    ap.add_argument("--rows", default=None, help="comma-separated rows to run (default: all of the mode)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    world = args.world or (torch.cuda.device_count() if cuda else 2)
    known = GPU_ROWS if cuda else CPU_ROWS
    if args.rows:
        args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [r for r in args.rows if r not in known]
        if unknown:
            ap.error(f"unknown rows {unknown} in {'GPU' if cuda else 'CPU'} mode; choose from {list(known)}")
        if not args.clip and set(args.rows) & set(CLIP_ONLY):
            ap.error(f"rows {list(CLIP_ONLY)} need --clip")
    width, layers = (args.gpu_width, args.gpu_layers) if cuda else (args.width, args.layers)
    numel = layers * (width * width + width)
    print(f"machine: {machine(cuda)}")
    print(f"{'GPU (NCCL)' if cuda else 'CPU (gloo)'} mode, world {world}; {numel / 1e6:.1f}M fp32 parameters in "
          f"{layers} FSDP units of {width} x {width} (+ bias), about {numel / world / 1e6:.1f}M per rank; batch "
          f"{args.batch} per rank" + ("" if cuda else f"; {args.threads} torch thread(s) per rank"))
    if not cuda:
        print("*** No CUDA here (or --cpu): CPUOffloadPolicy on a CPU mesh, parameters and gradients in host memory"
              " (not pinned: pinning needs an accelerator). GPU rows need a GPU. ***")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out: Dict[int, Dict[str, Any]] = {}
    try:
        while len(out) < world:
            rank, res = queue.get(timeout=1800)
            if "error" in res and isinstance(res["error"], str) and "Traceback" in res["error"]:
                raise SystemExit(f"rank {rank} failed:\n{res['error']}")
            out[rank] = res
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    result = report(args, cuda, world, out)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
