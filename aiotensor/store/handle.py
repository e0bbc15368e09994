"""SaveHandle: a save in flight, awaitable, and usable wherever a coroutine is expected."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any

import anyio

from .._runtime import threads
from ..errors import SaveCancelledError


def _cancellation(exc: Any) -> bool:
    """Is ``exc`` (an exception or its class) asyncio's cancellation? (trio never throws into a
    coroutine that has not started.)"""
    return isinstance(exc, asyncio.CancelledError) or (isinstance(exc, type) and issubclass(exc, asyncio.CancelledError))


class _Wait(Coroutine[Any, Any, None]):
    """A wait for a stage of a save (``event``: staged, or done), as an awaitable and as the
    coroutine object asyncio's tasks and trio drive: cancelling it cancels the save, also where
    the cancellation lands before it first ran (``asyncio.wait_for(handle.wait(), 0)`` throws into
    a coroutine that never started, whose handler never ran: the save went on and committed,
    helper-36). Awaiting it twice is fine; as a coroutine object it runs once."""

    def __init__(self, handle: SaveHandle, event: anyio.Event) -> None:
        self._handle = handle
        self._event = event
        self._inner: Coroutine[Any, Any, None] | None = None

    def __await__(self) -> Generator[Any, None, None]:
        return self._handle._wait(self._event).__await__()

    def send(self, value: Any) -> Any:
        if self._inner is None:
            self._inner = self._handle._wait(self._event)
        return self._inner.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self._inner is None:
            self._handle._here(self._event)  # (another loop's task: refused before anything is cancelled, helper-58)
            exc = val if val is not None else typ
            if _cancellation(exc):  # a task cancelled before it first ran: the save is cancelled
                self._handle.cancel()  # here, and the task ends once it stopped, as a started wait does
                self._inner = self._handle._stopped(exc() if isinstance(exc, type) else exc)
                return self._inner.send(None)
            self._inner = self._handle._wait(self._event)
        if val is None and tb is None:
            return self._inner.throw(typ)
        return self._inner.throw(typ, val, tb)  # pragma: no cover - the deprecated 3-argument form

    def close(self) -> None:
        """Close the coroutine (what a task that never ran does); the save goes on."""
        if self._inner is not None:
            self._inner.close()


class _Mirrored:
    def __init__(self, handle: SaveHandle) -> None:
        self._handle = handle

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        h = self._handle
        h._here(h._done_event)
        await h._done_event.wait()
        if h._error is not None:
            h.observed = True
            raise h._error
        h._here(h._mirrored_event)
        await h._mirrored_event.wait()
        if h._mirror_error is not None:
            raise h._mirror_error


class SaveHandle(Coroutine[Any, Any, None]):
    """A save in flight. ``await handle`` waits until the checkpoint is committed and durable.

    ``await handle.staged`` waits until every tensor has been copied out: from then on the caller
    may change its tensors; the checkpoint holds the values they had when ``save`` was called.

    The handle is also a coroutine object, so every usual way of running a save in a task works:
    ``asyncio.create_task(store.save(...))``, ``asyncio.wait_for(store.save(...), 60)``,
    ``tg.start_soon(handle.wait)``. The save itself started when ``save()`` returned: a task only
    waits for it (and, if cancelled, cancels it).

    After the commit point the save has succeeded, whatever happens next: a failure to update
    ``latest`` or to retire old steps is logged (logger ``aiotensor``) and listed in
    :attr:`warnings` (``latest`` is repaired by the next save or open, retention by the next
    commit); it never fails the handle. :attr:`warnings` also lists an earlier step that an
    incremental save found changed (replaced, or damaged on disk): its shard is written afresh.

    Cancellation: cancelling a task that awaits the handle (or ``handle.staged``) cancels the save
    itself: its temporary folder is removed, earlier checkpoints are untouched, and the await
    returns (raising the cancellation) only after the save has stopped. A save that reached its
    commit point completes anyway. To wait without that effect, shield the await
    (``anyio.CancelScope(shield=True)``). ``handle.cancel()`` cancels it without waiting; awaiting
    it afterwards raises :class:`~aiotensor.errors.SaveCancelledError`.
    """

    def __init__(self, step: int, nbytes: int = 0) -> None:
        self.step = step
        self.nbytes = nbytes  # tensor bytes, once planned
        self._started = anyio.current_time()
        self._staged_event = anyio.Event()
        self._done_event = anyio.Event()
        self._mirrored_event = anyio.Event()
        self._mirror_error: BaseException | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self._error: BaseException | None = None
        self._co: _Wait | None = None  # the handle's own coroutine side
        self._loop = threads.loop_token()  # the event loop the save runs on: only it can wait for the save
        self.observed = False
        self.committed = False
        self.warnings: list[str] = []  # trouble that did not fail the save (after its commit point; a damaged earlier step)
        self.stage_seconds: float | None = None  # save() to staged
        self.commit_seconds: float | None = None  # save() to committed
        self.bytes_written = 0  # shard bytes written (an incremental save links the rest)
        self.bytes_reused = 0  # shard bytes linked from an earlier step, proven equal

    def __repr__(self) -> str:
        if self.done():  # (a notebook shows it: "done" said nothing of a save that failed, helper-55)
            e = self._error
            failed = "cancelled" if isinstance(e, SaveCancelledError) else f"failed: {type(e).__name__}"
            state = "committed" if e is None else failed
        else:
            state = "committed, finishing" if self.committed else ("staged" if self._staged_event.is_set() else "staging")
        return f"<SaveHandle step={self.step} {state}>"

    def done(self) -> bool:
        return self._done_event.is_set()

    def exception(self) -> BaseException | None:
        """The failure of a finished save (None while running or on success). Reading a failure
        here counts as having seen it: the next ``save()`` does not raise ``SaveFailedError`` for it."""
        if self._error is not None and self.done():
            self.observed = True
        return self._error

    def cancel(self) -> None:
        """Ask the save to stop; it cleans up in the background. A committed save stays committed."""
        self._cancel_requested = True
        if self._scope is not None:
            self._scope.cancel()

    @property
    def staged(self) -> Coroutine[Any, Any, None]:
        """``await handle.staged``: until every tensor is copied out (see the class's text). A
        pre-staging failure (a state that cannot be stored) is raised here.

        Cancellation: as for the handle (cancels the save)."""
        return _Wait(self, self._staged_event)

    def wait(self) -> Coroutine[Any, Any, None]:
        """Wait until the save is committed (``await handle`` does the same); a coroutine object,
        so ``tg.start_soon(handle.wait)`` and ``asyncio.wait_for(handle.wait(), t)`` work.

        Raises:
            OSError, SaveCancelledError: the save's failure.

        Cancellation: as for the handle (cancels the save), also where it lands before the wait
        first ran (``asyncio.wait_for(handle.wait(), 0)``).
        """
        return _Wait(self, self._done_event)

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait(self._done_event).__await__()

    # the coroutine protocol, delegated to one wait: what asyncio.create_task and trio drive
    # (``asyncio.wait_for(store.save(...), 0)`` cancels the save, as a started wait does)
    def send(self, value: Any) -> Any:
        return self._coroutine().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        return self._coroutine().throw(typ, val, tb)

    def close(self) -> None:
        """Close the coroutine side of the handle (what a task that never ran does); the save goes on."""
        self._coroutine().close()

    def _coroutine(self) -> _Wait:
        if self._co is None:
            self._co = _Wait(self, self._done_event)
        return self._co

    async def _stopped(self, exc: BaseException) -> None:
        """Wait until the cancelled save has stopped, whatever cancels the caller again (asyncio's
        ``Task.cancel()`` goes through a shield: helper-51), then raise ``exc`` (its cancellation)."""
        await threads.wait_out(self._done_event)
        self.observed = True  # its canceller is told (by the cancellation)
        raise exc

    def _here(self, event: anyio.Event) -> None:
        """Refuse a wait for ``event`` from another event loop than the save's: its events wake
        tasks of their own loop only (another loop's wait never woke, and a notebook's
        ``executor.submit(asyncio.run, store.save(...))`` hung its kernel: helper-55)."""
        if not event.is_set() and self._loop is not None and threads.loop_token() != self._loop:
            raise RuntimeError(
                f"the save of step {self.step} runs on another event loop (the store's): await its handle on that "
                "loop; a store serves one event loop at a time"
            )

    async def _wait(self, event: anyio.Event) -> None:
        self._here(event)
        try:
            await event.wait()
        except anyio.get_cancelled_exc_class() as cancelled:
            self.cancel()
            await self._stopped(cancelled)
        # (a failed save's finish() also wakes staged-waiters: stage_seconds says whether it had staged)
        if self._error is not None and (event is self._done_event or self.stage_seconds is None):
            self.observed = True
            raise self._error

    # --- what the store tells the handle, as the save goes ---------------------------------

    def begin(self, scope: anyio.CancelScope) -> None:
        """The save runs inside ``scope`` from now on (cancelled at once if cancel() came first)."""
        self._scope = scope
        if self._cancel_requested:
            scope.cancel()

    def set_staged(self, nbytes: int) -> None:
        """The tensors (``nbytes`` of them) are copied out: the caller may change its own from here on."""
        self.nbytes = nbytes
        self.stage_seconds = anyio.current_time() - self._started
        self._staged_event.set()

    def set_committed(self) -> None:
        """Past the commit point: the save has succeeded, whatever happens next."""
        self.committed = True
        self.commit_seconds = anyio.current_time() - self._started

    @property
    def mirrored(self) -> _Mirrored:
        """``await handle.mirrored``: the save committed, and (with ``mirror=``) the step is
        committed in the mirror too. Raises the save's failure, or the upload's (the step is then
        committed locally only: the next open of the store uploads it again).

        Cancellation: only the wait is cancelled; the upload goes on.
        """
        return _Mirrored(self)

    def set_mirrored(self, error: BaseException | None) -> None:
        """The upload to the mirror ended (or there is none to make)."""
        self._mirror_error = error
        self._mirrored_event.set()

    def warn(self, message: str) -> None:
        """Trouble that does not fail the save, for :attr:`warnings`."""
        self.warnings.append(message)

    def finish(self, error: BaseException | None) -> None:
        """The save ended: with ``error``, or None once committed."""
        self._error = error
        self._staged_event.set()  # wakes staged-waiters of a failed save too (they see the error)
        self._done_event.set()
