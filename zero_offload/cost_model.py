"""``placement="auto"``'s cost model: which home each GPU bucket's step is cheapest in, from rates measured on the
machine at hand (the CPU kernel's elements per second with its threads, pinned host-to-device bytes per second), the
first step's arrival times (when backward made each bucket's gradients final) and the GPU's room.

The step after backward waits for two things: the host kernels of the buckets stepped on the host (their gradients'
copies overlap backward; the global clip and inf/nan verdict come only after the last gradient, so every host kernel
runs after backward, one after another), and the state of the parked buckets coming up (a bucket's reload starts when
its gradients are final, on the upload stream, one after another; the GPU steps it once it has landed). A resident
bucket waits for neither. So:

* **resident**: the last buckets to arrive, as many as fit in the memory the step never uses (free, plus the
  allocator's cache, less the step's peak and ``gpu_margin_gib``): they have no time to hide anything behind;
* **parked**: then, in arrival order (the earliest have the most backward left to hide their reload behind), each
  bucket whose move from the host shortens the tail ``max(host kernels after backward, reloads after backward)``,
  while the parked state fits in the memory backward has freed by ``step()`` (and the resident room left) and its
  write-back is down before the next forward needs that memory back;
* **host**: the rest.

The write-backs: each parked bucket's state goes down on the copy stream once the GPU has stepped it (once its reload
has landed and backward has ended), one after another. The next forward takes back the memory backward freed, so
the parked state beyond the room the step leaves must be down by the end of that forward (``forward``: the first
steps' measure of it): else the allocator would wait for the copies (a device-wide wait on the hot path). That bound
is a condition, not a cost.

With a GPU step of a few milliseconds for a whole 1.3B model (fused AdamW, 13-17 ms), its own time is left out.
A bucket's reload costs its parked bytes (8 per parameter for fp32 parameters, 12 with a separate fp32 master), its
write-back as much again. Sharded, a bucket in either GPU home also holds its shard of the reduced gradients through the
step (``BucketCost.held_bytes``): counted in the room it takes, not in the bytes it moves.
``benchmarks/step_model.py`` runs the same plan through the event model of a measured step.
"""

from __future__ import annotations

import math
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from zero_offload.host_memory import empty_host

__all__ = ["ASSUMED_FROM", "ASSUMED_RATES", "BucketCost", "Rates", "measure_copy_rate", "measure_kernel_rate",
           "plan_homes", "rates_here"]


class Rates(NamedTuple):
    """What the machine does per second: ``kernel`` elements through the CPU kernel (fp32 state, all its threads),
    ``upload`` pinned host-to-device bytes, ``download`` device-to-pinned-host bytes."""

    kernel: float
    upload: float
    download: float


# The rates a prediction assumes where it cannot measure them (no GPU here): the H100 host of the first lease, as the
# event model of benchmarks/step_model.py is calibrated to it (../shared/gpu/model/sim.py, its r0 and up_alone).
ASSUMED_RATES = Rates(kernel=4.91e9, upload=50.6e9, download=50.6e9)
ASSUMED_FROM = ("the H100 host of the first lease, a 16-core Xeon with AVX-512, where our kernel took 258-275 ms over "
                "1.31B elements and a pinned copy alone ran at 50.6 GB/s (docs/placement.md)")


def rates_here(measure: bool = True) -> Tuple[Rates, str]:
    """The rates of this machine and where they come from: with a GPU (and ``measure``), measured now (the CPU
    kernel with its threads as set, pinned copies to and from GPU 0: a second or two, and the kernel's build if it
    is not cached); else :data:`ASSUMED_RATES`, said so (:data:`ASSUMED_FROM`)."""
    if not measure or not torch.cuda.is_available():
        return ASSUMED_RATES, f"assumed ({'no GPU here' if measure else 'not measured'}): {ASSUMED_FROM}"
    device = torch.device("cuda", 0)
    rates = Rates(measure_kernel_rate(), measure_copy_rate(device), measure_copy_rate(device, up=False))
    return rates, (f"measured here: our kernel at {torch.get_num_threads()} threads, pinned copies to and from "
                   f"{torch.cuda.get_device_name(device)}")


