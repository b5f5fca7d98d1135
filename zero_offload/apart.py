"""Whether the optimizer may give each parameter a slot of its own: what a parameter's memory shares, and with what.

Each parameter has its own slots in the flat buffers, and a parameter bound to its slot (a CPU one, or one stepped
on its GPU) becomes a view of the bucket's buffer. Two cases would then part silently from ``torch.optim.AdamW``,
which updates every parameter in place:

* two parameters that share elements (one made over a view of the other's data) would stop sharing them: refused;
* a parameter that is a view of a larger tensor still alive (a flat buffer the model's parameters are views of,
  Megatron or FSDP1 style; ``nn.Parameter(base[:5])`` with ``base`` kept) would be rebound to the optimizer's buffer,
  and that tensor would stop seeing the updates: warned of (the tensor may be one nobody reads again, a loaded
  checkpoint's), and ``"auto"`` leaves such a GPU bucket on the host, where it is updated in place.

Parameters whose memory ranges interleave without sharing an element (the column halves of one matrix, a base no
longer alive) are apart: each slot is exact. A larger tensor is told alive by its storage's use count, less the
references the optimizer's own parameters hold (a parameter that spans its whole storage is never such a view: a
state dict or a graph holding the same tensor sees it whole, and is not a larger tensor). A buffer an optimizer
bound parameters to (:func:`bound_to`: a model stepped by another ``OffloadOptimizer`` before, whose parameters are
views of its buffer, also once it is dropped) is no such tensor: what else holds it is that optimizer's, or parameters
it bound, which a rebuilt optimizer takes over as parameters of their own. A GPU parameter whose state
is stepped on the host is written in place, as AdamW writes it, and may view a live tensor.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
import weakref
from typing import Any, Dict, FrozenSet, Optional, Sequence, Tuple

import torch

__all__ = ["Span", "bound_to", "live_views", "refuse_self_overlap", "share_elements", "span", "warn_live_views"]

# (device, storage address), first byte, one past the last
Span = Tuple[Tuple[str, int], int, int]

# The widest memory range (bytes) two parameters' elements are told apart in, element by element; beyond it, ranges
# that interleave are taken as sharing.
MARK_LIMIT = 1 << 24


# The storages of the buffers optimizers bound parameters to, for as long as each lives (torch keeps one Python object
# per storage while the storage lives, and the set refers to it weakly).
_BOUND: "weakref.WeakSet[torch.UntypedStorage]" = weakref.WeakSet()


def bound_to(slots: Sequence[torch.Tensor]) -> None:
    """Parameters were bound to ``slots`` (views of an optimizer's buffer): their storage is no larger tensor of the
    user's (see the module docstring)."""
    for slot in slots[:1]:  # (the slots of a bucket are views of one buffer)
        _BOUND.add(slot.untyped_storage())


def span(p: torch.Tensor) -> Optional[Span]:
    """Where ``p``'s elements lie: ((device, storage), first byte, one past the last); None when it has none."""
    if p.numel() == 0:
        return None
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(p.shape, p.stride()))
    lo = p.data_ptr()
    return (str(p.device), p.untyped_storage().data_ptr()), lo, lo + extent * p.element_size()


def refuse_self_overlap(tensors: Sequence[torch.Tensor], index: int) -> None:
    """Refuse a parameter of param group ``index`` whose elements overlap one another in memory (an expanded tensor,
    ``as_strided`` with overlapping strides): AdamW refuses to update it in place (or writes the shared memory once
    per element that holds it); a slot of its own would silently untie the elements that were one."""
    for j, p in enumerate(tensors):
        s = span(p)
        if s is None:
            continue
        status = torch._debug_has_internal_overlap(p)  # (0: none, 1: some, 2: not told by the strides alone)
        if status == 2 and s[2] - s[1] <= MARK_LIMIT:  # (each byte of its range marked by its offsets: all distinct?)
            status = int(_covered(p, s, s[1]).unique().numel() < p.numel() * p.element_size())
        if status == 1:
            raise ValueError(
                f"param group {index}, parameter {j} (shape {tuple(p.shape)}, strides {p.stride()}): its elements "
                "overlap one another in memory (an expanded tensor?). AdamW cannot update it in place, and "
                "OffloadOptimizer would give each element a slot of its own, untying them: give the parameter storage "
                "of its own (nn.Parameter(t.clone()))")


def _covered(t: torch.Tensor, s: Span, lo: int) -> torch.Tensor:
    """The byte offsets (from ``lo``) of ``t``'s elements (``s``: its span), one row of ``element_size`` per element."""
    offsets = torch.arange(s[2] - lo, dtype=torch.int32)
    size = t.element_size()
    return torch.as_strided(offsets, (*t.shape, size), (*(st * size for st in t.stride()), 1), s[1] - lo)


