"""Whether a place in the kernel's build cache may hold code that this process loads.

A cached build is native code: importing it runs whatever it holds, with this process's rights. Whoever can write
the module file, or rename or replace any folder on the way to it, can therefore run code in every trainer that
uses the cache (the folder's name is a predictable hash, so planting one takes no secret). A build is loaded only
when, from the cache root down to its module file, each folder and file

* is owned by this user (the effective uid), by root, or by an account named in ``ZERO_OFFLOAD_CACHE_TRUST``, and
* is writable by nobody else: not by others, and not by its group unless the owner is that group's only member
  (a user's private group, as Debian, Ubuntu and Fedora make for each user; under their usual umask of 002 a user's
  own folders are group-writable, and refusing those would refuse everyone's own cache).

The root alone may be writable by everyone if it is sticky (as ``/tmp`` is): there nobody can rename or remove
another's folder, so the folders inside it are what counts, and they are checked. Below the root nothing may be a
symbolic link (the cache makes none, and a link can point anywhere). This is OpenSSH's ``StrictModes`` rule for
key files, with Debian's private-group exception; pip likewise ignores a cache folder its user does not own.

Nothing in the cache is opened before it has been looked at. In a root others may write (sticky), another account
can put a FIFO where a manifest or a lock is expected: opening a FIFO to read waits for a writer, and reading it
waits for data, forever. So a file is read (:func:`read`) only after :func:`check` passed it as a regular file;
it is opened without following a link and without waiting (``O_NOFOLLOW | O_NONBLOCK``), what was opened is
checked again (``fstat``: :func:`check_open`), and at most :data:`READ_LIMIT` bytes are read. The build lock is
opened the same way (:func:`open_file`).

Not checked: the folders above the root (whoever can rename one of them can swap the root between this check and
the load), and the environment itself (who sets ``ZERO_OFFLOAD_CACHE_DIR`` could as well set ``LD_PRELOAD``).
docs/security.md lists what is trusted and why.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import stat
from pathlib import Path
from typing import FrozenSet, Optional

TRUST_VARIABLE = "ZERO_OFFLOAD_CACHE_TRUST"
# The most read from one file of the cache (a manifest holds under 1 KiB).
READ_LIMIT = 1 << 20
_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why the cache is not used: a path, who owns it, its mode, what is wrong with it and how to put it right.

    Attributes:
        path (Path): the folder or file that failed.
        owner (str): its owner, e.g. ``"nobody (uid 65534)"``; ``"-"`` where it could not be read.
        mode (str): its mode, e.g. ``"drwxrwxrwx (0777)"``; ``"-"`` where it could not be read.
        why (str): what is wrong, a phrase that follows the path (``"is writable by others"``).
        fix (str): what to do about it.
    """

    path: Path
    owner: str
    mode: str
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.path} (owner {self.owner}, mode {self.mode}) {self.why}; to fix: {self.fix}"


class Untrusted(Exception):
    """A file of the cache that was not read, or not used as the build lock: ``refusal`` says which and why."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


def _name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _user(uid: int) -> str:
    name = _name(uid)
    return f"{name} (uid {uid})" if name != str(uid) else f"uid {uid}"


def _mode(st: os.stat_result) -> str:
    return f"{stat.filemode(st.st_mode)} ({stat.S_IMODE(st.st_mode):04o})"


def _kind(st: os.stat_result) -> str:
    return next((name for test, name in _KINDS if test(st.st_mode)), "of an unknown kind")


def _kind_problem(st: os.stat_result, want_file: bool) -> Optional[str]:
    """What is wrong with the kind of a folder or file of the chain, as a phrase after its path; None if nothing."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (the cache makes none)"
    if stat.S_ISREG(st.st_mode) if want_file else stat.S_ISDIR(st.st_mode):
        return None
    return f"is {_kind(st)}, not {'a regular file' if want_file else 'a folder'}"


def refusal(path: Path, why: str, fix: str) -> Refusal:
    """A :class:`Refusal` for ``path``, with its owner and mode where it can be read."""
    try:
        st = os.lstat(path)
        owner, mode = _user(st.st_uid), _mode(st)
    except OSError:
        owner = mode = "-"
    return Refusal(Path(path), owner, mode, why, fix)


