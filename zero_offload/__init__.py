"""zero_offload: ZeRO-Offload for any PyTorch training loop.

Swap ``torch.optim.AdamW(...)`` for ``zero_offload.OffloadOptimizer(...)``: fp32 masters and Adam moments live in
pinned host memory and a fused SIMD CPU-Adam kernel updates them.

Importing this package is cheap: it compiles nothing and does not initialise CUDA. The native kernel is built
(or loaded from cache) on first use.
"""

from zero_offload import functional
from zero_offload.lion import Lion
from zero_offload.optimizer import OffloadOptimizer

__version__ = "0.1.0"

__all__ = ["Lion", "OffloadOptimizer", "functional", "__version__"]
