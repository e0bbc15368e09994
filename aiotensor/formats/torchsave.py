"""torch.save files (the zip format), read without unrestricted pickle.

``data.pkl`` is unpickled by a restricted unpickler that knows only what state_dicts are made of
(tensors, parameters, storages, dtypes, ``OrderedDict``, Python containers and scalars, and the
``set``, ``complex``, ``bytearray``, ``torch.device``, layout and qscheme values it also admits), like
``torch.load(weights_only=True)``; any other global refuses the file with
:class:`~aiotensor.errors.UnsafeFileError` before anything runs. Storages are never unpickled:
their zip entries must be stored uncompressed, their sizes must match what the pickle declares,
and every tensor must lie inside its storage. The result is a *layout*: where each tensor's bytes
are in the file, so they are read straight from their offsets (by the engine, in parallel).
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UnsafeFileError
from .dtypes import TORCH_TO_SAFETENSORS
from .pickled import brief, check_hashing, checked, hash_budget
from .tree import key_path, unique_key

if TYPE_CHECKING:
    from ..engines.base import Engine

MAX_PICKLE_BYTES = 64 << 20
ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True)
class Storage:
    """A storage's zip entry: ``offset`` (absolute, in the file) and ``nbytes``; ``dtype`` as pickled;
    ``crc32`` the zip's CRC-32 of its bytes (torch.load never checks it; aiotensor does), None
    where the file records none (``torch.serialization.set_crc32_options(False)``)."""

    key: str
    dtype: torch.dtype | None  # None: an UntypedStorage (bytes), typed by the tensor that uses it
    offset: int
    nbytes: int
    crc32: int | None = 0

    def __setstate__(self, state: Any) -> None:
        _no_build(self)


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the file: a strided view of ``storage``, in elements of ``dtype``; ``conj`` and
    ``neg``: torch's lazy conjugate and negative bits (``x.conj()`` saved as it is: its storage
    holds ``x``'s values, and the tensor reads their conjugate)."""

    storage: Storage
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool
    conj: bool = False
    neg: bool = False
    parameter: bool = False  # an nn.Parameter (torch.load gives it back as one)
    # a Parameter's Python attributes (Megatron's tensor_model_parallel, partition_dim...)
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __setstate__(self, state: Any) -> None:
        _no_build(self)

    @property
    def contiguous(self) -> bool:
        expected, acc = [], 1
        for d in reversed(self.size):
            expected.append(acc)
            acc *= d
        return all(s == e or d == 1 for s, e, d in zip(self.stride, reversed(expected), self.size, strict=True))

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize

    @property
    def file_offset(self) -> int:
        return self.storage.offset + self.storage_offset * self.dtype.itemsize


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, storages: dict[str, tuple[int, int, int | None]], path: object) -> None:
        super().__init__(io.BytesIO(data))
        self.storages = storages  # key -> (file offset, nbytes, crc32 or None) of its zip entry
        self.path = path
        self.size, self.made = len(data), 0
        left = [hash_budget(len(data))]  # what Counter and OrderedDict may spend hashing, all calls together
        self._counter, self._odict = checked(Counter, left), checked(OrderedDict, left)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return self._odict
        if (module, name) == ("collections", "Counter"):  # MultiStepLR's milestones
            return self._counter
        if (module, name) == ("torch", "Size"):
            return torch.Size
        if (module, name) == ("_codecs", "encode"):  # how protocol 2 pickles bytes
            return self._latin1
        if module == "torch._utils" and name in _REBUILDS:
            return getattr(_Rebuild, name)
        if module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        if module == "torch" and name in _LEGACY_STORAGES:
            return _LegacyStorage(_LEGACY_STORAGES[name])
        if module == "torch" and isinstance(got := vars(torch).get(name), (torch.dtype, torch.qscheme)):
            return got  # (vars: torch's getattr imports a lazy submodule of that name, torch._dynamo's 800)
        if module in ("builtins", "__builtin__") and name in ("set", "complex", "bytearray"):  # (protocol 2: __builtin__)
            return getattr(self, f"_{name}")
        if (module, name) == ("torch", "device"):
            return _device
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        raise UnsafeFileError(f"refusing the global {module}.{name}: not part of a state_dict (nothing was run)", self.path)

    # what torch.load(weights_only=True) admits of Python's own types beyond containers and scalars
    # (a set of milestones, a complex hyper-parameter, a device in a config), made within bounds

    def _made(self, n: int) -> None:
        """Count ``n`` bytes (or members) a constructor makes: a memo lets a pickle ask for one
        object's copy over and over (400 copies of 1 MB from a pickle of 1 MB), so what they make
        in all is bounded by the pickle's own size."""
        self.made += n
        if self.made > 4 * self.size + (1 << 20):
            raise UnsafeFileError(f"the pickle makes more than {4 * self.size + (1 << 20)} bytes of values from {self.size}")

    def _latin1(self, text: Any, encoding: Any) -> bytes:
        """``_codecs.encode`` as a protocol-2 pickle of ``bytes`` calls it, and only so."""
        if not (type(text) is str and encoding == "latin1"):
            raise UnsafeFileError("_codecs.encode called other than for bytes (a str and latin1): refused")
        self._made(len(text))
        return text.encode("latin1")

    def _bytearray(self, data: Any = b"", encoding: Any = None) -> bytearray:
        """Of the bytes a pickle holds (protocol 2: a str and latin-1), never of a size:
        ``bytearray(10**12)`` would allocate it."""
        if not ((type(data) is bytes and encoding is None) or (type(data) is str and encoding in ("latin-1", "latin1"))):
            raise UnsafeFileError(f"bytearray of a {type(data).__name__} ({str(encoding)[:20]}), not of bytes: refused")
        self._made(len(data))
        return bytearray(data, "latin-1") if isinstance(data, str) else bytearray(data)

    def _set(self, items: Any = ()) -> set[Any]:
        """Of plain values only (what a state holds in a set: milestones, names): a member is
        hashed as it goes in, and a tuple nested a million deep overflows the C stack there, or
        one shared with itself 40 times over takes 2**40 steps; a tensor in a set would never be
        read."""
        items = list(items) if isinstance(items, (list, tuple)) else None
        if items is None or not all(map(_plain_member, items)):
            raise UnsafeFileError("a set of other than plain values (None, bool, int, float, str, bytes): refused")
        self._made(len(items))
        return set(items)

    def _complex(self, *args: Any) -> complex:
        if not (len(args) <= 2 and all(type(a) in (int, float) for a in args)):
            raise UnsafeFileError(f"complex of {[type(a).__name__ for a in args]}: refused")
        try:
            return complex(*args)
        except OverflowError as e:  # an int past a float's range
            raise UnsafeFileError(f"complex: {e}") from None

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeFileError(f"unexpected persistent id {brief(pid)}", self.path)
        _, kind, key, _location, numel = pid
        if not (isinstance(key, str) and isinstance(numel, int) and numel >= 0):
            raise UnsafeFileError("malformed storage reference", self.path)
        if key not in self.storages:
            raise UnsafeFileError(f"storage {key!r} has no entry in the archive", self.path)
        offset, nbytes, crc = self.storages[key]
        dtype = kind.dtype if isinstance(kind, _LegacyStorage) else None
        if kind is not _UNTYPED and dtype is None:
            raise UnsafeFileError(f"storage {key!r} has an unknown type", self.path)
        want = numel * (dtype.itemsize if dtype is not None else 1)
        if want != nbytes:
            raise UnsafeFileError(f"storage {key!r} declares {want} bytes but its entry holds {nbytes}", self.path)
        return Storage(key, dtype, offset, nbytes, crc)


