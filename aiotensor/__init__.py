"""aiotensor: asyncio-native tensor I/O for PyTorch.

``TensorStore`` keeps committed, checksummed checkpoints of nested state and saves them in the
background; ``save_file``/``load_file`` read and write single safetensors files.
"""

from . import errors
from ._handle import SaveHandle
from .engines import Engine, FaultyEngine, KvikioEngine, PosixEngine
from .files import FileInfo, TensorInfo, load_file, read_header, save_file
from .scheduler import Priority, Scheduler
from .serving import LoadResult, Swap, TensorStream, load_into, load_torch, prepare_swap, save_torch, stream
from .snapshot import Snapshotter
from .store import TensorStore, load_checkpoint

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "LoadResult",
    "Swap",
    "TensorStream",
    "load_into",
    "load_torch",
    "save_torch",
    "prepare_swap",
    "stream",
    "FileInfo",
    "TensorInfo",
    "read_header",
    "FaultyEngine",
    "KvikioEngine",
    "PosixEngine",
    "Priority",
    "SaveHandle",
    "Scheduler",
    "Snapshotter",
    "TensorStore",
    "errors",
    "load_checkpoint",
    "load_file",
    "save_file",
]
