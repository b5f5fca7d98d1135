"""The build cache loads native code only from places nobody else can write (issue 37).

Each case plants a finished-looking build at the key this interpreter would load: a module that, if imported,
creates a marker file (a `.py` stands in for the `.so`: both are imported by the same `_load_built`). A refused
place must leave the marker absent, give one warning naming the path, its owner and mode and the fix, and the run
must go on on a private build (the compile replaced by a stand-in, as in test_build.py: no real compile here).
Ownership by another user needs root (`chown`); those cases skip elsewhere. Issue 54 added what another account
can plant besides a build (a FIFO where a manifest or the lock should be: never opened, never waited on; a
manifest past the read limit) and the message for a read-only root of one's own."""

import fcntl
import grp
import itertools
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import pytest

from zero_offload import _build, _cache_trust

REPO = Path(__file__).resolve().parents[1]
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give files to another user")
NOBODY = "nobody"
ME = f"{pwd.getpwuid(os.geteuid()).pw_name} (uid {os.geteuid()})"

# Loads the kernel with the compile replaced by a stand-in (module answering ['private']) and prints what happened.
# AS_UID: switch to that user first (effective ids), after what it cannot read as that user (torch lives under
# /root here) is imported; ninja's check is skipped for the same reason (the stand-in needs no ninja).
_LOAD = """
    import json, os, sys, warnings
    from pathlib import Path
    from zero_offload import _build
    def _fake(build):
        (Path(build) / "fake_kernel.py").write_text("def available_isas():\\n    return ['private']\\n")
        return "fake_kernel.py"
    _build._compile = _fake
    uid = int(os.environ.get("AS_UID", "-1"))
    if uid >= 0:
        import grp, pwd, torch.utils.cpp_extension
        from zero_offload import _cache_trust
        _build._toolchain_problem = lambda: None
        _build.cache_key()
        os.setegid(uid)
        os.seteuid(uid)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _build.load_native()
    s = _build.status()
    out = {"state": s.state, "detail": s.detail, "dir": s.cache_dir, "refused": s.refused,
           "file": getattr(module, "__file__", None), "isas": module.available_isas() if module else None,
           "warnings": [str(w.message) for w in caught if "zero_offload" in str(w.message)]}
    if os.environ.get("REPORT"):
        from zero_offload import report
        out["report"] = report.lines()
    print(json.dumps(out))
"""


