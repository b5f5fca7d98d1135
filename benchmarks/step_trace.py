"""One bucket's trip through a step, traced: how many calls the package makes and how often control passes from one
of its files to another, for one training iteration (backward with its hooks, ``step()``, ``zero_grad()``) of a
one-bucket model on the GPU code path (the CUDA stand-ins of the tests, on the CPU), with the default options.

    python benchmarks/step_trace.py                 # this tree
    python benchmarks/step_trace.py --root OTHER    # another checkout (e.g. a worktree of an older commit)

Counted with ``sys.setprofile`` on the thread that runs backward and the step, package functions only, comprehensions left out (Python 3.12 inlines them; 3.11 does not):

* calls: package functions entered;
* transitions: consecutive calls in different files, in the order they happen (``--calls`` lists them);
* cross-file calls: calls whose nearest package caller is in another file;
* bounces: A -> B -> A in the sequence of files visited.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent), help="the checkout to trace")
    ap.add_argument("--calls", action="store_true", help="list the calls, marking each change of file")
    ap.add_argument("--edges", action="store_true", help="list the cross-file calls (caller -> callee), counted")
    args = ap.parse_args()
    sys.path[:0] = [args.root, os.path.join(args.root, "tests")]
    import torch

    import cuda_standins
    import zero_offload

    pkg = os.path.dirname(zero_offload.__file__)
    if not pkg.startswith(os.path.abspath(args.root)):
        raise SystemExit(f"zero_offload was imported from {pkg}, not from {args.root}")
    cuda_standins.install(setattr)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = zero_offload.OffloadOptimizer(model.parameters(), lr=1e-3)

    def iteration():
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        iteration()
    calls, cross, edges = [], [0], []
    lock = threading.Lock()

    def prof(frame, event, arg):
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(pkg) or frame.f_code.co_name.startswith("<"):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(pkg):
            caller = caller.f_back
        with lock:
            calls.append((os.path.relpath(f, pkg), frame.f_code.co_name))
            if caller is not None and caller.f_code.co_filename != f:
                cross[0] += 1
                edges.append(f"{os.path.relpath(caller.f_code.co_filename, pkg)}:{caller.f_code.co_name} -> "
                             f"{os.path.relpath(f, pkg)}:{frame.f_code.co_name}")

    sys.setprofile(prof)
    try:
        iteration()
    finally:
        sys.setprofile(None)
    files = [f for f, _ in calls]
    seq = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    bounces = sum(1 for a, _, c in zip(seq, seq[1:], seq[2:]) if a == c)
    if args.calls:
        for i, (f, name) in enumerate(calls):
            print(("-> " if i == 0 or files[i - 1] != f else "   ") + f"{f}:{name}")
    if args.edges:
        for edge, n in collections.Counter(edges).most_common():
            print(f"{n:3d} {edge}")
    print(f"{args.root}: {len(calls)} calls over {len(set(files))} files; {len(seq) - 1} transitions, "
          f"{cross[0]} cross-file calls, {bounces} bounces")
    print("calls by file:", ", ".join(f"{f} {n}" for f, n in collections.Counter(files).most_common()))


if __name__ == "__main__":
    main()
