"""The folder of a TensorStore: names, the writer lock, and what a listing of it means.

Every function here blocks (file system calls) and runs in a worker thread.

A name is a committed step only if it is exactly ``step-`` + 12 ASCII digits, it is a real folder
(not a symbolic link) and it holds a manifest whose seal (its crc32c) holds and that names the same
step (or the sealed metadata of a DCP checkpoint). Listing checks only that, in memory the size of
the file: a load validates the whole manifest. Names the library itself
makes for work in progress (``step-…​.tmp-XXXXXXXX``, ``step-…​.tmp-delXXXXXXXX``,
``latest.tmp-XXXXXXXX``) are *leftovers*: only a writer holding the lock removes them, and nothing
else is ever removed. Everything else is *ignored* and reported, never counted as a step.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from . import commit, knobs
from .commit import is_leftover
from .engines import Engine
from .engines.objects import FOLDER_MARKER, ObjectEngine, ObjectLease
from .errors import FormatError, ManifestError, StoreLockedError, UnsafePathError
from .formats import dcp_metadata as dm
from .formats import manifest as mf

MANIFEST, DCP_METADATA = commit.MANIFEST, commit.DCP_METADATA
LATEST = "latest"
LOCK = ".aiotensor.lock"
_STEP = re.compile(r"step-([0-9]{12})")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def checkpoint_record(names: Iterable[str]) -> str | None:
    """The file among a folder's entry ``names`` that makes the folder a checkpoint itself, if one
    does: a DCP checkpoint's metadata (aiotensor's writer's, or DCP's own pickle), a step's manifest."""
    have = set(names)
    return next((n for n in (DCP_METADATA, dm.PICKLE_NAME, MANIFEST) if n in have), None)


def is_store(names: Iterable[str]) -> bool:
    """Do a folder's entry ``names`` make it a store root (a committed or a leftover step, ``latest``
    or the writer lock)?"""
    return any(n in (LATEST, LOCK) or parse_step(n) is not None or is_leftover(n) for n in names)


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def parse_step(name: str) -> int | None:
    """The step a folder name stands for, or None (``[0-9]``: full-width digits are not digits here)."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


# --- the writer lock ---------------------------------------------------------------------------


_NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)


class WriterLock:
    """One writer per root: ``flock`` on ``root/.aiotensor.lock``.

    The kernel drops the lock when its holder dies (even by SIGKILL), so a crash never leaves it held.
    ``flock`` locks belong to an open file, so two stores in one process exclude each other too.
    A child forked while the lock is held closes its copy of the file at once: it does not hold
    the lock (its parent does), and the lock still goes when the parent dies, however long a
    forked helper lives on.
    The file is never removed (removing a lock file races with its next holder), and never written
    unless it is the library's own: a regular file with one link that holds nothing but a pid (a
    hard link to another file would have that file written into, a FIFO would block).
    """

    poll_s = knobs.LOCK_POLL_S

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, LOCK)
        self._fd: int | None = None

    def check(self) -> None:
        """Before a commit: the lock file at the root's path is still the one this store locked. A
        ``flock`` is never taken from its holder, but it stays on the file it was taken on: a root
        moved or deleted (``mv ckpts ckpts.old``, then a new job at ``ckpts``), or its lock file
        removed, lets a second writer lock a new file there, and both wrote one folder (one's
        retention deleting the other's steps).

        Raises:
            StoreLockedError: the lock file is gone or another one (nothing more is committed).
        """
        fd = self._fd
        if fd is None:
            return
        try:
            now = os.stat(self.path, follow_symlinks=False)
            same = os.path.samestat(now, os.fstat(fd))
        except FileNotFoundError:
            same = False
        if not same:
            raise StoreLockedError(
                f"{self.path} is no longer the lock file this store holds (the folder was moved or deleted, or the file "
                "removed, while it wrote there): it is not the writer of that folder any more, and commits nothing there; "
                "close it and open the folder again"
            )

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False if another writer holds it.

        Raises:
            UnsafePathError: something other than aiotensor's lock file has its name (left alone).
        """
        with _forking:  # a fork meanwhile would leave the child a copy the hook below cannot see
            fd = _open_lock(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException as e:
                os.close(fd)
                if isinstance(e, OSError) and e.errno in _NO_FLOCK:
                    raise OSError(e.errno, f"{e.strerror}: this file system does not support flock(2), which the "
                                  "one-writer lock takes (Lustre: mount with -o flock); readonly=True stores take no "
                                  "lock", self.path) from e  # fmt: skip
                raise
            pid = f"{os.getpid()}\n".encode()
            try:  # the holder's pid, for the message a second writer gets (informative only)
                os.pwrite(fd, pid, 0)
                os.ftruncate(fd, len(pid))
            except OSError:
                pass
            self._fd = fd
            _held_locks.add(self)
        return True

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> str:
        """The pid the current holder wrote, for messages ("" if unknown)."""
        try:
            fd = _open_lock(self.path, create=False)
        except (OSError, FormatError):
            return ""
        try:
            return os.pread(fd, _LOCK_MAX, 0).decode("ascii", "replace").strip()
        finally:
            os.close(fd)

    def release(self) -> None:
        with _forking:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)  # closing the file drops the flock


_held_locks: weakref.WeakSet[WriterLock] = weakref.WeakSet()
_forking = threading.Lock()  # held around taking and letting go of a lock, and around a fork


def _let_go_in_child() -> None:
    """In a forked child: close the inherited descriptions of the parent's locks (the parent's
    own stay open, and with them its lock)."""
    global _forking
    _forking = threading.Lock()  # the fork happened while the parent's thread held it
    for lock in list(_held_locks):
        if lock._fd is not None:
            fd, lock._fd = lock._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=lambda: _forking.acquire(), after_in_parent=lambda: _forking.release(), after_in_child=_let_go_in_child
    )


