"""OffloadOptimizer.step() with the model on CPU: many tensors against one tensor of the same total size, against
torch's fused AdamW on the same tensors, and the host memory it takes per parameter.

What is timed is the whole ``step()`` as a training loop calls it (hooks, hyperparameters, gradient checks and
gathering, the kernel), with the default ``nonfinite="raise"`` policy unless a row says otherwise. Two ways
gradients can arrive:

  fresh      each step's ``.grad`` is a new tensor (``zero_grad()``'s default ``set_to_none=True``): the
             kernel reads each one where it is.
  in-buffer  ``.grad`` is already the flat buffer's view (what ``zero_grad(set_to_none=False)`` sets up, so
             backward accumulates into it): nothing to copy.

Candidates run interleaved, round by round, in one process, and medians are reported, because shared machines
drift. The ceiling is the best GB/s of two streaming kernels (a copy, and an in-place scale: read-modify-write
like the optimizer state) at the same size and thread count, counting 8 B/element each; "GB/s" of a
candidate is its logical traffic (kernel 28 B/element: read gradient 4, read+write master and two moments 24;
plus 4 for the non-finite check) divided by its time.

    python benchmarks/optimizer_step.py                    # 2,000 tensors, 50M elements
    python benchmarks/optimizer_step.py --numel 5e6 --reps 5   # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero_offload import OffloadOptimizer, functional  # noqa: E402
from zero_offload.host_memory import HUGE_PAGES_ENV, format_bytes, huge_pages_on  # noqa: E402

LR, WD = 1e-3, 0.01
PAGE = os.sysconf("SC_PAGE_SIZE")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} with {torch.get_num_threads()} "
            f"threads, python {platform.python_version()}, kernel path {functional.resolve_path()}")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def make_model(numel: int, tensors: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
    grads = [torch.randn(n, generator=gen) * 1e-3 for n in sizes]
    return params, grads


class Ours:
    """An OffloadOptimizer over one model, timed with fresh or in-buffer gradients."""

    def __init__(self, params, grads, **kw):
        self.params, self.fresh = params, grads
        for p, g in zip(params, grads):
            p.grad = g
        self.opt = OffloadOptimizer(params, lr=LR, weight_decay=WD, **kw)
        self.opt.step()  # first touch of everything
        self.opt.zero_grad(set_to_none=False)  # .grad becomes the flat buffer's views...
        self.views = [p.grad for p in params]
        for v, g in zip(self.views, grads):
            v.copy_(g)  # ...holding the same values

    def prepare(self, mode: str, nonfinite: str = "raise"):
        def prep():
            self.opt.nonfinite = nonfinite
            for p, g in zip(self.params, self.fresh if mode == "fresh" else self.views):
                p.grad = g

        return prep


def torch_fused(params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
    opt.step()
    return opt


def measure_memory(numel: int, tensors: int):
    """Host bytes of OffloadOptimizer over a fresh model: the estimate made before allocating, the buffers'
    nbytes, and the process RSS growth over construction and the first step."""
    params, grads = make_model(numel, tensors, seed=1)
    for p, g in zip(params, grads):
        p.grad = g
    estimate = OffloadOptimizer.estimate_host_memory(params)
    gc.collect()
    before = rss()
    opt = OffloadOptimizer(params, lr=LR, weight_decay=WD)
    built = rss()
    opt.step()
    stepped = rss()
    nbytes = {}
    for bufs in opt.host_buffers():
        for name, t in bufs.items():
            nbytes[name] = nbytes.get(name, 0) + t.nbytes
    result = dict(numel=numel, tensors=tensors, estimate_total=estimate.total_bytes, buffers=nbytes,
                  buffers_total=sum(nbytes.values()), rss_construct=built - before, rss_first_step=stepped - built,
                  replaces_param_bytes=estimate.replaces_param_bytes, padded_numel=estimate.padded_numel)
    del opt, params, grads
    gc.collect()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=50e6, help="total parameter elements (default 50e6)")
    ap.add_argument("--tensors", type=int, default=2000, help="tensors in the many-tensor model (default 2000)")
    ap.add_argument("--reps", type=int, default=11, help="interleaved rounds (default 11)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--bucket-numel", type=float, default=None, help="OffloadOptimizer bucket_numel (default: its own)")
    ap.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel, k = int(args.numel), args.tensors
    print(f"machine: {machine()}")
    print(f"model: {k:,} tensors of ~{numel // k:,} elements ({numel:,} total) vs 1 tensor of {numel:,}\n")

    measure_memory(max(numel // 50, k), k)  # once small first: one-time process costs stay out of the figures
    mem = measure_memory(numel, k)
    print("host memory of OffloadOptimizer (fp32 model on CPU):")
    per = {name: b / numel for name, b in mem["buffers"].items()}
    print("  buffers (nbytes): " + ", ".join(f"{n} {format_bytes(b)} ({per[n]:.2f} B/param)"
                                             for n, b in mem["buffers"].items()))
    state = sum(b for n, b in mem["buffers"].items() if n != "grad")
    print(f"  master + moments: {state / numel:.2f} B/param; gradient buffer: {per['grad']:.2f} B/param; "
          f"total {mem['buffers_total'] / numel:.2f} B/param (estimate before allocating: "
          f"{mem['estimate_total'] / numel:.2f}, {'exact' if mem['estimate_total'] == mem['buffers_total'] else 'OFF'}"
          ")")
    print(f"  RSS growth: construction {mem['rss_construct'] / numel:.2f} B/param, first step "
          f"{mem['rss_first_step'] / numel:.2f} B/param; the master replaces the parameters' own "
          f"{mem['replaces_param_bytes'] / numel:.2f} B/param (freed to the allocator, not always to the OS)\n")

    many_p, many_g = make_model(numel, k, seed=2)
    one_p, one_g = make_model(numel, 1, seed=3)
    kw = {} if args.bucket_numel is None else dict(bucket_numel=int(args.bucket_numel))
    ours_many, ours_one = Ours(many_p, many_g, **kw), Ours(one_p, one_g, **kw)
    small_p, small_g = make_model(numel, 1, seed=6)
    if not huge_pages_on():
        print(f"({HUGE_PAGES_ENV} is off here: every row of ours is on ordinary pages)")
    user = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = "0"  # the same optimizer, its buffers on ordinary pages (see host_memory)
    try:
        ours_small = Ours(small_p, small_g, **kw)
    finally:
        if user is None:
            del os.environ[HUGE_PAGES_ENV]
        else:
            os.environ[HUGE_PAGES_ENV] = user
    fused_many_p, fused_many_g = make_model(numel, k, seed=4)
    fused_one_p, fused_one_g = make_model(numel, 1, seed=5)
    fused_many_opt, fused_one_opt = torch_fused(fused_many_p, fused_many_g), torch_fused(fused_one_p, fused_one_g)
    ceil_a, ceil_b = torch.randn(numel), torch.empty(numel)

    noop = lambda: None  # noqa: E731
    many_fresh, one_fresh = f"ours {k} tensors, fresh grads", "ours 1 tensor, fresh grad"
    many_buf, one_buf = f"ours {k} tensors, in-buffer grads", "ours 1 tensor, in-buffer grad"
    many_ignore, fused_many = f"ours {k} tensors, in-buffer, nonfinite=ignore", f"torch fused AdamW {k} tensors"
    small_buf = "ours 1 tensor, in-buffer grad, 4 KiB pages"
    cands = {
        many_fresh: (ours_many.prepare("fresh"), ours_many.opt.step, 28 + 4),
        one_fresh: (ours_one.prepare("fresh"), ours_one.opt.step, 28 + 4),
        many_buf: (ours_many.prepare("views"), ours_many.opt.step, 28 + 4),
        one_buf: (ours_one.prepare("views"), ours_one.opt.step, 28 + 4),
        small_buf: (ours_small.prepare("views"), ours_small.opt.step, 28 + 4),
        many_ignore: (ours_many.prepare("views", "ignore"), ours_many.opt.step, 28),
        fused_many: (noop, fused_many_opt.step, 28),
        "torch fused AdamW 1 tensor": (noop, fused_one_opt.step, 28),
        "ceiling: streaming copy": (noop, lambda: ceil_b.copy_(ceil_a), 8),
        "ceiling: scale in place": (noop, lambda: ceil_a.mul_(1.0000001), 8),
    }
    times = {name: [] for name in cands}
    for prep, fn, _ in cands.values():  # warm-up
        prep()
        fn()
    for _ in range(args.reps):
        for name, (prep, fn, _) in cands.items():
            prep()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ceiling = 8 * numel / min(med["ceiling: streaming copy"], med["ceiling: scale in place"]) / 1e9

    print(f"step time, median of {args.reps} interleaved rounds:")
    print(f"  {'candidate':<50} {'median ms':>9} {'min ms':>8} {'GB/s':>6} {'% ceil':>6}")
    for name, (_, _, traffic) in cands.items():
        gbs = traffic * numel / med[name] / 1e9
        print(f"  {name:<50} {med[name] * 1e3:9.1f} {min(times[name]) * 1e3:8.1f} {gbs:6.1f} "
              f"{100 * gbs / ceiling:5.0f}%")

    checks = [
        (f"{k} tensors / 1 tensor, fresh grads", med[many_fresh] / med[one_fresh], 1.15),
        (f"{k} tensors / 1 tensor, in-buffer grads", med[many_buf] / med[one_buf], 1.15),
        (f"ours {k} fresh / torch fused {k}", med[many_fresh] / med[fused_many], 1.0),
        (f"ours {k} in-buffer / torch fused {k}", med[many_buf] / med[fused_many], 1.0),
        (f"ours {k} in-buffer, ignore / torch fused {k}", med[many_ignore] / med[fused_many], 1.0),
        ("ours 1 in-buffer: huge pages / 4 KiB pages", med[one_buf] / med[small_buf], 1.0),
    ]
    print("\nratios (target):")
    for label, ratio, target in checks:
        print(f"  {label:<50} {ratio:6.3f}  (< {target:.2f}: {'yes' if ratio < target else 'NO'})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(machine=machine(), memory=mem, median_s=med,
                                                   times_s=times, ratios={c[0]: c[1] for c in checks}), indent=1))


if __name__ == "__main__":
    main()
