"""Getting the native CPU-Adam kernel: prebuilt extension, else a just-in-time build, else an explained failure.

Nothing here runs at import. ``load_native()`` is called on the first kernel call and caches its outcome:

1. ``zero_offload._C``, compiled ahead of time by ``ZERO_OFFLOAD_BUILD_EXT=1 pip install .``;
2. a JIT build (ninja, through ``torch.utils.cpp_extension.load``) into a cache shared by every process, venv and
   checkout of this machine, described below;
3. if that fails (no compiler, no ninja, a compile error, a build lock held too long), ``None``, with the reason
   kept in ``status()`` and one warning. Import never breaks.

Both builds use portable flags (no ``-march=native``): each ISA's kernel is its own translation unit compiled
under ``#pragma GCC target`` and the CPU is asked at run time which to use.

The JIT cache, and why it is not torch's own
--------------------------------------------
``torch.utils.cpp_extension.load`` serialises builders with a ``FileBaton``: a ``lock`` file created with
``O_EXCL`` in the build folder and deleted when the build ends. A process killed by a signal (``timeout``, a
scheduler's time limit, the OOM killer) never deletes it, and every later ``load`` of that folder waits for it to
disappear, forever. Its folder is also rebuilt in place: ``build.ninja`` records the absolute paths of the torch
it was written for, so two venvs sharing the folder rebuild it on every switch. Here instead:

* **Content-keyed folders, finished before they appear.** ``<root>/<key>/`` holds one finished build. The key
  hashes what changes the binary (:func:`build_inputs`): the sources' content and flags, the compiler's identity
  and version, torch's version, git revision and C++ ABI, and the Python ABI. Paths are left out on purpose (of
  the sources, the venv, torch's headers and libraries): two venvs with the same torch build and the same
  compiler share one build. A build runs in a private temporary folder (``<root>/.build-<key>-*``) and is
  renamed into place whole, with a ``manifest.json``, once it has been compiled and imported; ``rename`` is
  atomic, so a reader sees either no folder or a finished one and never waits for a writer, nor runs ninja.
* **A lock a dead process cannot hold.** Builders of one key take ``fcntl.flock`` on ``<root>/<key>.lock`` (the
  kernel drops the lock when its holder dies, however it dies; the file itself is left in place and means
  nothing on its own, so a stale one never blocks). A waiter polls: when the folder appears it loads it; after
  ``ZERO_OFFLOAD_BUILD_WAIT`` seconds (default 600, about three times the slowest build seen on a loaded 2-core
  machine) it gives up and takes the fallback, naming the lock, its holder and how long it has held it. The
  lock holder clears what killed builders left behind (their temporary folders) before it starts.
* **The root** is ``ZERO_OFFLOAD_CACHE_DIR`` if set, else ``$TORCH_EXTENSIONS_DIR/zero_offload``, else
  ``zero_offload`` in torch's default extension folder (``~/.cache/torch_extensions/...``).
* **Loaded only from places nobody else can write.** A cached build is native code run in this process: before
  one is loaded or built into a root, :mod:`zero_offload._cache_trust` checks the way from the root down to the
  module (owner, write bits). Where that fails, or the root has no build and is not ours to write, this process
  builds its own copy in a new private folder (one warning naming the path, its owner and mode and the fix; the
  status and ``report`` say it too) and removes the folder once the module is loaded. Nothing of the cache is
  opened before it is looked at, nor waited on (a FIFO in a shared root would block a reader forever): manifests
  and locks must be regular files, and reads are bounded.
* **Said, not silent.** A build logs (logger ``zero_offload``, WARNING, so it shows when logging is left
  unconfigured) that it starts and why (first use, sources changed, another torch, compiler or Python), and
  how long it took; :func:`status` (and ``python -m zero_offload.report``) says whether this process loaded a
  prebuilt module, a cached build (when and by which interpreter it was built) or built it now (and why).

The compile itself runs in a child Python process, so this process imports the module only from its final
place (``torch.utils.cpp_extension.load`` imports what it builds: in the child, that checks the build loads).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from zero_offload._cache_trust import Refusal

EXTENSION_NAME = "zero_offload_cpu_adam"
SOURCES = ("cpu_adam.cpp", "bindings.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_neon.cpp", "isa_scalar.cpp")
HEADERS = ("cpu_adam.h", "kernel_args.h", "simd.h", "cpu_adam_kernel.h")
# -fopenmp: at::parallel_for is inline OpenMP code; without it the kernel silently runs on one thread.
CFLAGS = ("-O3", "-std=c++17", "-fopenmp")
LDFLAGS = ("-fopenmp",)
# Bumped when the cache's layout changes, so an older zero_offload's folders are never taken for ours.
CACHE_LAYOUT = 2
MANIFEST = "manifest.json"
DEFAULT_BUILD_WAIT = 600.0


@dataclasses.dataclass
class BuildStatus:
    """What happened when the native kernel was asked for.

    Attributes:
        state (str): ``"prebuilt"`` (``zero_offload._C``), ``"jit-cached"`` (a finished build loaded from the
            cache), ``"jit-built"`` (compiled by this process, now), ``"failed"`` or ``"not loaded yet"``.
        detail (str): for ``jit-built`` why it was built, for ``jit-cached`` when and by which interpreter, for
            ``failed`` the reason, for ``prebuilt`` the module's file.
        seconds (float): how long this process spent building (``jit-built``) or waiting and loading.
        cache_dir (str, optional): the build's folder in the cache (for a private build, its private folder, removed
            once loaded).
        refused (str, optional): why the cache was not used (the path, its owner and mode, how to fix it); None when
            it was, or was not needed.
    """

    state: str = "not loaded yet"
    detail: str = ""
    seconds: float = 0.0
    cache_dir: Optional[str] = None
    refused: Optional[str] = None

    def summary(self) -> str:
        """One line for reports, e.g. ``jit-built now in 91.2 s (first use: ...)`` or ``failed: <reason>``."""
        if self.state == "jit-built":
            return f"jit-built now in {self.seconds:.1f} s ({self.detail})"
        if not self.detail:
            return self.state
        return f"{self.state}: {self.detail}" if self.state == "failed" else f"{self.state} ({self.detail})"


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock for longer than ``ZERO_OFFLOAD_BUILD_WAIT`` seconds."""


