"""The transport of an optimizer in one process (no ``process_group``): each bucket on the route of its kind,
parameters on the host (:class:`~zero_offload.transport.host.HostRoute`) or on a GPU, with the state stepped on the
host (:class:`~zero_offload.transport.device.OffloadRoute`), resident on the GPU
(:class:`~zero_offload.transport.device.DeviceTierRoute`) or parked on the host and stepped on the GPU
(:class:`~zero_offload.transport.parked.ParkedRoute`)."""

from __future__ import annotations

from zero_offload.buckets import FlatBucket
from zero_offload.transport.base import Route, Transport
from zero_offload.transport.device import DeviceTierRoute, OffloadRoute
from zero_offload.transport.host import HostRoute
from zero_offload.transport.parked import ParkedRoute

__all__ = ["LocalTransport"]


class LocalTransport(Transport):
    """One process's buckets, each on its kind's route."""

    def route_for(self, bucket: FlatBucket) -> Route:
        if bucket.on_cpu:
            return self.route(HostRoute)
        return self.route({"resident": DeviceTierRoute, "parked": ParkedRoute}.get(bucket.home.kind, OffloadRoute))