def writer_lock(engine: Engine, root: str) -> WriterLock | ObjectLease:
    """The one-writer rule of ``root``: a :class:`WriterLock`, or on an object store an
    :class:`~aiotensor.engines.objects.ObjectLease` of ``knobs.LEASE_S`` seconds."""
    if isinstance(engine, ObjectEngine):
        return ObjectLease(engine, os.path.join(root, LOCK), knobs.LEASE_S)
    return WriterLock(root)


_LOCK_MAX = 32
_PID = re.compile(rb"[0-9]*\n?")


def _open_lock(path: str, create: bool = True) -> int:
    """Open the lock file (creating it if missing), never truncating it, following a link or
    blocking; refuse anything but aiotensor's own lock file."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC
    if create:
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            raise _foreign_lock("a symbolic link" if e.errno == errno.ELOOP else "a folder", path) from None
        raise
    try:
        why = _not_ours(fd, os.fstat(fd), _LOCK_MAX, _PID)
        if why:
            raise _foreign_lock(why, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _foreign_lock(what: str, path: str) -> UnsafePathError:
    return UnsafePathError(f"is {what}, not the lock file aiotensor makes: left alone (move it away to write here)", path)


def _not_ours(fd: int, meta: os.stat_result, most: int, text: re.Pattern[bytes]) -> str:
    """Why the open file ``fd`` is not a small file the library wrote ("" if it may be): a file the
    library replaces or writes into must be a regular file of one link holding what it writes."""
    if stat.S_ISDIR(meta.st_mode):
        return "a folder"
    if not stat.S_ISREG(meta.st_mode):
        return "a special file (FIFO, device or socket)"
    if meta.st_nlink != 1:
        return f"a file with {meta.st_nlink} hard links"
    if meta.st_size > most or not text.fullmatch(os.pread(fd, most + 1, 0)):
        return "a file with other contents"
    return ""


# --- listing -----------------------------------------------------------------------------------


@dataclass
class Listing:
    """What a root holds, as :func:`scan` found it."""

    committed: dict[int, str] = field(default_factory=dict)  # step -> folder name
    leftovers: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)  # name -> why it is not a step
    errors: dict[str, Exception] = field(default_factory=dict)  # name -> the error its manifest raised
    latest: str | None = None  # the step folder `latest` names (None: no such file, or not the library's)


def stat_key(meta: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is replaced or written to (an object's entity tag stands for its inode)."""
    return (meta.st_dev, meta.st_ino, meta.st_size, meta.st_mtime_ns)


