"""The host home: a bucket's state in host memory (page-locked where the bucket's parameters are on a GPU, whose
copies read and write it), stepped there by the CPU kernel. The home of every CPU bucket, and of the GPU buckets ``placement`` (or
``gpu_fraction``) leaves on the host."""

from __future__ import annotations

from typing import Any

import torch

from zero_offload.state.home import Home
from zero_offload.state.tiers import HostTier

__all__ = ["HostHome"]


class HostHome(Home):
    """State in host memory, page-locked with ``pin``, for a bucket on ``device`` (see
    :class:`~zero_offload.state.home.Home` for ``parts``)."""

    kind = "host"

    def __init__(self, device: torch.device, pin: bool, **parts: Any):
        super().__init__(HostTier(pin), **parts)
