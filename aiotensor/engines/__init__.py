"""I/O engines: the blocking syscalls behind the scheduler, run in worker threads only."""

from .. import knobs
from .base import Engine
from .kvikio import KvikioEngine, kvikio_usable
from .posix import PosixEngine

__all__ = ["Engine", "KvikioEngine", "PosixEngine", "default_engine", "kvikio_usable"]


def default_engine(*, workers: int = knobs.WORKERS, chunk_bytes: int = knobs.CHUNK_BYTES) -> Engine:
    """The engine for this machine, chosen at run time: kvikio where torch sees CUDA and kvikio
    imports (CUDA tensors then move through cuFile), posix everywhere else."""
    if kvikio_usable():
        return KvikioEngine(num_threads=workers, task_size=chunk_bytes)
    return PosixEngine()