class _LegacyStorage:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __setstate__(self, state: Any) -> None:
        _no_build(self)


def _plain_value(v: Any) -> bool:
    """None, bool, int, float or str, or a list or tuple of at most 64 of them: what parameters
    are marked with. Never walked deeper (the pickle memo lets a file of a few KB share one list
    billions of times over)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, (list, tuple)) and len(v) <= 64 and all(x is None or isinstance(x, (bool, int, float, str)) for x in v)


def _device(*args: Any) -> torch.device:
    if not (1 <= len(args) <= 2 and isinstance(args[0], str) and all(type(a) is int for a in args[1:])):
        raise UnsafeFileError(f"torch.device{brief(args)}: refused")
    try:
        return torch.device(*args)
    except RuntimeError as e:  # an unknown device type, an index out of range
        raise ValueError(str(e)) from None


def _plain_member(v: Any) -> bool:
    return v is None or type(v) in (bool, int, float, str, bytes)


def _layout(name: Any) -> torch.layout:
    got = vars(torch).get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if not isinstance(got, torch.layout):
        raise UnsafeFileError(f"no layout {brief(name)}")
    return got


def _no_build(obj: object) -> None:
    """The pickle's BUILD opcode on what describes a tensor or a storage: refused (torch's own
    unpickler applies it to tensors only as a legacy ``set_``, which a state_dict never needs), so
    that nothing changes after its bounds were checked."""
    raise UnsafeFileError(f"data.pkl rewrites a {type(obj).__name__.lstrip('_')} after it was made (BUILD): refused")


_UNTYPED = object()


class _Rebuild:
    """Stand-ins for torch's rebuild functions: they describe tensors, they never make them."""

    @staticmethod
    def _rebuild_tensor_v2(
        storage: Storage, offset: int, size: Any, stride: Any, requires_grad: bool, hooks: Any, metadata: Any = None
    ) -> TensorRef:
        if storage.dtype is None:
            raise UnsafeFileError("an untyped storage used without a dtype")
        return _tensor(storage, storage.dtype, offset, size, stride, requires_grad, metadata)

    @staticmethod
    def _rebuild_tensor_v3(
        storage: Storage,
        offset: int,
        size: Any,
        stride: Any,
        requires_grad: bool,
        hooks: Any,
        dtype: Any,
        metadata: Any = None,
    ) -> TensorRef:
        if not isinstance(dtype, torch.dtype):
            raise UnsafeFileError("a tensor whose dtype is not a torch.dtype")
        return _tensor(storage, dtype, offset, size, stride, requires_grad, metadata)

    @staticmethod
    def _rebuild_parameter_with_state(data: TensorRef, requires_grad: bool, hooks: Any, state: Any) -> TensorRef:
        """A Parameter with Python attributes: torch.load sets each (``state``: its ``__dict__``, or
        that and its slots). Only a few, each a new plain name (none a Parameter already has)
        holding a plain value (:func:`_plain_value`), are admitted."""
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
        attrs: dict[str, Any] = {}
        for part in parts:
            if part is None:
                continue
            if not (isinstance(part, dict) and len(part) <= 64):
                raise UnsafeFileError(f"a parameter's state is a {type(part).__name__}: not a dict of a few attributes")
            for k, v in part.items():
                if not (isinstance(k, str) and k.isidentifier() and not hasattr(torch.nn.Parameter, k)):
                    name = k[:40] if isinstance(k, str) else f"<a {type(k).__name__}>"  # (never the repr of a shared tree)
                    raise UnsafeFileError(f"a parameter's attribute {name!r}: not a new plain name")
                if not _plain_value(v):
                    raise UnsafeFileError(
                        f"a parameter's attribute {k!r} is a {type(v).__name__}: only plain values are admitted"
                    )
                attrs[k] = v
        return replace(_Rebuild._rebuild_parameter(data, requires_grad, hooks), attrs=attrs)

    @staticmethod
    def _rebuild_parameter(data: TensorRef, requires_grad: bool, hooks: Any) -> TensorRef:
        if not isinstance(data, TensorRef):
            raise UnsafeFileError("a parameter that is not a tensor")
        return replace(data, requires_grad=bool(requires_grad), parameter=True)


