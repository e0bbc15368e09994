"""The optional C helpers (``aiotensor/_native.c``, built at install where a C compiler is): ``native``
is the module, or None where it was not built, or ``AIOTENSOR_NATIVE=0`` is set (then aiotensor
does the same work in Python; the tests run both ways)."""

from __future__ import annotations

import importlib
import os
from typing import Any

native: Any = None
if os.environ.get("AIOTENSOR_NATIVE", "1") != "0":
    try:
        native = importlib.import_module("aiotensor._native")
    except ImportError:  # not built: the Python code does its work
        native = None
