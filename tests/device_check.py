"""A device checker for the CUDA stand-ins (tests/cuda_standins.py): on a CPU-only machine, which tensors would be
in GPU memory on a real GPU, and an error where an op would mix them with host tensors (torch raises at once on a
GPU; on the stand-ins every tensor is a CPU tensor, so nothing does).

A tensor is *on the device* when it is a view of memory marked so: the model's parameters and the user's data
(marked by the test, :meth:`DeviceCheck.mark`), what is allocated for the stand-in device (``torch.empty(...,
device=<stand-in>)``), and what an op computes from device tensors. Everything else is host memory. Then, while the
check is on:

* an op other than a copy (``copy_``, ``_foreach_copy_``, ``.to()``) that reads device and host tensors together
  raises :class:`CrossDevice` (a host tensor of no dimensions, which CUDA ops take as a scalar, aside);
* ``t.device`` and ``t.is_cuda`` of a device tensor say ``cuda`` (the stand-in device), as on a GPU, so the code's
  CUDA branches run, ``torch.empty(n, device=p.device)`` allocates on the device and ``t.to(p.device)`` moves there;
  ``t.to("cpu")`` and ``t.cpu()`` of a device tensor are copies to the host;
* each read of a device tensor's value on the host (``.item()``, ``float(t)``, ``.tolist()``, ``bool(t)``: a host
  synchronisation on a GPU) is counted, with where it came from.

What it cannot see: streams and events (the stand-ins order nothing), pinned memory, and anything done in native
code that takes tensors without torch's dispatch (the CPU kernel refuses device tensors itself: it reads
``t.device``).
"""

from __future__ import annotations

import collections
import os
import traceback
from pathlib import Path
from typing import Any, Dict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import cuda_standins
import zero_offload

__all__ = ["CrossDevice", "DeviceCheck"]

aten = torch.ops.aten

# Ops that move data between host and device: any mix is what they are for.
_COPIES = {aten.copy_.default, aten._foreach_copy_.default, aten._to_copy.default, aten.copy.default,
           aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
           aten._has_compatible_shallow_copy_type.default}
# Reads of a value on the host: of a scalar (then the tensor's device does not matter), or a comparison (``equal``,
# whose two tensors must be on one device).
_SCALARS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
_READS = _SCALARS | {aten.equal.default}


# Where a frame's file lies, by the packages' own folders (not by a folder's name: a venv inside a checkout
# named zero_offload puts torch under ``.../zero_offload/.venv/``).
_ROOTS = (("zero_offload", f"{Path(zero_offload.__file__).parent}{os.sep}"),
          ("torch/optim", f"{Path(torch.optim.__file__).parent}{os.sep}"))
_TORCH = f"{Path(torch.__file__).parent}{os.sep}"


class CrossDevice(RuntimeError):
    """An op read GPU and host tensors together (torch raises on a GPU)."""


def _storage_key(t: torch.Tensor) -> int:
    """The storage itself, not its address: memory given back and allocated again (``untyped_storage().resize_``,
    as the parked home's device copies are between steps) stays where it was."""
    return t.untyped_storage()._cdata


class DeviceCheck:
    """The marks and counts of one test (see the module docstring). Use as a context manager, with the stand-ins
    installed."""

    def __init__(self) -> None:
        self._device: Dict[int, Any] = {}  # storage -> the storage (kept: its key is never reused)
        self.reads: "collections.Counter[str]" = collections.Counter()
        self.stand_in = torch.device("cuda", 0)  # (what ``t.device`` of a device tensor says)

    # -- marks -------------------------------------------------------------------------------------------------------
    def mark(self, *tensors: torch.Tensor) -> None:
        """These tensors (and every view of their memory) are on the device."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                self._device[_storage_key(t)] = t.untyped_storage()

    def on_device(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0
                and _storage_key(t) in self._device)

    def _unmark(self, t: torch.Tensor) -> None:
        self._device.pop(_storage_key(t), None)

    # -- on and off --------------------------------------------------------------------------------------------------
    def __enter__(self) -> "DeviceCheck":
        self._wrap_allocations()
        self._function = _Functions(self)
        self._dispatch = _Dispatch(self)
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)
        for name, made in self._saved.items():
            setattr(torch, name, made)
        cuda_standins.Device.__eq__ = self._eq

    def _wrap_allocations(self) -> None:
        """The stand-ins' ``torch.empty`` / ``torch.zeros`` make a CPU tensor for the stand-in device: marked here."""
        self._saved = {name: getattr(torch, name) for name in ("empty", "zeros")}
        self._eq = cuda_standins.Device.__eq__
        # The layouts' stand-in device equals what ``t.device`` of a device tensor now says (a parameter that has not
        # moved), besides the CPU device.
        cuda_standins.Device.__eq__ = lambda d, other: (other is d or other == torch.device("cpu")
                                                        or other == torch.device("cuda", 0))

        def wrap(make):
            def made(*args, **kwargs):
                out = make(*args, **kwargs)
                if _is_stand_in(kwargs.get("device")):
                    self.mark(out)
                return out
            return made

        for name, make in self._saved.items():
            setattr(torch, name, wrap(make))

    def _count_read(self) -> None:
        """One host read of a device value, under the innermost frame of ours (``zero_offload/<file>:<line>``), of
        a ``torch.optim`` class's own code (``torch/optim/<file>:<line>``: a class run on the GPU reads what it
        reads there too), or of the test."""
        for frame in reversed(traceback.extract_stack()[:-1]):
            name = frame.filename
            if name.endswith("device_check.py"):
                continue
            for label, root in _ROOTS:
                if name.startswith(root):
                    self.reads[f"{label}/{Path(name).relative_to(root).as_posix()}:{frame.lineno}"] += 1
                    return
            if not name.startswith(_TORCH):
                self.reads["test"] += 1
                return

    def ours(self) -> int:
        """The host reads of device values counted under ``zero_offload``'s own code."""
        return sum(n for where, n in self.reads.items() if where.startswith("zero_offload/"))


