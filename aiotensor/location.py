"""Where data lives: every path a public API takes goes through :func:`local_path` first.

Only local paths are served. A URL (``scheme://...``) is refused with
:class:`~aiotensor.errors.UnsupportedLocationError` before anything is touched: taken as a relative
path, ``TensorStore("s3://bucket/run1/")`` would save into a folder named ``s3:`` in the working
directory, and a user would believe the checkpoint was in the bucket.
"""

from __future__ import annotations

import os
import re

from .errors import UnsupportedLocationError

# RFC 3986 scheme, then "://": what object stores, fsspec and HTTP name; a Windows drive ("C:\\")
# or a plain name with a colon ("run:1/") is not a URL
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def local_path(path: str | os.PathLike[str], what: str = "path") -> str:
    """``os.fspath(path)``, refusing a URL.

    Raises:
        UnsupportedLocationError: ``path`` is a URL (the message names its scheme).
        TypeError: ``path`` is not a str or path-like of str.
    """
    p = os.fspath(path)
    if not isinstance(p, str):
        raise TypeError(f"{what} must be a str or os.PathLike[str], got {type(p).__name__}")
    m = _URL.match(p)
    if m is not None:
        raise UnsupportedLocationError(
            f"{what} {p!r} is a URL ({m.group(1)}://): this version of aiotensor reads and writes local paths only "
            "(a local folder of that name would be made instead); mount the storage, or copy the files to a local folder"
        )
    return p


__all__ = ["local_path"]
