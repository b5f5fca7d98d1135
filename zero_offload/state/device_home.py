"""The device home (``gpu_fraction``, the twin flow's GPU part): a bucket's state in the memory of the GPU its
parameters are on, stepped there by the rule's device update (torch's fused AdamW for AdamW) after the same checks
as the host's buckets; the parameters become their slots, as a CPU model's do, so nothing crosses PCIe. A bucket
starts here (a numeric ``gpu_fraction``) or moves here from the host between steps (``"auto"``,
:meth:`DeviceHome.take_over`)."""

from __future__ import annotations

from typing import Any

import torch

from zero_offload import fsdp2
from zero_offload.rules.base import Rule, Run
from zero_offload.state.home import Home
from zero_offload.state.tiers import DeviceTier

__all__ = ["DeviceHome"]


class DeviceHome(Home):
    """State in ``device``'s memory (see :class:`~zero_offload.state.home.Home` for ``parts``; nothing of it is
    page-locked: ``pin`` is the host home's)."""

    kind = "device"
    on_device = True

    def __init__(self, device: torch.device, pin: bool, **parts: Any):
        super().__init__(DeviceTier(device), **parts)

    def update(self, rule: Rule, run: Run, hyper: Any) -> None:
        rule.update_on_device(run, hyper)

    def take_over(self, old: Home) -> None:
        """Hold what ``old`` holds (between steps, every copy from it waited for): the rule's buffers, the masters,
        the step counts (the same tensor: the entries' ``"step"`` are views of it), whether each master is current,
        and which parameters have entries. The parameters, which hold what was uploaded from the old masters, fill
        their new slots and are bound to them."""
        for name, buf in old.store.flat.items():
            self.store.flat[name].copy_(buf)
        if self.masters.separate:
            self.masters.master.copy_(old.masters.master)
        self.masters.fill_param_slots()
        self.store.steps = old.store.steps
        self.views.steps = old.store.steps
        self.masters.bind()
        watch, versions = self.masters.watch, old.masters.versions
        self.masters.versions = [v if v < 0 else fsdp2.version(p) for v, p in zip(versions, watch)]
        for i, exposed in enumerate(old.views.exposed):
            self.views.set_exposed(i, exposed)