def share_elements(a: torch.Tensor, sa: Span, b: torch.Tensor, sb: Span) -> Optional[bool]:
    """Whether ``a`` and ``b`` (spans ``sa``, ``sb``, which overlap) have a byte in common: each byte of the range
    they cover is marked by its offsets (no data read; any device). None where the range is over
    :data:`MARK_LIMIT` bytes (not told)."""
    lo, hi = min(sa[1], sb[1]), max(sa[2], sb[2])
    if hi - lo > MARK_LIMIT:
        return None
    marks = torch.zeros(hi - lo, dtype=torch.bool)  # (bytes: the two may differ in dtype)
    marks[_covered(a, sa, lo).reshape(-1)] = True
    return bool(marks[_covered(b, sb, lo).reshape(-1)].any())


def live_views(tensors: Sequence[torch.Tensor], own: Sequence[torch.Tensor]) -> Dict[int, Tuple[int, int]]:
    """Those of ``tensors`` that view a larger storage something besides ``own`` (the optimizer's parameters: every
    group's, ``tensors`` included) still holds, by id: (the storage's bytes, the parameter's). The garbage collector
    is run before any is reported (a tensor in a reference cycle no one refers to is no holder)."""
    found = _live_views(tensors, own)
    if found:
        gc.collect()
        found = _live_views(tensors, own)
    return found


def _live_views(tensors: Sequence[torch.Tensor], own: Sequence[torch.Tensor]) -> Dict[int, Tuple[int, int]]:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # (a torch without it: not told, every parameter taken, as before)
        return {}
    mine: Dict[Tuple[str, int], int] = {}
    seen = set()
    for p in own:
        if id(p) not in seen and p.numel():
            seen.add(id(p))
            key = (str(p.device), p.untyped_storage().data_ptr())
            mine[key] = mine.get(key, 0) + 1
    out: Dict[int, Tuple[int, int]] = {}
    for p in tensors:
        s = span(p)
        if s is None:
            continue
        storage = p.untyped_storage()
        if storage.nbytes() <= s[2] - s[1] or storage in _BOUND:
            continue  # (it spans its whole storage, or an optimizer's buffer)
        # (the use count includes the reference ``storage`` itself holds)
        if use_count(storage._cdata) - 1 > mine.get(s[0], 0):
            out[id(p)] = (storage.nbytes(), s[2] - s[1])
    return out


def warn_live_views(layouts: Sequence[Any], homes: Sequence[str], params: Sequence[torch.Tensor],
                    live: FrozenSet[int], gi: int) -> None:
    """Warn, once for param group ``gi``, of its parameters that :func:`live_views` found (``live``, by id) in a
    bucket whose parameters are bound to its slots (a CPU bucket, or one with a GPU home; ``layouts`` and
    ``homes``: the group's buckets). Not refused: the tensor still holding their storage is as often one nobody reads
    again (a loaded checkpoint's, whose tensors views of one storage when saved from slots) as a flat buffer the
    model reads (Megatron or FSDP1 style), and the use count does not tell them apart."""
    if not live:
        return
    found = [(j, params[j]) for layout, home in zip(layouts, homes)
             for j in (layout.indices if layout.device.type == "cpu" or home != "host" else ()) if id(params[j]) in live]
    if not found:
        return
    j, p = found[0]
    s = span(p)
    others = f" (and {len(found) - 1} more of the group)" if len(found) > 1 else ""
    warnings.warn(
        f"param group {gi}, parameter {j} (shape {tuple(p.shape)}){others} is a view of a larger tensor that is still "
        f"alive (its storage holds {p.untyped_storage().nbytes()} bytes, the parameter's elements span {s[2] - s[1]}; "
        "something besides the optimizer's parameters holds it: a flat buffer the parameters are views of, the tensor "
        "it was sliced from, a loaded checkpoint's tensors...). OffloadOptimizer makes the parameter a view of its own "
        "buffer (a CPU parameter, or a GPU one stepped on its GPU), so that tensor no longer sees the updates, where "
        "AdamW's in-place update would reach it. If something reads it, give the parameter storage of its own "
        "(nn.Parameter(t.clone())) and read the parameter, or, for a GPU model, keep its state stepped on the host "
        "(placement='host'), where the parameter is updated in place; if nothing does (a loaded checkpoint), drop it "
        "before building the optimizer", UserWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first frame outside this package and torch from the caller's caller: the user's
    line that built the optimizer or added the group, however deep the constructor's calls are."""
    inner = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inner):
        frame, level = frame.f_back, level + 1
    return level
