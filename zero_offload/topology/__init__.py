"""Where the optimizer's parameters live across ranks (see :mod:`~zero_offload.topology.base`): one process
(:class:`Local`), a ``process_group`` (:class:`~zero_offload.topology.group.Group`) or FSDP2's device mesh
(:class:`~zero_offload.topology.mesh.Mesh`), found from the constructor's parameters and options by :func:`of`."""

from __future__ import annotations

from typing import Any, Tuple

from zero_offload import fsdp2
from zero_offload.options import Options
from zero_offload.topology.base import Local, Placement, Topology

__all__ = ["Local", "Placement", "Topology", "of"]


def of(params: Any, options: Options) -> Tuple[Topology, Any]:
    """The topology of an optimizer over ``params`` (the constructor's: tensors or group dicts, maybe a generator)
    with ``options``, and ``params`` as a list. FSDP2's parameters (DTensors) are found first: FSDP's registry is
    read before the iterable is consumed (see :func:`zero_offload.fsdp2.take`)."""
    params, managed = fsdp2.take(params, options)
    if managed is not None:
        from zero_offload.topology.mesh import Mesh  # (torch.distributed only with DTensors)

        return Mesh(managed), params
    if options.process_group is not None:
        from zero_offload.topology.group import Group

        return Group(options.process_group), params
    return Local(), params
