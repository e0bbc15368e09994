"""I/O engines: the blocking syscalls behind the scheduler, run in worker threads only."""

from .base import Engine
from .faulty import FaultyEngine
from .posix import PosixEngine

__all__ = ["Engine", "FaultyEngine", "PosixEngine", "default_engine"]


def default_engine() -> Engine:
    """The engine for this machine: posix everywhere (kvikio is chosen per device buffer, not here)."""
    return PosixEngine()
