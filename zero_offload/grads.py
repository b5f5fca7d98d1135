"""A bucket's gradient slots on the host: the flat gradient buffer (and ``delayed_update``'s second one, swapped
with it each step), each parameter's view of its slot, which slots are known to hold zeros, and the checks a
gradient passes before the update reads it (:func:`check_grads`).

Sharded on the CPU, gradients are gathered in a full flat buffer (``flat_grad``) that the reduce-scatter reads, and
the gradient buffer proper holds the rank's shard. Sharded on a GPU (a resident or parked bucket), only the shard's
buffer exists, from the bucket's first reduce-scatter of a step to the step's end (:meth:`GradSlots.release`): the
reduce-scatter's input is a transient buffer of the transport's
(:class:`~zero_offload.transport.sharded.ShardedDeviceRoute`).
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Callable, Dict, List, Optional, Sequence

import torch

from zero_offload.state.layout import BucketLayout, _dense, view_like
from zero_offload.state.tiers import Tier

__all__ = ["GradSlots", "check_grads"]

_get_grad = operator.attrgetter("grad")
_get_layout = operator.attrgetter("layout")
_get_shape = operator.attrgetter("shape")


class GradSlots:
    """The gradient buffers of one bucket and each parameter's views of them.

    Attributes:
        grad (Tensor): the gradient buffer the update reads (the shard's when sharded); the parameters' dtype.
        grad_prev (Tensor, optional): ``delayed_update``'s second buffer (see :meth:`swap`).
        grad_views (List[Tensor]): each parameter's slot of ``grad`` (its 1-D piece when sharded).
        flat_grad (Tensor, optional): sharded on the CPU: the full flat gradient buffer, and ``flat_grad_views``.
        zero (List[bool]): whether each slot of :attr:`targets` is known to hold zeros: a parameter without a
            gradient must not leave a stale one in the buffer, which norms and checks read whole.
        slotted (bool): each parameter has a slot shaped like it (in ``grad``, or in ``flat_grad`` when sharded on
            the CPU); False for a sharded GPU bucket, whose shard a reduce-scatter rewrites whole.

    Args:
        params (Sequence[Tensor]): the bucket's parameters; ``shapes`` their shapes (read once).
        layout (BucketLayout): the layout of ``grad`` (the shard's); ``full`` the whole bucket's.
        pieces (List[Tuple[int, int]], optional): sharded: each parameter's piece of the shard.
        gather_full (bool): sharded on the CPU: allocate ``flat_grad``.
        tier (Tier): where the buffers live.
        label (Callable[[int], str]): names parameter ``i`` in error messages.
        lazy (bool): make ``grad`` at its first use even on the host (FSDP2's host shards: their gradients are
            read where FSDP leaves them). Default: False.
    """

    def __init__(self, params: Sequence[torch.Tensor], shapes: Sequence[torch.Size], layout: BucketLayout,
                 full: BucketLayout, pieces, gather_full: bool, tier: Tier, label: Callable[[int], str],
                 lazy: bool = False):
        self.params, self.shapes, self.layout, self.full = params, shapes, layout, full
        self.pieces, self.tier, self.label = pieces, tier, label
        # On a device tier the buffer is made at its first use (gradients are read where autograd left them; a
        # buffer is needed only for ``zero_grad(set_to_none=False)``, a gradient laid out unlike its parameter,
        # or a sharded bucket's reduce-scatter): GPU memory is what the device tier is short of. So for FSDP2's
        # host shards (``lazy``), whose gradients FSDP hands over as fresh tensors each step.
        self.allocated = False
        if tier.host and not lazy:
            self.allocate()
        self.grad_prev: Optional[torch.Tensor] = None
        self.flat_grad: Optional[torch.Tensor] = None
        self.flat_grad_views: Optional[List[torch.Tensor]] = None
        if gather_full:
            self.flat_grad = tier.zeros(full.padded_numel, layout.dtype)
            self.flat_grad_views = [view_like(self.flat_grad, o, p) for o, p in zip(full.offsets, params)]
        # (A slot has its parameter's strides, or is a 1-D piece.)
        self.slot_contiguous = ([v.is_contiguous() for v in self.grad_views] if self.allocated
                                else [pieces is not None or p.is_contiguous() or not _dense(p) for p in params])
        self.all_slots_contiguous = all(self.slot_contiguous)
        self.zero = [True] * len(params)
        self.slotted = pieces is None or gather_full
        self._prev_views: Optional[List[torch.Tensor]] = None
        self._prev_zero: List[bool] = []
        self._ptrs: Dict[int, List[int]] = {}  # data_ptr of a gradient buffer -> its slots' (_slot_ptrs)

    def allocate(self) -> torch.Tensor:
        """The gradient buffer, made now if it was not yet (a device tier's, see the constructor). Once made,
        ``grad`` and ``grad_views`` are plain attributes (read on the hot path without a call)."""
        if not self.allocated:
            self.grad = self.tier.zeros(self.layout.padded_numel, self.layout.dtype)
            self.grad_views = self.views(self.grad)
            self.allocated = True
        return self.grad

    def release(self) -> None:
        """Let go of the gradient buffer made at first use (a sharded GPU bucket's shard, once its step is over):
        reading ``grad`` makes it again, zeroed. The caller holds no other reference to it; the memory goes back to
        the stream it was made on, whose work (the update, and a reduce-scatter it waited for) is all that read
        it."""
        if self.allocated:
            self.__dict__.pop("grad", None)
            self.__dict__.pop("grad_views", None)
            self.allocated = False
            self.zero = [True] * len(self.params)
            self._ptrs.clear()

    # Until made, reading either makes the buffer (instance attributes set by allocate() take over from these).
    grad = functools.cached_property(allocate)
    grad_views = functools.cached_property(lambda self: (self.allocate(), self.__dict__["grad_views"])[1])

    def views(self, flat: Optional[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """Each parameter's slot of ``flat`` (a buffer of this layout): parameter-shaped, or 1-D pieces."""
        if flat is None:
            return None
        if self.pieces is not None:
            return [flat[a:b] for a, b in self.pieces]
        return [view_like(flat, o, p) for o, p in zip(self.layout.offsets, self.params)]

    @property
    def targets(self) -> List[torch.Tensor]:
        """Where a parameter's gradient is gathered: its slot of ``grad`` (of ``flat_grad`` when sharded on CPU)."""
        return self.flat_grad_views if self.flat_grad is not None else self.grad_views

    def collect(self) -> List[Optional[torch.Tensor]]:
        """Each parameter's ``.grad`` (None where absent), checked for what the kernel cannot take. On the hot
        path: C-level loops only (``map``, list comparison), about 0.2 us per parameter."""
        params = self.params
        grads = list(map(_get_grad, params))
        if not self.allocated and self.flat_grad is None:  # (no slot exists that a gradient could be)
            idx = [i for i, g in enumerate(grads) if g is not None]
            check_grads([grads[i] for i in idx], [params[i] for i in idx], [self.shapes[i] for i in idx],
                        lambda k: self.label(idx[k]))
            return grads
        in_slot = list(map(operator.is_, grads, self.targets))
        if any(in_slot) and self.unbind_rebound():
            in_slot = list(map(operator.is_, grads, self.targets))
        if all(in_slot):
            return grads  # every gradient already is its slot: dense, nothing more to check
        # Only a gradient that is not already its slot can be sparse or shaped unlike its parameter.
        if not any(in_slot) and not any(map(operator.is_, grads, itertools.repeat(None))):
            check_grads(grads, params, self.shapes, self.label)  # the usual fresh gradients: C-level loops only
            return grads
        others = [(g, i) for i, (g, s) in enumerate(zip(grads, in_slot)) if not s and g is not None]
        check_grads([g for g, _ in others], [params[i] for _, i in others], [self.shapes[i] for _, i in others],
                    lambda k: self.label(others[k][1]))
        return grads

    def unbind_rebound(self) -> bool:
        """A gradient that is a view of its slot (``zero_grad(set_to_none=False)``) can be rebound by the user,
        ``p.grad.data = t`` or ``p.grad.set_(t)``: the very view object then holds ``t``'s storage. Such a slot gets
        a fresh view, so the rebound tensor is read like any gradient assigned by hand (and shape-checked), as
        AdamW would read it. Returns whether any was rebound. One ``data_ptr`` per parameter (C-level loop)."""
        targets = self.targets
        expected = self._slot_ptrs()
        if list(map(torch.Tensor.data_ptr, targets)) == expected:
            return False
        flat, offsets = (self.flat_grad, self.full.offsets) if targets is not self.grad_views else (
            self.grad, self.layout.offsets)
        for i, t in enumerate(targets):
            if t.data_ptr() != expected[i]:
                targets[i] = view_like(flat, offsets[i], self.params[i])
                self.zero[i] = False  # (unknown: zeroed at its next use)
        return True

    def _slot_ptrs(self) -> List[int]:
        """The ``data_ptr`` each view of :attr:`targets` has while it views its slot (cached per buffer:
        ``delayed_update`` swaps two)."""
        full = self.flat_grad is not None
        flat = self.flat_grad if full else self.grad
        ptrs = self._ptrs.get(flat.data_ptr())
        if ptrs is None:
            offsets = self.full.offsets if full else self.layout.offsets
            ptrs = self._ptrs[flat.data_ptr()] = [view_like(flat, o, p).data_ptr()
                                                  for o, p in zip(offsets, self.params)]
        return ptrs

    def filled(self, i: int) -> None:
        """Slot ``i`` now holds (or is about to hold) a gradient."""
        self.zero[i] = False


    def all_filled(self) -> None:
        """Every slot now holds a gradient (the steady state of ``zero_grad(set_to_none=False)``)."""
        if any(self.zero):
            self.zero[:] = [False] * len(self.zero)

    def clear(self, i: int) -> None:
        """Parameter ``i`` has no gradient: its slot must read as zeros (without slots, nothing to do: the
        transport's reduce-scatter input holds zeros where a gradient is absent)."""
        if not self.slotted:
            self.zero[i] = True
        elif not self.zero[i]:  # (never for a buffer not yet made: its slots are all known zeros)
            self.targets[i].zero_()
            self.zero[i] = True

    def add_prev(self) -> None:
        """Allocate the second gradient buffer of ``delayed_update`` (see :meth:`swap`)."""
        if self.grad_prev is None:
            self.grad_prev = self.tier.zeros(self.layout.padded_numel, self.layout.dtype)
            self._prev_views = self.views(self.grad_prev)
            self._prev_zero = [True] * len(self.params)

    @property
    def prev_views(self) -> Optional[List[torch.Tensor]]:
        return self._prev_views

    def swap(self) -> None:
        """Exchange the gradient buffer with the second one: ``delayed_update`` updates from one step's gradients
        while the next backward fills the other."""
        self.add_prev()
        self.grad, self.grad_prev = self.grad_prev, self.grad
        self.grad_views, self._prev_views = self._prev_views, self.grad_views
        self.zero, self._prev_zero = self._prev_zero, self.zero

    def zero_as_views(self) -> None:
        """``zero_grad(set_to_none=False)`` for a CPU bucket: every existing gradient becomes its (zeroed) slot of
        the flat buffer, so the next backward accumulates straight into it and the step copies nothing."""
        self.unbind_rebound()  # a rebound view must not stay p.grad: AdamW would zero the tensor it holds
        targets = self.targets
        (self.flat_grad if self.flat_grad is not None else self.grad).zero_()
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None:
                self.zero[i] = True
                if g is not targets[i]:
                    p.grad = targets[i]


def check_grads(grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                shapes: Optional[Sequence[torch.Size]] = None, label: Optional[Callable[[int], str]] = None) -> None:
    """Refuse gradients the kernel cannot take for their parameters: sparse ones, and any shaped unlike the
    parameter (a broadcastable one would be silently expanded by a copy, a smaller one partly applied). C-level
    loops on the hot path. ``label(k)`` names parameter ``k`` in the error, with its shape (else its shape alone
    does: the bucket's label gives an FSDP2 parameter's whole shape, and its local shard's besides)."""
    # (``shapes``: the parameters' own, read once: a Parameter's attributes are slow to read.)
    if set(map(_get_layout, grads)) <= {torch.strided} and list(map(_get_shape, grads)) == list(
            shapes if shapes is not None else map(_get_shape, params)):
        return
    for k, (g, p) in enumerate(zip(grads, params)):
        what = f"a parameter of shape {tuple(p.shape)}" if label is None else label(k)
        if g.layout != torch.strided:
            raise RuntimeError(
                f"OffloadOptimizer does not support sparse gradients ({what} has a {g.layout} gradient); consider "
                "torch.optim.SparseAdam"
            )
        if g.shape != p.shape:
            raise RuntimeError(f"OffloadOptimizer: {what} has a gradient of shape {tuple(g.shape)}; nothing was "
                               "updated")
