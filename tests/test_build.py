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


def test_every_package_is_declared_for_the_wheel():
    """pyproject.toml lists the packages a wheel (or ``pip install .``) carries: an editable install finds a
    subpackage missing from that list anyway, a wheel leaves it out and ``import zero_offload`` fails there."""
    tomllib = pytest.importorskip("tomllib")
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "zero_offload").rglob("__init__.py")}
    assert found == declared, (f"in the tree, not declared: {sorted(found - declared)}; "
                               f"declared, not in the tree: {sorted(declared - found)}")


# ------------------------------------------------------------------------------------------- the JIT cache --
# Most cache tests replace the compile step with a tiny stand-in (a .py "extension" written after an optional
# sleep), so they exercise the real key, lock, rename and manifest logic in seconds; the module-scoped fixture
# below runs the one real compile of this file (and kills another one midway).

def fake_compile(build, seconds=0.0):
    """Stands in for ``_build._compile``: writes an importable module into ``build`` and names it."""
    import time

    time.sleep(seconds)
    (Path(build) / "fake_kernel.py").write_text("def available_isas():\n    return ['scalar']\n")
    return "fake_kernel.py"


_FAKE = """
    import os, sys, time
    from pathlib import Path
    from zero_offload import _build
    def _fake(build):
        release = os.environ.get("FAKE_BUILD_UNTIL")  # a file the test creates when the build may end
        deadline = time.monotonic() + 120
        while release and not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        (Path(build) / "fake_kernel.py").write_text("def available_isas():\\n    return ['scalar']\\n")
        return "fake_kernel.py"
    _build._compile = _fake
    _build.load_native()
    s = _build.status()
    print("STATE", s.state)
    print("DETAIL", s.detail)
    print("DIR", s.cache_dir)
"""


def _start(code, env_extra, new_session=False, stderr=subprocess.PIPE):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    env.pop("ZERO_OFFLOAD_SIMD", None)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=new_session)


def _wait_for(predicate, timeout, what):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def fresh_status(monkeypatch, tmp_path):
    """An in-process build into an empty cache with the stand-in compile; this process's real status untouched."""
    monkeypatch.setenv("ZERO_OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_compile", fake_compile)

    def build():
        monkeypatch.setattr(_build, "_status", _build.BuildStatus())
        module = _build._jit_build()
        return module, _build.status()

    return build


def test_cache_root_honours_both_variables(monkeypatch, tmp_path):
    monkeypatch.delenv("ZERO_OFFLOAD_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_ext"))
    assert _build.cache_root() == tmp_path / "torch_ext" / "zero_offload"
    monkeypatch.setenv("ZERO_OFFLOAD_CACHE_DIR", str(tmp_path / "ours"))  # ours wins
    assert _build.cache_root() == tmp_path / "ours"
    assert _build.cache_dir().parent == tmp_path / "ours"


def test_cache_key_names_no_path():
    """The key is made of what changes the binary; where the sources, the venv or torch live is not part of it."""
    import json

    text = json.dumps(_build.build_inputs())
    for path in (REPO, Path(torch.__file__).parent, Path(sys.prefix), Path(sys.executable).parent):
        assert str(path) not in text, (path, text)


def test_checkouts_with_identical_sources_have_one_key(tmp_path):
    copy = tmp_path / "checkout"
    (copy / "zero_offload").mkdir(parents=True)
    (copy / "csrc").mkdir()
    for f in (REPO / "zero_offload").rglob("*.py"):  # (subpackages too: state/, rules/)
        dest = copy / "zero_offload" / f.relative_to(REPO / "zero_offload")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
    for name in _build.SOURCES + _build.HEADERS:
        (copy / "csrc" / name).write_bytes((_build.source_dir() / name).read_bytes())
    env = dict(os.environ, PYTHONPATH=str(copy))
    code = "from zero_offload import _build; print(_build.__file__); print(_build.cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(copy / "zero_offload" / "_build.py"), str(_build.cache_dir())]