def scan(engine: Engine, root: str, known: dict[str, tuple[tuple[int, int, int, int], int]]) -> Listing:
    """List ``root``: committed steps (each manifest validated, or taken from ``known`` when its file
    is unchanged), leftovers and ignored names. ``known`` (name -> (manifest stat key, step)) is
    updated in place, so a store re-validates only what changed.
    """
    out = Listing()
    names = engine.listdir(root)
    for name in names:
        if name == LOCK:
            continue
        if name == LATEST:
            out.latest, foreign = read_latest(engine, root)
            if foreign:
                out.ignored[name] = foreign
            continue
        if is_leftover(name):
            out.leftovers.append(name)
            continue
        step = parse_step(name)
        if step is None:
            if name.startswith("step-") or ".tmp-" in name:
                out.ignored[name] = "not a name aiotensor makes (step- and 12 ASCII digits)"
            continue  # other files (a user's notes) are simply not ours
        why = _why_not_committed(engine, root, name, step, known)
        if why is _GONE:
            continue  # retired (or deleted) since the folder was listed: nothing to say about it
        if why is None:
            out.committed[step] = name
        elif why is _NO_RECORD and not engine.renames and engine.exists(os.path.join(root, name, FOLDER_MARKER)):
            out.leftovers.append(name)  # an object store's step folder that never got (or lost) its record
        elif isinstance(why, Exception):
            out.ignored[name] = f"not a valid checkpoint: {_short(str(why))}"
            out.errors[name] = why
        else:
            out.ignored[name] = why
    names_kept = set(out.committed.values())
    for name in list(known):
        if name not in names_kept:
            del known[name]
    return out


_GONE = "gone"  # the folder went away while the root was listed (a writer retired it)


def _why_not_committed(
    engine: Engine, root: str, name: str, step: int, known: dict[str, tuple[tuple[int, int, int, int], int]]
) -> str | Exception | None:
    """None if ``root/name`` is a committed step, else why not (the error its manifest raised)."""
    folder = os.path.join(root, name)
    try:
        meta = engine.stat(folder)
    except FileNotFoundError:
        return _GONE
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISDIR(meta.st_mode):
        return "a symbolic link, not a folder (never followed)" if stat.S_ISLNK(meta.st_mode) else "not a folder"
    try:
        mst = engine.stat(os.path.join(folder, MANIFEST))
    except FileNotFoundError:
        why = _check_dcp_step(engine, folder)
        return _GONE if why is not None and not engine.exists(folder) else why

    except OSError as e:
        return f"cannot be read ({e.strerror})"
    key = stat_key(mst)
    if known.get(name) == (key, step):
        return None
    path = os.path.join(folder, MANIFEST)
    try:  # its seal and the step it names: listing a root never parses a manifest (a load does, in full)
        named = mf.sealed_step(read_small(engine, path, mf.MAX_MANIFEST_BYTES, ManifestError, "the manifest"), path)
        if named != step:
            raise ManifestError(f"the manifest is of step {named}, but its folder is {step_dir_name(step)}", path)
    except (FormatError, OSError) as e:
        return e
    known[name] = (key, step)
    return None


def _check_dcp_step(engine: Engine, folder: str) -> str | Exception | None:
    """None if ``folder`` is a checkpoint committed by :class:`aiotensor.dcp.AiotensorWriter` (its
    sealed metadata is intact), else why not."""
    path = os.path.join(folder, DCP_METADATA)
    if not engine.exists(path):
        return DCP_OWN if engine.exists(os.path.join(folder, dm.PICKLE_NAME)) else _NO_RECORD
    try:
        data = read_small(engine, path, mf.MAX_MANIFEST_BYTES, ManifestError, "the DCP metadata")
        mf.check_seal(data, path)
    except (FormatError, OSError) as e:
        return e
    return None


_NO_RECORD = "no manifest.json (not a checkpoint)"
# a folder named as a step that DCP's own writer (FileSystemWriter) made: a checkpoint, but not one
# this store committed (helper-64: `ls` said it was no checkpoint, `verify` counted it bad)
DCP_OWN = "a checkpoint of DCP's own writer (.metadata), not a step of this store: aiotensor.dcp.load_full or stream reads it"


def is_dcp_step(engine: Engine, folder: str) -> bool:
    return not engine.exists(os.path.join(folder, MANIFEST)) and engine.exists(os.path.join(folder, DCP_METADATA))


