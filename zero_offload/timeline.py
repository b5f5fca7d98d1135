"""An opt-in record of what one optimizer's step did and when, by the host clock: every host wait (what for, how
long), each bucket's kernel (start, end, thread), each copy issued (gradients down, parameters up, a parked
bucket's state up and back), and ``step()`` itself.

``OffloadOptimizer.record_timeline()`` starts it, ``OffloadOptimizer.timeline()`` returns the events so far (and
clears them). Off (the default), each recording point costs one ``None`` check. On a GPU the copies are recorded
when they are *issued* (they run asynchronously); the waits show when the host blocked for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Dict, Iterator, List, Optional

__all__ = ["NOTHING", "Timeline", "TimelineEvent", "span"]


@dataclasses.dataclass
class TimelineEvent:
    """One thing that happened.

    Attributes:
        kind (str): ``"wait"`` (the host blocked), ``"kernel"``, ``"copy"``, ``"step"``.
        what (str): for a wait, what it waited for (``"d2h"``: a bucket's gradient copy; ``"h2d"``: its last
            upload; ``"norms"``: the GPU norms; ``"streams"``); for a kernel, ``"step"`` or ``"gpu launch"`` (the
            update of a bucket stepped on the GPU, launched: the GPU runs it after the span); for a copy, ``"d2h"``, ``"h2d"`` or ``"h2d delayed"`` (new parameters copied up to a device buffer
            during backward), ``"reload"`` and ``"write-back"`` (a parked bucket's state up to the GPU and back).
        bucket (int, optional): the bucket's position in the optimizer (groups in order, then buckets).
        thread (str): the thread's name.
        start (float), end (float): ``time.perf_counter()`` seconds (equal for an instant).
    """

    kind: str
    what: str
    bucket: Optional[int]
    thread: str
    start: float
    end: float

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


class Timeline:
    """The recorder (see the module docstring). Buckets are named by their position in the optimizer (their lane's
    ``position``)."""

    def __init__(self) -> None:
        self.events: List[TimelineEvent] = []  # appended from several threads: list.append is atomic

    def _event(self, kind: str, what: str, where: Optional[int], start: float, end: float) -> None:
        self.events.append(TimelineEvent(kind, what, where, threading.current_thread().name, start, end))

    @contextlib.contextmanager
    def span(self, kind: str, what: str, where: Optional[int] = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._event(kind, what, where, start, time.perf_counter())

    def mark(self, kind: str, what: str, where: Optional[int] = None) -> None:
        now = time.perf_counter()
        self._event(kind, what, where, now, now)

    def take(self) -> List[TimelineEvent]:
        events, self.events = self.events, []
        return sorted(events, key=lambda e: e.start)


# The context of a recording point while no timeline is on (hot paths write
# ``with NOTHING if tl is None else tl.span(...)``: no call at all then).
NOTHING = contextlib.nullcontext()


def span(timeline: Optional[Timeline], kind: str, what: str, where: Optional[int] = None):
    """``timeline.span(...)``, or a context that does nothing when there is no timeline."""
    return NOTHING if timeline is None else timeline.span(kind, what, where)


def breakdown(events: List[TimelineEvent]) -> Dict[str, Dict[str, float]]:
    """Per (kind, what): how many events and their total milliseconds, e.g. for a per-step table."""
    out: Dict[str, Dict[str, float]] = {}
    for e in events:
        row = out.setdefault(f"{e.kind} {e.what}", {"count": 0, "ms": 0.0})
        row["count"] += 1
        row["ms"] += e.ms
    return out


def chrome_trace(events: List[TimelineEvent], path: str) -> None:
    """Write ``events`` as a Chrome trace (chrome://tracing, Perfetto): one row per thread."""
    if not events:
        trace = []
    else:
        t0 = min(e.start for e in events)
        trace = [{"name": f"{e.kind} {e.what}" + ("" if e.bucket is None else f" b{e.bucket}"),
                  "ph": "X" if e.end > e.start else "i", "ts": (e.start - t0) * 1e6, "dur": (e.end - e.start) * 1e6,
                  "pid": 0, "tid": e.thread, "args": {"bucket": e.bucket}} for e in events]
    with open(path, "w") as f:
        json.dump({"traceEvents": trace}, f)
