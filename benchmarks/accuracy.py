"""The accuracy cost of compact optimizer state: the demo's task (a byte-level GPT on the Python standard library's
source, ``zero_offload.demo``) trained with ``torch.optim.AdamW`` and with ``OffloadOptimizer`` at each
``state_dtype`` (fp32, bf16, 8-bit), from the same seed on the same batches. Prints a markdown table (final loss as
the mean of the last 10 steps, its change from fp32 state, host bytes of the moments per parameter) and, with
matplotlib, writes the loss curves to ``--out``.

    python benchmarks/state_dtype_accuracy.py --steps 600
    python benchmarks/state_dtype_accuracy.py --preset gpt2-small --seq 64 --batch 4 --steps 2000 --runs fp32,bf16,int8
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from zero_offload import OffloadOptimizer, _build
from zero_offload.demo import add_task_args, param_groups, setup_task, train
from zero_offload.options import STATE_DTYPES, dtypes_by_name

STATES = dtypes_by_name(STATE_DTYPES)
# GPT-2 small's body (12 blocks, width 768, 12 heads) on the demo's bytes: 85M parameters with a 256-entry vocabulary.
PRESETS = {"gpt2-small": dict(layers=12, width=768, heads=12, lr=6e-4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_args(ap)
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a model shape users know, in place of --layers/--width/--heads/--lr")
    ap.add_argument("--runs", default="adamw,fp32,bf16,int8",
                    help="which runs, comma-separated: adamw and state dtypes (default: all four)")
    ap.add_argument("--out", default="state_dtype_out")
    args = ap.parse_args(argv)
    if args.preset:
        vars(args).update(PRESETS[args.preset])
    wanted = args.runs.split(",")
    unknown = sorted(set(wanted) - set(STATES) - {"adamw"})
    if unknown or "fp32" not in wanted:
        ap.error(f"--runs: unknown {unknown}" if unknown else "--runs must include fp32, the baseline")
    _build.load_native()
    device, dtype, data, base = setup_task(args)
    n = sum(p.numel() for p in base.parameters())
    print(f"{n / 1e6:.2f}M-parameter byte-level GPT ({dtype}) on {device}, {args.steps} steps x "
          f"{args.batch}x{args.seq} bytes, lr {args.lr}", file=sys.stderr)
    runs = {}
    if "adamw" in wanted:
        runs["torch AdamW"] = lambda ps: torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.95))
    for name, sd in STATES.items():
        if name in wanted:
            runs[f"ours, state {name}"] = lambda ps, sd=sd: OffloadOptimizer(ps, lr=args.lr, betas=(0.9, 0.95),
                                                                              state_dtype=sd)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, moments = {}, {}
    for name, make in runs.items():
        model = copy.deepcopy(base)
        opt = make(param_groups(model, 0.1))
        if isinstance(opt, OffloadOptimizer):
            est = opt.host_memory_estimate()
            moments[name] = sum(v for k, v in est.buffers.items() if k.startswith(("exp_avg", "max_exp_avg"))) / n
        results[name] = train(name, model, opt, data, args, device)
        del model, opt
        # Each curve is kept as soon as its run ends, so a long run that is stopped later keeps what it finished.
        (out / "losses.json").write_text(json.dumps({k: r["losses"] for k, r in results.items()}))
    final = {name: sum(r["losses"][-10:]) / len(r["losses"][-10:]) for name, r in results.items()}
    base_loss = final["ours, state fp32"]
    rows = ["| optimizer | final loss (mean of last 10) | vs fp32 state | moments, host B/param |",
            "|---|---:|---:|---:|"]
    for name in results:
        change = f"{100 * (final[name] / base_loss - 1):+.2f}%"
        rows.append(f"| {name} | {final[name]:.4f} | {change} | "
                    f"{moments[name]:.3f} |" if name in moments else f"| {name} | {final[name]:.4f} | {change} | - |")
    table = "\n".join(rows)
    print(table)
    (out / "state_dtypes.md").write_text(table + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(r["losses"], label=f"{name} ({final[name]:.3f})", linewidth=1.2)
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title=f"Loss by optimizer state dtype ({args.preset or 'demo task'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "state_dtypes.png", dpi=110)


if __name__ == "__main__":
    main()
