"""A stand-in for the real ``kvikio`` package (26.08, rapidsai/kvikio@2e98113d), for CPU tests.

It mirrors the real module layout: ``import kvikio`` loads ``kvikio.cufile`` (as the real
``__init__`` does, for ``CuFile``) but NOT ``kvikio.defaults`` nor ``kvikio.cufile_driver``, which
are reachable only by importing them. Contiguous uint8 CPU tensors stand in for device memory.
Test controls live in ``kvikio._fake.state`` (not part of the real package).
"""

from kvikio.cufile import CuFile

__version__ = "26.08.00"
__all__ = ["CuFile", "__version__"]
