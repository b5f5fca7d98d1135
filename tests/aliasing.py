"""Whether a tensor was copied: the one check the tests share of where a tensor's memory is."""

from __future__ import annotations

from typing import Iterable

import torch


def lies_in(t: torch.Tensor, buffers: Iterable[torch.Tensor], *, storage: bool = False) -> bool:
    """Whether the memory of ``t`` (its elements; with ``storage``, its whole storage, padding included) lies within
    one of ``buffers``: ``t`` is a view of that buffer, or a storage of its own over its memory
    (``zero_offload._compat.own_storage``), not a copy of it."""
    if storage:
        at, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    else:
        at, n = t.data_ptr(), t.nbytes
    return any(b.data_ptr() <= at and at + n <= b.data_ptr() + b.nbytes for b in buffers)
