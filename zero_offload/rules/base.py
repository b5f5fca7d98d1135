"""What an update rule is: the seam between the state home (which allocates, stores and exposes buffers) and the
arithmetic of one optimizer. A rule declares its per-element state buffers and runs its update over one *run*:
a contiguous range of a bucket's slots whose parameters all have a gradient and the same step count.

A rule never calls the transport, never touches ``opt.state``, never allocates state: the store gives it views.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

from zero_offload.options import prefixed, refuse_offload_options

__all__ = ["StateBuffer", "StateShape", "Run", "Rule", "Slots", "flat_grad", "grads_like"]


def _always(hyper: Any) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class StateShape:
    """The shape of a per-parameter state tensor as a function of its parameter's, for a class stepped on whole
    parameters (:mod:`zero_offload.rules.whole`): for each number of dimensions the class was probed with, which of
    the parameter's dimensions the tensor keeps (True) and which it reduces to 1 (False), or None where the class
    keeps no such entry for parameters of that many dimensions. Adafactor's ``row_var`` of a 2-D parameter keeps
    dimension 0 and reduces dimension 1, and a 1-D parameter has none.

    Attributes:
        dims (Tuple[Tuple[int, Optional[Tuple[bool, ...]]], ...]): ``(number of dimensions, kept dimensions or
            None)`` pairs.
    """

    dims: Tuple[Tuple[int, Optional[Tuple[bool, ...]]], ...]

    def of(self, shape: Sequence[int]) -> Optional[torch.Size]:
        """The tensor's shape for a parameter of ``shape`` (None: the class keeps none for it)."""
        masks = dict(self.dims)
        if len(shape) not in masks:
            raise ValueError(f"a state shape probed for parameters of {sorted(masks)} dimensions was asked for a "
                             f"parameter of shape {tuple(shape)}")
        mask = masks[len(shape)]
        return None if mask is None else torch.Size(s if keep else 1 for s, keep in zip(shape, mask))


@dataclasses.dataclass(frozen=True)
class StateBuffer:
    """One per-element state buffer of a rule, shaped like the parameter in the state dict.

    Attributes:
        name (str): its key in the state dict (AdamW's first moment's, say).
        compactable (bool): may be stored in a compact codec (``state_dtype`` bf16 / 8-bit); False: always fp32.
        signed (bool): may hold negative values (8-bit: int8 codes; else uint8 codes).
        needed (Callable[[hyper], bool]): allocated only when this holds for the group's hyperparameters (AdamW's
            running maximum with amsgrad).
        switch (str): for an optional buffer, the boolean group setting that asks for it (``"amsgrad"``), as
            messages name it: the host-RAM refusal lists what turning it off would save, the ranks of a process
            group must agree on it. Default: "".
        shape (StateShape, optional): None: shaped like the parameter, a slot of the bucket's per-element buffers;
            else each parameter's tensor has the shape this gives (or none), held in the bucket's buffer of shaped
            state (:mod:`zero_offload.state.shaped`). Default: None.
    """

    name: str
    compactable: bool = True
    signed: bool = True
    needed: Callable[[Any], bool] = _always
    switch: str = ""
    shape: Optional[StateShape] = None

    @property
    def optional(self) -> bool:
        return self.needed is not _always

    def shape_for(self, param_shape: Sequence[int]) -> Optional[torch.Size]:
        """This buffer's tensor for a parameter of ``param_shape``: its shape, or None where it has none."""
        return torch.Size(param_shape) if self.shape is None else self.shape.of(param_shape)


@dataclasses.dataclass(frozen=True)
class Slots:
    """Where a run lies, for a rule that keeps something per bucket beyond the state buffers (the generic rule keeps
    the wrapped class's own instance there, see :mod:`zero_offload.rules.torch_class`).

    Attributes:
        owner (object): the bucket (its identity only: what the rule keeps for it lives as long as it).
        group (int): the bucket's param group.
        steps (Tensor): the bucket's per-parameter step counts, live (read only: they say whether an update the
            rule saw was counted, or rolled back).
        index (int), count (int): this run's place among the runs of the bucket's update, and their number (a rule
            may do the whole update at the last).
        dry (bool): the update writes copies of the buffers (saving the state a pending update will leave):
            nothing the rule keeps may change.
        shapes (Tuple[torch.Size, ...]), offsets (Tuple[int, ...]): the run's parameters' shapes and their slots'
            offsets in the bucket (the run starts at the first), for a rule that steps each parameter whole
            (:mod:`zero_offload.rules.whole`). Default: () (not told).
    """

    owner: object
    group: int
    steps: torch.Tensor
    index: int = 0
    count: int = 1
    dry: bool = False
    shapes: Tuple[torch.Size, ...] = ()
    offsets: Tuple[int, ...] = ()


