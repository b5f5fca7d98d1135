"""A bucket's channel: what its copies need for the optimizer's life, kept by its route. The CUDA events that order
its copies (:class:`Mark`: an event, how many times it was recorded and which recording the host last waited for)
and whether something sent is still to be waited for; each route's own channel adds its landing buffers
(:class:`~zero_offload.transport.device.CopyChannel`, :class:`~zero_offload.transport.sharded.ShardedChannel`);
and the side streams those events are recorded on, the transport's (:class:`Streams`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from zero_offload.timeline import NOTHING, Timeline

__all__ = ["Channel", "Mark", "Streams"]


class Mark:
    """A point on a stream the host may wait for: a CUDA event (made at its first recording), the number of times
    it was recorded, and the recording the host last waited for (a complete event is not waited for again)."""

    __slots__ = ("event", "recorded", "seen")

    def __init__(self) -> None:
        self.event: Optional[Any] = None
        self.recorded = 0
        self.seen = 0

    def record(self, stream: Any) -> None:
        """Record the point, on ``stream``."""
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record(stream)
        self.recorded += 1

    @property
    def waited(self) -> bool:
        """Whether the host has waited for the last recording (or there was none)."""
        return self.recorded == self.seen

    def wait(self, timeline: Optional[Timeline], label: str, position: int, query: bool = False) -> None:
        """Wait until the last recording has passed (``query``: look first, as for a point usually long passed;
        the timeline then shows a wait only where there was one)."""
        recorded = self.recorded
        if self.event is not None and self.seen != recorded:
            if not (query and self.event.query()):
                with NOTHING if timeline is None else timeline.span("wait", label, position):
                    self.event.synchronize()
            self.seen = recorded  # (if recorded again meanwhile, the newer recording is still to be waited for)


class Channel:
    """What a bucket's copies keep for the optimizer's life (see the module docstring). The base channel is a
    route's where nothing lands anywhere (parameters on the host, the device tier's buckets).

    Attributes:
        down (Mark): after the bucket's last gradient copy to the host.
        up (Mark): after its last upload of parameters (which read the master or staging: the next update of the
            bucket waits for it).
        unsettled (bool): something was sent that the host has not waited for (a copy, a collective, a sum to
            add): the route's ``wait`` has work to do.
    """

    __slots__ = ("down", "up", "unsettled")

    def __init__(self) -> None:
        self.down, self.up = Mark(), Mark()
        self.unsettled = False

    def sent(self, stream: Any = None) -> None:
        """Something was sent (its copies recorded on ``stream`` where given): the host must wait before reading
        what lands."""
        if stream is not None:
            self.down.record(stream)
        self.unsettled = True

    def settled(self) -> None:
        """The host has waited for everything sent."""
        self.unsettled = False

    @property
    def staged(self) -> Optional[Any]:
        """A device copy of new parameters ahead of their commit (the copying route's channel only)."""
        return None


class Streams:
    """The side streams of one transport, made at first use, per device: one for the copies off the GPU (and a
    host-homed sharded bucket's reduce-scatter), one for the uploads back (and their all-gathers, and a parked
    bucket's reloads), so that uploads never queue behind gradient copies; and one for the collectives of the
    sharded buckets stepped on the GPU (their reduce-scatters and all-gathers), as DDP and FSDP2 keep theirs off the
    compute stream: it waits for the compute stream before each collective, and the compute stream waits for it
    only where a result is first read. Of their own, so that a reduce-scatter never queues behind a parked bucket's
    write-back, nor a parked reload at ``step()`` behind the previous bucket's all-gather.

    Beside them, the *compute* stream of each device (:meth:`compute`): the one forward, backward and ``step()`` run
    on in the user's code, which the caching allocator hands backward's freed memory back to. A device buffer made
    from a hook must come from its pool whatever stream the hook finds current: FSDP2 runs its post-accumulate-grad
    hooks with its reduce-scatter (or all-reduce) stream current, and a block allocated there would stay in that
    stream's pool once freed, out of reach of the next forward. Noted in the user's thread (:meth:`note_compute`:
    when a bucket is added, as each step begins and as it ends), never read from a hook."""

    __slots__ = ("_down", "_up", "_collectives", "_compute")

    def __init__(self) -> None:
        self._down: Dict[Any, Any] = {}
        self._up: Dict[Any, Any] = {}
        self._collectives: Dict[Any, Any] = {}
        self._compute: Dict[Any, Any] = {}

    def note_compute(self, device: Optional[torch.device] = None) -> None:
        """The stream current on ``device`` now is its compute stream (None: on every device noted before). From
        the user's thread only (a bucket added, a step begun or ended), not from a hook, where FSDP2's stream is
        current."""
        for d in list(self._compute) if device is None else [device]:
            self._compute[d] = torch.cuda.current_stream(d)

    def compute(self, device: torch.device) -> Any:
        """``device``'s compute stream as last noted (:meth:`note_compute`); the current stream where none was."""
        stream = self._compute.get(device)
        return torch.cuda.current_stream(device) if stream is None else stream

    def down(self, device: torch.device) -> Any:
        """The stream of the copies off ``device``."""
        return self._down.get(device) or self._make(self._down, device)

    def up(self, device: torch.device) -> Any:
        """The stream of the uploads to ``device``."""
        return self._up.get(device) or self._make(self._up, device)

    def collectives(self, device: torch.device) -> Any:
        """The stream the collectives of ``device``'s GPU-stepped sharded buckets are issued on."""
        return self._collectives.get(device) or self._make(self._collectives, device)

    @staticmethod
    def _make(streams: Dict[Any, Any], device: torch.device) -> Any:
        stream = streams[device] = torch.cuda.Stream(device=device)
        return stream

    def synchronize(self, timeline: Optional[Timeline]) -> None:
        """Wait for everything queued on every side stream."""
        for stream in [*self._down.values(), *self._up.values(), *self._collectives.values()]:
            with NOTHING if timeline is None else timeline.span("wait", "streams"):
                stream.synchronize()
