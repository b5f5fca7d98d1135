"""Our speculation as built (save-then-in-place: a copy pass of 24 B/elem before each speculative kernel), in
STEP_ANALYSIS's sim.py: buckets whose kernel starts before validation V cost (28 + 24) / 28 of a kernel; after V
the worker's queue is cancelled and the rest run plainly in arrival order; uploads wait for V (held until
validation). Compared with the design rows of the analysis (an out-of-place kernel: no copy pass). Estimates.

    python benchmarks/speculation_model.py /path/to/shared/gpu/model/sim.py
"""
import sys, os
SIM = sys.argv[1] if len(sys.argv) > 1 else "../shared/gpu/model/sim.py"
src = open(SIM).read()
src = src.replace("queue.pop(0); cur = i; left = SIZE[i]; ovh = g",
                  "queue.pop(0); cur = i; left = SIZE[i] * (COPY if t < VAL else 1.0); ovh = g")
ns = {"__file__": os.path.abspath(SIM)}
exec(compile(src, "sim_patched", "exec"), ns)
sim = ns
B, N, NB, ARR = sim["B"], sim["N"], sim["NB"], sim["ARR"]
arrival = sorted(range(NB), key=lambda i: ARR[i]["d2h_end"])
for label, copy, V, g in [("D0-like today (no speculation)", 1.0, 10**9, 0.47),
                          ("D2u out-of-place kernel (analysis)", 1.0, B + 0.5, 0.1),
                          ("ours: save+in-place, V = B + 0.5", 52 / 28, B + 0.5, 0.1),
                          ("ours: save+in-place, V = B + 12 (today's wait for the wte copy)", 52 / 28, B + 12, 0.1)]:
    sim["COPY"], sim["VAL"] = copy, V
    if V > 10**8:
        r = sim["simulate"](list(range(NB)), gate_kernel=lambda i: B + 12, gate_upload=lambda i: 0, g=g)
    else:
        r = sim["simulate"](arrival, gate_kernel=lambda i: 0, gate_upload=lambda i, V=V: V, g=g)
    print(f"{label:70s} T = {r['T']:6.1f} ms  {r['T'] / 304:.2f}x  tail after B {r['X']:.1f} ms")
