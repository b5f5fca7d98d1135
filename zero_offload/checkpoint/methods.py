"""The optimizer's side of ``torch.optim``'s state-dict protocol (``state_dict``, ``load_state_dict`` and their
hooks; DCP's sharded form), as a base class of :class:`~zero_offload.OffloadOptimizer`: each method settles what the
step has in flight, then hands the param groups, the buckets and ``opt.state`` to this package's functions."""

from __future__ import annotations

import contextlib
from itertools import chain
from typing import Any, Dict

import torch

from zero_offload.checkpoint import dcp, full
from zero_offload.checkpoint.entries import StateMap

__all__ = ["StateDictMethods"]


class StateDictMethods:
    """State dicts of an :class:`~zero_offload.OffloadOptimizer` (see the module docstring)."""

    def state_dict(self) -> Dict[str, Any]:
        """AdamW's state dict: views of the host buffers (compact moments: fp32 copies, a bucket at a time); saving
        changes nothing (``delayed_update``: the state after the pending update, with ``param``; see
        docs/checkpoints.md; ``overlap_step``: the state after the updates backward started, once they are done).
        Sharded: a collective gathering the full state onto *every* rank: prefer :meth:`sharded_state_dict` for
        large models.
        Entries of ``opt.state`` that are not a parameter's (a hook's ``opt.state["epoch"] = 3``) are carried as
        AdamW carries them. The pre-hooks run first and the post-hooks see the finished dict."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._settle(homes=True)
        self._sync()
        ahead = self._mode.ahead()  # on CUDA it waits for the worker that writes the buffers
        with _hooks_set_aside(self):  # torch's own packing of the param groups, without running the hooks twice
            sd = super().state_dict()
        # (as plain dicts; on a process group gathered, with the entries that are no parameter's)
        sd["state"] = self._topology.state_entries(sd["state"], self.param_groups, self._buckets, self.state,
                                                   self._transport)
        full.add_compact_moments(sd["state"], self.param_groups, self._buckets)
        for k, entry in full.ahead_entries(self.param_groups, self._buckets, ahead).items():
            sd["state"][k] = {**sd["state"].get(k, {}), **entry}  # (a wrapper's keys in the entry stay)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from this class or from ``torch.optim.AdamW``/``Adam``, into the host buffers in place.

        Everything is validated first; an invalid state dict raises ``ValueError`` and changes nothing. Parameters
        without an entry start fresh, as in AdamW; a missing ``master`` is taken from the parameter. With a
        ``process_group``, each rank copies only the piece it owns: no collective. Gradients that backward already
        sent (with ``release_grads``, the only copy) and a pending ``clip_grad_norm_`` are kept for the next
        ``step()``, as AdamW keeps ``.grad``.

        Args:
            state_dict (dict): with ``"state"`` and ``"param_groups"``, as returned by ``state_dict()``.
        """
        full.check_format(state_dict)
        self._topology.adopt_switched(self)
        self._mode.check_load()
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        plan = full.plan_load(self.param_groups, self._buckets, state_dict, self._rule, self._topology.local_value,
                              self.defaults)
        # Allocate before changing anything: an allocation failure must leave the optimizer as it was. (A new
        # buffer, amsgrad's, is zero-filled and not yet in any state entry, so adding it changes nothing visible.)
        for group, buckets in zip(plan.groups, self._buckets):
            for bucket in buckets:
                bucket.ensure_buffers(self._rule.needed(self._rule.hyper(group)))
        self._quiesce()
        full.apply_load(self.state, self._buckets, plan)
        self.param_groups = plan.groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _settle(self, homes: bool = False) -> None:
        """Wait for the updates ``overlap_step`` started in backward: they write the state (and the parameters)
        being read, and a save must not catch a bucket half updated (re-raises the first one that failed). With
        ``homes``, also for the state still on its way back to its home (a parked bucket's write-back), before the
        host reads it."""
        self._mode.settle()
        if homes:
            self._settle_homes()

    def _before_edits(self, homes: bool) -> None:
        """Before ``opt.state``'s edits are looked at (:func:`~zero_offload.checkpoint.entries.sync_state`): an
        update still pending is applied; with ``homes`` (edits to write), every home settled too."""
        self._mode.flush(self.state)
        if homes:
            self._settle_homes()

    def _settle_homes(self) -> None:
        """Every bucket's state in its home before the host reads or writes it: a parked bucket's write-back still
        in flight has landed (and device copies brought up early are let go)."""
        if type(self.state) is StateMap:
            self.state.landing = None
        for bucket in chain.from_iterable(self._buckets):
            bucket.home.settle()

    def _quiesce(self) -> None:
        """Before the state is replaced: no update running, none pending, no copy reading the buffers. The step's
        gradients stay in their lanes (AdamW keeps ``.grad`` over a load; with ``release_grads`` the host buffers
        hold the only copy), and so does a pending clip, whose coefficient AdamW would have applied to ``.grad``
        already: the next ``step()`` updates the loaded state with them."""
        self._mode.drop()  # a pending update of the old trajectory
        self._transport.synchronize()
        self._settle_homes()  # (a parked bucket's state brought up in backward is the old one)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """The optimizer state for ``torch.distributed.checkpoint`` (DCP), nothing gathered and no collective: a
        run saved on N ranks resumes on M ranks, or in one process. Each state tensor is 1-D (the parameter's
        elements in memory order), a :class:`~zero_offload.checkpoint.FlatPiece` holding this rank's piece (a
        :class:`~zero_offload.checkpoint.WholePiece`, a plain tensor, where the bucket is not sharded), a view of the
        host buffers, which ``dcp.save`` reads in place. ``dcp.load`` writes into staging (the live state is
        untouched if it fails part way; while staged, the state it loads takes its memory once more); then call
        :meth:`load_sharded_state_dict`, which makes it the optimizer's. With ``delayed_update``, as
        :meth:`state_dict`, with ``param`` in every entry. See docs/multi-gpu.md."""
        self._topology.check_flat_checkpoint("sharded_state_dict")
        self._settle(homes=True)
        self._sync()
        return dcp.sharded_state_dict(self.param_groups, self._buckets, self._mode.ahead(),
                                      param=self.options.delayed_update)

    def load_sharded_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Finish loading a :meth:`sharded_state_dict` that ``dcp.load`` filled: validate, then make what it staged
        the optimizer's state (the staging buffers trade their memory with the live ones: no copy), and apply the
        step counts and hyperparameters. Local. An invalid dict raises ``ValueError`` and changes nothing; the
        step's gradients are kept, as by :meth:`load_state_dict`.

        Args:
            state_dict (dict): the dict returned by :meth:`sharded_state_dict` after ``dcp.load`` filled it.
        """
        self._topology.check_flat_checkpoint("load_sharded_state_dict")
        self._mode.check_load()
        groups, steps, tensors = dcp.plan_sharded_load(self.param_groups, self._buckets, state_dict,
                                                       self._rule, self.options.delayed_update, self.defaults)
        self._quiesce()
        dcp.commit_staged(state_dict)
        dcp.apply_sharded_load(self.state, self._buckets, steps, groups, tensors)
        self.param_groups = groups

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError("OffloadOptimizer cannot be pickled or deep-copied: its state lives in host buffers bound to "
                        "the parameters. Save and restore it with state_dict() / load_state_dict().")


@contextlib.contextmanager
def _hooks_set_aside(opt: torch.optim.Optimizer):
    """``torch.optim.Optimizer.state_dict`` without its hooks, which :meth:`OffloadOptimizer.state_dict` runs
    around its own completion of the dict."""
    pre, post = opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks
    opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = type(pre)(), type(post)()
    try:
        yield
    finally:
        opt._optimizer_state_dict_pre_hooks, opt._optimizer_state_dict_post_hooks = pre, post


