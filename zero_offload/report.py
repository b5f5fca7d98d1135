"""``python -m zero_offload.report``: what this machine has, what was built, and which path the kernel takes.

Paste its output into bug reports. It builds (or loads from cache) the native kernel, so its first run may take
a minute.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import List, Tuple

import torch

import zero_offload
from zero_offload import _build, functional


def cpu_features() -> Tuple[str, List[str]]:
    """CPU model name and the SIMD features the kernel cares about, from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    wanted = ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16", "avx2", "fma", "f16c",
              "asimd", "asimdhp", "sve", "bf16"]
    return model, [f for f in wanted if f in flags]


def lines() -> List[str]:
    model, flags = cpu_features()
    out = [
        f"zero_offload     {zero_offload.__version__}",
        f"torch            {torch.__version__}",
        f"python           {sys.version.split()[0]} on {platform.platform()}",
        f"cpu              {model}, {os.cpu_count()} logical cores",
        f"cpu features     {' '.join(flags) or 'none detected'}",
        f"threads          {torch.get_num_threads()} (torch.set_num_threads / OMP_NUM_THREADS)",
    ]
    _build.load_native()
    st = _build.status()
    build = st.state + (f" in {st.seconds:.1f} s" if st.state == "jit-built" else "")
    out.append(f"native kernel    {build}{': ' + st.detail if st.detail else ''}")
    out.append(f"build cache      {st.cache_dir or '-'}")
    out.append(f"native ISAs      {', '.join(_build.native_isas()) or 'none'}")
    forced = os.environ.get("ZERO_OFFLOAD_SIMD")
    try:
        chosen = functional.resolve_path()
    except (ValueError, RuntimeError) as exc:
        chosen = f"error: {exc}"
    out.append(f"path chosen      {chosen}" + (f" (forced by ZERO_OFFLOAD_SIMD={forced})" if forced else ""))
    if torch.cuda.is_available():
        out.append(f"cuda             {torch.version.cuda}, {torch.cuda.device_count()} device(s): "
                   f"{torch.cuda.get_device_name(0)}")
        try:
            torch.empty(1, pin_memory=True)
            out.append("pinned memory    available")
        except RuntimeError as exc:
            out.append(f"pinned memory    unavailable: {exc}")
    else:
        out.append("cuda             not available (pinned host memory needs CUDA; host buffers are pageable)")
    return out


def main() -> None:
    print("\n".join(lines()))


if __name__ == "__main__":
    main()
