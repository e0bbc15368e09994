"""Keeping worker threads' Python work in short GIL holds: they share the GIL with the event loop's
thread, which waits for every hold (measured with a 20,000-tensor state in ``bench/bench_loop.py``).

Two things held it for 100 ms or more at a time:

- one ``json.dumps`` call of a big manifest or safetensors header (the C encoder never lets the GIL
  go): :func:`dumps` encodes big objects and arrays in slices of members, each one C call, and
  joins them, byte-identical to ``json.dumps(obj, separators=(",", ":"), ensure_ascii=False,
  allow_nan=False)``. (It once went member by member in Python, which held the GIL longer in all
  than the one C call it replaced: 0.45 s per save and load of 20,000 tensors, by py-spy.)
- full collections of the cyclic garbage collector, set off by the tens of thousands of objects a
  save or load of many tensors keeps alive for its duration (plans, specs, manifest entries): each
  walks every object in the process (torch's own and the user's state too; 110-220 ms with 20,000
  tensors on the development VM, in whichever thread set it off, the GIL held throughout).
  :func:`paused_gc` pauses the collector for a whole save or load (and :func:`quiet_gc` for a
  function that builds many objects outside one); reference counting still frees everything at
  once, nothing the library makes is a reference cycle (``formats/tree.py``), and the collector
  resumes (if it was enabled) when the last pause ends. What the application makes meanwhile is
  collected then.

A load without ``into`` (or a stream) hands its new tensors to the application. Everything made
during a pause is young, so the first young collection after it walked them all at once, on
whichever thread allocated next, often the loop's (15-47 ms for 20,000 tensors). When more than
:data:`PROMOTE_OVER` objects are young as the last pause ends, they are moved to the oldest
generation unwalked instead (``gc.freeze()`` then ``gc.unfreeze()``: on CPython 3.11-3.13, two
list splices), where the next full collection meets them as it meets the rest of the heap. The
price: garbage cycles the application made in the last few seconds of the pause wait for that full
collection too. Nothing is moved once the application has frozen objects itself (a pre-fork
server's ``gc.freeze()``, which ``gc.unfreeze()`` would give back to the collector; counting them
walks them, so it is counted until it is seen once), on 3.14 and later (the incremental collector's
freeze marks objects one by one) or on a free-threaded interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

from ..knobs import JSON_CHUNK_VALUES, PROMOTE_OVER, YOUNG_EVERY_S

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
U = TypeVar("U", bound="set[Any] | dict[Any, Any]")

_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_FEW = 16  # members: see _size
# there, freeze() walks objects: see the module's text
_can_promote = sys.version_info < (3, 14) and not sysconfig.get_config_var("Py_GIL_DISABLED")
_lock = threading.Lock()
_paused = 0
_was_enabled = False
_lowered = 0
_was_interval = 0.0
_next_young = 0.0
_set_interval = 0.0


def listed(items: Iterable[T]) -> list[T]:
    """``list(items)``, made by C loops of :data:`_LISTED_PER_CALL` items each. A C loop (``map``
    over a C function, ``tuple.__new__``, a crc) never lets the GIL go: one over 20,000 items held
    it ~10 ms while the event loop's thread waited; between these loops it changes hands."""
    it = iter(items)
    out: list[T] = []
    while True:
        had = len(out)
        out += islice(it, _LISTED_PER_CALL)
        if len(out) - had < _LISTED_PER_CALL:
            return out


_LISTED_PER_CALL = 1024