logger = logging.getLogger("zero_offload")
_lock = threading.Lock()
_status = BuildStatus()
_module: Optional[ModuleType] = None
_attempted = False
_isas: Tuple[Optional[ModuleType], List[str]] = (None, [])  # native_isas(): the module asked, its answer


def source_dir() -> Path:
    """Folder holding the C++ sources: packaged copy when installed, the repository's csrc/ in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_csrc", here.parent / "csrc"):
        if (candidate / SOURCES[0]).is_file():
            return candidate
    raise FileNotFoundError(f"zero_offload: C++ sources not found next to {here}")


def cache_root() -> Path:
    """The cache's root: ``ZERO_OFFLOAD_CACHE_DIR``, else ``$TORCH_EXTENSIONS_DIR/zero_offload``, else
    ``zero_offload`` in torch's default extension folder."""
    own = os.environ.get("ZERO_OFFLOAD_CACHE_DIR")
    if own:
        return Path(own)
    torch_root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not torch_root:
        from torch.utils.cpp_extension import get_default_build_root

        torch_root = get_default_build_root()
    return Path(torch_root) / "zero_offload"


@functools.lru_cache(maxsize=None)
def _compiler_identity(compiler: str) -> str:
    """The compiler torch will call (``CXX`` or ``c++``) as its resolved path and first line of ``--version``:
    ``c++`` is often a link that another install can repoint."""
    path = shutil.which(compiler)
    if path is None:
        return f"{compiler} (not found)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        out = f"version unknown: {exc}"
    first = (out.strip().splitlines() or ["version unknown"])[0]
    return f"{os.path.realpath(path)}: {first}"


