"""The accuracy cost of the options that change the arithmetic: compact optimizer state (``state_dtype`` bf16 and
8-bit) and ``delayed_update`` (parameters one step stale, with or without N exact steps first). The demo's task (a
byte-level GPT on the Python standard library's source, ``zero_offload.demo``) is trained with ``torch.optim.AdamW``
and with ``OffloadOptimizer`` in each setting, from the same seed on the same batches. Prints a markdown table
(final loss as the mean of the last 10 steps, its change from ours with fp32 state and no delay, host bytes of the
moments per parameter) and, with matplotlib, writes the loss curves to ``--out``.

    python benchmarks/accuracy.py --steps 600
    python benchmarks/accuracy.py --steps 600 --runs fp32,delayed,delayed=10,delayed=50
    python benchmarks/accuracy.py --preset gpt2-small --seq 64 --batch 4 --steps 2000 --runs fp32,bf16,int8

``--runs``: ``adamw``; ``fp32``, ``bf16``, ``int8`` (ours at that ``state_dtype``); ``delayed`` (ours,
``delayed_update=True``) and ``delayed=N`` (``delayed_update=N``). ``fp32`` is the baseline and always runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch

from zero_offload import OffloadOptimizer, _build
from zero_offload.demo import add_task_args, param_groups, setup_task, train
from zero_offload.options import STATE_DTYPES, dtypes_by_name

STATES = dtypes_by_name(STATE_DTYPES)
# GPT-2 small's body (12 blocks, width 768, 12 heads) on the demo's bytes: 85M parameters with a 256-entry vocabulary.
PRESETS = {"gpt2-small": dict(layers=12, width=768, heads=12, lr=6e-4)}
BASELINE = "ours, state fp32"


def make_runs(wanted: List[str], lr: float) -> Dict[str, Callable]:
    """Each run's name and the optimizer it builds over parameter groups; ``ValueError`` names an unknown run."""
    kw = dict(lr=lr, betas=(0.9, 0.95))
    runs: Dict[str, Callable] = {BASELINE: lambda ps: OffloadOptimizer(ps, **kw)}
    for spec in wanted:
        name, _, n = spec.partition("=")
        if spec == "adamw":
            runs["torch AdamW"] = lambda ps: torch.optim.AdamW(ps, **kw)
        elif spec in STATES and spec != "fp32":
            runs[f"ours, state {spec}"] = lambda ps, sd=STATES[spec]: OffloadOptimizer(ps, state_dtype=sd, **kw)
        elif spec == "delayed" or (name == "delayed" and n.isdigit() and int(n) > 0):
            setting = int(n) if n else True
            runs[f"ours, delayed_update={setting}"] = lambda ps, d=setting: OffloadOptimizer(ps, delayed_update=d,
                                                                                              **kw)
        elif spec != "fp32":
            raise ValueError(f"--runs: unknown run {spec!r}")
    return runs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_args(ap)
    ap.add_argument("--preset", choices=sorted(PRESETS),
                    help="a model shape users know, in place of --layers/--width/--heads/--lr")
    ap.add_argument("--runs", default="adamw,fp32,bf16,int8", help="which runs, comma-separated (see above; "
                    "default: adamw,fp32,bf16,int8)")
    ap.add_argument("--out", default="accuracy_out")
    args = ap.parse_args(argv)
    if args.preset:
        vars(args).update(PRESETS[args.preset])
    try:
        runs = make_runs(args.runs.split(","), args.lr)
    except ValueError as exc:
        ap.error(str(exc))
    _build.load_native()
    device, dtype, data, base = setup_task(args)
    n = sum(p.numel() for p in base.parameters())
    print(f"{n / 1e6:.2f}M-parameter byte-level GPT ({dtype}) on {device}, {args.steps} steps x "
          f"{args.batch}x{args.seq} bytes, lr {args.lr}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, moments = {}, {}
    for name, make in runs.items():
        model = copy.deepcopy(base)
        opt = make(param_groups(model, 0.1))
        if isinstance(opt, OffloadOptimizer):
            est = opt.estimate_host_memory()
            moments[name] = sum(v for k, v in est.buffers.items() if k.startswith(("exp_avg", "max_exp_avg"))) / n
        results[name] = train(name, model, opt, data, args, device)
        del model, opt
        # Each curve is kept as soon as its run ends, so a long run that is stopped later keeps what it finished.
        (out / "losses.json").write_text(json.dumps({k: r["losses"] for k, r in results.items()}))
    final = {name: sum(r["losses"][-10:]) / len(r["losses"][-10:]) for name, r in results.items()}
    rows = ["| optimizer | final loss (mean of last 10) | vs ours, fp32 state | moments, host B/param |",
            "|---|---:|---:|---:|"]
    for name in results:
        moment = f"{moments[name]:.3f}" if name in moments else "-"
        rows.append(f"| {name} | {final[name]:.4f} | {100 * (final[name] / final[BASELINE] - 1):+.2f}% | {moment} |")
    table = "\n".join(rows)
    print(table)
    (out / "accuracy.md").write_text(table + "\n")
    chart(results, final, out / "accuracy.png", args.preset or "demo task")


def chart(results: Dict[str, Dict], final: Dict[str, float], path: Path, task: str) -> None:
    """The loss curves, one per run (needs matplotlib; nothing without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(r["losses"], label=f"{name} ({final[name]:.3f})", linewidth=1.2)
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title=f"Loss by optimizer setting ({task})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