def read_manifest(engine: Engine, folder: str, step: int | None = None) -> mf.Manifest:
    """Read and validate ``folder/manifest.json``; with ``step``, it must name that step.

    Raises:
        ManifestError: malformed, or it names another step than its folder.
        UnsafePathError / OSError: not a regular file, or unreadable.
    """
    path = os.path.join(folder, MANIFEST)
    identity: list[Any] = []
    m = mf.loads(read_small(engine, path, mf.MAX_MANIFEST_BYTES, ManifestError, "the manifest", identity=identity), path)
    if step is not None and m.step != step:
        raise ManifestError(f"the manifest is of step {m.step}, but its folder is {step_dir_name(step)}", path)
    return replace(m, identity=identity[0])


def read_small(
    engine: Engine,
    path: str,
    limit: int,
    error: type[FormatError],
    what: str,
    shown: str | None = None,
    identity: list[Any] | None = None,
) -> bytes:
    """A whole small file of at most ``limit`` bytes, read through ``engine`` (blocking); errors
    name ``shown`` (the path a user knows, where ``path`` is a link's target) or ``path``; the
    file's :meth:`~aiotensor.engines.Engine.identity` is appended to ``identity``, where given."""
    fd = engine.open_read(path)
    try:
        if identity is not None:
            identity.append(engine.identity(fd))
        size = engine.size(fd)
        if size > limit:
            raise error(f"{what} is {size} bytes, over the {limit} byte cap", shown or path)
        return read_range(engine, fd, 0, size, shown or path, error, what)
    finally:
        engine.close(fd)


def read_range(engine: Engine, fd: int, offset: int, nbytes: int, path: str, error: type[FormatError], what: str) -> bytes:
    """``nbytes`` bytes at ``offset`` of an open file; a file that ends first is ``error`` (blocking)."""
    buf = bytearray(nbytes)
    view, off = memoryview(buf), 0
    while off < nbytes:
        n = engine.pread(fd, view[off:], offset + off)
        if n <= 0:
            raise error(f"{what} ends at byte {offset + off} of the file (it is shorter than recorded, or shrank)", path)
        off += n
    return bytes(buf)


_LATEST_TEXT = re.compile(rb"step-[0-9]{12}\n")


def read_latest(engine: Engine, root: str) -> tuple[str | None, str]:
    """``(name, "")``: the step folder ``root/latest`` names, or None when there is no such file;
    ``(None, why)`` when something else has that name (a folder, a link, a file of other contents):
    it is the user's, and the library never replaces or removes it."""
    path = os.path.join(root, LATEST)
    if not engine.renames:  # an object: no links, no special files; only its contents can be foreign
        try:
            data = read_small(engine, path, 64, FormatError, "latest")
        except FileNotFoundError:
            return None, ""
        except FormatError:
            data = b""  # too big to be ours
        if not _LATEST_TEXT.fullmatch(data):
            return None, _foreign_latest("an object of other contents")
        return data.decode().strip(), ""
    for _ in range(3):  # a file the writer replaced while it was read (no link left): read the new one
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC)
        except FileNotFoundError:
            return None, ""
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
            return None, _foreign_latest(why)
        try:
            meta = os.fstat(fd)
            why = _not_ours(fd, meta, len("step-000000000000\n"), _LATEST_TEXT)
            name = "" if why else os.pread(fd, 64, 0).decode("ascii").strip()
        finally:
            os.close(fd)
        if meta.st_nlink:  # (a reader took it for a foreign file: 11 of 75,129 listings, helper-32)
            break
    return (None, _foreign_latest(why)) if why else (name, "")


def _foreign_latest(what: str) -> str:
    return f"{what}, not the file aiotensor writes there: left alone"


def point_latest(engine: Engine, root: str, name: str | None) -> str:
    """Make ``root/latest`` name the step folder ``name`` (None: remove it), durably, unless
    something other than the library's own file has that name: then nothing is touched and the
    reason is returned ("" when done). Blocking: a worker thread."""
    found, why = read_latest(engine, root)
    if why or found == name:
        return why
    data = None if name is None else f"{name}\n".encode()
    return commit.replace_small(engine, os.path.join(root, LATEST), data, lambda: read_latest(engine, root)[1])


def _short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + "…"


__all__ = [
    "is_store",
    "LATEST",
    "LOCK",
    "MANIFEST",
    "Listing",
    "WriterLock",
    "parse_step",
    "point_latest",
    "read_latest",
    "read_manifest",
    "read_range",
    "read_small",
    "scan",
    "step_dir_name",
    "writer_lock",
]