# Each load runs in a fresh process, forked from a server started once for this module that has imported torch
# and the package (and loaded nothing): 0.3 s a load instead of the 3.6 s of a new interpreter. The child takes the
# load's environment, works from "/", and writes its stdout and stderr to files named in the request.
_SERVER = """
import json, os, sys, traceback
import grp, pwd, torch, torch.utils.cpp_extension
from zero_offload import _build, _cache_trust
code = sys.argv[1]
for line in sys.stdin:
    env, out = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ.clear()
        os.environ.update(env)
        os.chdir("/")
        for fd, path in ((1, out), (2, out + ".err")):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        status = 0
        try:
            exec(code, {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


_SERVED = {}  # the servers, by the tree of zero_offload they import, and the folder of the loads' output files


@pytest.fixture(scope="module", autouse=True)
def _loader(tmp_path_factory):
    _SERVED.update(servers={}, outputs=tmp_path_factory.mktemp("loads"), count=itertools.count())
    try:
        yield
    finally:
        for tree in list(_SERVED["servers"]):
            _stop_server(tree)
        _SERVED.clear()


def _server(tree):
    """The server whose loads import zero_offload from ``tree``: started at its first load (and after one hung)."""
    if tree not in _SERVED["servers"]:
        env = dict(os.environ, PYTHONPATH=str(tree))
        env.pop("ZERO_OFFLOAD_SIMD", None)
        _SERVED["servers"][tree] = subprocess.Popen(
            [sys.executable, "-c", _SERVER, textwrap.dedent(_LOAD)], env=env, cwd="/", stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True)
    return _SERVED["servers"][tree]


def _stop_server(tree, kill=False):
    server = _SERVED["servers"].pop(tree)
    if not kill:
        server.stdin.close()
        try:
            server.wait(timeout=60)
            return
        except subprocess.TimeoutExpired:
            pass
    os.killpg(server.pid, signal.SIGKILL)  # the server and a load that hung: its own session
    server.wait()


def _load(root, tree=REPO, deadline=300, **env):
    """Load the kernel in a fresh process whose cache is ``root`` (the compile a stand-in) and whose zero_offload is
    ``tree``'s, with ``env`` on top of this process's environment; what happened, as ``_LOAD`` prints it, and its
    stderr (``"stderr"``: the log's records). A load still running after ``deadline`` seconds fails the test."""
    server = _server(tree)
    full = dict(os.environ, PYTHONPATH=str(tree), ZERO_OFFLOAD_CACHE_DIR=str(root), **env)
    full.pop("ZERO_OFFLOAD_SIMD", None)
    out = str(_SERVED["outputs"] / f"load-{next(_SERVED['count'])}")
    server.stdin.write(json.dumps([full, out]) + "\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], deadline)
    if not ready:
        _stop_server(tree, kill=True)  # no later load waits behind the hung one: the next starts a new server
        pytest.fail(f"the load did not finish in {deadline} s: it hangs. Its stderr: "
                    f"{Path(out + '.err').read_text()[-2000:]!r}")
    status = int(server.stdout.readline())
    assert status == 0, Path(out + ".err").read_text()
    return dict(json.loads(Path(out).read_text().strip().splitlines()[-1]), stderr=Path(out + ".err").read_text())


def _plant(root, marker=None):
    """A finished build at this interpreter's key in ``root``: manifest.json and planted.py, which creates ``marker``
    when imported and answers ``available_isas()`` with ['planted']."""
    folder = Path(root) / _build.cache_key()
    folder.mkdir(parents=True)
    side_effect = f"open({str(marker)!r}, 'w').close()\n" if marker else ""
    (folder / "planted.py").write_text(side_effect + "def available_isas():\n    return ['planted']\n")
    manifest = {"module": _build.EXTENSION_NAME, "file": "planted.py", "inputs": _build.build_inputs(),
                "built_at": time.time(), "seconds": 1.0, "built_by": "/planted/python", "reason": "planted"}
    (folder / _build.MANIFEST).write_text(json.dumps(manifest))
    for path in (folder, *folder.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


def _chown(folder, user=NOBODY):
    entry = pwd.getpwnam(user)
    for path in (folder, *folder.rglob("*")):
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _refused_privately(out, root, marker, says):
    """The refusal as it must be seen: private build loaded, nothing of ``root`` imported, one warning with ``says``."""
    assert out["state"] == "jit-built" and out["detail"] == f"private build: the cache {root} is not used", out
    assert out["isas"] == ["private"] and not out["file"].startswith(str(root)), out
    assert not marker.exists(), "the planted module was imported"
    assert not Path(out["dir"]).parent.exists(), "the private folder outlived the load"
    assert len(out["warnings"]) == 1, out["warnings"]
    for words in says:
        assert words in out["warnings"][0] and words in out["refused"], (words, out["warnings"][0])


@pytest.fixture
def shared(tmp_path):
    """A cache root of this user's, 0755, with a planted build; and where its marker would appear."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    return root, _plant(root, tmp_path / "imported"), tmp_path / "imported"


def test_the_planted_build_is_detected_when_loaded(shared):
    """The positive control: from a root of our own the planted build is loaded (marker made), with no warning."""
    root, folder, marker = shared
    out = _load(root)
    assert (out["state"], out["isas"], out["warnings"]) == ("jit-cached", ["planted"], [])
    assert out["file"] == str(folder / "planted.py") and marker.exists() and out["refused"] is None


@AS_ROOT
def test_a_build_owned_by_another_user_in_a_sticky_shared_root_is_not_loaded(shared):
    """Issue 37's case: TORCH_EXTENSIONS_DIR in a sticky world-writable folder, a build at our key made by another
    user, world-writable, its module too. The report says it as well."""
    root, folder, marker = shared
    root.chmod(0o1777)
    _chown(folder)
    folder.chmod(0o777)
    (folder / "planted.py").chmod(0o666)
    out = _load(root, REPORT="1")
    _refused_privately(out, root, marker, [
        f"{folder} (owner nobody (uid 65534), mode drwxrwxrwx (0777)) is owned by an account other than you, root "
        "and those in ZERO_OFFLOAD_CACHE_TRUST", "ZERO_OFFLOAD_CACHE_DIR", "ZERO_OFFLOAD_CACHE_TRUST=nobody"])
    line = next(ln for ln in out["report"] if ln.startswith("build cache"))
    assert line.startswith(f"build cache      not used: {folder} (owner nobody (uid 65534), "), line
    assert "private" in next(ln for ln in out["report"] if ln.startswith("native kernel"))


@pytest.mark.parametrize("where, mode, group", [
    ("folder", 0o757, None), ("folder", 0o775, "nogroup"),
    ("module", 0o646, None), ("module", 0o664, "nogroup"), ("manifest", 0o666, None)],
    ids=["folder-o+w", "folder-g+w", "module-o+w", "module-g+w", "manifest-o+w"])
def test_a_build_others_may_write_is_not_loaded(shared, where, mode, group):
    root, folder, marker = shared
    path = {"folder": folder, "module": folder / "planted.py", "manifest": folder / _build.MANIFEST}[where]
    if group is not None:
        if os.geteuid() != 0:
            pytest.skip("needs root, to give a file to another group")
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    path.chmod(mode)
    out = _load(root)
    whom = "others" if group is None else f"group {group}"
    _refused_privately(out, root, marker, [f"{path} (owner {ME}, mode ", f"({mode:04o})) is writable by {whom}",
                                           f"remove {folder}"])


def test_a_root_others_may_write_is_used_only_if_sticky(shared):
    """World-writable and not sticky: anyone may rename our build away and put theirs in its place; refused, and
    nothing is written into it. Sticky (as /tmp), with our build in it: used."""
    root, folder, marker = shared
    root.chmod(0o777)
    before = sorted(p.name for p in root.iterdir())
    out = _load(root)
    _refused_privately(out, root, marker, [f"{root} (owner {ME}, mode drwxrwxrwx (0777)) is writable by "
                                           "others and not sticky", f"chmod go-w {root}", f"chmod +t {root}"])
    assert sorted(p.name for p in root.iterdir()) == before
    root.chmod(0o1777)
    out = _load(root)
    assert (out["state"], out["isas"], out["warnings"]) == ("jit-cached", ["planted"], []) and marker.exists()


def test_a_link_in_the_cache_is_not_followed(shared, tmp_path):
    root, folder, marker = shared
    elsewhere = tmp_path / "elsewhere.py"
    shutil.move(folder / "planted.py", elsewhere)
    (folder / "planted.py").symlink_to(elsewhere)
    out = _load(root)
    _refused_privately(out, root, marker, [f"{folder / 'planted.py'} (owner ", ") is a symbolic link"])


def test_a_lock_planted_as_a_link_is_not_followed(tmp_path):
    """No build yet, and the lock's name is a link to another file: opening it must not create or truncate that
    file (the lock holder writes its pid into the lock)."""
    root = tmp_path / "cache"
    root.mkdir()
    victim = tmp_path / "precious"
    victim.write_text("keep me\n")
    (root / f"{_build.cache_key()}.lock").symlink_to(victim)
    out = _load(root)
    assert victim.read_text() == "keep me\n"
    _refused_privately(out, root, tmp_path / "no-marker", ["cannot be opened as the build lock"])


# Issue 54: in a sticky root that all may write (which the docs allow), another account can put a FIFO where a
# manifest or a lock is expected. Opening a FIFO to read waits for a writer, reading one waits for data: a load that
# did either would hang for ever, holding the build lock. These loads have a deadline, so a hang fails the test.
HANG_DEADLINE = 120  # seconds: a load with the stand-in compile takes under one


def _owner_of_planted(owner):
    """``(uid, gid, env)`` for a case's planted file: this user's, nobody's, or nobody's and trusted (``env`` names
    nobody in ZERO_OFFLOAD_CACHE_TRUST); skips the cases that need root."""
    if owner == "me":
        return os.geteuid(), os.getegid(), {}
    if os.geteuid() != 0:
        pytest.skip("needs root, to give files to another user")
    entry = pwd.getpwnam(NOBODY)
    return entry.pw_uid, entry.pw_gid, ({"ZERO_OFFLOAD_CACHE_TRUST": NOBODY} if "trusted" in owner else {})


@pytest.mark.parametrize("owner", ["me", "nobody", "nobody, trusted"])
def test_a_fifo_for_another_builds_manifest_is_never_opened(tmp_path, owner):
    """Our build is missing; another folder's manifest.json is a FIFO. The builder reads the other builds'
    manifests to say why it builds: it must build without opening the FIFO and name what it did not read, and why
    (a folder of another account's is not read at all; a trusted account's FIFO is seen to be one)."""
    uid, gid, trust = _owner_of_planted(owner)
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o1777)
    other = root / "0123456789abcdef"
    other.mkdir()
    os.mkfifo(other / _build.MANIFEST)
    (other / _build.MANIFEST).chmod(0o644)
    for path in (other, other / _build.MANIFEST):
        os.chown(path, uid, gid)
    out = _load(root, deadline=HANG_DEADLINE, **trust)
    assert (out["state"], out["detail"], out["isas"], out["refused"]) == (
        "jit-built", f"first use: no build in {root} yet", ["private"], None), out
    assert out["file"] == str(root / _build.cache_key() / "fake_kernel.py"), out
    if owner == "nobody":
        says = f"{other} (owner nobody (uid 65534), mode drwxr-xr-x (0755)) is owned by an account other than you"
    else:
        whose = ME if owner == "me" else "nobody (uid 65534)"
        says = f"{other / _build.MANIFEST} (owner {whose}, mode prw-r--r-- (0644)) is a FIFO, not a regular file"
    assert f"1 folder(s) in {root} not read (looking for the closest earlier build): {says}" in out["stderr"], \
        out["stderr"]


@pytest.mark.parametrize("owner", ["me", "nobody"])
def test_a_fifo_for_the_build_lock_is_neither_locked_nor_read(tmp_path, owner):
    """No build yet, and the key's lock is a FIFO that its maker holds locked: a waiter would read it to name the
    holder, and wait for ever. It is not used as the lock at all: the run builds privately, naming it."""
    uid, gid, _ = _owner_of_planted(owner)
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o1777)
    lock = root / f"{_build.cache_key()}.lock"
    os.mkfifo(lock)
    lock.chmod(0o666)
    os.chown(lock, uid, gid)
    held = os.open(lock, os.O_RDWR | os.O_NONBLOCK)  # (a FIFO opened read-write waits for nobody)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        out = _load(root, deadline=HANG_DEADLINE)
    finally:
        os.close(held)
    whose = ME if owner == "me" else "nobody (uid 65534)"
    says = f"{lock} (owner {whose}, mode prw-rw-rw- (0666)) is a FIFO, not a regular file"
    # Where fs.protected_fifos is set, the kernel refuses the open (O_CREAT) of another account's FIFO in a sticky
    # folder that all may write at once: the same refusal, said by the open.
    protected = Path("/proc/sys/fs/protected_fifos")
    if owner != "me" and protected.exists() and protected.read_text().strip() != "0":
        says = f"{lock} (owner {whose}, mode prw-rw-rw- (0666)) cannot be opened as the build lock"
    _refused_privately(out, root, tmp_path / "no-marker", [says, "ZERO_OFFLOAD_CACHE_DIR"])


def test_a_manifest_past_the_read_limit_is_not_read(shared):
    """Reads from the cache are bounded: a manifest of more than 1 MiB (ours are under 1 KiB) is not read, and so
    its build is not loaded."""
    root, folder, marker = shared
    manifest = folder / _build.MANIFEST
    manifest.write_text(" " * (1 << 20) + manifest.read_text())  # still valid JSON
    out = _load(root)
    _refused_privately(out, root, marker, [
        f"{manifest} (owner {ME}, mode -rw-r--r-- (0644)) holds more than {1 << 20} bytes", f"remove {folder}"])


def test_a_read_only_root_of_ones_own_says_so(tmp_path):
    """A root of this user's own with no build for it and that it cannot write: the message must not send the
    user to the root's owner (that is them), but say what keeps them out and how to let them in. Not root: the
    root's mode lacks u+w. Root (whom no mode keeps out): the root is immutable (``chattr +i``), where it can be."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o755)
    if os.geteuid() != 0:
        lock, unlock = ["chmod", "0555", str(root)], ["chmod", "0755", str(root)]
        says = [f"{root} (owner {ME}, mode dr-xr-xr-x (0555)) has no build for this torch, compiler and Python and "
                "you, its owner, cannot write to it (its mode has no write bit for you)", f"`chmod u+w {root}`"]
    else:
        lock, unlock = ["chattr", "+i", str(root)], ["chattr", "-i", str(root)]
        says = [f"{root} (owner {ME}, mode drwxr-xr-x (0755)) has no build for this torch, compiler and Python and "
                f"you, its owner, cannot write to it: it is immutable (`lsattr -d {root}` shows an 'i')",
                f"`chattr -i {root}` as root"]
        if shutil.which("chattr") is None:
            pytest.skip("no chattr here")
    try:
        if subprocess.run(lock, capture_output=True).returncode != 0:
            pytest.skip(f"`{' '.join(lock)}` failed here (no CAP_LINUX_IMMUTABLE, or a file system without the flag)")
        out = _load(root)
    finally:
        subprocess.run(unlock, capture_output=True)
    _refused_privately(out, root, tmp_path / "no-marker",
                       says + ["point ZERO_OFFLOAD_CACHE_DIR at a folder you can write"])
    assert "its owner can add the build" not in out["refused"] and list(root.iterdir()) == []


def test_a_root_on_a_read_only_file_system_says_so(tmp_path, monkeypatch):
    """The same on a read-only mount (which needs privileges to make: the file system's flag is stood in for)."""
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_flag=real(path).f_flag | os.ST_RDONLY))
    assert str(_cache_trust.unwritable_root(tmp_path)) == (
        f"{tmp_path} (owner {ME}, mode {stat.filemode(tmp_path.stat().st_mode)} "
        f"({tmp_path.stat().st_mode & 0o7777:04o})) has no build for this torch, compiler and Python and is on a "
        "read-only file system; to fix: build into it where it is mounted read-write, or point "
        "ZERO_OFFLOAD_CACHE_DIR at a folder you can write")


def test_a_manifest_naming_a_file_outside_its_folder_is_refused(shared, tmp_path):
    root, folder, marker = shared
    outside = tmp_path / "outside.py"
    outside.write_text(f"open({str(marker)!r}, 'w').close()\ndef available_isas():\n    return ['outside']\n")
    manifest = json.loads((folder / _build.MANIFEST).read_text())
    (folder / _build.MANIFEST).write_text(json.dumps({**manifest, "file": "../../outside.py"}))
    out = _load(root)
    assert out["state"] == "failed" and not marker.exists(), out
    assert "names '../../outside.py' as the module: not a file name in" in out["warnings"][0], out


@AS_ROOT
def test_an_account_named_in_cache_trust_is_trusted(shared):
    root, folder, marker = shared
    _chown(folder)
    out = _load(root, ZERO_OFFLOAD_CACHE_TRUST=NOBODY)
    assert (out["state"], out["isas"], out["warnings"]) == ("jit-cached", ["planted"], []) and marker.exists()
    marker.unlink()
    out = _load(root, ZERO_OFFLOAD_CACHE_TRUST="no-such-user-here")
    assert out["state"] == "failed" and not marker.exists(), out
    assert "Invalid ZERO_OFFLOAD_CACHE_TRUST='no-such-user-here': no user 'no-such-user-here'" in out["warnings"][0]


def _public_dir(prefix):
    """A new folder, 0755, that every account can reach: in the temporary folder where every folder above it lets
    others through (o+x), else in /tmp or /var/tmp; the test skips where none does."""
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        base = Path(base).resolve()
        if base.is_dir() and all(os.stat(p).st_mode & stat.S_IXOTH for p in (base, *base.parents)):
            folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            folder.chmod(0o755)
            return folder
    pytest.skip("no temporary folder here that other accounts can reach")


def _public_tree():
    """What a load by another account reads of zero_offload (its Python modules and C++ sources), copied into a
    folder every account can read: the checkout itself may lie where only its owner can (a private temporary
    folder, a home folder of mode 0700)."""
    tree = _public_dir("zero_offload-tree-")
    leave_out = shutil.ignore_patterns("__pycache__", "*.so", "*.o")  # no prebuilt module: the JIT path is tested
    for part in ("zero_offload", "csrc"):
        shutil.copytree(REPO / part, tree / part, ignore=leave_out)
    for path in tree.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return tree


@AS_ROOT
def test_a_root_owned_shared_cache_serves_another_user():
    """A root owned by root, 0755, readable by all: another user's process loads the build in it, and, where the
    build it needs is missing, builds its own privately (it cannot write there) without touching the root. Both the
    root and the zero_offload that process imports lie where that user can read them, wherever the checkout lies."""
    tree, root = _public_tree(), _public_dir("zero_offload-shared-")  # not under pytest's 0700 folder
    nobody = str(pwd.getpwnam(NOBODY).pw_uid)
    try:
        folder = _plant(root)
        out = _load(root, tree=tree, AS_UID=nobody)
        assert (out["state"], out["isas"], out["warnings"]) == ("jit-cached", ["planted"], []), out
        assert out["file"] == str(folder / "planted.py")
        shutil.rmtree(folder)
        out = _load(root, tree=tree, AS_UID=nobody)
        _refused_privately(out, root, root / "no-marker", [
            f"{root} (owner root (uid 0), mode drwxr-xr-x (0755)) has no build for this torch, compiler and Python "
            "and you cannot write to it", "run `python -m zero_offload.report` as that account"])
        assert list(root.iterdir()) == []
    finally:
        if tree in _SERVED["servers"]:
            _stop_server(tree)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tree, ignore_errors=True)


