"""Host memory for the offloaded optimizer state: exact-size (optionally pinned) flat buffers, and what they will
cost before any of them is allocated.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's pinned caching allocator rounds every request up to a
power of two, so a 5 GiB master buffer takes 8 GiB of page-locked RAM, and it keeps freed blocks cached for
reuse. Optimizer state is allocated once and lives as long as the optimizer, so neither behaviour helps. Here a
buffer is an ordinary CPU tensor of exactly the requested size (PyTorch's CPU allocator aligns it to 64 bytes),
or, pinned, an anonymous memory map of its size rounded up to whole pages, page-locked in place with
``cudaHostRegister`` and unregistered just before the map is released.

Every buffer is a whole storage that starts at its first element (no offset, no neighbour): two buffers of the
same size and pinning can trade their memory with :func:`~zero_offload._compat.take_memory`, and every view of
either follows (a checkpoint load commits its staged state so, see :mod:`zero_offload.checkpoint.staging`). A
pinned buffer's registration belongs to its memory, not to a tensor: it is undone when the memory is released,
whichever storage holds it then.

Large unpinned buffers (from 8 MiB and four huge pages) start on a huge-page boundary (2 MiB on x86-64) and are
advised to the kernel as huge-page memory (``madvise(MADV_HUGEPAGE)``, which takes effect where the system's
transparent huge pages are ``madvise`` or ``always``): the step streams every buffer once, and on 4 KiB pages it
took 1.09x as long (``benchmarks/optimizer_step.py``, docs/memory.md). ``ZERO_OFFLOAD_HUGE_PAGES=0`` keeps them on
ordinary pages. Pinned buffers stay shared maps on ordinary pages. A fork splits the huge pages of a private map
that the parent then writes (copy-on-write goes page by page), until the kernel's khugepaged rebuilds them.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import logging
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_offload.home_costs import HomeCost

__all__ = ["empty_host", "huge_pages", "huge_pages_on", "huge_page_bytes", "env_flag", "is_registered",
           "HostMemoryEstimate", "estimate_bucket", "available_host_bytes", "address_space_room", "format_bytes",
           "copy_many_"]

logger = logging.getLogger("zero_offload")

# data_ptr -> registered bytes (whole pages) of every buffer this process pinned and has not unregistered yet.
# Registration state is kept here rather than asked of the driver so that tests and reports need no CUDA call.
_registered: Dict[int, int] = {}


def _unregister(ptr: int) -> None:
    # Runs when the memory is released (see _PinnedMap), which may be at interpreter exit, after the CUDA runtime
    # has begun tearing down: errors are logged, never raised.
    if _registered.pop(ptr, None) is None:
        return
    try:
        # A copy to or from this buffer may still be in flight (an optimizer dropped right after step(), or while
        # a backward it streamed was failing): the memory must not go back to the system under it.
        torch.cuda.synchronize()
    except Exception as exc:  # pragma: no cover - shutdown ordering
        logger.debug("zero_offload: synchronize before freeing pinned memory failed: %s", exc)
    try:
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(err) != 0:
            logger.debug("zero_offload: cudaHostUnregister(%#x) returned %s", ptr, err)
    except Exception as exc:  # pragma: no cover - shutdown ordering
        logger.debug("zero_offload: cudaHostUnregister(%#x) failed: %s", ptr, exc)


HUGE_PAGE = 2 << 20  # bytes: x86-64's and (4 KiB granule) arm64's transparent huge page
HUGE_FROM = 8 << 20  # bytes: buffers this large get huge pages (aligning costs address space, not resident RAM)
_THP = "/sys/kernel/mm/transparent_hugepage"
HUGE_PAGES_ENV = "ZERO_OFFLOAD_HUGE_PAGES"
_FALSE, _TRUE = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def env_flag(name: str, default: bool, on: str, off: str) -> bool:
    """The environment variable ``name`` as a boolean, as users write one (any case): ``false``, ``no``, ``off``,
    ``0`` (``00``...) are off; ``true``, ``yes``, ``on``, ``1`` on; unset or empty (a launcher's template left
    blank): ``default``. Anything else raises ``ValueError`` naming it and what each value does (``on``, ``off``):
    a typo must not silently decide."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    value = text.strip().lower()
    if value.isdigit() and int(value) in (0, 1):
        value = str(int(value))
    if value in _FALSE or value in _TRUE:
        return value in _TRUE
    raise ValueError(f"Invalid {name}={text!r}: expected 1, true, yes or on ({on}) or 0, false, no or off ({off})")


