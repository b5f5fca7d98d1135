"""Where the buckets go once the first steps have shown the machine (:class:`Placer`): with ``gpu_fraction="auto"``
the last-arriving CUDA buckets move to the device home, as many as fit in the GPU memory the step left free (what
neither the allocator's peak of the step nor ``gpu_margin_gib`` takes; sharded, every rank moves the same buckets,
the fewest any rank has room for); with ``placement="auto"`` each CUDA bucket goes where the cost model says its step
is cheapest (:mod:`zero_offload.cost_model`), from the second step's arrival times, the GPU's room over the steps, the
forward between them and the rates measured then (sharded, each the least over the ranks: every rank places alike)."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, MutableMapping, Optional, Sequence

import torch

from zero_offload import apart, checkpoint, cost_model
from zero_offload.lane import Lane
from zero_offload.options import Options
from zero_offload.topology import Topology
from zero_offload.transport import Transport
from zero_offload.transport.device import device_capacity

__all__ = ["Placer", "device_bytes", "movable", "place_on_device"]

logger = logging.getLogger("zero_offload")


def _device_room(device: torch.device, margin_gib: float) -> int:
    """Bytes of ``device`` memory the state may take: what this process may hold there (free memory plus what the
    caching allocator holds, within its cap: :func:`~zero_offload.transport.device.device_capacity`), less the step's
    peak allocation (which the next step needs again) and the margin."""
    return int(device_capacity(device) - torch.cuda.max_memory_allocated(device) - margin_gib * 2**30)


def place_on_device(topology: Topology, transport: Transport, streamer: Any, state: MutableMapping,
                    margin_gib: float) -> None:
    """Move the last-arriving CUDA buckets of ``transport``'s lanes to the device tier (see the module
    docstring); ``streamer`` stops streaming them and ``state`` shows their new entries."""
    lanes = movable([lane for lane in transport.lanes if not lane.bucket.resident], transport)
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


def _move(lanes: List[Lane], topology: Topology, transport: Transport, streamer: Any, state: MutableMapping,
          kinds: Optional[Sequence[str]] = None) -> int:
    """Move each of ``lanes`` into the home of its ``kinds`` (default: resident); stop at the first the GPU has no
    memory for. Returns how many moved."""
    moved = 0
    for lane, kind in zip(lanes, kinds or ["resident"] * len(lanes)):
        bucket = lane.bucket
        try:
            bucket.rehome(kind)
        except torch.cuda.OutOfMemoryError as exc:
            if not topology.alone:  # the other ranks may have moved it: the layouts would differ
                raise
            logger.warning("OffloadOptimizer: the GPU ran out of memory moving %s to its %s home (%s); it and the "
                           "buckets after it stay on the host", bucket.where, kind, exc)
            break
        transport.rehome(lane)
        if not lane.route.hooks:
            streamer.drop(lane)  # (its gradients are read at step(): nothing for backward's hooks)
        checkpoint.expose(state, bucket, [i for i, e in enumerate(bucket.exposed) if e])
        moved += 1
    return moved


class Placer:
    """The first steps' measurements and the move after them: ``gpu_fraction="auto"`` places after the first step;
    ``placement="auto"`` after the second, which shows the forward too (from the first step's end to the second's
    first gradient, at most backward's length: forward does about half its work, and the gap holds whatever the
    loop does between steps; host clock, which runs ahead of the GPU in forward, so the measure errs short).

    Args:
        options (Options): the optimizer's.
    """

    def __init__(self, options: Options):
        self.options = options
        self.allocated: Dict[Any, int] = {}  # GPU memory allocated as step() began, by device
        self.begun: Optional[float] = None  # when this step() began
        self.ended: Optional[float] = None  # when the first step() ended (placement="auto")

    @staticmethod
    def of(options: Options) -> Optional["Placer"]:
        """The placer ``options`` ask for; None (nothing to place after the first steps)."""
        return Placer(options) if "auto" in (options.gpu_fraction, options.placement) else None

    def step_begins(self, transport: Transport) -> None:
        """``step()`` begins: what backward has freed by now is what parked state may take (the step's peak came
        before)."""
        self.begun = time.perf_counter()
        for device in {lane.bucket.device for lane in transport.lanes if not lane.bucket.on_cpu}:
            self.allocated[device] = torch.cuda.memory_allocated(device)

    def step_ends(self, topology: Topology, transport: Transport, streamer: Any,
                  state: MutableMapping) -> Optional["Placer"]:
        """Move the buckets where the options (and what the steps showed) say. Returns itself while it has more to
        measure, else None."""
        if self.options.gpu_fraction == "auto":
            place_on_device(topology, transport, streamer, state, self.options.gpu_margin_gib)
            return None
        lanes = movable([lane for lane in transport.lanes
                         if not lane.bucket.on_cpu and lane.bucket.home.kind == "host"], transport)
        if not lanes and topology.alone:  # (with other ranks, agree anyway: they meet at the exchange)
            return None
        if self.ended is None:
            self.ended = time.perf_counter()
            return self
        sent = [lane.arrival.at for lane in lanes if lane.arrival.at is not None]
        forward = 0.0 if not sent else max(0.0, min(min(sent) - self.ended, self.begun - min(sent)))
        homes = plan_auto(lanes, self.options, self.allocated, forward, topology) if lanes else []
        homes = topology.same_homes(homes)  # (where each rank planned from its own measures: see Topology.same_homes)
        moving = [(lane, home) for lane, home in zip(lanes, homes) if home != "host"]
        logger.info("OffloadOptimizer(placement='auto'): of %d GPU buckets, %d resident, %d parked, the rest stepped "
                    "on the host (forward taken as %.1f ms)", len(lanes), homes.count("resident"),
                    homes.count("parked"), forward * 1e3)
        if moving:
            transport.synchronize()  # no copy may still read the host buffers being replaced
            _move([lane for lane, _ in moving], topology, transport, streamer, state, [h for _, h in moving])
        return None


def movable(lanes: Sequence[Lane], transport: Transport) -> List[Lane]:
    """Those of ``lanes`` a GPU home may take: not a bucket with a parameter that views a larger tensor still alive
    (:mod:`zero_offload.apart`; not FSDP2's shards, whose storage a GPU home takes over from FSDP): stepped on the
    host, it is updated in place, as AdamW updates it; a GPU home would bind it to its slot, and the tensor it views
    would stop seeing the updates."""
    own = [p for lane in transport.lanes for p in lane.bucket.params]
    live = apart.live_views([p for lane in lanes if not lane.bucket.fsdp for p in lane.bucket.params], own)
    return [lane for lane in lanes if not any(id(p) in live for p in lane.bucket.params)]


def plan_auto(lanes: Sequence[Lane], options: Options, allocated: Dict[Any, int], forward: float,
              topology: Optional[Topology] = None) -> List[str]:
    """The home of each of ``lanes`` (CUDA buckets stepped on the host so far) by the cost model, with the rates
    measured now and the room the first steps left: resident, the memory their peak never used (less
    ``gpu_margin_gib``); parked, besides that, what backward had freed by ``step()`` (the peak less what was
    allocated then), given back within ``forward`` seconds of the step. With ``uploads_in_backward=False`` a parked
    bucket comes up at ``step()``: as if every bucket arrived at backward's end.

    Over a ``topology`` of several ranks every rank must place its buckets alike (their shards' collectives and
    layouts must match): each measure is taken as the least over the ranks (one collective) before the plan, so
    every rank plans from the same numbers: the slowest kernel and copies, the smallest room, the shortest forward,
    each bucket's latest arrival (its time before backward's end on the rank where that is shortest) and its largest
    shard."""
    devices = {lane.bucket.device for lane in lanes}
    rates = [cost_model.measure_kernel_rate(), min(cost_model.measure_copy_rate(d) for d in devices),
             min(cost_model.measure_copy_rate(d, up=False) for d in devices)]
    resident = min(_device_room(d, options.gpu_margin_gib) for d in devices)
    parked = min(torch.cuda.max_memory_allocated(d) - allocated.get(d, 0) for d in devices)
    sent = [lane.arrival.at if options.uploads_in_backward else None for lane in lanes]
    end = max((at for at in sent if at is not None), default=0.0)
    before = [0.0 if at is None else end - at for at in sent]  # (not sent in backward: at its end)
    # (the state a parked bucket brings up is what a resident one keeps: moments, and a separate master; a rank's
    # shard may hold fewer elements than another's, so sizes go in negated: the least is the largest)
    sizes = [-float(x) for lane in lanes for x in (lane.bucket.layout.numel, lane.bucket.device_cost())]
    if topology is not None:
        agreed = topology.least([*rates, resident, parked, forward, *before, *sizes], "placement='auto''s measures")
        rates, (resident, parked, forward) = agreed[:3], agreed[3:6]
        before, sizes = agreed[6 : 6 + len(lanes)], agreed[6 + len(lanes) :]
    # (a sharded bucket's shard of the reduced gradients is held through the step in either GPU home, and not moved)
    grads = [lane.bucket.device_grad_cost() for lane in lanes]  # (the same on every rank: shards are padded alike)
    costs = [cost_model.BucketCost(int(-sizes[2 * k]), int(-sizes[2 * k + 1]) - grads[k], int(-sizes[2 * k + 1]), -b,
                                   grads[k]) for k, b in enumerate(before)]
    return cost_model.plan_homes(costs, cost_model.Rates(*rates), max(0, resident), max(0, parked), forward)


def device_bytes(lanes: Sequence[Lane]) -> Dict[str, int]:
    """GPU memory held by the state on the device tier, in bytes by buffer (summed over its buckets)."""
    total: Dict[str, int] = {}
    for lane in lanes:
        for name, n in lane.bucket.device_bytes().items():
            total[name] = total.get(name, 0) + n
    return total