def _ints(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in x)


def _tensor(
    storage: Storage, dtype: torch.dtype, offset: Any, size: Any, stride: Any, requires_grad: Any, metadata: Any = None
) -> TensorRef:
    if not (isinstance(offset, int) and offset >= 0 and _ints(tuple(size)) and _ints(tuple(stride)) and len(size) == len(stride)):
        raise UnsafeFileError("a tensor with a malformed offset, size or stride")
    if dtype not in TORCH_TO_SAFETENSORS and dtype != torch.complex128:  # (torch.load reads it; safetensors has no C128)
        raise UnsafeFileError(f"a tensor of dtype {dtype}, which aiotensor does not read")
    size, stride = tuple(size), tuple(stride)
    if math.prod(size) * dtype.itemsize >= 2**63:  # torch counts bytes in int64: absurd, not an allocation
        raise UnsafeFileError(f"a tensor of {list(size)} {dtype}: more than 2**63 bytes")
    if math.prod(size):
        last = offset + sum((d - 1) * s for d, s in zip(size, stride, strict=True))
        if (last + 1) * dtype.itemsize > storage.nbytes:
            raise UnsafeFileError(f"a tensor reaches past the end of storage {storage.key!r}")
    bits = metadata or {}  # what torch.save records of a tensor beyond its view: the two bits, each only where set
    if not (isinstance(bits, dict) and _BITS.issuperset(bits) and all(type(v) is bool for v in bits.values())):
        raise UnsafeFileError(f"a tensor with metadata {brief(metadata)}: not the conj and neg bits torch writes")
    return TensorRef(storage, dtype, offset, size, stride, bool(requires_grad), bits.get("conj", False), bits.get("neg", False))


