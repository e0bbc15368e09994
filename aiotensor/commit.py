"""The commit protocol: how everything aiotensor writes appears whole, or not at all.

Every step goes through an :class:`~aiotensor.engines.Engine`, so a test engine records and fails
any of them (the kill sweep and the power-cut replay run over the store, ``save_file``,
``save_torch``, the DCP writer and ``convert`` alike):

1. **Temporary name.** A new file or folder is written under a name of :func:`temp_name` beside
   its final name, never under the final name itself.
2. **Durable write.** Every file in it is written and fsync'ed (``_io.write.write_file``,
   :func:`write_small`).
3. **Publish** (:func:`publish`): the folder's entries fsync'ed, the rename to the final name, the
   parent fsync'ed. The last fsync is the commit point; if it fails, the rename is undone.
4. **Replace a small file** (:func:`replace_small`: ``latest``): the same steps, and only where what
   has that name is the library's own file.
5. **Retire** (:func:`retire`): a committed folder is renamed to a leftover name, durably (it stops
   being a checkpoint at once: a half-deleted folder never looks like one), then deleted at leisure.

On an object store (``engine.renames`` False: put, ranged get, list, delete; each object
atomic), the same steps by other means:

1. No temporary name: objects are put under their final keys; the folder is marked as the
   library's by a conditionally created marker (:meth:`Engine.mkdir`), so two writers cannot
   write one folder.
2. Each object is durable when its PUT returns.
3. The **commit record** (:data:`RECORDS`: a store's ``manifest.json``, DCP's metadata), put last
   and conditionally, is the commit point: a folder without one is no checkpoint, and a writer
   removes it (a marked folder without a record is a leftover).
4. ``latest`` is one PUT (atomic).
5. Retiring deletes the record first (the step stops being a checkpoint at once), then the rest.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from types import TracebackType

import anyio

from ._runtime.scheduler import Priority, Scheduler
from .engines import Engine
from .engines.objects import FOLDER_MARKER
from .errors import CheckpointExistsError, annotate_oserror

log = logging.getLogger("aiotensor")
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata.json"
RECORDS = (MANIFEST, DCP_METADATA)  # the files whose presence commits a folder
_LEFTOVER = re.compile(r"(step-[0-9]{12}\.tmp-(del)?|latest\.tmp-)[0-9a-f]{8}")


def temp_name(name: str, kind: str = "") -> str:
    """A name for work in progress on ``name`` (``kind="del"``: a folder being retired), in the same
    folder: for a store's names, one that :func:`is_leftover` recognises."""
    return f"{name}.tmp-{kind}{uuid.uuid4().hex[:8]}"


def is_leftover(name: str) -> bool:
    """Is ``name`` work in progress a store's writer left (only such names are ever cleaned up)?"""
    return _LEFTOVER.fullmatch(name) is not None


