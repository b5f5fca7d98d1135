"""The device home (``placement="resident"``, ``gpu_fraction``: the twin flow's GPU part): a bucket's state in the memory of the GPU its
parameters are on, stepped there by the rule's device update (torch's fused AdamW for AdamW) after the same checks
as the host's buckets; the parameters become their slots, as a CPU model's do, so nothing crosses PCIe. A bucket
starts here (its resident share of ``placement``, a numeric ``gpu_fraction``) or moves here from the host between
steps (``"auto"``, :meth:`~zero_offload.state.home.Home.take_over`)."""

from __future__ import annotations

from typing import Any

import torch

from zero_offload.rules.base import Rule, Run
from zero_offload.state.home import Home
from zero_offload.state.tiers import DeviceTier

__all__ = ["DeviceHome"]


class DeviceHome(Home):
    """State in ``device``'s memory (see :class:`~zero_offload.state.home.Home` for ``parts``; nothing of it is
    page-locked: ``pin`` is the host home's)."""

    kind = "resident"
    on_device = True

    def __init__(self, device: torch.device, pin: bool, **parts: Any):
        super().__init__(DeviceTier(device), **parts)

    def update(self, rule: Rule, run: Run, hyper: Any) -> None:
        rule.update_on_device(run, hyper)