def test_status_says_why_a_build_ran(fresh_status, monkeypatch, caplog, capsys):
    """First use, then a build for another torch, for changed sources, then the cached one: each says so, in the
    status and in the log line (a record of logger ``zero_offload``, not a print) that announces the compile."""
    with caplog.at_level("WARNING", logger="zero_offload"):
        module, st = fresh_status()
    assert module.available_isas() == ["scalar"]
    assert (st.state, st.detail.split(":")[0]) == ("jit-built", "first use")
    assert st.summary().startswith("jit-built now in ")
    messages = [r.getMessage() for r in caplog.records if r.name == "zero_offload"]
    assert any("compiling the CPU-Adam kernel (first use" in m for m in messages), messages
    assert any("CPU-Adam kernel built in" in m for m in messages), messages

    real = _build.build_inputs()
    monkeypatch.setattr(_build, "build_inputs", lambda: {**real, "torch": "9.9.9+cpu (git 0, cxx11 abi 1)"})
    caplog.clear()
    with caplog.at_level("WARNING", logger="zero_offload"):
        _, st = fresh_status()
    assert st.state == "jit-built"
    assert st.detail == f"another torch ({real['torch']} -> 9.9.9+cpu (git 0, cxx11 abi 1))"
    assert any(f"compiling the CPU-Adam kernel ({st.detail})" in r.getMessage() for r in caplog.records)

    monkeypatch.setattr(_build, "build_inputs", lambda: {**real, "sources": "0123456789abcdef"})
    _, st = fresh_status()
    assert (st.state, st.detail) == ("jit-built", "the C++ sources changed")

    monkeypatch.setattr(_build, "build_inputs", lambda: real)
    caplog.clear()
    with caplog.at_level("WARNING", logger="zero_offload"):
        _, st = fresh_status()
    assert st.state == "jit-cached" and st.detail.endswith(f"by {sys.executable}"), st
    assert not caplog.records  # nothing compiled, nothing said
    root = _build.cache_root()
    assert len(list(root.glob("*/manifest.json"))) == 3 and not list(root.glob(".build-*"))
    assert capsys.readouterr().err == ""


def test_an_older_versions_builds_are_named_not_reused(fresh_status):
    old = _build.cache_root() / "0123456789abcdef"
    old.mkdir(parents=True)
    (old / "build.ninja").write_text("")
    (old / "zero_offload_cpu_adam.so").write_text("")
    _, st = fresh_status()
    assert st.state == "jit-built"
    assert st.detail == f"first use of this zero_offload's cache: 1 older build(s) in {_build.cache_root()} are not reused"


