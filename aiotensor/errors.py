"""The exception tree of aiotensor.

Every problem of a file, a checkpoint or a store that the library raises is an
:class:`AiotensorError` (a wrong argument is a ``ValueError`` or ``TypeError``, as in Python itself)::

    AiotensorError
    ├── FormatError (ValueError)           a file does not follow its format
    │   ├── HeaderError                    malformed safetensors header
    │   ├── ManifestError                  malformed checkpoint manifest
    │   ├── UnsafeFileError                a torch.save file that would need unrestricted pickle
    │   ├── UnsafePathError                a symlink, FIFO, device or folder where a regular file belongs
    │   └── ChecksumError                  tensor bytes differ from the recorded crc32c
    ├── StateError (TypeError)             a state_dict that cannot be saved (leaf type, device, layout)
    │   └── StateChangedError              a tensor changed in place before the save copied it out
    ├── MismatchError (ValueError)         ``load(into=...)`` target has another shape/dtype/key set
    ├── UnsupportedLocationError (ValueError)  a URL aiotensor does not serve there (``gs://...``, ``s3:/bucket``)
    ├── CheckpointNotFoundError (LookupError, FileNotFoundError)  no such step / no committed step
    ├── SourceChangedError (RuntimeError)  a file was replaced or written while it was being loaded
    ├── StreamClosedError (RuntimeError)   a stream cut short (a cancelled wait, a failed read) asked again
    ├── CheckpointExistsError (FileExistsError)   the step is already committed or being saved
    ├── StaleStepError (ValueError)        a save of a step older than a committed one (roll back first)
    ├── SaveCancelledError                 the save was cancelled; nothing was committed
    ├── StoreClosedError (RuntimeError)    the store was used outside ``async with``
    ├── StoreLockedError (RuntimeError)    another writer holds the root's lock
    ├── ReadOnlyStoreError (RuntimeError)  a write (save, delete) on a store opened ``readonly=True``
    ├── SaveFailedError (RuntimeError)     an earlier background save failed and nobody awaited it
    └── DistributedError (RuntimeError)    a save or load under a process group failed on other ranks

Operating system failures (disk full, EIO, permission) stay :class:`OSError` — users expect
``except OSError`` to catch a full disk — but their message is extended with the file involved.
"""

from __future__ import annotations

__all__ = [
    "ReadOnlyStoreError",
    "StoreLockedError",
    "StaleStepError",
    "UnsafePathError",
    "AiotensorError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "DistributedError",
    "ChecksumError",
    "FormatError",
    "HeaderError",
    "ManifestError",
    "MismatchError",
    "SaveCancelledError",
    "SaveFailedError",
    "SourceChangedError",
    "StateChangedError",
    "StateError",
    "StoreClosedError",
    "StreamClosedError",
    "UnsafeFileError",
    "UnsupportedLocationError",
]


_MAX_MESSAGE = 600


class AiotensorError(Exception):
    """Base class of every error raised on purpose by aiotensor."""


class FormatError(AiotensorError, ValueError):
    """A file does not follow its format. ``path`` names the file."""

    def __init__(self, message: str, path: object = None) -> None:
        self.path = None if path is None else str(path)
        if len(message) > _MAX_MESSAGE:  # a hostile file must not make a megabyte-long message
            message = message[: _MAX_MESSAGE - 20] + f"… ({len(message)} chars)"
        self.reason = message  # what is wrong, without the file's name
        super().__init__(f"{self.path}: {message}" if self.path else message)


class HeaderError(FormatError):
    """A safetensors header is malformed (size, JSON, dtype, shape, offsets)."""


class ManifestError(FormatError):
    """A checkpoint manifest is malformed or points outside its checkpoint."""


class UnsafeFileError(FormatError):
    """A torch.save file needs something aiotensor refuses to do (arbitrary pickle, compression)."""


class UnsafePathError(FormatError):
    """Something other than a regular file (a symbolic link inside a checkpoint, a FIFO, a device, a
    folder) where a file was expected: refused before reading, so nothing can block or escape."""