def build_inputs() -> Dict[str, str]:
    """Everything that changes the built binary, by name (the cache key is their hash; a rebuild names the ones
    that differ from the last build). Not paths: a venv's torch at another path is the same torch."""
    import torch

    digest = hashlib.sha256()
    src = source_dir()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes() + b"\0")
    return {
        "layout": str(CACHE_LAYOUT),
        "sources": digest.hexdigest()[:16],
        "flags": " ".join(CFLAGS) + " | " + " ".join(LDFLAGS),
        "compiler": _compiler_identity(os.environ.get("CXX", "c++")),
        "torch": f"{torch.__version__} (git {torch.version.git_version[:12]}, "
                 f"cxx11 abi {int(torch.compiled_with_cxx11_abi())})",
        "python": f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')} {platform.machine()}",
    }


def cache_key(inputs: Optional[Dict[str, str]] = None) -> str:
    """The build's folder name: a hash of :func:`build_inputs`."""
    text = json.dumps(inputs if inputs is not None else build_inputs(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """The folder a finished build for this process's sources, flags, compiler, torch and Python lives in."""
    return cache_root() / cache_key()


# ------------------------------------------------------------------------------------------------ the lock --
def _build_wait() -> float:
    """Seconds to wait for another process's build: ``ZERO_OFFLOAD_BUILD_WAIT``, default 600."""
    text = os.environ.get("ZERO_OFFLOAD_BUILD_WAIT", "")
    if not text.strip():
        return DEFAULT_BUILD_WAIT
    try:
        wait = float(text)
    except ValueError:
        wait = -1.0
    if not wait >= 0:
        raise ValueError(f"Invalid ZERO_OFFLOAD_BUILD_WAIT={text!r} (seconds to wait for another process's "
                         f"build, e.g. {DEFAULT_BUILD_WAIT:.0f})")
    return wait


def lock_holder(fd: int) -> str:
    """Who holds (or last held) the build lock open as ``fd``, from what its holder wrote into it (pid, host and
    for how long): its first 256 bytes, read from this open file (checked as a regular file), not reopened."""
    try:
        pid, host, since = os.pread(fd, 256, 0).decode(errors="replace").split()[:3]
        return f"pid {pid} on {host}, held for {time.time() - float(since):.0f} s"
    except (OSError, ValueError):
        return f"holder unknown, file {time.time() - os.fstat(fd).st_mtime:.0f} s old"


def _take_lock(lock_path: Path, wait: float, done: Callable[[], bool]) -> Optional[int]:
    """The build lock's file descriptor, once held; None as soon as ``done()`` (another process finished the
    build meanwhile). Raises :class:`BuildLockTimeout` after ``wait`` seconds, OSError where the lock cannot be
    opened, ``_cache_trust.Untrusted`` where it is no regular file of a trusted owner."""
    import fcntl

    from zero_offload import _cache_trust

    # In a root others may write (a sticky one), a link planted at the lock's name would have this process truncate
    # what it points to, a FIFO would block a reader forever: neither is used. (Its content only informs a message.)
    fd = _cache_trust.open_file(lock_path, os.O_RDWR | os.O_CREAT, "use a cache root of your own "
                                "(ZERO_OFFLOAD_CACHE_DIR)", modes=False, create_mode=0o666)
    start, told = time.monotonic(), False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n".encode())
                return fd
            except BlockingIOError:
                pass
            if done():
                break
            if not told:
                logger.warning("zero_offload: another process is building the CPU-Adam kernel (lock %s: %s); "
                               "waiting up to %.0f s (ZERO_OFFLOAD_BUILD_WAIT) ...", lock_path,
                               lock_holder(fd), wait)
                told = True
            if time.monotonic() - start >= wait:
                raise BuildLockTimeout(
                    f"gave up after {wait:.0f} s waiting for the build lock {lock_path} ({lock_holder(fd)}); "
                    "a lock whose holder has died is released by itself: this one's holder still runs. "
                    "Set ZERO_OFFLOAD_BUILD_WAIT to wait longer")
            time.sleep(min(0.5, max(wait / 4, 0.01)))
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _release_lock(fd: int) -> None:
    # The file stays: deleting it would let a waiter lock the old inode while a newcomer locks a new one.
    os.close(fd)


# ------------------------------------------------------------------------------------------------ the build --
def _stage_sources(build: Path) -> Path:
    """The sources copied into the private build folder and compiled from there, so the build never depends on
    (nor records) which checkout or installed copy asked for it."""
    staged, src = build / "src", source_dir()
    staged.mkdir(parents=True, exist_ok=True)
    for name in SOURCES + HEADERS:
        shutil.copyfile(src / name, staged / name)
    return staged


# The child reports a failure as torch's message (which carries ninja's and the compiler's output), not a traceback.
_CHILD = """
import json, sys
from torch.utils.cpp_extension import load
try:
    module = load(**json.loads(sys.argv[1]))
except Exception as exc:
    sys.exit(str(exc))
print(module.__file__)
"""


def _compile(build: Path) -> str:
    """Compile the kernel into the empty folder ``build`` (in a child Python, which also imports the result to
    check it loads) and return the module's file name there. Raises RuntimeError with the build's output."""
    src = _stage_sources(build)
    kwargs = dict(name=EXTENSION_NAME, sources=[str(src / name) for name in SOURCES], extra_cflags=list(CFLAGS),
                  extra_ldflags=list(LDFLAGS), extra_include_paths=[str(src)], build_directory=str(build),
                  verbose=False)
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(kwargs)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the kernel failed (exit status {done.returncode}):\n"
                           f"{done.stderr[-20000:]}{done.stdout[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1]).name


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


def _why_build(root: Path, final: Path, inputs: Dict[str, str]) -> str:
    """Why this build runs, in words: first use, or what differs from the closest finished build in ``root``
    (fewest differing inputs, then newest: switching sources on one torch says "sources changed" even when a
    build for another torch is also cached)."""
    if final.exists():
        return f"{final} held an unfinished build, cleared first"
    from zero_offload import _cache_trust

    best, ignored = None, []
    for manifest in root.glob(f"*/{MANIFEST}"):
        try:
            data = _read_manifest(root, manifest.parent)
            old, when = dict(data["inputs"]), float(data["built_at"])
        except _cache_trust.Untrusted as exc:  # another account's, a FIFO, a link: never opened, never waited on
            ignored.append(str(exc.refusal))
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        changed = [k for k in inputs if old.get(k) != inputs[k]]
        if best is None or (len(changed), -when) < (len(best[0]), -best[2]):
            best = (changed, old, when)
    if ignored:
        logger.warning("zero_offload: %d folder(s) in %s not read (looking for the closest earlier build): %s%s",
                       len(ignored), root, "; ".join(ignored[:3]), " ..." if len(ignored) > 3 else "")
    if best is None:
        # Folders with a build.ninja but no manifest: builds of an older zero_offload, whose layout had no manifest.
        older = [d for d in root.glob("[!.]*/build.ninja")]
        if older:
            return f"first use of this zero_offload's cache: {len(older)} older build(s) in {root} are not reused"
        return f"first use: no build in {root} yet"
    changed, old, _ = best
    words = {"sources": "the C++ sources changed", "flags": "the build flags changed",
             "layout": "the cache layout changed"}
    return "; ".join(words.get(k) or f"another {k} ({old.get(k, '?')} -> {inputs[k]})" for k in changed)


def _finished(final: Path) -> bool:
    """Whether ``final`` holds a finished build: its manifest is a regular file (looked at, not opened)."""
    try:
        return stat.S_ISREG(os.lstat(final / MANIFEST).st_mode)
    except OSError:
        return False


def _read_manifest(root: Path, folder: Path) -> dict:
    """The manifest of the build in ``folder`` (inside ``root``), as ``_cache_trust.read`` reads it (checked first,
    never waited on, bounded), whose ``file`` is a plain name in ``folder``. Raises ``_cache_trust.Untrusted``
    where it may not be read, ValueError where it names no such file."""
    from zero_offload import _cache_trust

    data = json.loads(_cache_trust.read(root, folder / MANIFEST))
    name = data.get("file") if isinstance(data, dict) else None
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"{folder / MANIFEST} names {name!r} as the module: not a file name in {folder}")
    return data


def _load_built(folder: Path, manifest: dict) -> ModuleType:
    """Import the finished build in ``folder`` (the name and file its ``manifest`` records)."""
    spec = importlib.util.spec_from_file_location(manifest["module"], folder / manifest["file"])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {folder / manifest['file']}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cached_detail(manifest: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(manifest["built_at"]))
    return f"built {when} in {manifest['seconds']:.1f} s by {manifest['built_by']}"


def _clear_leftovers(root: Path, key: str, final: Path) -> None:
    """With the key's lock held no other builder of it runs: what its temporary folders hold was left by killed
    builds, and a final folder without a manifest is not a finished build. Both go."""
    if final.exists() and not _finished(final):
        aside = Path(tempfile.mkdtemp(prefix=f".build-{key}-stale-", dir=root))
        os.replace(final, aside / "old")
    for leftover in root.glob(f".build-{key}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _build_into(root: Path, key: str, final: Path, inputs: Dict[str, str], reason: str,
                later: Optional[str] = None) -> None:
    """Compile in a private folder and rename it into place with its manifest (the lock is held). ``later`` says
    what becomes of the build (by default: later runs load it from ``final``)."""
    logger.warning("zero_offload: compiling the CPU-Adam kernel (%s); about a minute, %s ...", reason,
                   later or f"once: later runs load it from {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-{os.getpid()}-", dir=root))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the finished build from a cache shared between users
        start = time.perf_counter()
        file = _compile(tmp)
        seconds = time.perf_counter() - start
        for obj in tmp.glob("*.o"):  # kept: the module, build.ninja and the staged sources, to see what was built
            obj.unlink()
        manifest = {"module": EXTENSION_NAME, "file": file, "inputs": inputs, "built_at": time.time(),
                    "seconds": round(seconds, 1), "built_by": sys.executable, "reason": reason}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        # Writable by its owner only, whatever the umask (002 leaves files group-writable): the trust check refuses
        # group-writable builds unless the group is the user's own.
        for path in (tmp, *tmp.rglob("*")):
            if not path.is_symlink():
                path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o022)
        os.rename(tmp, final)  # atomic; fails if `final` exists, which the lock rules out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.warning("zero_offload: CPU-Adam kernel built in %.1f s", seconds)


