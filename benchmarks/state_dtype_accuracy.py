"""The accuracy cost of compact optimizer state: the demo's task (a byte-level GPT on the Python standard library's
source, ``zero_offload.demo``) trained with ``torch.optim.AdamW`` and with ``OffloadOptimizer`` at each
``state_dtype`` (fp32, bf16, 8-bit), from the same seed on the same batches. Prints a markdown table (final loss as
the mean of the last 10 steps, its change from fp32 state, host bytes of the moments per parameter) and, with
matplotlib, writes the loss curves to ``--out``.

    python benchmarks/state_dtype_accuracy.py --steps 300
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from zero_offload import OffloadOptimizer, _build
from zero_offload.demo import TinyGPT, load_stdlib_text, param_groups, train

STATES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--data-mb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="state_dtype_out")
    args = ap.parse_args(argv)
    _build.load_native()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data = load_stdlib_text(int(args.data_mb * 1e6))
    torch.manual_seed(args.seed)
    base = TinyGPT(args.layers, args.width, args.heads, args.seq).to(device=device, dtype=dtype)
    n = sum(p.numel() for p in base.parameters())
    print(f"{n / 1e6:.2f}M-parameter byte-level GPT ({dtype}) on {device}, {args.steps} steps x "
          f"{args.batch}x{args.seq} bytes, lr {args.lr}", file=sys.stderr)
    runs = {"torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.95))}
    for name, sd in STATES.items():
        runs[f"ours, state {name}"] = lambda ps, sd=sd: OffloadOptimizer(ps, lr=args.lr, betas=(0.9, 0.95),
                                                                          state_dtype=sd)
    results, moments = {}, {}
    for name, make in runs.items():
        model = copy.deepcopy(base)
        opt = make(param_groups(model, 0.1))
        if isinstance(opt, OffloadOptimizer):
            est = opt.host_memory_estimate()
            moments[name] = sum(v for k, v in est.buffers.items() if k.startswith(("exp_avg", "max_exp_avg"))) / n
        results[name] = train(name, model, opt, data, args, device)
    final = {name: sum(r["losses"][-10:]) / 10 for name, r in results.items()}
    base_loss = final["ours, state fp32"]
    rows = ["| optimizer | final loss (mean of last 10) | vs fp32 state | moments, host B/param |",
            "|---|---:|---:|---:|"]
    for name in results:
        change = f"{100 * (final[name] / base_loss - 1):+.2f}%"
        rows.append(f"| {name} | {final[name]:.4f} | {change} | "
                    f"{moments[name]:.3f} |" if name in moments else f"| {name} | {final[name]:.4f} | {change} | - |")
    table = "\n".join(rows)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title="Loss by optimizer state dtype (demo task)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "state_dtypes.png", dpi=110)


if __name__ == "__main__":
    main()
