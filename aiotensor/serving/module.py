"""Loading into a live ``nn.Module``: in place (:func:`load_into`), or beside it for a hot swap
(:func:`prepare_swap`, :class:`Swap`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from .. import knobs
from .._runtime.scheduler import Priority, Scheduler
from ..errors import MismatchError
from .tensor_stream import stream


class LoadResult(NamedTuple):
    """What :func:`load_into` could not match, as ``nn.Module.load_state_dict`` reports it."""

    missing_keys: list[str]
    unexpected_keys: list[str]


async def _matched(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    fn: Callable[[str, torch.Tensor, torch.Tensor], object],
    *,
    strict: bool,
    window_bytes: int,
    scheduler: Scheduler | None,
) -> LoadResult:
    """Stream ``source`` and call ``fn(name, module's tensor, loaded tensor)`` for each tensor the
    module has, of its shape, in worker threads, batches of up to :data:`knobs.STREAM_BATCH_TENSORS` tensors or
    :data:`knobs.STREAM_BATCH_BYTES` at a time (one call per tensor made a 20,000-tensor load_into take 7 s).
    ``strict``: a tensor the module lacks is an error at once (else it is reported)."""
    unexpected: list[str] = []
    async with stream(source, window_bytes=window_bytes, scheduler=scheduler) as s:
        with s.scheduler.operation():
            sched = s.scheduler
            left = await sched.run_sync(lambda: dict(module.state_dict(keep_vars=True)))  # not found yet
            batch: list[tuple[str, torch.Tensor, torch.Tensor]] = []
            size = 0
            async for name, t in s:
                dst = left.pop(name, None)
                if dst is None:
                    if strict:
                        raise MismatchError(f"{source} has a tensor {name!r} the module does not")
                    unexpected.append(name)
                    continue
                if tuple(dst.shape) != tuple(t.shape):
                    raise MismatchError(f"tensor {name!r}: {source} has {list(t.shape)}, the module {list(dst.shape)}")
                batch.append((name, dst, t))
                size += t.nbytes
                if len(batch) >= knobs.STREAM_BATCH_TENSORS or size >= knobs.STREAM_BATCH_BYTES:
                    await sched.call(_each, fn, batch, priority=Priority.LOAD)
                    batch, size = [], 0
            if batch:
                await sched.call(_each, fn, batch, priority=Priority.LOAD)
            missing: list[str] = await sched.run_sync(list, left)
            await sched.discard(left)
    return LoadResult(missing, unexpected)


def _each(fn: Callable[[str, torch.Tensor, torch.Tensor], object], batch: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():  # per thread: set in the worker
        for name, dst, t in batch:
            fn(name, dst, t)
    batch.clear()  # the loaded tensors are freed here, not on the loop's thread


async def load_into(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    strict: bool = True,
    window_bytes: int = knobs.WINDOW_BYTES,
    scheduler: Scheduler | None = None,
) -> LoadResult:
    """Load ``source`` in place into ``module``'s parameters and buffers, a batch of tensors at a
    time (memory: the module, the stream's window and a batch of up to :data:`knobs.STREAM_BATCH_BYTES`),
    converting dtypes on the fly.

    Raises:
        MismatchError: a shape differs (named), or with ``strict``, missing or unexpected keys.
        What :func:`stream` raises.

    Cancellation: the stream is closed; the module may hold a mix of old and new values (load into
    a copy, or use :func:`prepare_swap`, to switch only once everything is in).
    """
    got = await _matched(
        module,
        source,
        lambda name, dst, t: dst.detach().copy_(t),
        strict=False,
        window_bytes=window_bytes,
        scheduler=scheduler,
    )
    if strict and (got.missing_keys or got.unexpected_keys):
        missing, unexpected = got.missing_keys[:10], got.unexpected_keys[:10]
        raise MismatchError(f"load_into {source}: missing keys {missing}, unexpected keys {unexpected}")
    return got


class Swap:
    """New weights for a module, loaded and verified beside the ones serving; :meth:`apply` switches."""

    def __init__(self, module: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
        self.module = module
        self.tensors = dict(tensors)

    def apply(self) -> None:
        """Switch the module to the new weights: pointer swaps only, no I/O and no copy. Call it
        between two requests, on the loop thread, while no other thread runs the module (with
        inference in worker threads, load a second module and switch the reference instead, as
        ``examples/model_server.py`` does): it does not await, so no coroutine sees half of it."""
        current = self.module.state_dict(keep_vars=True)  # now: .to() or new parameters since replace tensors
        with torch.no_grad():
            for name, new in self.tensors.items():
                current[name].data = new


async def prepare_swap(
    module: torch.nn.Module,
    source: str | os.PathLike[str],
    *,
    window_bytes: int = knobs.WINDOW_BYTES,
    scheduler: Scheduler | None = None,
) -> Swap:
    """Load ``source`` for ``module`` into new tensors (one extra copy of the weights, on the
    module's devices and dtypes) while the module keeps serving; returns a :class:`Swap` whose
    ``apply()`` switches between two requests. If the load fails (a corrupt file: ChecksumError;
    other keys or shapes: MismatchError), nothing of the new version is visible.

    Cancellation: nothing was switched; the partly loaded copy is dropped.
    """
    new: dict[str, torch.Tensor] = {}

    def keep(name: str, dst: torch.Tensor, t: torch.Tensor) -> None:
        new[name] = t if (t.dtype, t.device) == (dst.dtype, dst.device) else t.to(dst.device, dst.dtype)

    got = await _matched(module, source, keep, strict=True, window_bytes=window_bytes, scheduler=scheduler)
    if got.missing_keys:
        raise MismatchError(f"the new version lacks {got.missing_keys[:10]}")
    return Swap(module, new)