def trusted_uids() -> FrozenSet[int]:
    """This user (effective uid), root, and the accounts in ``ZERO_OFFLOAD_CACHE_TRUST`` (user names or numeric uids,
    separated by commas or spaces). Raises ValueError naming an entry that is no user of this machine."""
    import pwd

    text = os.environ.get(TRUST_VARIABLE, "")
    uids = {os.geteuid(), 0}
    for entry in filter(None, re.split(r"[\s,]+", text)):
        if entry.isdigit():
            uids.add(int(entry))
            continue
        try:
            uids.add(pwd.getpwnam(entry).pw_uid)
        except KeyError:
            raise ValueError(f"Invalid {TRUST_VARIABLE}={text!r}: no user {entry!r} on this machine (the accounts "
                             "whose builds are trusted besides yours and root's: user names or numeric uids, "
                             "separated by commas)") from None
    return frozenset(uids)


@functools.lru_cache(maxsize=None)
def private_group(gid: int, uid: int) -> bool:
    """Whether group ``gid`` has no member but user ``uid``, as a primary group (from the user database) or a
    supplementary one; a group with no member at all is not (such groups serve setgid programs)."""
    import grp
    import pwd

    try:
        group, name = grp.getgrgid(gid), pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    if any(member != name for member in group.gr_mem):
        return False
    primary = [p.pw_uid for p in pwd.getpwall() if p.pw_gid == gid]
    return all(u == uid for u in primary) and bool(primary or group.gr_mem)


def _own_cache_fix(uid: Optional[int] = None) -> str:
    trust = (f", or {TRUST_VARIABLE}={_name(uid)} if you trust {_name(uid)} with code in your processes"
             if uid is not None else "")
    return f"point ZERO_OFFLOAD_CACHE_DIR at a folder of your own (e.g. ~/.cache/zero_offload){trust}"


def _problem(path: Path, st: os.stat_result, is_root: bool, trusted: FrozenSet[int]) -> Optional[str]:
    """What makes one folder or file of the chain unsafe, as a phrase after its path; None if nothing."""
    if st.st_uid not in trusted:
        return f"is owned by an account other than you, root and those in {TRUST_VARIABLE}"
    sticky_root = is_root and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & stat.S_IWOTH and not sticky_root:
        return "is writable by others" + (" and not sticky" if is_root else "")
    if st.st_mode & stat.S_IWGRP and not sticky_root and not private_group(st.st_gid, st.st_uid):
        import grp

        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return f"is writable by group {group} (gid {st.st_gid}), which has members other than its owner"
    return None


def check(root: Path, target: Optional[Path] = None, file: bool = True) -> Optional[Refusal]:
    """The first place on the way from ``root`` down to ``target`` that someone else could change, as a
    :class:`Refusal`; None if there is none. ``target`` (inside ``root``) is a regular file if ``file``, else a
    folder; every folder between them is checked too. Without ``target`` only the root is checked. The root is
    followed if it is a link (a link above the root is the trusted parents' business); nothing below it may be one.

    Raises:
        ValueError: if ``ZERO_OFFLOAD_CACHE_TRUST`` names no user of this machine.
    """
    trusted = trusted_uids()
    try:
        st = os.stat(root)
    except OSError as exc:
        return refusal(root, f"cannot be read ({exc.strerror})", _own_cache_fix())
    if not stat.S_ISDIR(st.st_mode):
        return refusal(root, "is not a folder", "point ZERO_OFFLOAD_CACHE_DIR at a folder")
    problem = _problem(root, st, True, trusted)
    if problem is not None:
        fix = (_own_cache_fix(st.st_uid) if st.st_uid not in trusted else
               f"as its owner, `chmod go-w {root}` (or `chmod +t {root}` for a folder that all may write, as /tmp "
               "is), then remove the builds in it that you did not make")
        return Refusal(Path(root), _user(st.st_uid), _mode(st), problem, fix)
    if target is None:
        return None
    parts = Path(target).relative_to(root).parts
    path = Path(root)
    for depth, part in enumerate(parts, 1):
        path = path / part
        last = depth == len(parts)
        try:
            st = os.lstat(path)
        except OSError as exc:
            return refusal(path, f"cannot be read ({exc.strerror})", _remove_fix(root, path))
        problem = _kind_problem(st, last and file) or _problem(path, st, False, trusted)
        if problem is not None:
            return Refusal(path, _user(st.st_uid), _mode(st), problem, _below_root_fix(root, path, st, trusted))
    return None


def _remove_fix(root: Path, path: Path) -> str:
    top = Path(root) / Path(path).relative_to(root).parts[0]
    return f"remove {top} (what another account could change cannot be trusted; the next run builds it again)"


def _below_root_fix(root: Path, path: Path, st: os.stat_result, trusted: FrozenSet[int]) -> str:
    if st.st_uid in trusted:
        return _remove_fix(root, path)
    top = Path(root) / Path(path).relative_to(root).parts[0]
    return f"have {_name(st.st_uid)} or root remove {top}, or {_own_cache_fix(st.st_uid)}"


