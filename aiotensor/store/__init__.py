"""TensorStore: a folder of committed, checksummed checkpoints, saved in the background."""

from .handle import SaveHandle
from .store import TensorStore

__all__ = ["SaveHandle", "TensorStore"]
