"""Snapshotter: the recommended trainer pattern, with a bounded policy for a disk that falls behind."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Literal

import anyio

from .store import SaveHandle, TensorStore

Policy = Literal["skip", "wait"]
log = logging.getLogger("aiotensor")
# loop turns a before_update gives the saves in flight when it waits for none: a save's step on the loop
# takes two (its thread's result, then its task), and ~25 steps make a save (helper-50's 5 ms steps:
# a save committed every ~10 steps, none with none given); idle, 8 turns take 20-100 us
_TURNS = 8
_KEPT = 10_000  # the newest entries of skipped_steps and held_seconds kept


class Snapshotter:
    """Checkpoints a training loop in the background, holding the trainer only while tensors are
    copied out, and never letting memory grow when the disk is slower than the checkpoints::

        snap = Snapshotter(store)
        for step in range(n):
            loss = forward_backward()     # (on CPU, in a worker thread) the last save stages meanwhile
            await snap.before_update()    # the only hold: the last save's tensors are copied out
            optimizer.step()
            snap.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      force=step == n - 1)  # the last step is never skipped
        await snap.drain()                # every started save committed (or its error raised)

    Forward and backward do not change parameters or optimizer state, so the copy out of step N's
    state runs alongside step N+1's forward/backward and the trainer waits only for what is left.
    A forward that changes the state does not allow that: BatchNorm in train mode updates its
    running statistics (buffers, in ``state_dict()``), and step N's checkpoint would hold some of
    step N+1's (such a save fails: ``StateChangedError``, its ``num_batches_tracked`` having
    moved). For such a model, ``await snap.before_update()`` before the forward instead (the
    copy then overlaps only what runs before it), or save a copy of those buffers.

    Policy when the disk cannot absorb a checkpoint per ``save`` call (every staging arena of the
    store — ``max_staged``, default 2 — belongs to a save that has not committed):

    - ``"skip"`` (default, but see below): that ``save`` is skipped and returns None (counted in ``skipped``).
      The trainer never waits for the disk; checkpoints come as often as the disk can write them.
    - ``"wait"``: the save starts anyway and waits for an arena before it stages, so
      ``before_update`` holds the trainer until the disk has caught up with one save.

    Either way at most ``max_staged`` states are held in memory and at most one save waits.
    ``save(..., force=True)`` never skips (it waits as under ``"wait"``): use it for the last step
    of a run. ``drain`` returns the steps skipped since the previous ``drain`` (the newest 10,000;
    ``skipped`` counts them all) and logs a warning
    if the last ``save`` before it was skipped.

    A save that fails raises its error from the next ``save``, ``before_update`` or ``drain``.

    ``background`` (default True): each save is started with ``TensorStore.save(...,
    background=True)``, its I/O behind loads and other saves of the store.

    Under a process group (a store opened with ``distributed=``) every rank must save the same
    steps, and a rank cannot know whether another one would skip: the policy is then ``"wait"``
    (the default there; ``"skip"`` is refused with ``ValueError``).
    """

    def __init__(self, store: TensorStore, *, policy: Policy | None = None, background: bool = True) -> None:
        if policy not in (None, "skip", "wait"):
            raise ValueError(f"policy must be 'skip' or 'wait', got {policy!r}")
        distributed = store.distributed is not False
        if policy is None:
            policy = "wait" if distributed else "skip"
        if distributed and policy == "skip":
            raise ValueError(
                "policy='skip' cannot be used with a distributed store: ranks deciding apart would "
                "save different steps and wait for one another for ever; use policy='wait'"
            )
        self.store = store
        self.policy = policy
        self.background = background
        self.started = 0
        self.skipped = 0
        # bounded: a trainer that runs for days and never drains kept one entry a save (helper-54)
        self.skipped_steps: deque[int] = deque(maxlen=_KEPT)  # since the last drain (the last _KEPT)
        self._last_skipped: int | None = None  # the step of the last save() call, if it was skipped
        self.held_seconds: deque[float] = deque(maxlen=_KEPT)  # one per before_update that waited for a save
        self._handles: list[SaveHandle] = []  # not yet known committed
        self._failed: list[SaveHandle] = []  # failed, their errors not raised yet
        self._last: SaveHandle | None = None  # not yet known staged

    def __repr__(self) -> str:  # (what a notebook shows: helper-55)
        running = sum(not h.done() for h in self._handles)
        counts = f"{self.started} started, {self.skipped} skipped, {running} running"
        return f"<Snapshotter of {self.store!r}: policy={self.policy!r}, {counts}>"

    def save(self, step: int, state: Any, *, force: bool = False) -> SaveHandle | None:
        """Start saving ``state`` as ``step`` unless the policy skips it; returns at once.

        With ``force``, the save is never skipped: it waits for a staging arena (as under
        ``"wait"``), so ``before_update``/``drain`` hold the trainer until the disk has caught up.

        Raises: what :meth:`TensorStore.save` raises, and the error of an earlier failed save.
        """
        self._collect()
        if not force and self.policy == "skip" and len(self._handles) >= self.store.staging.max_arenas:
            self.skipped += 1
            self.skipped_steps.append(step)
            self._last_skipped = step
            return None
        self._last_skipped = None
        h = self.store.save(step, state, background=self.background)
        self.started += 1
        self._handles.append(h)
        self._last = h
        return h

    async def before_update(self) -> None:
        """Wait until the last save's tensors are copied out; call it just before they change.

        Cancellation: cancels that save (see :class:`~aiotensor.SaveHandle`) and raises.
        """
        h, self._last = self._last, None
        if h is not None:
            t0 = time.perf_counter()
            await h.staged
            self.held_seconds.append(time.perf_counter() - t0)
        elif self._handles:  # the saves in flight go on only while the loop runs: a trainer whose forward
            for _ in range(_TURNS):  # is synchronous never let it (every later save skipped: helper-50)
                await anyio.lowlevel.checkpoint()
        self._collect()

    async def drain(self) -> list[int]:
        """Wait for every started save to commit; raise the first failure. Returns the steps that
        were skipped since the last ``drain`` (a warning is logged if the very last ``save`` was).

        Cancellation: cancels the save being awaited (see :class:`~aiotensor.SaveHandle`).
        """
        self._collect()
        while self._handles:
            h = self._handles[0]
            await h
            self._handles.pop(0)
        self._last = None
        if self._last_skipped is not None:
            log.warning(
                "the last save (step %d) was skipped because the disk was behind: "
                "save the final step with save(step, state, force=True)",
                self._last_skipped,
            )
        skipped, self._last_skipped = list(self.skipped_steps), None
        self.skipped_steps.clear()
        return skipped

    def _collect(self) -> None:
        """Forget finished saves; raise the error of the first failed one not raised yet, each in
        turn (the store would raise one the snapshotter holds as a SaveFailedError, no longer an
        OSError that ``except OSError`` catches: helper-32's full disk). A save whose wait was
        cancelled is observed (its canceller was told): a ``before_update`` or ``drain`` cancelled
        by a timeout made every later ``save`` raise SaveCancelledError (helper-36)."""
        for h in self._handles:
            if h.done() and not h.observed and h.exception() is not None:  # (drain raised an observed one)
                h.observed = True
                self._failed.append(h)
        self._handles = [h for h in self._handles if not h.done()]
        if self._failed:
            raise self._failed.pop(0).exception()  # type: ignore[misc]
