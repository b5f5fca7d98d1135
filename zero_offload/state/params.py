"""The parameters' side of a bucket: the fp32 masters and whether each is current (the parameter's autograd
version when the optimizer last wrote it), the low-precision copy the update writes (``staging``), CPU parameters
bound to the slots the update writes, and what the parameters are uploaded from.

Where a parameter lives:

* fp32 on CPU: the parameter *is* its master slot (``p.data`` is rebound to the view); no separate master.
* bf16/fp16 on CPU: the parameter is its staging slot, which the update writes; the fp32 master is separate.
* on CUDA: the parameter stays where it is; the transport copies the master (fp32) or the staging copy back.
* on CUDA with the state on the device tier (``gpu_fraction``): as on CPU, in device memory ("resident").
* FSDP2's shards on a GPU stepped there (a resident or parked home): as on one GPU, the storage FSDP keeps for each
  shard moved into its slot on the GPU (:func:`zero_offload.fsdp2.bind_shard`): an fp32 shard is its own master, a
  bf16/fp16 one its staging slot, which the fused update writes and FSDP's all-gather reads. Where FSDP keeps a
  shard otherwise (no takeover), the fp32 master is separate (in the home's tier) and the update is copied into the
  shard on the GPU (the transport's FSDP2 device routes).
* sharded on CPU (or resident): the parameters are views of one full flat buffer ``flat_param``, whose rank's
  slice *is* the master (fp32) or the staging copy.
* FSDP2's shards on the host (a CPU mesh, or ``CPUOffloadPolicy``): as on CPU, the storage FSDP keeps for each
  shard moved into its slot (:func:`zero_offload.fsdp2.bind_shard`), so FSDP's all-gather reads what the update
  wrote; where FSDP keeps a shard otherwise, the parameter stays where it is and is written like a GPU one.

A separate master is (re)initialised from its parameter before the parameter's next update whenever the parameter
was changed outside the optimizer (its version counter moved) and no longer equals the master rounded to its
dtype: loading a model checkpoint after building the optimizer just works.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from zero_offload import apart, fsdp2
from zero_offload.state.layout import BucketLayout, ShardLayout, memory_order_flat, view_like
from zero_offload.state.seen import Seen
from zero_offload.state.tiers import Tier

__all__ = ["Masters"]

# A version never recorded: a master just loaded, to be checked against its parameter (Masters.loaded); -1: none yet.
_LOADED = -2


class Masters:
    """Masters, staging and parameter binding of one bucket.

    Args:
        params (Sequence[Tensor]): the bucket's parameters.
        layout (BucketLayout): the bucket's layout (the shard's when sharded); ``shard`` the cut, if any.
        tier (Tier): where the buffers live.
        shares_grad (bool): the update writes the low-precision parameter into the gradient buffer it reads (an
            unsharded low-precision CUDA bucket): no staging buffer.
        views (Callable[[Tensor], List[Tensor]]): cuts a flat buffer into per-parameter views.
        watch (Sequence[Tensor], optional): the tensors whose autograd versions tell a change made outside the
            optimizer, when not ``params`` themselves (FSDP2: the DTensor parameters, whose local shards the
            optimizer writes). Default: ``params``.
        bind (bool): CPU parameters may become views of their slots; False: they stay where they are (FSDP2's
            shards live in FSDP's storage) and are written like GPU parameters. Default: True.
        takeovers (Sequence, optional): FSDP2: FSDP's record of each shard (see :func:`zero_offload.fsdp2.takeover`),
            whose storage the slots take over (``watch`` the DTensor parameters): on the host, or on a GPU for a
            home stepped there; each slot has room for the shard's padding rows. Default: None.
        slots_tier (Tier, optional): where the buffer the parameters are bound to lives (the master, or the staging
            copy of low-precision parameters), when not ``tier``: page-locked host memory for the FSDP2 shards taken
            over with ``CPUOffloadPolicy(pin_memory=True)`` (FSDP copies them to the GPU); the GPU for a parked
            home's parameters, whose state is on the host. Default: None.
    """

    def __init__(self, params: Sequence[torch.Tensor], layout: BucketLayout, shard: Optional[ShardLayout],
                 tier: Tier, shares_grad: bool, views: Callable[[Optional[torch.Tensor]], Optional[List[torch.Tensor]]],
                 watch: Optional[Sequence[torch.Tensor]] = None, bind: bool = True,
                 takeovers: Optional[Sequence[Any]] = None, slots_tier: Optional[Tier] = None):
        self.params, self.shard, self.takeovers, self.layout = params, shard, takeovers, layout
        self.watch = params if watch is None else watch
        # Sharded: each parameter's shape and strides as built, which its pieces of the shard are cut by (in memory
        # order): data replaced with other ones, however many elements, would be read and written out of order.
        self.built = None if shard is None else [(p.shape, p.stride()) for p in params]
        slots = slots_tier or tier  # (the buffer the parameters are bound to: master, or staging if low precision)
        # The state lives with the parameters (a CPU model, FSDP2's shards taken over, or a GPU bucket stepped on its
        # GPU): the parameters are bound to the slots the update writes, and nothing is transferred. (Not FSDP2's
        # shards FSDP keeps otherwise, ``bind`` False: they stay in FSDP's storage, which its all-gather reads.)
        self.resident = takeovers is not None or (bind and (layout.device.type == "cpu" or not slots.host))
        # (The tier the parameters are bound to: on a GPU, the update runs there and the parameters are read there,
        # not on the host; pinned, FSDP copies its shards to the GPU from it.)
        self.slots = slots
        self.low_precision = layout.dtype != torch.float32
        self.separate = not (self.resident and not self.low_precision)
        n = layout.padded_numel
        self.flat_param: Optional[torch.Tensor] = None
        own = None
        if shard is not None and self.resident:
            self.flat_param = slots.zeros(shard.full.padded_numel, self.dtype)  # (a parked home's: on its GPU)
            self.param_views = [view_like(self.flat_param, o, p) for o, p in zip(shard.full.offsets, params)]
            own = self.flat_param[shard.lo : shard.lo + shard.numel]
        self.master = (own if (own is not None and not self.low_precision)
                       else (tier if self.low_precision or not self.resident else slots).zeros(n, torch.float32))
        self.staging: Optional[torch.Tensor] = None
        if self.low_precision and not shares_grad:
            self.staging = own if own is not None else slots.zeros(n, self.dtype)
        self.master_views = views(self.master)
        self.staging_views = views(self.staging)
        # Each parameter's autograd version right after the optimizer last wrote it (or initialised its master
        # from it); -1 = master not initialised. Unused when the parameter is its own master.
        self.versions = [-1] * len(params)
        # data_ptr of each of FSDP2's shards whose storage the slots took over (fsdp2.takeover_ptrs), once taken.
        self.slot_ptrs: List[Any] = []
        # What each parameter was when last bound to its slot (a CPU one, or one stepped on its GPU), or as it is
        # where it stays (a GPU one stepped on the host): a replacement (``p.data = ...``, ``vector_to_parameters``,
        # a view of the same storage with another shape or strides) moves no version counter, but changes this. Not
        # FSDP2's, whose shards FSDP shapes and re-makes.
        self.seen: Optional[Seen] = Seen(params, own_storage=not self.resident) if self.watch is params else None

    # (the layout's, as properties: one field for the three)
    offsets = property(lambda self: self.layout.offsets)
    device = property(lambda self: self.layout.device)
    dtype = property(lambda self: self.layout.dtype)

    @property
    def param_slots(self) -> Optional[List[torch.Tensor]]:
        """For CPU buckets, the views the parameters are bound to (master or staging, or ``flat_param``'s when
        sharded); None on CUDA."""
        if not self.resident:
            return None
        if self.shard is not None:
            return self.param_views
        return self.staging_views if self.low_precision else self.master_views

    def fill_param_slots(self) -> None:
        """Copy each CPU parameter's values into the slot it will be bound to (see :meth:`bind`; FSDP2's shards
        are copied as they are bound)."""
        for p, slot in zip(self.params, () if self.takeovers is not None else self.param_slots or ()):
            slot.copy_(p.detach())

    def bind(self) -> None:
        """Make CPU parameters views of the slots the kernel writes (after :meth:`fill_param_slots`, so the model
        is unchanged, and a later in-place load into a parameter lands in its slot). FSDP2: the storage FSDP
        keeps for each shard moves into its slot, and ``params`` take the new local shards."""
        if self.takeovers is not None:
            self._take(range(len(self.takeovers)))
        elif self.resident:
            for p, slot in zip(self.params, self.param_slots):
                p.data = slot
            apart.bound_to(self.param_slots)  # (their storage is no larger tensor of the user's)
            self.seen = Seen(self.params, own_storage=False)  # (the slots' storage is the bucket's)

    def check_in_place(self) -> None:
        """Follow, or refuse, parameters that no longer live where the optimizer put them (see
        :mod:`~zero_offload.state.seen`). C-level loops on the hot path."""
        params = self.params
        if self.takeovers is not None:
            now = fsdp2.takeover_ptrs(self.watch, self.takeovers)
            if now != self.slot_ptrs:
                self._retake([i for i, (a, b) in enumerate(zip(now, self.slot_ptrs)) if a != b])
            return
        if self.seen is None:  # FSDP2's shards left in FSDP's storage: follow storage FSDP re-made
            now = fsdp2.local_ptrs(self.watch)
            if now != list(map(torch.Tensor.data_ptr, params)):
                self._follow([i for i, (a, p) in enumerate(zip(now, params)) if a != p.data_ptr()])
        else:
            changed = self.seen.changed(params)
            if changed:
                (self._rebind if self.resident else self._replaced)(changed)
            if self.resident:
                return
        dtype, device = self.dtype, self.device
        if any(p.dtype != dtype or p.device != device for p in params):
            self._refuse(next(i for i, p in enumerate(params) if p.dtype != dtype or p.device != device), None)

    def _rebind(self, indices: Sequence[int]) -> None:
        """Parameters whose data was replaced (``p.data = ...``, ``model.to()`` onto the device they are on, which
        copies; a view of their slot with other strides, ``p.data = p.data.t()`` of a square matrix): as AdamW
        follows the ``Parameter``, the new values are copied into the slots and the parameters bound to them again,
        their state kept (a separate master is then checked against its parameter at its next update, as a loaded
        one is). A move or a cast is refused, naming it, with nothing rebound."""
        slots = self.param_slots
        for i in indices:
            p = self.params[i]
            if p.dtype != self.dtype or p.device != self.device or p.shape != slots[i].shape:
                self._refuse(i, slots[i].shape)
        for i in indices:
            p, slot = self.params[i], slots[i]
            value = p.detach()
            if value.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr():
                value = value.clone()  # (a view of the slot itself: copied over itself, it would be read as written)
            slot.copy_(value)
            p.data = slot
            self.seen.take(i, p)
            self.loaded(i, True)

    def _replaced(self, indices: Sequence[int]) -> None:
        """Parameters that stay where they are (a GPU one stepped on the host) whose data was replaced (``p.data =
        ...``, which moves no version counter; new storage given the old one's address too; strides changed over the
        same storage): as AdamW follows the ``Parameter``, each separate master is checked against its parameter at
        its next update, as a loaded one is (kept where it rounds to it, else taken from it). A move, a cast or
        another shape (also over the same storage: ``p.data = p.data[:n]``) is refused, naming it, with nothing
        followed; sharded, other strides too (the shard's pieces are cut by them)."""
        shapes = self.seen.shapes
        for i in indices:
            p = self.params[i]
            strides = None if self.built is None else self.built[i][1]
            if p.dtype != self.dtype or p.device != self.device or p.shape != shapes[i] \
                    or strides is not None and p.stride() != strides:
                self._refuse(i, shapes[i], strides=strides)
        for i in indices:
            self.seen.take(i, self.params[i])
            self.loaded(i, True)

    def _follow(self, indices: Sequence[int]) -> None:
        """FSDP2 re-made the storage of the shards ``indices``, which the optimizer writes where FSDP keeps them:
        the new local shards are written from now on (their separate masters checked against them at their next
        update, as loaded ones are). A shard now of another dtype, device or shape is refused, naming it, with
        nothing followed."""
        new = {i: fsdp2.local_shard(self.watch[i]) for i in indices}
        for i, t in new.items():
            if t.dtype != self.dtype or t.device != self.device or t.shape != self.params[i].shape:
                self._refuse(i, self.params[i].shape, t)
        for i, t in new.items():
            self.params[i] = t
            self.loaded(i, True)

    def _retake(self, indices: Sequence[int]) -> None:
        """FSDP2 re-made the storage of the shards ``indices`` after the optimizer took it over (``model.to()``
        onto the device they are on, which copies; ``load_state_dict(assign=True)``): as :meth:`_rebind`, the
        new values move into the slots, which FSDP keeps again, the state kept (a separate master checked against
        its parameter at its next update, as a loaded one is). A shard FSDP now keeps in another dtype, on another
        device or of another size is refused, naming it, with nothing taken."""
        flat = self.staging if self.low_precision else self.master
        for i in indices:
            record, owner = self.takeovers[i], self.watch[i]
            data = record._sharded_param_data
            if (fsdp2.takeover(owner, record) is None or data.dtype != self.dtype or data.device != flat.device
                    or data.numel() != fsdp2.takeover_numel(record)):
                raise RuntimeError(
                    f"OffloadOptimizer: FSDP2 re-made the storage of the shard of a parameter of shape "
                    f"{tuple(owner.shape)} after the optimizer took it over, as {data.dtype} on {data.device} (it was "
                    f"{self.dtype} on {self.device}; model.to(...), another OffloadOptimizer built over the same "
                    "parameters, ...): the optimizer would update storage FSDP no longer reads. Build the optimizer "
                    "after such changes to the model (storage re-made with the same dtype, device and size is "
                    "followed).")
        self._take(indices)
        for i in indices:
            self.loaded(i, True)

    def _take(self, indices: Sequence[int]) -> None:
        """FSDP2: the storage FSDP keeps for the shards ``indices`` moves into their slots (the staging buffer of
        low-precision shards, else the master), and ``params`` take the new local shards."""
        flat = self.staging if self.low_precision else self.master
        for i in indices:
            room = flat[self.offsets[i] : self.offsets[i] + fsdp2.takeover_numel(self.takeovers[i])]
            self.params[i] = fsdp2.bind_shard(self.watch[i], self.takeovers[i], room, self.slots.pinned)
        self.slot_ptrs = fsdp2.takeover_ptrs(self.watch, self.takeovers)

    def _refuse(self, i: int, shape: Optional[torch.Size], now: Optional[torch.Tensor] = None,
                strides: Optional[Tuple[int, ...]] = None) -> None:
        """Parameter ``i`` moved, cast or reshaped since the optimizer was built (``shape``, ``strides``: its shape
        and strides then, where known; ``now``: what it is now, where not ``params[i]``); named by its whole shape
        (FSDP2: the DTensor's, not the shard's)."""
        p = self.params[i] if now is None else now
        was, now = f"{self.dtype} on {self.device}", f"{p.dtype} on {p.device}"
        if strides is not None and shape == p.shape and strides != p.stride():
            was = f"{tuple(shape)} with strides {strides} {was}"
            now = f"{tuple(p.shape)} with strides {p.stride()} {now}"
        elif shape is not None and shape != p.shape:
            was, now = f"{tuple(shape)} {was}", f"{tuple(p.shape)} {now}"
        whole = self.watch[i].shape if self.seen is None else self.seen.shapes[i]  # (FSDP2: the DTensor's)
        raise RuntimeError(
            f"OffloadOptimizer: a parameter's data was moved, cast or reshaped after the optimizer was built: it was "
            f"{was}, it is now {now} (a parameter of shape {tuple(whole)}; `model.to(...)`, "
            "`p.data = ...`, ...). The optimizer's state lives with the "
            "parameters where it was built: move or cast the model first, then build the optimizer (data replaced "
            "on the parameter's own device, dtype and shape, and strides where sharded, is followed, as AdamW follows "
            "it).")

    def loaded(self, i: int, loaded: bool) -> None:
        """A separate master was just written from a checkpoint, or not (``loaded=False``: taken from the parameter
        at its next update). A loaded one is checked at the next update, whatever the parameter's version: kept if
        it rounds to the parameter then (a model checkpoint loaded before or after this one, from the same step),
        else replaced by it (it was not this parameter's: e.g. the master a partial DCP load of an AdamW checkpoint,
        which has none, left as it was)."""
        if self.separate:
            self.versions[i] = _LOADED if loaded else -1

    def record_versions(self, indices: Sequence[int]) -> None:
        if self.separate:
            watch = self.watch
            for i in indices:
                self.versions[i] = fsdp2.version(watch[i])

    def refresh(self, indices: Sequence[int], into: Optional[List[torch.Tensor]] = None,
                record: Optional[bool] = None) -> None:
        """(Re)initialise the separate masters of ``indices`` whose parameter changed since the optimizer last
        wrote it. Each rank decides for its own pieces, with no collective. ``into``: per-parameter tensors to
        refresh instead of the masters (copies, on the parameters' device: the bucket left as it is, unless
        ``record``, default False there: the parameters' versions are recorded, as where the copies become the
        masters)."""
        stale = self.stale(indices)
        if not stale:
            return
        for i, value in zip(stale, self._values(stale)):
            master = self.master_views[i] if into is None else into[i]
            # A parameter rewritten with the value it already had (a model checkpoint loaded alongside this
            # optimizer's) keeps the fp32 master's extra bits; any other value replaces the master.
            if value is not None and (self.versions[i] == -1 or not torch.equal(master.to(self.dtype), value)):
                master.copy_(value)
            if into is None or record:
                self.versions[i] = fsdp2.version(self.watch[i])

    def stale(self, indices: Sequence[int]) -> List[int]:
        """Those of ``indices`` whose separate master is out of date: their parameter changed since the optimizer
        last wrote it (none where the parameters are their own masters)."""
        if not self.separate:
            return []
        return [i for i in indices if fsdp2.version(self.watch[i]) != self.versions[i]]

    def _values(self, stale: Sequence[int]) -> List[Optional[torch.Tensor]]:
        """The host values of the parameters ``stale`` (their pieces when sharded; None for an empty piece)."""
        if self.shard is not None:
            return [self._piece_value(i) for i in stale]
        # (host parameters not bound to their slots, FSDP2's; or read where a GPU-stepped home updates them)
        if self.resident or self.device.type == "cpu" or not self.slots.host:
            return [self.params[i].detach() for i in stale]
        # The parameter's bits land in its own-dtype host slot first (staging for low precision, else the master),
        # in one batch of async copies and one wait; the upcast to the fp32 master then runs on the host. Into a
        # scratch copy when the master may be kept: it is compared before being overwritten.
        # (Never into a gradient slot that carries parameters out: it holds this step's gradient.)
        landing = self.staging_views if self.low_precision else self.master_views
        host = [landing[i] if self.versions[i] == -1 and landing is not None
                else torch.empty_like(self.master_views[i], dtype=self.dtype) for i in stale]
        torch._foreach_copy_(host, [self.params[i].detach() for i in stale], non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def _piece_value(self, i: int) -> Optional[torch.Tensor]:
        a, b = self.shard.pieces[i]
        if b <= a:
            return None
        if self.resident:
            return self.staging_views[i]  # the parameter's own storage
        src = self.shard.piece_src[i]
        return memory_order_flat(self.params[i].detach())[src : src + b - a].to("cpu")
