"""Where data lives: every path a public API takes goes through :func:`local_path` first.

Local paths are served everywhere; ``s3://bucket/key`` by ``TensorStore`` (and ``mirror=``,
``distributed=``), ``save_file``, ``save_torch``, the readers (``load_file``, ``read_header``,
``stream``, ``load_into``, ``prepare_swap``, ``load_torch``: safetensors and torch.save objects,
store roots and steps, DCP steps, Hugging Face folders), the DCP layer and the CLI, through
:class:`~aiotensor.engines.objects.ObjectEngine`.
Any other URL (``scheme://...``), and ``s3://`` where it is not served yet, is refused with
:class:`~aiotensor.errors.UnsupportedLocationError` before anything is touched: taken as a relative
path, ``TensorStore("s3://bucket/run1/")`` would save into a folder named ``s3:`` in the working
directory, and a user would believe the checkpoint was in the bucket.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from .engines import Engine
from .engines.objects import SCHEME, ObjectEngine
from .errors import UnsupportedLocationError

# RFC 3986 scheme, then "://": what object stores, fsspec and HTTP name; a Windows drive ("C:\\")
# or a plain name with a colon ("run:1/") is not a URL
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# a storage URL's scheme and a colon without its "//" ("s3:/bucket/run", "s3:bucket"): a typo, taken
# as a relative path it made a local folder "s3:" (write "./s3:..." for a folder so named; "s3:"
# alone is a name)
_MISTYPED = re.compile(r"(s3|s3a|gs|gcs|az|abfss?|adl|azure|oss|r2|hf|hdfs|https?|s?ftp|file):(?!//)(?=.)", re.IGNORECASE)


def local_path(path: str | os.PathLike[str], what: str = "path", *, objects: bool = False) -> str:
    """``os.fspath(path)``, refusing a URL (but ``s3://`` ones where ``objects``).

    Raises:
        UnsupportedLocationError: ``path`` is a URL (the message names its scheme).
        TypeError: ``path`` is not a str or path-like of str.
        ValueError: ``path`` is empty (it named the working folder: save_file wrote into its
            parent, helper-71).
    """
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"{what} must be a str or os.PathLike[str], got {type(p).__name__}")
    if not p:
        raise ValueError(f"{what} is empty: name a file or folder (. for the working folder)")
    m = _URL.match(p)
    served = "local paths and s3:// URLs" if objects else "local paths"
    if m is not None and not (objects and is_object(p)):
        scheme = m.group(1)
        hint = " (the scheme in lowercase: s3://)" if objects and scheme.lower() == "s3" else ""
        raise UnsupportedLocationError(
            f"{what} {p!r} is a URL ({scheme}://): aiotensor serves {served} here{hint}; a local folder of that name "
            "would be made instead. Mount the storage, or copy the files to a local folder"
        )
    m = _MISTYPED.match(p)
    if m is not None:
        scheme, folder = m.group(1), p.split("/", 1)[0]
        raise UnsupportedLocationError(
            f"{what} {p!r} looks like a mistyped URL ({scheme}: without //): aiotensor serves {served} here, and "
            f"would make a local folder {folder!r}. Write {scheme.lower()}://..., or ./{p} for a local path so named"
        )
    return p


def is_object(path: str) -> bool:
    """An ``s3://`` URL (as :func:`local_path` passed it)."""
    return path.startswith(SCHEME)


def real_path(path: str) -> str:
    """The path a user named, canonical: a local one with its links resolved (a Hugging Face cache
    links files to blobs); an object store has no links (a key as named, without a trailing ``/``)."""
    return path.rstrip("/") if is_object(path) else os.path.realpath(path)


def absolute(path: str) -> str:
    """``path`` made absolute (a local one against the working folder; an object's key is)."""
    return path if is_object(path) else os.path.abspath(path)


def where(path: str | os.PathLike[str]) -> str:
    """A path a public API took that may name an object: :func:`local_path` (``s3://`` admitted),
    made :func:`absolute`."""
    return absolute(local_path(path, objects=True))


def split(path: str) -> tuple[str, str]:
    """``path``'s absolute parent folder and its name (``s3://b/run/step-1/`` -> ``s3://b/run``, ``step-1``)."""
    p = absolute(path)
    return os.path.split(p.rstrip("/") if is_object(p) else p)


def mode_of(engine: Engine, path: str) -> int:
    """The ``st_mode`` of what ``path`` names, links followed (``engine``: the one that serves it).

    Raises:
        FileNotFoundError: nothing there.
    """
    return (engine.stat(path) if is_object(path) else os.stat(path)).st_mode


def is_folder(engine: Engine, path: str) -> bool:
    """Is ``path`` a folder (an object store's: a key prefix with objects under it)?"""
    try:
        return stat.S_ISDIR(mode_of(engine, path))
    except (FileNotFoundError, NotADirectoryError):
        return False


def engine_for(path: str, scheduler: Any = None, storage_options: Mapping[str, Any] | None = None) -> Engine | None:
    """The engine a scheduler of the library's own needs for ``path``: an
    :class:`~aiotensor.engines.objects.ObjectEngine` (configured by ``storage_options``, obstore's
    S3 keys, over the ``AWS_*`` environment) for an object, None (the default) otherwise."""
    if not is_object(path):
        return None
    if scheduler is not None and storage_options:
        raise ValueError("storage_options= configures a scheduler of aiotensor's own: pass it or scheduler=, not both")
    if scheduler is not None:
        if not scheduler.engine.renames:
            return None  # it has an object store's engine: it is used
        raise UnsupportedLocationError(f"{path}: s3:// objects are read by a scheduler of aiotensor's own; pass no scheduler=")
    return ObjectEngine(storage_options)


__all__ = ["absolute", "engine_for", "is_folder", "is_object", "local_path", "mode_of", "real_path", "split", "where"]