@dataclasses.dataclass
class Run:
    """What a rule's update reads and writes for one run of slots ``[a, b)`` of a bucket.

    Attributes:
        master (Tensor): fp32 master weights of the run, updated in place.
        grad (Tensor, optional): the run's gradients, flat (fp32/bf16/fp16); None when ``grads`` is given.
        grads (Sequence[Tensor], optional): one gradient per parameter, read where it lies, with ``offsets``.
        offsets (Sequence[int]): each parameter's slot start, relative to ``a``.
        state (Dict[str, Tensor]): the rule's buffers for the run, by name, as their codec stores them.
        scales (Dict[str, Tensor]): 8-bit state only: each buffer's block scales covering the run.
        step (int): the parameters' step count after this update (1 on the first).
        grad_scale (float): multiplies the gradient first (loss-scale inverse x clip coefficient x 1/world).
        param_out (Tensor, optional): receives the updated parameter rounded to its low-precision dtype.
        slots (Slots, optional): the bucket and the run's place in its update (None: a run of its own, driven
            without a bucket). Default: None.
        shaped (Sequence[Dict[str, Tensor]], optional): per parameter of the run, its state tensors of their own
            shapes (buffers declared with a :class:`StateShape`), views where the update runs. Default: None (none).
        views (Dict[str, Sequence[Tensor]], optional): for a rule with :attr:`Rule.device_views`, stepped on a GPU
            with per-parameter gradients: the run's parameters' views, shaped like them, of the master
            (``"master"``) and of the rule's buffers, by name; views the home cut once, not per step (see
            :meth:`~zero_offload.state.home.Home.run_views`). Default: None (not given: cut them from the flat
            run).
    """

    master: torch.Tensor
    grad: Optional[torch.Tensor]
    grads: Optional[Sequence[torch.Tensor]]
    offsets: Sequence[int]
    state: Dict[str, torch.Tensor]
    scales: Dict[str, torch.Tensor]
    step: int
    grad_scale: float
    param_out: Optional[torch.Tensor]
    slots: Optional[Slots] = None
    shaped: Optional[Sequence[Dict[str, torch.Tensor]]] = None
    views: Optional[Dict[str, Sequence[torch.Tensor]]] = None


