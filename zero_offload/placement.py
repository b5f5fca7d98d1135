"""``gpu_fraction="auto"``: after the first step, the last-arriving CUDA buckets move to the device tier, as many
as fit in the GPU memory the step left free (what neither the allocator's peak of the step nor ``gpu_margin_gib``
takes). Sharded, every rank moves the same buckets (the fewest any rank has room for)."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, MutableMapping, Sequence

import torch

from zero_offload import checkpoint
from zero_offload.lane import Lane
from zero_offload.topology import Topology
from zero_offload.transport import Transport

__all__ = ["device_bytes", "place_on_device"]

logger = logging.getLogger("zero_offload")


def _device_room(device: torch.device, margin_gib: float) -> int:
    """Bytes of ``device`` memory the state may take: free memory plus what the caching allocator holds, less the
    step's peak allocation (which the next step needs again) and the margin."""
    free, _ = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    return int(free + held - torch.cuda.max_memory_allocated(device) - margin_gib * 2**30)


def place_on_device(topology: Topology, transport: Transport, streamer: Any, state: MutableMapping,
                    margin_gib: float) -> None:
    """Move the last-arriving CUDA buckets of ``transport``'s lanes to the device tier (see the module
    docstring); ``streamer`` stops streaming them and ``state`` shows their new entries."""
    lanes = [lane for lane in transport.lanes if not lane.bucket.resident]
    if not lanes and topology.alone:  # (a CPU model: nothing to place; with other ranks, agree anyway)
        return
    arrived = [lane for lane in transport.arrivals if not lane.bucket.resident]  # (streamed CPU buckets too)
    # Last to arrive first; then those backward did not send, in construction order (backward would produce the
    # first ones last).
    order = list(reversed(arrived)) + [lane for lane in lanes if all(lane is not a for a in arrived)]
    room = {d: _device_room(d, margin_gib) for d in {lane.bucket.device for lane in lanes}}
    count = 0
    for lane in order:
        cost = lane.bucket.device_cost()
        if cost > room[lane.bucket.device]:
            break
        room[lane.bucket.device] -= cost
        count += 1
    count = topology.fewest(count, "the buckets gpu_fraction='auto' moves")
    if not count:
        logger.info("OffloadOptimizer(gpu_fraction='auto'): no bucket fits on the GPU; all state stays on the host")
        return
    transport.synchronize()  # no copy may still read the host buffers being replaced
    moved = _move(order[:count], topology, transport, streamer, state)
    logger.info("OffloadOptimizer(gpu_fraction='auto'): %d of %d GPU buckets moved to the GPU (%s)", moved,
                len(lanes), device_bytes(transport.lanes))


def _move(lanes: List[Lane], topology: Topology, transport: Transport, streamer: Any, state: MutableMapping) -> int:
    moved = 0
    for lane in lanes:
        bucket = lane.bucket
        try:
            bucket.move_to_device()
        except torch.cuda.OutOfMemoryError as exc:
            if not topology.alone:  # the other ranks may have moved it: the layouts would differ
                raise
            logger.warning("OffloadOptimizer(gpu_fraction='auto'): the GPU ran out of memory moving %s (%s); it "
                           "and the buckets after it stay on the host", bucket.where, exc)
            break
        streamer.drop(lane)
        transport.rehome(lane)
        checkpoint.expose(state, bucket, [i for i, e in enumerate(bucket.exposed) if e])
        moved += 1
    return moved


def device_bytes(lanes: Sequence[Lane]) -> Dict[str, int]:
    """GPU memory held by the state on the device tier, in bytes by buffer (summed over its buckets)."""
    total: Dict[str, int] = {}
    for lane in lanes:
        for name, n in lane.bucket.device_bytes().items():
            total[name] = total.get(name, 0) + n
    return total