_BITS = frozenset({"conj", "neg"})
_REBUILDS = ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state")


def is_torch_zip(prefix: bytes) -> bool:
    return prefix.startswith(ZIP_MAGIC)


def is_legacy_torch(head: bytes) -> bool:
    """Do a file's first 4 bytes begin a torch.save of the format before 1.6 (a pickle: protocol 2
    or 3 and the long of torch's old magic number, or protocol 4 or 5 and the frame holding it)?
    As a safetensors header's length, each is over 100 MB, its cap: no safetensors file begins so."""
    return (head[:2] in (b"\x80\x02", b"\x80\x03") and head[2:] == b"\x8a\x0a") or (
        head[:2] in (b"\x80\x04", b"\x80\x05") and head[2:3] == b"\x95" and head[3:4] >= b"\x07"
    )


Prefetch = Callable[[list[tuple[int, int]]], None]  # read these (offset, bytes) ranges ahead, together
_PREFETCH_BATCH = 4096  # local headers fetched together (memory: ~160 bytes each)
_HEADER_GUESS = 30 + 128  # a local header and its extra field (torch pads to 64-byte alignment), beyond the name


def parse(f: io.BufferedIOBase, size: int, path: object, prefetch: Prefetch | None = None) -> Any:
    """The state a torch.save zip holds, with :class:`TensorRef` leaves (blocking: a worker thread).

    Raises:
        UnsafeFileError: a global outside the allow-list, a compressed entry, a storage whose size
            or bounds do not match, or not a torch.save zip at all.
    """
    try:
        z = zipfile.ZipFile(f)
    except _ZIP_ERRORS as e:
        raise UnsafeFileError(f"not a torch.save zip ({type(e).__name__}: {str(e)[:200]})", path) from None
    try:
        with z:
            data, storages = _entries(z, f, size, path, prefetch)
    except _ZIP_ERRORS as e:
        raise UnsafeFileError(f"a malformed zip ({type(e).__name__}: {str(e)[:200]})", path) from None
    try:
        check_hashing(data, path, "data.pkl")
        return _Unpickler(data, storages, path).load()
    except UnsafeFileError as e:
        if e.path is None:
            raise UnsafeFileError(e.reason, path) from None
        raise
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError, LookupError, ArithmeticError) as e:
        raise UnsafeFileError(f"data.pkl is malformed ({type(e).__name__}: {str(e)[:200]})", path) from None


# every way zipfile says an archive is broken (a bad CRC, a name that is not UTF-8, encryption...)
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    EOFError,
    RuntimeError,
    NotImplementedError,
    UnicodeDecodeError,
    struct.error,
)


