"""``python -m zero_offload.demo``: train a small GPT on real text twice, with ``torch.optim.AdamW`` and with
``OffloadOptimizer``, from the same seed and on the same batches, and show that the two agree.

The text is the Python standard library's own source code, read from this machine's disk (nothing is downloaded),
modelled byte by byte. On a GPU the model is bf16 (ours keeps fp32 masters on the host); on a CPU it is fp32.
At the end: a table (final loss, step time, optimizer-state memory and where it lives) and a PNG chart of both
loss curves and step times, in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


def load_stdlib_text(max_bytes: int) -> torch.Tensor:
    """Up to max_bytes of the standard library's .py files, in a fixed order, as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A byte-level GPT: token and position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, layers: int, width: int, heads: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        for m in self.modules():  # GPT-2's initialisation: small weights keep the tied head's first logits near 0
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    """The usual recipe: no decay for biases, LayerNorm and embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "tok" not in name and "pos" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def state_bytes(opt: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes of optimizer state by device, each storage counted once (ours keeps views into flat buffers)."""
    seen, by_device = set(), {}
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    by_device[str(t.device)] = by_device.get(str(t.device), 0) + s.nbytes()
    return by_device


class Progress:
    """A progress line with loss, tokens/s and an ETA. On a terminal it redraws in place (at most 10 times a
    second); otherwise (a log file, CI) it writes a whole line at every tenth of the run, so a log gets 10 short
    lines rather than one line of thousands of carriage returns."""

    def __init__(self, name: str, total: int, stream=None):
        self.name, self.total, self.stream = name, total, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = self.last = time.perf_counter()
        self.next_mark = 1

    def update(self, done: int, text: str) -> None:
        now = time.perf_counter()
        eta = (now - self.start) / done * (self.total - done)
        frac = done / self.total
        line = f"{self.name:>16s} {done}/{self.total} {text}, ETA {eta:.0f} s"
        if self.tty:
            if now - self.last >= 0.1 or done == self.total:
                bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
                print(f"\r{self.name:>16s} [{bar}] {done}/{self.total} {text}, ETA {eta:.0f} s  ", end="",
                      file=self.stream, flush=True)
                self.last = now
            if done == self.total:
                print(file=self.stream)
        elif frac * 10 >= self.next_mark:
            self.next_mark = int(frac * 10) + 1
            print(line, file=self.stream, flush=True)


def train(name, model, opt, data, args, device) -> Dict:
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for both runs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    losses, times = [], []
    tokens = args.batch * args.seq
    progress = Progress(name, args.steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        idx = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([data[i : i + args.seq + 1] for i in idx.tolist()]).long().to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        progress.update(step + 1, f"loss {losses[-1]:.3f} {tokens / times[-1]:,.0f} tok/s")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return dict(losses=losses, times=times, state=state_bytes(opt), peak=peak)


def chart(results: Dict[str, Dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    # The curves coincide: the first is drawn wide and pale, the second dashed on top, so both stay visible.
    styles = [dict(linewidth=3.5, alpha=0.45), dict(linewidth=1.2, linestyle="--")]
    times = {name: [1e3 * t for t in r["times"]] for name, r in results.items()}
    for (name, r), style in zip(results.items(), styles):
        a.plot(r["losses"], label=name, **style)
        b.plot(times[name], label=name, **style)
    a.set(xlabel="step", ylabel="training loss (nats/byte)", title="Loss: both optimizers, same seed and batches")
    b.set(xlabel="step", ylabel="ms", title="Step time (forward + backward + step)")
    # A busy machine stalls a few steps for seconds; keep the axis on the typical step and count the others.
    top = 3 * max(statistics.median(t) for t in times.values())
    clipped = sum(t > top for ts in times.values() for t in ts)
    b.set_ylim(0, top)
    if clipped:
        b.text(0.02, 0.97, f"{clipped} steps above {top:.0f} ms not shown (other load on the machine)",
               transform=b.transAxes, va="top", fontsize=8)
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def add_task_args(ap: argparse.ArgumentParser) -> None:
    """The task's options (model shape, batches, learning rate, data, seed, device), shared with the benchmarks."""
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default: 300)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (default: 4)")
    ap.add_argument("--width", type=int, default=128, help="model width (default: 128)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence (default: 128)")
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (default: 16)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (default: auto)")
    ap.add_argument("--data-mb", type=float, default=4.0, help="MB of stdlib source to read (default: 4)")
    ap.add_argument("--seed", type=int, default=0)


def setup_task(args) -> Tuple[torch.device, torch.dtype, torch.Tensor, nn.Module]:
    """The device, the model dtype (bf16 on a GPU, fp32 on a CPU), the text and the seeded initial model."""
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    data = load_stdlib_text(int(args.data_mb * 1e6))
    torch.manual_seed(args.seed)
    base = TinyGPT(args.layers, args.width, args.heads, args.seq).to(device=device, dtype=dtype)
    return device, dtype, data, base


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_args(ap)
    ap.add_argument("--out", default="demo_out", help="folder for the chart and table (default: demo_out)")
    args = ap.parse_args(argv)

    from zero_offload import OffloadOptimizer, _build

    # Build (or load) the kernel before anything is timed: a build takes a minute or more and is not a step. The
    # build itself logs that it starts and why; the line below says what this run got, built or not.
    _build.load_native()
    print(f"zero_offload demo: native kernel {_build.status().summary()}", file=sys.stderr)

    device, dtype, data, base = setup_task(args)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"zero_offload demo: {n_params / 1e6:.2f}M-parameter byte-level GPT ({dtype}) on {device}, "
          f"{data.numel() / 1e6:.1f} MB of Python stdlib source, {args.steps} steps x {args.batch}x{args.seq} bytes",
          file=sys.stderr)

    results = {}
    for name, make in (
        ("torch AdamW", lambda ps: torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.95))),
        # (the state off the GPU, what the table shows: the default, "auto", would keep a small model's on a GPU)
        ("OffloadOptimizer", lambda ps: OffloadOptimizer(ps, lr=args.lr, betas=(0.9, 0.95), placement="host")),
    ):
        model = copy.deepcopy(base)
        results[name] = train(name, model, make(param_groups(model, 0.1)), data, args, device)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # What the product is for: optimizer state off the GPU (on a CPU run both optimizers keep it in host memory).
    rows = ["| optimizer | final loss (mean of last 10) | median step | optimizer state on the GPU "
            "| optimizer state in host memory | peak GPU memory |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        final = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        step_ms = 1e3 * sorted(r["times"])[len(r["times"]) // 2]
        gpu = sum(b for d, b in r["state"].items() if d.startswith("cuda"))
        gpu_cell = f"{gpu / 2**20:.1f} MiB" if device.type == "cuda" else "- (CPU run)"
        peak = "-" if r["peak"] is None else f"{r['peak'] / 2**20:.1f} MiB"
        rows.append(f"| {name} | {final:.4f} | {step_ms:.1f} ms | {gpu_cell} | "
                    f"{r['state'].get('cpu', 0) / 2**20:.1f} MiB | {peak} |")
    table = "\n".join(rows)
    (out / "demo.md").write_text(table + "\n")
    print(table)
    drew = chart(results, out / "demo.png")
    print(f"wrote {out / 'demo.md'}"
          + (f" and {out / 'demo.png'}" if drew else " (pip install matplotlib for the chart)"))


if __name__ == "__main__":
    main()
