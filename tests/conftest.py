"""Shared pytest configuration: the ``cuda`` marker, skipping CUDA-marked tests on hosts without a GPU, and
leaving out the kernel tests of SIMD ISAs this CPU or build cannot run, with one line per ISA in the summary
(rather than one skip per test: hundreds)."""

from typing import Dict, List

import pytest
import torch

NATIVE_ISAS = ("avx512", "avx2", "neon", "scalar")  # the ``path`` values tests parametrize over


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is available")


def _isa(item) -> str:
    callspec = getattr(item, "callspec", None)
    value = callspec.params.get("path") if callspec is not None else None
    return value if value in NATIVE_ISAS else ""


def _drop_unavailable_isas(config, items) -> None:
    if not any(map(_isa, items)):
        return
    from zero_offload import _build

    available = set(_build.native_isas())  # builds (or loads) the kernel: the ISA tests need it anyway
    why = "not available on this CPU/build" if _build.load_native() is not None else (
        f"native kernel unavailable: {_build.status().detail}")
    dropped: Dict[str, List] = {}
    for item in items:
        isa = _isa(item)
        if isa and isa not in available:
            dropped.setdefault(isa, []).append(item)
    if dropped:
        gone = {id(item) for group in dropped.values() for item in group}
        config.hook.pytest_deselected(items=[item for group in dropped.values() for item in group])
        items[:] = [item for item in items if id(item) not in gone]
        config.stash[_ISA_LINES] = [f"ISA {isa}: {why}, {len(group)} tests left out" for isa, group in dropped.items()]


_ISA_LINES = pytest.StashKey[List[str]]()


def pytest_collection_modifyitems(config, items):
    _drop_unavailable_isas(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in config.stash.get(_ISA_LINES, []):
        terminalreporter.write_line(line)