def _private_group_by_the_files(gid, name):
    """Whether group ``gid`` has no member but ``name``, read from /etc/passwd and /etc/group themselves (the
    reference for the check's getpwall/getgrgid answer); None where those files do not say."""
    try:
        passwd = [ln.split(":") for ln in Path("/etc/passwd").read_text().splitlines() if ln.count(":") >= 6]
        group = [ln.split(":") for ln in Path("/etc/group").read_text().splitlines() if ln.count(":") >= 3]
    except OSError:
        return None
    entry = [g for g in group if g[2] == str(gid)]
    if len(entry) != 1:
        return None
    members = {u[0] for u in passwd if u[3] == str(gid)} | set(filter(None, entry[0][3].split(",")))
    return members == {name}


def test_a_users_own_group_writable_cache_is_used(shared):
    """Under a umask of 002 (Debian, Ubuntu, Fedora) a user's own cache is group-writable by the user's private
    group: that is theirs alone, and used."""
    root, folder, marker = shared
    gid, name = os.getegid(), pwd.getpwuid(os.geteuid()).pw_name
    if not _private_group_by_the_files(gid, name):
        pytest.skip(f"group {gid} is not {name}'s private group here")
    for path in (root, folder):
        path.chmod(0o775)
    (folder / "planted.py").chmod(0o664)
    out = _load(root)
    assert (out["state"], out["isas"], out["warnings"]) == ("jit-cached", ["planted"], []) and marker.exists()


