"""The parked home: a bucket's state parked in pinned host memory between steps and stepped on the GPU its
parameters are on, by the rule's device update (torch's fused AdamW for AdamW, as the device home's). Its moments
(and the fp32 master of bf16/fp16 parameters; an fp32 parameter is its own master, bound to a slot on the GPU) come
up as device copies on a copy stream once the bucket's gradients are final in backward (:meth:`ParkedHome.reload`:
into memory allocated on the compute stream, which backward has been freeing, whatever stream the hook finds
current: FSDP2 runs its hooks with its reduce-scatter stream current), or at ``step()`` at the latest;
``step()`` updates them there, after the same checks as every other bucket's; they go down again on the other copy
stream while the next forward runs (:meth:`ParkedHome.put_back`), and the device copies' memory returns to the
allocator once that copy has read it. No host wait on the way: the compute stream waits for the reload's event, the
host only for a write-back still in flight when it reads the state (:meth:`ParkedHome.settle`: a checkpoint, a
load, ``flush()``, the first read of ``opt.state`` after ``step()``). The bucket's
gradients and parameters never cross PCIe.

The device copies are the same tensors from step to step, their storage given memory at each reload and none after
the write-back (as FSDP frees and re-allocates an unsharded parameter's storage): the per-parameter views cut of them
(the class stepped whole sees each parameter's shaped state through them, FSDP's shards copy their results from
them) are cut once and follow the storage into whatever memory the next reload is given, rather than being cut again
every step. They are cut again only where a copy is made anew (a buffer laid out again, another size).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.rules.base import Rule, Run, StateBuffer
from zero_offload.state.home import Copies, Home
from zero_offload.state.shaped import SHAPED
from zero_offload.state.tiers import DeviceTier, HostTier, Tier
from zero_offload.timeline import NOTHING, Timeline

__all__ = ["ParkedHome"]


class ParkedHome(Home):
    """State parked in (page-locked, with ``pin``) host memory, stepped on ``device`` (see the module docstring and
    :class:`~zero_offload.state.home.Home` for ``parts``).

    Attributes:
        twins (Dict[str, Tensor], optional): the device copies of the parked buffers (``"master"`` where it is
            separate, the rule's by name) from their reload to their write-back; None between (their tensors are
            kept, their storage holding no memory: see the module docstring).
    """

    kind = "parked"
    on_device = True

    def __init__(self, device: torch.device, pin: bool, **parts: Any):
        self.device = torch.device(device) if isinstance(device, str) else device
        parts["slots_tier"] = DeviceTier(self.device)  # (the parameters are bound to slots on their GPU)
        self._cut = parts["views"]  # a flat buffer's per-parameter views (their pieces when sharded)
        super().__init__(HostTier(pin), **parts)
        self.twins: Optional[Dict[str, torch.Tensor]] = None
        self._reloaded: Optional[Any] = None  # the event after the reload's copies
        self._written: Optional[Any] = None  # the event after the last write-back's copies, until waited for
        self._versions: Dict[str, int] = {}  # each parked buffer's version counter as its reload read it
        self._shown: List[int] = []  # under FSDP2, those of the DTensors opt.state shows (StateViews.shown_versions)
        self._held: Dict[str, torch.Tensor] = {}  # the device copies' tensors, kept between steps (memory freed)
        self._cuts: Dict[str, Tuple[torch.Tensor, Any, List[Any]]] = {}  # per copy: (its tensor, layout, views)

    @property
    def grads_tier(self) -> Tier:
        return DeviceTier(self.device)  # (its gradients are read where autograd left them, on the GPU)

    def parked(self) -> Dict[str, torch.Tensor]:
        """The host buffers the home parks, by name: a separate fp32 master (``"master"``), the rule's buffers, the
        shaped buffer (:data:`~zero_offload.state.shaped.SHAPED`) where the rule declares one."""
        master = {"master": self.masters.master} if self.masters.separate else {}
        shaped = self.store.shaped.flat
        return {**master, **self.store.flat, **({} if shaped is None else {SHAPED: shaped})}

    def nbytes_parked(self) -> int:
        """Bytes of the parked buffers: what the GPU holds of this home while it is stepped."""
        return sum(t.numel() * t.element_size() for t in self.parked().values())

    def device_tensors(self) -> Dict[str, torch.Tensor]:
        """The device copies of the parked buffers, from their reload to their write-back (none between)."""
        return dict(self.twins or {})

    # -- around a step -------------------------------------------------------------------------------------------
    def reload(self, streams: Any, timeline: Optional[Timeline] = None, where: Optional[int] = None) -> None:
        """Bring the parked buffers up (once a step): device copies allocated on the compute stream
        (:meth:`~zero_offload.transport.channel.Streams.compute`, whatever stream is current: in FSDP2's hooks, its
        reduce-scatter or all-reduce stream), filled on the upload stream once it has waited for the compute stream
        and the last write-back, an event after them."""
        if self.twins is not None:
            return
        up, compute = streams.up(self.device), streams.compute(self.device)
        twins: Dict[str, torch.Tensor] = {}
        try:
            # (From the compute stream's pool, where backward frees memory and the next forward allocates: made with
            # a side stream current, the blocks would return to that stream's pool at the write-back and stay there.)
            with torch.cuda.stream(compute):
                for name, buf in self.parked().items():
                    twins[name] = self._device_copy(name, buf)
        except BaseException:
            # (out of memory midway, as a reload in backward may be: the copies already given memory give it back
            # now, not at the next reload, which would allocate each again beside it and copy its contents over)
            _free(twins)
            raise
        up.wait_stream(compute)  # (the memory may have been in use by work queued on the compute stream until now)
        if self._written is not None:
            up.wait_event(self._written)  # the host buffers hold the last step's state only once it has landed
        with torch.cuda.stream(up), NOTHING if timeline is None else timeline.span("copy", "reload", where):
            for name, buf in self.parked().items():
                twins[name].copy_(buf, non_blocking=True)
                self._versions[name] = buf._version
            self._shown = self.views.shown_versions()
            self._reloaded = torch.cuda.Event()
            self._reloaded.record(up)
        for twin in twins.values():
            twin.record_stream(up)  # (freed while the copy may still run: the allocator waits for it)
        self.twins = twins

    def bring(self, streams: Any, timeline: Optional[Timeline] = None, where: Optional[int] = None) -> None:
        """The update's stream (the current one) waits for the reload (issued now if backward did not). A host
        buffer written in place since its reload in backward (``opt.state[p][name].mul_(0)``: a view of it, whose
        version counter it shares; under FSDP2, the DTensor ``opt.state`` shows) comes up again, as it then is: the
        step updates the state AdamW's would."""
        if self.twins is not None and (any(buf._version != self._versions.get(name)
                                           for name, buf in self.parked().items())
                                       or self.views.shown_versions() != self._shown):
            self.release()
        self.reload(streams, timeline, where)
        torch.cuda.current_stream(self.device).wait_event(self._reloaded)

    def update(self, rule: Rule, run: Run, hyper: Any) -> None:
        rule.update_on_device(run, hyper)

    def put_back(self, streams: Any, timeline: Optional[Timeline] = None, where: Optional[int] = None) -> None:
        """The updated buffers go down on the copy stream, after the update; their device memory is given back
        (reused once that copy has read it)."""
        twins, self.twins = self.twins, None
        down = streams.down(self.device)
        down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(down), NOTHING if timeline is None else timeline.span("copy", "write-back", where):
            for name, buf in self.parked().items():
                buf.copy_(twins[name], non_blocking=True)
            self._written = torch.cuda.Event()
            self._written.record(down)
        for twin in twins.values():
            twin.record_stream(down)
        _free(twins)

    def release(self) -> None:
        """The step is over: device copies still held (a step that did not update the bucket: skipped, refused, no
        gradient) are let go; the host buffers still hold the state."""
        twins, self.twins = self.twins, None
        _free(twins)

    def settle(self) -> None:
        """The host buffers hold the state, before the host reads or writes them (a checkpoint, ``opt.state``, a
        load): wait for a write-back still in flight, and let go of device copies brought up early (``step()``
        brings the state up again, as it then is)."""
        written, self._written = self._written, None
        if written is not None:
            written.synchronize()
        self.release()

    def _device_copy(self, name: str, buf: torch.Tensor) -> torch.Tensor:
        """Device memory for the copy of parked buffer ``name`` (``buf``), allocated on the current stream (the
        compute stream: :meth:`reload` makes it current; at ``step()`` it is): the storage of the tensor its last
        copy was given memory again, or, where there is none of its size and dtype (the first reload, a buffer laid
        out again), a new tensor, whose views are cut anew."""
        held = self._held.get(name)
        if held is not None and held.dtype == buf.dtype and held.numel() == buf.numel():
            storage, nbytes = held.untyped_storage(), buf.numel() * buf.element_size()
            if storage.nbytes() != nbytes:  # (resizing memory it holds would allocate anew and copy the old over)
                storage.resize_(nbytes)
            return held
        held = self._held[name] = torch.empty(buf.numel(), dtype=buf.dtype, device=self.device)
        self._cuts.pop(name, None)
        return held

    def _views(self, name: str, cut: Callable[[torch.Tensor], List[Any]], layout: Any = None) -> List[Any]:
        """``cut(twin)`` of the device copy ``name`` (up), cut once per tensor and ``layout`` (the views follow the
        storage into each reload's memory)."""
        twin = self.twins[name]
        cached = self._cuts.get(name)
        if cached is None or cached[0] is not twin or cached[1] is not layout:
            cached = self._cuts[name] = (twin, layout, cut(twin))
        return cached[2]

    # -- what one update reads and writes --------------------------------------------------------------------------
    def run_buffers(self, a: int, b: int, copies: Optional[Copies] = None
                    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """While stepped (reloaded): the device copies over elements ``[a, b)`` (the master: the parameters' own
        slots where it is not separate). Otherwise, or of ``copies``, as every home."""
        twins = self.twins
        if twins is None or copies is not None:
            return super().run_buffers(a, b, copies)
        master = twins["master"] if self.masters.separate else self.masters.master
        return master[a:b], {name: twins[name][a:b] for name in self.store.flat}, {}

    def run_shaped(self, first: int, last: int, copies: Optional[Copies] = None
                   ) -> Optional[List[Dict[str, torch.Tensor]]]:
        """While stepped (reloaded): views of the shaped buffer's device copy. Otherwise as every home."""
        twins = self.twins
        if twins is None or copies is not None or SHAPED not in twins:
            return super().run_shaped(first, last, copies)
        shaped = self.store.shaped
        return self._views(SHAPED, shaped.cut, shaped.places)[first:last + 1]

    def run_views(self, first: int, last: int) -> Dict[str, List[torch.Tensor]]:
        """While stepped (reloaded): views of the device copies, cut once per copy (see the module docstring).
        Otherwise as every home."""
        twins = self.twins
        if twins is None:
            return super().run_views(first, last)
        views = {name: self._views(name, self._cut)[first:last + 1] for name in self.store.flat}
        master = self._views("master", self._cut) if self.masters.separate else self.masters.master_views
        views["master"] = master[first:last + 1]
        return views

    def results(self) -> List[torch.Tensor]:
        """While stepped, a separate fp32 master's new values are in its device copy (until the write-back)."""
        masters = self.masters
        if self.twins is None or masters.low_precision or not masters.separate:
            return super().results()
        return self._views("master", self._cut)

    def refresh(self, indices: Sequence[int], into: Optional[List[torch.Tensor]] = None) -> None:
        """While stepped, a separate master taken from its changed parameter goes into its device copy (which the
        write-back then parks)."""
        if into is None and self.twins is not None and self.masters.separate:
            if self.masters.stale(indices):  # (the views only where a parameter changed: not every step)
                self.masters.refresh(indices, into=self._views("master", self._cut), record=True)
            return
        super().refresh(indices, into)

    def ensure(self, buffers: Sequence[StateBuffer]) -> List[str]:
        """As every home's; a buffer added while the state is up (amsgrad switched on) comes up too (zeros)."""
        added = super().ensure(buffers)
        if added and self.twins is not None:
            for name in added:
                if name in self.store.flat:
                    self.twins[name] = self._device_copy(name, self.store.flat[name]).zero_()
            if set(added) & set(self.store.shaped.names):  # (laid out again: its values come up as they are)
                flat = self.store.shaped.flat
                self.twins[SHAPED] = self._device_copy(SHAPED, flat).copy_(flat)
        return added


def _free(twins: Optional[Dict[str, torch.Tensor]]) -> None:
    """Give the device copies' memory back to the allocator (once the copies on the streams recorded on them have
    read it); their tensors, and the views cut of them, are kept for the next reload."""
    for twin in (twins or {}).values():
        twin.untyped_storage().resize_(0)
