"""Host buffers on huge pages (``zero_offload.host_memory``): large unpinned buffers start on a 2 MiB boundary and
are advised as huge-page memory, are still exact-size whole storages (a checkpoint load trades their memory), and an
optimizer on them matches ``torch.optim.AdamW``; ``ZERO_OFFLOAD_HUGE_PAGES`` turns it off, and a value that is no
boolean is refused."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from zero_offload import OffloadOptimizer, host_memory
from zero_offload._compat import take_memory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_suite  # noqa: E402  (its smaps reader)

HUGE = host_memory.huge_page_bytes()  # the system's huge page (None: none)
LARGE = max(host_memory.HUGE_FROM, 4 * (HUGE or 0)) // 4 + 7  # fp32 elements: just over the threshold
needs_madvise = pytest.mark.skipif(HUGE is None or not os.path.exists("/proc/self/smaps"),
                                   reason="needs transparent huge pages and /proc/self/smaps")


def _vm_flags(ptr: int) -> str:
    """The VmFlags of the mapping of this process that holds address ``ptr`` ("hg": advised as huge pages)."""
    flags = gpu_suite.smaps_field(ptr, "VmFlags")
    assert flags, f"no mapping holds {ptr:#x}"
    return flags


@needs_madvise
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_buffers_start_on_a_huge_page_advised_for_huge_pages(monkeypatch, dtype):
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = LARGE * 4 // itemsize
    buf = host_memory.empty_host(n, dtype)
    assert buf.dtype == dtype and buf.numel() == n and buf.is_contiguous()
    assert buf.storage_offset() == 0 and buf.untyped_storage().nbytes() == n * itemsize  # a whole, exact storage
    assert buf.data_ptr() % HUGE == 0
    assert "hg" in _vm_flags(buf.data_ptr()).split()
    assert "hg" in _vm_flags(buf.data_ptr() + buf.nbytes - 1).split()
    small = host_memory.empty_host(max(host_memory.HUGE_FROM, 4 * HUGE) // itemsize - 1, dtype)
    assert "hg" not in _vm_flags(small.data_ptr()).split()


@needs_madvise
@pytest.mark.parametrize("value, on", [("0", False), ("off", False), (" False ", False), ("", True), ("yes", True)])
def test_huge_pages_turned_off_by_the_environment(monkeypatch, value, on):
    """Off by a boolean's false values; an empty value is unset (on), as a launcher's blank template leaves it."""
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, value)
    buf = host_memory.empty_host(LARGE, torch.float32)
    assert buf.numel() == LARGE and ("hg" in _vm_flags(buf.data_ptr()).split()) == on


def test_a_huge_pages_setting_that_is_no_boolean_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "maybe")
    with pytest.raises(ValueError, match=r"Invalid ZERO_OFFLOAD_HUGE_PAGES='maybe'"):
        host_memory.empty_host(LARGE, torch.float32)
    for n in (LARGE, 17):  # refused at construction, whether or not a buffer is large enough to be concerned
        w = nn.Parameter(torch.randn(n))
        before = w.detach().clone()
        with pytest.raises(ValueError, match="ZERO_OFFLOAD_HUGE_PAGES"):
            OffloadOptimizer([w])
        assert torch.equal(w, before)


def test_memory_is_traded_between_huge_and_ordinary_buffers_and_freed_with_the_last_view(monkeypatch):
    """A staged checkpoint load commits by trading memory between two buffers of one size (every view follows): a buffer on
    huge pages trades with another, or with one from torch's allocator, and its map lives as long as a view."""
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    a = host_memory.empty_host(LARGE, torch.float32).fill_(1.0)
    b = host_memory.empty_host(LARGE, torch.float32).fill_(2.0)
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    c = host_memory.empty_host(LARGE, torch.float32).fill_(3.0)
    view = a[5:9]
    assert take_memory(a, b) and take_memory(a, c)
    assert torch.equal(view, torch.full((4,), 3.0)) and bool((a == 3.0).all())
    assert bool((b == 1.0).all()) and bool((c == 2.0).all())
    del a, b
    c.add_(1.0)  # c holds the memory b started with: alive after a and b are gone
    assert bool((c == 3.0).all()) and torch.equal(view, torch.full((4,), 3.0))


@pytest.mark.parametrize("huge", ["1", "0"])
def test_an_optimizer_on_huge_page_buffers_matches_adamw(monkeypatch, huge):
    """Parameters of 1, 7, 4097 and just over the threshold elements in one bucket, fresh gradients every step:
    parameters and both moments against ``torch.optim.AdamW(foreach=False)`` at default tolerance."""
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, huge)
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (1, 7, 4097, LARGE)]
    refs = [nn.Parameter(p.detach().clone()) for p in params]
    ours = OffloadOptimizer(params, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1, foreach=False)
    if huge == "1" and HUGE is not None and os.path.exists("/proc/self/smaps"):
        held = [t for buffers in ours.host_buffers() for t in buffers.values() if t.nbytes >= host_memory.HUGE_FROM]
        assert held and all("hg" in _vm_flags(t.data_ptr()).split() for t in held)
    for step in range(3):
        for p, q in zip(params, refs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, refs)):
            torch.testing.assert_close(p, q, msg=lambda m: f"step {step} param {i}: {m}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[p][key], ref.state[q][key])


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="needs madvise(MADV_HUGEPAGE)")
@pytest.mark.parametrize("setting", ["always", "madvise", "never", None])
def test_the_report_says_what_becomes_of_large_buffers(monkeypatch, tmp_path, setting):
    """``python -m zero_offload.report``'s "huge pages" line: advised, and whether the system's setting lets it take
    effect; off, naming the variable; a bad value named; none without the kernel feature."""
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)
    (tmp_path / "none").mkdir()  # (no hpage_pmd_size: the kernel feature is missing)
    assert host_memory.huge_pages(str(tmp_path / "none")).startswith("not on this system")
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    if setting is not None:
        (tmp_path / "enabled").write_text(" ".join(f"[{w}]" if w == setting else w
                                                    for w in ("always", "madvise", "never")) + "\n")
    line = host_memory.huge_pages(str(tmp_path))
    assert line.startswith("unpinned host buffers of 8.0 MiB or more advised"), line
    assert f"(system setting: {setting or 'unknown'})" in line, line
    assert ("to no effect" in line) == (setting == "never"), line
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "no")
    assert host_memory.huge_pages(str(tmp_path)) == "off (ZERO_OFFLOAD_HUGE_PAGES=no): host buffers on ordinary pages"
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "sometimes")
    assert "Invalid ZERO_OFFLOAD_HUGE_PAGES='sometimes'" in host_memory.huge_pages(str(tmp_path))