class Rule:
    """An elementwise optimizer's update over flat buffers. Subclasses set the class attributes and implement
    :meth:`hyper` and :meth:`update`.

    Attributes:
        name (str): for messages and ``report``.
        optimizer_class (type): the optimizer whose state-dict format and defaults the rule reproduces.
        buffers (Tuple[StateBuffer, ...]): the per-element state, in state-dict key order.
        step_key (str, optional): the per-parameter step-count key of the state dict (None: the format has none).
        state_dtypes (Tuple[torch.dtype, ...]): the codecs the update can read and write directly.
        defaults (Dict[str, Any]): the optimizer's defaults (what ``hyper`` reads of a group), used to plan the
            buffers of groups that give only some settings (``estimate_host_memory``).
        loaded_defaults (Dict[str, Any]): what the optimizer's ``__setstate__`` gives a loaded group lacking these
            keys (an older checkpoint), rather than the value this optimizer was built with.
        cleared_flags (Tuple[str, ...]): flags a loaded group may carry that are set False here (not honoured).
        uses_loss (bool): :meth:`update` reads the loss that the closure given to ``step()`` returned (see
            :meth:`set_loss`): its updates run in ``step()``, after the closure (no ``overlap_step``, no
            ``delayed_update``).
        closure_refusal (str): why ``step(closure)`` is refused, before the closure is called ("": it is not).
    """

    name: str = ""
    optimizer_class: type = torch.optim.Optimizer
    buffers: Tuple[StateBuffer, ...] = ()
    step_key: Optional[str] = "step"
    state_dtypes: Tuple[torch.dtype, ...] = (torch.float32,)
    defaults: Dict[str, Any] = {}
    loaded_defaults: Dict[str, Any] = {}
    cleared_flags: Tuple[str, ...] = ()
    uses_loss: bool = False
    closure_refusal: str = ""

    def forced_on_load(self, defaults: Dict[str, Any]) -> Dict[str, Any]:
        """Settings a loaded group takes whatever it says, for an optimizer built with ``defaults``: what the
        optimizer's ``__setstate__`` forces (none here)."""
        return {}

    def needed(self, hyper: Any) -> Tuple[StateBuffer, ...]:
        """The buffers a group with hyperparameters ``hyper`` allocates."""
        return tuple(b for b in self.buffers if b.needed(hyper))

    def buffers_for(self, group: Dict[str, Any]) -> Tuple[StateBuffer, ...]:
        """The buffers a group (or a partial one: the rest taken from :attr:`defaults`) allocates."""
        return self.needed(self.hyper({**self.defaults, **group}))

    def hyper(self, group: Dict[str, Any]) -> Hashable:
        """The group's hyperparameters read and validated once per step, as a frozen dataclass of plain
        floats/bools (compared for equality, agreed across ranks field by field)."""
        raise NotImplementedError

    def check(self, group: Dict[str, Any], where: str = "") -> None:
        """Validate a group's hyperparameters (the defaults, a group being added, a loaded one) before anything
        changes: :meth:`hyper`'s checks, and no offload option among them (one is the whole optimizer's: a group's
        would be ignored); ``where`` prefixes the message (a loaded group)."""
        with prefixed(where):
            refuse_offload_options(group, self.defaults)
            self.check_settings(group)

    def check_settings(self, group: Dict[str, Any]) -> None:
        """:meth:`check`'s validation of the group's hyperparameters: :meth:`hyper`'s checks by default."""
        self.hyper(group)

    def group_keys(self, group: Dict[str, Any]) -> Dict[str, Any]:
        """Keys the optimizer's constructor adds to a param group with ``group``'s settings beyond its defaults, with
        their values (Lookahead's ``k``, ``alpha``, ``counter``): what a group added to the optimizer holds too."""
        return {}

    def set_loss(self, loss: Optional[Tuple[Any]]) -> None:
        """For a rule that :attr:`uses_loss`: ``(loss,)``, what the closure given to the ``step()`` in progress
        returned, or None (no closure, or the step is over)."""

    def run_closure(self, closure: Optional[Callable[[], Any]]) -> Any:
        """``step(closure)``'s closure, run once with grad enabled (None without one), or refused before it runs
        where :attr:`closure_refusal` says why; its loss is handed to a rule that :attr:`uses_loss`
        (:meth:`set_loss`)."""
        if closure is None:
            self.set_loss(None)
            return None
        if self.closure_refusal:
            raise ValueError(self.closure_refusal)
        with torch.enable_grad():
            loss = closure()
        self.set_loss((loss,))
        return loss

    def update(self, run: Run, hyper: Any) -> None:
        """Update one run: ``master``, ``state`` (and ``scales``) in place; and ``param_out``."""
        raise NotImplementedError

    # Whether :meth:`update_on_device` exists: the rule can run on the device tier (``gpu_fraction``).
    device_update: bool = False
    # Whether :meth:`update_on_device` reads :attr:`Run.views` (per-parameter views the home keeps) where the run's
    # gradients come per parameter: asked of the home only for such a rule.
    device_views: bool = False
    # Why :meth:`update` cannot run, for a rule with a device update only (a class run on whole parameters on the GPU,
    # :mod:`zero_offload.rules.whole`): a bucket it would step on the host is refused with this ("": it can).
    host_refusal: str = ""

    def update_on_device(self, run: Run, hyper: Any) -> None:
        """:meth:`update` of a run whose buffers and gradients are in GPU memory (the device tier), with torch's
        kernels there. Only where :attr:`device_update` is set."""
        raise NotImplementedError


def flat_grad(run: Run) -> torch.Tensor:
    """The run's gradient as one flat tensor on the run's device: ``run.grad`` itself, or the per-parameter
    gradients gathered into float32 with zeros between them (the padding, which an elementwise update leaves at
    zero)."""
    if run.grads is None:
        return run.grad
    flat = torch.zeros(run.master.numel(), dtype=torch.float32, device=run.master.device)
    if run.grads:
        torch._foreach_copy_([flat[o:o + g.numel()] for o, g in zip(run.offsets, run.grads)],
                             [g.reshape(-1) for g in run.grads])
    return flat


_size = operator.attrgetter("shape")


def grads_like(grads: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """The per-parameter gradients of a run laid out as the home's views of its buffers (:attr:`Run.views`: the same
    sizes and strides, which torch's fused and multi-tensor CUDA kernels require of the tensors they pair): ``grads``
    itself where each has its view's shape (a gradient read where autograd left it is then contiguous, as its slot
    is: see :meth:`~zero_offload.transport.host.HostRoute.gather`), else each other one, a flat range of its slot
    in the slot's memory order (a channels-last parameter's, or one read from its slot), viewed with its view's sizes
    and strides, so that the elements paired are the ones at the same place in the slot."""
    if list(map(_size, grads)) == list(map(_size, views)):
        return grads
    return [g if g.shape == v.shape else g.as_strided(v.shape, v.stride(), g.storage_offset())
            for g, v in zip(grads, views)]