class _HostMap(mmap.mmap):
    """Anonymous memory holding one buffer: its storage holds this object (its buffer), so the memory goes back to
    the system exactly when the last storage holding it goes."""


class _PinnedMap(_HostMap):
    """A :class:`_HostMap` page-locked from ``ptr``: unregistered first when released."""

    ptr = 0

    def __del__(self) -> None:
        _unregister(self.ptr)


def huge_pages_on() -> bool:
    """``ZERO_OFFLOAD_HUGE_PAGES`` (unset: on); a value that is no boolean raises ``ValueError`` naming it."""
    return env_flag(HUGE_PAGES_ENV, True, "large buffers on huge pages", "every buffer on ordinary pages")


@functools.lru_cache(maxsize=None)
def huge_page_bytes(root: str = _THP) -> Optional[int]:
    """The system's transparent huge page size (2 MiB on x86-64 and 4 KiB-page arm64, 512 MiB with 64 KiB pages);
    None where it has none (no such kernel feature, another OS)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        with open(os.path.join(root, "hpage_pmd_size")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _wants_huge(nbytes: int) -> Optional[int]:
    """The huge page size a buffer of ``nbytes`` is aligned to, or None: ordinary pages (a buffer under
    ``HUGE_FROM`` or under four huge pages, no huge pages here, or ``ZERO_OFFLOAD_HUGE_PAGES`` off)."""
    size = huge_page_bytes()
    if size is None or nbytes < max(HUGE_FROM, 4 * size) or not huge_pages_on():
        return None
    return size


def huge_pages(root: str = _THP) -> str:
    """What becomes of large host buffers here, in words (the report's line): advised as huge pages, and whether the
    system's transparent huge pages (``enabled`` under ``root``) let that take effect; or why not."""
    size = huge_page_bytes(root)
    if size is None:
        return "not on this system (no transparent huge pages): host buffers on ordinary pages"
    try:
        if not huge_pages_on():
            return f"off ({HUGE_PAGES_ENV}={os.environ[HUGE_PAGES_ENV]}): host buffers on ordinary pages"
    except ValueError as exc:
        return f"error: {exc}"
    try:
        with open(os.path.join(root, "enabled")) as f:
            setting = next((w[1:-1] for w in f.read().split() if w.startswith("[")), "unknown")
    except OSError:
        setting = "unknown"
    what = (f"unpinned host buffers of {format_bytes(max(HUGE_FROM, 4 * size))} or more advised (system setting: "
            f"{setting})")
    if setting == "never":
        return what + ", to no effect: they stay on ordinary pages"
    return what + f"; {HUGE_PAGES_ENV}=0 turns it off"


def _mapped(numel: int, dtype: torch.dtype, kind: type, huge: Optional[int]) -> Tuple[torch.Tensor, mmap.mmap]:
    """``numel`` elements of anonymous memory zero-filled by the system, and their map (a ``kind``): starting on
    a page, or with ``huge`` (a huge page's size) on a huge page, the range advised as huge-page memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = -(-numel * itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    offset = 0
    if not huge:
        memory = kind(-1, span)
    else:  # (private: a shared anonymous map is shmem, whose huge pages the system's shmem_enabled governs)
        memory = kind(-1, span + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        offset = -torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr() % huge
        try:
            memory.madvise(mmap.MADV_HUGEPAGE, offset, span)
        except OSError as exc:  # (a kernel without transparent huge pages)
            logger.debug("zero_offload: madvise(MADV_HUGEPAGE) failed: %s", exc)
    return torch.frombuffer(memory, dtype=dtype, count=numel, offset=offset), memory


def empty_host(numel: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """A flat, uninitialised CPU tensor of exactly ``numel`` elements, page-locked when ``pin``, that is a whole
    storage starting at its first element.

    Pinned buffers are anonymous memory maps of their page-rounded size (``cudaHostRegister`` works on whole pages
    and refuses a page already registered, which two small buffers from the same heap page would hit), zero-filled
    by the system; the cost is under one page per buffer. The registration is undone when the memory is released
    (see :class:`_PinnedMap`), however many views of it are alive until then. Unpinned buffers of ``HUGE_FROM``
    bytes or more are private maps on huge pages (see the module docstring); smaller ones come from torch's CPU
    allocator.

    Args:
        numel (int): number of elements (not rounded up).
        dtype (torch.dtype): element type.
        pin (bool): page-lock the memory with ``cudaHostRegister`` so that host<->device copies from and to it
            are asynchronous. Needs CUDA. Default: False.

    Returns:
        Tensor: a 1-D contiguous CPU tensor of ``numel`` elements.
    """
    numel = int(numel)
    if not pin or numel == 0:
        huge = _wants_huge(numel * torch.empty((), dtype=dtype).element_size()) if numel else None
        if huge:
            return _mapped(numel, dtype, _HostMap, huge)[0]
        return torch.empty(numel, dtype=dtype, device="cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("zero_offload: pinned host memory was requested but CUDA is not available")
    buf, memory = _mapped(numel, dtype, _PinnedMap, None)
    ptr, span = buf.data_ptr(), -(-buf.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    err = torch.cuda.cudart().cudaHostRegister(ptr, span, 0)
    if int(err) != 0:
        _clear_last_cuda_error()
        raise RuntimeError(
            f"zero_offload: cudaHostRegister of {format_bytes(span)} failed ({err}); the limit on locked memory "
            "(ulimit -l, container memlock) may be too low, or pass pin_memory=False"
        )
    _registered[ptr] = span
    memory.ptr = ptr
    return buf


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's per-thread "last error" after a failed call that was handled here.

    Left set, PyTorch's next kernel-launch check (``cudaGetLastError``) would raise it as that kernel's own error,
    so a caller that catches the failure (to retry unpinned, or to try a smaller model) would fail later anyway.
    torch's cudart bindings have no ``cudaGetLastError``, so it is called in the ``libcudart`` torch loaded. Best
    effort: with a statically linked runtime there is none to find, and nothing is done."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line.rsplit("/", 1)[-1]}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception as exc:  # pragma: no cover - depends on how CUDA was linked
        logger.debug("zero_offload: could not reset the CUDA error state: %s", exc)


def is_registered(t: torch.Tensor) -> bool:
    """Whether ``t`` lies inside a buffer page-locked by :func:`empty_host` that is still registered."""
    ptr = t.data_ptr()
    return any(base <= ptr < base + size for base, size in _registered.items())


def available_host_bytes() -> Optional[int]:
    """Host RAM this process can still take: ``MemAvailable`` from ``/proc/meminfo`` (Linux), capped by the room
    left under the memory limit of its cgroup where a container sets one (which ``/proc/meminfo`` ignores) and under
    its address-space limit (``ulimit -v``); None where none is known."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    known = [b for b in (avail, cgroup_room(), address_space_room()) if b is not None]
    return min(known) if known else None


def address_space_room() -> Optional[int]:
    """Bytes of address space this process may still map under its ``RLIMIT_AS`` (``ulimit -v``): the soft limit
    less its current size (``VmSize`` in ``/proc/self/status``); None without a limit, or where either is unknown.
    Every buffer is a new mapping (or heap growth) that counts against it, touched or not."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):  # (no resource module on Windows)
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    try:
        with open("/proc/self/status") as f:
            size = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), None)
    except (OSError, ValueError):
        return None
    return None if size is None else max(0, soft - size)


# (limit, usage, stats, reclaimable page cache key) for cgroup v2, then v1.
_CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                  "total_inactive_file"))


def cgroup_room(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes left under this cgroup's memory limit (the limit less the usage, inactive page cache counting as
    free, as the kernel reclaims it first); None without a limit or a readable cgroup."""
    for limit_name, usage_name, stat_name, inactive_key in _CGROUP_FILES:
        try:
            with open(os.path.join(root, limit_name)) as f:
                limit = f.read().strip()
            if limit == "max":
                return None
            limit_bytes = int(limit)
            if limit_bytes >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2**63 - 1
                return None
            with open(os.path.join(root, usage_name)) as f:
                usage = int(f.read().strip())
            inactive = 0
            with open(os.path.join(root, stat_name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive_key:
                        inactive = int(value)
                        break
            return max(0, limit_bytes - usage + inactive)
        except (OSError, ValueError):
            continue
    return None


# Buffers that are not optimizer state: gradients, parameter copies or storage.
_NOT_STATE = ("grad", "staging", "flat_grad", "params")


@dataclasses.dataclass(frozen=True)
class HostMemoryEstimate:
    """Host RAM an :class:`~zero_offload.OffloadOptimizer` allocates, computed from the same bucket layout that
    the allocation uses, so it is exact (to the byte) rather than a rule of thumb.

    Attributes:
        numel (int): parameter elements being optimized.
        padded_numel (int): elements per flat buffer summed over buckets, alignment padding included.
        buffers (Dict[str, int]): bytes per buffer kind: ``master``, the update rule's state buffers by name (in
            the state dtype; with 8-bit state also each one's float32 ``*_scale``), ``grad``
            (host gradient buffers), ``staging`` (low-precision parameter copies on the CPU or sharded) and
            ``grad_prev`` (``delayed_update``'s second gradient buffer);
            sharded over a process group (``world_size > 1``) these hold the rank's shard only, and a CPU bucket
            adds ``flat_grad`` (the full flat gradient buffer the reduce-scatter reads) and ``params`` (the rest of
            the full flat parameter buffer the parameters are views of, outside the rank's own slice).
        pinned_bytes (int): the part of the total that is page-locked.
        replaces_param_bytes (int): bytes of CPU parameter storage that become views of these buffers (fp32 CPU
            params live in ``master``, low-precision CPU params in ``staging``), so the process grows by
            ``total_bytes - replaces_param_bytes``.
        homes (Dict[str, HomeCost]): the buckets by home (``"host"``, ``"parked"``, ``"resident"``: see
            ``placement``), each home's host RAM and GPU memory, the bytes it copies each way per step and the
            elements the CPU kernel steps (:class:`~zero_offload.home_costs.HomeCost`; its ``seconds(rates)`` the
            predicted times).
    """

    numel: int
    padded_numel: int
    buffers: Dict[str, int]
    pinned_bytes: int
    replaces_param_bytes: int
    homes: Dict[str, HomeCost] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.buffers.values())

    @property
    def state_bytes(self) -> int:
        """Master weights and moments: what an fp32 AdamW would hold as parameters plus state."""
        return sum(v for k, v in self.buffers.items() if k not in _NOT_STATE)

    @property
    def bytes_per_param(self) -> float:
        return self.total_bytes / self.numel if self.numel else 0.0

    def __add__(self, other: "HostMemoryEstimate") -> "HostMemoryEstimate":
        keys = list(dict.fromkeys([*self.buffers, *other.buffers]))
        return HostMemoryEstimate(
            numel=self.numel + other.numel,
            padded_numel=self.padded_numel + other.padded_numel,
            buffers={k: self.buffers.get(k, 0) + other.buffers.get(k, 0) for k in keys},
            pinned_bytes=self.pinned_bytes + other.pinned_bytes,
            replaces_param_bytes=self.replaces_param_bytes + other.replaces_param_bytes,
            homes={k: self.homes.get(k, HomeCost()) + other.homes.get(k, HomeCost())
                   for k in dict.fromkeys([*self.homes, *other.homes])},
        )

    def describe(self) -> str:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.buffers.items() if v)
        return (
            f"{format_bytes(self.total_bytes)} of host RAM for {self.numel:,} parameters "
            f"({self.bytes_per_param:.2f} B/param: {parts}; pinned {format_bytes(self.pinned_bytes)})"
        )


class PlanOrMeasure:
    """The descriptor behind ``OffloadOptimizer.estimate_host_memory``: one name for "the host RAM this optimizer
    takes", asked before the optimizer exists (on the class, with ``params``: a plan, nothing allocated) or after
    (on an instance, without arguments: the buffers it holds, including groups added since)."""

    def __init__(self, plan, measure):
        self.plan, self.measure = plan, measure

    def __get__(self, obj, owner=None):
        if obj is None:
            return self.plan

        @functools.wraps(self.plan)
        def bound(params=None, **options):
            if params is not None:
                return self.plan(params, **options)
            if options:
                raise TypeError("opt.estimate_host_memory() takes no options: it measures the buffers this optimizer "
                                "holds; to plan other settings call OffloadOptimizer.estimate_host_memory(params, ...)")
            return self.measure(obj)

        return bound


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def estimate_bucket(
    numel: int,
    padded_numel: int,
    param_dtype: torch.dtype,
    *,
    on_cpu: bool,
    state: Dict[str, int],
    pin: bool,
    world_size: int = 1,
    delayed_update: bool = False,
    grad_buffer: bool = True,
    parked: bool = False,
    copied: bool = False,
) -> HostMemoryEstimate:
    """Bytes of one bucket's buffers; see :class:`HostMemoryEstimate`. ``state`` is the update rule's state
    buffers' bytes by name, from the rule's declarations (``zero_offload.state.store.state_bytes``, which the
    allocation uses too); this adds the master, the gradient buffers and the parameter copies.

    With ``world_size > 1``, ``padded_numel`` is the bucket's full padded length (a multiple of ``world_size``)
    and every state buffer holds ``padded_numel / world_size`` elements: the rank's shard. ``delayed_update`` adds
    the second gradient buffer it double-buffers with; without ``grad_buffer`` (FSDP2's host shards until one is
    needed) there is no gradient buffer. A ``parked`` bucket (stepped on its GPU, see ``placement``) keeps only its
    state on the host: the rule's buffers and, for low-precision parameters, the fp32 master (FSDP2's shards on a GPU
    whose storage the home could not take over, ``copied``: for fp32 ones too, which have a master of their own)."""
    low_precision = param_dtype != torch.float32
    # An unsharded CUDA bucket's kernel writes the low-precision parameter into the gradient buffer it reads
    # (buckets.FlatBucket.shares_grad): no staging buffer.
    staging = low_precision and (on_cpu or world_size > 1)
    grad_itemsize = torch.empty((), dtype=param_dtype).element_size()
    shard = padded_numel // world_size
    buffers = {"master": 4 * shard if not parked or low_precision or (copied and not on_cpu) else 0, **state}
    buffers.update({
        "grad": grad_itemsize * shard if grad_buffer and not parked else 0,
        "staging": grad_itemsize * shard if staging and not parked else 0,
        "grad_prev": grad_itemsize * shard if delayed_update else 0,
    })
    if world_size > 1 and on_cpu:
        buffers["flat_grad"] = grad_itemsize * padded_numel
        # The full flat parameter buffer; the rank's slice of it is the master (fp32) or the staging copy.
        buffers["params"] = grad_itemsize * (padded_numel - shard)
        pin = False  # nothing of a CPU bucket crosses to a device
    total = sum(buffers.values())
    replaced = numel * grad_itemsize if on_cpu else 0
    return HostMemoryEstimate(numel, padded_numel, buffers, total if pin else 0, replaced)


# ------------------------------------------------------------------------------------------- host copies --
# Tensors at least this large are copied with torch's own intra-op parallelism; smaller ones are spread over a
# few Python threads instead (torch runs them on the calling thread). Same value as at::internal::GRAIN_SIZE.
_PARALLEL_COPY_NUMEL = 32768

_pool: Optional[ThreadPoolExecutor] = None


def _copy_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < workers:  # noqa: SLF001 - sized once, grown if threads are raised
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zero_offload_copy")
    return _pool


def copy_many_(dsts: List[torch.Tensor], srcs: List[torch.Tensor], numels: Sequence[int]) -> None:
    """``dst.copy_(src)`` for CPU pairs (``numels[i]`` elements each), using every intra-op thread even when the
    tensors are small.

    Torch parallelises one copy only above its grain size, so thousands of small gradient copies would run on
    one core; here they are split into equal-element shares over ``torch.get_num_threads()`` threads (torch ops
    release the GIL). Large tensors are copied afterwards on the calling thread with torch's own parallelism, so
    the two kinds never oversubscribe the cores. Pairs in device memory (a device-tier bucket's) are one
    ``torch._foreach_copy_``.
    """
    if dsts and not dsts[0].is_cpu:
        torch._foreach_copy_(dsts, srcs)
        return
    if any(n >= _PARALLEL_COPY_NUMEL for n in numels):
        small = [i for i, n in enumerate(numels) if n < _PARALLEL_COPY_NUMEL]
        large = [i for i, n in enumerate(numels) if n >= _PARALLEL_COPY_NUMEL]
    else:
        small, large = list(range(len(numels))), []
    threads = torch.get_num_threads()
    cum = list(itertools.accumulate(numels[i] for i in small))
    if threads > 1 and len(small) > 16 and cum[-1] >= 4 * _PARALLEL_COPY_NUMEL:
        cuts = [0] + [bisect.bisect_left(cum, cum[-1] * k / threads) for k in range(1, threads)] + [len(small)]
        shares = [small[a:b] for a, b in zip(cuts, cuts[1:])]
        pool = _copy_pool(threads - 1)
        futures = [pool.submit(_copy_share, dsts, srcs, share) for share in shares[1:] if share]
        _copy_share(dsts, srcs, shares[0])
        for f in futures:
            f.result()
    else:
        _copy_share(dsts, srcs, small)
    _copy_share(dsts, srcs, large)


def _copy_share(dsts: List[torch.Tensor], srcs: List[torch.Tensor], which: Sequence[int]) -> None:
    if which:
        torch._foreach_copy_([dsts[i] for i in which], [srcs[i] for i in which])
