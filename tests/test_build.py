"""Build and import behaviour: cheap import, the native kernel builds where a toolchain exists, and a missing or
failing compiler degrades to the pure-torch path with one clear warning and the same results."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zero_offload import _build

REPO = Path(__file__).resolve().parents[1]


def _run(code, env_extra=None, tmp_path=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ZERO_OFFLOAD_SIMD", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


def test_import_is_lean():
    result = _run("""
        import sys, torch
        import zero_offload, zero_offload.functional
        assert not torch.cuda.is_initialized(), "import initialised CUDA"
        assert not zero_offload._build._attempted, "import tried to load or build the kernel"
        assert "zero_offload_cpu_adam" not in sys.modules
        print("lean")
    """)
    assert result.returncode == 0, result.stderr
    assert "lean" in result.stdout


def test_native_kernel_builds_where_a_toolchain_exists():
    """If a compiler and ninja are here, the kernel must build: a build failure must not hide behind the
    fallback (the ISA tests would skip, not fail)."""
    problem = _build._toolchain_problem()
    if problem:
        pytest.skip(problem)
    assert _build.load_native() is not None, _build.status().detail
    assert "scalar" in _build.native_isas()


_FALLBACK_CHECK = """
    import warnings, torch
    warnings.simplefilter("always")
    from zero_offload import functional, _build, _torch_fused
    torch.manual_seed(0)
    n = 4097
    ref = torch.randn(n).requires_grad_(True)
    p, m, v = ref.detach().clone(), torch.zeros(n), torch.zeros(n)
    opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    with warnings.catch_warnings(record=True) as caught:
        for step in range(1, 11):
            g = torch.randn(n)
            ref.grad = g.clone()
            opt.step()
            functional.cpu_adam_(p, g, m, v, step=step, lr=1e-2, weight_decay=0.01)
            torch.testing.assert_close(p, ref.detach())
    # torch's own fused CPU AdamW where this torch has one (>= 2.4), else the pure-torch reference.
    assert functional.resolve_path() == ("torch-fused" if _torch_fused.AVAILABLE else "torch")
    print("STATE", _build.status().state)
    print("WARNINGS", len([w for w in caught if "native CPU-Adam kernel is unavailable" in str(w.message)]))
    print("MESSAGE", [str(w.message) for w in caught if "native CPU-Adam kernel" in str(w.message)][:1])