class BucketCost(NamedTuple):
    """One GPU bucket as the model sees it: its elements, the bytes its parked state takes (and moves each way),
    the bytes its resident state would add to the GPU, when backward made its gradients final (seconds, any
    origin; None: not sent in backward, final when backward ends), and the bytes a parked bucket holds on the GPU
    through the step beside its state without moving them (sharded: the rank's shard of the reduced gradients,
    which ``resident_bytes`` counts too)."""

    numel: int
    parked_bytes: int
    resident_bytes: int
    arrival: Optional[float]
    held_bytes: int = 0


def plan_homes(buckets: Sequence[BucketCost], rates: Rates, resident_room: float, parked_room: float,
               forward: float = 0.0) -> List[str]:
    """Each bucket's home (``"resident"``, ``"parked"``, ``"host"``; see the module docstring). ``resident_room``:
    bytes the step's peak never uses; ``parked_room``: bytes backward has freed by ``step()``; ``forward``: seconds
    the next forward takes before it has claimed them back (0: at once)."""
    end = max((b.arrival for b in buckets if b.arrival is not None), default=0.0)  # backward's end
    arrival = [end if b.arrival is None else b.arrival for b in buckets]
    # (Ties, as buckets backward did not send: the last built first, as backward makes their gradients.)
    order = sorted(range(len(buckets)), key=lambda i: (arrival[i], -i))
    homes = ["host"] * len(buckets)
    room = resident_room
    for i in reversed(order):  # the last to arrive first, while they fit
        if buckets[i].resident_bytes > room:
            break
        room -= buckets[i].resident_bytes
        homes[i] = "resident"
    parked_room += room  # (what the resident buckets left is free through the step too)
    kernels = sum(buckets[i].numel for i in order if homes[i] == "host") / rates.kernel
    # The upload stream's clock (when the reloads so far have landed), the download stream's after backward's end
    # (when their write-backs are down) and the parked bytes so far.
    reloaded, written, used = -math.inf, 0.0, 0.0
    for i in order:
        if homes[i] != "host":
            continue
        b = buckets[i]
        done = max(arrival[i], reloaded) + b.parked_bytes / rates.upload
        down = max(written, done - end) + b.parked_bytes / rates.download
        left = kernels - b.numel / rates.kernel
        tail = max(left, done - end)
        late = down - room / rates.download > max(tail, 0.0) + forward  # (the forward would wait for memory)
        held = b.parked_bytes + b.held_bytes
        if used + held > parked_room or late or tail >= max(kernels, reloaded - end):
            break
        homes[i], kernels, reloaded, written, used = "parked", left, done, down, used + held
    return homes


def measure_kernel_rate(numel: int = 1 << 22) -> float:
    """Elements per second of the CPU kernel (fp32 state and gradient, its threads as set), over ``numel`` scratch
    elements, the best of three runs."""
    from zero_offload import functional

    params, grads = torch.zeros(numel), torch.full((numel,), 1e-3)
    m, v = torch.zeros(numel), torch.zeros(numel)
    best = float("inf")
    for step in range(1, 4):
        start = time.perf_counter()
        functional.cpu_adam_(params, grads, m, v, step=step, lr=1e-3)
        best = min(best, time.perf_counter() - start)
    return numel / best


def measure_copy_rate(device: torch.device, nbytes: int = 1 << 26, up: bool = True) -> float:
    """Bytes per second of a copy from pinned host memory to ``device`` (``up``) or back (the best of three, timed
    by CUDA events)."""
    host = empty_host(nbytes, torch.uint8, pin=True)  # (as the state's buffers are pinned, given back when freed)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, src = (gpu, host) if up else (host, gpu)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best
