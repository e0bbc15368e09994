"""The kvikio engine: CUDA device memory read and written through ``kvikio.CuFile`` (cuFile/GDS).

Run on one GPU with the real kvikio-cu13 26.10 in its compatibility mode (an H200 without
GPUDirect Storage, 2026-11-26); GDS itself has not run. Its logic (which buffers go to kvikio,
chunking, short reads, configuration, the reported mode, every call in a worker thread) is also
tested on CPU against a stand-in kvikio package that mirrors the real one's module layout and
signatures (tests/fake_kvikio, from kvikio 26.08).

Host buffers keep the posix path (``os.preadv``/``os.pwritev``, O_DIRECT writes): the scheduler
already runs them in parallel, and kvikio's host path is posix I/O on its own thread pool. Only
CUDA tensors go through ``CuFile.pread``/``pwrite``: with GPUDirect Storage the bytes move between
disk and GPU memory without a host copy. In kvikio's own compatibility mode (cuFile unavailable)
kvikio would bounce them through its own pinned buffers with plain reads; the engine then moves
them through the store's bounce slots instead (``cufile="auto"``), which measured faster. The
file format is the same as the posix engine's: every file either engine writes, the other reads.

Selected at run time by :func:`aiotensor.engines.default_engine`, only where torch sees a CUDA
device (so libcuda loaded) and ``import kvikio`` works.
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from .._runtime import cuda
from .posix import FD_DIR, PosixEngine


class KvikioEngine(PosixEngine):
    """Posix I/O for host memory, ``kvikio.CuFile`` for CUDA tensors.

    Args:
        direct, direct_reads: as :class:`~aiotensor.engines.PosixEngine`'s (host memory and bounce slots).
        num_threads: kvikio's thread pool size. The scheduler issues up to ``workers`` calls at
            once and each is one kvikio task (``task_size`` = the scheduler's chunk), so the pool
            needs ``workers`` threads to keep them all moving; fewer serialise them.
        task_size: kvikio's task size, in bytes.
        cufile: ``"auto"``: CUDA tensors go through cuFile unless kvikio runs in its own POSIX
            compatibility mode (``mode == "compat"``, no cuFile library: GDS cannot run), where
            they go through the store's pinned bounce slots and copy stream instead, as with the
            posix engine. Both then bounce through pinned host memory; ours reads with O_DIRECT
            and was faster on an H200 in both runs there (bench/results/gpu.md: cold loads
            1.41 vs 1.64 GB/s new, 1.44 vs 1.57 into existing tensors, medians of 4; 1.89 vs 1.92
            and 2.13 vs 2.42 a run before). ``"always"``: through kvikio whatever its mode (to
            compare, or to test kvikio's path).

    kvikio is set up once per process, in a thread of its own started by the first engine:
    ``import kvikio`` (0.6 s), opening the cuFile driver to ask whether GDS is available. Building
    an engine (every ``Scheduler()``, so every ``load_file``/``save_file``/``stream`` call that
    makes its own) returns at once; the first device call waits for the set-up, in a worker.
    Reading :attr:`mode` waits for it too. If kvikio fails to load there, the engine says so once
    (a warning) and moves CUDA tensors through bounce slots, as the posix engine does.

    kvikio's settings are process-wide: ``KVIKIO_NTHREADS`` (or ``KVIKIO_NUM_THREADS``, which
    kvikio 26.x also reads) and ``KVIKIO_TASK_SIZE`` in the environment win over these arguments
    (they are the user's explicit choice). ``mode`` says what kvikio does here: ``"gds"`` (cuFile
    with GPUDirect Storage), ``"cufile-compat"`` (cuFile without the nvidia-fs driver) or
    ``"compat"`` (kvikio's own POSIX compatibility mode). kvikio may still fall back to compat for
    one file (a file system without O_DIRECT: tmpfs before Linux 6.6); :attr:`file_modes` counts the
    files that went through cuFile by the mode that really ran for each.
    """

    # kvikio.CuFile opens a path: the file's own descriptor's (/proc/thread-self/fd/N), so a CUDA read of a
    # file unlinked since it was opened (a step retired while it loads) still reads that file (kvikio
    # reopens it, with O_DIRECT where it runs cuFile; its opt-in KVIKIO_THREAD_POOL_PER_BLOCK_DEVICE
    # caches a path's device, so there files of several devices may share one pool: only its speed)
    holds_files = FD_DIR is not None

    name = "kvikio"

    def __init__(
        self,
        *,
        direct: bool = True,
        direct_reads: bool | None = None,
        num_threads: int = 4,
        task_size: int = 16 << 20,
        cufile: str = "auto",
    ) -> None:
        if cufile not in ("auto", "always"):
            raise ValueError(f'cufile must be "auto" or "always", got {cufile!r}')
        super().__init__(direct=direct, direct_reads=direct_reads)
        self.cufile = cufile
        self._settings = (num_threads, task_size)
        self._configured = False
        _SETUP.start()
        self.file_modes: Counter[str] = Counter()
        self._paths: dict[int, tuple[str, str]] = {}  # fd -> (path, kvikio open flags)
        self._files: dict[int, Any] = {}  # fd -> CuFile, opened on the first device call
        self._lock = threading.Lock()

    def _kvikio(self) -> _Kvikio | None:
        """kvikio, set up, and configured for this engine (waits for the set-up); None if it failed."""
        k = _SETUP.wait()
        if k is not None and not self._configured:
            with _CONFIGURING:
                if not self._configured:
                    _configure(k.defaults, *self._settings)
                    self._configured = True
        return k

    @property
    def mode(self) -> str:  # type: ignore[override]
        k = self._kvikio()
        return k.mode if k is not None else "unavailable"

    @property
    def kvikio(self) -> Any:
        k = self._kvikio()
        assert k is not None, "kvikio failed to load"
        return k.module

    @property
    def defaults(self) -> Any:
        k = self._kvikio()
        assert k is not None, "kvikio failed to load"
        return k.defaults

    def _through_cufile(self) -> bool:
        """Does cuFile move CUDA tensors here (kvikio set up, and ``cufile`` says so for its mode)?
        Waits for kvikio's set-up."""
        k = self._kvikio()
        return k is not None and (self.cufile == "always" or k.mode != "compat")

    @property
    def label(self) -> str:
        if self.mode == "compat" and not self._through_cufile():
            return "kvikio (compat: CUDA tensors through bounce slots)"
        return super().label

    def handles_device(self, t: torch.Tensor) -> bool:
        """:meth:`device_memory` tensors, where cuFile moves them (:meth:`_through_cufile`: in a
        worker thread, it waits for kvikio's set-up)."""
        return self.device_memory(t) and self._through_cufile()

    def device_memory(self, t: torch.Tensor) -> bool:
        """Is ``t`` memory cuFile moves: a CUDA tensor whose bytes are its memory?"""
        return t.device.type == "cuda" and t.is_contiguous() and not t.is_conj() and not t.is_neg()

    def open_read(self, path: str) -> int:
        fd = super().open_read(path)
        self._paths[fd] = (path, "r")
        return fd

    def create(self, path: str, *, direct: bool = False) -> int:
        fd = super().create(path, direct=direct)
        self._paths[fd] = (path, "r+")  # read-write, neither created nor truncated again
        return fd

    def _cufile(self, fd: int) -> Any:
        with self._lock:
            f = self._files.get(fd)
            if f is None:
                path, flags = self._paths[fd]
                f = self._files[fd] = self.kvikio.CuFile(f"{FD_DIR}/{fd}" if FD_DIR else path, flags)
                mode_here = self.mode
                # GDS needs O_DIRECT on the file: without it kvikio runs this file in compat mode
                direct_io = getattr(f, "is_direct_io_supported", lambda: True)()
                mode = mode_here if mode_here != "gds" or direct_io else "compat"
                if mode != mode_here:
                    logging.getLogger("aiotensor").info("%s: no O_DIRECT on its file system: kvikio runs it in compat mode", path)
                self.file_modes[mode] += 1
            return f

    def pread_device(self, fd: int, dst: torch.Tensor, offset: int) -> int:
        return self._io("pread", fd, dst, offset)

    def pwrite_device(self, fd: int, src: torch.Tensor, offset: int) -> int:
        return self._io("pwrite", fd, src, offset)

    def _io(self, op: str, fd: int, buf: torch.Tensor, offset: int) -> int:
        try:
            f = self._cufile(fd)
            return int(getattr(f, op)(buf, buf.nbytes, offset).get())
        except (RuntimeError, ValueError, TypeError) as e:
            # kvikio reports cuFile and system errors as RuntimeError, bad arguments (a buffer it
            # cannot take, an offset past the file) as ValueError or TypeError
            code = _errno_of(str(e))
            raise OSError(code, f"kvikio {op} of {buf.nbytes} bytes at {offset} failed: {e}") from e

    def close(self, fd: int) -> None:
        with self._lock:
            f = self._files.pop(fd, None)
            self._paths.pop(fd, None)
        try:
            if f is not None:
                f.close()
        finally:
            super().close(fd)


# kvikio raises system errors (std::system_error) as RuntimeError("<what>: <strerror(errno)>")
_STRERROR = {os.strerror(code): code for code in sorted(errno.errorcode, reverse=True)}


def _errno_of(message: str) -> int:
    """The errno whose text ends kvikio's message (a full disk stays ENOSPC); ELIBACC where a shared
    library (libcuda.so.1, libcufile) failed to load, which dlerror also ends with "No such file or
    directory" but is no missing file; EIO otherwise."""
    if "shared object" in message or "shared library" in message:
        return errno.ELIBACC
    for text, code in _STRERROR.items():
        if message.endswith(text):
            return code
    return errno.EIO


_THREAD_VARS = ("KVIKIO_NTHREADS", "KVIKIO_NUM_THREADS")


def _configure(d: Any, num_threads: int, task_size: int) -> None:
    wanted = {}
    if not any(v in os.environ for v in _THREAD_VARS):
        wanted["num_threads"] = num_threads
    if "KVIKIO_TASK_SIZE" not in os.environ:
        wanted["task_size"] = task_size
    if not wanted:
        return
    if hasattr(d, "get") and hasattr(d, "set"):  # kvikio >= 25.04
        if d.get("num_threads") >= wanted.get("num_threads", 0):
            wanted.pop("num_threads", None)  # never shrink a pool another user of kvikio sized
        if wanted:
            d.set(wanted)
    else:
        if "num_threads" in wanted and d.get_num_threads() < num_threads:
            d.num_threads_reset(num_threads)
        if "task_size" in wanted:
            d.task_size_reset(task_size)


def io_mode(defaults: Any, driver: Any) -> str:
    """What kvikio does for device buffers here: ``"gds"``, ``"cufile-compat"`` or ``"compat"``
    (``"cufile"`` where an old kvikio cannot say whether GDS is available)."""
    if hasattr(defaults, "is_compat_mode_preferred"):
        compat = bool(defaults.is_compat_mode_preferred())
    else:  # before 25.04: a bool, later a CompatMode (OFF=0, ON=1, AUTO=2)
        m = defaults.compat_mode()
        compat = m is True or (not isinstance(m, bool) and int(m) == 1)
    if compat:
        return "compat"
    if driver is None:
        return "cufile"
    try:
        gds = bool(driver.get("is_gds_available"))
    except RuntimeError:  # libcufile missing or its driver failed to open: cuFile falls back
        return "cufile-compat"
    return "gds" if gds else "cufile-compat"


def kvikio_usable() -> bool:
    """True where this process may use CUDA (:func:`aiotensor._runtime.cuda.available`) and kvikio
    is installed (found, not imported: importing it is the set-up, which runs in a thread of its own)."""
    if not cuda.available():
        return False
    try:
        return importlib.util.find_spec("kvikio") is not None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return False


@dataclass(frozen=True)
class _Kvikio:
    module: Any
    defaults: Any
    driver: Any
    mode: str


class _Setup:
    """kvikio's set-up, once per process, in a thread of its own (see :class:`KvikioEngine`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = False
        self._result: _Kvikio | None = None

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name="aiotensor-kvikio-setup", daemon=True).start()

    def wait(self) -> _Kvikio | None:
        self.start()
        self._done.wait()
        return self._result

    def _run(self) -> None:
        log = logging.getLogger("aiotensor")
        try:
            # `import kvikio` does not load these submodules (kvikio 24.12-26.10 __init__): import them
            module = importlib.import_module("kvikio")
            defaults = importlib.import_module("kvikio.defaults")
            try:
                driver: Any = importlib.import_module("kvikio.cufile_driver")
            except ImportError:  # kvikio before 25.02 has no driver properties: GDS cannot be asked about
                driver = None
            self._result = _Kvikio(module, defaults, driver, io_mode(defaults, driver))
            log.info("kvikio engine: CUDA tensors move through cuFile in %s mode", self._result.mode)
        except ModuleNotFoundError as e:
            if e.name != "kvikio":  # (one of its own imports)
                log.warning("kvikio is installed but failed to load (%s): CUDA tensors move through bounce slots", e)
            else:  # (it said "is installed" when it was not: helper-50)
                log.warning("kvikio is not installed (pip install 'aiotensor[gds]'): CUDA tensors move through bounce slots")
        except Exception as e:  # a kvikio that fails to load its libraries
            log.warning("kvikio is installed but failed to load (%s): CUDA tensors move through bounce slots", e)
        finally:
            self._done.set()


_SETUP = _Setup()
_CONFIGURING = threading.Lock()


def forget_setup() -> None:
    """Set kvikio up again on next use (for tests that swap the kvikio package, and in a forked
    child, where a set-up thread that was running is gone)."""
    global _SETUP
    _SETUP = _Setup()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: forget_setup() if not _SETUP._done.is_set() else None)
