"""What differs between the torch releases we support (the floor is in pyproject.toml and the README; CI runs it).

Each helper picks its form once, from the installed torch's version, so the hot path pays no feature probing.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

__all__ = ["increment_version", "foreach_norm_fp32", "MIN_TORCH"]

MIN_TORCH = (2, 3)

# torch.autograd.graph.increment_version takes a list of tensors (one call into C++) from torch 2.5; before, one
# tensor per call.
_VERSION_TAKES_LIST = torch.__version__ >= (2, 5)
# torch._foreach_norm accepts dtype= (accumulate bf16/fp16 gradients in fp32) from torch 2.4.
_FOREACH_NORM_HAS_DTYPE = torch.__version__ >= (2, 4)


def increment_version(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the autograd version of each tensor, as an in-place op on it would."""
    if _VERSION_TAKES_LIST:
        torch.autograd.graph.increment_version(list(tensors))
    else:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def foreach_norm_fp32(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The L2 norm of each tensor, accumulated and returned in float32 whatever the tensors' dtype."""
    if _FOREACH_NORM_HAS_DTYPE:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return [torch.linalg.vector_norm(t, 2, dtype=torch.float32) for t in tensors]