def _jit_build() -> ModuleType:
    """The cached build, waiting (bounded) for another builder of it or building it under the lock; a private
    build where the cache may not be used."""
    from zero_offload import _cache_trust

    inputs = build_inputs()
    root, key = cache_root(), cache_key(inputs)
    final = root / key
    _status.cache_dir = str(final)
    start = time.perf_counter()
    refused = _build_in_cache(root, key, final, inputs)
    if refused is None:  # the manifest first: it names the module file
        try:
            manifest = _read_manifest(root, final)
            refused = _cache_trust.check(root, final / manifest["file"])
        except _cache_trust.Untrusted as exc:
            refused = exc.refusal
    if refused is not None:
        return _private_build(root, key, inputs, refused, start)
    module = _load_built(final, manifest)
    _status.seconds = time.perf_counter() - start
    if _status.state != "jit-built":
        _status.state, _status.detail = "jit-cached", _cached_detail(manifest)
    return module


def _build_in_cache(root: Path, key: str, final: Path, inputs: Dict[str, str]) -> Optional[Refusal]:
    """Build into the cache under the key's lock, unless the build is there or another process finishes it
    meanwhile. Returns a :class:`Refusal` where the root (or an unfinished ``final``)
    may not be used, or is not ours to write; else None."""
    from zero_offload import _cache_trust

    finished = functools.partial(_finished, final)
    if finished():
        return None
    if not root.is_dir():
        try:
            root.mkdir(parents=True)
            root.chmod(0o755)  # whatever the umask: the trust check refuses a root that others may write
        except FileExistsError:
            pass
        except OSError as exc:
            return _cache_trust.refusal(root, f"cannot be created ({exc.strerror})",
                                        "point ZERO_OFFLOAD_CACHE_DIR at a folder you can write")
    refused = _cache_trust.check(root, final if os.path.lexists(final) else None, file=False)
    if refused is not None:
        return refused
    # effective_ids: a process that switched to another user (seteuid) writes as that user.
    if not os.access(root, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        return _cache_trust.unwritable_root(root)
    try:
        fd = _take_lock(root / f"{key}.lock", _build_wait(), finished)
    except OSError as exc:  # in a root shared with others (sticky): a lock file another user made, or a link
        return _cache_trust.refusal(root / f"{key}.lock", f"cannot be opened as the build lock ({exc.strerror})",
                                    "use a cache root of your own (ZERO_OFFLOAD_CACHE_DIR)")
    except _cache_trust.Untrusted as exc:  # there, a FIFO or another account's file: not locked, not read
        return exc.refusal
    if fd is not None:
        try:
            if not finished():
                reason = _why_build(root, final, inputs)
                _clear_leftovers(root, key, final)
                _build_into(root, key, final, inputs, reason)
                _status.state, _status.detail = "jit-built", reason
        finally:
            _release_lock(fd)
    return None


def _private_build(root: Path, key: str, inputs: Dict[str, str], refused: Refusal, start: float) -> ModuleType:
    """Build into a new folder of this process's own (``mkdtemp``: made by us, 0700, at a name nobody could
    choose first), load it from there and remove the folder: a loaded module no longer needs its file."""
    _status.refused = str(refused)
    warnings.warn(f"zero_offload: the kernel build cache is not used: {refused}. A cached build is native code run "
                  "in this process: it is loaded only where nobody but you, root or an account you trust can change "
                  "it (docs/build.md, 'Sharing the cache'). This process builds a private copy instead (about a "
                  "minute, on every run until this is fixed).", RuntimeWarning, stacklevel=4)
    private = Path(tempfile.mkdtemp(prefix="zero_offload-private-"))
    try:
        reason = f"private build: the cache {root} is not used"
        _status.cache_dir = str(private / key)
        _build_into(private, key, private / key, inputs, reason, later="in a private folder removed once loaded")
        module = _load_built(private / key, _read_manifest(private, private / key))
    finally:
        shutil.rmtree(private, ignore_errors=True)
    _status.state, _status.detail, _status.seconds = "jit-built", reason, time.perf_counter() - start
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

            _module, _status.state, _status.detail = _C, "prebuilt", str(getattr(_C, "__file__", ""))
        except ImportError:
            problem = _toolchain_problem()
            if problem is None:
                try:
                    _module = _jit_build()
                except Exception as exc:  # a failed build must never break the caller
                    problem = str(exc) if isinstance(exc, (BuildLockTimeout, ValueError)) else _short_reason(exc)
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
    """What happened when the native kernel was asked for (see :class:`BuildStatus`)."""
    return _status


def native_isas() -> List[str]:
    """ISAs the loaded native module can run on this CPU, best first; empty without the module. (Asked of each
    module once: every kernel call resolves its path through this.)"""
    global _isas
    module = load_native()
    if module is None:
        return []
    if _isas[0] is not module:
        _isas = (module, list(module.available_isas()))
    return list(_isas[1])
