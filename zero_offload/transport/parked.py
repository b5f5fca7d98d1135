"""The route of a GPU bucket whose state is parked on the host between steps (:class:`ParkedRoute`, the parked home's:
:mod:`zero_offload.state.parked_home`): no gradient and no parameter crosses PCIe, only the state. Backward's hooks
bring the state up as the bucket's gradients become final, where the GPU has room for it then (memory backward has
freed, beyond ``gpu_margin_gib`` and the gradients still to come; else at ``step()``); ``step()`` reads the gradients
where autograd left them, steps the bucket on the GPU, and sends the state back down during the next forward. Sharded
over a ``process_group``, the bucket is on :class:`~zero_offload.transport.sharded.ShardedParkedRoute`: the same
home, holding this rank's shard of the state."""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from zero_offload.lane import Lane
from zero_offload.transport.device import room_in_backward
from zero_offload.transport.host import HostRoute

__all__ = ["ParkedRoute", "reload_if_room"]


class ParkedRoute(HostRoute):
    """Parameters and gradients on a GPU, the state parked on the host (see the module docstring)."""

    upload_reads = True  # (its update runs on the GPU, not by a queued native call)
    reads_in_place = True

    def send(self, lane: Lane, idx: List[int], grads: List[torch.Tensor], add: List[bool]) -> Optional[torch.Tensor]:
        """The bucket's gradients are final: its state comes up now, where there is room (once a step)."""
        reload_if_room(self.transport, lane)
        return None

    def end(self, lane: Lane) -> None:
        lane.bucket.home.release()


def reload_if_room(transport: Any, lane: Lane) -> None:
    """Bring a parked bucket's state up now (backward has made its gradients final), where the GPU has room for it
    beyond the margin and the gradients still to come, and it is not up already (once a step); else, or where the
    allocator cannot give that memory after all, ``step()`` does. Its route's, sharded or not
    (:class:`~zero_offload.transport.sharded.ShardedParkedRoute`)."""
    home = lane.bucket.home
    if home.twins is None and room_in_backward(transport, lane.bucket.device, home.nbytes_parked(), transport.lanes):
        try:
            home.reload(transport.streams, transport.timeline, lane.position)
        except torch.cuda.OutOfMemoryError:
            # (room the check counted that the allocator could not give, as a fragmented cache: nothing was brought
            # up, and the error would end backward; step() brings the state up after it, as without room)
            pass
