"""Every byte that moves between the parameters and the host buffers (see :mod:`zero_offload.transport.base`):
the transport of one optimizer (made by its topology, :mod:`zero_offload.topology`), and the routes of its bucket
kinds, one module each."""

from zero_offload.transport.base import Route, Transport
from zero_offload.transport.local import LocalTransport

__all__ = ["LocalTransport", "Route", "Transport"]
