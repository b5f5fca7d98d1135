"""Install zero_offload.

By default nothing is compiled here: the CPU-Adam kernel is built just in time, on first use, into torch's
extension cache. To compile it ahead of time into the package (``zero_offload._C``), with torch already installed:

    ZERO_OFFLOAD_BUILD_EXT=1 pip install --no-build-isolation .

Either way the flags are portable (no -march=native); the kernel picks AVX-512, AVX2 or scalar code at run time.
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _build_config():
    """zero_offload/_build.py, loaded on its own (it imports only the standard library at module level), so the
    source list and flags of the ahead-of-time build are the JIT build's."""
    name = "_zero_offload_build"
    spec = importlib.util.spec_from_file_location(name, ROOT / "zero_offload" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their own module up in sys.modules.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class BuildPyWithSources(build_py):
    """Ships csrc/ inside the package as zero_offload/_csrc, so an installed (non-editable) copy can JIT-build."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "zero_offload" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for f in CSRC.iterdir():
            if f.suffix in (".h", ".cpp"):
                shutil.copy2(f, target / f.name)


cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
if os.environ.get("ZERO_OFFLOAD_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    cfg = _build_config()
    ext_modules.append(
        CppExtension(
            "zero_offload._C",
            [str(Path("csrc") / name) for name in cfg.SOURCES],
            include_dirs=[str(CSRC)],
            extra_compile_args=list(cfg.CFLAGS),
            extra_link_args=list(cfg.LDFLAGS),
        )
    )
    cmdclass["build_ext"] = BuildExtension

# Metadata (name, version, dependencies, license, classifiers) is in pyproject.toml; this file adds only the
# ahead-of-time extension and the shipped C++ sources.
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
