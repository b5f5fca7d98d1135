"""What each of a bucket's parameters was when the optimizer last bound it to its slot or followed a replacement of
its data: where its data starts, its shape, its strides, and (for a parameter that keeps its own storage) a weak
reference to that storage. ``p.data = ...`` moves no version counter, so this is how a replacement is seen.

The address alone misses two replacements: a view of the same storage with other strides (``p.data = p.data.t()``
on a square matrix: same address, same shape) and new storage that happens to be given the old one's address (the
old storage freed first: the caching allocator hands a freed block of the same size to the next request). The
strides catch the first. The second is caught by the weak reference: it holds the storage's bookkeeping object (not
its memory) alive, so no other storage can ever share its identity, and it expires exactly when nothing uses that
storage any more: a parameter whose storage expired has other storage, wherever its data now starts. A slot's
storage is the bucket's own flat buffer, which the bucket keeps alive: bound parameters need no reference.

All of it is C-level loops on the hot path (one comparison per list, no Python call per parameter) until something
changed.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import torch

__all__ = ["Seen"]

_expired = torch.UntypedStorage._expired
_free_weak_ref = torch.UntypedStorage._free_weak_ref


def _storage_ref(t: torch.Tensor) -> int:
    return t.untyped_storage()._weak_ref()


class Seen:
    """The parameters ``params`` as they are now (see the module docstring).

    Args:
        params (Sequence[Tensor]): the parameters.
        own_storage (bool): the parameters keep their own storage (not bound to a slot of the bucket): watch it
            with weak references.

    Attributes:
        ptrs (List[int]): each parameter's ``data_ptr()``.
        shapes (List[torch.Size]): each parameter's shape.
        strides (List[Tuple[int, ...]]): each parameter's strides.
    """

    def __init__(self, params: Sequence[torch.Tensor], own_storage: bool):
        self.ptrs = list(map(torch.Tensor.data_ptr, params))
        self.shapes = list(map(torch.Tensor.size, params))
        self.strides = list(map(torch.Tensor.stride, params))
        self._refs: Optional[List[int]] = list(map(_storage_ref, params)) if own_storage else None
        if self._refs is not None:
            weakref.finalize(self, _free_all, self._refs)  # (the same list, as take() updates it)

    def changed(self, params: Sequence[torch.Tensor]) -> List[int]:
        """The positions of the parameters whose data is no longer what was seen (none in the usual case, checked
        in C-level loops)."""
        refs = self._refs
        if (list(map(torch.Tensor.data_ptr, params)) == self.ptrs and list(map(torch.Tensor.size, params)) ==
                self.shapes and list(map(torch.Tensor.stride, params)) == self.strides
                and (refs is None or not any(map(_expired, refs)))):
            return []
        return [i for i, p in enumerate(params)
                if p.data_ptr() != self.ptrs[i] or p.shape != self.shapes[i] or p.stride() != self.strides[i]
                or refs is not None and _expired(refs[i])]

    def take(self, i: int, p: torch.Tensor) -> None:
        """Parameter ``i`` is now ``p`` (bound again, or its replacement followed)."""
        self.ptrs[i], self.shapes[i], self.strides[i] = p.data_ptr(), p.shape, p.stride()
        if self._refs is not None:
            old, self._refs[i] = self._refs[i], _storage_ref(p)
            _free_weak_ref(old)


def _free_all(refs: List[int]) -> None:
    for ref in refs:
        _free_weak_ref(ref)

