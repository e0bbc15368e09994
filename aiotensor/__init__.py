"""aiotensor: asyncio-native tensor I/O for PyTorch.

``TensorStore`` keeps committed, checksummed checkpoints of nested state and saves them in the
background (``Snapshotter`` runs the trainer pattern); ``save_file``/``load_file`` read and write
single safetensors files; ``stream``, ``load_into`` and ``prepare_swap`` serve weights from any
of the formats a model server meets. Test tooling (``FaultyEngine``) is in :mod:`aiotensor.testing`.
"""

from . import errors
from ._runtime.scheduler import Scheduler
from .engines import Engine, KvikioEngine, PosixEngine
from .files import FileInfo, TensorInfo, load_file, read_header, save_file
from .serving import LoadResult, Swap, TensorStream, load_into, load_torch, prepare_swap, save_torch, stream
from .snapshot import Snapshotter
from .store import SaveHandle, TensorStore

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "FileInfo",
    "KvikioEngine",
    "LoadResult",
    "PosixEngine",
    "SaveHandle",
    "Scheduler",
    "Snapshotter",
    "Swap",
    "TensorInfo",
    "TensorStore",
    "TensorStream",
    "errors",
    "load_file",
    "load_into",
    "load_torch",
    "prepare_swap",
    "read_header",
    "save_file",
    "save_torch",
    "stream",
]
