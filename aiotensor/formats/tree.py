"""Nested state <-> JSON tree plus a flat list of tensors.

The JSON tree keeps every container type and key type exactly; tensors become ``{"tensor": key}``.
Nothing is ever pickled: a leaf JSON cannot hold is refused, naming its key path.

Encoding: ``None``, ``bool``, ``int``, ``str`` and finite ``float`` are stored as themselves;
``{"float": "nan" | "inf" | "-inf"}``, ``{"list": [...]}``, ``{"tuple": [...]}``,
``{"dict": {str: ...}}`` (all keys strings) or ``{"items": [[key, value], ...]}`` (other keys),
``{"dtype": "float32"}`` for a ``torch.dtype``, ``{"numpy": ["float32", 0.5]}`` for a numpy bool,
integer or float scalar of up to 64 bits (a metric, a loader's index: it comes back as that numpy
type), ``{"tensor": key}``, and
``{"odict": [mapping, metadata]}`` for an ``OrderedDict`` (what ``state_dict()`` returns), whose
``_metadata`` attribute (the module versions ``load_state_dict`` reads) is kept too, and
``{"counter": mapping}`` for a ``collections.Counter`` (``MultiStepLR``'s milestones: as a dict,
its ``step()`` fails after a restore). Other subclasses of dict, list, tuple, int and str come back
as those (a ``torch.Size`` as a tuple, a named tuple as a tuple, a ``defaultdict`` as a dict).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping
from itertools import chain, compress, repeat
from operator import is_, itemgetter
from typing import Any, TypeVar

import torch

from .._runtime import gil
from ..errors import ManifestError, StateChangedError, StateError

Path = tuple[Any, ...]
TAGS = frozenset({"dict", "list", "tuple", "items", "odict", "counter", "tensor", "dtype", "float", "numpy"})  # a node's
_SCALARS = (type(None), bool, int, str)
_KEYS = (*_SCALARS, float)  # what a dict's keys may be (instances of)
_KEY_TYPES, _STR = frozenset(_KEYS), frozenset([str])
MAX_DEPTH = 64
# flatten and unflatten recurse through methods of small classes, not nested functions: a nested
# function that calls itself is a reference cycle (function -> closure cell -> function) holding all
# its closure sees (the tensor list, the destination dict), so every save and load handed its
# tensors to the cyclic garbage collector instead of freeing them at once, and the collections that
# followed held the GIL (so the event loop) for 100 ms and more with 20,000 tensors.


def key_path(path: Path) -> str:
    return ".".join(map(str, path)) or "<root>"


def unique_key(key: str, used: set[str]) -> str:
    """``key``, or the first of ``key#2``, ``key#3``... not in ``used`` (then added to it): two
    paths can make one dotted name (``{"a.b": x, "a": {"b": y}}``, ``{1: x, "1": y}``), and each
    tensor keeps a name of its own."""
    name, n = key, 1
    while name in used:
        n += 1
        name = f"{key}#{n}"
    used.add(name)
    return name


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


class _Flatten:
    """flatten's walk (a class, not a nested function: see the comment under MAX_DEPTH)."""

    def __init__(self, leaf: type = torch.Tensor, paths: bool = False) -> None:
        self.leaf = leaf  # what a tensor leaf is (matched() walks a saved tree's keys as leaves)
        self.tensors: list[tuple[str, Any]] = []
        self.used: set[str] = set()
        self.paths: list[Path] | None = [] if paths else None  # each tensor's, in the order of tensors (matched())

    def tensor(self, t: Any, name: str) -> dict[str, str]:
        if name in self.used:
            key = unique_key(name, self.used)
        else:
            self.used.add(key := name)
        self.tensors.append((key, t))
        return {"tensor": key}

    def mapping(self, obj: Mapping[Any, Any], path: Path) -> Any:
        keys = list(obj.keys())
        kinds = set(map(type, keys))  # (the keys' types, not each key, tested: ~3 us a dict saved)
        if not kinds <= _KEY_TYPES and not all(issubclass(k, _KEYS) for k in kinds):
            bad = next(k for k in keys if not isinstance(k, _KEYS))
            raise StateError(
                f"key {bad!r} at {key_path(path)!r} is a {type(bad).__name__}; keys must be str, int, float, bool or None"
            )
        if kinds <= _STR or all(issubclass(k, str) for k in kinds):
            if self.paths is None and len(path) < MAX_DEPTH:  # a tensor's key made here: 1 us of 3 saved
                at = ".".join(map(str, path)) + "." if path else ""
                leaf, tensor = self.leaf, self.tensor
                return {
                    "dict": {
                        k: tensor(v, at + str(k) or "<root>") if isinstance(v := obj[k], leaf) else self.walk(v, (*path, k))
                        for k in keys
                    }
                }
            return {"dict": {k: self.walk(obj[k], (*path, k)) for k in keys}}
        return {"items": [[_float(k) if isinstance(k, float) else k, self.walk(obj[k], (*path, k))] for k in keys]}

    def walk(self, obj: Any, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise StateError(f"state nests deeper than {MAX_DEPTH} levels at {key_path(path)!r}")
        if type(obj) is dict and len(obj) < _BULK:  # (an optimizer's state per parameter: no test of what it is not)
            return self.mapping(obj, path)
        if isinstance(obj, self.leaf):
            if self.paths is not None:
                self.paths.append(tuple(_NAN if k != k else k for k in path))  # (nan is no key's equal)
            return self.tensor(obj, key_path(path))
        if isinstance(obj, _SCALARS):
            return obj
        if isinstance(obj, float):
            return _float(obj) if type(obj) is float else numpy_node(obj) or _float(obj)  # (numpy's float64: one)
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if type(obj) is Counter:
            return {"counter": self.walk(dict(obj), path)}
        if type(obj) is OrderedDict:
            meta = getattr(obj, "_metadata", None)
            return {"odict": [self.walk(dict(obj), path), None if meta is None else self.walk(meta, (*path, _META))]}
        if type(obj) in (dict, list, tuple) and len(obj) >= _BULK and len(path) < MAX_DEPTH and _flat(obj):
            # only plain scalars one level down (a sampler's indices, per-sample losses): copied by
            # C loops; walked value by value, a list of a million took 0.35 s of a save
            if type(obj) is dict:
                return {"dict": _copied(obj, {})}
            return {"tuple" if type(obj) is tuple else "list": gil.listed(obj)}
        if isinstance(obj, Mapping):
            return self.mapping(obj, path)
        if isinstance(obj, (list, tuple)):
            items = [self.walk(v, (*path, i)) for i, v in enumerate(obj)]
            return {"tuple" if isinstance(obj, tuple) else "list": items}
        if (node := numpy_node(obj)) is not None:
            return node
        raise StateError(
            f"cannot save {type(obj).__module__}.{type(obj).__qualname__} at {key_path(path)!r}: "
            "only tensors, dicts, lists, tuples, str, int, float, bool, None, torch.dtype and numpy's bool, integer "
            "and float scalars are stored (aiotensor never pickles); convert it, for example to a tensor or a string"
        )


def numpy_node(obj: Any) -> dict[str, list[Any]] | None:
    """``{"numpy": [dtype name, value]}`` for a numpy bool, integer or float scalar of up to 64
    bits; None for anything else (numpy's complex, longdouble, datetime64 scalars, arrays)."""
    np = sys.modules.get("numpy")
    if np is None or not isinstance(obj, np.generic) or obj.dtype.name not in _NUMPY_NAMES:
        return None
    value = obj.item()
    return {"numpy": [obj.dtype.name, _float(value) if isinstance(value, float) else value]}


# the numpy scalars stored, by their dtype's name, and the type of the value stored with each
_NUMPY_NAMES = {"bool": bool, "float16": float, "float32": float, "float64": float} | {
    f"{sign}int{bits}": int for sign in ("", "u") for bits in (8, 16, 32, 64)
}


def python_values(obj: Any) -> Any:
    """``obj`` with each numpy scalar :func:`flatten` keeps made its Python value (``.item()``),
    for a writer that pickles values: ``torch.load(weights_only=True)`` refuses numpy's (helper-68:
    a step read through DCP, or converted to a torch.save file, could not be loaded). Containers
    holding none are returned as they are."""
    if numpy_node(obj) is not None:
        return obj.item()
    if type(obj) in (dict, OrderedDict, Counter):
        new = {k: python_values(v) for k, v in obj.items()}
        meta = getattr(obj, "_metadata", None)
        kept = python_values(meta)  # (an OrderedDict's, which flatten keeps too: helper-69)
        if all(map(is_, new.values(), obj.values())) and kept is meta:
            return obj
        out = type(obj)(new)
        if meta is not None:
            out._metadata = kept  # type: ignore[attr-defined]
        return out
    if type(obj) in (list, tuple):
        items = [python_values(v) for v in obj]
        return obj if all(map(is_, items, obj)) else type(obj)(items)
    return obj


def flatten(state: Any) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
    """Return the JSON tree and the tensors in tree order, each under a unique string key.

    Raises:
        StateError: a leaf that JSON cannot hold, a non-string-able key, or nesting over 64 deep.
        StateChangedError: a dict of it changed size, or lost a key, while the walk went through it
            (another thread changing the state: helper-60 got a bare RuntimeError).
    """
    f = _Flatten()
    try:
        return f.walk(state, ()), f.tensors
    except (RuntimeError, KeyError) as e:
        # a dict changed while iterated, or a key this walk listed gone when it looked it up (not a
        # Mapping's own __getitem__ refusing: a lazy mapping's KeyError is its own, helper-61)
        if isinstance(e, RuntimeError) and "changed size during iteration" not in str(e):
            raise
        if isinstance(e, KeyError) and (e.__traceback__ is None or _last_frame(e.__traceback__).f_code.co_filename != __file__):
            raise
        raise StateChangedError(
            f"the state changed while the save walked it ({type(e).__name__}: {e}): another thread changed one of its "
            "dicts or lists; do not change the state's containers until the save's handle is staged. Nothing was saved"
        ) from None


def _last_frame(tb: Any) -> Any:
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def matched(tree: Any, keys: Iterable[str], state: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` under the keys of the tree a save wrote (:func:`flatten`'s; ``keys``:
    its tensors' keys), paired by where they are, not by name: two paths that make one dotted name
    (``{"a.b": x, "a": {"b": y}}``) are named ``a.b`` and ``a.b#2`` in the order a walk meets them,
    and a ``state`` that lists them in the other order would swap them by name. The saved tree's
    paths come from the same two walks a load and a save make (:func:`unflatten` with its keys as
    leaves, then flatten's). A tensor of ``state`` at a path the tree lacks keeps its own name
    (``#`` and a number where that is taken): the caller reports it."""
    f = _Flatten(paths=True)
    f.walk(state, ())
    if not any("#" in k for k, _ in f.tensors) and not any("#" in k for k in keys):  # no name made twice: names are paths
        return dict(f.tensors)
    walked = _Flatten(leaf=_Key, paths=True)
    walked.walk(unflatten(tree, _Key), ())
    assert f.paths is not None and walked.paths is not None
    by_path = {p: (k, t) for p, (k, t) in zip(f.paths, f.tensors, strict=True)}
    out: dict[str, torch.Tensor] = {}
    for (_, leaf), path in zip(walked.tensors, walked.paths, strict=True):
        if path in by_path:
            out[leaf.key] = by_path.pop(path)[1]
    used = set(out) | {leaf.key for _, leaf in walked.tensors}  # a tensor at a path the tree lacks takes no saved key
    for key, t in by_path.values():
        out[unique_key(key, used)] = t
    return out


class _Key:
    """A saved tensor's key, as a leaf of the tree :func:`matched` rebuilds."""

    def __init__(self, key: str) -> None:
        self.key = key


class _Marker:
    """A path element that equals nothing a state's keys hold, shown as ``name`` in key paths."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return self.name


_META, _NAN = _Marker("_metadata"), _Marker("nan")  # an OrderedDict's _metadata; a nan key


class _Unflatten:
    """unflatten's walk (a class, not a nested function: see the comment under MAX_DEPTH)."""

    def __init__(self, tensor: Callable[[str], Any], where: object) -> None:
        self.tensor = tensor
        self.where = where

    def bad(self, msg: str) -> ManifestError:
        return ManifestError(f"state tree: {msg}", self.where)

    def scalar(self, x: Any) -> Any:
        if isinstance(x, _SCALARS) or isinstance(x, float):
            return x
        if isinstance(x, dict) and set(x) == {"float"} and x["float"] in ("nan", "inf", "-inf"):
            return float(x["float"])
        raise self.bad(f"unexpected value {str(x)[:80]!r}")

    def walk(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH + 1:
            raise self.bad("nested too deep")
        if not isinstance(node, dict):
            return self.scalar(node)
        if len(node) != 1:
            raise self.bad(f"a node must have one tag, got {sorted(node)[:5]}")
        ((tag, val),) = node.items()
        if tag == "tensor" and isinstance(val, str):
            return self.tensor(val)
        if tag in ("list", "tuple") and isinstance(val, list):
            plain = len(val) >= _BULK and depth <= MAX_DEPTH and _plain(val)  # (its items one level down: within the depth)
            items = gil.listed(val) if plain else [self.walk(v, depth + 1) for v in val]
            return items if tag == "list" else tuple(items)
        if tag == "dict" and isinstance(val, dict):
            keys = _tensor_keys(val.values()) if depth <= MAX_DEPTH else None
            if keys is not None:  # only tensors below (a state_dict): C loops, not a walk per tensor
                pairs = zip(val, map(self.tensor, keys), strict=True)  # (a slice per C loop: 20,000 held the GIL 1.3 ms)
                return dict(pairs) if len(val) <= _BULK else gil.filled({}, pairs)
            if len(val) >= _BULK and depth <= MAX_DEPTH and _plain(val.values()):
                return _copied(val, {})
            return {k: self.walk(v, depth + 1) for k, v in val.items()}
        if tag == "items" and isinstance(val, list):
            out = {}
            for pair in val:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise self.bad("items must be [key, value] pairs")
                out[self.scalar(pair[0])] = self.walk(pair[1], depth + 1)
            return out
        if tag == "odict" and isinstance(val, list) and len(val) == 2 and isinstance(val[0], dict):
            # the mapping is the OrderedDict's own level, as flatten counts it (an extra level here
            # refused a state of OrderedDicts nested 33 to 64 deep that flatten had saved)
            out = _copied(self.walk(val[0], depth), OrderedDict())
            if val[1] is not None:
                out._metadata = self.walk(val[1], depth + 1)  # type: ignore[attr-defined]
            return out
        if tag == "counter" and isinstance(val, dict):
            return Counter(self.walk(val, depth))  # (the dict's own level, as for an OrderedDict)
        if tag == "dtype" and isinstance(val, str):
            dt = getattr(torch, val, None)
            if not isinstance(dt, torch.dtype):
                raise self.bad(f"unknown dtype {val!r}")
            return dt
        if tag == "numpy" and isinstance(val, list) and len(val) == 2 and isinstance(val[0], str):
            return self.numpy(val[0], self.scalar(val[1]))
        return self.scalar(node)

    def numpy(self, name: str, value: Any) -> Any:
        """The numpy scalar ``{"numpy": [name, value]}`` stands for (:func:`numpy_node`)."""
        if _NUMPY_NAMES.get(name) is not type(value):  # (np.dtype() of a hostile name: SyntaxError, helper-68)
            raise self.bad(f"unexpected numpy scalar {name!r}: {str(value)[:40]!r}")
        make, top = _numpy_type(name)
        try:  # (a finite float past the type's largest would be inf, with numpy's RuntimeWarning)
            out = None if top is not None and top < abs(value) < math.inf else make(value)
        except OverflowError:
            out = None
        if out is None or (type(value) is float and float(out) != value and value == value):  # (out of range: 0)
            raise self.bad(f"numpy scalar {value!r} is not a {name}")
        return out


@functools.cache
def _numpy_type(name: str) -> tuple[Any, float | None]:
    """The numpy scalar type of one of :data:`_NUMPY_NAMES`, and its largest finite value (a float type's)."""
    import numpy as np

    dtype = np.dtype(name)
    return dtype.type, float(np.finfo(dtype).max) if dtype.kind == "f" else None


def _tensor_keys(nodes: Collection[Any]) -> list[str] | None:
    """The keys of ``nodes`` where every one is a tensor's (``{"tensor": key}``), else None."""
    if len(nodes) < 2:
        return None
    keys: list[str] = []
    for some in gil.slices(nodes) if len(nodes) > _BULK else (nodes,):  # (C loops over 20,000 held the GIL 1-2 ms each)
        if not _DICT.issuperset(map(type, some)) or set(map(len, some)) != {1}:
            return None
        if set(chain.from_iterable(some)) != {"tensor"}:
            return None
        got = list(map(_TENSOR, some))
        if not _STR.issuperset(map(type, got)):
            return None
        keys += got
    return keys


def _plain(values: Iterable[Any], finite: bool = False) -> bool:
    """Is every one of ``values`` a JSON scalar that stands for itself (not a node: None, a bool,
    an int, a string, a float; with ``finite``, no nan or inf, which a tree writes as nodes)?
    Checked by C loops a slice at a time: a list of a million sample indices walked value by
    value took 200 ms, twice per load (a C loop over all of it at once would hold the GIL ~20 ms).
    Worth it for containers of :data:`_BULK` values or more: for small ones the checks cost more
    than the walk they save (a state of 10,000 dicts of two tensors flattened 20% slower)."""
    for some in gil.slices(values):
        if not _PLAIN.issuperset(map(type, some)):
            return False
        if finite and not all(map(math.isfinite, compress(some, map(is_, map(type, some), repeat(float))))):
            return False
    return True


def _flat(obj: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> bool:
    """Does ``obj`` hold only what a state tree writes as itself: plain scalars (finite floats),
    under string keys if a dict?"""
    if type(obj) is dict:
        return all(_STR.issuperset(map(type, some)) for some in gil.slices(obj)) and _plain(obj.values(), finite=True)
    return _plain(obj, finite=True)


def _copied(mapping: Mapping[Any, Any], out: M) -> M:
    """``out`` updated with ``mapping``'s items a slice at a time (as :func:`_plain`: an
    ``OrderedDict`` of 300,000 items made in one call held the GIL 100 ms)."""
    for some in gil.slices(mapping.items()):
        out.update(some)
    return out


M = TypeVar("M", bound=MutableMapping[Any, Any])
_PLAIN = frozenset({type(None), bool, int, str, float})
_BULK = 256  # values in a container before the checks of the plain paths pay (_plain)
_DICT, _STR = frozenset({dict}), frozenset({str})
_TENSOR = itemgetter("tensor")


def unflatten(tree: Any, tensor: Callable[[str], Any], where: object = None) -> Any:
    """Rebuild the state from a JSON tree; ``tensor(key)`` supplies each tensor.

    Raises:
        ManifestError: the tree is not one :func:`flatten` writes.
    """
    return _Unflatten(tensor, where).walk(tree, 0)


def leaves(tree: Any, is_leaf: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """``(key, leaf)`` for each leaf of ``tree`` (dicts, lists and tuples walked) for which
    ``is_leaf`` holds; keys dotted as :func:`flatten` makes them."""
    out: list[tuple[str, Any]] = []
    used: set[str] = set()
    todo: list[tuple[Any, Path]] = [(tree, ())]
    while todo:
        obj, path = todo.pop()
        if is_leaf(obj):
            out.append((unique_key(key_path(path), used), obj))
        elif isinstance(obj, Mapping):
            todo += [(v, (*path, k)) for k, v in reversed(list(obj.items()))]
        elif isinstance(obj, (list, tuple)):
            todo += [(v, (*path, i)) for i, v in reversed(list(enumerate(obj)))]
    return out


def under_empty(saved: Callable[[], Any], into: Any, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """The leaves of ``saved()`` (the saved state tree rebuilt with place-holder leaves; made only
    where ``into`` holds an empty dict) that lie under a dict ``into`` holds empty at the same
    place, such as a fresh optimizer's ``state`` before its first step: a strict load puts the
    saved values there, new tensors included (:func:`update`). One empty dict at two places of
    ``into`` counts at its first (it is not empty once the load filled it)."""
    if not _holds(into, lambda x: isinstance(x, Mapping) and not x, tensors=False):
        return []
    out: list[Any] = []
    seen: set[int] = set()
    todo: list[tuple[Any, Any]] = [(saved(), into)]
    while todo:
        mine, theirs = todo.pop()
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            if theirs:
                todo += [(v, theirs[k]) for k, v in reversed(list(mine.items())) if k in theirs]
            elif id(theirs) not in seen:
                seen.add(id(theirs))
                out += [leaf for _, leaf in leaves(mine, is_leaf)]
        elif isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
            todo += reversed(list(zip(mine, theirs, strict=False)))  # (a list of another length: its first places)
    return out


def update(into: Any, saved: Any, partial: bool = False, str_keys: bool = False) -> Any:
    """Every value of ``saved`` put into ``into``'s own containers (a load's ``into=`` gets every
    saved value): dicts and lists updated in place, tensors left alone (the load filled them), other
    values replaced, a tuple rebuilt (it cannot change in place), never a value that holds a tensor
    the load did not read (:data:`UNREAD`: another rank's, under a process group) where ``into``
    lacks the place; returns ``into`` (or the tuple).
    ``partial`` (a load with ``strict=False``): only where ``into`` has the place, a list or tuple
    only element by element (one of another length is left as it is; a named tuple keeps its
    type), never a value that holds a tensor the load did not read (:data:`UNREAD`), never over a
    place of ``into`` that holds tensors.

    A dict or list that ``into`` holds at two places (a fresh ``SequentialLR``'s ``_last_lr`` is its
    first scheduler's) is updated in place at the first, and replaced by an updated copy at the
    others: in place, the last place's saved values overwrote the first's (helper-40).

    ``str_keys`` (a state DCP flattened, whose dict keys it made strings): a saved key ``"2"`` goes
    to ``into``'s key ``2`` where ``into`` has no ``"2"`` (``MultiStepLR``'s milestones, a
    ``Counter`` of ints, got ``"2"`` beside ``2``: the learning rate never decayed, and the next
    save refused the duplicate, helper-77)."""
    return _update(into, saved, partial, set(), str_keys)


def _update(into: Any, saved: Any, partial: bool, done: set[int], str_keys: bool = False) -> Any:
    if saved is UNREAD or isinstance(into, torch.Tensor):
        return into
    if isinstance(into, (MutableMapping, list)) and isinstance(saved, (Mapping, list)):
        if id(into) in done:  # a second place of one container: a copy of its own
            into = copy.copy(into)
        done.add(id(into))
    if isinstance(into, MutableMapping) and isinstance(saved, Mapping):
        named = {str(k): k for k in into if type(k) is not str} if str_keys else {}
        for k, v in saved.items():
            if named and type(k) is str and k not in into:
                k = named.get(k, k)
            if k in into:
                into[k] = _update(into[k], v, partial, done, str_keys)
            elif not partial and not _holds(v, _is_unread):  # (another rank's tensors, under a process group)
                into[k] = v
        return into
    lists, tuples = isinstance(into, list) and isinstance(saved, list), isinstance(into, tuple) and isinstance(saved, tuple)
    same = (lists or tuples) and len(into) == len(saved)
    if (lists or tuples) and not same and partial:
        return into  # an optimizer's param_groups' "params" after the model changed: `into`'s own
    if lists and same:
        into[:] = [_update(a, b, partial, done, str_keys) for a, b in zip(into, saved, strict=True)]
        return into
    if tuples and same and type(into) is tuple:
        return tuple(_update(a, b, partial, done, str_keys) for a, b in zip(into, saved, strict=True))
    if tuples and same and partial and hasattr(type(into), "_make"):  # a named tuple: its own type kept
        return type(into)._make(_update(a, b, partial, done, str_keys) for a, b in zip(into, saved, strict=True))
    if partial and (_holds(saved, _is_unread) or _holds(into, _is_tensor)):
        return into  # a value the load did not read, or a place of `into` whose tensors it keeps
    return saved


class _Unread:
    def __repr__(self) -> str:
        return "UNREAD"


UNREAD: Any = _Unread()  # a saved tensor a partial load did not read, in the tree it rebuilds


def _holds(value: Any, leaf: Callable[[Any], bool], tensors: bool = True) -> bool:
    """Whether ``value`` is, or its dicts, lists and tuples hold, a ``leaf`` (without ``tensors``:
    the values of a dict that are all tensors, a model's state_dict, are not asked one by one)."""
    if leaf(value):
        return True
    if isinstance(value, Mapping):
        if not tensors and all(map(isinstance, value.values(), repeat(torch.Tensor))):
            return False
        return any(_holds(v, leaf, tensors) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, leaf, tensors) for v in value)
    return False


def _is_unread(value: Any) -> bool:
    return value is UNREAD


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
