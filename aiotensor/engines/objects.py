"""Reading objects of an S3-compatible store (``s3://bucket/key``) through ``obstore``.

The engine contract of :mod:`.base` over objects: ``open_read`` asks for the object's size and
entity tag once; every ``pread`` is a ranged GET of that version only (``If-Match``), so an object
replaced while it is read fails the read instead of mixing two versions. The scheduler's worker
threads issue the ranges in parallel, as they issue ``pread`` calls on a local file; obstore's calls
release the GIL while they wait.

Credentials and the endpoint come from the environment as AWS tools read them (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``,
``AWS_ALLOW_HTTP``...), or from ``storage_options`` (obstore's S3 config keys). Error messages carry
the URL and the server's status, never a credential.

Writing is not built yet: every write operation raises
:class:`~aiotensor.errors.UnsupportedLocationError`.
"""

from __future__ import annotations

import errno
import itertools
import threading
from collections.abc import Mapping
from typing import Any

from .._runtime.buffers import copy_bytes
from ..errors import UnsupportedLocationError
from .base import Engine

SCHEME = "s3://"


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → ``(bucket, key)``."""
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise UnsupportedLocationError(f"{url!r} names no bucket (s3://bucket/key)")
    return bucket, key


def _short(e: BaseException) -> str:
    """obstore's message without its multi-line debug dump."""
    return str(e).split("\n", 1)[0][:500]


def _no_folders(path: str) -> UnsupportedLocationError:
    return UnsupportedLocationError(f"{path}: s3:// folders (stores, Hugging Face folders) are not built yet; name one object")


class ObjectEngine(Engine):
    """Blocking reads of ``s3://`` objects (see the module's text)."""

    name = "s3"
    read_bytes = 8 << 20  # a ranged GET costs a round trip: 8 MiB each, several in flight

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            import obstore
        except ImportError:
            raise UnsupportedLocationError("reading s3:// URLs needs obstore: pip install 'aiotensor[s3]'") from None
        self._obstore = obstore
        self._options = dict(storage_options or {})
        self._stores: dict[str, Any] = {}
        self._open: dict[int, tuple[Any, str, int, str | None]] = {}  # fd -> store, key, size, entity tag
        self._fds = itertools.count(1 << 30)
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                store = self._stores[bucket] = S3Store(bucket, config=self._options or None)  # type: ignore[arg-type]
            return store

    @staticmethod
    def _fail(e: Exception) -> OSError:
        """An OSError (FileNotFoundError for a missing object or bucket) of one line; the caller
        adds what it was doing and the URL."""
        if isinstance(e, FileNotFoundError):
            return FileNotFoundError(errno.ENOENT, f"no such object ({_short(e)})")
        return OSError(errno.EIO, f"{type(e).__name__}: {_short(e)}")

    def open_read(self, path: str) -> int:
        bucket, key = split(path)
        if not key or key.endswith("/"):
            raise _no_folders(path)
        store = self._store(bucket)
        try:
            meta = self._obstore.head(store, key)
        except Exception as e:
            raise self._fail(e) from None
        fd = next(self._fds)
        with self._lock:
            self._open[fd] = (store, key, int(meta["size"]), meta.get("e_tag"))
        return fd

    def size(self, fd: int) -> int:
        return self._open[fd][2]

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        store, key, size, etag = self._open[fd]
        end = min(size, offset + len(buf))
        if end <= offset:
            return 0
        options: dict[str, Any] = {"range": (offset, end)}
        if etag:
            options["if_match"] = etag
        try:
            data = self._obstore.get(store, key, options=options).bytes()  # type: ignore[arg-type]
        except Exception as e:
            raise self._fail(e) from None
        n = len(data)
        copy_bytes(buf[:n], data)
        return n

    def close(self, fd: int) -> None:
        with self._lock:
            self._open.pop(fd, None)

    def exists(self, path: str) -> bool:
        bucket, key = split(path)
        try:
            self._obstore.head(self._store(bucket), key)
        except FileNotFoundError:
            return False
        return True

    # --- not built yet: writes ----------------------------------------------------------------

    def _read_only(self, *_: Any, **__: Any) -> Any:
        raise UnsupportedLocationError("writing to s3:// is not built yet: this version reads objects only")

    create = pwrite = truncate = sync = mkdir = rename = sync_dir = remove_tree = remove_file = _read_only  # type: ignore[assignment]

    def listdir(self, path: str) -> list[str]:
        raise _no_folders(path)


__all__ = ["ObjectEngine", "SCHEME", "split"]