def same(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """``a == b`` for two lists, compared :data:`_LISTED_PER_CALL` items per C call (as
    :func:`listed` makes one)."""
    step = _LISTED_PER_CALL
    return len(a) == len(b) and all(a[i : i + step] == b[i : i + step] for i in range(0, len(a), step))


def filled(into: U, items: Iterable[Any]) -> U:
    """``into.update(items)`` (a dict's pairs or a set's members) a slice of
    :data:`_LISTED_PER_CALL` per C call, as :func:`listed` makes a list (a ``dict(zip(...))`` of
    20,000 pairs held the GIL 1.3 ms); returns ``into``."""
    it = iter(items)
    while True:
        some = list(islice(it, _LISTED_PER_CALL))
        into.update(some)
        if len(some) < _LISTED_PER_CALL:
            return into


def emptied(*containers: list[Any] | dict[Any, Any]) -> None:
    """Empty ``containers`` a slice at a time, freeing each slice in one call with the GIL held: the
    slice doubles while one is freed in under :data:`_FREE_FAST_S` and halves when one takes four
    times that, since what a member holds is unknown (a target, or a stream's batch of 512 entries
    and their specs). Emptying a list of 20,000 targets in one call held the GIL 2-3 ms, the event
    loop's thread waiting; a stream's 40 batches, 7 ms; a save plan's 20,000 tensor identities,
    ~3 ms, where its function returned."""
    for c in containers:
        n = 1
        while c:
            t = time.perf_counter()
            if isinstance(c, dict):
                gone = [c.popitem() for _ in range(min(len(c), n))]
            else:
                gone = c[-n:]
                del c[-n:]
            del gone
            took = time.perf_counter() - t
            n = 2 * n if took < _FREE_FAST_S else max(1, n // 2) if took > 4 * _FREE_FAST_S else n


_FREE_FAST_S = 0.00025


def slices(items: Iterable[T], size: int = 4096) -> Iterator[list[T]]:
    """``items`` as lists of ``size`` (the last shorter), for work done by C loops a slice at a
    time, as :func:`listed` makes a list: between slices the GIL changes hands."""
    it = iter(items)
    while some := list(islice(it, size)):
        yield some


def dumps(obj: Any) -> str:
    """``json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)``, byte for
    byte, in C-encoder calls of about :data:`JSON_CHUNK_VALUES` values each."""
    parts: list[str] = []
    _walk(obj, parts)
    return "".join(parts)


def _size(obj: Any) -> int:
    """The number of JSON values in ``obj``, estimated: a container of up to :data:`_FEW` members
    adds up its members' sizes, a bigger one takes its first member's size for every member (the big
    containers of state trees, manifests and headers hold members alike), so that the estimate
    costs little more than the depth of ``obj``."""
    if not isinstance(obj, (dict, list, tuple)) or not obj:
        return 1
    members = obj.values() if isinstance(obj, dict) else obj
    if len(obj) <= _FEW:
        return 1 + sum(_size(m) for m in members)
    return 1 + len(obj) * _size(next(iter(members)))


def _walk(obj: Any, parts: list[str]) -> None:
    size = _size(obj)
    if size <= JSON_CHUNK_VALUES:
        parts.append(_encode(obj))
        return
    per = (size - 1) // len(obj)  # values per member
    step = max(1, JSON_CHUNK_VALUES // per) if per <= JSON_CHUNK_VALUES else 0  # members per C call; 0: each member walked
    mapping = isinstance(obj, dict)
    # a slice at a time (a list of a dict's 300,000 items, made in one C call, held the GIL 10 ms)
    members = iter(obj.items()) if mapping else iter(obj)
    whole = dict if mapping else list  # a slice of members, encoded as its own object or array
    parts.append("{" if mapping else "[")
    first = True
    for some in slices(members, step or 1):
        if not first:
            parts.append(",")
        first = False
        if step:
            parts.append(_encode(whole(some))[1:-1])
        elif mapping:
            ((k, v),) = some
            parts.append(_encode({k: 0})[1:-3] + ":")  # the key as json.dumps writes it (int, float, bool, None too)
            _walk(v, parts)
        else:
            _walk(some[0], parts)
    parts.append("}" if mapping else "]")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused inside (see the module's text); pauses nest and overlap
    across threads and operations, and the state the first one found comes back after the last.
    (An application that calls ``gc.disable()`` itself while a pause is on finds the collector
    enabled again when the pause ends, if it was enabled when the pause began.)"""
    global _paused, _was_enabled, _next_young
    with _lock:
        if _paused == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
            _next_young = time.monotonic() + YOUNG_EVERY_S
        _paused += 1
    try:
        yield
    finally:
        with _lock:
            _paused -= 1
            if _paused == 0 and _was_enabled:
                _promote_young()
                gc.enable()


def _promote_young() -> None:
    """Move the young objects to the oldest generation unwalked, if there are many (module text)."""
    global _can_promote
    if not _can_promote or gc.get_count()[0] <= PROMOTE_OVER:
        return
    if gc.get_freeze_count():  # the application's own: never given back; not counted again
        _can_promote = False
        return
    gc.freeze()
    gc.unfreeze()


def call_collecting(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, after a young collection if a pause has lasted :data:`YOUNG_EVERY_S` since
    the last (worker threads run their calls through this).

    Saves of big states, or saves back to back (a snapshotter on a slow disk), can keep the
    collector paused for minutes, and the application's garbage cycles would pile up meanwhile.
    Nothing is collected during a pause, so everything made since it began is young: collecting
    the young generations frees those cycles at a cost that grows with what was made since the
    last such collection, not with the heap, and it runs in the worker, not the loop's thread.
    """
    global _next_young
    if _paused and time.monotonic() >= _next_young and _was_enabled:
        with _lock:
            due = _paused > 0 and time.monotonic() >= _next_young
            _next_young = time.monotonic() + YOUNG_EVERY_S
        if due:
            gc.collect(1)
    return fn(*args)


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """The interpreter's GIL switch interval at most ``seconds`` inside (``None``: left alone).

    A thread that wants the GIL waits a whole switch interval (5 ms by default) before it asks
    the holder to let go, and a worker doing Python work for 20,000 small tensors holds it that
    long every time: the event loop's thread then ran its callbacks 10 ms late at the 99th
    percentile, with one worker as with four; at 1 ms, 3 ms late (at 0.5 ms, the default now, 1.6-3.1), and no
    slower (``bench/bench_loop.py``). Windows nest and overlap like :func:`paused_gc`; when the
    last ends, the interval the first found comes back, unless someone changed it meanwhile.
    """
    global _lowered, _was_interval, _set_interval
    if seconds is None:
        yield
        return
    with _lock:
        current = sys.getswitchinterval()
        if _lowered == 0:
            _was_interval = current
        if seconds < current:
            sys.setswitchinterval(seconds)
        _set_interval = sys.getswitchinterval()
        _lowered += 1
    try:
        yield
    finally:
        with _lock:
            _lowered -= 1
            if _lowered == 0 and sys.getswitchinterval() == _set_interval:
                sys.setswitchinterval(_was_interval)


def quiet_gc(fn: F) -> F:
    """Run ``fn`` inside :func:`paused_gc`."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with paused_gc():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