class ChecksumError(FormatError):
    """Tensor bytes read from disk differ from the crc32c recorded when they were written."""

    def __init__(self, message: str, path: object = None, key: str | None = None) -> None:
        self.key = key
        super().__init__(message, path)


class StateError(AiotensorError, TypeError):
    """The state given to save cannot be stored; the message names the key path."""


class StateChangedError(StateError):
    """A tensor of the state being saved was changed in place (its version counter moved: an
    optimizer's step, a ``fill_``) after ``save()`` and before the save copied it out (``await
    handle.staged``): the copy may be half old, half new, so the save failed and nothing was
    committed. Changes PyTorch does not count (through ``.data``, a NumPy view, a fused optimizer,
    BatchNorm's running statistics, a CUDA graph) cannot be seen: a net, not a guarantee."""


class MismatchError(AiotensorError, ValueError):
    """A ``load(into=...)`` target does not match what the checkpoint holds."""


class UnsupportedLocationError(AiotensorError, ValueError):
    """A URL this library does not serve there (``gs://``, ``http://``, ``S3://``..., ``s3://`` where an
    API takes local paths only), or one mistyped (``s3:/bucket``), where a path was expected:
    refused before anything is created (a local folder named ``s3:`` would otherwise be made in the
    working directory)."""


class CheckpointNotFoundError(AiotensorError, LookupError, FileNotFoundError):
    """No committed checkpoint for the step asked for (or none at all)."""


class SourceChangedError(AiotensorError, RuntimeError):
    """A file was replaced (or written) while it was being loaded: its data is no longer the data its
    header, read first, describes. Nothing read from it is returned or switched to; load again."""


class StreamClosedError(AiotensorError, RuntimeError):
    """A stream asked for its next tensor after it was cut short: a wait for a tensor was cancelled
    (a per-tensor timeout) or a read failed, which closed it. What it gave is only part of its
    source; open a new stream. (A stream closed by ``aclose()`` or its ``async with`` ends as an
    iterator does, ``StopAsyncIteration``.)"""


class CheckpointExistsError(AiotensorError, FileExistsError):
    """The step is already committed in this store, or a save of it is in flight."""


class StaleStepError(AiotensorError, ValueError):
    """A save of a step older than a committed one: ``latest`` would still name the newer one (and
    retention, ``keep_last``, might delete it as soon as it commits). Roll back first
    (``TensorStore.rollback``) to resume from an earlier step and save it again."""


class StoreLockedError(AiotensorError, RuntimeError):
    """Another writer (a store in this or another process) holds the root's lock."""


class ReadOnlyStoreError(AiotensorError, RuntimeError):
    """A save, delete or rollback on a store opened with ``readonly=True``."""


class SaveCancelledError(AiotensorError):
    """The save was cancelled (``handle.cancel()`` or the store closing on an error); nothing was committed."""


class StoreClosedError(AiotensorError, RuntimeError):
    """The store is not open: use it inside ``async with TensorStore(...)``."""


class SaveFailedError(AiotensorError, RuntimeError):
    """A background save failed and its handle was never awaited; ``__cause__`` is the failure."""


class DistributedError(AiotensorError, RuntimeError):
    """A save or load under a process group failed on other ranks; ``failures`` maps each rank that
    failed to what it raised (this rank's own failure is raised as itself instead)."""

    failures: dict[int, BaseException]


def annotate_oserror(exc: OSError, what: str, *, unless_named: bool = False) -> OSError:
    """Return ``exc`` with ``what`` (the operation and file) prepended, keeping its type and errno;
    ``unless_named``: ``exc`` itself where it names its file already (a local one: the path said
    once; an object store's names its request, not the URL)."""
    if getattr(exc, "_aiotensor_annotated", False) or (unless_named and exc.filename is not None):
        return exc
    new = type(exc)(exc.errno, f"{what}: {exc.strerror or exc}") if exc.errno else type(exc)(f"{what}: {exc}")
    if exc.filename is not None:  # assigning None would print as ": None"
        new.filename = exc.filename
    new._aiotensor_annotated = True  # type: ignore[attr-defined]
    return new
