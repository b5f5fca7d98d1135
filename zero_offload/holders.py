"""Which live optimizers hold a parameter: the claim each optimizer's gradient stream makes on its parameters, so
that one that releases gradients (``release_grads``) does not take them from another.

Two live optimizers may both step one parameter (each reads its gradient, as two AdamWs each read ``.grad``; an
optimizer rebuilt while the old one is still referred to, by an LR scheduler say, is the usual case). One that
releases gradients breaks that: its backward hook sets ``.grad`` to None once the gradient is on its way to its own
host buffer, and the other then steps without it, silently. So every optimizer's :class:`Holding` is entered in
:data:`_HOLDERS` under each of its parameters (streamed or not), and:

- the first hook of each backward of a releasing optimizer refuses a parameter another live optimizer holds, before
  any copy of that backward (looked for again only when some optimizer was built or dropped since);
- an optimizer built over a parameter whose gradient another has released and not yet stepped is refused at once
  (:func:`refuse_taken`, with the checks of a param group before anything is laid out);
- one dropped with released gradients not yet stepped says that they are lost with it.

An optimizer the user no longer refers to may still be alive: it is in reference cycles (its own, an LR
scheduler's wrapper of its ``step``), so it lives until the cyclic garbage collector runs, which after a long run
(the optimizer in the oldest generation) may be much later. Its claim is no claim: before refusing, the collector is
run once (off the hot path: only where a refusal is due) and the parameters looked at again. A releasing
optimizer found dropped by that collection (its own hook was asking) does nothing more (:attr:`Holding.dropped`).

The registry is read and written from several threads: backward's hooks (autograd's device threads on a GPU), the
user's (constructors), and wherever the collector runs a finaliser (any thread that allocates, ``overlap_step``'s
worker included). Every access holds :data:`_LOCK` (re-entrant: a finaliser may run on a thread that holds it), and
the collector is run without it. A finaliser only marks its holding dropped: entries are pruned by :meth:`Holding.add`,
never while a finaliser may be interleaved with an add on the same thread (an entry pruned between a lookup and the
add into it would lose that claim).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from typing import Dict, Iterable, Sequence

import torch

from zero_offload.lane import Lane

__all__ = ["Holding", "refuse_taken"]

logger = logging.getLogger("zero_offload")

# Each parameter's live holdings, keyed by the parameter's id, and a count that moves whenever one is added or let
# go. (By id, not by a weak reference to the parameter: torch.utils.swap_tensors, which model.to() uses for
# FSDP2's DTensor parameters and under torch.__future__.set_swap_module_params_on_conversion, refuses a tensor
# with a weak reference. A holding's parameters outlive its entries: its optimizer refers to them, and let_go runs
# as that optimizer goes.)
_HOLDERS: Dict[int, "weakref.WeakSet[Holding]"] = {}
_CHANGES = [0]
_LOCK = threading.RLock()
_PRUNE_AT = [64]  # (the number of entries at which add() next prunes those no live holding claims)


class Holding:
    """One optimizer's claim on its parameters (see the module docstring).

    Args:
        transport (Transport): the optimizer's; says whether it releases gradients and has taken some this step.
    """

    __slots__ = ("transport", "checked", "dropped", "__weakref__")

    def __init__(self, transport) -> None:
        self.transport = transport
        self.checked = -1  # the count of changes the last look for a shared parameter saw
        self.dropped = False  # the optimizer was let go (its finaliser ran): its hooks do nothing

    def add(self, lane: Lane) -> None:
        """Claim a new bucket's parameters (checked before by :func:`refuse_taken`)."""
        with _LOCK:
            if len(_HOLDERS) >= _PRUNE_AT[0]:
                for key in [k for k, held in _HOLDERS.items() if all(h.dropped for h in list(held))]:
                    del _HOLDERS[key]  # (its id may be another parameter's once it is freed)
                _PRUNE_AT[0] = max(64, 2 * len(_HOLDERS))
            for p in lane.bucket.owners:
                _HOLDERS.setdefault(id(p), weakref.WeakSet()).add(self)
            _CHANGES[0] += 1

    def check(self, streamed: Iterable[Lane]) -> None:
        """Before the first copy of a backward: where this optimizer releases gradients, refuse a parameter of the
        ``streamed`` buckets another live optimizer holds (its gradient would be taken from it). Where one is found,
        garbage is collected first (see the module docstring): afterwards this optimizer may be :attr:`dropped`."""
        if not self.transport.release or self.checked == _CHANGES[0]:
            return
        lanes = list(streamed)
        changes = _CHANGES[0]
        shared = self._shared(lanes)
        if shared is not None:
            gc.collect()  # (an optimizer no longer referred to, in a cycle, is no other holder)
            shared = None if self.dropped else self._shared(lanes)
        if shared is not None:
            lane, i = shared
            raise RuntimeError(
                f"{lane.bucket.label(i)} is also optimized by another live OffloadOptimizer, and this one has "
                "release_grads=True: its hooks would take the gradient from the other, which would step "
                "without it. Drop the optimizer you no longer use (and what still refers to it, an LR "
                "scheduler say), or build this one without release_grads")
        self.checked = changes  # (a change made meanwhile, on another thread, is looked at by the next check)

    def _shared(self, lanes: Sequence[Lane]):
        """The first (lane, index) of ``lanes`` whose parameter another holding claims; None where there is none."""
        with _LOCK:
            for lane in lanes:
                for i, p in enumerate(lane.bucket.owners):
                    if any(other is not self and not other.dropped for other in list(_HOLDERS.get(id(p), ()))):
                        return lane, i
        return None

    def let_go(self) -> None:
        """The optimizer is dropped: its parameters are no longer claimed by it."""
        self.dropped = True
        if self.transport.release and self.transport.moved:
            logger.warning("OffloadOptimizer: dropped after a backward whose gradients it had taken "
                           "(release_grads=True) and before its step(): those gradients are lost with it")
        # (Marked, not taken out of the sets: a finaliser runs wherever the collector does, also while a check or an
        # add on its own thread is half way, which a removal would break; the set lets go of it once the holding is
        # freed, and add() prunes the entries no live holding claims.)
        with _LOCK:
            _CHANGES[0] += 1


def refuse_taken(tensors: Sequence[torch.Tensor], index: int) -> None:
    """Before a param group ``index`` is laid out: refuse a parameter whose gradient of the last backward a live
    optimizer took (``release_grads``) and has not stepped yet (this one would step without it); garbage is
    collected before refusing (see the module docstring)."""
    taken = _taken(tensors)
    if taken is not None:
        gc.collect()
        taken = _taken(tensors)
    if taken is not None:
        j, p = taken
        raise ValueError(
            f"param group {index}, parameter {j} (shape {tuple(p.shape)}): its gradient of the last backward "
            "was taken by a live OffloadOptimizer with release_grads=True whose step() has not run, so this "
            "one would step without it: call that optimizer's step() or zero_grad() first, or build this "
            "one before backward")


def _taken(tensors: Sequence[torch.Tensor]):
    with _LOCK:
        for j, p in enumerate(tensors):
            for other in list(_HOLDERS.get(id(p), ())):
                if not other.dropped and other.transport.release and other.transport.moved:
                    return j, p
    return None
