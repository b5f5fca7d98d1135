"""Update-rule throughput over flat host buffers: the Lion rule (torch ops over cache-sized chunks) and the generic
rule running torch.optim classes on whole runs, against our fused CPU-Adam kernel, side by side in one process.

Every candidate runs the offload path: a bf16 gradient in, fp32 master and state updated, a bf16 copy of the new
weights out (``param_out``), over one run of ``--size`` elements. Candidates run interleaved, round by round;
medians are reported as ns per element, elements per second, and "x AdamW kernel": the candidate's time per element
over the fused Adam kernel's in the same rounds (below 1 is faster).

    python benchmarks/cpu_rules.py                       # 2e7 elements, all threads
    python benchmarks/cpu_rules.py --size 4e6 --rounds 5 --threads 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable, Dict

import torch

from zero_offload import functional
from zero_offload.rules.base import Run
from zero_offload.rules.lion import LION


def _candidates(n: int) -> Dict[str, Callable[[], None]]:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    master = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    m16 = torch.zeros(n, dtype=torch.bfloat16)
    lion_group = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1, maximize=False)
    lion_hyper = LION.hyper(lion_group)

    def adam_kernel():
        functional.cpu_adam_(master, grad, m, v, step=10, lr=1e-4, weight_decay=0.1, param_out=out, grad_scale=0.5)

    def lion_rule(state):
        return lambda: LION.update(Run(master, grad, None, [0], state, {}, 1, 0.5, out), lion_hyper)

    cands = {"AdamW kernel (ours, fused)": adam_kernel, "Lion rule (fp32 exp_avg)": lion_rule({"exp_avg": m}),
             "Lion rule (bf16 exp_avg)": lion_rule({"exp_avg": m16})}
    try:
        from zero_offload.rules.torch_class import rule_for
    except ImportError:
        return cands
    for cls, kw in [(torch.optim.SGD, dict(lr=1e-3, momentum=0.9)), (torch.optim.Adagrad, dict(lr=1e-2))]:
        rule = rule_for(cls, kw)
        hyper = rule.hyper({**rule.defaults, **kw})
        state = {b.name: torch.zeros(n) for b in rule.needed(hyper)}
        holder = {"step": 0}

        def generic(rule=rule, hyper=hyper, state=state, holder=holder):
            holder["step"] += 1
            rule.update(Run(master, grad, None, [0], state, {}, holder["step"], 0.5, out), hyper)

        cands[f"generic rule: {cls.__name__}"] = generic
    return cands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=2e7, help="elements of the run (default 2e7)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.size)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {n:.3g} elements, kernel path {functional.resolve_path(torch.float32)}")
    cands = _candidates(n)
    times: Dict[str, list] = {k: [] for k in cands}
    for fn in cands.values():  # warm-up (and the kernel's build or load)
        fn()
    for _ in range(args.rounds):
        for name, fn in cands.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["AdamW kernel (ours, fused)"])
    print(f"{'candidate':34s} {'ns/elem':>8s} {'Gelem/s':>8s} {'x AdamW kernel':>15s}")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"{name:34s} {t / n * 1e9:8.3f} {n / t / 1e9:8.3f} {t / base:15.2f}")


if __name__ == "__main__":
    main()
