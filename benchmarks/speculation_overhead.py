"""The CPU cost of speculation (``speculate``) per step, with many small tensors, measured on a CPU-only machine.

Two rows:

  standins   the CUDA code path run on CPU tensors (tests/cuda_standins.py: streams and events do nothing), so
             gradients stream from backward hooks and speculation runs in its worker: process CPU time (every
             thread) of one training step (backward, the worker's speculation, ``step()``) with speculate off and
             on. On a GPU the speculative work overlaps backward; here it is only counted.
  cpu        a CPU model (nothing streamed, nothing speculated): ``step()``'s process CPU time with the default
             ``speculate`` (None) and with it off; run it once with this tree and once with ``--tree`` another
             checkout (e.g. one from before speculation, which has no such option: both rows are then its only schedule).

  window     the undo memory speculation holds (stand-ins, the default ``speculation_memory``): 12 buckets of
             2**21 elements, each speculative kernel made 60 ms slower, so that, as on a GPU, backward outruns the
             worker and step() finds most buckets still queued; at step 3 a 1 s pause between backward and step()
             (an eval, a log) lets the worker reach every bucket. Prints the undo bytes held step by step.

Min over rounds of the per-step mean (the machine may be shared: the min is the least disturbed).

    python benchmarks/speculation_overhead.py --tensors 2000 --rounds 7
    python benchmarks/speculation_overhead.py --rows cpu --tree ../other-checkout
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _params(n: int, numel: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(n)]


def _step_time(opt, params, steps: int, wait_worker: bool):
    """Mean process CPU time of one training step (backward through a cheap loss, the worker, ``step()``), and of
    its ``step()`` alone."""
    weights = [torch.full((), 1.0 + i / len(params)) for i in range(len(params))]

    def one() -> float:
        opt.zero_grad()
        loss = sum((p * w).sum() for p, w in zip(params, weights))
        loss.backward()
        if wait_worker:  # the worker's speculation counts too (it would overlap backward on a GPU)
            opt._mode._worker.submit(lambda: None).result()  # (one thread: every job before it is done)
        t = time.process_time()
        opt.step()
        return time.process_time() - t

    for _ in range(3):
        one()
    t = time.process_time()
    in_step = sum(one() for _ in range(steps))
    return (time.process_time() - t) / steps, in_step / steps


def _undo_held(opt) -> int:
    """Bytes of speculation's undo buffers: the pool's row of the estimate, or (a tree from before the pool) the
    buffers each bucket kept."""
    undo = getattr(opt._mode, "_undo", None)
    if undo is not None:
        return sum(t.nbytes for buffers in undo.values() for t in buffers.values())
    return opt.estimate_host_memory().buffers.get("undo", 0)


def _state_bytes(bucket) -> int:
    return bucket.master.nbytes + sum(t.nbytes for t in bucket.store.tensors().values())


def _best(old, new):
    return new if old is None else (min(old[0], new[0]), min(old[1], new[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=100, help="elements per tensor (default 100)")
    ap.add_argument("--bucket-numel", type=int, default=1 << 14)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="standins,cpu", help="standins, cpu, window (default: standins,cpu)")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose zero_offload is measured (default: this)")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import zero_offload
    from zero_offload import OffloadOptimizer

    print(f"zero_offload from {Path(zero_offload.__file__).parent}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.tensors} tensors x {args.numel} elements")
    rows = args.rows.split(",")
    if "cpu" in rows:
        best = {}
        for _ in range(args.rounds):
            for label, kw in (("default", {}), ("speculate=False", {"speculate": False})):
                params = _params(args.tensors, args.numel)
                try:
                    opt = OffloadOptimizer(params, bucket_numel=args.bucket_numel, **kw)
                except TypeError:  # a tree without the option
                    opt = OffloadOptimizer(params, bucket_numel=args.bucket_numel)
                best[label] = _best(best.get(label), _step_time(opt, params, args.steps, False))
        for label, (t, s) in best.items():
            print(f"cpu       {label:16s} {t * 1e3:8.2f} ms CPU per step, of which step() {s * 1e3:8.2f} ms")
    if "standins" in rows:
        sys.path.insert(0, str(ROOT / "tests"))
        import cuda_standins
        cuda_standins.install(setattr)
        best = {}
        for _ in range(args.rounds):
            for label, spec in (("speculate=False", False), ("speculate=True", True)):
                params = _params(args.tensors, args.numel)
                opt = OffloadOptimizer(params, bucket_numel=args.bucket_numel, speculate=spec)
                best[label] = _best(best.get(label), _step_time(opt, params, args.steps, spec))
                if spec:
                    stats = opt.speculation_stats
        for label, (t, s) in best.items():
            print(f"standins  {label:16s} {t * 1e3:8.2f} ms CPU per step, of which step() {s * 1e3:8.2f} ms")
        print(f"standins  buckets {len(opt._buckets[0])}; last run's {stats}")
        print(f"standins  undo bytes held after {args.steps + 3} steps: {_undo_held(opt):,} (state: master and "
              f"moments {sum(_state_bytes(b) for b in opt._buckets[0]):,})")
    if "window" in rows:
        _window()


def _window(steps: int = 30, pause_at: int = 3) -> None:
    """The ``window`` row (see the module docstring); needs the stand-ins installed."""
    sys.path.insert(0, str(ROOT / "tests"))
    import cuda_standins
    from zero_offload import OffloadOptimizer, speculation

    cuda_standins.install(setattr)
    kernel = speculation.run_rule

    def slow(*a, **kw):
        time.sleep(0.06)
        return kernel(*a, **kw)

    speculation.run_rule = slow
    n, numel = 12, 1 << 21
    params = _params(n, numel)
    opt = OffloadOptimizer(params, bucket_numel=numel, speculate=True)
    held = []
    for step in range(steps):
        opt.zero_grad()
        sum((p * (1.0 + i / n)).sum() for i, p in enumerate(params)).backward()
        if step == pause_at:
            time.sleep(1.0)
        opt.step()
        held.append(_undo_held(opt))
    speculation.run_rule = kernel
    state = sum(_state_bytes(b) for b in opt._buckets[0])
    print(f"window    {n} buckets, state (master and moments) {state / 2**20:.0f} MiB; undo MiB held after each step "
          f"(a pause at step {pause_at}): " + " ".join(f"{b / 2**20:.0f}" for b in held))
    print(f"window    {opt.speculation_stats}")


if __name__ == "__main__":
    main()
