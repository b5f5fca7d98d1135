"""A bucket: a run of parameters of one parameter group that share a device and a dtype, laid out in aligned flat
buffers (:mod:`zero_offload.state.layout`), and the composition of what lives there: its state, in a home
(:mod:`zero_offload.state.home`), and its gradient slots (:class:`~zero_offload.grads.GradSlots`).
Also: planning a group's buckets, estimating their host RAM from the same declarations, and allocating them.

The per-parameter optimizer state PyTorch exposes is views of the buffers' slots, shaped and strided like the
parameter, so ``state_dict()`` has the wrapped optimizer's format without a copy (moving bytes in and out is
:mod:`zero_offload.transport`'s job).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

import torch

from zero_offload import affinity, fsdp2
from zero_offload.apart import warn_live_views
from zero_offload.grads import GradSlots, check_grads
from zero_offload.home_costs import bucket_cost
from zero_offload.host_memory import (HostMemoryEstimate, available_host_bytes, env_flag, estimate_bucket, format_bytes,
                                      huge_pages_on)
from zero_offload.options import Options
from zero_offload.rules.adamw import ADAMW
from zero_offload.rules.base import Rule, StateBuffer
from zero_offload.state.layout import (ALIGN, BucketLayout, ShardLayout, align_up, memory_order_flat, plan_buckets,
                                       view_like)
from zero_offload.state.device_home import DeviceHome
from zero_offload.state.home import Home
from zero_offload.state.host_home import HostHome
from zero_offload.state.parked_home import ParkedHome
from zero_offload.state.store import state_bytes
from zero_offload.state.tiers import HostTier, should_pin

__all__ = ["ALIGN", "BucketLayout", "FlatBucket", "HOMES", "Placement", "ShardLayout", "allocate_group", "align_up",
           "check_grads", "estimate_layouts", "home_plan", "memory_order_flat", "plan_buckets",
           "plan_local", "should_pin", "view_like"]

logger = logging.getLogger("zero_offload")

# Where a bucket's state can live, by the name placement gives it (see FlatBucket's ``home``).
HOMES = {"host": HostHome, "resident": DeviceHome, "parked": ParkedHome}


def estimate_layouts(layouts: Sequence[BucketLayout], buffers: Sequence[StateBuffer], options: Options,
                     world_size: int = 1, rule: Rule = ADAMW, takeovers: Optional[Sequence[Any]] = None,
                     homes: Optional[Sequence[str]] = None) -> HostMemoryEstimate:
    """Host bytes of the buckets ``layouts`` would allocate with the state ``buffers`` of ``rule`` and ``options``
    (their ``pin_memory``, ``delayed_update`` and ``state_dtype``), per rank when sharded over ``world_size``,
    without allocating: the same declarations as the real buckets'. ``takeovers``: the layouts are of FSDP2's local
    shards, with each one's :func:`zero_offload.fsdp2.takeover` (see :class:`Placement`): a bucket on the host has
    no gradient buffer until one is needed (FSDP's gradients are read where they are), and the slots that take over
    shards FSDP pins are pinned. ``homes``: each layout's home (:func:`home_plan`; default: all on the host); a
    resident one holds no host bytes, a parked one its state only. A GPU home takes the storage of FSDP2's shards
    over, as the host's does (the planner, which has no records, counts it so); where it cannot (a record None),
    the shards are written by copies: a master of their own (fp32) or a staging copy on the GPU (bf16/fp16),
    :func:`~zero_offload.home_costs.bucket_cost`'s ``copied``."""
    total = HostMemoryEstimate(0, 0, {}, 0, 0)
    for layout, home in zip(layouts, homes or ["host"] * len(layouts)):
        padded = layout.padded_numel if world_size == 1 else align_up(layout.padded_numel, ALIGN * world_size)
        state = state_bytes(buffers, options.state_dtype, padded // world_size, rule.buffers)
        on_cpu = layout.device.type == "cpu"
        copied = takeovers is not None and takes_over(layout, home) and bucket_takeovers(layout, takeovers) is None
        total = total + _estimate(home, layout.numel, padded, layout.dtype, on_cpu=on_cpu, state=state,
                                  pin=should_pin(layout.device, options.pin_memory), world_size=world_size,
                                  delayed_update=bool(options.delayed_update),
                                  grad_buffer=takeovers is None or not on_cpu, copied=copied,
                                  pinned_takeover=on_cpu and _pins_takeover(bucket_takeovers(layout, takeovers)))
    return total


def _estimate(home: str, numel: int, padded_numel: int, dtype: torch.dtype, *, on_cpu: bool, state: Dict[str, int],
              pin: bool, world_size: int, delayed_update: bool, grad_buffer: bool, copied: bool,
              pinned_takeover: bool) -> HostMemoryEstimate:
    """One bucket's host bytes in ``home`` (a resident one holds none: its state is in the GPU's memory), with
    what the home costs (:func:`~zero_offload.home_costs.bucket_cost`): the estimate before building
    (:func:`estimate_layouts`) and a built bucket's (:meth:`FlatBucket.estimate`) alike."""
    if home == "resident":
        held = HostMemoryEstimate(numel, 0, {}, 0, 0)
    else:
        held = estimate_bucket(numel, padded_numel, dtype, on_cpu=on_cpu, state=state, pin=pin, world_size=world_size,
                               delayed_update=delayed_update, grad_buffer=grad_buffer, parked=home == "parked",
                               copied=copied)
        held = _pinned_takeover(held, dtype != torch.float32) if pinned_takeover else held
    cost = bucket_cost(home, numel, padded_numel, dtype, on_cpu=on_cpu, state=state, world_size=world_size,
                       host_bytes=held.total_bytes, copied=copied)
    return dataclasses.replace(held, homes={home: cost})


class FlatBucket:
    """One bucket: a run of parameters laid out in aligned flat buffers, and the composition of what lives there:
    its state, in its :attr:`home` (the rule's buffers in ``state_dtype``, the fp32 masters and low-precision
    ``staging``, the step counts, the entries ``opt.state`` shows: see :mod:`zero_offload.state.home`) and its
    gradient slots (:attr:`grads`).

    **Sharded** (``shard`` given, see :class:`ShardLayout`): every buffer holds this rank's shard only, ``layout``
    is the shard's, and per-parameter views are 1-D pieces; the kernel's gradient multiplier carries the 1/world of
    the average.

    Args:
        layout (BucketLayout): the bucket as :func:`plan_buckets` made it.
        params (Sequence[Tensor]): the group's parameters.
        rule (Rule): the update rule; ``buffers`` the state buffers it allocates now (``rule.needed(hyper)``).
        pin (bool): page-lock the buffers (those that take part in device copies).
        shard (ShardLayout, optional): this rank's cut of the bucket.
        grads_reduced (bool): sharded, the gradients arrive averaged already (no 1/world in the multiplier).
        where (str): "param group G, bucket B", for error messages.
        state_dtype (torch.dtype): the state's codec, ``torch.float32``, ``torch.bfloat16`` or ``torch.int8``
            (8-bit block-wise). Default: ``torch.float32``.
        group (int): the param group's index, and ``names`` (optional) its ``param_names``: error messages name
            a parameter by both.
        home (str): where the state lives (:data:`HOMES`): ``"host"``, stepped there; ``"resident"``, in the GPU's
            memory (``gpu_fraction``); ``"parked"``, on the host between steps and stepped on the GPU. Default:
            ``"host"``.
        owners (Sequence[Tensor], optional): FSDP2: the group's DTensor parameters, whose local shards ``params``
            are; ``takeovers`` each one's record where its slot takes over the shard's storage
            (:func:`zero_offload.fsdp2.takeover`).
    """

    def __init__(self, layout: BucketLayout, params: Sequence[torch.Tensor], *, rule: Rule = ADAMW,
                 buffers: Optional[Sequence[StateBuffer]] = None, pin: bool, shard: Optional[ShardLayout] = None,
                 grads_reduced: bool = False, where: str = "", state_dtype: torch.dtype = torch.float32,
                 group: int = 0, names: Optional[Sequence[str]] = None, home: str = "host",
                 owners: Optional[Sequence[torch.Tensor]] = None, takeovers: Optional[Sequence[Any]] = None):
        self.shard, self.where, self.group, self.rule = shard, where, group, rule
        self.names = None if not names else [names[i] for i in layout.indices]
        self.params: List[torch.Tensor] = [params[i] for i in layout.indices]
        # The tensors users see (the keys of opt.state, whose .grad and hooks the optimizer reads): the parameters
        # themselves, or FSDP2's DTensor parameters, whose local shards ``params`` then are (zero_offload.fsdp2).
        self.owners: List[torch.Tensor] = self.params if owners is None else [owners[i] for i in layout.indices]
        self.device, self.dtype = layout.device, layout.dtype
        self.low_precision = layout.dtype != torch.float32
        on_cpu = layout.device.type == "cpu"
        # FSDP's records of the shards whose storage a home on the parameters' side (the host's, or a GPU home)
        # takes over; kept for a move into a GPU home (rehome).
        self.records = bucket_takeovers(layout, takeovers)
        takeovers = self.records if takes_over(layout, home) else None
        # The state lives with the parameters: a CPU bucket (FSDP2's host shards where their storage is taken over),
        # or a GPU bucket stepped on its GPU (its home resident there, or parked and brought up for the step): no
        # transfers of parameters or gradients, the parameters bound to the slots the update writes.
        self.resident = (on_cpu and (owners is None or takeovers is not None)) or home != "host"
        # A low-precision CUDA bucket, unsharded: the kernel reads each gradient and writes the rounded parameter
        # into the same slot, which the upload then reads (2 B/param less than a separate staging buffer). The
        # transport orders the next gradient copies into the buffer after that upload. A CPU parameter *is* its
        # staging slot, and a sharded bucket all-gathers from its staging shard: those keep one.
        self.shares_grad = self.low_precision and not self.resident and shard is None
        # (nothing of a sharded CPU bucket, or of a resident one, goes through host memory to a GPU)
        self.pin = pin and not (shard is not None and on_cpu) and home != "resident"
        self.takeover_pinned = on_cpu and _pins_takeover(takeovers)
        # Multiplies the gradient in the kernel, on top of the loss-scale inverse and clip coefficient.
        self.grad_multiplier = 1.0 if shard is None or grads_reduced else 1.0 / shard.world
        self.layout = layout if shard is None else shard.local
        self.home: Home = self._home(HOMES[home], rule.needed(rule.hyper(rule.defaults)) if buffers is None else buffers,
                                     state_dtype, self.pin, self.shares_grad, takeovers)
        self.grads = self._grads(self.home, self.resident, lazy=self.fsdp and on_cpu)

    def _home(self, kind: type, buffers: Sequence[StateBuffer], state_dtype: torch.dtype, pin: bool,
              shares_grad: bool, takeovers: Optional[Sequence[Any]] = None) -> Home:
        """A home of ``kind`` for this bucket's state (its slots cut as the bucket cuts them)."""
        return kind(self.device, pin, rule=self.rule, buffers=buffers, state_dtype=state_dtype,
                    params=self.params, owners=self.owners, layout=self.layout, shard=self.shard, views=self._views,
                    bind=not self.fsdp, shares_grad=shares_grad, placed=self.owners if self.fsdp else None,
                    takeovers=takeovers,
                    slots_tier=HostTier(True) if takeovers is not None and self.takeover_pinned else None)

    def _grads(self, home: Home, resident: bool, lazy: bool = False) -> GradSlots:
        """The gradient slots, in ``home``'s :attr:`~zero_offload.state.home.Home.grads_tier` (``resident``: the
        state lives with the parameters). Sharded, a CPU bucket's full flat gradient buffer (``flat_grad``, which
        ``zero_grad(set_to_none=False)`` makes the gradients views of) is kept; a GPU bucket's reduce-scatter reads a
        transient one (:class:`~zero_offload.transport.sharded.ShardedDeviceRoute`)."""
        gather_full = self.shard is not None and resident and home.grads_tier.host
        return GradSlots(self.params, [p.shape for p in self.params], self.layout, self.full,
                         None if self.shard is None else self.shard.pieces, gather_full, home.grads_tier,
                         self.shaped_label, lazy=lazy)

    def rehome(self, kind: str) -> None:
        """Move the bucket's state into a home of ``kind`` (``"resident"`` or ``"parked"``: stepped on its GPU),
        between steps (``gpu_fraction="auto"``, ``placement="auto"``): the same masters, buffers, step counts and
        entries' flags, the parameters bound to their new slots (see :meth:`Home.take_over`). The caller has waited
        for every copy in flight; it shows the new entries, and stops streaming the bucket's gradients where its new
        route has no work for backward's hooks. An allocation failure leaves the bucket as it was."""
        pin = self.pin and kind != "resident"
        home = self._home(HOMES[kind], [self.home.declared[n] for n in self.home.names], self.state_dtype, pin, False,
                          self.records)
        grads = self._grads(home, True)
        home.take_over(self.home)
        self.home, self.grads = home, grads
        self.resident, self.shares_grad, self.pin = True, False, pin

    def device_cost(self) -> int:
        """Device bytes :meth:`rehome` into a GPU home would add (see :meth:`device_bytes`): a resident home's
        :func:`~zero_offload.home_costs.bucket_cost` (FSDP2's shards whose storage it could not take over are
        ``copied``: an fp32 master of their own, a low-precision one's staging copy)."""
        world = 1 if self.shard is None else self.shard.world
        return bucket_cost("resident", self.full.numel, self.full.padded_numel, self.dtype, on_cpu=False,
                           state=self.home.nbytes(), world_size=world,
                           copied=self.fsdp and self.records is None).gpu_bytes

    def device_grad_cost(self) -> int:
        """Of :meth:`device_cost`, what is not state (what a parked bucket does not move): sharded, the rank's shard
        of the reduced gradients, held on the GPU from the step's first reduce-scatter to its end."""
        return self.layout.padded_numel * self.dtype.itemsize if self.shard is not None else 0

    def _views(self, flat: Optional[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        if flat is None:
            return None
        if self.shard is not None:
            return [flat[a:b] for a, b in self.shard.pieces]
        return self.slot_views(flat)

    def slot_views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Each parameter's slot of ``flat``, a buffer in this bucket's layout, as :func:`view_like` cuts it: one
        ``as_strided`` each, from the slots' shapes, strides and offsets, read once."""
        base = flat.storage_offset()
        return [flat.as_strided(shape, stride, base + o) for shape, stride, o in self._slot_geometry]

    @functools.cached_property
    def _slot_geometry(self) -> List[Tuple[torch.Size, Tuple[int, ...], int]]:
        probe = torch.empty(self.layout.padded_numel, device="meta")
        cuts = (view_like(probe, o, p) for o, p in zip(self.layout.offsets, self.params))
        return [(v.shape, v.stride(), v.storage_offset()) for v in cuts]

    # -- the parts, by the names the other modules read ----------------------------------------------------------
    sharded = property(lambda self: self.shard is not None)
    on_cpu = property(lambda self: self.device.type == "cpu")
    fsdp = property(lambda self: self.owners is not self.params)  # FSDP2's local shards (see the constructor)
    # FSDP2's shards on a GPU stepped there whose storage is not the home's: each update copied into them
    copied = property(lambda self: self.fsdp and not self.on_cpu and self.home.on_device
                      and self.masters.takeovers is None)
    device_tier = property(lambda self: self.home.kind == "resident")  # its state in its GPU's memory
    masters = property(lambda self: self.home.masters)
    store = property(lambda self: self.home.store)
    views = property(lambda self: self.home.views)
    steps = property(lambda self: self.home.store.steps)
    state_dtype = property(lambda self: self.home.store.state_dtype)
    compact = property(lambda self: self.home.store.compact)
    shapes = property(lambda self: self.grads.shapes)
    master = property(lambda self: self.masters.master)
    master_views = property(lambda self: self.masters.master_views)
    staging = property(lambda self: self.masters.staging)
    staging_views = property(lambda self: self.masters.staging_views)
    flat_param = property(lambda self: self.masters.flat_param)
    versions = property(lambda self: self.masters.versions)
    separate_master = property(lambda self: self.masters.separate)
    grad = property(lambda self: self.grads.grad)
    grad_views = property(lambda self: self.grads.grad_views)
    grad_prev = property(lambda self: self.grads.grad_prev)
    flat_grad = property(lambda self: self.grads.flat_grad)
    grad_slot_zero = property(lambda self: self.grads.zero)
    exposed = property(lambda self: self.views.exposed)
    all_exposed = property(lambda self: self.views.all_exposed)

    @property
    def full(self) -> BucketLayout:
        """The whole bucket's layout (the shard's full layout when sharded)."""
        return self.layout if self.shard is None else self.shard.full

    def label(self, i: int) -> str:
        """Parameter ``i`` as error messages name it: its group, index in the group and name (where given)."""
        name = f" ({self.names[i]!r})" if self.names else ""
        return f"param group {self.group}, parameter {self.layout.indices[i]}{name}"

    def shaped_label(self, i: int) -> str:
        """:meth:`label` with the parameter's whole shape (an FSDP2 parameter's, as every rank's errors give it),
        and this rank's local shard's besides."""
        whole, local = tuple(self.owners[i].shape), tuple(self.params[i].shape)
        shard = f" (this rank's shard: {local})" if self.fsdp else ""
        return f"{self.label(i)} of shape {whole}{shard}"

    def collect_grads(self) -> List[Optional[torch.Tensor]]:
        """Each parameter's ``.grad``, checked (see :meth:`GradSlots.collect`), once the parameters are checked
        to still live where the optimizer put them."""
        self.masters.check_in_place()
        return self.grads.collect()

    # -- what the update writes and the upload reads -------------------------------------------------------------
    def param_out(self, flat_grad: torch.Tensor, a: int, b: int) -> Optional[torch.Tensor]:
        """Where the kernel writes the low-precision parameter of elements ``[a, b)`` (None: fp32, the master is
        the result): the staging buffer, or with :attr:`shares_grad` the gradient buffer it reads."""
        if self.staging is not None:
            return self.staging[a:b]
        return flat_grad[a:b] if self.shares_grad else None

    @property
    def upload_views(self) -> List[torch.Tensor]:
        """What the parameters are uploaded from after an update: the master (fp32), the staging copy, or with
        :attr:`shares_grad` the gradient buffer the kernel last wrote (``delayed_update``'s second buffer, which
        its updates read and its uploads follow before the buffers are swapped)."""
        if not self.low_precision:
            return self.master_views
        if not self.shares_grad:
            return self.staging_views
        return self.grads.prev_views if self.grad_prev is not None else self.grad_views

    @property
    def upload_flat(self) -> torch.Tensor:
        """The flat buffer behind :attr:`upload_views` (in the bucket's layout)."""
        if not self.low_precision:
            return self.master
        if not self.shares_grad:
            return self.staging
        return self.grad_prev if self.grad_prev is not None else self.grad

    def runs(self, present: Sequence[bool]) -> List[Tuple[int, int, int]]:
        """Contiguous runs ``(first, last, step)`` of parameters that have a gradient (``present``) and the same step
        count: each is one kernel call. Usually one run covering the whole bucket."""
        steps = self.steps.tolist()
        if all(present) and min(steps) == max(steps):
            return [(0, len(present) - 1, int(steps[0]))]
        out: List[Tuple[int, int, int]] = []
        first = None
        for i, has in enumerate(present):
            if first is not None and (not has or steps[i] != steps[first]):
                out.append((first, i - 1, int(steps[first])))
                first = None
            if has and first is None:
                first = i
        if first is not None:
            out.append((first, len(present) - 1, int(steps[first])))
        return out

    def count_steps(self, runs: Sequence[Tuple[int, int, int]]) -> Sequence[int]:
        """One more step for the parameters of ``runs`` (see :meth:`runs`); returns those parameters."""
        steps = self.steps
        if len(runs) == 1 and runs[0][0] == 0 and runs[0][1] == len(self.params) - 1:
            steps += 1
            return range(len(self.params))
        for first, last, _ in runs:
            steps[first : last + 1] += 1
        return [i for first, last, _ in runs for i in range(first, last + 1)]

    # -- memory --------------------------------------------------------------------------------------------------
    def ensure_buffers(self, buffers: Sequence[StateBuffer]) -> List[str]:
        """Allocate those of the rule's ``buffers`` the bucket lacks (a group switched amsgrad on); their names."""
        return self.home.ensure(buffers)

    def device_bytes(self) -> Dict[str, int]:
        """Device memory a GPU home holds now beyond the parameters', by buffer (empty for a host bucket): the
        rule's state and a separate fp32 master (low-precision parameters, FSDP2's shards not taken over), always
        where resident, from reload to write-back where parked
        (:meth:`~zero_offload.state.home.Home.device_tensors`); gradient buffers made (sharded: the rank's shard of
        the reduced gradients, from the step's first reduce-scatter to its end). The parameters' own storage becomes
        the master (fp32) or staging slots and is not counted (FSDP2's shards whose storage the home could not take
        over stay in FSDP's: their staging copy is counted)."""
        if not self.home.on_device:
            return {}
        held = self.home.device_tensors()
        if self.staging is not None and not self.masters.resident:  # (the shard is FSDP's storage, not a slot)
            held["staging"] = self.staging
        if self.grads.allocated:
            held["grad"] = self.grad
        if self.flat_grad is not None:
            held["flat_grad"] = self.flat_grad
        return {name: t.numel() * t.element_size() for name, t in held.items()}

    def estimate(self) -> HostMemoryEstimate:
        """The host RAM this bucket holds, and what its home costs (:class:`~zero_offload.home_costs.HomeCost`)."""
        return _estimate(self.home.kind, self.full.numel, self.full.padded_numel, self.dtype, on_cpu=self.on_cpu,
                         state=self.home.nbytes(), pin=self.pin,
                         world_size=1 if self.shard is None else self.shard.world,
                         delayed_update=self.grad_prev is not None, grad_buffer=self.grads.allocated,
                         copied=self.copied, pinned_takeover=self.takeover_pinned)

    def buffers(self) -> Dict[str, torch.Tensor]:
        out = {"master": self.master, **self.home.tensors()}
        if self.grads.allocated:
            out["grad"] = self.grad
        if self.staging is not None:
            out["staging"] = self.staging
        if self.grad_prev is not None:
            out["grad_prev"] = self.grad_prev
        if self.shard is not None and self.flat_grad is not None:
            out["flat_grad"] = self.flat_grad
            out["flat_param"] = self.flat_param
        return out


class Placement(NamedTuple):
    """How a param group's buckets are laid out, as its topology places them (``Topology.place``): this rank's
    ``cut`` of every bucket (``(world, rank)``; None: whole), the tensors the buckets hold (``data``: FSDP2's local
    shards, the group's parameters their owners; None: the parameters themselves), each one's unit (``units``: its
    FSDP unit, at whose boundaries buckets are cut), and ``takeovers``: each one's record where its slot takes over
    the storage of the tensor it holds (:func:`zero_offload.fsdp2.takeover`; the slot then has room for FSDP's
    padding rows too); ``live_views``: the ids of parameters that view a larger tensor still alive
    (:mod:`zero_offload.apart`)."""

    cut: Optional[Tuple[int, int]] = None
    data: Optional[List[torch.Tensor]] = None
    units: Optional[List[int]] = None
    takeovers: Optional[List[Any]] = None
    live_views: FrozenSet[int] = frozenset()


OVERCOMMIT_ENV = "ZERO_OFFLOAD_ALLOW_OVERCOMMIT"


def allow_overcommit() -> bool:
    """``ZERO_OFFLOAD_ALLOW_OVERCOMMIT`` as a boolean (:func:`~zero_offload.host_memory.env_flag`; unset: off): a
    typo raises rather than silently decide whether the out-of-memory guard runs."""
    return env_flag(OVERCOMMIT_ENV, False, "allocate even beyond the host RAM this process can take",
                    "refuse with a MemoryError")


class _Room:
    """Host RAM for one param group's buckets: the check before allocating them, and the ``MemoryError`` (with the
    numbers, and what smaller setups would need) when they do not fit, or when allocating them failed anyway (an
    address-space limit met part way, memory taken meanwhile by another process)."""

    def __init__(self, layouts: Sequence[BucketLayout], homes: Sequence[str], gi: int, buffers: Sequence[StateBuffer],
                 options: Options, world: int, rule: Rule, takeovers: Optional[Sequence[Any]] = None):
        self.layouts, self.gi, self.buffers, self.options, self.world, self.rule = (layouts, gi, buffers, options,
                                                                                    world, rule)
        self.homes, self.takeovers = homes, takeovers  # (each layout's home; FSDP2's: see estimate_layouts)

    def estimate(self, buffers: Optional[Sequence[StateBuffer]] = None, world: Optional[int] = None,
                 **changes: Any) -> HostMemoryEstimate:
        """The group's estimate, or with other ``buffers``, ``world`` or options (``changes``, by name)."""
        options = dataclasses.replace(self.options, **changes) if changes else self.options
        return estimate_layouts(self.layouts, self.buffers if buffers is None else buffers, options,
                                self.world if world is None else world, self.rule, self.takeovers, self.homes)

    def check(self) -> None:
        """Refuse, before allocating anything, buckets that cannot fit in the host RAM this process can still take:
        the kernel's OOM killer would end the process instead, with nothing said. The peak is the whole estimate, as
        a CPU parameter's own storage is freed only once its buckets are filled. ``ZERO_OFFLOAD_ALLOW_OVERCOMMIT=1``
        turns the error into a warning (swap, or memory about to be freed elsewhere)."""
        allow = allow_overcommit()  # (read first: a bad value is an error whether or not the buckets fit)
        huge_pages_on()  # (the same for ZERO_OFFLOAD_HUGE_PAGES, whether or not a buffer is large enough)
        affinity.check()  # (and ZERO_OFFLOAD_PIN_THREADS, LOCAL_RANK..., before the first step reads them)
        avail = available_host_bytes()
        if avail is None or self.estimate().total_bytes <= avail:
            return
        message = self.message(avail) + f" Set {OVERCOMMIT_ENV}=1 to allocate anyway."
        if allow:
            logger.warning("%s (allocating anyway: %s is set)", message, OVERCOMMIT_ENV)
            return
        raise MemoryError(message)

    def message(self, avail: Optional[int], failed: str = "") -> str:
        """What the group needs, what failed (``failed``: the allocator's error) or what the process can take."""
        est, options, buffers = self.estimate(), self.options, self.buffers
        smaller = [(f"{b.switch}=False", self.estimate(buffers=[c for c in buffers if c is not b]))
                   for b in buffers if b.optional and b.switch]
        if options.delayed_update:
            smaller.append(("delayed_update=False", self.estimate(delayed_update=False)))
        for dtype, name in ((torch.bfloat16, "torch.bfloat16"), (torch.int8, "torch.int8")):
            if options.state_dtype.itemsize > dtype.itemsize and dtype in self.rule.state_dtypes:
                smaller.append((f"state_dtype={name}", self.estimate(state_dtype=dtype)))
        for n in (2, 4, 8):
            if n > self.world:
                smaller.append((f"process_group of {n} ranks (per rank)", self.estimate(world=n)))
        ways = "; ".join(f"{what}: {format_bytes(e.total_bytes)}" for what, e in smaller)
        room = ("" if avail is None else f"this process can take {format_bytes(avail)} (MemAvailable, capped by its "
                "cgroup's limit and its address-space limit, ulimit -v)")
        why = f"allocating it failed ({failed}){'; ' + room + ' now' if room else ''}" if failed else room
        return (f"OffloadOptimizer: param group {self.gi} needs {format_bytes(est.total_bytes)} of host RAM "
                f"({est.bytes_per_param:.2f} B/param for {est.numel:,} parameters), but {why}. It would need, "
                f"with {ways}.")


def _host_allocation_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a host allocation that failed: torch's CPU allocator, an mmap (pinned buffers) or
    Python's own; not a GPU's out-of-memory error (the device tier's), which says so itself."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return "can't allocate memory" in str(exc)


def home_plan(layouts: Sequence[BucketLayout], options: Options) -> List[str]:
    """Each of a group's buckets' home at construction (``"host"``, ``"resident"``, ``"parked"``), from the shares
    ``options`` give (:meth:`~zero_offload.options.Options.shares`): the group's first buckets on CUDA (backward runs
    the model from its end, so it produces their gradients last, when nothing is left to hide a host update
    behind) resident, as many as fit in the resident share of the group's CUDA elements, then as many parked as fit
    in the parked share; the rest, and every bucket off CUDA, on the host."""
    shares = options.shares()
    out = ["host"] * len(layouts)
    if not shares:
        return out
    total = sum(l.numel for l in layouts if l.device.type == "cuda")
    used, budget, homes = 0, 0.0, iter(home for home in ("resident", "parked") if home in shares)
    home = None
    for i, layout in enumerate(layouts):
        if layout.device.type != "cuda":
            continue
        while home is None or used + layout.numel > budget:
            home = next(homes, None)
            if home is None:
                return out
            budget += shares[home] * total
        used += layout.numel
        out[i] = home
    return out


def allocate_group(group: Dict[str, Any], gi: int, options: Options, placed: Placement = Placement(),
                   rule: Rule = ADAMW) -> List[FlatBucket]:
    """Lay out and allocate the buckets of param group ``gi`` as its topology ``placed`` them (see
    :class:`Placement`) with the state ``rule`` declares for the group's hyperparameters. ``MemoryError`` with the
    numbers, and nothing left allocated, if the host has no room for them (checked first) or their allocation
    fails."""
    sharded, data, takeovers = placed.cut, placed.data, placed.takeovers
    if data is None:
        layouts = plan_buckets(group["params"], options.bucket_numel)
    else:
        layouts = plan_local(data, options.bucket_numel, placed.units, takeovers)
    world = sharded[0] if sharded is not None else 1
    buffers = rule.needed(rule.hyper(group))
    homes = home_plan(layouts, options)
    warn_live_views(layouts, homes, group["params"], placed.live_views, gi)  # (before anything is allocated)
    if rule.host_refusal and "host" in homes:
        asked = options.gpu_option if options.gpu_tier else "placement"
        raise ValueError(f"{rule.host_refusal}. {asked}={getattr(options, asked)!r} leaves {homes.count('host')} of "
                         f"param group {gi}'s {len(homes)} buckets on the host (every bucket of CPU parameters is "
                         "stepped there, and placement='auto' steps every bucket there first)")
    if rule.host_refusal and (world > 1 or data is not None and any(
            tuple(d.shape) != tuple(p.shape) for d, p in zip(data, group["params"]))):
        where = "a process_group" if world > 1 else "FSDP2"
        raise ValueError(f"{rule.host_refusal.split(':')[0]}, and its own code steps each parameter whole; with "
                         f"{where} param group {gi}'s buckets hold this rank's pieces of its parameters, which that "
                         "code would step as if whole (it is not elementwise). Run it without sharding its state")
    room = _Room(layouts, homes, gi, buffers, options, world, rule, takeovers)
    room.check()
    buckets: List[FlatBucket] = []
    failed = ""
    try:
        _make_buckets(buckets, layouts, homes, group, gi, options, sharded, rule, buffers, data, takeovers)
    except (MemoryError, OSError, RuntimeError) as exc:
        if not _host_allocation_failed(exc):
            raise
        failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if failed:
        # Raised outside the except block, the buckets freed first: the allocator's error and its traceback (whose
        # frames hold the bucket being made) are gone, so nothing allocated outlives the refusal.
        buckets.clear()
        raise MemoryError(room.message(available_host_bytes(), failed))
    return buckets


def bucket_takeovers(layout: BucketLayout, takeovers: Optional[Sequence[Any]]) -> Optional[List[Any]]:
    """The records of the FSDP2 shards whose storage the slots of ``layout`` can take over
    (:func:`zero_offload.fsdp2.takeover`, given per parameter of the group), all or none (see :func:`takes_over`)."""
    if takeovers is None:
        return None
    mine = [takeovers[i] for i in layout.indices]
    return mine if mine and all(h is not None for h in mine) else None


def takes_over(layout: BucketLayout, home: str) -> bool:
    """Whether a bucket of ``layout`` in ``home`` takes over the storage of FSDP2's shards it holds (where
    :func:`bucket_takeovers` has their records): on the host, every bucket (the CPU kernel writes the shards); on a
    GPU, a bucket stepped there (``"resident"``, ``"parked"``: the fused update writes them, as it writes a plain
    parameter bound to its slot), not one whose state is on the host (its update is uploaded into the shards)."""
    return layout.device.type == "cpu" or home != "host"


def _pins_takeover(takeovers: Optional[Sequence[Any]]) -> bool:
    """FSDP pins the shards it keeps for CPUOffloadPolicy(pin_memory=True) (it copies them to the GPU), and re-pins
    any that are not: the slot buffer that takes them over is pinned, the rest of the state is not."""
    return any(getattr(h, "pin_memory", False) for h in takeovers or ())


def _pinned_takeover(held: HostMemoryEstimate, low_precision: bool) -> HostMemoryEstimate:
    """``held`` with its pinned bytes the slot buffer the shards live in (staging, or the fp32 master)."""
    return dataclasses.replace(held, pinned_bytes=held.buffers["staging" if low_precision else "master"])


def plan_local(data: Sequence[torch.Tensor], bucket_numel: int, units: Optional[Sequence[int]],
               takeovers: Optional[Sequence[Any]]) -> List[BucketLayout]:
    """The buckets of FSDP2 parameters' local shards ``data``: cut at their FSDP ``units``, and a slot that takes
    over a shard's storage (its ``takeovers`` record, see :func:`zero_offload.fsdp2.takeover`) with room for FSDP's
    padding rows too."""
    rooms = None if takeovers is None else [0 if h is None else fsdp2.takeover_numel(h) for h in takeovers]
    return plan_buckets(data, bucket_numel, cuts=units, rooms=rooms)


def _make_buckets(out: List[FlatBucket], layouts: Sequence[BucketLayout], homes: Sequence[str],
                  group: Dict[str, Any], gi: int, options: Options, sharded: Optional[Tuple[int, int]], rule: Rule,
                  buffers: Sequence[StateBuffer], data: Optional[Sequence[torch.Tensor]],
                  takeovers: Optional[Sequence[Any]] = None) -> None:
    """Allocate the buckets of ``layouts`` into ``out``, one at a time (``data``: see :func:`allocate_group`)."""
    world, rank = sharded if sharded is not None else (1, 0)
    for bi, layout in enumerate(layouts):
        shard = None if sharded is None else ShardLayout.cut(layout, world, rank)
        bucket = FlatBucket(layout, group["params"] if data is None else data, rule=rule, buffers=buffers,
                            pin=should_pin(layout.device, options.pin_memory), shard=shard,
                            grads_reduced=options.grads_reduced, where=f"param group {gi}, bucket {bi}",
                            state_dtype=options.state_dtype, group=gi, names=group.get("param_names"),
                            home=homes[bi], owners=None if data is None else group["params"],
                            takeovers=takeovers)
        if options.delayed_update:
            bucket.grads.add_prev()  # allocated now, so the logged estimate and the RSS include it
        out.append(bucket)
