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

Writing (``renames = False``): every object is put whole, from the caller's memory (:meth:`put`);
a folder is a key prefix, marked as the library's by a :data:`FOLDER_MARKER` object created
conditionally (:meth:`mkdir`). Every create is conditional; a PUT the server did whose answer was
lost is retried by the client and refused, and an object holding exactly the bytes put is then
taken as done (:meth:`put`). :mod:`aiotensor.commit` says how a commit works without rename.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import posixpath
import socket
import stat
import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from .. import knobs
from .._runtime.buffers import copy_bytes
from ..errors import StoreLockedError, UnsupportedLocationError
from .base import Engine

log = logging.getLogger("aiotensor")
SCHEME = "s3://"
FOLDER_MARKER = ".aiotensor-folder"  # the object (a token) that makes a key prefix a folder the library made
PUT_MAX = 5 << 30  # S3's largest single PUT
PART_BYTES = 16 << 20  # a multipart upload's part (only for objects over PUT_MAX)
COALESCE = 64 << 10  # pread_ranges: ranges closer than this are fetched by one GET


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
    return UnsupportedLocationError(f"{path} names a folder: name one object (a store's folder is opened with TensorStore)")


class ObjectEngine(Engine):
    """Blocking reads of ``s3://`` objects (see the module's text)."""

    name = "s3"
    renames = False
    holds_files = False
    read_bytes = 8 << 20  # a ranged GET costs a round trip: 8 MiB each, several in flight

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            import obstore
        except ImportError:
            raise UnsupportedLocationError("reading s3:// URLs needs obstore: pip install 'aiotensor[s3]'") from None
        self._obstore = obstore
        self._options = dict(storage_options or {})
        # a client option, not an S3 one: from storage_options or the environment, as obstore reads it
        self._allow_http = str(self._options.pop("allow_http", os.environ.get("AWS_ALLOW_HTTP", ""))).lower() == "true"
        self._stores: dict[str, Any] = {}
        self._open: dict[int, tuple[Any, str, int, str | None]] = {}  # fd -> store, key, size, entity tag
        self._fds = itertools.count(1 << 30)
        self._lock = threading.Lock()

    def _store(self, bucket: str) -> Any:
        with self._lock:
            store = self._stores.get(bucket)
            if store is None:
                from obstore.store import S3Store

                retry = {
                    "max_retries": knobs.OBJECT_RETRIES,
                    "retry_timeout": timedelta(seconds=knobs.OBJECT_RETRY_S),
                    "backoff": {"init_backoff": timedelta(seconds=0.1), "max_backoff": timedelta(seconds=5), "base": 2},
                }
                client: dict[str, Any] = {
                    "timeout": timedelta(seconds=knobs.OBJECT_TIMEOUT_S),
                    "connect_timeout": timedelta(seconds=knobs.OBJECT_CONNECT_S),
                }
                if self._allow_http:
                    client["allow_http"] = True
                options: Any = self._options or None
                store = self._stores[bucket] = S3Store(bucket, config=options, client_options=client, retry_config=retry)  # type: ignore[arg-type]
            return store

    @staticmethod
    def _fail(e: Exception) -> OSError:
        """An OSError (FileNotFoundError for a missing object or bucket) of one line; the caller
        adds what it was doing and the URL."""
        if isinstance(e, FileNotFoundError) or "NoSuchBucket" in str(e):
            return FileNotFoundError(errno.ENOENT, f"no such object or bucket ({_short(e)})")
        if "builder error" in str(e) and "http://" in str(e):  # reqwest refuses a plain-http URL
            return OSError(
                errno.EINVAL,
                "the endpoint is http://, which the client refuses unless allowed: pass allow_http=True in "
                f"storage_options or set AWS_ALLOW_HTTP=true ({type(e).__name__}: {_short(e)})",
            )
        if "169.254.169.254" in str(e):  # no keys anywhere: the client asked the cloud's metadata service
            return PermissionError(
                errno.EACCES,
                "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for a server "
                f"of your own), or pass storage_options ({type(e).__name__}: {_short(e)})",
            )
        if type(e).__name__ in ("PermissionDeniedError", "UnauthenticatedError") or any(
            status in str(e) for status in ("401 Unauthorized", "403 Forbidden")
        ):  # wrong keys, or no right to the bucket: as "no credentials" is (helper-74: EIO)
            return PermissionError(errno.EACCES, f"access denied: the S3 keys are refused here ({type(e).__name__}: {_short(e)})")
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

    def identity(self, fd: int) -> tuple[int, str] | None:
        """The object's size and ETag (None where the store gives no ETag)."""
        _, _, size, etag = self._open[fd]
        return (size, etag) if etag else None

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

    def pread_ranges(self, fd: int, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Fetched together (obstore's ``get_ranges``: near ranges coalesced, up to 10 GETs in
        flight). Without ``If-Match``: a caller that must not mix versions reads the data itself
        with :meth:`pread`, which fails if the object was replaced since it was opened."""
        store, key, size, _ = self._open[fd]
        spans = [(off, min(size, off + n)) for off, n in ranges]
        live = [(a, b) for a, b in spans if b > a]
        try:
            got = iter(
                self._obstore.get_ranges(store, key, starts=[a for a, _ in live], ends=[b for _, b in live], coalesce=COALESCE)
            )
        except Exception as e:
            raise self._fail(e) from None
        return [bytes(next(got)) if b > a else b"" for a, b in spans]

    def close(self, fd: int) -> None:
        with self._lock:
            self._open.pop(fd, None)

    def exists(self, path: str) -> bool:
        """An object of that key, or a folder (any object under ``path/``)."""
        bucket, key = split(path)
        store = self._store(bucket)
        if key and not key.endswith("/"):
            try:
                self._obstore.head(store, key)
                return True
            except FileNotFoundError:
                pass
            except Exception as e:
                raise self._fail(e) from None
        try:
            return bool(self._keys(store, key, limit=1))
        except FileNotFoundError:  # no such bucket
            return False

    def stat(self, path: str) -> os.stat_result:
        """An object is a regular file (its entity tag stands for the inode, so a rewrite shows);
        a folder is a key prefix that has objects under it."""
        bucket, key = split(path)
        store = self._store(bucket)
        try:
            if not key.strip("/"):
                raise FileNotFoundError  # the bucket itself: a folder
            meta = self._obstore.head(store, key)
        except FileNotFoundError:
            if not self._keys(store, key, limit=1):
                raise FileNotFoundError(errno.ENOENT, "no such object or folder", path) from None
            return os.stat_result((stat.S_IFDIR | 0o755, 0, 0, 1, 0, 0, 0, 0, 0, 0))
        except Exception as e:
            raise self._fail(e) from None
        mtime = int(meta["last_modified"].timestamp())
        ino = zlib.crc32(str(meta.get("e_tag")).encode())
        return os.stat_result((stat.S_IFREG | 0o644, ino, 0, 1, 0, 0, int(meta["size"]), mtime, mtime, mtime))

    def listdir(self, path: str) -> list[str]:
        """The names right under the folder ``path`` (objects and folders)."""
        bucket, key = split(path)
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        try:
            got = self._obstore.list_with_delimiter(self._store(bucket), prefix or None)
        except Exception as e:
            raise self._fail(e) from None
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in got["common_prefixes"]]
        return names + [o["path"].rsplit("/", 1)[-1] for o in got["objects"]]

    def _keys(self, store: Any, key: str, limit: int | None = None) -> list[str]:
        """The keys under the folder ``key`` (at most about ``limit``)."""
        prefix = key.rstrip("/") + "/" if key.strip("/") else None
        out: list[str] = []
        try:
            for batch in self._obstore.list(store, prefix, chunk_size=limit or 1000):
                out += [o["path"] for o in batch]
                if limit is not None and len(out) >= limit:
                    break
        except Exception as e:
            raise self._fail(e) from None
        return out

    # --- writing: every object put whole -----------------------------------------------------

    def put(self, path: str, views: Sequence[memoryview]) -> None:
        """Put the object ``path`` (it must not exist: a conditional create) holding the bytes of
        ``views``, from the caller's memory. One PUT up to :data:`PUT_MAX` bytes, so that an
        interrupted upload leaves nothing behind; a bigger object is a multipart upload (obstore
        aborts it on an error, but a writer killed meanwhile leaves its parts to the bucket's
        lifecycle rules), which cannot be conditional."""
        bucket, key = split(path)
        size = sum(len(v) for v in views)
        mode: Any = "create" if size <= PUT_MAX else None
        try:
            self._obstore.put(  # type: ignore[call-overload]
                self._store(bucket), key, iter(views), mode=mode, use_multipart=mode is None,
                chunk_size=PART_BYTES, max_concurrency=8,
            )  # fmt: skip
        except Exception as e:
            if type(e).__name__ != "AlreadyExistsError":
                raise self._fail(e) from None
            if not self._holds(self._store(bucket), key, views):
                raise FileExistsError(errno.EEXIST, "an object of that name exists", path) from None
            # our own PUT, done, whose response was lost: the client's retry found it (helper-30)

    def _holds(self, store: Any, key: str, views: Sequence[memoryview]) -> bool:
        """Does the object ``key`` hold exactly the bytes of ``views``? (A conditional PUT that the
        server did but whose response a dropped connection lost is retried by the client, and the
        retry fails: the object exists. A shard, a manifest or a folder's marker, each unique to
        one save, with those very bytes is ours.) Its ETag is compared with their MD5 (S3's ETag
        of a single PUT), else its bytes with theirs. An object that is not there does not; a
        request that fails raises (OSError: it cannot tell)."""
        try:
            meta = self._obstore.head(store, key)
        except FileNotFoundError:
            return False
        except Exception as e:
            raise self._fail(e) from None
        try:
            if int(meta["size"]) != sum(map(len, views)):
                return False
            md5 = hashlib.md5(usedforsecurity=False)
            for v in views:
                md5.update(v)
            if str(meta.get("e_tag") or "").strip('"') == md5.hexdigest():
                return True
            # an ETag of another kind (encryption): the bytes compared, a piece at a time (an object of
            # up to PUT_MAX bytes read whole would double the memory of the save that put it)
            at = 0
            for v in views:
                for a in range(0, len(v), PART_BYTES):
                    piece = v[a : a + PART_BYTES]
                    if memoryview(self._obstore.get_range(store, key, start=at + a, length=len(piece))) != piece:
                        return False
                at += len(v)
        except FileNotFoundError:  # (replaced or removed meanwhile)
            return False
        except Exception as e:
            raise self._fail(e) from None
        return True

    def replace(self, path: str, tmp: str, data: bytes) -> None:
        """One PUT replaces an object atomically (no temporary object)."""
        bucket, key = split(path)
        try:
            self._obstore.put(self._store(bucket), key, data, use_multipart=False)
        except Exception as e:
            raise self._fail(e) from None

    def mkdir(self, path: str) -> bytes:
        """A folder is a key prefix: the library marks its own with :data:`FOLDER_MARKER`, created
        conditionally, so two writers cannot make the same folder (FileExistsError, as ``mkdir``).
        It holds a token of its own, returned, so that a retried PUT of it tells its own from
        another's, and its maker tells its folder from one made at that name since."""
        token = uuid.uuid4().hex.encode()
        self.put(posixpath.join(path, FOLDER_MARKER), [memoryview(token)])
        return token

    def holds(self, path: str, data: bytes) -> bool:
        bucket, key = split(path)
        return self._holds(self._store(bucket), key, [memoryview(data)])

    def sync_dir(self, path: str) -> None:
        """Nothing to do: an object is durable once its PUT returned."""

    def remove_file(self, path: str) -> None:
        bucket, key = split(path)
        try:
            self._obstore.delete(self._store(bucket), key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._fail(e) from None

    def remove_tree(self, path: str) -> None:
        """Delete the object ``path`` or every object under the folder ``path/``, the folder's
        marker last (a folder whose removal was interrupted is still recognised as the library's)."""
        bucket, key = split(path)
        store = self._store(bucket)
        keys = self._keys(store, key) or [key]
        keys.sort(key=lambda k: k.endswith("/" + FOLDER_MARKER))
        for k in keys:
            self.remove_file(f"{SCHEME}{bucket}/{k}")

    def _whole_objects(self, *_: Any, **__: Any) -> Any:
        raise UnsupportedLocationError("an object is written whole (Engine.put); it has no file handle to write through")

    def rename(self, src: str, dst: str) -> None:
        """An object store has no rename: the object is copied by the server (atomically, over any
        object ``dst``), then ``src`` deleted. Objects only (a folder's keys are not moved): the
        commit protocol never renames folders here (:mod:`aiotensor.commit`)."""
        bucket, key = split(src)
        if split(dst)[0] != bucket:
            raise UnsupportedLocationError(f"{src} -> {dst}: a rename within one bucket only")
        try:
            self.link(src, dst)
        except FileNotFoundError:
            if self._keys(self._store(bucket), key, limit=1):
                raise UnsupportedLocationError(f"{src}: an object store cannot rename a folder") from None
            raise
        self.remove_file(src)

    def link(self, src: str, dst: str) -> None:
        """The object ``src`` copied to ``dst`` by the server (no bytes through this machine)."""
        (bucket, key), (bucket2, key2) = split(src), split(dst)
        if bucket2 != bucket:
            raise OSError(errno.EXDEV, "a copy within one bucket only", dst)
        try:
            self._obstore.copy(self._store(bucket), key, key2)
        except Exception as e:
            raise self._fail(e) from None

    create = pwrite = truncate = sync = _whole_objects  # type: ignore[assignment]


class ObjectLease:
    """One writer per store on an object store, where there is no ``flock``: a lease object at
    ``path`` (the store's lock file's name) that the writer creates conditionally and renews with a
    conditional PUT (``If-Match`` its last version) every ``ttl / 3`` seconds from a thread of its
    own. Another writer takes the lease over only once it was not renewed for ``ttl`` seconds (its
    holder died, or lost the network), again with a conditional PUT, so of two takers one wins.
    :meth:`check`, run before each commit, renews the lease at once and fails if it was taken over:
    a writer that stalled past its lease never commits over its successor. The lease says how long
    it is (``ttl``); the server's ``Last-Modified`` is compared with this machine's clock, so clocks
    must agree to within a few seconds.

    The same interface as :class:`aiotensor.root.WriterLock`.
    """

    def __init__(self, engine: ObjectEngine, path: str, ttl: float) -> None:
        self.engine, self.path, self.ttl = engine, path, ttl
        self._etag: str | None = None
        self._lost = ""
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # the renewing thread and a commit's check() renew one version
        self._thread: threading.Thread | None = None
        self._body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "ttl": ttl, "id": uuid.uuid4().hex})
        self._mine = False  # the lease last read holds this lease's own body

    poll_s = knobs.LEASE_POLL_S

    @property
    def held(self) -> bool:
        return self._etag is not None

    def _put(self, mode: Any) -> str:
        bucket, key = split(self.path)
        result = self.engine._obstore.put(self.engine._store(bucket), key, self._body.encode(), mode=mode)
        return str(result["e_tag"])

    def try_acquire(self) -> bool:
        """Take the lease if it is free or expired; False while another writer holds it."""
        try:
            self._etag = self._put("create")
        except Exception as e:
            if type(e).__name__ != "AlreadyExistsError":
                raise self.engine._fail(e) from None
            held = self._current()
            if held is None:
                return False  # released meanwhile: the next try creates it
            etag, age, ttl = held
            if self._mine:  # our own create, done, its response lost and the retry refused (helper-30)
                self._etag = etag
            elif age <= ttl:
                return False
            else:
                try:  # expired: take it over, unless someone else just did
                    self._etag = self._put({"e_tag": etag})
                except Exception as e:
                    if type(e).__name__ == "PreconditionError":
                        return False
                    raise self.engine._fail(e) from None
                log.warning("%s: took over a writer lease not renewed for %.0f s (its writer died or stalled)", self.path, age)
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="aiotensor-lease", daemon=True)
        self._thread.start()
        return True

    def _current(self) -> tuple[str, float, float] | None:
        """The lease's version, seconds since it was last renewed, and its length; None if none."""
        bucket, key = split(self.path)
        store = self.engine._store(bucket)
        try:  # one GET: the version and the body it carries belong together
            got = self.engine._obstore.get(store, key)
            meta, body = got.meta, got.bytes()
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self.engine._fail(e) from None
        self._mine = bytes(body) == self._body.encode()  # (the body carries this lease's own id)
        try:
            ttl = float(json.loads(bytes(body))["ttl"])
        except (ValueError, KeyError, TypeError):
            ttl = knobs.LEASE_S
        return str(meta["e_tag"]), time.time() - meta["last_modified"].timestamp(), ttl

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.check()
            except StoreLockedError:
                return
            except OSError as e:  # the network: retried at the next tick, and by check() before a commit
                log.warning("%s: could not renew the writer lease (%s)", self.path, e)

    def check(self) -> None:
        """Renew the lease now.

        Raises:
            StoreLockedError: another writer took it over (this store must not commit).
            OSError: the server could not be asked.
        """
        with self._mutex:
            self._renew()

    def _renew(self) -> None:
        if self._lost:
            raise StoreLockedError(self._lost)
        if self._etag is None:
            raise StoreLockedError(f"{self.path}: this store does not hold the writer lease")
        try:
            self._etag = self._put({"e_tag": self._etag})
        except Exception as e:
            if type(e).__name__ not in ("PreconditionError", "NotFoundError") and not isinstance(e, FileNotFoundError):
                raise self.engine._fail(e) from None
            self._lost = (
                f"{self.path}: another writer took over this store's lease (it was not renewed for {self.ttl:.0f} s): "
                "this store can no longer save; nothing more is committed by it"
            )
            raise StoreLockedError(self._lost) from None

    def holder(self) -> str:
        """Who holds the lease ("pid N on HOST"), for messages ("" if unknown)."""
        bucket, key = split(self.path)
        try:
            d = json.loads(bytes(self.engine._obstore.get(self.engine._store(bucket), key).bytes()))
            return f"{int(d['pid'])} on {str(d['host'])[:64]}"
        except Exception:
            return ""

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still this writer's."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            etag, self._etag = self._etag, None
        if etag is None or self._lost:
            return
        held = self._current_or_none()
        if held is not None and held[0] == etag:
            self.engine.remove_file(self.path)

    def _current_or_none(self) -> tuple[str, float, float] | None:
        try:
            return self._current()
        except OSError:
            return None


__all__ = ["FOLDER_MARKER", "ObjectEngine", "ObjectLease", "PUT_MAX", "SCHEME", "split"]
