"""What differs between the torch releases we support (the floor is in pyproject.toml and the README; CI runs it).

Each helper picks its form once, from the installed torch's version, so the hot path pays no feature probing.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, List, Sequence

import torch

__all__ = ["increment_version", "foreach_norm_fp32", "own_storage", "take_memory", "MIN_TORCH"]

MIN_TORCH = (2, 3)

# torch.autograd.graph.increment_version takes a list of tensors (one call into C++) from torch 2.5; before, one
# tensor per call.
_VERSION_TAKES_LIST = torch.__version__ >= (2, 5)
# torch._foreach_norm accepts dtype= (accumulate bf16/fp16 gradients in fp32) from torch 2.4.
_FOREACH_NORM_HAS_DTYPE = torch.__version__ >= (2, 4)
# Two storages trade their memory (every view of either follows), where torch has it.
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def increment_version(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the autograd version of each tensor, as an in-place op on it would."""
    if _VERSION_TAKES_LIST:
        torch.autograd.graph.increment_version(list(tensors))
    else:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def _norms_fp32(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors]


# foreach_norm_fp32(tensors): the L2 norm of each tensor, accumulated and returned in float32 whatever the tensors'
# dtype (a sequence). Where torch's foreach kernel takes dtype=, that kernel itself (no Python frame per call).
foreach_norm_fp32: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] = (
    functools.partial(torch._foreach_norm, ord=2, dtype=torch.float32) if _FOREACH_NORM_HAS_DTYPE else _norms_fp32)


def take_memory(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Make ``dst`` (and every view of its storage) hold what ``src`` holds; ``src`` is left holding ``dst``'s
    old contents, or, where that cannot be done by trading memory, its own (then ``dst`` got a copy). Returns
    whether the memory was traded: O(1), no byte copied. Trading needs two whole storages of one size starting
    at their first element (what :func:`zero_offload.host_memory.empty_host` makes, the same size and pinning for
    both); anything else is copied."""
    a, b = dst.untyped_storage(), src.untyped_storage()
    if (_CAN_SWAP and dst.storage_offset() == 0 and src.storage_offset() == 0 and a.nbytes() == b.nbytes()
            and dst.nbytes == src.nbytes and dst.device == src.device):
        a._swap_data_ptr_(b)
        return True
    dst.copy_(src)
    return False


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the memory of ``t`` (contiguous, on the host) whose storage is its own and starts at its first
    element, keeping ``t``'s storage alive. For a ``DTensor``'s local tensor: torch (2.13 here) gives the
    ``DTensor`` its local tensor's storage offset, and one whose offset is not 0 cannot be pickled or deep-copied
    (``torch.save``, ``copy.deepcopy``: "invalid python storage"), nor can what is derived from it
    (``detach()``, and so ``module.state_dict()``). Unlike a view, it does not follow :func:`take_memory` on ``t``'s
    storage."""
    if not t.nbytes:
        return torch.empty(t.shape, dtype=t.dtype)
    memory = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
    memory.owner = t  # (torch.frombuffer keeps ``memory`` alive, and it ``t``)
    return torch.frombuffer(memory, dtype=t.dtype).view(t.shape)