def _is_stand_in(x: Any) -> bool:
    return (isinstance(x, cuda_standins.Device) or (isinstance(x, str) and x.startswith("cuda"))
            or (isinstance(x, torch.device) and x.type == "cuda"))


_DEVICE, _IS_CUDA = torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__  # (compared with ==: made anew)


class _Functions(TorchFunctionMode):
    """The Python-level calls: ``.device`` / ``.is_cuda`` of device tensors, allocations and moves to the stand-in
    device, moves to the host, host reads that bypass the dispatcher (``tolist``)."""

    def __init__(self, check: DeviceCheck):
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self.check
        if (func == _DEVICE or func == _IS_CUDA) and args and check.on_device(args[0]):
            return check.stand_in if func == _DEVICE else True
        if func is torch.Tensor.tolist and args and check.on_device(args[0]):
            check._count_read()
        to_device = _is_stand_in(kwargs.get("device"))
        if to_device:
            kwargs = {**kwargs, "device": "cpu"}
        if func in (torch.Tensor.to, torch.Tensor.cuda) and len(args) > 1 and _is_stand_in(args[1]):
            args, to_device = (args[0], "cpu", *args[2:]), True
        if func is torch.Tensor.cuda:
            func, to_device = torch.Tensor.to, True
            args = (args[0], "cpu", *args[1:])
        to_host = (func is torch.Tensor.cpu or (func is torch.Tensor.to and _names_cpu(args[1:], kwargs))) \
            and check.on_device(args[0])
        out = func(*args, **kwargs)
        if to_host:  # a copy on a GPU (here the same tensor would come back)
            out = out.clone() if _same_memory(out, args[0]) else out
            check._unmark(out)
        elif to_device:
            if func is torch.Tensor.to and not check.on_device(args[0]) and _same_memory(out, args[0]):
                out = out.clone()  # (a copy on a GPU: here the same tensor would come back)
            tree_map(lambda t: check.mark(t) if isinstance(t, torch.Tensor) else None, out)
        return out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _names_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor) or target is None:
        return False
    return str(target) == "cpu"


class _Dispatch(TorchDispatchMode):
    """Every aten op: a mix of device and host tensors raises, outputs of device inputs are device tensors, host
    reads of device values are counted."""

    def __init__(self, check: DeviceCheck):
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self.check
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        dev = [t for t in tensors if check.on_device(t)]
        if func in _READS and dev:
            check._count_read()
        if dev and func not in _COPIES and func not in _SCALARS:
            host = [t for t in tensors if not check.on_device(t) and not (t.dim() == 0 and t.device.type == "cpu")]
            if host:
                raise CrossDevice(f"{func} read tensors on the GPU {[tuple(t.shape) for t in dev][:4]} and on the host "
                                  f"{[tuple(t.shape) for t in host][:4]} together (torch raises on a GPU)")
        out = func(*args, **kwargs)
        if dev and (func not in _COPIES or func is aten._to_copy.default):
            # (``_to_copy`` too: a dtype change stays where it is; ``.to("cpu")`` is unmarked by _Functions)
            outs, _ = tree_flatten(out)
            for t in outs:
                if isinstance(t, torch.Tensor) and not check.on_device(t):
                    check.mark(t)
        return out
