"""The pass over the gradients before a step: their sum of squares and whether one is inf/nan, which ours makes for
``clip_grad_norm_`` and for the ``nonfinite`` check (``nonfinite="raise"``/``"skip"``, on by default), against what
torch runs for the same answers, side by side in one process.

Rows (each reads every gradient once; GB/s is the gradient's bytes over the time):

  ours            ``functional.grad_sq_norm``: the sum of squares and the inf/nan flag in one native pass;
  ours-segments   ``functional.grad_sq_norm_segments`` over the same bytes cut into 8 tensors (FSDP2's host shards,
                  read where FSDP left them);
  torch-norm      ``torch.linalg.vector_norm(g)`` (what ``torch.nn.utils.clip_grad_norm_`` computes per tensor;
                  no inf/nan flag: a NaN or inf norm says one is there, an overflowed sum says the same);
  torch-finite    ``torch.isfinite(g).all()`` (the flag alone);
  torch-sum       ``g.sum()``: a plain read of the same bytes, for reference.

    python benchmarks/grad_norm.py                       # 16.8M fp32 elements, 1 thread
    python benchmarks/grad_norm.py --numel 67108864 --threads 2 --dtype bfloat16

Medians over ``--reps`` rounds, the rows interleaved round by round (shared machines drift); x: the row's time over
``ours``'s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=16_777_216, help="elements (default 16,777,216: 64 MiB of fp32)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the native pass uses the same)")
    ap.add_argument("--reps", type=int, default=21, help="rounds (default 21)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from zero_offload import functional

    g = torch.randn(args.numel).to(getattr(torch, args.dtype))
    pieces = list(g.chunk(8))
    rows = {
        "ours": lambda: functional.grad_sq_norm(g),
        "ours-segments": lambda: functional.grad_sq_norm_segments(pieces),
        "torch-norm": lambda: float(torch.linalg.vector_norm(g)),
        "torch-finite": lambda: bool(torch.isfinite(g).all()),
        "torch-sum": lambda: float(g.sum()),
    }
    times = {name: [] for name in rows}
    for fn in rows.values():
        fn()  # (the native build, and first touches)
    for _ in range(args.reps):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    nbytes = g.numel() * g.element_size()
    print(f"{args.numel:,} {args.dtype} elements ({nbytes / 2**20:.0f} MiB), {args.threads} thread(s), "
          f"path {functional.resolve_path()}; medians of {args.reps}")
    base = statistics.median(times["ours"])
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:<14} {t * 1e3:8.2f} ms {nbytes / t / 1e9:6.1f} GB/s  x{t / base:5.2f}")


if __name__ == "__main__":
    main()