"""


def test_hidden_compiler_falls_back_with_one_warning(tmp_path):
    if (Path(_build.__file__).parent / "_C.so").exists():
        pytest.skip("a prebuilt extension is installed")
    result = _run(_FALLBACK_CHECK, {"CXX": "/nonexistent/c++", "ZERO_OFFLOAD_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "STATE failed" in result.stdout
    assert "WARNINGS 1" in result.stdout  # once, not once per call
    assert "no C++ compiler found" in result.stdout
    # The warning says what runs instead and how much slower it is.
    assert "x slower" in result.stdout
    if torch.__version__ >= (2, 4):
        assert "torch's fused CPU AdamW" in result.stdout


def test_failing_compiler_falls_back_with_its_reason(tmp_path):
    fake = tmp_path / "fake-cxx"
    # Answers version queries like a real compiler, fails every compilation.
    fake.write_text('#!/bin/sh\ncase "$*" in *" -c "*) echo "fake-cxx: error: simulated compiler failure" >&2; '
                    'exit 1;; esac\necho "g++ (fake) 12.2.0"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        pytest.skip("ninja missing: the build cannot even start")
    result = _run(_FALLBACK_CHECK, {"CXX": str(fake), "ZERO_OFFLOAD_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert "STATE failed" in result.stdout
    assert "simulated compiler failure" in result.stdout


def test_forcing_an_isa_without_a_build_is_an_error(tmp_path):
    result = _run("""
        from zero_offload import functional
        try:
            functional.resolve_path()
        except RuntimeError as exc:
            print("ERROR", exc)
    """, {"CXX": "/nonexistent/c++", "ZERO_OFFLOAD_CACHE_DIR": str(tmp_path), "ZERO_OFFLOAD_SIMD": "scalar"})
    assert "ERROR ZERO_OFFLOAD_SIMD=scalar asks for the native kernel" in result.stdout, result.stdout + result.stderr


def test_report_runs():
    result = _run("import runpy; runpy.run_module('zero_offload.report', run_name='__main__')")
    assert result.returncode == 0, result.stderr
    for key in ("torch ", "cpu features", "native kernel", "path chosen", "threads", "cuda"):
        assert key in result.stdout


def test_checkouts_with_identical_sources_share_one_build(tmp_path):
    """The JIT cache is keyed on the sources' content, flags, torch and Python, not on where the sources are: a
    second checkout (or venv, or installed copy) with the same sources reuses the build instead of paying a
    compile, and the build compiles a staged copy, so build.ninja does not name either checkout."""
    if _build._toolchain_problem():
        pytest.skip(_build._toolchain_problem())
    assert _build.load_native() is not None, _build.status().detail
    if _build.status().state == "prebuilt":
        pytest.skip("a prebuilt extension is installed")
    copy = tmp_path / "checkout"
    (copy / "zero_offload").mkdir(parents=True)
    (copy / "csrc").mkdir()
    for f in (REPO / "zero_offload").glob("*.py"):
        (copy / "zero_offload" / f.name).write_bytes(f.read_bytes())
    for name in _build.SOURCES + _build.HEADERS:
        (copy / "csrc" / name).write_bytes((_build.source_dir() / name).read_bytes())
    env = dict(os.environ, PYTHONPATH=str(copy))
    env.pop("ZERO_OFFLOAD_SIMD", None)
    code = "from zero_offload import _build; _build.load_native(); s = _build.status(); print(s.state, s.cache_dir)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["jit-cached", str(_build.cache_dir())], out.stdout + out.stderr
    ninja = (_build.cache_dir() / "build.ninja").read_text()
    assert str(REPO) not in ninja and str(copy) not in ninja


def test_setup_loads_the_build_config_for_the_ahead_of_time_build(tmp_path):
    """setup.py reads _build.py's sources and flags with ZERO_OFFLOAD_BUILD_EXT=1 (its dataclass needs the module
    registered in sys.modules); the wheel itself is built, installed and used in .ci/run."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__}: pyproject.toml needs >= 77 (pip provides it when building)")
    env = dict(os.environ, ZERO_OFFLOAD_BUILD_EXT="1")
    out = subprocess.run([sys.executable, str(REPO / "setup.py"), "--version"], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == __import__("zero_offload").__version__


def test_compile_messages_go_through_logging(tmp_path, monkeypatch, caplog, capsys):
    """The JIT build's two messages are log records of logger ``zero_offload`` (filterable, and shown by Python's
    last-resort handler when logging is unconfigured), not prints."""
    import types

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("ZERO_OFFLOAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_build, "_status", _build.BuildStatus())  # this process's real status stays as it was
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: types.SimpleNamespace(name=kw["name"]))
    with caplog.at_level("INFO", logger="zero_offload"):
        _build._jit_build()
    messages = [r.getMessage() for r in caplog.records if r.name == "zero_offload"]
    assert any("compiling the CPU-Adam kernel" in m for m in messages), messages
    assert any("CPU-Adam kernel built in" in m for m in messages), messages
    assert capsys.readouterr().err == ""


def test_cpu_without_a_simd_unit_never_runs_the_scalar_loop_where_torch_fused_is_faster(monkeypatch):
    """A CPU for which the native kernel has only its scalar loop (x86 without AVX2, ARM other than AArch64, ...):
    auto dispatch sends fp32 state to torch's vectorized fused AdamW, and bf16/8-bit state, which torch's kernel does
    not do, to the scalar loop rather than the slower pure-torch reference; report says so."""
    from zero_offload import _torch_fused, functional

    if not _torch_fused.AVAILABLE or "scalar" not in _build.native_isas():
        pytest.skip("needs torch's fused CPU AdamW and the native kernel")
    real = _build.load_native()
    calls = []

    class Spy:  # the native module, recording which entry point ran on which ISA
        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.append((name, args[0]))
                return getattr(real, name)(*args, **kwargs)
            return call

    monkeypatch.delenv("ZERO_OFFLOAD_SIMD", raising=False)
    monkeypatch.setattr(_build, "native_isas", lambda: ["scalar"])
    monkeypatch.setattr(_build, "load_native", lambda: Spy())
    fused = []
    monkeypatch.setattr(_torch_fused, "adam_", lambda *args, **kwargs: fused.append(kwargs["step"]))
    assert [functional.resolve_path(d) for d in (torch.float32, torch.bfloat16, torch.int8)] == [
        "torch-fused", "scalar", "scalar"]
    assert functional.path_reason().startswith("torch-fused for fp32 state, scalar for bf16/8-bit state: ")

    n = 4097
    p, g = torch.randn(n), torch.randn(n)
    functional.cpu_adam_(p, g, torch.zeros(n), torch.zeros(n), step=1, lr=1e-3)
    assert fused == [1] and calls == []
    functional.cpu_adam_(p, g, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16), step=2,
                         lr=1e-3)
    functional.cpu_adam_segments_(p, [g[:64], g[64:]], [0, 64], torch.zeros(n, dtype=torch.int8),
                                  torch.zeros(n, dtype=torch.uint8), step=3, lr=1e-3,
                                  exp_avg_scale=torch.zeros(functional.q8_scale_numel(n)),
                                  exp_avg_sq_scale=torch.zeros(functional.q8_scale_numel(n)))
    assert fused == [1] and calls == [("adam_step", "scalar"), ("adam_step_segments", "scalar")]
