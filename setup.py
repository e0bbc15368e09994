"""The optional C helpers (``aiotensor/_native.c``): where they cannot be built (no C compiler),
aiotensor installs without them and does the same work in Python."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("aiotensor._native", ["aiotensor/_native.c"], optional=True)])