def _entries(
    z: zipfile.ZipFile, f: io.BufferedIOBase, size: int, path: object, prefetch: Prefetch | None
) -> tuple[bytes, dict[str, tuple[int, int, int | None]]]:
    """``data.pkl`` (read, its CRC checked) and each storage's (offset, bytes, CRC-32), every entry
    stored, not encrypted, its local header naming it (``prefetch``: the local headers are read
    ahead in batches, one round trip each on an object store instead of one per storage). A file
    whose every CRC-32 is 0 records none (torch.save after ``set_crc32_options(False)``; one saved
    with them always has one that is not 0, its ``version`` record's): nothing is checked, CRC-32
    None. A big-endian file (its ``byteorder`` record: torch.load swaps each storage's bytes) is
    refused, as is a ``byteorder`` record that is neither."""
    infos = z.infolist()
    pkl = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pkl) != 1:
        raise UnsafeFileError("no single <name>/data.pkl: not a torch.save zip", path)
    prefix = pkl[0].filename[: -len("data.pkl")]
    storages: dict[str, tuple[int, int, int | None]] = {}
    unchecked = all(info.CRC == 0 for info in infos)
    for i, info in enumerate(infos):
        if prefetch is not None and i % _PREFETCH_BATCH == 0:
            batch = infos[i : i + _PREFETCH_BATCH]
            prefetch([(b.header_offset, _HEADER_GUESS + len(b.orig_filename.encode("utf-8", "replace"))) for b in batch])
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsafeFileError(f"entry {info.filename!r} is compressed: only stored entries are read", path)
        if info.flag_bits & 0x1:
            raise UnsafeFileError(f"entry {info.filename!r} is encrypted", path)
        if info.filename.startswith(prefix + "data/"):
            crc = None if unchecked else info.CRC
            storages[info.filename[len(prefix) + 5 :]] = (_data_offset(f, info, size, path), info.file_size, crc)
    if pkl[0].file_size > MAX_PICKLE_BYTES:
        raise UnsafeFileError(f"data.pkl is {pkl[0].file_size} bytes, over the {MAX_PICKLE_BYTES} byte cap", path)
    order = [i for i in infos if i.filename == prefix + "byteorder"]
    if order:
        mark = _record(f, order[0], size, path, unchecked) if order[0].file_size <= 16 else None
        if mark == b"big":
            raise UnsafeFileError("a big-endian torch.save file (its byteorder record): torch.load swaps its bytes", path)
        if mark != b"little":
            raise UnsafeFileError(f"its byteorder record is neither little nor big ({order[0].file_size} bytes)", path)
    return _record(f, pkl[0], size, path, unchecked), storages


def _record(f: io.BufferedIOBase, info: zipfile.ZipInfo, size: int, path: object, unchecked: bool) -> bytes:
    """The bytes of a stored entry, its CRC-32 checked unless ``unchecked``."""
    f.seek(_data_offset(f, info, size, path))
    data = f.read(info.file_size)
    if len(data) != info.file_size:
        raise UnsafeFileError(f"entry {info.filename!r} runs past the end of the file", path)
    if not unchecked and zlib.crc32(data) != info.CRC:
        raise UnsafeFileError(f"a malformed zip (BadZipFile: Bad CRC-32 for file {info.filename!r})", path)
    return data


def _data_offset(f: io.BufferedIOBase, info: zipfile.ZipInfo, size: int, path: object) -> int:
    """Where an entry's bytes start: after its local header (whose extra field may differ from the
    central directory's: torch pads it to align storages)."""
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != ZIP_MAGIC:
        raise UnsafeFileError(f"entry {info.filename!r} has a broken local header", path)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    if f.read(name_len) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437"):
        raise UnsafeFileError(f"entry {info.filename!r}: its local header names another file", path)
    start: int = info.header_offset + 30 + int(name_len) + int(extra_len)
    if start + info.file_size > size:
        raise UnsafeFileError(f"entry {info.filename!r} runs past the end of the file", path)
    return start


def parse_path(engine: Engine, path: str) -> Any:
    """:func:`parse` on the file or object at ``path``, opened by ``engine`` as every file is (a
    local one without following links; blocking). On an object store each small read (the zip's
    directory, each entry's local header) is a ranged GET."""
    fd = engine.open_read(path)
    try:
        return parse_open(engine, fd, path)
    finally:
        engine.close(fd)


