"""CPU-Adam throughput: zero_offload's fused kernel against torch AdamW (fused, foreach) and DeepSpeedCPUAdam
(when installed), side by side in one process, with the memory-bandwidth ceiling measured in the same run.

Two paths:
  fp32     fp32 params, grads and moments (what every anchor does natively).
  offload  what ZeRO-Offload really runs: a bf16 gradient in, fp32 master and moments updated, a bf16 copy of the
           new weights out. Ours does it in one pass (cpu_adam_ with param_out); each anchor must upcast the
           gradient, step, then downcast the weights.

Both paths move 28 bytes per element in a single fused pass (fp32: 4 grad + 3 x 8 master/moments; offload:
2 grad + 24 + 2 out); GB/s below is each candidate's logical traffic divided by time, so it is directly comparable
to the ceiling.

Ours runs once per state dtype (--state-dtype, all three by default), side by side: fp32 moments (the reference
line), bf16 moments, 8 bytes less per element (20 B on the fp32 path), and 8-bit block-wise moments, 11.75 bytes
less (16.25 B: one byte per moment each way plus a 4-byte scale per 64 elements each way). Each line prints its
bytes per element, ns per element, GB/s, and "x fp32 state": its time per element over ours with fp32 moments in
the same rounds (below 1 is faster). The ceiling is the best of three streaming kernels (in-place scale, copy,
triad) at the same size and thread count. Candidates and ceiling kernels run interleaved, round by round, and
medians are reported (--stat min for the best round), because shared machines drift. A ceiling that cannot be
one (not measured, under 0.5 GB/s, or beaten by more than 10% by a candidate of the same rounds: its rounds were
disturbed by other load) is reported as invalid, with the reason, instead of as a percentage.

    python benchmarks/cpu_adam.py                  # 1M..200M elements, 1..all threads
    python benchmarks/cpu_adam.py --quick          # small sizes, a smoke run
    python benchmarks/cpu_adam.py --sizes 1e8 --threads 2
    python benchmarks/cpu_adam.py --sizes 2e7 --threads 1,2 --no-anchors --stat min   # state dtypes only

--out-of-place adds, per state dtype of ours, two ways to keep an update undoable: "oop" runs cpu_adam_ with out=
(read one set of master and moments, write another, swapping sets every call: the ping-pong, same single pass and
logical traffic as in place), "+copy" copies master, moments (and 8-bit scales) into an undo buffer with torch's
copy_ and then updates in place (the copy adds the state's bytes read and written again, counted in its B/el). Compare their ns/el with the in-place
line of the same state dtype.

    python benchmarks/cpu_adam.py --sizes 1e7 --threads 2 --paths fp32 --no-anchors --state-dtype fp32,int8 \
        --out-of-place
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zero_offload import functional  # noqa: E402
from zero_offload.report import cpu_features  # noqa: E402

BYTES_PER_ELEM = 28
LR, WD = 1e-3, 0.01
# Bytes per element of the two moments, read and written once each: fp32 4+4 per moment, bf16 2+2, 8-bit 1+1 plus
# its block's 4-byte scale (read and written) shared by 64 elements.
STATE_BYTES = {"fp32": 16, "bf16": 8, "int8": 4 + 2 * 8 / functional.Q8_BLOCK}


def _deepspeed_adam():
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam
    except Exception:  # not installed, or its op cannot build here
        return None


def _state(kind: str, n: int) -> dict:
    """cpu_adam_ keywords holding moments of one state dtype."""
    if kind == "fp32":
        return dict(exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))
    if kind == "bf16":
        return dict(exp_avg=torch.zeros(n, dtype=torch.bfloat16), exp_avg_sq=torch.zeros(n, dtype=torch.bfloat16))
    blocks = functional.q8_scale_numel(n)
    return dict(exp_avg=torch.zeros(n, dtype=torch.int8), exp_avg_sq=torch.zeros(n, dtype=torch.uint8),
                exp_avg_scale=torch.zeros(blocks), exp_avg_sq_scale=torch.zeros(blocks))


def bytes_per_elem(path: str, state: str = "fp32") -> float:
    """Logical traffic per element: gradient in, fp32 master read and written, moments, low-precision copy out."""
    return (4 if path == "fp32" else 2 + 2) + 8 + STATE_BYTES[state]


def _ours(kind: str, path: str, n: int, init: torch.Tensor, grad: torch.Tensor, mode: str = "in place"):
    """Our step with moments of one state dtype: (step function, bytes per element). ``mode``: "in place", "oop"
    (out of place, alternating between two buffer sets) or "+copy" (an undo copy of the state, then in place)."""
    sets = [dict(param=init.clone(), **_state(kind, n)) for _ in range(2 if mode == "oop" else 1)]
    undo = {k: torch.empty_like(t) for k, t in sets[0].items()} if mode == "+copy" else None
    out = torch.empty(n, dtype=torch.bfloat16) if path == "offload" else None
    counter = [0]

    def ours():
        counter[0] += 1
        src = sets[counter[0] % len(sets)]
        if undo is not None:
            for k, t in src.items():
                undo[k].copy_(t)
        dst = sets[(counter[0] + 1) % len(sets)] if mode == "oop" else None
        state = {k: t for k, t in src.items() if k != "param"}
        functional.cpu_adam_(src["param"], grad, step=counter[0], lr=LR, weight_decay=WD, param_out=out, out=dst,
                             **state)

    copy_bytes = 8 + STATE_BYTES[kind] if mode == "+copy" else 0  # the state read and written once more
    return ours, bytes_per_elem(path, kind) + copy_bytes


def make_candidates(path: str, n: int, ds_cls, states=("fp32",), anchors=True, out_of_place=False):
    """name -> (step function, bytes per element); each owns its buffers. Gradients are random once; values do not
    change speed."""
    gen = torch.Generator().manual_seed(0)
    grad_dtype = torch.float32 if path == "fp32" else torch.bfloat16
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    init = torch.randn(n, generator=gen)
    cands = {}

    cands["zero_offload"] = _ours("fp32", path, n, init, grad)
    for kind in states:
        if kind != "fp32":
            cands[f"zero_offload {kind}"] = _ours(kind, path, n, init, grad)
    for kind in states if out_of_place else ():
        for mode in ("oop", "+copy"):
            cands[f"zero_offload {kind} {mode}"] = _ours(kind, path, n, init, grad, mode)
    if not anchors:
        return cands

    def anchor(make_opt):
        param = torch.nn.Parameter(init.clone())
        param.grad = torch.empty(n) if path == "offload" else grad.clone()
        opt = make_opt([param])
        low = torch.empty(n, dtype=torch.bfloat16)

        def step():
            if path == "offload":
                param.grad.copy_(grad)  # upcast
            opt.step()
            if path == "offload":
                low.copy_(param.detach())  # downcast

        return step, BYTES_PER_ELEM

    cands["torch fused"] = anchor(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, fused=True))
    cands["torch foreach"] = anchor(lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=True))
    if ds_cls is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            cands["DeepSpeedCPUAdam"] = anchor(lambda ps: ds_cls(ps, lr=LR, weight_decay=WD, adamw_mode=True))
    return cands


def ceiling_kernels(n: int):
    """Streaming kernels whose best GB/s is the ceiling: (function, bytes per element) by name."""
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return {
        "scale in place": (lambda: a.mul_(1.0000001), 8),  # read-modify-write, like Adam's state
        "copy": (lambda: c.copy_(a), 8),
        "triad": (lambda: torch.add(a, b, alpha=0.5, out=c), 12),
    }


def run(args):
    ds_cls = None if args.no_deepspeed or args.no_anchors else _deepspeed_adam()
    states = [k.strip() for k in args.state_dtype.split(",")]
    unknown = sorted(set(states) - set(STATE_BYTES))
    if unknown:
        raise SystemExit(f"--state-dtype: unknown {', '.join(unknown)} (choose from {', '.join(STATE_BYTES)})")
    threads_all = os.cpu_count() or 1
    thread_list = sorted({int(t) if t != "all" else threads_all for t in args.threads.split(",")})
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rows = []
    for path in args.paths.split(","):
        for n in sizes:
            cands = make_candidates(path, n, ds_cls, states, anchors=not args.no_anchors,
                                    out_of_place=args.out_of_place)
            ceilings = ceiling_kernels(n)
            for threads in thread_list:
                torch.set_num_threads(threads)
                for fn in [c[0] for c in cands.values()] + [k[0] for k in ceilings.values()]:  # warm-up: lazy state, faults
                    fn()
                ceiling_rounds = []
                times = {name: [] for name in cands}
                for _ in range(args.reps):
                    # The ceiling is timed inside every round, next to the candidates, so that drift in this
                    # machine's bandwidth moves both alike.
                    best = 0.0
                    for fn, nbytes in ceilings.values():
                        t0 = time.perf_counter()
                        fn()
                        best = max(best, n * nbytes / (time.perf_counter() - t0) / 1e9)
                    ceiling_rounds.append(best)
                    for name, (fn, _) in cands.items():
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
                point = point_rows(args.stat, dict(path=path, elements=n, threads=threads), times,
                                   {name: c[1] for name, c in cands.items()}, ceiling_rounds)
                print_rows(point)
                rows += point
            del cands, ceilings
            gc.collect()
    return rows


# No machine this runs on streams below this; a ceiling under it is a stalled measurement, not a bandwidth.
MIN_PLAUSIBLE_GBPS = 0.5
# A candidate may beat a streaming kernel by a little (its traffic is counted logically, caches help both); by more
# than this, the ceiling's rounds were disturbed (other load on the machine), not the candidate's.
MAX_FRACTION = 1.10


def ceiling_problem(ceiling, gbps):
    """Why the ceiling measured at one point cannot serve as one (None if it can): not measured, implausibly low,
    or beaten by a candidate measured in the same rounds."""
    if not ceiling or ceiling != ceiling or ceiling == float("inf"):
        return "not measured"
    if ceiling < MIN_PLAUSIBLE_GBPS:
        return f"{ceiling:.2f} GB/s is implausibly low: a stalled measurement (other load?)"
    name, best = max(gbps.items(), key=lambda kv: kv[1])
    if best > MAX_FRACTION * ceiling:
        return (f"{name} ran at {best / ceiling:.1f}x it: the ceiling's rounds were disturbed (other load?); "
                "rerun on a quiet machine or with --stat min")
    return None


def point_rows(stat_name, where, times, bytes_per_elem, ceiling_rounds):
    """One row per candidate at one (path, size, threads) point; the ceiling and each fraction of it only where
    the ceiling is valid (else None, with the reason in ``ceiling_problem``)."""
    stat = min if stat_name == "min" else statistics.median
    ceiling = max(ceiling_rounds) if stat_name == "min" else statistics.median(ceiling_rounds)
    n, ours_t = where["elements"], stat(times["zero_offload"])
    t = {name: stat(ts) for name, ts in times.items()}
    gbps = {name: n * bytes_per_elem[name] / t[name] / 1e9 for name in times}
    problem = ceiling_problem(ceiling, gbps)
    return [dict(where, candidate=name, seconds=t[name], bytes_per_elem=bytes_per_elem[name],
                 ns_per_elem=t[name] / n * 1e9, melem_per_s=n / t[name] / 1e6, gb_per_s=gbps[name],
                 ceiling_gb_per_s=None if problem else ceiling, ceiling_measured_gb_per_s=ceiling,
                 ceiling_problem=problem, fraction_of_ceiling=None if problem else gbps[name] / ceiling,
                 ours_speedup=t[name] / ours_t) for name in times]


def _of_ceiling(r, width=5):
    if r["ceiling_problem"]:
        return f"{'-':>{width}}  (ceiling invalid)"
    return f"{100 * r['fraction_of_ceiling']:{width}.1f}% of {r['ceiling_gb_per_s']:.1f} GB/s"


def machine_info():
    model, flags = cpu_features()
    return dict(cpu=model, cores=os.cpu_count(), features=" ".join(flags), torch=torch.__version__,
                python=platform.python_version(), kernel_path=functional.path_reason())


def print_rows(rows):
    for r in rows:
        print(f"{r['path']:8s} {r['elements']:>11,d} el {r['threads']:>2d} thr  {r['candidate']:23s} "
              f"{r['bytes_per_elem']:6.2f} B/el {r['ns_per_elem']:6.3f} ns/el {r['melem_per_s']:6.0f} Melem/s "
              f"{r['gb_per_s']:6.1f} GB/s  {_of_ceiling(r)}  x{r['ours_speedup']:.2f} fp32 state", flush=True)
    if rows and rows[0]["ceiling_problem"]:
        print(f"  bandwidth ceiling invalid here: {rows[0]['ceiling_problem']}", flush=True)


def markdown(rows, info):
    lines = [f"Machine: {info['cpu']}, {info['cores']} cores ({info['features']}); torch {info['torch']}; "
             f"kernel path {info['kernel_path']}.", "",
             "| path | elements | threads | candidate | B/elem | ns/elem | Melem/s | GB/s | % of ceiling | "
             "time / ours (fp32 state) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['elements']:,} | {r['threads']} | {r['candidate']} | "
                     f"{r['bytes_per_elem']:.2f} | {r['ns_per_elem']:.3f} | "
                     f"{r['melem_per_s']:.0f} | {r['gb_per_s']:.1f} | {_md_of_ceiling(r)} | {r['ours_speedup']:.2f}x |")
    bad = {r["ceiling_problem"] for r in rows if r["ceiling_problem"]}
    if bad:
        lines += ["", "Ceiling invalid where marked: " + "; ".join(sorted(bad))]
    return "\n".join(lines) + "\n"


def _md_of_ceiling(r):
    if r["ceiling_problem"]:
        return "n/a (ceiling invalid)"
    return f"{100 * r['fraction_of_ceiling']:.0f}% (of {r['ceiling_gb_per_s']:.1f})"


def chart(rows, path_png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    top = max(r["threads"] for r in rows)
    paths = sorted({r["path"] for r in rows})
    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4), squeeze=False)
    for ax, path in zip(axes[0], paths):
        sel = [r for r in rows if r["path"] == path and r["threads"] == top]
        for name in dict.fromkeys(r["candidate"] for r in sel):
            pts = sorted((r["elements"], r["melem_per_s"]) for r in sel if r["candidate"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ceil = sorted({(r["elements"], r["ceiling_gb_per_s"] * 1e3 / BYTES_PER_ELEM) for r in sel
                       if not r["ceiling_problem"]})
        ax.plot([c[0] for c in ceil], [c[1] for c in ceil], "k--", label="bandwidth ceiling")
        ax.set_xscale("log")
        ax.set_xlabel("elements")
        ax.set_ylabel("Melem/s")
        ax.set_title(f"{path} path, {top} threads")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8,2e8", help="comma-separated element counts")
    ap.add_argument("--threads", default="1,all", help="comma-separated thread counts ('all' = every core)")
    ap.add_argument("--paths", default="fp32,offload", help="fp32, offload or both")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds per candidate (median reported)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam even if installed")
    ap.add_argument("--state-dtype", default="fp32,bf16,int8",
                    help="comma-separated moment dtypes of ours, from fp32, bf16, int8 (8-bit block-wise); ours "
                         "with fp32 moments always runs beside them")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="per candidate, the median round (default) or the fastest (and the ceiling's best)")
    ap.add_argument("--no-anchors", action="store_true", help="ours only (torch and DeepSpeed skipped)")
    ap.add_argument("--out-of-place", action="store_true",
                    help="also ours out of place (out=, two buffer sets in turn) and ours with an undo copy of the "
                         "state before an in-place update, per state dtype")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1e5 and 1e6 elements, 3 rounds")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.reps = "1e5,1e6", 3
    info = machine_info()
    print(f"# {info['cpu']}, {info['cores']} cores, torch {info['torch']}, zero_offload path {info['kernel_path']}")
    rows = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_adam.json").write_text(json.dumps(dict(machine=info, rows=rows), indent=1))
    (out / "cpu_adam.md").write_text(markdown(rows, info))
    drew = chart(rows, out / "cpu_adam.png")
    print(f"wrote {out / 'cpu_adam.json'}, {out / 'cpu_adam.md'}" + (f", {out / 'cpu_adam.png'}" if drew else ""))


if __name__ == "__main__":
    main()
