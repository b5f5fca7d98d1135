"""zero_offload: ZeRO-Offload for any PyTorch training loop.

Swap ``torch.optim.AdamW(...)`` for ``zero_offload.OffloadOptimizer(...)``: fp32 masters and Adam moments live in
pinned host memory and a fused SIMD CPU-Adam kernel updates them. ``zero_offload.offload(optimizer_class, params,
**kwargs)`` does the same for other elementwise optimizers (``zero_offload.Lion``, ``torch.optim.SGD``, ...).

Importing this package is cheap: it compiles nothing and does not initialise CUDA. The native kernel is built
(or loaded from cache) on first use.
"""

from zero_offload import functional
from zero_offload.lion import Lion
from zero_offload.factory import offload
from zero_offload.optimizer import OffloadOptimizer

__version__ = "0.1.0"

__all__ = ["Lion", "OffloadOptimizer", "functional", "offload", "__version__"]