def test_a_failed_build_leaves_nothing_behind(fresh_status, monkeypatch):
    def broken(build):
        (Path(build) / "half.o").write_text("")
        raise RuntimeError("error: simulated")

    monkeypatch.setattr(_build, "_compile", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        fresh_status()
    root = _build.cache_root()
    assert sorted(p.name for p in root.iterdir()) == [f"{_build.cache_key()}.lock"]


def test_planted_stale_locks_do_not_block(tmp_path):
    """A lock file left by a dead process (ours, with a holder that no longer runs) and torch's ``lock`` left in
    the build folder by a killed older build: neither is waited for."""
    import time

    root = tmp_path / "cache"
    root.mkdir()
    key = _build.cache_key()
    (root / f"{key}.lock").write_text(f"999999 deadhost {time.time() - 7200}\n")
    (root / key).mkdir()
    (root / key / "lock").write_text("")
    os.utime(root / key / "lock", (time.time() - 7200,) * 2)
    proc = _start(_FAKE, {"ZERO_OFFLOAD_CACHE_DIR": str(root), "ZERO_OFFLOAD_BUILD_WAIT": "30"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "STATE jit-built" in out, out + err
    assert f"DETAIL {root / key} held an unfinished build, cleared first" in out
    assert (root / key / "manifest.json").is_file() and not (root / key / "lock").exists()


def test_a_lock_held_too_long_ends_in_the_fallback_naming_it(tmp_path):
    """A live process holding the build lock (a hung build) is waited for ZERO_OFFLOAD_BUILD_WAIT seconds, then
    the fallback runs, with one warning that names the lock, its holder and its age."""
    root = tmp_path / "cache"
    root.mkdir()
    lock = root / f"{_build.cache_key()}.lock"
    holder = _start(f"""
        import fcntl, os, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{{os.getpid()}} somehost {{time.time() - 300}}".encode())
        print("held", flush=True)
        time.sleep(120)
    """, {})
    try:
        assert holder.stdout.readline().strip() == "held"
        never = "\n    _build._compile = lambda build: 1 / 0  # the lock is never had: no build\n"
        check = _FALLBACK_CHECK.replace("_torch_fused\n", "_torch_fused" + never, 1)
        result = _run(check, {"ZERO_OFFLOAD_CACHE_DIR": str(root), "ZERO_OFFLOAD_BUILD_WAIT": "2"})
    finally:
        holder.kill()
        holder.communicate()
    assert result.returncode == 0, result.stderr
    assert "STATE failed" in result.stdout and "WARNINGS 1" in result.stdout, result.stdout
    assert f"gave up after 2 s waiting for the build lock {lock} (pid {holder.pid} on somehost, held for " \
        in result.stdout, result.stdout
    assert "another process is building the CPU-Adam kernel" in result.stderr  # said at once, not after the wait
    assert not list(root.glob("*/manifest.json"))


def test_a_waiter_loads_what_another_process_built(tmp_path):
    """Two processes asking at once: one builds, the other waits for it and loads its build (one build). The
    build ends only once the waiter has said it waits, so a slow start of the waiter cannot find it finished."""
    root = tmp_path / "cache"
    release, w_err_file = tmp_path / "release", tmp_path / "waiter.err"
    env = {"ZERO_OFFLOAD_CACHE_DIR": str(root), "FAKE_BUILD_UNTIL": str(release)}
    builder = _start(_FAKE, env)
    try:
        _wait_for(lambda: list(root.glob(".build-*")), 120, "the first process to start building")
        with open(w_err_file, "w") as w_err_sink:
            waiter = _start(_FAKE, env, stderr=w_err_sink)
            try:
                _wait_for(lambda: "another process is building" in w_err_file.read_text(), 120,
                          "the second process to say it waits")
                release.touch()
                w_out, _ = waiter.communicate(timeout=120)
            finally:
                waiter.kill()
        b_out, b_err = builder.communicate(timeout=120)
    finally:
        builder.kill()
    w_err = w_err_file.read_text()
    assert "STATE jit-built" in b_out, b_out + b_err
    assert "STATE jit-cached" in w_out, w_out + w_err
    assert "another process is building the CPU-Adam kernel" in w_err
    assert len(list(root.glob("*/manifest.json"))) == 1


def _kill_leftover_compilers(root):
    """SIGKILL the compiler processes a killed build left running: ninja starts each command in its own process
    group, so killing the builder's group does not reach them (they would only burn CPU into a dead folder)."""
    import signal

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(root) in cmdline:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(scope="module")
def killed_then_built(tmp_path_factory):
    """This file's one real compile. A build is SIGKILLed midway with its process group (as a scheduler's time
    limit or ``timeout -s KILL`` does), then ``python -m zero_offload.report`` runs in a fresh process with
    ``ZERO_OFFLOAD_BUILD_WAIT=60``: it must build, not wait for the dead one."""
    import signal
    import time

    problem = _build._toolchain_problem()
    if problem:
        pytest.skip(problem)
    if (Path(_build.__file__).parent / "_C.so").exists() or list(Path(_build.__file__).parent.glob("_C*.so")):
        pytest.skip("a prebuilt extension is installed")
    work = tmp_path_factory.mktemp("real_build")
    root = work / "cache"
    env = {"ZERO_OFFLOAD_CACHE_DIR": str(root), "ZERO_OFFLOAD_BUILD_WAIT": "60"}
    victim = _start("from zero_offload import _build; _build.load_native()", env, new_session=True)
    try:
        # torch writes build.ninja just before it starts ninja: from then on the compilers are running.
        _wait_for(lambda: list(root.glob(".build-*/build.ninja")), 300, "the build to start compiling")
        time.sleep(3)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.communicate(timeout=60)
    finally:
        victim.kill()
        _kill_leftover_compilers(root)
    after_kill = {
        "returncode": victim.returncode,
        "finished": list(root.glob(f"*/{_build.MANIFEST}")),
        "leftovers": list(root.glob(".build-*")),
        "torch_lock_left": [d for d in root.glob(".build-*") if (d / "lock").exists()],
        "lock_file": list(root.glob("*.lock")),
    }
    env_all = dict(os.environ, PYTHONPATH=str(REPO), **env)
    env_all.pop("ZERO_OFFLOAD_SIMD", None)
    report = subprocess.run([sys.executable, "-m", "zero_offload.report"], env=env_all, capture_output=True,
                            text=True, timeout=900, cwd=work)
    return {"root": root, "env": env_all, "after_kill": after_kill, "report": report, "work": work}


def _report_line(stdout, key):
    return next(ln for ln in stdout.splitlines() if ln.startswith(key))[len(key):].strip()


def test_a_build_killed_mid_compile_does_not_block_the_next_run(killed_then_built):
    k = killed_then_built["after_kill"]
    assert k["returncode"] == -9 and not k["finished"]
    # It died holding both locks: its own (released by the kernel with it) and torch's FileBaton, which the
    # killed build left behind in its private folder, where nobody waits for it.
    assert k["lock_file"] and k["torch_lock_left"], k
    report, root = killed_then_built["report"], killed_then_built["root"]
    assert report.returncode == 0, report.stderr
    assert "compiling the CPU-Adam kernel (first use" in report.stderr
    assert _report_line(report.stdout, "native kernel").startswith(f"jit-built now in "), report.stdout
    assert _report_line(report.stdout, "native kernel").endswith(f"(first use: no build in {root} yet)")
    assert _report_line(report.stdout, "native ISAs") != "none"
    (manifest,) = root.glob(f"*/{_build.MANIFEST}")
    assert _report_line(report.stdout, "build cache").startswith(str(manifest.parent) + " ")
    assert not list(root.glob(".build-*")), "the killed build's folder was not cleared"


def _second_venv(venv):
    """A new venv whose torch is a link in its own site-packages (so at another path than this interpreter's) and
    whose other packages are this interpreter's. Not ``--system-site-packages``: that reaches the base
    interpreter's packages, and when this one is itself a venv (the README's commands run in one), torch's
    dependencies are in this venv, not in the base. Its own site-packages come first, so its torch is the link."""
    import site

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    own = Path(subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True, timeout=120).stdout.strip())
    os.symlink(Path(torch.__file__).parent, own / "torch")
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    ours = [d for d in site.getsitepackages() + user if os.path.isdir(d)]
    # addsitedir, not bare paths: it also runs those folders' .pth files (editable installs, namespace packages).
    (own / "first_env.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in ours))
    return python, own


def test_a_second_venv_with_torch_at_another_path_shares_the_build(killed_then_built):
    """A venv whose torch is at another path (a link in its own site-packages) loads the first one's build:
    nothing compiled, and the report says whose build it is."""
    import json

    work, root = killed_then_built["work"], killed_then_built["root"]
    assert killed_then_built["report"].returncode == 0
    venv = work / "venv2"
    python, site = _second_venv(venv)
    code = "import sys, torch; print(sys.prefix); print(torch.__file__)"
    where = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, timeout=300,
                           env=killed_then_built["env"]).stdout.split()
    assert where[0] == str(venv) and where[1].startswith(str(site)), where
    report = subprocess.run([str(python), "-m", "zero_offload.report"], env=killed_then_built["env"],
                            capture_output=True, text=True, timeout=600, cwd=work)
    assert report.returncode == 0, report.stderr
    assert "compiling" not in report.stderr, report.stderr
    (manifest,) = root.glob(f"*/{_build.MANIFEST}")
    built = json.loads(manifest.read_text())
    assert built["built_by"] == sys.executable
    line = _report_line(report.stdout, "native kernel")
    assert line.startswith("jit-cached (built ") and line.endswith(f" by {sys.executable})"), line
    assert _report_line(report.stdout, "build cache").startswith(str(manifest.parent) + " ")


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