def parse_open(engine: Engine, fd: int, path: str) -> Any:
    """:func:`parse` on the open file ``fd`` (``path``: for messages; blocking)."""
    size = engine.size(fd)
    window = _Window(engine, fd, 0, size)
    return parse(io.BufferedReader(window), size, path, window.prefetch)


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of a file ``engine`` opened, as a read-only seekable file
    of its own (``pread``: the file's offset is never moved). A read that starts where a
    :meth:`prefetch` range starts is served from it (once), perhaps short."""

    def __init__(self, engine: Engine, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.engine, self.fd, self.start, self.length, self.pos = engine, fd, start, length, 0
        self.ahead: dict[int, bytes] = {}

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        ranges = [(off, min(n, self.length - off)) for off, n in ranges if 0 <= off < self.length]
        got = self.engine.pread_ranges(self.fd, [(self.start + off, n) for off, n in ranges])
        self.ahead.update((off, data) for (off, _), data in zip(ranges, got, strict=True) if data)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = min(len(buf), self.length - self.pos)
        if n <= 0:
            return 0
        # released before returning or raising: a view left in a traceback would outlive the
        # reader's buffer ("deallocated bytearray object has exported buffers")
        with memoryview(buf) as whole, whole.cast("B") as flat, flat[:n] as part:
            early = self.ahead.pop(self.pos, None)
            if early is not None:
                got = min(n, len(early))
                part[:got] = early[:got]
            else:
                got = self.engine.pread(self.fd, part, self.start + self.pos)
        self.pos += got
        return got


def parse_at(engine: Engine, fd: int, start: int, length: int, path: str, what: str) -> TensorRef:
    """The tensor a ``torch.save(tensor)`` blob at bytes ``[start, start + length)`` of a file
    ``engine`` opened describes (one item of a DCP ``FileSystemWriter`` file): parsed as
    :func:`parse` does, its storage's offset then relative to ``start`` (blocking).

    Raises:
        UnsafeFileError: the blob is not a torch.save file of one tensor, naming ``what``.
    """
    try:
        ref = parse(io.BufferedReader(_Window(engine, fd, start, length)), length, path)
    except UnsafeFileError as e:
        raise UnsafeFileError(f"{what}: {e.reason}", path) from None
    if not isinstance(ref, TensorRef):
        raise UnsafeFileError(f"{what} is not one tensor", path)
    return ref


def read_tensor_at(engine: Engine, fd: int, start: int, length: int, path: str, what: str) -> torch.Tensor:
    """The tensor of the blob :func:`parse_at` reads, its storage read straight from the file, the
    tensor a view of it as ``torch.load`` makes it (blocking)."""
    ref = parse_at(engine, fd, start, length, path, what)
    data = torch.empty(ref.storage.nbytes, dtype=torch.uint8)
    view, off = data.numpy().data.cast("B"), 0
    while off < len(view):
        n = engine.pread(fd, view[off:], start + ref.storage.offset + off)
        if n <= 0:
            raise UnsafeFileError(f"{what}: the file ends inside it (it shrank)", path)
        off += n
    return view_of(data, ref)


def view_of(storage: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """``ref``'s tensor over ``storage`` (its storage's bytes, as a uint8 tensor): a view, as
    ``torch.load`` makes it, never a copy (an expanded view stays as small as its storage), with
    its conj and neg bits (a copy of it resolves them)."""
    t = torch.empty(0, dtype=ref.dtype, device=storage.device).set_(
        storage.untyped_storage(), ref.storage_offset, ref.size, ref.stride
    )
    if ref.conj and t.is_complex():
        t = t.conj()
    return torch._neg_view(t) if ref.neg else t


MAX_DEPTH = 64  # containers nested in a state (formats.tree's cap for what aiotensor saves)
MAX_NODES = 1 << 20  # containers and tensors reached, counted along every path to them


def tensor_refs(tree: Any, path: object = None) -> list[tuple[tuple[str, ...], TensorRef]]:
    """Each distinct tensor of ``tree`` (by identity), with every name it is reached by, in first
    seen order. Names are dotted as in a state_dict and unique: where two paths make one name
    (``{"a.b": x, "a": {"b": y}}``), the later tensor is ``a.b#2``, as
    :func:`~aiotensor.formats.tree.flatten` names it.

    The pickle memo lets a file of a few KB share structure billions of times over; a container
    without tensors is walked once whatever shares it, and a walk that meets more than
    :data:`MAX_NODES` containers and tensors along its paths, or nests deeper than
    :data:`MAX_DEPTH`, refuses the file.

    Raises:
        UnsafeFileError: nesting or sharing past those bounds, naming ``path`` (the file).
    """
    walk = _Names()
    try:
        walk.walk(tree, (), 0)
    except UnsafeFileError as e:  # (the file named: helper-50)
        raise UnsafeFileError(e.reason, path) from None
    return [(tuple(names), ref) for names, ref in walk.found.values()]


class _Names:
    def __init__(self) -> None:
        self.found: dict[int, tuple[list[str], TensorRef]] = {}
        self.used: set[str] = set()
        self.empty: set[int] = set()  # containers known to hold no tensor
        self.nodes = 0

    def walk(self, obj: Any, path: tuple[Any, ...], depth: int) -> bool:
        """Name the tensors under ``obj``; True if there are any."""
        if depth > MAX_DEPTH:
            raise UnsafeFileError(f"the state nests deeper than {MAX_DEPTH} containers, at {key_path(path[:8])!r}...")
        if isinstance(obj, Storage):
            raise UnsafeFileError(f"a bare storage at {key_path(path[:8])!r}, not a tensor: aiotensor reads tensors")
        if isinstance(obj, (set, frozenset)) and any(isinstance(x, (TensorRef, Storage)) for x in obj):
            raise UnsafeFileError(f"a set of tensors at {key_path(path[:8])!r}: aiotensor reads tensors by their place")
        is_ref = isinstance(obj, TensorRef)
        if not is_ref and (not isinstance(obj, (dict, list, tuple)) or id(obj) in self.empty):
            return False
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise UnsafeFileError(
                f"the state reaches more than {MAX_NODES} containers and tensors (structure shared over and over)"
            )
        if is_ref:
            name = unique_key(key_path(path) if path else "", self.used)
            self.found.setdefault(id(obj), ([], obj))[0].append(name)
            return True
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        found = False
        for k, v in items:
            found = self.walk(v, (*path, k), depth + 1) or found
        if not found:
            self.empty.add(id(obj))
        return found


def rebuild(tree: Any, fn: Any) -> Any:
    """``tree`` with every :class:`TensorRef` replaced by ``fn(ref)`` (an ``nn.Parameter`` of it
    where the ref is one): containers and tensors made once each (shared structure stays shared,
    as ``torch.load`` gives it), ``OrderedDict`` with its ``_metadata``, other leaves kept. Call
    :func:`tensor_refs` first: it bounds the walk."""
    return _Rebuilt(fn).walk(tree)


class _Rebuilt:
    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.memo: dict[int, Any] = {}

    def walk(self, obj: Any) -> Any:
        if not isinstance(obj, (dict, list, tuple, TensorRef)):
            return obj
        done = self.memo.get(id(obj))
        if done is not None:
            return done
        if isinstance(obj, TensorRef):
            t = self.fn(obj)
            done = self.memo[id(obj)] = torch.nn.Parameter(t, requires_grad=obj.requires_grad) if obj.parameter else t
            for k, v in obj.attrs.items():
                setattr(done, k, v)
            return done
        if isinstance(obj, dict):
            out: Any = type(obj)() if type(obj) in (dict, OrderedDict, Counter) else {}
            self.memo[id(obj)] = out
            for k, v in obj.items():
                out[k] = self.walk(v)
            if hasattr(obj, "_metadata"):
                out._metadata = obj._metadata
        elif isinstance(obj, list):
            out = self.memo[id(obj)] = []
            out.extend(self.walk(v) for v in obj)
        else:  # a torch.Size holds ints only: itself
            out = self.memo[id(obj)] = obj if type(obj) is torch.Size else tuple(self.walk(v) for v in obj)
        return out
