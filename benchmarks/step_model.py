"""The event model's predictions for the GPU step of the 1.3B GPT preset (H100 PCIe, 16-core host), for the
schedules this version has and the follow-ups, as docs/speculation.md and docs/twin-flow.md quote them.

The model is ``../shared/gpu/model/sim.py`` (calibrated to +-2% on the two measured schedules; see
``../shared/gpu/STEP_ANALYSIS.md``), fed the bucket sizes and gradient arrival times of the profiled run. This script
adds one thing to it: speculation as built copies a bucket's state before its kernel (the save copy), so a kernel
started before validation costs (28 + 24) / 28 kernel-times; after validation the queued buckets run plainly.
Estimates, not measurements: the GPU run is ``benchmarks/gpu_suite.py``.

    python benchmarks/step_model.py [--model-dir ../shared/gpu/model]
"""
from __future__ import annotations

import argparse
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAVE_COPY = (28 + 24) / 28  # kernel bytes + the save copy's, over the kernel's, per element


def load_model(model_dir: Path) -> types.ModuleType:
    """``sim.py`` with a cost factor for kernels that start before a given time (``SPEC = [factor, time]``)."""
    source = (model_dir / "sim.py").read_text()
    start = "queue.pop(0); cur = i; left = SIZE[i]; ovh = g"
    if start not in source:
        raise SystemExit(f"{model_dir / 'sim.py'} is not the model this script knows (no {start!r})")
    source = source.replace(start, "queue.pop(0); cur = i; left = SIZE[i] * (SPEC[0] if t < SPEC[1] else 1.0); "
                                   "ovh = g")
    sim = types.ModuleType("sim")
    sim.__file__ = str(model_dir / "sim.py")
    sim.SPEC = [1.0, 0.0]
    exec(compile(source, sim.__file__, "exec"), sim.__dict__)
    return sim


def step_ms(sim: types.ModuleType, *, gpu_buckets: int, speculate: bool, copy: float, uploads_at_once: bool):
    """The step (ms) under the model's three kernel/DMA contention fits: (central, low, high)."""
    arrival_order = list(range(sim.NB - 1, -1, -1))
    validated = sim.B + 0.5  # the checks, right after the last gradient copy
    out = []
    for extra in (dict(), dict(c=0.0), dict(linear_W=140e6)):
        sim.SPEC[:] = [copy, validated] if speculate else [1.0, 0.0]
        out.append(sim.simulate(
            order=arrival_order, gate_kernel=(lambda i: 0) if speculate else (lambda i: validated),
            gate_upload=(lambda i: 0) if uploads_at_once else (lambda i: validated), g=0.1,
            gpu=frozenset(range(gpu_buckets)), v_gpu=validated, **extra)["T"])
    return out[0], min(out[1:]), max(out[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT.parent / "shared" / "gpu" / "model")
    args = ap.parse_args()
    sim = load_model(args.model_dir)
    rows = [("no speculation", False, 1.0, False), ("speculation as built (save copy)", True, SAVE_COPY, False),
            ("out-of-place kernel, uploads after validation", True, 1.0, False),
            ("out-of-place kernel, uploads during backward", True, 1.0, True)]
    print(f"1.3B GPT preset, fused AdamW {sim.T_ADAMW:.0f} ms; GPU tier = buckets 0..m-1 (the last to arrive)")
    print(f"{'schedule':48s} {'GPU tier':>16s} {'step ms':>8s} {'x AdamW':>8s} {'range':>12s}")
    for name, speculate, copy, at_once in rows:
        for m in (0, 1, 8, 12, 16):
            phi = sum(sim.SIZE[:m]) / sim.N
            t, lo, hi = step_ms(sim, gpu_buckets=m, speculate=speculate, copy=copy, uploads_at_once=at_once)
            tier = "none" if not m else f"0..{m - 1} (phi {phi:.2f})"
            print(f"{name:48s} {tier:>16s} {t:8.1f} {t / sim.T_ADAMW:7.2f}x "
                  f"{lo / sim.T_ADAMW:5.2f}-{hi / sim.T_ADAMW:.2f}x")


if __name__ == "__main__":
    main()
