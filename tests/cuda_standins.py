"""Stand-ins that run the CUDA-only branches of zero_offload on CPU tensors (see test_cuda_branches.py).

The bucket layouts are told their parameters are on ``cuda:0`` (and the default placement, ``"auto"``, takes the
model for a GPU one); tensors created for that device are made on the CPU. Python in those branches then runs for
real. Streams and events order nothing (a CPU copy is complete when it returns), but they keep account of what they
were told: which stream is current (``torch.cuda.stream``), which stream waited for which (directly, through another
or through an event), and, in a spawned rank (:func:`install_in_rank`), which collective each device collective of a
bucket was issued on and which streams wait for it (:class:`Ledger`), so that a test can check the order a GPU would
keep. Wherever FSDP2 runs on the stand-ins, its own streams stand in too (:func:`stand_in_fsdp_streams`, on by
default): its hooks run with its stream current, as on a GPU. Devices are not checked by themselves: every tensor
is a CPU tensor, so a host buffer handed to a GPU op passes; tests/device_check.py adds that check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch

import zero_offload.buckets as buckets_module
import zero_offload.cost_model as cost_model
import zero_offload.options as options_module
from zero_offload import _torch_fused


class Device:
    """Stands for ``cuda:0`` in the bucket layouts: its ``type`` picks the CUDA branches, and it equals the CPU
    device the tensors really are on (the check that a parameter has not moved)."""

    type = "cuda"
    index = 0

    def __eq__(self, other) -> bool:
        return other is self or other == torch.device("cpu")

    def __hash__(self) -> int:
        return hash("cuda:0 (stand-in)")

    def __repr__(self) -> str:
        return "cuda:0 (stand-in)"


class Stream:
    """A stream that orders nothing but keeps account of what it waits for: ``epoch`` counts the work a test says
    was queued on it (:meth:`tick`), ``seen`` the epoch of each other stream it waits for, ``collectives`` the
    (:class:`Issued`) ids of the collectives it waits for; each directly or through other streams and events."""

    def __init__(self, *args, name: str = "side", **kwargs):
        self.name = name
        self.epoch = 0
        self.seen: Dict["Stream", int] = {}
        self.collectives: set = set()

    def __repr__(self) -> str:
        return f"<stand-in stream {self.name}>"

    def point(self) -> Tuple[Dict["Stream", int], FrozenSet[int]]:
        """Everything work queued here from now on comes after (what an event recorded now marks)."""
        return {**self.seen, self: self.epoch}, frozenset(self.collectives)

    def _join(self, point: Tuple[Dict["Stream", int], FrozenSet[int]]) -> None:
        seen, collectives = point
        for stream, epoch in seen.items():
            if stream is not self:
                self.seen[stream] = max(self.seen.get(stream, 0), epoch)
        self.collectives |= collectives

    def wait_stream(self, other) -> None:
        self._join(other.point())

    def wait_event(self, event) -> None:
        if event.point is not None:  # (an event never recorded is complete, as CUDA's)
            self._join(event.point)

    def synchronize(self) -> None:
        pass

    def tick(self) -> None:
        """Work was queued on this stream (a test says so: a gradient written, an update run)."""
        self.epoch += 1

    def waits_for(self, other: "Stream") -> bool:
        """Whether everything queued on ``other`` so far comes before what is queued here next."""
        return other is self or self.seen.get(other, 0) >= other.epoch


class Event:
    def __init__(self, *args, **kwargs):
        self.recorded = False
        self.point: Optional[Tuple[Dict[Stream, int], FrozenSet[int]]] = None

    def record(self, stream=None) -> None:
        self.recorded = True
        self.point = (stream or torch.cuda.current_stream()).point()

    def synchronize(self) -> None:
        assert self.recorded, "waited for an event that was never recorded"

    def query(self) -> bool:
        return True


@dataclasses.dataclass
class Issued:
    """A device collective of a bucket (a reduce-scatter of its gradients, an all-gather of its parameters), as the
    stand-ins saw it issued: ``stream``, the current one, which (as ``Work.wait()`` makes it on a GPU) waits for it
    from then on; ``compute_epoch`` the compute stream's epoch then and ``saw_compute`` whether ``stream`` waited for
    all of it; ``input_stream`` the stream its input was made on (None: not made for it)."""

    id: int
    what: str
    where: str
    stream: Stream
    compute_epoch: int
    saw_compute: bool
    input_stream: Optional[Stream]


@dataclasses.dataclass
class Allocation:
    """A device allocation, as the stand-ins saw it (:func:`watch_allocations`): ``stream``, the one current then
    (the caching allocator's pool the block comes from, and goes back to when freed), its bytes, ``how`` it was made
    (``"empty"``, ``"zeros"``, or ``"resize_"``: a storage given memory again) and its storage (``_cdata``)."""

    stream: Stream
    nbytes: int
    how: str
    storage: int


@dataclasses.dataclass
class Ledger:
    """What one process's stand-ins saw: the compute stream (current outside any ``torch.cuda.stream`` block), the
    device collectives issued (:func:`install_in_rank`), in order; with :func:`watch_allocations`, every device
    allocation (``allocations``, None unwatched) and every ``record_stream`` (``handed``: (storage, stream));
    with :func:`stand_in_fsdp_streams`, the stand-in of each of FSDP's streams (``fsdp``: by the ``id`` of FSDP's
    own stream)."""

    compute: Stream
    issued: List[Issued] = dataclasses.field(default_factory=list)
    allocations: Optional[List[Allocation]] = None
    handed: List[Tuple[int, Stream]] = dataclasses.field(default_factory=list)
    storages: set = dataclasses.field(default_factory=set)  # (the device tensors' storages, watched)
    fsdp: Dict[int, Stream] = dataclasses.field(default_factory=dict)


LEDGER = Ledger(Stream(name="compute"))  # (the latest install's)


@contextlib.contextmanager
def installed(fsdp_streams: bool = True, allocations: bool = False):
    """The stand-ins for the duration of a ``with`` block (outside pytest: a spawned rank's job), then the real
    attributes back. Yields :func:`install`'s list. ``fsdp_streams`` (default): FSDP2's own streams stand in too
    (:func:`stand_in_fsdp_streams`), so that FSDP's hooks run with its stream current, as on a GPU;
    ``allocations``: :func:`watch_allocations` too."""
    saved = []

    def setattr_(obj, name, value):
        saved.append((obj, name, obj.__dict__.get(name, _INHERITED) if isinstance(obj, type) else getattr(obj, name)))
        setattr(obj, name, value)

    try:
        planned = install(setattr_, fsdp_streams=fsdp_streams)
        if allocations:
            watch_allocations(setattr_)
        yield planned
    finally:
        for obj, name, value in reversed(saved):
            if value is _INHERITED:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


_INHERITED = object()  # (a class attribute that was its base's: deleted again, not set on the class)


def install(setattr_: Callable[[object, str, object], None], default_host: bool = False,
            fsdp_streams: bool = True) -> List[int]:
    """Install the stand-ins with ``setattr_`` (pytest's ``monkeypatch.setattr``, or ``setattr`` in a spawned
    process). Returns a list that grows by one entry per param group planned on the stand-in device. With
    ``default_host``, the default placement is left at the host, as for a CPU model (for the tests of the host
    route's CUDA branches, whose helpers build optimizers with the default options). ``fsdp_streams`` (default):
    :func:`stand_in_fsdp_streams` too, wherever FSDP2 runs on the stand-ins (nothing changes where it does not)."""
    global LEDGER
    device, planned = Device(), []
    LEDGER = Ledger(Stream(name="compute"))
    current = [LEDGER.compute]
    plan = buckets_module.plan_buckets

    def plan_on_cuda(params, max_numel, **kw):
        planned.append(len(params))
        return [dataclasses.replace(layout, device=device) for layout in plan(params, max_numel, **kw)]

    ledger = LEDGER

    def on_cpu(make):
        def made(*args, **kwargs):
            if not isinstance(kwargs.get("device"), Device):
                return make(*args, **kwargs)
            kwargs["device"] = "cpu"
            t = make(*args, **kwargs)
            t.standin_stream = current[0]  # (the stream it was made on, as the caching allocator keeps it)
            if ledger.allocations is not None:
                storage = t.untyped_storage()
                ledger.storages.add(storage._cdata)
                ledger.allocations.append(Allocation(current[0], storage.nbytes(), make.__name__, storage._cdata))
            return t
        return made

    @contextlib.contextmanager
    def stream(s):
        before = current[0]
        if s is not None:
            current[0] = s
        try:
            yield
        finally:
            current[0] = before

    setattr_(buckets_module, "plan_buckets", plan_on_cuda)
    setattr_(buckets_module, "should_pin", lambda device, pin_memory: False)
    # The model counts as on a GPU (the default placement is "auto" there; not where torch < 2.4 has no fused CPU
    # AdamW to stand in for the GPU's update), whose copies run at a PCIe 4 link's rate ("auto" measures them after
    # the second step; the stand-in streams time nothing).
    gpu_model = not default_host and _torch_fused.AVAILABLE
    setattr_(options_module, "gpu_params", lambda params: gpu_model)
    setattr_(cost_model, "measure_copy_rate", lambda device, nbytes=0, up=True: 25e9)
    setattr_(torch.cuda, "Stream", Stream)
    setattr_(torch.cuda, "Event", Event)
    setattr_(torch.cuda, "current_stream", lambda device=None: current[0])
    setattr_(torch.cuda, "stream", stream)
    # A device with room to spare (uploads in backward and parked reloads ask).
    setattr_(torch.cuda, "mem_get_info", lambda device=None: (1 << 40, 1 << 40))
    setattr_(torch.cuda, "memory_reserved", lambda device=None: 0)
    setattr_(torch.cuda, "memory_allocated", lambda device=None: 0)
    setattr_(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    setattr_(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)  # (uncapped)
    setattr_(torch.Tensor, "record_stream", lambda self, stream: None)
    for name in ("empty", "zeros"):
        setattr_(torch, name, on_cpu(getattr(torch, name)))
    if fsdp_streams:
        stand_in_fsdp_streams(setattr_)
    return planned


def watch_allocations(setattr_: Callable[[object, str, object], None]) -> None:
    """After :func:`install`: the :data:`LEDGER` keeps every device allocation (:class:`Allocation`: a stand-in
    device tensor made, or its storage given memory again by ``untyped_storage().resize_``, as the parked home and
    FSDP re-allocate a buffer) with the stream current then, and every ``record_stream`` (a tensor handed to
    another stream) in ``handed``."""
    ledger = LEDGER
    ledger.allocations = []
    resize = torch.UntypedStorage.resize_

    def resize_(storage, nbytes):
        if nbytes and storage._cdata in ledger.storages:
            ledger.allocations.append(Allocation(torch.cuda.current_stream(), int(nbytes), "resize_", storage._cdata))
        return resize(storage, nbytes)

    setattr_(torch.UntypedStorage, "resize_", resize_)
    setattr_(torch.Tensor, "record_stream",
             lambda self, stream: ledger.handed.append((self.untyped_storage()._cdata, stream)))


def stand_in_fsdp_streams(setattr_: Callable[[object, str, object], None]) -> None:
    """After :func:`install`: FSDP2's own streams take part in the stand-ins' account. On a CPU mesh FSDP enters
    ``torch.cpu.stream(s)`` where on a GPU it enters ``torch.cuda.stream(s)`` (its reduce-scatter or all-reduce
    stream around the post-accumulate-grad hooks it runs, its all-gather streams in forward); each such block now
    also makes a stand-in stream of ``s`` (one per stream of FSDP's, in ``LEDGER.fsdp``) current, so that what the
    optimizer does from FSDP's hooks sees the stream a GPU would have current there."""
    ledger, real = LEDGER, torch.cpu.stream

    @contextlib.contextmanager
    def stream(s):
        standin = ledger.fsdp.get(id(s))
        if standin is None:
            standin = ledger.fsdp[id(s)] = Stream(name=f"FSDP's #{len(ledger.fsdp)}")
            standin.fsdp_stream = s  # (keeps FSDP's stream alive: its id stays its own)
        with real(s), torch.cuda.stream(standin):
            yield

    setattr_(torch.cpu, "stream", stream)


def fixture_body(monkeypatch, needs_fused: bool = True, default_host: bool = False):
    """The body of a test module's ``cuda_branches`` fixture (``yield from fixture_body(monkeypatch)``): the
    stand-ins installed for the test, ``monkeypatch`` handed on, and a check that some optimizer used them. With
    ``needs_fused``, skipped where torch has no fused AdamW for CPU tensors to stand in for the GPU's (torch < 2.4);
    ``default_host``: see :func:`install`."""
    if needs_fused and not _torch_fused.AVAILABLE:
        import pytest

        pytest.skip("torch < 2.4 has no fused AdamW for CPU tensors to stand in for the GPU's")
    planned = install(monkeypatch.setattr, default_host)
    yield monkeypatch
    assert planned, "no optimizer was built on the stand-in device"


def install_in_rank() -> None:
    """In a spawned rank (for the process's life): :func:`install`, each collective of ``zero_offload``'s
    process-group transport waited for as it starts (the stand-in streams order nothing, so a collective's result
    must be there before the next stand-in copy reads it), and each device collective of a bucket entered in the
    :data:`LEDGER` (:class:`Issued`: the stand-in tensors are on the CPU, so gloo runs it and nothing waits on a
    stream; on a GPU, NCCL's ``Work.wait()`` has the current stream wait for it, as the entry does)."""
    import zero_offload.distributed

    install(setattr)
    Comm = zero_offload.distributed.Comm
    start = Comm.start

    def start_and_wait(comm, *args, **kwargs):
        pending = start(comm, *args, **kwargs)
        pending.wait()
        return pending

    Comm.start = start_and_wait
    ids = itertools.count()

    def entered(issue):
        def issued(comm, out, inp, where):
            pending = issue(comm, out, inp, where)
            if where.startswith(("gradients of ", "parameters of ")):  # (not the step's small host exchanges)
                stream, compute = torch.cuda.current_stream(), LEDGER.compute
                LEDGER.issued.append(Issued(next(ids), pending.what, where, stream, compute.epoch,
                                            stream.waits_for(compute), getattr(inp, "standin_stream", None)))
                stream.collectives.add(LEDGER.issued[-1].id)
            return pending
        return issued

    Comm.start_reduce_scatter = entered(Comm.start_reduce_scatter)
    Comm.start_all_gather = entered(Comm.start_all_gather)
