"""The optional C helpers (``aiotensor/_native.c``): where they cannot be built (no C compiler),
aiotensor installs without them and does the same work in Python. The module carries the hash of
the source it was built from (``SOURCE``), so a test can tell a build older than the source."""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "aiotensor/_native.c"
digest = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()[:16]
setup(ext_modules=[Extension("aiotensor._native", [SOURCE], optional=True, define_macros=[("SOURCE_HASH", f'"{digest}"')])])
