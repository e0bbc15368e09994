"""Keeping worker threads' Python work in short GIL holds: they share the GIL with the event loop's
thread, which waits for every hold (measured with a 20,000-tensor state in ``bench/bench_loop.py``).

Two things held it for 100 ms or more at a time:

- one ``json.dumps`` call of a big manifest or safetensors header (the C encoder never lets the GIL
  go): :func:`dumps` encodes big objects and arrays member by member, byte-identical to
  ``json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)``;
- full collections of the cyclic garbage collector, set off by the tens of thousands of dicts a
  manifest parse or a plan makes: each walks every object in the process (the user's state too).
  :func:`quiet_gc` pauses the collector while such a function runs; reference counting still frees
  everything at once, and the collector resumes (if it was enabled) when the last one returns.
"""

from __future__ import annotations

import functools
import gc
import json
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_BIG = 32  # members: containers holding bigger ones, at any depth, are encoded member by member
_lock = threading.Lock()
_paused = 0
_was_enabled = False


def dumps(obj: Any) -> str:
    parts: list[str] = []
    _walk(obj, parts)
    return "".join(parts)


def _heavy(obj: Any) -> bool:
    """Does ``obj`` hold a container of more than ``_BIG`` members, at any depth?"""
    if isinstance(obj, dict):
        return len(obj) > _BIG or any(_heavy(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return len(obj) > _BIG or any(_heavy(v) for v in obj)
    return False


def _walk(obj: Any, parts: list[str]) -> None:
    if not _heavy(obj):
        parts.append(_encode(obj))
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        parts.append("{")
        for i, (k, v) in enumerate(obj.items()):
            parts.append(("," if i else "") + _encode(k) + ":")
            _walk(v, parts)
        parts.append("}")
    elif isinstance(obj, (list, tuple)):
        parts.append("[")
        for i, v in enumerate(obj):
            if i:
                parts.append(",")
            _walk(v, parts)
        parts.append("]")
    else:
        parts.append(_encode(obj))


def quiet_gc(fn: F) -> F:
    """Run ``fn`` with the cyclic garbage collector paused (see the module's text)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _paused, _was_enabled
        with _lock:
            if _paused == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _paused -= 1
                if _paused == 0 and _was_enabled:
                    gc.enable()

    return wrapper  # type: ignore[return-value]
