"""Where a bucket's bytes live. A tier allocates a zeroed flat buffer of ``n`` elements of a dtype; the bucket store
asks one for every buffer it holds, so *where* state lives is decided here and nowhere else.

Most buffers are in host memory (:class:`HostTier`: page-locked where it takes part in device copies). The
GPU-resident part of the state (``gpu_fraction``, the twin flow of the GPU step) is on a :class:`DeviceTier`; an
NVMe tier, paging a bucket's state in before its update, would be a third implementation of the same one method.
"""

from __future__ import annotations

from typing import Optional

import torch

from zero_offload.host_memory import empty_host

__all__ = ["DeviceTier", "HostTier", "Tier", "should_pin"]


class Tier:
    """A place for flat buffers.

    Attributes:
        name (str): for messages and reports ("host", "pinned host", "cuda:0").
        pinned (bool): its buffers are page-locked host memory (counted as such by the host-RAM estimate).
        host (bool): its buffers are host memory.
    """

    name: str = ""
    pinned: bool = False
    host: bool = True

    def zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed, contiguous, 1-D buffer of ``n`` elements of ``dtype``."""
        return self.empty(n, dtype).zero_()

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous, 1-D buffer of ``n`` elements of ``dtype``, its values undefined (for one written whole)."""
        raise NotImplementedError


class HostTier(Tier):
    """Host memory, page-locked with ``pin`` (exact-size, see :func:`zero_offload.host_memory.empty_host`)."""

    host = True

    def __init__(self, pin: bool):
        self.pinned = bool(pin)
        self.name = "pinned host" if self.pinned else "host"

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return empty_host(n, dtype, pin=self.pinned)


class DeviceTier(Tier):
    """Memory of an accelerator (state kept beside the parameters it updates)."""

    host = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device) if isinstance(device, str) else device
        self.name = str(self.device)

    def zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.device)

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)


def should_pin(device: torch.device, pin_memory: Optional[bool]) -> bool:
    """Whether a bucket on ``device`` gets page-locked buffers: ``pin_memory`` as given, or (None) exactly the
    buckets whose parameters are on CUDA (pinning buys nothing without transfers and locks RAM)."""
    if pin_memory is None:
        return device.type == "cuda"
    return bool(pin_memory)
