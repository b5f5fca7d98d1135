"""How many optimizer classes of a third-party collection ``zero_offload.offload`` accepts and runs exactly as the
class itself, and why it refuses the others: ``python benchmarks/third_party_census.py`` (needs
``pip install pytorch_optimizer``; lucidrains' ``lion-pytorch`` and torch's own classes are counted when present).

Each class runs through tests/class_runs.py's ``check_class`` (two param groups, several buckets, 30 steps, then
checkpoints both ways), once with its defaults and once with ``maximize=True`` where its constructor takes it. A
class counts as "equal" only if every run it was given is; "differs" is a bug of ours. Refusals are grouped by the
kind of reason (the first words the refusal's message gives after the class's name). ``--steps N`` runs N steps
before the checkpoints instead of 30.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import class_runs  # noqa: E402

KINDS = [  # (kind, pattern in the refusal's message), the first that matches
    ("known refusal (LBFGS, SparseAdam)", r"cannot be offloaded: (its step|it updates sparse)"),
    ("built over a model or named parameters, or needs a package",
     r"needs an argument|cannot be offloaded: zero_offload runs it over plain|building it over plain"),
    ("not elementwise (per-tensor norm, matrix, factored or shaped state)", r"not elementwise"),
    ("per-parameter scalar state", r"per-parameter scalar"),
    ("random draws", r"it draws random numbers"),
    ("state outside the optimizer (steps differently on a replay)", r"state outside the optimizer"),
    ("needs a closure / second-order (backward through the gradient)", r"closure|grad_fn|create_graph|hessian"),
    ("its update of one parameter depends on others (a sum over all parameters)", r"depends on other parameters"),
    ("a statistic over the whole param group", r"statistic over all the parameters"),
    ("could not be probed (its step raised)", r"could not be probed"),
    ("steps differently (state zero_offload does not carry)", r"does not carry"),
]


def kind(reason: str) -> str:
    for name, pattern in KINDS:
        if re.search(pattern, reason):
            return name
    return "other: " + reason[:80]


def collection():
    out = []
    try:
        import pytorch_optimizer
        out += [("pytorch_optimizer", c) for c in class_runs.classes_of(pytorch_optimizer)]
    except ImportError:
        print("pytorch_optimizer is not installed: pip install pytorch_optimizer")
    try:
        import lion_pytorch
        out.append(("lion_pytorch", lion_pytorch.Lion))
    except ImportError:
        pass
    out += [("torch.optim", c) for c in vars(torch.optim).values()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer]
    return out


def markdown(rows) -> str:
    """The docs' census table: one row per outcome and kind of refusal, the classes by name."""
    by = collections.defaultdict(list)
    for source, name, status, reason in rows:
        by[(status if status != "refused" else f"refused: {kind(reason)}", source)].append(name)
    out = ["| outcome | collection | classes | count |", "|---|---|---|---|"]
    for (outcome, source), names in sorted(by.items(), key=lambda kv: (kv[0][0] != "equal", kv[0])):
        out.append(f"| {outcome} | {source} | {', '.join(f'`{n}`' for n in sorted(names))} | {len(names)} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=class_runs.STEPS, help="steps before the checkpoints")
    class_runs.STEPS = parser.parse_args().steps
    warnings.filterwarnings("ignore")
    rows = []
    start = time.perf_counter()
    for source, cls in collection():
        runs = [{}] + ([dict(maximize=True)] if class_runs.takes(cls, "maximize") else [])
        if source == "lion_pytorch":
            runs.append(dict(decoupled_weight_decay=True, weight_decay=0.1))
        outcomes = []
        for kw in runs:
            try:
                outcomes.append(class_runs.check_class(cls, **kw))
            except Exception as e:  # a failure of ours outside the comparison: a bug, shown as such
                outcomes.append(class_runs.Outcome("error", f"{type(e).__name__}: {e}"))
        worst = next((o for o in outcomes if o.status != "equal"), outcomes[0])
        rows.append((source, cls.__name__, worst.status, worst.reason))
        print(f"{source}.{cls.__name__}: {worst.status}{': ' + worst.reason[:300] if worst.reason else ''}")
    print(f"\n{len(rows)} classes, {class_runs.STEPS} + {class_runs.RESUMED_STEPS} steps each, in "
          f"{time.perf_counter() - start:.0f} s (torch {torch.__version__})")
    counts = collections.Counter((source, status) for source, _, status, _ in rows)
    for (source, status), n in sorted(counts.items()):
        print(f"{source}: {status}: {n}")
    kinds = collections.Counter((source, kind(reason)) for source, _, status, reason in rows if status == "refused")
    for (source, k), n in sorted(kinds.items()):
        print(f"  {source}: refused, {k}: {n}")
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
