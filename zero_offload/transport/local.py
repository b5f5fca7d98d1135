"""The transport of an optimizer in one process (no ``process_group``): each bucket on the route of its kind,
parameters on the host (:class:`~zero_offload.transport.host.HostRoute`) or on a GPU, with the state on the host
(:class:`~zero_offload.transport.device.OffloadRoute`) or on the GPU's own tier
(:class:`~zero_offload.transport.device.DeviceTierRoute`)."""

from __future__ import annotations

from zero_offload.buckets import FlatBucket
from zero_offload.transport.base import Route, Transport
from zero_offload.transport.device import DeviceTierRoute, OffloadRoute
from zero_offload.transport.host import HostRoute

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """One process's buckets, each on its kind's route."""

    def route_for(self, bucket: FlatBucket) -> Route:
        if bucket.on_cpu:
            return self.route(HostRoute)
        return self.route(DeviceTierRoute if bucket.home.on_device else OffloadRoute)
