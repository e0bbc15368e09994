"""Hand-made hostile files for tests/test_hostile.py: a tiny pickle-opcode writer and torch.save-shaped
zips, for files torch.save cannot produce (shared memo structures, BUILD after a tensor, absurd sizes)."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from typing import Any

# --- a pickle-opcode writer ------------------------------------------------------------------------


def proto(n: int = 2) -> bytes:
    return pickle.PROTO + bytes([n])


def stop() -> bytes:
    return pickle.STOP


def int_(n: int) -> bytes:
    """An int, as pickle protocol 2 writes it (BININT1, BININT, LONG1)."""
    if 0 <= n < 256:
        return pickle.BININT1 + bytes([n])
    if -(2**31) <= n < 2**31:
        return pickle.BININT + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def str_(s: str) -> bytes:
    raw = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def global_(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def tuple_(*items: bytes) -> bytes:
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def list_(*items: bytes) -> bytes:
    """EMPTY_LIST, then APPENDS (torch's weights_only unpickler has no LIST opcode)."""
    return pickle.EMPTY_LIST + (pickle.MARK + b"".join(items) + pickle.APPENDS if items else b"")


def dict_(pairs: dict[str, bytes]) -> bytes:
    """A dict with str keys and pickled values."""
    body = b"".join(str_(k) + v for k, v in pairs.items())
    return pickle.EMPTY_DICT + (pickle.MARK + body + pickle.SETITEMS if pairs else b"")


def put(i: int) -> bytes:
    return pickle.BINPUT + bytes([i]) if i < 256 else pickle.LONG_BINPUT + struct.pack("<I", i)


def get(i: int) -> bytes:
    return pickle.BINGET + bytes([i]) if i < 256 else pickle.LONG_BINGET + struct.pack("<I", i)


def storage(key: str, numel: int, cls: str = "FloatStorage") -> bytes:
    """A persistent reference to ``archive/data/<key>`` as torch.save writes it."""
    return tuple_(str_("storage"), global_("torch", cls), str_(key), str_("cpu"), int_(numel)) + pickle.BINPERSID


def tensor(storage_pkl: bytes, offset: int, size: tuple[int, ...], stride: tuple[int, ...], metadata: bytes = b"") -> bytes:
    """``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()[, metadata])``."""
    hooks = global_("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    parts = (storage_pkl, int_(offset), tuple_(*map(int_, size)), tuple_(*map(int_, stride)), pickle.NEWFALSE, hooks)
    args = tuple_(*parts, *([metadata] if metadata else []))
    return global_("torch._utils", "_rebuild_tensor_v2") + args + pickle.REDUCE


def build(state: bytes) -> bytes:
    """BUILD: ``state`` (a pickled dict) applied to the object on the stack."""
    return state + pickle.BUILD


def data_pkl(body: bytes) -> bytes:
    return proto(2) + body + stop()


# --- torch.save-shaped zips ------------------------------------------------------------------------


def torch_zip(path: Any, pkl: bytes, storages: dict[str, bytes] | None = None, prefix: str = "archive") -> None:
    """A zip laid out as torch.save writes it (entries stored, not compressed)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", pkl)
        z.writestr(f"{prefix}/byteorder", b"little")
        for key, raw in (storages or {}).items():
            z.writestr(f"{prefix}/data/{key}", raw)
        z.writestr(f"{prefix}/version", b"3\n")


def shared_lists(depth: int) -> bytes:
    """``data.pkl`` of lists nested ``depth`` deep, each holding the level below twice (the second
    time by a memo GET): a few bytes per level, 2**depth leaves when walked as a tree."""
    body = pickle.EMPTY_LIST + put(0)
    for i in range(1, depth + 1):
        body = list_(body, get(i - 1)) + put(i)
    return data_pkl(dict_({"x": body}))


def nested_lists(depth: int) -> bytes:
    """``data.pkl`` of ``depth`` lists, each the only item of the one around it: [[[...[1]...]]]."""
    body = (pickle.EMPTY_LIST + pickle.MARK) * depth + int_(1) + pickle.APPENDS * depth
    return data_pkl(body)


# --- patching real zips ----------------------------------------------------------------------------


def zip_headers(raw: bytes) -> dict[str, tuple[int, int]]:
    """Each entry's name -> (offset of its local header, offset of its central directory header)."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        local = {i.filename: i.header_offset for i in z.infolist()}
        pos = z.start_dir
    out = {}
    for _ in local:
        assert raw[pos : pos + 4] == b"PK\x01\x02"
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", raw, pos + 28)
        name = raw[pos + 46 : pos + 46 + name_len].decode()
        out[name] = (local[name], pos)
        pos += 46 + name_len + extra_len + comment_len
    return out
