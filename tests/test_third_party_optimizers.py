"""Every optimizer class of two third-party collections through ``zero_offload.offload`` (tests/class_runs.py):
pytorch_optimizer's (its registry of supported optimizers) and lucidrains' Lion. Each is either accepted and equal
to the class itself (two param groups, several buckets, 30 steps, ``maximize=True`` where it takes it, then
checkpoints both ways), or refused with a reason that docs/other-optimizers.md lists for it; never accepted and
different. The packages are in the ``test`` extra; without them these tests skip.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from class_runs import check_class, classes_of, takes

po = pytest.importorskip("pytorch_optimizer")

DOCS = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "other-optimizers.md").read_text()
CLASSES = classes_of(po)


def _documented_refusal(name: str) -> bool:
    """The class's name appears in the census table's refused rows (as `Name`)."""
    return any(f"`{name}`" in line for line in DOCS.splitlines() if line.startswith("| refused"))


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_pytorch_optimizer_class_is_equal_or_refused_as_documented(cls):
    runs = [{}] + ([dict(maximize=True)] if takes(cls, "maximize") else [])
    outcomes = [check_class(cls, **kw) for kw in runs]
    statuses = {o.status for o in outcomes}
    assert "differs" not in statuses, outcomes
    if statuses == {"equal"}:
        assert not _documented_refusal(cls.__name__), f"{cls.__name__} is accepted but documented as refused"
        return
    assert statuses <= {"refused", "equal"}, outcomes
    assert _documented_refusal(cls.__name__), f"{cls.__name__} is refused but not listed: {outcomes}"
    reason = next(o.reason for o in outcomes if o.status == "refused")
    assert re.search(re.escape(cls.__name__), reason), reason  # the refusal names the class


def test_lucidrains_lion_flags_are_honoured_or_refused():
    lion = pytest.importorskip("lion_pytorch").Lion
    for kw in ({}, dict(decoupled_weight_decay=True, weight_decay=0.1), dict(weight_decay=0.1, lr=3e-4)):
        outcome = check_class(lion, **kw)
        assert outcome.status == "equal", (kw, outcome)
    try:
        import triton  # noqa: F401
    except ImportError:
        outcome = check_class(lion, use_triton=True)
        assert outcome.status == "refused" and "triton" in outcome.reason.lower(), outcome