def test_a_build_made_under_a_permissive_umask_is_writable_by_its_owner_only(tmp_path, monkeypatch):
    """Under umask 002 the compile's files come out group-writable; the finished build must not (a build this user
    made would otherwise be refused where the group is not the user's own)."""
    monkeypatch.setenv("ZERO_OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))

    def compile_under_002(build):
        (Path(build) / "fake_kernel.py").write_text("def available_isas():\n    return ['scalar']\n")
        (Path(build) / "fake_kernel.py").chmod(0o775)
        (Path(build) / "sub").mkdir(mode=0o777)
        (Path(build) / "sub").chmod(0o777)
        return "fake_kernel.py"

    monkeypatch.setattr(_build, "_compile", compile_under_002)
    monkeypatch.setattr(_build, "_status", _build.BuildStatus())
    old = os.umask(0o002)
    try:
        _build._jit_build()
    finally:
        os.umask(old)
    root = tmp_path / "cache"
    modes = {str(p.relative_to(root)): p.stat().st_mode & 0o777 for p in (root, *root.rglob("*"))
             if not p.name.endswith(".lock") and "__pycache__" not in p.parts}
    key = _build.cache_key()
    assert modes == {".": 0o755, key: 0o755, f"{key}/sub": 0o755, f"{key}/fake_kernel.py": 0o755,
                     f"{key}/{_build.MANIFEST}": 0o644}, modes


def test_a_root_that_cannot_be_made_gets_a_private_build(tmp_path):
    """ZERO_OFFLOAD_CACHE_DIR below a file: the root cannot be created; the run goes on on a private build, saying
    why, rather than on the slow fallback."""
    (tmp_path / "a-file").write_text("")
    root = tmp_path / "a-file" / "cache"
    out = _load(root)
    _refused_privately(out, root, tmp_path / "no-marker", [
        f"{root} (owner -, mode -) cannot be created (Not a directory)",
        "point ZERO_OFFLOAD_CACHE_DIR at a folder you can write"])
