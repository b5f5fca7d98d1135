"""The event model's predictions for the GPU step of the 1.3B GPT preset, for the schedules this tree runs: each row is
an :class:`~zero_offload.options.Options` (the default, a numeric ``gpu_fraction``, ``gpu_fraction="auto"``), and
what the model simulates is read from the code, not written here: which buckets ``gpu_fraction`` keeps on the GPU
(``home_plan``, or for ``"auto"`` the buckets that fit in the GPU memory the offloaded step leaves, as
``placement.place_on_device`` decides). Then ``delayed_update`` (one step
stale, so not one of the exact rows), with its uploads during the next backward or not as
``Options.uploads_in_backward`` says, and with every upload at ``step()``: the schedule the first H100 run measured
(417 ms; the model gives 391, so read its delayed rows as lower bounds).

The model is ``../shared/gpu/model/sim.py`` (calibrated to +-2% on the two measured schedules of the first H100 run;
see ``../shared/gpu/STEP_ANALYSIS.md``), fed the bucket sizes and gradient arrival times of the profiled run.
``--kernel-ms`` rescales its CPU kernel to another host (the runbook prints "CPU Adam kernel N ms over 1,313,722,368
elements"), ``--gpu-gib``/``--peak-gib`` the room ``"auto"`` finds. Estimates, not measurements: the GPU run is
``benchmarks/gpu_suite.py``.

    python benchmarks/step_model.py [--model-dir ../shared/gpu/model] [--kernel-ms 323]
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
D2D_BYTES_PER_MS = 1.3e9  # a device-to-device copy on an H100 (delayed_update's uploads in backward, into place)


def load_model(model_dir: Path) -> types.ModuleType:
    """``sim.py``, loaded from ``model_dir``."""
    sim = types.ModuleType("sim")
    sim.__file__ = str(model_dir / "sim.py")
    exec(compile((model_dir / "sim.py").read_text(), sim.__file__, "exec"), sim.__dict__)
    return sim


def gpu_buckets(sim: types.ModuleType, fraction, room_bytes: float) -> int:
    """How many of the last-arriving buckets (0..m-1 in the model's numbering) keep their state on the GPU."""
    import torch

    from zero_offload.buckets import home_plan
    from zero_offload.options import Options
    from zero_offload.state.layout import BucketLayout

    if fraction == "auto":  # as placement.place_on_device: the last to arrive first, while they fit
        m, used = 0, 0.0
        for i in range(sim.NB):
            cost = 12.0 * sim.SIZE[i]  # fp32 parameters: moments on the GPU, the parameter its own master
            if used + cost > room_bytes:
                break
            used, m = used + cost, m + 1
        return m
    # home_plan takes a group's buckets in construction order: the first ones (backward's last) go.
    layouts = [BucketLayout((0,), (0,), (sim.SIZE[i],), sim.SIZE[i], torch.device("cuda"), torch.float32)
               for i in range(sim.NB)]
    return home_plan(layouts, Options(gpu_fraction=fraction)).count("resident")


def step_ms(sim: types.ModuleType, gpu: int):
    """The step (ms) under the model's three kernel/DMA contention fits: (central, low, high)."""
    arrival_order = list(range(sim.NB - 1, -1, -1))
    validated = sim.B + 0.5  # the checks, right after the last gradient copy
    out = [sim.simulate(order=arrival_order, gate_kernel=lambda i: validated, gate_upload=lambda i: validated, g=0.1,
                        gpu=frozenset(range(gpu)), v_gpu=validated, **extra)["T"]
           for extra in (dict(), dict(c=0.0), dict(linear_W=140e6))]
    return out[0], min(out[1:]), max(out[1:])


def delayed_ms(sim: types.ModuleType, uploads_in_backward: bool, r0: float = 4.91e6, g: float = 0.1) -> float:
    """``delayed_update``'s step (ms): the worker runs the last step's kernels (plan order, ``r0`` elements per ms,
    ``g`` ms each besides, 12% slower while a copy runs) from the end of ``step()`` through the next forward and
    backward. Its parameters go up at ``step()`` once the last kernel has run, or (``uploads_in_backward``) each
    bucket's into a device buffer once its kernel has run and backward has sent its gradients, then one
    device-to-device copy at ``step()``. The next forward starts when they have landed. Times from the forward's
    start, with the model's rates (uploads 38.4 GB/s beside a kernel, 50.6 alone)."""
    dt, t = 0.005, 0.0
    sent = [sim.F + sim.ARR[i]["d2h_start"] for i in range(sim.NB)]
    d2h = [(sim.F + sim.ARR[i]["d2h_start"], sim.F + sim.ARR[i]["d2h_end"]) for i in range(sim.NB)]
    queue, cur, left, kdone = list(range(sim.NB)), None, 0.0, {}
    ucur, uleft, udone = None, 0.0, {}
    while queue or cur is not None or (uploads_in_backward and len(udone) < sim.NB):
        copying = ucur is not None or any(a <= t < b for a, b in d2h)
        if cur is None and queue:
            cur = queue.pop(0)
            left = sim.SIZE[cur] + g * r0  # (the per-bucket overhead, as elements at the kernel's rate)
        if cur is not None:
            left -= (r0 / 1.12 if copying else r0) * dt
            if left <= 0:
                kdone[cur], cur = t, None
        if uploads_in_backward:
            if ucur is None:  # one copy stream: the first bucket both computed and sent
                ready = [i for i in kdone if i not in udone and t >= sent[i]]
                if ready:
                    ucur = min(ready, key=lambda i: max(kdone[i], sent[i]))
                    uleft = 4.0 * sim.SIZE[ucur]
            if ucur is not None:
                uleft -= (38.4e6 if cur is not None else 50.6e6) * dt
                if uleft <= 0:
                    udone[ucur], ucur = t, None
        t += dt
    start = max(sim.F + sim.B, max(kdone.values()))
    if uploads_in_backward:
        return max(start, max(udone.values())) + 4.0 * sim.N / D2D_BYTES_PER_MS
    return start + 4.0 * sim.N / 50.6e6


def homes_step_ms(sim: types.ModuleType, homes, r0: float, spare_bytes: float = 0.0, copy_bytes: float = 50.6e6):
    """The step (ms) with each bucket in its home (``homes``, the model's numbering, as
    ``zero_offload.cost_model.plan_homes`` gives them): the host buckets as the default schedule runs them (their
    kernels and uploads after the checks, their gradients copied down as they arrive); each parked bucket's state
    (8 B per element, fp32 model) coming up on the upload stream once its gradients are final, one after another at
    ``copy_bytes`` per ms, the GPU stepping it once it has landed and the checks have passed, then its write-back
    going down, one after another at the same rate; the resident buckets stepped right after the checks. The next
    forward (``sim.F``) claims back what backward freed: what is still to go down beyond ``spare_bytes`` by its end
    makes it wait. Returns (step ms with that wait, the reloads' end and the write-backs' end after backward's end,
    the wait)."""
    validated = sim.B + 0.5
    reloaded = written = 0.0
    for i in sorted((i for i in range(sim.NB) if homes[i] == "parked"), key=lambda i: sim.ARR[i]["d2h_start"]):
        reloaded = max(reloaded, sim.ARR[i]["d2h_start"]) + 8.0 * sim.SIZE[i] / copy_bytes
        written = max(written, reloaded, validated) + 8.0 * sim.SIZE[i] / copy_bytes
    on_gpu = frozenset(i for i in range(sim.NB) if homes[i] != "host")
    step = sim.simulate(order=list(range(sim.NB - 1, -1, -1)), gate_kernel=lambda i: validated,
                        gate_upload=lambda i: validated, g=0.1, gpu=on_gpu, v_gpu=max(validated, reloaded),
                        r0=r0)
    wait = max(0.0, written - spare_bytes / copy_bytes - (sim.B + step["X"] + sim.F)) if written else 0.0
    return step["T"] + wait, reloaded - sim.B, written - sim.B, wait


def placement_rows(sim: types.ModuleType, r0: float, gpu_gib: float, peak_gib: float, freed_gib: float,
                   margin_gib: float) -> None:
    """The three homes' rows: every bucket on the host, every bucket parked, and ``placement="auto"`` (the code's
    own cost model, told the forward's time) on the whole GPU and at a GPU capped at the all-host placement's peak
    plus 1 GiB (where AdamW, 52 GiB at its peak, does not fit)."""
    from zero_offload.cost_model import BucketCost, Rates, plan_homes

    rates = Rates(kernel=r0, upload=50.6e6, download=50.6e6)  # (per ms: the model's kernel rate, pinned copies)
    costs = [BucketCost(sim.SIZE[i], 8 * sim.SIZE[i], 8 * sim.SIZE[i], sim.ARR[i]["d2h_start"])
             for i in range(sim.NB)]
    cap = peak_gib + 1.0
    rows = [("placement='host'", ["host"] * sim.NB, None, 0.0),
            ("placement='parked'", ["parked"] * sim.NB, cap, max(0.0, cap - peak_gib - margin_gib))]
    for name, total in (("'auto', whole GPU", gpu_gib), ("'auto', capped", cap)):
        resident = max(0.0, total - peak_gib - margin_gib) * 2**30
        homes = plan_homes(costs, rates, resident, freed_gib * 2**30, forward=sim.F)
        left = resident - sum(c.resident_bytes for c, h in zip(costs, homes) if h == "resident")
        rows.append((f"placement={name}", homes, total, left / 2**30))
    print(f"\nhomes (fp32 model; pinned copies {rates.upload / 1e6:.1f} GB/s each way; backward frees {freed_gib} GiB; "
          f"cap = the all-host peak {peak_gib} + 1 GiB = {cap} GiB; margin {margin_gib} GiB)")
    print(f"{'placement':26s} {'GPU GiB':>8s} {'host/parked/resident':>21s} {'step ms':>8s} {'x AdamW':>8s} "
          f"{'reloads end':>12s} {'written end':>12s} {'fwd waits':>10s}")
    for name, homes, gpu, spare_gib in rows:
        t, reloaded, written, wait = homes_step_ms(sim, homes, r0, spare_gib * 2**30)
        counts = "/".join(str(homes.count(h)) for h in ("host", "parked", "resident"))
        ends = f"{reloaded:+12.1f} {written:+12.1f}" if "parked" in homes else f"{'-':>12s} {'-':>12s}"
        print(f"{name:26s} {'all' if gpu is None else f'{gpu:.1f}':>8s} {counts:>21s} {t:8.1f} "
              f"{t / sim.T_ADAMW:7.2f}x {ends} {wait:10.1f}")
    print("(reloads end, written end: ms after backward's end, when the last parked state has come up, gone down;\n"
          f" fwd waits: ms the next forward ({sim.F:.0f} ms) waits for memory still going down, counted in the step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT.parent / "shared" / "gpu" / "model")
    ap.add_argument("--kernel-ms", type=float, default=None,
                    help="the host's CPU-Adam kernel over the 1.3B elements (default: the model's calibration)")
    ap.add_argument("--gpu-gib", type=float, default=79.2, help="GPU memory, GiB (default: an H100's)")
    ap.add_argument("--peak-gib", type=float, default=42.3,
                    help="the offloaded step's peak GPU memory, GiB (default: measured on the 1.3B preset)")
    ap.add_argument("--freed-gib", type=float, default=37.0,
                    help="GPU memory backward has freed by step(), GiB (what parked state may take; default 37)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from zero_offload.options import Options

    sim = load_model(args.model_dir)
    kw = {}
    if args.kernel_ms:
        kw["r0"] = sim.N / args.kernel_ms
        simulate = sim.simulate
        sim.simulate = lambda **k: simulate(**{**kw, **k})
    room = (args.gpu_gib - args.peak_gib - Options().gpu_margin_gib) * 2**30
    rows = [("default", {}), ("gpu_fraction=0.28", {"gpu_fraction": 0.28}),
            ('gpu_fraction="auto"', {"gpu_fraction": "auto"})]
    print(f"1.3B GPT preset, fused AdamW {sim.T_ADAMW:.0f} ms; kernel {sim.N / kw.get('r0', 4.91e6):.0f} ms over "
          f"{sim.N:,} elements")
    print(f"{'options':26s} {'GPU tier':>18s} {'step ms':>8s} {'x AdamW':>8s} {'range':>12s}")
    for name, options_kw in rows:
        options = Options(**options_kw)
        m = gpu_buckets(sim, options.gpu_fraction, room) if options.gpu_tier else 0
        t, lo, hi = step_ms(sim, m)
        tier = "none" if not m else f"{m} of {sim.NB} buckets"
        print(f"{name:26s} {tier:>18s} {t:8.1f} {t / sim.T_ADAMW:7.2f}x "
              f"{lo / sim.T_ADAMW:5.2f}-{hi / sim.T_ADAMW:.2f}x")
    # delayed_update (not exact: one step stale): as built, and with every upload at step() (what the first H100 run
    # measured, 417 ms, to check the model against).
    r0 = kw.get("r0", 4.91e6)
    for name, in_backward in (("delayed_update=True", Options(delayed_update=True).uploads_in_backward),
                              ("delayed, no early uploads", False)):
        t = delayed_ms(sim, in_backward, r0)
        print(f"{name:26s} {'none':>18s} {t:8.1f} {t / sim.T_ADAMW:7.2f}x")
    placement_rows(sim, r0, args.gpu_gib, args.peak_gib, args.freed_gib, Options().gpu_margin_gib)


if __name__ == "__main__":
    main()