def hidden_temp(path: str) -> str:
    """The temporary path of a single file the user named (``save_file``, ``save_torch``): hidden,
    so that a glob for the final name's pattern does not pick it up."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{temp_name(name)}")


# --- blocking steps (worker threads) ------------------------------------------------------------


def write_small(engine: Engine, path: str, data: bytes) -> None:
    """Create ``path`` (it must not exist) holding ``data``, durably."""
    engine.put(path, [memoryview(data)])


def publish(engine: Engine, tmp: str, final: str, *, folder: bool) -> None:
    """The commit point of a file or folder written, and made durable, at ``tmp``: the folder's
    entries fsync'ed, ``tmp`` renamed to ``final``, ``final``'s parent fsync'ed. If that fsync
    fails the rename is undone (it may not be durable: nothing is committed) and the error raised.
    On an object store a folder's ``tmp`` is ``final``, and the writer's record was the commit
    point; a file is copied over ``final`` by the server (:meth:`ObjectEngine.rename`)."""
    if folder and not engine.renames:
        return
    parent = os.path.dirname(final) or "."
    if folder:
        engine.sync_dir(tmp)
    engine.rename(tmp, final)
    try:
        engine.sync_dir(parent)
    except BaseException:
        engine.rename(final, tmp)
        raise


def replace_small(engine: Engine, path: str, data: bytes | None, foreign: Callable[[], str]) -> str:
    """Replace the small file ``path`` with ``data`` (None: remove it), durably, unless
    ``foreign()`` says why what has that name is not the library's own: then nothing is touched
    and that reason is returned ("" when done)."""
    why = foreign()
    if why:
        return why
    folder = os.path.dirname(path) or "."
    if data is None:
        engine.remove_file(path)
    else:
        engine.replace(path, os.path.join(folder, temp_name(os.path.basename(path))), data)
    engine.sync_dir(folder)
    return ""


def retire(engine: Engine, path: str) -> str:
    """Rename the committed folder ``path`` to a leftover name and fsync its parent: from then on it
    is no checkpoint, and a crash leaves a leftover the next writer removes. Returns the new path,
    to delete (``engine.remove_tree``) whenever convenient. On an object store: its records are
    deleted instead (a marked folder without one is a leftover); ``path`` is returned."""
    if not engine.renames:
        drop_records(engine, path)
        return path
    doomed = os.path.join(os.path.dirname(path), temp_name(os.path.basename(path), "del"))
    engine.rename(path, doomed)
    engine.sync_dir(os.path.dirname(path) or ".")
    return doomed


def has_records(engine: Engine, folder: str) -> bool:
    """Does ``folder`` still hold a commit record (a step retired meanwhile does not: on an object
    store its records go first, while its other objects are still being deleted)?"""
    return any(engine.exists(os.path.join(folder, name)) for name in RECORDS)


def damaged(engine: Engine, folder: str, step: int, missing: FileNotFoundError) -> FileNotFoundError | None:
    """What a file of step ``step`` (the folder ``folder``) found ``missing`` means: the step
    damaged, where it is still committed (a ``FileNotFoundError`` saying so, not a
    ``CheckpointNotFoundError``); None where it was retired meanwhile (blocking)."""
    if not has_records(engine, folder):
        return None
    why = missing.strerror or missing
    return FileNotFoundError(
        missing.errno, f"step {step} in {folder} is damaged, a file it lists is not there ({why})", missing.filename
    )


def _unfinished(engine: Engine, folder: str) -> bool:
    """An object store's folder the library marked that holds no commit record (a leftover)?"""
    return engine.exists(os.path.join(folder, FOLDER_MARKER)) and not has_records(engine, folder)


def drop_records(engine: Engine, folder: str) -> None:
    """Delete a folder's commit records (on an object store: it stops being a checkpoint)."""
    for name in RECORDS:
        engine.remove_file(os.path.join(folder, name))


def remove(engine: Engine, path: str) -> None:
    """Remove a file or a folder that may be committed: on an object store its records go first,
    so that no reader takes what is left of it for a checkpoint."""
    if not engine.renames:
        drop_records(engine, path)
    engine.remove_tree(path)


# --- a publication, on a scheduler --------------------------------------------------------------


