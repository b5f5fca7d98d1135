"""Every byte that moves between the parameters and the host buffers (see :mod:`zero_offload.transport.base`):
the transport of one optimizer, and the routes of its bucket kinds, one module each."""

from __future__ import annotations

from typing import Any, Optional

import torch

from zero_offload.options import Options
from zero_offload.transport.base import Route, Transport
from zero_offload.transport.local import LocalTransport

__all__ = ["LocalTransport", "Route", "Transport", "make_transport"]


def make_transport(process_group: Optional[Any], options: Options, fsdp: bool = False) -> Transport:
    """The transport ``options`` ask for: one process's, FSDP2's shards' (``fsdp``), or (``process_group``) the
    sharded one."""
    transport: Transport
    if fsdp:
        from zero_offload.transport.fsdp2 import FSDPTransport

        transport = FSDPTransport(release=options.release_grads)
    elif process_group is None:
        transport = LocalTransport(release=options.release_grads)
    else:
        from zero_offload.distributed import DEFAULT_TIMEOUT, Comm  # only with a process group
        from zero_offload.transport.sharded import ShardedTransport

        timeout = DEFAULT_TIMEOUT if options.timeout is None else options.timeout
        transport = ShardedTransport(Comm(process_group, timeout, options.grads_reduced,
                                          compact_state=options.state_dtype != torch.float32),
                                     release=options.release_grads)
    transport.staging_margin = int(options.gpu_margin_gib * 2**30) if options.uploads_in_backward else None
    return transport
