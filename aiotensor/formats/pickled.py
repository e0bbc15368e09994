"""What unpickling a pickle would hash, bounded before it runs.

Python's C unpickler hashes dict keys and set members as it puts them in, before any hook of a
restricted unpickler sees them, and the hash of a tuple recurses through its items without a
check: a torch.save file whose dict key was a tuple a million deep crashed the process (the C
stack overflowed: ``torch.load(weights_only=True)`` crashes the same way), and one whose key was a
tuple shared with itself 40 times over took 2**40 steps. :func:`check_hashing` runs a model of the
unpickler's stack and memo over the opcodes once and refuses such a pickle before it is unpickled.
"""

from __future__ import annotations

import pickle
import pickletools
import reprlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from .._runtime import gil
from ..errors import UnsafeFileError

MAX_DEPTH = 64  # tuples (and objects) nested in what is hashed; no state_dict comes near
_D = 7  # an item is an int, (cost << _D) | depth, or a _Record: depth < 2**_D
_ATOM = 1 << _D


def hash_budget(size: int) -> int:
    """The hashing steps a pickle of ``size`` bytes may take in all (as :meth:`_made` bounds what
    the admitted constructors make: four times its size, and a MiB)."""
    return 4 * size + (1 << 20)


class _Record:
    """A list, dict or set, or an object a call made (mutable: what goes in later counts): the
    cost of hashing what it holds and how deep that nests; ``shared``: the memo handed it out
    again, ``held``: a tuple holds it (a tuple's cost is counted once, as it is made). A BUILD
    may change neither kind, nor anything else go into a held one: a key it already is, or a
    tuple holding it, would then cost more than was counted. (The pickler fills every value
    before it is used anywhere; only a value that holds itself through a tuple is refused so.)"""

    __slots__ = ("cost", "depth", "held", "shared")

    def __init__(self, cost: int = 1, depth: int = 0) -> None:
        self.cost, self.depth, self.held, self.shared = cost, depth, False, False


def _cost(x: int | _Record) -> int:
    return x >> _D if type(x) is int else x.cost  # type: ignore[union-attr,operator]


def _depth(x: int | _Record) -> int:
    return x & _DEPTHS if type(x) is int else x.depth  # type: ignore[union-attr,operator]


# what each opcode's argument is: a fixed count of bytes (> 0), a length of 1, 4 or 8 bytes before
# its bytes (-1, -4, -8: the signed 4-byte lengths of BINSTRING and LONG4 included; a negative one
# is the unpickler's error, and the model stops there too), or lines up to a newline (-10, -20)
def _arg(op: pickletools.OpcodeInfo) -> int:
    a = op.arg
    if a is None:
        return 0
    if a.n == pickletools.UP_TO_NEWLINE:
        return -20 if op.name in ("GLOBAL", "INST") else -10
    return {
        pickletools.TAKEN_FROM_ARGUMENT1: -1,
        pickletools.TAKEN_FROM_ARGUMENT4: -4,
        pickletools.TAKEN_FROM_ARGUMENT4U: -4,
        pickletools.TAKEN_FROM_ARGUMENT8U: -8,
    }.get(a.n, a.n)


_ARG = {op.code.encode("latin-1")[0]: _arg(op) for op in pickletools.opcodes}
_NAME = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
# (the opcodes below that :func:`check_hashing` takes first are not named again in these)
_ATOMS = {"INT", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "UNICODE", "FLOAT", "GLOBAL", "EXT1", "EXT2", "EXT4",
          "PERSID", "NEXT_BUFFER"}  # fmt: skip
_NOTHING = {"PROTO", "READONLY_BUFFER"}
# the opcodes taken first (nine in ten of a state_dict's pickle)
_BINPUT, _LONG_BINPUT, _BINGET, _LONG_BINGET, _MEMOIZE, _MARK, _EMPTY_DICT, _EMPTY_LIST, _BUILD, _SETITEMS = map(
    ord, (pickle.BINPUT, pickle.LONG_BINPUT, pickle.BINGET, pickle.LONG_BINGET, pickle.MEMOIZE, pickle.MARK,
          pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.BUILD, pickle.SETITEMS)
)  # fmt: skip
_TUPLE1, _TUPLE2, _EMPTY_TUPLE, _TUPLE, _REDUCE, _NEWOBJ, _APPEND, _BINPERSID, _POP = map(
    ord, (pickle.TUPLE1, pickle.TUPLE2, pickle.EMPTY_TUPLE, pickle.TUPLE, pickle.REDUCE, pickle.NEWOBJ, pickle.APPEND,
          pickle.BINPERSID, pickle.POP)
)  # fmt: skip


