"""Serving: stream weights into a model server tensor by tensor, load into a live module, hot-swap,
and torch.save files."""

from .module import LoadResult, Swap, load_into, prepare_swap
from .tensor_stream import TensorStream, stream
from .torch_files import load_torch, save_torch

__all__ = ["LoadResult", "Swap", "TensorStream", "load_into", "load_torch", "prepare_swap", "save_torch", "stream"]
