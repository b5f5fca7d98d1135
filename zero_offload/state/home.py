"""The residency seam: a bucket's optimizer state (its rule's buffers, the fp32 masters, the step counts and the
entries ``opt.state`` shows) behind one interface, :class:`Home`, which says where the state is, brings it to where
its update runs (and back), and hands out what the rest of the package asks of it: the buffers one update reads and
writes, copies of them, the entries of ``opt.state`` and of a checkpoint. No module outside :mod:`zero_offload.state`
(and the kernel's entry, :mod:`zero_offload.apply`, through :meth:`Home.run_buffers`) reads a state buffer.

Where the state lives is a subclass, one file each: :class:`~zero_offload.state.host_home.HostHome` (host memory,
stepped there by the CPU kernel), :class:`~zero_offload.state.device_home.DeviceHome` (the GPU's memory,
stepped there by torch's fused kernels) and :class:`~zero_offload.state.parked_home.ParkedHome` (parked in host
memory between steps, brought to the GPU and stepped there). A new home (paged from NVMe, say) is one more
subclass: its tier, its :meth:`Home.bring` and :meth:`Home.put_back`, and where its update runs.

The parts a home composes stay in their files: :mod:`~zero_offload.state.store` (the rule's buffers through their
codecs), :mod:`~zero_offload.state.params` (masters, staging, the parameters bound to their slots) and
:mod:`~zero_offload.state.views` (the entries).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload import fsdp2
from zero_offload.rules.base import Rule, Run, StateBuffer
from zero_offload.state.layout import BucketLayout, ShardLayout
from zero_offload.state.params import Masters
from zero_offload.state.shaped import SHAPED
from zero_offload.state.store import StateStore
from zero_offload.state.tiers import Tier
from zero_offload.state.views import StateViews
from zero_offload.timeline import Timeline

__all__ = ["Copies", "Home"]

_NONE = object()  # (no hyperparameters seen yet)

# Copies of a bucket's buffers by name ("master", the rule's, "staging"), and of their 8-bit scales.
Copies = Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]
Views = Callable[[Optional[torch.Tensor]], Optional[List[torch.Tensor]]]


class Home:
    """Where one bucket's state lives (see the module docstring). Made by the bucket, with the geometry of its
    slots; subclasses say where.

    Attributes:
        kind (str): the home's name, as placement gives it ("host", "resident", "parked").
        on_device (bool): its update runs on the bucket's GPU (the rule's device update), not by the CPU kernel.
        tier (Tier): where its buffers are now.
        masters (Masters), store (StateStore), views (StateViews): its parts (see the module docstring).

    Args:
        tier (Tier): where to allocate.
        rule (Rule): the update rule; ``buffers`` the state buffers to allocate now; ``state_dtype`` their codec.
        params (Sequence[Tensor]): the bucket's parameters (FSDP2: their local shards), ``owners`` the tensors
            users see (the keys of ``opt.state``), ``placed``: FSDP2's owners, whose entries are DTensors.
        layout (BucketLayout): the slots (the shard's when sharded), ``shard`` the cut over ranks, ``views`` cuts a
            flat buffer into per-parameter views.
        bind (bool), shares_grad (bool), takeovers, slots_tier: see :class:`~zero_offload.state.params.Masters`.
    """

    kind = ""
    on_device = False

    def __init__(self, tier: Tier, *, rule: Rule, buffers: Sequence[StateBuffer], state_dtype: torch.dtype,
                 params: Sequence[torch.Tensor], owners: Sequence[torch.Tensor], layout: BucketLayout,
                 shard: Optional[ShardLayout], views: Views, bind: bool, shares_grad: bool,
                 placed: Optional[Sequence[torch.Tensor]] = None, takeovers: Optional[Sequence[Any]] = None,
                 slots_tier: Optional[Tier] = None):
        self.tier = tier
        self.masters = Masters(params, layout, shard, tier, shares_grad, views, owners, bind=bind, takeovers=takeovers,
                               slots_tier=slots_tier)
        self.store = StateStore(rule, buffers, state_dtype, tier, layout.padded_numel, views, len(params),
                                None if shard is not None else [p.shape for p in params])
        self.views = StateViews(rule, self.store, self.masters, layout, shard, params, placed)
        self._in_use: Tuple[Any, List[str]] = (_NONE, [])  # (hyper, the optional buffers its updates use): see use()

    # -- where it is, and where it is stepped ----------------------------------------------------------------------
    @property
    def grads_tier(self) -> Tier:
        """Where the bucket's gradient slots live (made there at first use unless on the host)."""
        return self.tier

    def bring(self, streams: Any, timeline: Optional[Timeline] = None, where: Optional[int] = None) -> None:
        """Make the state readable where its update runs, before the update (here: it is there already).
        ``streams``: the transport's side streams (:class:`~zero_offload.transport.channel.Streams`), for a home
        whose state must travel; ``timeline`` and ``where`` (the bucket's position) name the copies."""

    def put_back(self, streams: Any, timeline: Optional[Timeline] = None, where: Optional[int] = None) -> None:
        """After the update: the state goes back where it lives between steps (here: it never left)."""

    def release(self) -> None:
        """The step is over without an update of the bucket: what :meth:`bring` (or an earlier reload) holds is
        let go (here: nothing)."""

    def settle(self) -> None:
        """Before the host reads the state (a checkpoint, ``opt.state``): wait for any copy still bringing it back
        (here: none)."""

    def update(self, rule: Rule, run: Run, hyper: Any) -> None:
        """Run ``rule`` over one run of this home's slots, where this home's state is stepped."""
        rule.update(run, hyper)

    def results(self) -> List[torch.Tensor]:
        """Per parameter, where its last update left the new value, in the parameter's dtype and shape: the master's
        slot, or the staging copy's of a low-precision parameter (for parameters that are not their slots: FSDP2's
        shards on a GPU, which take it from there)."""
        masters = self.masters
        return masters.staging_views if masters.low_precision else masters.master_views

    # -- what one update reads and writes (the kernel's entry) ---------------------------------------------------
    def run_buffers(self, a: int, b: int, copies: Optional[Copies] = None
                    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """The master, the rule's buffers and their scales over elements ``[a, b)``: the live ones, or of
        ``copies`` (see :meth:`copies`)."""
        master = self.masters.master if copies is None else copies[0]["master"]
        state, scales = self.store.run_state(a, b, copies)
        return master[a:b], state, scales

    def run_shaped(self, first: int, last: int, copies: Optional[Copies] = None
                   ) -> Optional[List[Dict[str, torch.Tensor]]]:
        """Parameters ``first..last``'s tensors of the shaped buffers (:mod:`~zero_offload.state.shaped`), one dict
        each: the live ones, or of ``copies``; None where the rule declares none."""
        shaped = self.store.shaped
        if shaped.flat is None:
            return None
        return (shaped.views if copies is None else shaped.cut(copies[0][SHAPED]))[first:last + 1]

    def run_views(self, first: int, last: int) -> Dict[str, List[torch.Tensor]]:
        """Parameters ``first..last``'s views, shaped like them, of the master (``"master"``) and of the rule's
        buffers, by name, where the update runs (:attr:`~zero_offload.rules.base.Run.views`): the live buffers',
        cut when they were laid out (a buffer added, amsgrad's, is cut then), not per step."""
        views = {name: cut[first:last + 1] for name, cut in self.store.views.items()}
        views["master"] = self.masters.master_views[first:last + 1]
        return views

    def copies(self) -> Copies:
        """Copies of everything an update writes: the master, the rule's buffers and scales, the staging copy."""
        flat = {"master": self.masters.master.clone(), **{n: t.clone() for n, t in self.store.flat.items()}}
        if self.store.shaped.flat is not None:
            flat[SHAPED] = self.store.shaped.flat.clone()
        if self.masters.staging is not None:
            flat["staging"] = self.masters.staging.clone()
        return flat, {n: t.clone() for n, t in self.store.scales.items()}

    def holds(self, names: Sequence[str]) -> bool:
        """Whether every buffer of ``names`` is allocated (amsgrad's, once switched on)."""
        return set(names) <= set(self.store.names)

    # -- what users see: opt.state entries and checkpoints -------------------------------------------------------
    def entry(self, i: int) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s ``opt.state`` entry (views of the buffers)."""
        return self.views.entry(i)

    def slots(self, i: int, *, master: bool = True) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s state tensors by name, views of the buffers (the master with ``master``, where it is
        separate from the parameter)."""
        return self.views.slots(i, master=master)

    def fp32(self, name: str) -> torch.Tensor:
        """Buffer ``name`` (``"master"`` too) whole as float32: the buffer itself where it is fp32, else a new
        tensor."""
        return self.masters.master if name == "master" else self.store.fp32(name)

    def live(self, name: str) -> Optional[torch.Tensor]:
        """The flat buffer ``name`` (``"master"`` or one of the rule's) that views of the state are views of, for a
        checkpoint that saves them in place and stages loads beside them; None where there is none."""
        return self.masters.master if name == "master" else self.store.flat.get(name)

    def load(self, name: str, i: int, value: Optional[torch.Tensor]) -> None:
        """Write parameter ``i``'s buffer ``name`` (its piece when sharded) from ``value`` (validated, parameter-shaped,
        converted by the buffer's codec; None: zeros)."""
        self.views.load(name, i, value)

    def load_pieces(self, entries: Sequence[Optional[Dict[str, object]]]) -> None:
        """Sharded: this rank's piece of each parameter's full entry (validated; None: fresh state)."""
        self.views.load_pieces(entries)

    def reset(self, i: int) -> None:
        """Parameter ``i`` starts afresh (its buffers zeroed by the caller): step 0, no entry, master taken from the
        parameter at its next update."""
        self.views.reset(i)

    def set_step(self, i: int, step: float) -> None:
        self.views.set_step(i, step)

    def hold(self, indices: Sequence[int], rule: Rule, hyper: Any) -> List[int]:
        """Parameters ``indices`` were just updated by ``rule`` with a group's ``hyper``: their entries hold the
        optional buffers it needs from now on; returns those whose entries gained one (see
        :meth:`StateViews.hold`). No Python call once every entry holds every one, nor while ``hyper`` is the
        object last seen (:meth:`use`) and needs none (amsgrad off)."""
        if self.views.all_hold:
            return []
        if hyper is not self._in_use[0]:
            self.use(hyper, rule.needed(hyper))
        names = self._in_use[1]
        return self.views.hold(indices, names) if names else []

    def use(self, hyper: Any, needed: Sequence[StateBuffer]) -> None:
        """Updates with ``hyper`` use the rule's buffers ``needed`` (``rule.needed(hyper)``): kept, by ``hyper``'s
        identity, for :meth:`hold`. A rule's ``hyper()`` gives a new object where a group's hyperparameters changed
        (a scheduler's lr, an edit of ``param_groups``), and AdamW's the same one while they stay as they were, so a
        step of an unchanged group asks the rule nothing; a changed one is asked once a step, by the schedule
        (:func:`~zero_offload.update.ensure_buffers`), or here."""
        self._in_use = (hyper, [b.name for b in needed if b.optional])

    def hold_only(self, i: int, names: Sequence[str]) -> None:
        """Parameter ``i``'s entry holds the optional buffers among ``names`` only (a loaded or edited entry's)."""
        self.views.hold_only(i, names)

    def shows(self, i: int, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Parameter ``i``'s ``tensors`` (by buffer name) that its entry shows (see :meth:`StateViews.shown`)."""
        return self.views.shown(i, tensors)

    def count_steps_in(self, dtype: torch.dtype) -> None:
        """Count the steps in ``dtype`` from now on (a load's: see :meth:`StateStore.count_steps_in`)."""
        self.store.count_steps_in(dtype)

    def set_exposed(self, i: int, exposed: bool) -> None:
        """Record whether parameter ``i`` has an entry in ``opt.state``."""
        self.views.set_exposed(i, exposed)

    def loaded(self, i: int, loaded: bool) -> None:
        """Parameter ``i``'s separate master was just written from a checkpoint, or not (see
        :meth:`Masters.loaded`)."""
        self.masters.loaded(i, loaded)

    @property
    def step_key(self) -> Optional[str]:
        """The key of the step count in the entries (see :attr:`StateViews.step_key`)."""
        return self.views.step_key

    def to_fp32(self, name: str, codes: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
        """A copy of buffer ``name``'s codes (``codes``, ``scales``: see :meth:`copies`) as float32."""
        return self.store.codecs[name].to_fp32(codes, scales)

    @property
    def names(self) -> List[str]:
        """The rule's buffers allocated, in declaration order."""
        return self.store.names

    @property
    def declared(self) -> Dict[str, StateBuffer]:
        """The rule's buffers by name, allocated or not."""
        return self.store.declared

    def nbytes(self) -> Dict[str, int]:
        """Bytes of the rule's buffers held (and their scales), by name."""
        return self.store.nbytes()

    def device_tensors(self) -> Dict[str, torch.Tensor]:
        """The state's tensors in GPU memory now, by name (the rule's, their scales, a separate ``"master"``)."""
        if self.tier.host:
            return {}
        master = {"master": self.masters.master} if self.masters.separate else {}
        return {**self.tensors(), **master}

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor of the rule's state held, by name (the buffers, then their scales as ``<name>_scale``)."""
        return self.store.tensors()

    def ensure(self, buffers: Sequence[StateBuffer]) -> List[str]:
        """Allocate those of ``buffers`` not allocated yet (zeroed); returns their names."""
        return self.store.ensure(buffers)

    def take_over(self, old: "Home") -> None:
        """Hold what ``old`` (the bucket's home so far) holds, between steps, every copy from it waited for: the
        rule's buffers, a separate master, the step counts (the same tensor: the entries' ``"step"`` are views of
        it), whether each master is current, and which parameters have entries. The parameters, which hold what was
        uploaded from the old masters, fill their new slots and are bound to them."""
        for name, buf in old.store.flat.items():
            self.store.flat[name].copy_(buf)
        if old.store.shaped.flat is not None:
            self.store.shaped.flat.copy_(old.store.shaped.flat)
        if self.masters.separate:
            self.masters.master.copy_(old.masters.master)
        self.masters.fill_param_slots()
        self.store.steps = old.store.steps
        self.views.steps = old.store.steps
        self.masters.bind()
        watch, versions = self.masters.watch, old.masters.versions
        self.masters.versions = [v if v < 0 else fsdp2.version(p) for v, p in zip(versions, watch)]
        for i, exposed in enumerate(old.views.exposed):
            self.views.set_exposed(i, exposed)
        for name, held in old.views.holds.items():
            self.views.holds[name][:] = held

    # -- the parameters beside the state -------------------------------------------------------------------------
    def fill_param_slots(self) -> None:
        """Copy the values of the parameters that live with the state into the slots :meth:`bind` binds them to."""
        self.masters.fill_param_slots()

    def bind(self) -> None:
        """At construction, after :meth:`fill_param_slots`: parameters that live with the state become views of the
        slots the update writes (see :meth:`Masters.bind`)."""
        self.masters.bind()

    def check_in_place(self) -> None:
        """Refuse parameters that no longer live where the home put them."""
        self.masters.check_in_place()

    def refresh(self, indices: Sequence[int], into: Optional[List[torch.Tensor]] = None) -> None:
        """(Re)initialise the separate masters of ``indices`` whose parameter changed outside the optimizer (into
        ``into`` instead where given: copies, the home left as it is)."""
        self.masters.refresh(indices, into)

    def record_versions(self, indices: Sequence[int]) -> None:
        """The parameters ``indices`` were just written from the state."""
        self.masters.record_versions(indices)