class Publication:
    """A file or folder that appears at ``final`` whole and durable, or not at all::

        async with Publication(sched, final, folder=True) as pub:
            await write_file(sched, os.path.join(pub.tmp, "a"), ...)  # durable writes under pub.tmp
            await pub.publish()  # the commit point

    Leaving the block without :meth:`publish` (an error, a cancellation) removes ``tmp``; a failure
    to remove it is added to the error as a note (the leftover is a store writer's to clean).

    A file replaces what is at ``final`` (atomically); a folder must not exist there. On an object
    store (see the module's text) a folder's ``tmp`` is ``final``: the writer puts its commit
    record last.

    Args:
        tmp: the temporary path (default: :func:`temp_name` beside ``final`` for a folder,
            :func:`hidden_temp` for a file).
        fence: the caller is the root's writer, and ``await fence()`` raises unless it still is
            (its lock or lease: :meth:`~aiotensor.store.steps.Steps.fence`): on an object store,
            an unfinished folder of the library's at ``final`` (its marker, no commit record: a
            failed save whose clean-up failed, the server down) is removed first, as the writer's
            repair at open would (a save of that step again failed with "an object of that name
            exists" until the store was reopened: helper-30), once ``fence()`` has passed (a
            writer that stalled past its lease removed its successor's save in progress there).

    On an object store the folder's marker holds a token of this publication's: leaving without
    :meth:`publish` removes the folder only while the marker still holds it (a writer whose
    lease ran out meanwhile left its successor's save of the same step alone).

    Cancellation: :meth:`publish` runs to its end once started (its thread is waited out); where
    a cancellation is raised after it ran, :attr:`published` is True all the same. The clean-up on
    leaving is shielded too.
    """

    def __init__(
        self,
        sched: Scheduler,
        final: str,
        *,
        folder: bool,
        tmp: str | None = None,
        priority: int = Priority.SAVE,
        fence: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.sched, self.final, self.folder, self.priority, self.fence = sched, final, folder, priority, fence
        if folder and not sched.engine.renames:
            tmp = final
        elif tmp is None:
            tmp = os.path.join(os.path.dirname(final), temp_name(os.path.basename(final))) if folder else hidden_temp(final)
        self.tmp = tmp
        self.published = False
        self._mark: bytes | None = None  # an object store's folder marker, as this publication made it

    @property
    def engine(self) -> Engine:
        return self.sched.engine

    async def __aenter__(self) -> Publication:
        if not self.folder:
            return self
        try:
            await self._mkdir()
        except FileExistsError:
            if not (
                self.fence is not None
                and not self.engine.renames
                and await self._call(_unfinished, self.engine, self.tmp, what=f"checking {self.tmp}")
            ):
                raise
            await self.fence()  # still the writer: the leftover is no other writer's save in progress
            await self._call(remove, self.engine, self.tmp, what=f"removing the unfinished {self.tmp}")
            await self._mkdir()
        except BaseException as e:
            # a cancellation waits for the mkdir in its thread, then is raised here: the folder was
            # made, and no __aexit__ runs to remove it (helper-36: a save cancelled then left its
            # temporary folder until the next writer's open); a temporary name is this one's own
            if self.engine.renames:
                await self.__aexit__(type(e), e, e.__traceback__)
            raise
        return self

    async def publish(self) -> None:
        """Make what was written under ``tmp`` appear at ``final`` (see :func:`publish`).

        Raises:
            CheckpointExistsError: a folder ``final`` is there already (not empty).
            OSError: naming the step that failed; nothing is published (``tmp`` is then removed
                on leaving the block).
        """
        ran: list[bool] = []

        def publish_it() -> None:
            publish(self.engine, self.tmp, self.final, folder=self.folder)
            ran.append(True)

        with anyio.CancelScope(shield=True):  # a rename that ran must be followed by its fsync
            try:
                await self._call(publish_it, what=f"publishing {self.final}")
            except OSError as e:
                if self.folder and e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise CheckpointExistsError(
                        f"{self.final} appeared meanwhile and is not this save's (nothing was published): {e}"
                    ) from e
                raise
            finally:  # (published, even where a cancellation came while it ran: its thread was waited out)
                self.published = bool(ran)

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.published:
            return
        # one worker call, handed to its thread at once (outside the scheduler's gate) and waited
        # out: asyncio's own Task.cancel() goes through an anyio shield, and withdrew a clean-up
        # that waited for admission, leaving a failed save_file's hidden temporary file beside the
        # user's for ever (helper-57)
        with anyio.CancelScope(shield=True):
            err = await self.sched.run_sync(self._clean)
        if err is None:
            return
        if e is None:
            raise annotate_oserror(err, f"removing {self.tmp}") from err
        who = "a store's next writer removes it" if self.folder else "nothing else removes it: delete it"
        note = f"clean-up could not remove the unfinished {self.tmp} ({err}); {who}"
        e.add_note(note)
        log.warning("%s", note)

    def _clean(self) -> OSError | None:
        """Remove ``tmp`` (blocking; left, and logged here, where another writer's save made it
        since: its marker holds their token); the error where it is still there (where that cannot
        be told too: only a stat that says it is missing says no), else None."""
        try:
            if self.folder and self._mark is not None and not self._ours():
                log.warning("%s: left as it is: another writer's save made it since this one failed", self.tmp)
                return None
            if self.folder:
                remove(self.engine, self.tmp)
            else:  # a file: no commit records under it to drop first
                self.engine.remove_file(self.tmp)
            return None
        except OSError as err:
            try:
                self.engine.stat(self.tmp)
            except FileNotFoundError:  # never made (its creation failed: a read-only folder), or gone
                return None
            except OSError:
                pass
            return err

    async def _mkdir(self) -> None:
        made = await self._call(self.engine.mkdir, self.tmp, what=f"creating {self.tmp}")
        self._mark = made if isinstance(made, bytes) else None

    def _ours(self) -> bool:
        """Does the folder's marker still hold the token this publication put there?"""
        assert self._mark is not None
        return self.engine.holds(os.path.join(self.tmp, FOLDER_MARKER), self._mark)

    async def _call(self, fn: Callable[..., object], *args: object, what: str, **kwargs: object) -> object:
        try:
            return await self.sched.call(lambda: fn(*args, **kwargs), priority=self.priority)
        except OSError as err:
            raise annotate_oserror(err, what) from err


__all__ = [
    "MANIFEST",
    "RECORDS",
    "Publication",
    "drop_records",
    "hidden_temp",
    "is_leftover",
    "publish",
    "remove",
    "replace_small",
    "retire",
    "temp_name",
    "write_small",
]
