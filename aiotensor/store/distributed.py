"""TensorStore under a process group: saves and loads delegated to torch.distributed.checkpoint with
aiotensor as its storage (:mod:`aiotensor.dcp`). Everything here blocks (collectives): the store
calls it in threads of its own, never on the loop thread and never in the scheduler's workers.

Imported only by stores opened with ``distributed=``, so plain users never import torch.distributed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
import weakref
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, MutableMapping
from typing import Any

import anyio
import anyio.lowlevel
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .. import sources
from .._io.tensors import mismatch
from .._runtime import threads
from .._runtime.scheduler import Scheduler
from ..errors import DistributedError, MismatchError, SaveCancelledError, StateError
from ..formats import tree
from .handle import SaveHandle
from .steps import Steps


class Group:
    """A store's side of a process group (``TensorStore(distributed=...)``): rank 0 is the root's
    writer; each save and load is a collective of every rank, one at a time, in call order; what
    blocks (collectives) runs in worker threads of the store's scheduler.

    The store's collectives run on a gloo group of aiotensor's over the same ranks (see
    :class:`Side`), as torch's ``async_save`` advises: a save runs in the background while the
    trainer's own collectives (FSDP's all-gathers, a DTensor's ``full_tensor()``) run on the
    user's group, and two threads issuing collectives on one group interleave them (gloo aborts
    the process: "Received data size doesn't match expected size")."""

    def __init__(self, distributed: Any, sched: Scheduler) -> None:
        """Made where the store's ``open()`` is called, before it awaits anything: its open takes
        its turn here (helper-42: taken after rank 0 had waited for the root's lock, an open paired
        with another store's save across the ranks)."""
        self.parent, self.rank, self.world = group_of(distributed)
        self.sched = sched
        self.side: Side | None = side_for(self.parent)
        self.opening = self.side.ticket()
        self._group: Any = None  # aiotensor's group, once opened
        self.saver: Saver | None = None

    @property
    def group(self) -> Any:
        assert self._group is not None, "the store opened"
        return self._group

    def ticket(self) -> int:
        """A place in the order of this process's operations on the side group: take it where the
        operation is called (before any await), and give it to :meth:`turn`, or to :meth:`passed`
        if the operation ends before its turn."""
        assert self.side is not None, "the store opened"
        return self.side.ticket()

    def passed(self, ticket: int) -> None:
        assert self.side is not None, "the store opened"
        self.side.done(ticket)

    @contextlib.asynccontextmanager
    async def turn(self, ticket: int | None = None, abandon: Callable[[], object] | None = None) -> AsyncIterator[None]:
        """The turn of ``ticket`` (taken now if None): the operations of every store of this process
        on the same ranks run one at a time, in call order, so their collectives pair up across the
        ranks and never interleave. Cancelled while waiting (asyncio's own ``Task.cancel()``, which
        no shield holds), the thread still waits for the turn, runs ``abandon()`` in it (the
        operation's vote, saying this rank cancelled it, so that every rank gives it up: skipped
        on one rank alone, the ranks went out of step, helper-42) and passes it on."""
        side = self.side
        assert side is not None, "the store opened"
        if ticket is None:
            ticket = side.ticket()

        def give_up(_: object) -> None:
            try:
                if abandon is not None:
                    with contextlib.suppress(Exception):  # (the others learn it, or their group failed)
                        abandon()
            finally:
                side.done(ticket)

        try:
            await threads.run_sync(side.wait, ticket, cleanup=give_up)
            yield
        finally:
            side.done(ticket)

    async def opened(self, problem: BaseException | None, root: str) -> None:
        """In the open's turn: join the side group (every rank of the user's takes part), then every
        rank learns whether rank 0 could open ``root`` as its writer (``problem``)."""
        assert self.side is not None
        mine = "" if problem is None else f"{type(problem).__name__}: {problem}"
        async with self.turn(self.opening):
            self._group = await anyio.to_thread.run_sync(self.side.joined)
            self.saver = Saver(self._group)
            text = await anyio.to_thread.run_sync(share_outcome, mine, self._group, f"opening {root}")
        if problem is not None:
            raise problem
        if text:
            raise DistributedError(f"rank 0 could not open {root} as its writer: {text}")

    async def save(self, h: SaveHandle, state: Any, path: str, steps: Steps, cancelled: Callable[[], bool], ticket: int) -> None:
        """Stage this rank's part, write it, and commit once every rank's file is durable (DCP plans,
        aiotensor writes, rank 0 commits; its last collective carries the outcome to every rank).
        Collectives cannot be left half-way: cancelling waits for the end on this rank; a save
        ``cancelled()`` by the time every rank has staged is abandoned by every rank (the caller
        shields it until then, so that it never skips a collective another rank waits in)."""
        what = f"saving step {h.step} in {steps.root}"
        assert self.saver is not None, "the store opened"
        with anyio.CancelScope(shield=True):
            async with self.turn(ticket):
                staged = await self.sched.run_sync(self.saver.stage, state, what, h.step, cancelled, steps.root)
                del state
                h.set_staged(0)
                token = anyio.lowlevel.current_token()
                lock, group = steps.writer_lock, self.group

                def fence() -> None:  # on every rank: one that DCP makes its coordinator (the group gone) refuses
                    live(group, f"{what}: committing it")
                    if lock is not None:
                        lock.check()

                h.nbytes = await self.sched.run_sync(self.saver.write, staged, path, what, self.sched, token, fence)
            await steps.commit(h, None)

    async def load(self, into: Any, step: int, path: str, what: str, strict: bool = True) -> None:
        """Fill ``into`` (this rank's sharded state) through DCP, which reshards (``strict=False``:
        its partial load), once every rank names the same ``step``. As :meth:`save`, cancelling
        waits for the end on this rank."""
        root = os.path.dirname(path)
        abandon = functools.partial(vote, None, step, self.group, what, "loading", "", True, root)
        with anyio.CancelScope(shield=True):
            async with self.turn(abandon=abandon):
                token = anyio.lowlevel.current_token()
                await self.sched.run_sync(load, into, step, path, self.group, what, self.sched, token, strict)

    async def retire(self, steps: Steps, step: int, doomed: Callable[[], list[int]], what: str) -> list[int]:
        """``delete``/``rollback`` (``step``: its argument) on every rank together: the ranks agree
        on ``step``, rank 0 (the root's writer) retires the ``doomed()`` steps, every rank learns
        how it went and lists the root again (a rank that did it alone renamed steps without the
        lock, or left the others' views naming deleted steps: their next save raised at once while
        rank 0 waited in its collectives). Returns the steps doomed. Cancellation: it completes."""
        abandon = functools.partial(vote, None, step, self.group, what, "deleting", "", True, steps.root)
        with anyio.CancelScope(shield=True):
            async with self.turn(abandon=abandon):
                try:
                    gone, problem = doomed(), None
                except Exception as e:
                    gone, problem = [], e
                args = (problem, step, self.group, what, "deleting", "could not delete", False, steps.root)
                abandoned(await anyio.to_thread.run_sync(vote, *args), what)
                error: Exception | None = None
                if self.rank == 0:
                    try:
                        await steps.delete(gone)
                    except Exception as e:
                        error = e
                mine = "" if error is None else f"{type(error).__name__}: {error}"
                text = await anyio.to_thread.run_sync(share_outcome, mine, self.group, what)
                if self.rank != 0:
                    await steps.scan()
                if error is not None:
                    raise error
                if text:
                    raise DistributedError(f"{what} failed on rank 0: {text}")
        return gone

    def close(self) -> None:
        """Let go of aiotensor's group: torch's registry keeps it while it lives, and
        ``destroy_process_group()`` frees it (kept here, its gloo threads ran on into the
        interpreter's exit, where a rank may abort: "terminate called without an active exception")."""
        if self.saver is not None:
            self.saver.close()
        self.saver = self._group = None


class Side:
    """aiotensor's gloo group over a set of ranks, and the turns of the operations of every store of
    this process on it: each operation takes a ticket when it is called (on the event loop's thread,
    before it awaits anything) and runs its collectives when its ticket comes up, so that the
    operations run in call order on every rank, whichever store they are of (helper-40: the
    thread that won a lock first ran first, and rank 0's save into one root paired with rank 1's
    save into another: each root committed the other's rows)."""

    def __init__(self, ranks: tuple[int, ...] = (), timeout: Any = None) -> None:
        self.ranks, self.timeout = ranks, timeout
        self._group: Callable[[], Any] = lambda: None  # a weak reference to the group :meth:`joined` made
        self._turns = threading.Condition()
        self._next = 0  # the next ticket
        self._serving = 0  # the ticket whose turn it is
        self._passed: set[int] = set()  # tickets done (or given up) before their turn

    def ticket(self) -> int:
        with self._turns:
            self._next += 1
            return self._next - 1

    def joined(self) -> Any:
        """aiotensor's gloo group over these ranks, made where there is none (or the one there was
        destroyed with ``destroy_process_group()``); blocking, a collective of the ranks: called in
        an open's turn, so that every rank makes it at the same place of its order. Held weakly: torch's
        registry keeps it alive until ``destroy_process_group()``, which frees it (see :meth:`Group.close`)."""
        group = self._group()
        if group is None or not _alive(group):
            group = dist.new_group(list(self.ranks), timeout=self.timeout, backend="gloo", use_local_synchronization=True)
            self._group = weakref.ref(group)
        return group

    def wait(self, ticket: int) -> None:
        """Block until ``ticket``'s turn."""
        with self._turns:
            self._turns.wait_for(lambda: self._serving == ticket)

    def done(self, ticket: int) -> None:
        """``ticket``'s turn is over, or it will not be taken (once, or again: a no-op)."""
        with self._turns:
            if ticket < self._serving:
                return
            self._passed.add(ticket)
            while self._serving in self._passed:
                self._passed.remove(self._serving)
                self._serving += 1
            self._turns.notify_all()


_SIDES: dict[tuple[int, ...], Side] = {}
_MAKING = threading.Lock()


def side_for(parent: Any) -> Side:
    """The :class:`Side` of ``parent``'s ranks (None: the default group's), with its timeout: one
    per set of ranks for the process's life, shared by the stores of the process (its group is
    made by the first open: :meth:`Side.joined`). Not one group per store: a group made with local
    synchronization and destroyed leaves its name free, the next one takes it and finds the old
    one's addresses in the rendezvous store (gloo: "Connect timeout"). Not blocking."""
    pg = dist.group.WORLD if parent is None else parent
    assert pg is not None, "torch.distributed is not initialized"
    ranks = tuple(dist.get_process_group_ranks(pg))
    with _MAKING:
        side = _SIDES.get(ranks)
        if side is None:
            timeout = None
            for device in ("cpu", "cuda"):
                try:
                    timeout = pg._get_backend(torch.device(device)).options._timeout
                    break
                except Exception:  # no backend for that device, or no options: (a private API) gloo's default timeout
                    continue
            _SIDES[ranks] = side = Side(ranks, timeout)
        return side


def _alive(group: Any) -> bool:
    """Is ``group`` still registered (destroy_process_group() forgets every group)?"""
    try:
        dist.get_process_group_ranks(group)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def group_of(distributed: Any) -> tuple[Any, int, int]:
    """The process group (None: the default group), this process's rank in it and its size."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "TensorStore(distributed=...) needs torch.distributed initialized first "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    group = None if distributed is True else distributed
    return group, dist.get_rank(group), dist.get_world_size(group)


def _coordinator(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def share_outcome(error: str, group: Any, what: str) -> str:
    """Every rank gets the coordinator's ``error`` text ("" when it opened fine). Plain tensors, no pickle."""
    src = _coordinator(group)
    data = torch.frombuffer(bytearray(error.encode()[:4000] or b"\0"), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    collective(lambda: dist.broadcast(size, src, group=group), what, group)
    buf = data if dist.get_rank() == src else torch.empty(int(size.item()), dtype=torch.uint8)
    collective(lambda: dist.broadcast(buf, src, group=group), what, group)
    return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")


class Saver:
    """A rank's side of distributed saves: stage, agree, write. One save at a time (the store holds a
    lock around each): the stager keeps its CPU copies between saves, as the store keeps arenas."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.opts, self.stager = self._stager()

    @staticmethod
    def _stager() -> tuple[StagingOptions, Any]:
        """DCP's stager; its copies pinned where this process uses CUDA (torch initialized it; a
        CPU-only rank on a GPU machine pins nothing, and a driver that fails would fail here)."""
        opts = StagingOptions(use_pinned_memory=torch.cuda.is_initialized(), use_shared_memory=False,  # type: ignore[no-untyped-call]
                              use_async_staging=False, use_non_blocking_copy=False)  # fmt: skip
        return opts, DefaultStager(opts)

    def stage(self, state: Any, what: str, step: int, cancelled: Callable[[], bool], root: str) -> Any:
        """A CPU copy of this rank's part of ``state`` (DCP's stager: DTensor and ShardedTensor kept
        as such). Every rank learns whether every other one could, saves the same ``step``, and
        has not ``cancelled()`` the save, before anyone starts writing: a rank that failed or
        stopped here would leave the others waiting in DCP's first collective, or pair them with
        its next save (a step folder held two steps' shards, and rank 0 said committed)."""
        if self.opts.use_pinned_memory != torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            self.stager.close()  # CUDA came into use (or a fork left it) since the last save
            self.opts, self.stager = self._stager()
        try:
            values = plain(state)
            dcp_names(values)
            staged, problem = self.stager.stage(values), None
        except Exception as e:
            staged, problem = None, e
        if spent(self.stager):
            self.opts, self.stager = self._stager()
        stopped = vote(problem, step, self.group, what, "saving", "could not stage their state", cancelled(), root)
        if dist.get_rank(self.group) in stopped:
            raise SaveCancelledError(f"the save of step {step} was cancelled; nothing was committed (on any rank)")
        if stopped:
            raise DistributedError(f"{what} was abandoned: rank{'s' * (len(stopped) > 1)} {stopped} cancelled it")
        return staged

    def write(self, staged: Any, path: str, what: str, sched: Scheduler, token: Any, fence: Callable[[], None] | None) -> int:
        """Write through :class:`~aiotensor.dcp.AiotensorWriter` on ``sched`` (the store's, on the
        event loop of ``token``; ``fence``: rank 0's writer lock checked, an object store's lease
        renewed, just before the commit point); returns this rank's bytes once rank 0 committed
        the step (DCP's last collective carries the commit's outcome to every rank)."""
        from ..dcp import AiotensorWriter

        writer = AiotensorWriter(path, latest=False, scheduler=sched, token=token, fence=fence)
        try:
            collective(lambda: dcp_save(staged, storage_writer=writer, process_group=self.group), what, self.group)
        except BaseException as e:
            if isinstance(e, DistributedError) and self.rank != 0:  # (helper-40)
                step = os.path.basename(path)
                e.add_note(f"if rank 0 stopped while committing, {step} may be committed: a store opened again lists it")
            try:  # rank 0, after every rank left write_data (or died): nothing writes there now
                writer.abort()
            except OSError as cleanup:
                e.add_note(f"clean-up could not remove the unfinished {writer.tmp} ({cleanup}); the next writer removes it")
            raise
        return writer.nbytes

    def close(self) -> None:
        self.stager.close()


def plain(state: Any, path: tuple[Any, ...] = ()) -> Any:
    """``state`` with each value as a store keeps it: a subclass of ``float``, ``int``, ``str`` or
    ``bool`` (numpy's ``float64``) made the plain one, and a numpy scalar its Python value (a store in
    one process keeps its numpy type), since DCP pickles values and every loader refuses a pickle of
    numpy's (a step committed that no resume could read: helper-31); what a
    store cannot save is refused here as in one process (:func:`aiotensor.formats.tree.flatten`).
    Tensors (DTensor), ShardedTensors and containers are kept; the containers are new ones.

    Raises:
        StateError: naming the path of a value that cannot be saved."""
    if isinstance(obj := state, (torch.Tensor, ShardedTensor)):
        return obj
    if len(path) > 64:
        raise StateError(f"state nests deeper than 64 levels at {tree.key_path(path)!r}")
    for base in (bool, int, float, str):
        if isinstance(obj, base):
            return obj if type(obj) is base else base(obj)
    if obj is None or isinstance(obj, torch.dtype):
        return obj
    if tree.numpy_node(obj) is not None:  # a numpy scalar: its Python value (DCP would pickle numpy's)
        return obj.item()
    if isinstance(obj, Mapping):
        out = {k: plain(v, (*path, k)) for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if isinstance(obj, (list, tuple)):
        items = [plain(v, (*path, i)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    tree.flatten(_at(path, obj))  # raises the store's StateError, naming the path
    raise AssertionError(f"unreachable: {type(obj)}")  # pragma: no cover


def dcp_names(state: Any) -> None:
    """Refuse a state two of whose values DCP names alike (it saves by dotted names): DCP's own
    refusal is a bare ValueError on every rank (helper-60).

    Raises:
        StateError: naming the name made twice."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    try:
        flatten_state_dict(state if isinstance(state, dict) else {"": state})
    except ValueError as e:
        if "duplicated flatten key" not in str(e):
            raise
        raise StateError(
            f"under distributed=True a state is saved by DCP's dotted names, and two of its values get one ({e}): a key "
            "holding a '.' beside a nested dict of that name, or 1 and '1' as keys of one dict; rename one (a store "
            "in one process keeps both)"
        ) from None


def _at(path: tuple[Any, ...], obj: Any) -> Any:
    """``obj`` nested under ``path`` (for a message naming it)."""
    for k in reversed(path):
        obj = {str(k): obj}
    return obj


def spent(stager: Any) -> bool:
    """Did DCP's ``DefaultStager`` close itself in its last ``stage``? torch 2.11 closes its inner
    stager at the end of every stage (pytorch/pytorch#183413), after which the next one fails with
    ``KeyError: <class 'type'>``: the second save of a distributed store did, on the first GPU run."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


def gather(values: list[int], group: Any, what: str) -> list[list[int]]:
    """Every group rank's ``values`` (small integers), known to every rank (a rank gone:
    DistributedError, as in DCP's collectives)."""
    mine = torch.tensor([int(v) for v in values], dtype=torch.int64)
    got = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    collective(lambda: dist.all_gather(got, mine, group=group), what, group)
    return [t.tolist() for t in got]


def vote(
    problem: Exception | None,
    step: int,
    group: Any,
    what: str,
    doing: str,
    failing: str,
    cancelled: bool = False,
    root: str = "",
) -> list[int]:
    """The ranks' vote before the collectives of a save, a load or a deletion, which every rank
    learns alike: whether each could do its part (``problem``: this rank's failure), the ``step``
    each names, whether each ``cancelled`` it. Returns the ranks that cancelled.

    Raises, on every rank alike: ``problem`` where this rank failed (noting the others that did),
    DistributedError where another rank did (``failing``: what it could not do), or where the ranks
    name different steps (``doing`` them): each rank must save, load and delete the same steps, in
    the same order."""
    # the store: its folder's name (a root's absolute path may differ across nodes, its name not)
    store = zlib.crc32(os.path.basename(root.rstrip("/")).encode())
    votes = gather([problem is not None, step, cancelled, _KINDS.index(doing), store], group, what)
    failed = [r for r, v in enumerate(votes) if v[0]]
    if problem is not None:
        if len(failed) > 1:
            problem.add_note(f"{what} was abandoned on every rank; ranks {failed} {failing}")
        raise problem
    if failed:
        raise DistributedError(f"{what} was abandoned: ranks {failed} {failing}")
    if len({(v[3], v[4]) for v in votes}) > 1:  # (tickets keep the order: ranks that called them in different orders)
        each = ", ".join(f"rank {r}: {_KINDS[v[3]]} step {v[1]}" for r, v in enumerate(votes))
        raise DistributedError(
            f"{what} was abandoned: the ranks are at different operations or stores ({each}; the stores are told "
            "apart by their folder's name); every rank must call the same operations of the same stores (save, "
            "load, delete) in the same order (nothing was changed)"
        )
    if len({v[1] for v in votes}) > 1:
        each = ", ".join(f"rank {r}: {v[1]}" for r, v in enumerate(votes))
        raise DistributedError(
            f"{what} was abandoned: the ranks are {doing} different steps ({each}); every rank must make the same "
            "call with the same step, in the same order (nothing was changed)"
        )
    return [r for r, v in enumerate(votes) if v[2]]


_KINDS = ("saving", "loading", "deleting")  # what a vote's ``doing`` names


def abandoned(stopped: list[int], what: str) -> None:
    """A DistributedError where ranks ``stopped`` (cancelled) the operation: every rank gives it up."""
    if stopped:
        raise DistributedError(f"{what} was abandoned: rank{'s' * (len(stopped) > 1)} {stopped} cancelled it")


def load(into: Any, step: int, path: str, group: Any, what: str, sched: Scheduler, token: Any, strict: bool = True) -> None:
    """Fill ``into`` (this rank's sharded state) from a checkpoint; DCP reshards by chunk. The
    reads run on ``sched`` (the store's, on the event loop of ``token``). ``strict=False``: DCP's
    partial load (``allow_partial_load``): a key of ``into`` the checkpoint lacks is left alone;
    DCP never reads a key ``into`` lacks (strict, a saved tensor ``into`` lacks is refused:
    :class:`_Planner`)."""
    from ..dcp import AiotensorReader

    reader = AiotensorReader(path, scheduler=sched, token=token)
    try:  # first, and agreed on: DCP would fold a bad checkpoint's error into an AssertionError of its own
        reader.read_metadata()
        problem: Exception | None = None
    except Exception as e:
        problem = e
    abandoned(
        vote(problem, step, group, what, "loading", "could not read the checkpoint's metadata", False, os.path.dirname(path)),
        what,
    )
    planner = _Planner(allow_partial_load=not strict)
    collective(lambda: dcp_load(into, storage_reader=reader, planner=planner, process_group=group), what, group)
    _own_keys(into)
    if strict:  # DCP loads only the keys `into` has: the saved values it lacks are put there, as in one process
        src = sources.step(sched.engine, path)
        assert src.state is not None
        tree.update(into, src.state(lambda name: tree.UNREAD), str_keys=True)


class _Planner(DefaultLoadPlanner):
    """DCP's load planner; strict, it also refuses the checkpoint's tensors that no rank's ``into``
    has, as a load in one process does: DCP reads only what ``into`` has, and a fresh optimizer's
    ``state_dict`` (its state empty until the first step) resumed with no moments, and no error.
    What every rank reads is known on the coordinator only (a pipeline stage's ranks load their
    own layers): the others get a DistributedError naming its MismatchError."""

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        if not self.allow_partial_load and self.metadata is not None:
            read = {item.dest_index.fqn for plan in global_plan for item in plan.items}
            extra = sorted(
                k
                for k, md in self.metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata) and md.size.numel() and k not in read
            )
            if extra:
                raise MismatchError(
                    f"`into` does not match the checkpoint: {mismatch([], extra, '`into` of any rank')}; under a process "
                    "group only the tensors `into` has are read: make an optimizer's state first (torch's "
                    "get_optimizer_state_dict), or load with strict=False"
                )
        return super().create_global_plan(global_plan)


def _own_keys(state: Any) -> None:
    """Put back under ``state``'s own keys the values DCP's load put beside them: it makes every
    dict key a string, and set a saved value (``MultiStepLR``'s milestones, a ``Counter`` of
    ints) under ``"2"`` beside ``2``: the learning rate never decayed, and the next save refused
    the duplicate (helper-77). A dict holding both (which DCP could not have saved) gets the
    string's value under the key it prints."""
    todo = [state]
    while todo:
        node = todo.pop()
        if isinstance(node, MutableMapping):
            own = {str(k): k for k in node if type(k) is not str}
            for k in [k for k in node if type(k) is str and k in own]:
                node[own[k]] = node.pop(k)
            todo += [v for v in node.values() if isinstance(v, (MutableMapping, list))]
        elif isinstance(node, list):
            todo += [v for v in node if isinstance(v, (MutableMapping, list))]


def live(group: Any, what: str) -> None:
    """A DistributedError unless torch.distributed is initialized and ``group`` still registered:
    after ``destroy_process_group()`` DCP takes itself for a single process, and each rank would
    plan, write and commit a step of its own part alone (helper-40: rank 0 committed half a
    checkpoint, `latest` named it, and it said the save succeeded)."""
    if not (dist.is_initialized() and _alive(group)):
        raise DistributedError(
            f"{what} failed: the process group was destroyed (destroy_process_group) while the store was open; nothing "
            "was committed by this rank (close the store, or await its saves, before destroying the group)"
        )


def collective(fn: Callable[[], Any], what: str, group: Any) -> None:
    """Run DCP's ``fn`` (collectives on ``group``) with its errors made ordinary: see
    :func:`unwrap`; a rank that died or hung shows up as the backend's error (at the latest after
    the group's timeout), raised as :class:`DistributedError`, as is a group destroyed before or
    meanwhile (:func:`live`)."""
    live(group, what)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's notices, once per call
            fn()
    except CheckpointException as e:
        from ..dcp import unwrap

        raise unwrap(e, what) from None
    except RuntimeError as e:  # the backend's (DistBackendError, gloo's "Connection reset by peer")
        live(group, what)
        raise DistributedError(f"{what} failed: another rank stopped answering ({str(e)[:300]})") from e
    except ValueError:  # torch.distributed's "Group ... is not registered", for a group destroyed meanwhile
        live(group, what)
        raise


__all__ = ["Group", "Saver", "gather", "group_of", "load", "share_outcome", "vote"]
