"""The host time of ``step()`` for parked buckets: a model of many small parameters (``--params``, 200 by default:
matrices and vectors of a few hundred elements each), every bucket parked, stepped on the GPU code path with the
CUDA stand-ins of the tests (on the CPU: the device's kernels run on tiny tensors, so what is timed is mostly the
Python and dispatch work per parameter that a real GPU would wait on). AdamW (``OffloadOptimizer``), Lion
(``offload(zero_offload.Lion)``) and Adafactor (``offload(torch.optim.Adafactor)``, stepped whole, its factored
state in the shaped buffer); each one's reference class stepping the same model on the CPU is timed beside it.

Backward runs untimed before each step; the median over ``--steps`` steps (after two warm-up steps) of the CPU time
of the thread that runs ``step()`` (``time.thread_time``: with one torch thread, the Python and the tiny kernels;
steadier than the wall clock on a shared machine) is printed as ms per step and µs per parameter. Lion's device
update runs its multi-tensor code on the stand-ins too (``zero_offload.Lion`` picks it for CUDA tensors, the
single-tensor loop elsewhere): what a GPU's host would run. To compare two trees, run it with ``--root`` on each (a
checkout of an older commit, say) and quote both:

    python benchmarks/parked_overhead.py
    python benchmarks/parked_overhead.py --root /tmp/base --steps 50 --threads 1
    python benchmarks/parked_overhead.py --profile Lion     # the hottest package functions of Lion's steps
    python benchmarks/parked_overhead.py --dtype bf16       # bf16 parameters, their fp32 masters parked
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path


def _model(torch, n: int, dtype):
    """``n`` parameters of ``dtype``: a 12x20 matrix and a 20-vector in turn (an MLP's weights and biases, small)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(12, 20) if i % 2 == 0 else (20,) for i in range(n)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _time(torch, params, opt, steps: int, profile: bool):
    def backward(k):
        gen = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)

    for k in range(2):  # (warm-up: the first steps allocate, probe and build)
        backward(k)
        opt.step()
    times, prof = [], cProfile.Profile() if profile else None
    for k in range(steps):
        backward(k + 2)
        start = time.thread_time()
        if prof is not None:
            prof.enable()
        opt.step()
        if prof is not None:
            prof.disable()
        times.append(time.thread_time() - start)
    return statistics.median(times), prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="the checkout to time")
    ap.add_argument("--params", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="the parameters' dtype (bf16: fp32 masters parked too, the parameters written from them)")
    ap.add_argument("--profile", default="", help="profile the steps of this row (AdamW, Lion, Adafactor)")
    ap.add_argument("--sort", default="tottime", help="--profile: the pstats order (tottime, cumulative)")
    ap.add_argument("--top", type=int, default=25, help="--profile: how many functions to list")
    args = ap.parse_args()
    sys.path[:0] = [args.root, os.path.join(args.root, "tests")]
    import torch

    import cuda_standins
    import zero_offload
    import zero_offload.rules.lion as lion_rule

    pkg = os.path.dirname(zero_offload.__file__)
    if not pkg.startswith(os.path.abspath(args.root)):
        raise SystemExit(f"zero_offload was imported from {pkg}, not from {args.root}")
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"{args.params} {args.dtype} parameters, every bucket parked on the CUDA stand-ins; tree {args.root}")
    rows = {
        "AdamW": (lambda ps: zero_offload.OffloadOptimizer(ps, lr=1e-3, placement="parked"),
                  lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)),
        "Lion": (lambda ps: zero_offload.offload(zero_offload.Lion, ps, lr=1e-4, weight_decay=0.1,
                                                 placement="parked"),
                 lambda ps: zero_offload.Lion(ps, lr=1e-4, weight_decay=0.1)),
        "Adafactor": (lambda ps: zero_offload.offload(torch.optim.Adafactor, ps, placement="parked"),
                      lambda ps: torch.optim.Adafactor(ps)),
    }
    print(f"{'optimizer':<10} {'ours ms/step':>13} {'us/param':>9} {'class ms/step':>14} {'ours/class':>11}")
    for name, (ours, theirs) in rows.items():
        with cuda_standins.installed():
            # (the update on the GPU: its multi-tensor code, as for CUDA tensors)
            single, lion_rule._single_tensor_lion = lion_rule._single_tensor_lion, lion_rule._multi_tensor_lion
            params = _model(torch, args.params, dtype)
            opt = ours(params)
            homes = {b.home.kind for group in opt._buckets for b in group}
            assert homes == {"parked"}, homes
            try:
                mine, prof = _time(torch, params, opt, args.steps, args.profile == name)
            finally:
                lion_rule._single_tensor_lion = single
        params = _model(torch, args.params, dtype)
        ref, _ = _time(torch, params, theirs(params), args.steps, False)
        print(f"{name:<10} {mine * 1e3:13.2f} {mine * 1e6 / args.params:9.1f} {ref * 1e3:14.2f} {mine / ref:11.2f}")
        if prof is not None:
            pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
