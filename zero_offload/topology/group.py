"""The topology of ZeRO over a ``process_group`` (:class:`Group`): every rank holds the whole parameters and keeps the
state of its shard of every bucket (:class:`~zero_offload.state.layout.ShardLayout`); the step's collectives are
the sharded transport's (:mod:`~zero_offload.transport.sharded`), over the group's
:class:`~zero_offload.distributed.Comm`."""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.options import Options, check_params
from zero_offload.topology.base import Placement, Topology, _with_margin

if TYPE_CHECKING:  # (annotations only)
    from zero_offload.distributed import Comm
    from zero_offload.transport.base import Transport

__all__ = ["Group"]


class Group(Topology):
    """A ``process_group`` of data-parallel ranks, each with the whole parameters and its shard of the state.

    Args:
        process_group: the group (checked when the transport is made, with the validated options).
    """

    alone = False

    def __init__(self, process_group: Any):
        self.process_group = process_group
        self.comm: Optional["Comm"] = None  # made with the transport

    def transport(self, options: Options) -> "Transport":
        from zero_offload.distributed import DEFAULT_TIMEOUT, Comm
        from zero_offload.transport.sharded import ShardedTransport

        timeout = DEFAULT_TIMEOUT if options.timeout is None else options.timeout
        self.comm = Comm(self.process_group, timeout, options.grads_reduced,
                         compact_state=options.state_dtype != torch.float32)
        return _with_margin(ShardedTransport(self.comm, release=options.release_grads), options)

    def place(self, tensors: Sequence[torch.Tensor], index: int, layout: Tuple[Tuple[str, Any], ...]) -> Placement:
        """Every rank gives the same parameters and ``layout`` (checked on every rank at once: one collective), on
        a backend that moves them; the buckets are cut into the ranks' shards."""
        check_params(tensors)
        live = self.check_apart(tensors, index)
        comm = self.comm
        comm.check_same_params(tensors, index, layout)
        if not comm.host_ok and any(p.device.type == "cpu" for p in tensors):
            raise ValueError("process_group runs NCCL alone, which moves CUDA tensors only, but param group "
                             f"{index} has parameters on the CPU: shard a CPU model over a gloo group")
        return Placement(cut=(comm.world, comm.rank), live_views=live)

    def fewest(self, count: int, what: str) -> int:
        return int(self.comm.all_reduce_host([count], torch.distributed.ReduceOp.MIN, what)[0])

    def least(self, values: Sequence[float], what: str) -> List[float]:
        return self.comm.all_reduce_host(list(values), torch.distributed.ReduceOp.MIN, what)

    def state_entries(self, packed: Dict[Any, Any], groups: Sequence[Dict[str, Any]], buckets: Sequence[Any],
                      state: Dict[Any, Any], transport: "Transport") -> Dict[Any, Any]:
        """The full state, gathered onto every rank (a collective, after every rank agrees on what it holds), and
        the entries that are no parameter's."""
        from zero_offload.checkpoint.full import empty_entries, full_state

        transport.agree_state(chain.from_iterable(buckets))
        out = full_state(groups, buckets, self.comm.all_gather_host)
        out.update(empty_entries(groups, state))
        out.update((k, v) for k, v in state.items() if not isinstance(k, torch.Tensor))
        return out
