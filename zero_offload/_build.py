"""Getting the native CPU-Adam kernel: prebuilt extension, else a just-in-time build, else an explained failure.

Nothing here runs at import. ``load_native()`` is called on the first kernel call and caches its outcome:

1. ``zero_offload._C``, compiled ahead of time by ``ZERO_OFFLOAD_BUILD_EXT=1 pip install .``;
2. a JIT build with ninja through ``torch.utils.cpp_extension.load`` into a cache folder keyed by a hash of the
   sources' content, flags, torch and Python versions (not by where the sources are: every venv and checkout
   with the same sources shares one build), so a rebuild happens exactly when one of them changes;
   two log records (logger ``zero_offload``, WARNING) say that it is compiling and how long it took;
3. if that fails (no compiler, no ninja, a compile error), ``None``, with the reason kept in ``status()`` and
   one warning. Import never breaks.

Both builds use portable flags (no ``-march=native``): each ISA's kernel is its own translation unit compiled
under ``#pragma GCC target`` and the CPU is asked at run time which to use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import List, Optional

EXTENSION_NAME = "zero_offload_cpu_adam"
SOURCES = ("cpu_adam.cpp", "bindings.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_neon.cpp", "isa_scalar.cpp")
HEADERS = ("cpu_adam.h", "kernel_args.h", "simd.h", "cpu_adam_kernel.h")
# -fopenmp: at::parallel_for is inline OpenMP code; without it the kernel silently runs on one thread.
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)


@dataclasses.dataclass
class BuildStatus:
    """What happened when the native kernel was asked for."""

    state: str = "not loaded yet"  # "prebuilt", "jit-built", "jit-cached", "failed", "not loaded yet"
    detail: str = ""
    seconds: float = 0.0
    cache_dir: Optional[str] = None


logger = logging.getLogger("zero_offload")
_lock = threading.Lock()
_status = BuildStatus()
_module: Optional[ModuleType] = None
_attempted = False


def source_dir() -> Path:
    """Folder holding the C++ sources: packaged copy when installed, the repository's csrc/ in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"zero_offload: C++ sources not found next to {here}")


def cache_dir() -> Path:
    """Build folder for this exact combination of sources (their content only, not where they are), flags, torch
    and Python (``ZERO_OFFLOAD_CACHE_DIR`` overrides the root, which defaults to torch's extension cache), so every
    venv, worktree and installed copy with the same sources and torch shares one build."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("ZERO_OFFLOAD_CACHE_DIR") or os.path.join(get_default_build_root(), "zero_offload")
    digest = hashlib.sha256()
    src = source_dir()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((src / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS + (torch.__version__, sys.version)).encode())
    return Path(root) / digest.hexdigest()[:16]


def _stage_sources(build: Path) -> Path:
    """The sources copied into the build folder, compiled from there: torch writes their absolute paths into
    build.ninja, so compiling each checkout's own copy would make checkouts sharing the folder rewrite it and
    rebuild (and race) on every switch. Files are written once (atomically) and never touched again: a fresh mtime
    would make ninja rebuild."""
    staged, src = build / "src", source_dir()
    staged.mkdir(parents=True, exist_ok=True)
    for name in SOURCES + HEADERS:
        target = staged / name
        if not target.is_file():
            tmp = staged / f".{name}.{os.getpid()}.tmp"
            shutil.copyfile(src / name, tmp)
            os.replace(tmp, target)
    return staged


def _toolchain_problem() -> Optional[str]:
    """A precise reason when the JIT build cannot even start, else None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found (looked for {compiler!r}; set CXX or install g++/clang++)"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _short_reason(exc: BaseException) -> str:
    """The compiler's own words: the lines of the build log that say what went wrong."""
    output = getattr(exc, "output", None)  # subprocess errors keep the tool's own output here
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    text = str(exc) + ("\n" + output if output else "")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # Compiler diagnostics ("error:") say the most; ninja's FAILED command lines are long and say little.
    for pick in (lambda ln: "error:" in ln.lower(), lambda ln: "error" in ln.lower() or "not found" in ln.lower()):
        key = [ln[:200] for ln in lines if pick(ln)]
        if key:
            return " | ".join(dict.fromkeys(key[:3]))
    return " | ".join(ln[:200] for ln in lines[:3]) or type(exc).__name__


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    build = cache_dir()
    src = _stage_sources(build)
    _status.cache_dir = str(build)
    fresh = not any(build.glob(f"{EXTENSION_NAME}*.so"))
    if fresh:
        # WARNING, not INFO: a first use stalls for about a minute, which must not look like a hang when logging
        # is left unconfigured (Python then shows WARNING and above).
        logger.warning("zero_offload: compiling the CPU-Adam kernel (first use, about a minute; cached in %s) ...",
                       build)
    start = time.perf_counter()
    module = load(
        name=EXTENSION_NAME,
        sources=[str(src / name) for name in SOURCES],
        # Copies: torch appends its own libraries to the list it is given, which would change the cache key.
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(src)],
        build_directory=str(build),
        verbose=False,
    )
    _status.seconds = time.perf_counter() - start
    _status.state = "jit-built" if fresh else "jit-cached"
    if fresh:
        logger.warning("zero_offload: CPU-Adam kernel built in %.1f s", _status.seconds)
    return module


def load_native() -> Optional[ModuleType]:
    """The native module, building it on first use; None (with one warning) if it cannot be had."""
    global _module, _attempted
    if _attempted:
        return _module
    with _lock:
        if _attempted:
            return _module
        try:
            from zero_offload import _C  # type: ignore[attr-defined]

            _module, _status.state = _C, "prebuilt"
        except ImportError:
            problem = _toolchain_problem()
            if problem is None:
                try:
                    _module = _jit_build()
                except Exception as exc:  # a failed build must never break the caller
                    problem = _short_reason(exc)
            if _module is None:
                _status.state, _status.detail = "failed", problem or "unknown"
                warnings.warn(f"zero_offload: the native CPU-Adam kernel is unavailable ({_status.detail}); "
                              f"{fallback_summary()} `python -m zero_offload.report` shows details.",
                              RuntimeWarning, stacklevel=3)
        _attempted = True
        return _module


def fallback_summary() -> str:
    """What runs instead of the native kernel, and how much slower it is (measured on a 2-core AVX2 machine, 16M
    elements per update: native 38 ms, torch's fused 94 ms, the pure-torch reference 1.3-3.5 s)."""
    from zero_offload import _torch_fused

    if _torch_fused.AVAILABLE:
        return ("using torch's fused CPU AdamW for fp32 state (same results, about 2.5x slower than the native "
                "kernel) and the pure-torch reference for bf16/8-bit state (30x slower or more).")
    return "using the pure-torch reference (same results, 30x slower or more; torch >= 2.4 has a faster fallback)."


def status() -> BuildStatus:
    return _status


def native_isas() -> List[str]:
    """ISAs the loaded native module can run on this CPU, best first; empty without the module."""
    module = load_native()
    return list(module.available_isas()) if module is not None else []