def _table(sizes: dict[str, int]) -> bytes:
    """A byte per opcode: ``sizes[its name]`` + 1, 0 for the others (one lookup takes them all)."""
    out = bytearray(256)
    for name, k in sizes.items():
        out[ord(getattr(pickle, name))] = k + 1
    return bytes(out)


# atoms of a fixed argument (its bytes), and of an argument of its length's bytes before it
_FIXED = _table({"BININT1": 1, "BININT2": 2, "BININT": 4, "BINFLOAT": 8, "NEWFALSE": 0, "NEWTRUE": 0, "NONE": 0})
_SIZED = _table({"SHORT_BINUNICODE": 1, "BINUNICODE": 4, "BINUNICODE8": 8, "SHORT_BINBYTES": 1, "BINBYTES": 4,
                 "BINBYTES8": 8, "BYTEARRAY8": 8, "SHORT_BINSTRING": 1})  # fmt: skip
_DEPTHS = _ATOM - 1


@gil.quiet_gc  # (a record per list, dict and object: no collection walks them meanwhile)
def check_hashing(data: bytes, path: object, what: str = "the pickle") -> None:
    """Refuse ``data`` (:class:`UnsafeFileError`) where unpickling it would hash a tuple nested
    more than :data:`MAX_DEPTH` deep, or take more than :func:`hash_budget` steps hashing in all.

    The model: each item on the stack or in the memo knows what hashing it costs (a tuple the
    count of its items, nested ones counted each time they appear, so a shared one counts as
    often as it is shared; a long int its bytes; a list, dict, set or object made by a call what
    went into it) and how deep tuples and objects nest in it. Charged: dict keys (SETITEM,
    SETITEMS, DICT), set members (ADDITEMS, FROZENSET), a BUILD's state (its keys go into
    ``__dict__``), and whatever is handed to Python code, which may hash it (a call's arguments, a
    persistent id; an Enum's constructor looks its value up). A constructor that hashes what it
    is given (``collections.Counter``, ``OrderedDict``) checks the objects themselves too
    (:func:`checked`). The model follows the opcodes as the C unpickler reads them: a pickle it
    cannot follow (an unknown opcode, a short argument, a stack underflow, a memo key never put, an
    opcode across the end of its frame, a frame inside a frame, which the C reader would take
    otherwise than the model: helper-48) is refused as malformed.
    """
    budget = hash_budget(len(data))
    cap = budget + 1
    spent = 0
    stack: list[Any] = []
    marks: list[int] = []
    memo: list[Any] = []  # the memo's keys 0, 1, 2..., as every pickler makes them (8 bytes an entry)
    kids: list[Any]
    i, n = 0, len(data)
    frame_end = -1  # where the frame being read ends (-1: none)

    def refuse(why: str) -> UnsafeFileError:
        return UnsafeFileError(f"{what} {why}: refused before it was unpickled", path)

    def tuple_of(kids: list[Any]) -> int:
        cost, depth = _added(kids, 1, 0, hold=True)
        depth += 1
        if depth > MAX_DEPTH:
            raise refuse(f"nests tuples more than {MAX_DEPTH} deep (hashing one overflows the C stack)")
        return (min(cost, cap) << _D) | depth

    def charge(items: Any) -> None:
        nonlocal spent
        for x in items:
            spent += x >> _D if type(x) is int else x.cost
        if spent > budget:
            raise refuse(f"hashes more than {budget} items (a key shared with itself over and over)")

    def put_in(kids: list[Any]) -> None:
        """Add ``kids`` to the record below them."""
        if len(stack) <= (marks[-1] if marks else 0):
            raise _Lost("nothing to add to")
        into = stack[-1]
        if type(into) is _Record:
            if into.held:
                raise refuse("changes a value a tuple already holds")
            cost, depth = _added(kids, into.cost, into.depth)
            into.cost, into.depth = min(cost, cap), depth

    def put(key: int, x: Any) -> None:
        if key < len(memo):
            memo[key] = x
        elif key == len(memo):
            memo.append(x)
        else:  # the C unpickler makes room for it: 16 bytes a key (a 12-byte pickle took 2.3 GB: helper-53)
            raise _Lost("a memo key past the entries made so far")

    def to_mark() -> list[Any]:
        if not marks:
            raise _Lost("no mark")
        m = marks.pop()
        kids = stack[m:]
        del stack[m:]
        return kids

    def above(k: int) -> None:
        if len(stack) - (marks[-1] if marks else 0) < k:
            raise _Lost("a stack underflow")

    def call(args: int) -> _Record:
        """What a call (REDUCE, NEWOBJ, OBJ...) of ``args`` (a tuple item) made: its code may hash
        them (charged), and hashing what it made may hash them again."""
        nonlocal spent
        cost = args >> _D
        spent += cost
        if spent > budget:
            raise refuse(f"hashes more than {budget} items (a key shared with itself over and over)")
        if args & _DEPTHS > MAX_DEPTH:
            raise refuse(f"nests objects more than {MAX_DEPTH} deep")
        return _Record(1 + cost, args & _DEPTHS)

    try:
        while True:
            if i >= frame_end >= 0:
                if i > frame_end:  # the C reader takes the bytes after the frame there: the model cannot follow
                    raise _Lost("an opcode across the end of its frame")
                frame_end = -1
            if i >= n:
                raise _Lost("no STOP")
            op = data[i]
            i += 1
            # the opcodes of a state_dict's pickle, nine in ten of them, first (0.2-0.3 us an opcode in all)
            if op == _MEMOIZE or op == _BINPUT or op == _LONG_BINPUT:
                if not stack:
                    raise _Lost("a PUT of nothing")
                if op == _MEMOIZE:
                    memo.append(stack[-1])
                    continue
                if op == _BINPUT:
                    key = data[i]
                    i += 1
                else:
                    key = int.from_bytes(data[i : i + 4], "little")
                    i += 4
                if key < len(memo):
                    memo[key] = stack[-1]
                else:
                    put(key, stack[-1])
                continue
            if op == _BINGET or op == _LONG_BINGET:
                if op == _BINGET:
                    key = data[i]
                    i += 1
                else:
                    key = int.from_bytes(data[i : i + 4], "little")
                    i += 4
                if key >= len(memo):
                    raise _Lost("a GET of what was never PUT")
                got = memo[key]
                if type(got) is _Record:
                    got.shared = True
                stack.append(got)
                continue
            k = _FIXED[op]
            if k:
                i += k - 1
                stack.append(_ATOM)
                continue
            if op == _MARK:
                marks.append(len(stack))
                continue
            if op == _TUPLE1 or op == _EMPTY_TUPLE:
                if op == _EMPTY_TUPLE:
                    stack.append(_ATOM | 1)
                    continue
                x = stack[-1] if len(stack) > (marks[-1] if marks else 0) else None
                if type(x) is int and x & _DEPTHS < MAX_DEPTH and x >> _D < cap:  # one item: a count and a level more
                    stack[-1] = x + _ATOM + 1
                    continue
            if (op == _NEWOBJ or op == _REDUCE) and len(stack) - (marks[-1] if marks else 0) >= 2:
                x = stack.pop()
                stack[-1] = call(x if type(x) is int else tuple_of([x]))
                continue
            if op == _BUILD:
                above(2)
                state = stack.pop()  # a dict, or (a dict, slots): its keys go into the object's __dict__
                charge((state,))
                target = stack[-1]
                if type(target) is _Record:
                    if target.shared or target.held:
                        raise refuse("BUILDs an object it already handed out")
                    target.cost = min(target.cost + _cost(state), cap)
                    target.depth = max(target.depth, 1 + _depth(state))
                    if target.depth > MAX_DEPTH:
                        raise refuse(f"nests objects more than {MAX_DEPTH} deep")
                continue
            if op == _EMPTY_DICT or op == _EMPTY_LIST:
                stack.append(_Record())
                continue
            if op == _SETITEMS:
                kids = to_mark()
                charge(kids[::2])
                put_in(kids)
                continue
            k = _SIZED[op]
            if k:
                k -= 1
                i += k + int.from_bytes(data[i : i + k], "little")
                stack.append(_ATOM)
                continue
            if op == _TUPLE2 and len(stack) - (marks[-1] if marks else 0) >= 2:
                kids = stack[-2:]
                del stack[-2:]
                stack.append(tuple_of(kids))
                continue
            if op == _TUPLE and marks:
                m = marks.pop()
                kids = stack[m:]
                del stack[m:]
                stack.append(tuple_of(kids))
                continue
            if op == _APPEND:
                above(2)
                put_in([stack.pop()])
                continue
            if op == _BINPERSID:
                above(1)
                charge(stack[-1:])  # (a persistent id goes to Python code)
                stack[-1] = _ATOM
                continue
            if op == _POP and len(stack) > (marks[-1] if marks else 0):
                stack.pop()
                continue
            arg = _ARG.get(op)
            if arg is None:
                raise _Lost(f"an unknown opcode {op:#04x}")
            name = _NAME[op]
            size = 0  # an argument's bytes
            if arg > 0:
                size = arg
                value = int.from_bytes(data[i : i + arg], "little")
                i += arg
            elif arg in (-1, -4, -8):
                k = -arg
                size = int.from_bytes(data[i : i + k], "little", signed=k == 4 and name in ("BINSTRING", "LONG4"))
                if size < 0:
                    raise _Lost("a negative length")
                i += k + size
            elif arg < 0:
                end = i
                for _ in range(arg // -10):
                    end = data.find(b"\n", end) + 1
                    if end == 0:
                        raise _Lost("a line without its end")
                size, line, i = end - i, data[i : end - 1], end
            if i > n:
                raise _Lost("an argument cut short")
            if name == "GET":  # (its text form)
                key = _int(line)
                if key >= len(memo):
                    raise _Lost("a GET of what was never PUT")
                got = memo[key]
                if type(got) is _Record:
                    got.shared = True
                stack.append(got)
            elif name == "PUT":
                if not stack:
                    raise _Lost("a PUT of nothing")
                put(_int(line), stack[-1])
            elif name in _ATOMS:
                stack.append(min(1 + size, cap) << _D if name in ("LONG", "LONG1", "LONG4") else _ATOM)
            elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
                k = ord(name[-1]) - ord("0")
                above(k)
                kids = stack[-k:]
                del stack[-k:]
                stack.append(tuple_of(kids))
            elif name in ("TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"):
                kids = to_mark()
                if name == "TUPLE":
                    stack.append(tuple_of(kids))
                elif name in ("DICT", "FROZENSET", "LIST"):
                    if name != "LIST":
                        charge(kids[::2] if name == "DICT" else kids)
                    cost, depth = _added(kids, 1, 0)
                    stack.append(_Record(min(cost, cap), depth))
                else:
                    stack.append(call(tuple_of(kids[1:] if name == "OBJ" else kids)))
            elif name == "EMPTY_SET":
                stack.append(_Record())
            elif name == "SETITEM":
                above(3)
                kids = stack[-2:]
                del stack[-2:]
                charge(kids[:1])
                put_in(kids)
            elif name in ("APPENDS", "ADDITEMS"):
                kids = to_mark()
                if name == "ADDITEMS":
                    charge(kids)
                put_in(kids)
            elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
                k = 3 if name == "NEWOBJ_EX" else 2
                above(k)
                args = stack[-k + 1 :]
                del stack[-k:]
                stack.append(call(tuple_of(args)))
            elif name == "STACK_GLOBAL":
                above(2)
                charge(stack[-2:])
                del stack[-2:]
                stack.append(_ATOM)
            elif name in ("POP", "POP_MARK"):  # (a POP of the stack at its mark takes the mark)
                to_mark()
            elif name == "DUP":
                above(1)
                if type(stack[-1]) is _Record:
                    stack[-1].shared = True
                stack.append(stack[-1])
            elif name == "FRAME":
                if frame_end >= 0:
                    raise _Lost("a frame inside a frame")
                frame_end = i + value
            elif name == "STOP":
                return
            elif name not in _NOTHING:
                raise _Lost(f"the opcode {name}")  # (every opcode is named above)
    except (_Lost, IndexError) as e:
        why = str(e) if isinstance(e, _Lost) else "an argument cut short"
        raise refuse(f"is malformed where its opcodes cannot be followed ({why}, at byte {i})") from None


def _added(kids: list[Any], cost: int, depth: int, hold: bool = False) -> tuple[int, int]:
    """``cost`` with what hashing ``kids`` costs added, and the deepest of ``depth`` and theirs
    (``hold``: a tuple takes them in; a loop: ``map(_cost, ...)`` took twice as long)."""
    for k in kids:
        if type(k) is int:
            cost += k >> _D
            d = k & _DEPTHS
        else:
            cost += k.cost
            d = k.depth
            if hold:
                k.held = True
        if d > depth:
            depth = d
    return cost, depth


class _Lost(Exception):
    """Where the model cannot follow the pickle as the C unpickler reads it."""


def _int(line: bytes) -> int:
    """A GET's or PUT's text argument as the C unpickler reads it (to its first NUL: helper-48)."""
    try:
        key = int(line.split(b"\0", 1)[0])
    except ValueError:
        raise _Lost("a GET or PUT of no number") from None
    if key < 0:  # (the C unpickler's error)
        raise _Lost("a GET or PUT of a negative key")
    return key


def key_cost(x: Any, most: int) -> int:
    """The steps hashing ``x`` takes (a tuple's items counted each time they appear, nested), for
    a constructor that hashes what the unpickler gave it: a plain value (None, bool, int, float,
    str, bytes) or a tuple of them; anything else (a ``torch.Size`` hashes all its items, an
    object's ``__hash__`` what it likes: helper-48), more than ``most`` steps, or tuples nested
    more than :data:`MAX_DEPTH` deep: :class:`UnsafeFileError`."""
    steps = 0
    todo = [(x, 0)]
    while todo:
        v, depth = todo.pop()
        steps += 1
        if steps > most:
            raise UnsafeFileError(f"hashing the pickle's keys takes more than {most} steps: refused")
        kind = type(v)
        if kind is tuple:
            if depth >= MAX_DEPTH:
                raise UnsafeFileError(f"a key nests tuples more than {MAX_DEPTH} deep: refused")
            todo.extend((item, depth + 1) for item in v)
        elif kind is int:
            steps += v.bit_length() >> 6
        elif v is not None and kind not in (bool, float, str, bytes):
            raise UnsafeFileError(f"a key of a counter or an ordered dict is a {kind.__name__}: only plain values are admitted")
    return steps


def checked(cls: type, left: list[int]) -> Callable[..., Any]:
    """``cls`` (``collections.Counter`` or ``OrderedDict``, which hash what they are made of) as an
    unpickler's call of it makes it: of nothing, a dict, or a list or tuple (of pairs, each a list
    or tuple of two, for an ``OrderedDict``), the keys it would hash checked first
    (:func:`key_cost`) against ``left[0]`` steps, which each call spends."""

    def make(*args: Any) -> Any:
        if args:
            given = args[0]
            if len(args) > 1 or not isinstance(given, (dict, list, tuple)):
                raise UnsafeFileError(f"{cls.__name__} of other than a dict, a list or a tuple: refused")
            pairs = cls is not Counter and not isinstance(given, dict)
            for k in given:
                if pairs:
                    if not (isinstance(k, (list, tuple)) and len(k) == 2):
                        raise UnsafeFileError(f"{cls.__name__} of a {type(k).__name__} where a pair goes: refused")
                    k = k[0]
                left[0] -= key_cost(k, left[0])
        return cls(*args)

    make.__name__ = cls.__name__
    return make


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxtuple, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxstring, _BRIEF.maxother = 3, 4, 4, 4, 60, 60


def brief(x: Any) -> str:
    """``repr(x)`` within bounds, for a message about a value a pickle made (the repr of a tuple
    shared with itself 40 times over never ends: helper-48)."""
    return _BRIEF.repr(x)