def check_open(fd: int, path: Path, fix: str, modes: bool = True) -> Optional[Refusal]:
    """What makes the file this process opened as ``fd`` (from ``path``) unsafe to read: it is not a regular file
    (a FIFO, a device, a folder), or its owner is not trusted, or (with ``modes``) others may write it; None if
    nothing. Asked of the opened file (``fstat``), it answers for what was opened, whatever ``path`` names now.

    Raises:
        ValueError: if ``ZERO_OFFLOAD_CACHE_TRUST`` names no user of this machine.
    """
    st = os.fstat(fd)
    trusted = trusted_uids()
    problem = _kind_problem(st, True)
    if problem is None and st.st_uid not in trusted:
        problem = f"is owned by an account other than you, root and those in {TRUST_VARIABLE}"
    if problem is None and modes:
        problem = _problem(path, st, False, trusted)
    return None if problem is None else Refusal(Path(path), _user(st.st_uid), _mode(st), problem, fix)


def open_file(path: Path, flags: int, fix: str, modes: bool = True, create_mode: int = 0o644) -> int:
    """``path`` opened with ``flags`` (``os.O_*``; ``O_CREAT`` makes it with ``create_mode``), never following a
    link nor waiting (``O_NOFOLLOW | O_NONBLOCK``: a FIFO would block an open for reading until someone writes
    to it), and returned only once :func:`check_open` (with ``fix`` and ``modes``) passes what was opened.

    Raises:
        OSError: where it cannot be opened (a link at ``path``: ELOOP).
        Untrusted: where what was opened fails :func:`check_open` (it is closed again).
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, create_mode)
    try:
        refused = check_open(fd, path, fix, modes)
    except BaseException:
        os.close(fd)
        raise
    if refused is not None:
        os.close(fd)
        raise Untrusted(refused)
    return fd


def read(root: Path, path: Path, limit: int = READ_LIMIT) -> bytes:
    """The content of ``path``, a file inside ``root``, once :func:`check` has passed the way down to it: opened by
    :func:`open_file` (not followed, not waited on, checked again as opened) and read only if it holds at most
    ``limit`` bytes (int, default :data:`READ_LIMIT`).

    Raises:
        Untrusted: where the file or a folder on the way fails a check, cannot be opened, or is too large; its
            ``refusal`` names the path and says why.
        ValueError: if ``ZERO_OFFLOAD_CACHE_TRUST`` names no user of this machine.
    """
    refused = check(root, path)
    if refused is not None:
        raise Untrusted(refused)
    fix = _remove_fix(root, path)
    try:
        fd = open_file(path, os.O_RDONLY, fix)
    except OSError as exc:
        raise Untrusted(refusal(path, f"cannot be opened ({exc.strerror})", fix)) from None
    try:
        chunks, size = [], 0
        while size <= limit:  # one byte past the limit tells a file that grew past it since fstat
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Untrusted(refusal(path, f"holds more than {limit} bytes (a file of the cache holds a few hundred)",
                                    fix))
        return b"".join(chunks)
    finally:
        os.close(fd)


def unwritable_root(root: Path) -> Refusal:
    """Why a root that passed :func:`check` but has no build for this process cannot take one, with the fix that
    fits: a read-only file system; a root of this user's own that is read-only (no write bit for its owner, or
    immutable); else a root of another account's, which that account can build into."""
    lacking = "has no build for this torch, compiler and Python and"
    elsewhere = "point ZERO_OFFLOAD_CACHE_DIR at a folder you can write"
    try:
        st, read_only = os.stat(root), bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError as exc:
        return refusal(root, f"{lacking} cannot be looked at ({exc.strerror})", elsewhere)
    if read_only:
        return refusal(root, f"{lacking} is on a read-only file system",
                       f"build into it where it is mounted read-write, or {elsewhere}")
    me = os.geteuid()
    if st.st_uid == me and me != 0 and not st.st_mode & stat.S_IWUSR:
        return refusal(root, f"{lacking} you, its owner, cannot write to it (its mode has no write bit for you)",
                       f"`chmod u+w {root}`, or {elsewhere}")
    if st.st_uid == me or me == 0:  # root is kept out by neither owner nor mode: by an immutable flag
        who = "you, its owner," if st.st_uid == me else "you (root)"
        return refusal(root, f"{lacking} {who} cannot write to it: it is immutable (`lsattr -d {root}` shows an "
                       "'i') or locked by a security module",
                       f"`chattr -i {root}` as root, or {elsewhere}")
    return refusal(root, f"{lacking} you cannot write to it",
                   "its owner can add the build: run `python -m zero_offload.report` as that account, with the same "
                   "torch, compiler and Python")
