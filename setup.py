"""Install zero_offload.

By default nothing is compiled here: the CPU-Adam kernel is built just in time, on first use, into torch's
extension cache. To compile it ahead of time into the package (``zero_offload._C``), with torch already installed:

    ZERO_OFFLOAD_BUILD_EXT=1 pip install --no-build-isolation .

Either way the flags are portable (no -march=native); the kernel picks AVX-512, AVX2 or scalar code at run time.
"""

import importlib.util
import os
import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def _build_config():
    """zero_offload/_build.py, loaded on its own (it imports only the standard library at module level), so the
    source list and flags of the ahead-of-time build are the JIT build's."""
    spec = importlib.util.spec_from_file_location("_zero_offload_build", ROOT / "zero_offload" / "_build.py")
    module = importlib.util.module_from_spec(spec)
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
            extra_compile_args=cfg.CFLAGS,
            extra_link_args=cfg.LDFLAGS,
        )
    )
    cmdclass["build_ext"] = BuildExtension

version = re.search(r'__version__ = "([^"]+)"', (ROOT / "zero_offload" / "__init__.py").read_text()).group(1)

setup(
    name="zero_offload",
    version=version,
    description="ZeRO-Offload for any PyTorch training loop: a drop-in AdamW with state in pinned host memory",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["zero_offload", "zero_offload.*"]),
    install_requires=["torch>=2.3", "pybind11", "ninja"],
    # integrations: what tests/test_integrations.py and examples/ need (Hugging Face Trainer, Lightning); the
    # torch.compile test needs only torch and a C++ compiler. Install with torch pinned on the same line, e.g.
    # `pip install torch==2.13.0 -e ".[integrations]"`, so pip never swaps the installed torch.
    extras_require={"test": ["pytest"], "demo": ["matplotlib"], "bench": ["matplotlib"],
                    "integrations": ["transformers", "accelerate", "lightning"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
