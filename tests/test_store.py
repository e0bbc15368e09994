"""TensorStore on every engine, on asyncio and uvloop."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import threading
from typing import Any

import anyio
import crc32c
import pytest
import torch
from safetensors import safe_open

import aiotensor
from aiotensor import TensorStore
from aiotensor.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumError,
    HeaderError,
    ManifestError,
    MismatchError,
    SaveCancelledError,
    SaveFailedError,
    StaleStepError,
    StateError,
    StoreClosedError,
    StoreLockedError,
)
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal, manifest_rows, small_state, tmp_leftovers

pytestmark = pytest.mark.anyio

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype (NaN patterns included)."""
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def every_kind_of_tensor() -> dict[str, Any]:
    state: dict[str, Any] = {str(d).removeprefix("torch."): random_tensor(d, (3, 5), i) for i, d in enumerate(DTYPES)}
    big = random_tensor(torch.float32, (40, 30), 99)
    state.update(
        {
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 4, dtype=torch.bfloat16),
            "transposed": big.t(),
            "strided": big[::3, 1::2],
            "slice": big[5:9],
            "base": big,
            "tied_a": big,
            "conj": torch.randn(3, dtype=torch.complex64).conj(),
        }
    )
    return state


async def test_round_trip_every_dtype_and_layout(tmp_path: Any, engine: aiotensor.Engine) -> None:
    state = every_kind_of_tensor()
    async with TensorStore(tmp_path, engine=engine, chunk_bytes=4096) as store:
        await store.save(1, state)
        out = await store.load(1)
    assert_state_equal(state, out)
    assert out["tied_a"] is out["base"], "tied weights come back as one tensor"
    assert out["slice"].data_ptr() != out["base"].data_ptr(), "partly overlapping views come back unshared"


async def test_a_relative_root_stays_where_it_was_when_the_working_folder_changes(tmp_path: Any, monkeypatch: Any) -> None:
    """helper-39: a store of a relative root followed a later os.chdir: a reader's refresh() served
    another run's checkpoint of the same relative name, a writer's save blamed a moved lock."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")
    async with TensorStore("ck") as s:
        await s.save(5, {"other_run": torch.zeros(2)})
    monkeypatch.chdir(tmp_path / "a")
    async with TensorStore("ck") as w, TensorStore("ck", readonly=True) as r:
        await w.save(10, {"w": torch.ones(2)})
        await r.refresh()
        assert w.root == r.root == str(tmp_path / "a" / "ck")
        monkeypatch.chdir(tmp_path / "b")
        await w.save(11, {"w": torch.full((2,), 2.0)})
        await r.refresh()
        assert r.steps() == [10, 11] and torch.equal((await r.load())["w"], torch.full((2,), 2.0))
    # made absolute as the system finds it (helper-41): link/../ck is beside the link's target
    (tmp_path / "real" / "deep").mkdir(parents=True)
    os.symlink(tmp_path / "real" / "deep", tmp_path / "a" / "link")
    monkeypatch.chdir(tmp_path / "a")
    async with TensorStore("link/../ck2") as s:
        await s.save(1, {"w": torch.ones(1)})
    assert (tmp_path / "real" / "ck2" / "latest").exists() and not (tmp_path / "a" / "ck2").exists()
    with pytest.raises(ValueError, match="TensorStore root is empty"):  # an unset variable: not the working folder
        TensorStore(os.environ.get("AIOTENSOR_NO_SUCH_VARIABLE", ""))


async def test_load_into_a_fresh_sequential_lr_restores_its_last_lr(tmp_path: Any) -> None:
    """helper-40: a fresh SequentialLR's state_dict holds one list at two places (its _last_lr is
    its first scheduler's); load(into=) filled it in place twice, the last place's values won,
    and get_last_lr() after the resume was the warm-up's, not the step's."""

    def make() -> tuple[Any, Any]:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=3e-3)
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)
        return opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])

    opt, sched = make()
    for _ in range(4):
        opt.step()
        sched.step()
    async with TensorStore(tmp_path) as store:
        await store.save(4, {"sched": sched.state_dict()})
        _, fresh = make()
        into = {"sched": fresh.state_dict()}
        assert into["sched"]["_last_lr"] is into["sched"]["_schedulers"][0]["_last_lr"]  # the shared list
        await store.load(into=into)
    fresh.load_state_dict(into["sched"])
    assert fresh.get_last_lr() == sched.get_last_lr() and fresh.state_dict() == sched.state_dict()


async def test_nested_optimizer_state_round_trips_exactly(tmp_path: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "extra": [None, True, "s", (1.5, float("nan"))]}
    async with TensorStore(tmp_path) as store:
        await store.save(7, state)
        out = await store.load()
    assert_state_equal(state, out)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(out["optim"])  # optimizer accepts what comes back (int keys, tuples)
    model.load_state_dict(out["model"])


async def test_shards_open_with_safetensors_and_manifest_has_crcs(tmp_path: Any) -> None:
    state = {"a": torch.randn(100, 10), "b": torch.arange(50), "c": torch.ones(3, dtype=torch.bfloat16)}
    async with TensorStore(tmp_path, shard_bytes=4000) as store:
        await store.save(3, state)
    folder = tmp_path / "step-000000000003"
    manifest = json.loads((folder / "manifest.json").read_text())
    rows = manifest_rows(manifest)
    assert {t["shard"] for t in rows.values()} == {s["file"] for s in manifest["shards"]}
    assert len(manifest["shards"]) == 2
    for t in rows.values():  # each tensor's crc32c, of its bytes in its shard
        data = (folder / t["shard"]).read_bytes()[t["offset"] : t["offset"] + t["nbytes"]]
        assert t["crc32c"] == crc32c.crc32c(data) and len(data) == t["nbytes"] > 0
    seen = {}
    for s in manifest["shards"]:
        with safe_open(str(folder / s["file"]), "pt") as f:
            seen.update({k: f.get_tensor(k) for k in f.keys()})
    assert_state_equal(state, seen)
    assert (tmp_path / "latest").read_text().strip() == "step-000000000003"


async def test_load_into_reads_in_place_and_checks_shapes(tmp_path: Any, engine: aiotensor.Engine) -> None:
    state = every_kind_of_tensor()
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    into["tied_a"] = into["base"]
    into["transposed"] = torch.zeros(40, 30).t()  # a non-contiguous target: goes through bounce slots
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    async with TensorStore(tmp_path, engine=engine, chunk_bytes=4096) as store:
        await store.save(1, state)
        out = await store.load(into=into)
        assert all(out[k].data_ptr() == ptrs[k] for k in into)
        assert_state_equal(state, into)

        bad = dict(into, float32=torch.zeros(5, 3))
        with pytest.raises(MismatchError, match=r"'float32'.*\[3, 5\].*\[5, 3\]"):
            await store.load(into=bad)
        with pytest.raises(MismatchError, match=r"unexpected keys \['base'\] \(not in `into`\)"):
            await store.load(into={k: v for k, v in into.items() if k != "base"})
        with pytest.raises(MismatchError, match=r"missing keys \['zzz'\] \(only in `into`\)"):
            await store.load(into={**into, "zzz": torch.ones(1)})


async def test_staged_means_tensors_may_change(tmp_path: Any) -> None:
    state = {f"p{i}": torch.full((256, 256), float(i)) for i in range(20)}
    expected = {k: v.clone() for k, v in state.items()}
    async with TensorStore(tmp_path, chunk_bytes=1 << 16) as store:
        handle = store.save(1, state)
        await handle.staged
        for v in state.values():
            v.add_(1000)  # the trainer's optimizer step, while the write runs
        await handle
        assert_state_equal(expected, await store.load(1))


async def test_errors_are_typed_and_named(tmp_path: Any) -> None:
    store = TensorStore(tmp_path)
    with pytest.raises(StoreClosedError):
        store.save(1, {})
    async with store:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint in"):
            await store.load()
        with pytest.raises(StateError, match=r"'opt.sched'"):
            await store.save(1, {"opt": {"sched": object()}})
        h = store.save(1, {"opt": {"sched": object()}})
        with pytest.raises(StateError, match=r"'opt.sched'"):  # as docs/store.md says (it returned: helper-31)
            await h.staged
        with pytest.raises(StateError):
            await h
        with pytest.raises(ValueError, match="step must be"):
            store.save(-1, {})
        with pytest.raises(StateError, match="cannot be named '__metadata__'"):  # a shard header's own member
            await store.save(1, {"__metadata__": torch.ones(2)})
        await store.save(1, {"x": torch.ones(2)})
        with pytest.raises(CheckpointExistsError, match="step 1 is already committed"):
            store.save(1, {})
        with pytest.raises(CheckpointNotFoundError, match="step 2"):
            await store.load(2)
        assert tmp_leftovers(str(tmp_path)) == []
    with pytest.raises(ValueError, match="keep_last"):
        TensorStore(tmp_path, keep_last=0)


async def test_a_step_whose_folder_is_taken_by_a_damaged_one_is_refused_at_once(tmp_path: Any) -> None:
    """A trainer resumed from step 1 because step 2's manifest was damaged (load() skips it) then
    saved step 2 again: all the work was done, and the final rename failed with a raw OSError
    (ENOTEMPTY). The damaged folder is never deleted (its shards may be worth keeping): the save is
    refused before anything is written, and one made while a save runs is refused at its commit."""
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"x": torch.ones(2)})
        await store.save(2, {"x": torch.ones(2) * 2})
    manifest = tmp_path / "step-000000000002" / "manifest.json"
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 1
    manifest.write_bytes(bytes(raw))
    async with TensorStore(tmp_path) as store:
        assert store.steps() == [1]
        with pytest.raises(CheckpointExistsError, match="step-000000000002 exists but is not a committed checkpoint"):
            await store.save(2, {"x": torch.zeros(2)})
        assert manifest.read_bytes() == bytes(raw) and not tmp_leftovers(str(tmp_path))

    def meanwhile(op: tuple[Any, ...]) -> None:  # a folder of that name, made while step 3 is saved, not empty
        if op[0] == "rename" and str(op[2]).endswith("step-000000000003"):
            (tmp_path / "step-000000000003").mkdir()
            (tmp_path / "step-000000000003" / "notes.txt").write_text("mine")

    async with TensorStore(tmp_path, engine=FaultyEngine(hook=meanwhile)) as store:
        with pytest.raises(CheckpointExistsError, match="appeared meanwhile"):
            await store.save(3, {"x": torch.zeros(4)})
        assert os.listdir(tmp_path / "step-000000000003") == ["notes.txt"] and not tmp_leftovers(str(tmp_path))
        await store.save(4, {"x": torch.ones(3)})
        assert store.steps() == [1, 4]


async def test_a_committed_step_missing_a_file_or_a_meta_into_say_so(tmp_path: Any) -> None:
    """A shard deleted from a committed step was a bare FileNotFoundError naming the file; a meta
    tensor in ``into`` was a StateError about saving ("this store handles cpu tensors")."""
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(4), "step": 1})
        with torch.device("meta"):
            meta = torch.nn.Linear(2, 2).weight
        with pytest.raises(MismatchError, match="is on the meta device"):
            await store.load(1, into={"w": meta, "step": 0})
        with pytest.raises(MismatchError) as e:
            await store.load(1, into={"w": torch.ones(4), "v": torch.ones(1), "step": 0})
        assert "unexpected" not in str(e.value)  # no empty list of keys
        os.remove(tmp_path / "step-000000000001" / "shard-00000.safetensors")
        with pytest.raises(
            FileNotFoundError, match="step 1 in .*step-000000000001 is damaged, a file it lists is not there"
        ) as got:
            await store.load(1)
        assert not isinstance(got.value, CheckpointNotFoundError)


async def test_corruption_is_detected_and_named(tmp_path: Any) -> None:
    state = {"a": torch.randn(1000), "b": torch.randn(2000)}
    async with TensorStore(tmp_path) as store:
        await store.save(1, state)
        shard = tmp_path / "step-000000000001" / "shard-00000.safetensors"
        data = bytearray(shard.read_bytes())
        m = json.loads((tmp_path / "step-000000000001" / "manifest.json").read_text())
        off = manifest_rows(m)["b"]["offset"] + 100
        data[off] ^= 0x10
        shard.write_bytes(bytes(data))
        with pytest.raises(ChecksumError, match=r"shard-00000.safetensors: tensor 'b' is corrupt") as ei:
            await store.load(1)
        assert ei.value.key == "b"
        await store.load(1, verify=False)  # opt-out reads the (wrong) bytes
        shard.write_bytes(bytes(data[:5000]))
        with pytest.raises(HeaderError, match="shard-00000.safetensors"):
            await store.load(1)
        (tmp_path / "step-000000000001" / "manifest.json").write_text("{}")
        with pytest.raises(ManifestError, match="manifest.json: the manifest does not end with its checksum"):
            await store.load(1)


async def test_retention_and_latest(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, keep_last=2) as store:
        for step in (10, 20, 30):
            await store.save(step, {"x": torch.full((4,), float(step))})
        assert store.steps() == [20, 30] and store.latest() == 30
        # retired steps are renamed away at once; their files go in the background
        assert sorted(n for n in os.listdir(tmp_path) if ".tmp-del" not in n) == [
            ".aiotensor.lock",
            "latest",
            "step-000000000020",
            "step-000000000030",
        ]
        # an older step than a committed one is refused (helper-44: a resume from an earlier step
        # without rollback: `latest` still named the abandoned branch's newest, and keep_last
        # retired the new branch's steps as they came); an older one committed after a newer one
        # (both in flight) does not move `latest` back
        with pytest.raises(StaleStepError, match=r"older than 1 committed step\(s\).*would still name step 30.*rollback\(24\)"):
            store.save(25, {"x": torch.zeros(4)})
        h35 = store.save(35, {"x": torch.full((4,), 35.0)})
        h32 = store.save(32, {"x": torch.full((4,), 32.0)}, background=True)
        await h32
        await h35
        assert (tmp_path / "latest").read_text().strip() == "step-000000000035"
        assert store.steps() == [32, 35]
    assert sorted(os.listdir(tmp_path)) == [
        ".aiotensor.lock",
        "latest",
        "step-000000000032",
        "step-000000000035",
    ]  # close() waited
    async with TensorStore(tmp_path) as again:
        assert again.steps() == [32, 35]
        assert float((await again.load())["x"][0]) == 35.0


async def test_open_removes_leftovers_of_interrupted_saves_and_nothing_else(tmp_path: Any) -> None:
    (tmp_path / "step-000000000005.tmp-0123abcd").mkdir()
    (tmp_path / "step-000000000005.tmp-0123abcd" / "manifest.json").write_text("{}")
    (tmp_path / "step-000000000004.tmp-del89abcdef").mkdir()
    (tmp_path / "latest.tmp-deadbeef").write_text("junk")
    (tmp_path / "notes.tmp-backup").write_text("a user's file")  # not a name aiotensor makes
    (tmp_path / "step-000000000006.tmp-mine").mkdir()
    async with TensorStore(tmp_path) as store:
        assert store.steps() == []
        assert "step-000000000006.tmp-mine" in store.ignored
    assert sorted(os.listdir(tmp_path)) == [".aiotensor.lock", "notes.tmp-backup", "step-000000000006.tmp-mine"]


class _StepStays(FaultyEngine):
    """A root whose step 1 cannot be renamed away (a folder of an overlay's lower layer: EXDEV),
    or fails to be once (``once``: EIO, a passing failure)."""

    def __init__(self, once: bool = False) -> None:
        super().__init__()
        self.stays, self.once = not once, once

    def rename(self, src: str, dst: str) -> None:
        if os.path.basename(src) == "step-000000000001" and (self.stays or self.once):
            self.once = False
            raise OSError(errno.EIO if not self.stays else errno.EXDEV, "injected", src)
        super().rename(src, dst)


async def test_a_step_that_cannot_be_retired_stops_no_other(tmp_path: Any) -> None:
    """helper-46: on an overlay whose lower layer held step 1 (a checkpoint in a container image),
    retiring it failed with EXDEV at every save, and retention stopped there: no later step was
    retired and the root grew without bound. It is left (said once, the cause named), the others
    retired as keep_last says; a delete of it names the cause; reopened, the store tries again."""
    async with TensorStore(tmp_path, engine=_StepStays(), keep_last=2) as store:
        said = []
        for step in range(1, 7):
            h = store.save(step, small_state(step))
            await h
            said += h.warnings
        assert store.steps() == [1, 5, 6]
        assert len(said) == 1 and "step 1" in said[0] and "overlay" in said[0], said
        with pytest.raises(OSError, match="overlay's lower layer"):
            await store.delete(1)
        assert store.steps() == [1, 5, 6]
        with pytest.raises(OSError, match="overlay's lower layer"):
            await store.rollback(0)  # 6 and 5 go, 1 stays: `latest` names it (it named nothing: helper-48)
        assert store.steps() == [1] and (tmp_path / "latest").read_text().strip() == "step-000000000001"
        for step in (5, 6):
            await store.save(step, small_state(step))
        assert_state_equal(await store.load(1), small_state(1))
    eng = _StepStays()
    async with TensorStore(tmp_path, engine=eng, keep_last=2) as store:
        h = store.save(7, small_state(7))
        await h
        assert store.steps() == [1, 6, 7] and len(h.warnings) == 1
        eng.stays = False  # (the overlay gone): step 1 deleted, the run saved again from step 1
        for step in store.steps():
            await store.delete(step)
        for step in range(1, 5):
            await store.save(step, small_state(step))
        assert store.steps() == [3, 4]  # the new step 1 is retired (helper-48: it stayed, for good)


async def test_a_step_whose_retiring_failed_once_is_retired_after_the_next_commit(tmp_path: Any) -> None:
    """helper-48: an EIO (or an object store's 503) made a step stay for the store's life."""
    async with TensorStore(tmp_path, engine=_StepStays(once=True), keep_last=2) as store:
        said = []
        for step in range(1, 6):
            h = store.save(step, small_state(step))
            await h
            said += h.warnings
        assert store.steps() == [4, 5]
        assert len(said) == 1 and "tried again after the next commit" in said[0], said


async def test_a_file_system_without_flock_is_named(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """helper-46: where flock is not supported (Lustre without -o flock) open() raised a bare
    ENOSYS/ENOLCK; it names the lock and the way out."""
    from aiotensor import root

    def no_flock(fd: int, how: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(root.fcntl, "flock", no_flock)
    with pytest.raises(OSError, match="does not support flock") as ei:
        async with TensorStore(tmp_path):
            pass
    assert ei.value.errno == errno.ENOLCK
    async with TensorStore(tmp_path, readonly=True) as store:
        assert store.steps() == []


async def test_commit_order(tmp_path: Any) -> None:
    eng = FaultyEngine()
    async with TensorStore(tmp_path, engine=eng, keep_last=1) as store:
        await store.save(1, small_state(1))
        eng.ops.clear()
        await store.save(2, small_state(2))
    names = [(op[0], os.path.basename(str(op[1]))) for op in eng.ops if op[0] not in ("pwrite", "pread", "open_read")]
    i = {v: k for k, v in enumerate(names)}
    tmp = next(n for _, n in names if n.startswith("step-000000000002.tmp-"))
    shard_sync = i[("sync", "shard-00000.safetensors")]
    manifest_sync = i[("sync", "manifest.json")]
    dir_sync = i[("sync_dir", tmp)]
    rename = i[("rename", tmp)]
    root_sync = next(k for k, (op, n) in enumerate(names) if op == "sync_dir" and n == tmp_path.name and k > rename)
    latest = next(k for k, (op, n) in enumerate(names) if op == "rename" and n.startswith("latest.tmp-"))
    retire = next(k for k, (op, n) in enumerate(names) if op == "rename" and n == "step-000000000001")
    removal = next(k for k, (op, n) in enumerate(names) if op == "remove_tree" and "tmp-del" in n)
    assert shard_sync < manifest_sync < dir_sync < rename < root_sync < latest < retire < removal


@pytest.mark.parametrize("op", ["create", "pwrite", "truncate", "sync", "mkdir", "sync_dir", "rename"])
async def test_a_failed_io_leaves_nothing_and_the_old_checkpoint_loads(tmp_path: Any, op: str) -> None:
    eng = FaultyEngine()
    state = small_state(1)
    async with TensorStore(tmp_path, engine=eng, keep_last=1) as store:
        await store.save(1, state)
        eng.counts.clear()
        eng.fail = {op: (1, errno.ENOSPC)}
        with pytest.raises(OSError, match=r"No space left|injected ENOSPC") as ei:
            await store.save(2, small_state(2))
        assert ei.value.errno == errno.ENOSPC
        assert not isinstance(ei.value, aiotensor.errors.AiotensorError)
        assert store.steps() == [1] and tmp_leftovers(str(tmp_path)) == []
        assert eng.open_fds() == []
        eng.fail = {}
        assert_state_equal(state, await store.load())
        await store.save(3, small_state(3))  # the next save works
        assert store.steps() == [3]


async def test_unawaited_failure_is_not_swallowed(tmp_path: Any) -> None:
    eng = FaultyEngine(fail={"sync": (1, errno.EIO)})
    with pytest.raises(SaveFailedError, match="step 1") as ei:
        async with TensorStore(tmp_path, engine=eng) as store:
            store.save(1, small_state())
            await anyio.sleep(0.5)
            store.save(2, small_state())  # raises: the failure of step 1 was never looked at
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.EIO


async def test_close_raises_unobserved_failure(tmp_path: Any) -> None:
    eng = FaultyEngine(fail={"rename": (1, errno.EIO)})
    with pytest.raises(SaveFailedError):
        async with TensorStore(tmp_path, engine=eng) as store:
            store.save(1, small_state())
    assert tmp_leftovers(str(tmp_path)) == []


class GatedEngine(FaultyEngine):
    """Blocks writes (in their threads) until a test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.active = 0

    def _gated(self, io: Any, fd: int, buf: memoryview, offset: int) -> int:
        self.entered.set()
        self.active += 1
        try:
            self.gate.wait(10)
            return int(io(fd, buf, offset))
        finally:
            self.active -= 1

    def pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return self._gated(super().pwrite, fd, buf, offset)

    def pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return self._gated(super().pread, fd, buf, offset)


async def _wait_thread_event(ev: threading.Event) -> None:
    with anyio.fail_after(10):
        while not ev.is_set():
            await anyio.sleep(0.005)


async def _cancelled_in_a_thread(call: Any, entered: threading.Event, gate: threading.Event) -> None:
    """Run ``call()`` until one of its threads is held at ``gate`` (``entered`` set), cancel it,
    and open the gate 0.2 s later; returns when the call has returned."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await _wait_thread_event(entered)
            scope.cancel()
            threading.Timer(0.2, gate.set).start()


async def test_cancelling_an_awaited_save_removes_its_tmp_dir(tmp_path: Any) -> None:
    eng = GatedEngine()
    eng.gate.set()
    async with TensorStore(tmp_path, engine=eng) as store:
        await store.save(1, small_state(1))
        eng.gate.clear()
        eng.entered.clear()
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def saver() -> None:
                    await store.save(2, small_state(2))

                tg.start_soon(saver)
                await _wait_thread_event(eng.entered)
                scope.cancel()
                eng.gate.set()
        assert scope.cancelled_caught
        assert eng.active == 0 and eng.open_fds() == []
        assert store.steps() == [1] and tmp_leftovers(str(tmp_path)) == []
        await store.save(2, small_state(2))  # the step can be saved again
        assert store.steps() == [1, 2]


async def test_handle_cancel(tmp_path: Any) -> None:
    eng = GatedEngine()
    async with TensorStore(tmp_path, engine=eng) as store:
        h = store.save(1, small_state(1))
        await _wait_thread_event(eng.entered)
        h.cancel()
        eng.gate.set()
        with pytest.raises(SaveCancelledError):
            await h
        assert store.steps() == [] and tmp_leftovers(str(tmp_path)) == []


async def test_cancelling_a_load_leaves_no_thread_writing(tmp_path: Any) -> None:
    eng = GatedEngine()
    eng.gate.set()
    state = {f"t{i}": torch.randn(1 << 14) for i in range(8)}
    async with TensorStore(tmp_path, engine=eng, chunk_bytes=4096) as store:
        await store.save(1, state)
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        eng.gate.clear()
        eng.entered.clear()
        await _cancelled_in_a_thread(lambda: store.load(1, into=into), eng.entered, eng.gate)
        # the load returned only after its threads finished: nothing writes into `into` any more
        assert eng.active == 0 and eng.open_fds() == []
        snapshot = {k: v.clone() for k, v in into.items()}
        await anyio.sleep(0.3)
        assert_state_equal(snapshot, into)


class GatedOpens(FaultyEngine):
    """Counts the opens of shard files; the second blocks (in its thread) until a test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.shards: list[str] = []

    def open_read(self, path: str) -> int:
        if os.path.basename(path).startswith("shard-"):
            self.shards.append(path)
            if len(self.shards) == 2:
                self.entered.set()
                self.gate.wait(10)
        return super().open_read(path)


@pytest.mark.parametrize("mmap", [False, True])
async def test_a_cancelled_load_stops_after_the_shard_in_hand(tmp_path: Any, mmap: bool) -> None:
    # each shard is opened and checked (or mapped) in a call of its own: a load cancelled while
    # one is opened opens no other (in one call for all, it went on through all nine)
    state = {f"t{i}": torch.randn(1 << 12) for i in range(9)}
    async with TensorStore(tmp_path, shard_bytes=1 << 14) as store:
        await store.save(1, state)
    assert len([n for n in os.listdir(tmp_path / "step-000000000001") if n.startswith("shard-")]) == 9
    eng = GatedOpens()
    async with TensorStore(tmp_path, engine=eng, readonly=True) as store:
        await _cancelled_in_a_thread(lambda: store.load(1, mmap=mmap), eng.entered, eng.gate)
        assert len(eng.shards) == 2 and eng.open_fds() == []
        eng.shards.clear()
        assert_state_equal(await store.load(1, mmap=mmap), state)  # (the gate is open now)


async def test_concurrent_saves_and_loads_share_one_scheduler(tmp_path: Any) -> None:
    states = {s: small_state(s) for s in range(1, 7)}
    async with TensorStore(tmp_path, keep_last=3, chunk_bytes=4096) as store:
        await store.save(0, small_state(0))
        handles = [store.save(s, st, background=s % 2 == 0) for s, st in states.items()]
        loads = []
        async with anyio.create_task_group() as tg:
            for _ in range(4):

                async def reader() -> None:
                    loads.append(await store.load(0))

                tg.start_soon(reader)
        for h in handles:
            await h
        for out in loads:
            assert_state_equal(small_state(0), out)
        assert store.steps() == [4, 5, 6]
        assert_state_equal(states[6], await store.load())


async def test_background_save_does_not_starve_a_load(tmp_path: Any) -> None:
    eng = FaultyEngine()
    big = {f"t{i}": torch.randn(1 << 16) for i in range(16)}
    async with TensorStore(tmp_path, engine=eng, workers=1, chunk_bytes=4096, batch_bytes=4096) as store:
        await store.save(0, {"x": torch.ones(4)})
        eng.ops.clear()
        h = store.save(1, big, background=True)
        await h.staged
        await anyio.sleep(0.01)
        await store.load(0)
        load_done = len(eng.ops)
        await h
    writes_after_load = sum(1 for op in eng.ops[load_done:] if op[0] == "pwrite")
    assert writes_after_load > 0, "the load waited for the whole background save"


async def test_staging_memory_is_reused(tmp_path: Any) -> None:
    sizes = []
    async with TensorStore(tmp_path, keep_last=1, max_staged=1) as store:
        for step in range(5):
            await store.save(step, {"w": torch.randn(1 << 16)})
            sizes.append(store.staging.mapped_bytes)
    assert sizes == [(1 << 18) + 4096] * 5  # one header page + the data, mapped once


async def test_a_reader_polling_from_another_store_never_sees_an_uncommitted_step(tmp_path: Any) -> None:
    """RELIABILITY 6: a second store on the same root (another process, in effect) polls the newest
    step while saves commit and retire steps; every load it completes is exact, and a step
    retired under it is a CheckpointNotFoundError, never partial data."""
    states = {s: {"w": torch.full((50_000,), float(s)), "step": s} for s in range(12)}
    seen: list[int] = []
    vanished = 0
    async with TensorStore(tmp_path, keep_last=2, chunk_bytes=4096) as writer:
        await writer.save(0, states[0])
        async with TensorStore(tmp_path, readonly=True) as reader:
            done = False

            async def poll() -> None:
                nonlocal vanished
                while not done:
                    await reader.refresh()
                    step = reader.latest()
                    assert step is not None and step in states
                    try:
                        got = await reader.load(step)
                    except CheckpointNotFoundError:
                        vanished += 1
                        continue
                    assert_state_equal(states[step], got)
                    seen.append(step)

            async with anyio.create_task_group() as tg:
                tg.start_soon(poll)
                for s in range(1, 12):
                    await writer.save(s, states[s])
                done = True
    assert seen and all(s in states for s in seen)


async def test_a_step_retired_by_another_store_is_not_found_not_an_oserror(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, keep_last=1) as writer:
        await writer.save(1, {"w": torch.ones(3)})
        async with TensorStore(tmp_path, readonly=True) as reader:
            assert reader.steps() == [1]
            await writer.save(2, {"w": torch.zeros(3)})  # retires step 1 under the reader
            with pytest.raises(CheckpointNotFoundError, match=r"step 1 is gone: the writer .* before or while .* refresh\(\)"):
                await reader.load(1)
            assert reader.steps() == []  # forgotten; refresh() finds step 2
            with pytest.raises(CheckpointNotFoundError, match=r"as this store last read it \(refresh\(\) reads it again\)"):
                await reader.load()  # (helper-60: a reader that never refreshed was told only "no committed checkpoint")
            assert await reader.refresh() == [2]


async def test_the_store_reports_its_io_path(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, engine=aiotensor.PosixEngine()) as store:
        assert store.io_mode == "posix"
    async with TensorStore(tmp_path, engine=FaultyEngine()) as store:
        assert store.io_mode == "faulty"


async def test_load_into_inference_tensors(tmp_path: Any) -> None:
    # a state made under inference_mode (non-contiguous, and untied where the checkpoint is tied):
    # torch refuses in-place writes to inference tensors outside that mode
    w = torch.randn(4, 4)
    saved = {"w": w, "tied": w, "b": torch.randn(3)}
    with torch.inference_mode():
        into = {"w": torch.zeros(4, 4).t(), "tied": torch.zeros(4, 4), "b": torch.zeros(3)}
    async with TensorStore(tmp_path) as store:
        await store.save(1, saved)
        await store.load(into=into)
    assert_state_equal(into, saved)


async def test_a_multisteplr_state_keeps_its_counter(tmp_path: Any) -> None:
    # MultiStepLR keeps its milestones in a collections.Counter: as a plain dict, step() failed
    # after a restore ('dict' object has no attribute 'elements')
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4, 4], gamma=0.5)
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"sched": sched.state_dict()})
        got = await store.load()
    assert type(got["sched"]["milestones"]) is collections.Counter and got["sched"] == sched.state_dict()
    again = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), milestones=[1])
    again.load_state_dict(got["sched"])
    for _ in range(5):
        again.optimizer.step()
        again.step()
        sched.optimizer.step()
        sched.step()
    assert again.get_last_lr() == sched.get_last_lr()


async def test_a_string_that_is_not_unicode_is_a_state_error_and_leaves_nothing(tmp_path: Any) -> None:
    name = os.fsdecode(b"shard-\xff.bin")  # a lone surrogate: what os.fsdecode makes of a name that is not UTF-8
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(2)})
        with pytest.raises(StateError, match=r"surrogate\): 'shard-\\udcff.bin' \(a value under the key 'files'\)"):
            await store.save(2, {"w": torch.ones(2), "files": [name]})  # (was the manifest's JSON around it)
        with pytest.raises(StateError, match=r"surrogate\): 'shard-\\udcff.bin' \(a key under the key 'opt'\)"):
            await store.save(2, {"w": torch.ones(2), "opt": {name: 1}})
        with pytest.raises(StateError, match=r"surrogate\): the name 'shard-\\udcff.bin'"):  # a tensor's name, named
            await store.save(2, {name: torch.ones(2)})  # (its shard's header: was a raw error, then the JSON around it)
        assert store.steps() == [1]
    assert sorted(os.listdir(tmp_path)) == [".aiotensor.lock", "latest", "step-000000000001"]
    with pytest.raises(StateError, match=r"the name 'shard-\\udcff.bin'"):  # a file's header, the same way (helper-47)
        await aiotensor.save_file({name: torch.ones(2)}, tmp_path / "one.safetensors")
    assert not (tmp_path / "one.safetensors").exists()


@pytest.mark.parametrize("kind", ["dotted", "int and str"])
async def test_load_into_pairs_tensors_by_where_they_are_not_by_a_name_two_paths_share(tmp_path: Any, kind: str) -> None:
    # {"a.b": x, "a": {"b": y}} names x "a.b" and y "a.b#2" in the order a walk meets them: an
    # `into` that lists them the other way round swapped them, silently
    if kind == "dotted":
        saved: Any = {"a.b": torch.zeros(3), "a": {"b": torch.ones(3)}}
        into: Any = {"a": {"b": torch.full((3,), 7.0)}, "a.b": torch.full((3,), 7.0)}
        first, second = into["a.b"], into["a"]["b"]
    else:
        saved = {1: torch.zeros(3), "1": torch.ones(3)}
        into = {"1": torch.full((3,), 7.0), 1: torch.full((3,), 7.0)}
        first, second = into[1], into["1"]
    async with TensorStore(tmp_path) as store:
        await store.save(1, saved)
        await store.load(into=into)
        assert first.tolist() == [0.0] * 3 and second.tolist() == [1.0] * 3
        extra = {**into, "c": torch.ones(1)}  # a tensor at a path the checkpoint lacks: named, not paired
        with pytest.raises(MismatchError, match="'c'"):
            await store.load(into=extra)


async def test_load_into_pairs_metadata_and_nan_keys_by_where_they_are(tmp_path: Any) -> None:
    # an OrderedDict's content key "_metadata" beside a tensor in its _metadata, and nan keys,
    # with names made twice and `into` in another order
    od: Any = collections.OrderedDict(
        {"_metadata": {"x": torch.ones(2)}, "a.b": torch.full((2,), 2.0), "a": {"b": torch.full((2,), 3.0)}}
    )
    od._metadata = {"x": torch.full((2,), 4.0)}
    saved = {"od": od, float("nan"): torch.full((2,), 5.0), "nan": torch.full((2,), 6.0)}
    async with TensorStore(tmp_path) as store:
        await store.save(1, saved)
        into_od: Any = collections.OrderedDict(
            {"a": {"b": torch.zeros(2)}, "a.b": torch.zeros(2), "_metadata": {"x": torch.zeros(2)}}
        )
        into_od._metadata = {"x": torch.zeros(2)}
        into = {"nan": torch.zeros(2), float("nan"): torch.zeros(2), "od": into_od}
        await store.load(into=into)
    assert into_od["_metadata"]["x"].tolist() == [1.0] * 2 and into_od._metadata["x"].tolist() == [4.0] * 2
    assert into_od["a.b"].tolist() == [2.0] * 2 and into_od["a"]["b"].tolist() == [3.0] * 2
    assert into["nan"].tolist() == [6.0] * 2 and next(v for k, v in into.items() if k != k).tolist() == [5.0] * 2


async def test_a_partial_resume_loads_what_both_have(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """strict=False (load_state_dict's meaning): a model that gained a head and lost a layer, an
    optimizer state that changed shape, resumes from what both have; the rest of ``into`` is left
    as it is, and nothing ``into`` lacks is read or added."""
    w = torch.randn(8, 4)
    saved = {
        "model": {"embed": w, "layer1": torch.randn(4, 4), "head": w},  # head tied to embed: stored once
        "optim": {"lr": 0.01, "betas": [0.9, 0.99], "momentum": [torch.ones(3), torch.ones(5)], "params": [0, 1]},
        "step": 7,
        "rng": "saved",
    }
    async with TensorStore(tmp_path) as store:
        await store.save(7, saved)
        new_head = torch.full((2, 4), 5.0)
        into: dict[str, Any] = {
            "model": {"head": torch.zeros(8, 4), "new_head": new_head},  # embed and layer1 dropped
            # lists of another length (an optimizer's param_groups' params after the model changed)
            "optim": {"lr": 0.5, "betas": [0.0, 0.0], "momentum": [torch.zeros(3)], "params": [0, 1, 2]},
            "step": 0,
        }
        with pytest.raises(MismatchError, match="missing keys.*new_head.*unexpected keys"):
            await store.load(into=into)
        assert into["step"] == 0 and not into["model"]["head"].any()  # a refused load writes nothing
        caplog.set_level("WARNING", logger="aiotensor")
        got = await store.load(into=into, strict=False)
    assert got is into
    assert torch.equal(into["model"]["head"], w)  # read from the tensor it is tied to, though `into` lacks embed
    assert torch.equal(into["model"]["new_head"], torch.full((2, 4), 5.0)) and into["model"]["new_head"] is new_head
    assert set(into["model"]) == {"head", "new_head"} and "rng" not in into  # nothing `into` lacks is added
    assert into["step"] == 7 and into["optim"]["lr"] == 0.01 and into["optim"]["betas"] == [0.9, 0.99]
    # names are paths: optim.momentum.0 is in both (filled), .1 only in the step; the list keeps its length
    assert len(into["optim"]["momentum"]) == 1 and into["optim"]["momentum"][0].eq(1).all()
    assert into["optim"]["params"] == [0, 1, 2]
    assert "strict=False" in caplog.text and "new_head" in caplog.text and "layer1" in caplog.text


async def test_a_resume_into_a_fresh_optimizer_takes_its_saved_moments(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A fresh optimizer's ``state_dict()`` has an empty ``state`` until its first step: a strict
    load into it puts the saved moments there as new tensors (as it puts the saved settings), so
    ``load_state_dict`` restores them (it raised MismatchError). Not with strict=False, which keeps
    ``into``'s ``param_groups`` when the model changed: the saved moments, keyed by index, would
    land on other parameters (helper-28: a grown model's new layer got a head's moments); they are
    named in the warning and not read. Where ``into``'s dict is not empty, a saved tensor it lacks
    is still unexpected."""
    torch.manual_seed(0)
    model, opt = _adamw_trained()
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1})
        fresh = torch.nn.Linear(8, 4)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)
        into = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict(), "step": -1}
        await store.load(into=into)
        fresh_opt.load_state_dict(into["optim"])
        assert into["step"] == 1 and fresh_opt.param_groups[0]["lr"] == 3e-4
        assert_state_equal(fresh.state_dict(), model.state_dict())
        for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
            assert_state_equal(fresh_opt.state[q], opt.state[p])
        got = await store.load(into={"model": {}, "optim": {}, "step": 0})  # empty: the saved values whole
        assert_state_equal(got["model"], model.state_dict())
        grown = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4))
        into = {"model": grown.state_dict(), "optim": torch.optim.AdamW(grown.parameters()).state_dict(), "step": 0}
        with pytest.raises(MismatchError, match="unexpected keys"):
            await store.load(into=into)
        caplog.set_level("WARNING", logger="aiotensor")
        await store.load(into=into, strict=False)
        assert into["optim"]["state"] == {} and "optim.state.0.exp_avg" in caplog.text
        w = torch.randn(4)
        await store.save(2, {"a": {"w": torch.ones(3)}, "b": {"w": torch.full((3,), 2.0)}, "model": {"emb": w}, "opt": {"x": w}})
        one: dict[str, Any] = {}  # one empty dict at two places: filled at the first, the second's tensors have no place
        with pytest.raises(MismatchError, match="unexpected keys.*b.w"):
            await store.load(into={"a": one, "b": one, "model": {"emb": torch.zeros(4)}, "opt": {"x": torch.zeros(4)}})
        # a tied name under an empty dict: one new tensor, tied, as a load without `into` makes it
        got = await store.load(into={"a": {}, "b": {}, "model": {}, "opt": {}})
        assert torch.equal(got["opt"]["x"], w) and got["opt"]["x"] is got["model"]["emb"]


def _adamw_trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


async def test_a_partial_resume_still_refuses_a_shape_or_dtype_that_differs(tmp_path: Any) -> None:
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(4, 4), "b": torch.ones(4)})
        into = {"w": torch.zeros(4, 5), "b": torch.zeros(4)}
        with pytest.raises(MismatchError, match="tensor 'w'"):
            await store.load(into=into, strict=False)
        assert not into["b"].any()
        into = {"b": torch.zeros(4, dtype=torch.float64)}
        with pytest.raises(MismatchError, match="tensor 'b'"):
            await store.load(into=into, strict=False)
        into = {"w": torch.zeros(1, 4).expand(4, 4), "b": torch.zeros(4)}  # one row, seen 4 times: not fillable
        with pytest.raises(MismatchError, match="tensor 'w' of `into` is expanded"):
            await store.load(into=into)
        into = {"w": torch.zeros(16).as_strided((4, 4), (1, 1)), "b": torch.zeros(4)}  # rows that overlap: was filled, mixed
        with pytest.raises(MismatchError, match="tensor 'w' of `into` has strides \\[1, 1\\].*one memory location"):
            await store.load(into=into)
        assert not into["b"].any() and not into["w"].any()
        into = {"w": torch.zeros(4, 8)[:, ::2].t().t(), "b": torch.zeros(8)[::2]}  # strided, no overlap: filled
        assert (await store.load(into=into))["w"].eq(1).all() and into["b"].eq(1).all()
        into = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
        assert (await store.load(into=into, strict=False, atomic=True))["w"].eq(1).all()  # nothing to warn about
        assert (await store.load(strict=False))["b"].eq(1).all()  # without into: no meaning, new tensors


class _Pair(collections.namedtuple("_Pair", "params step")):
    pass


async def test_a_partial_resume_never_replaces_what_it_leaves_alone(tmp_path: Any) -> None:
    """strict=False keeps every place of `into` the warning calls missing: a dict of tensors where
    the step has a number, a named tuple's own type and members, a name tied in the step that
    `into` holds as something else."""
    w = torch.randn(4)
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"x": 5, "nt": ({"w": w}, 3), "embed": w, "head": w, "both": [w, w], "tup": (w, 1)})
        keep, new, z = torch.zeros(2), torch.full((3,), 7.0), torch.zeros(4)
        into: dict[str, Any] = {
            "x": {"a": keep},
            "nt": _Pair({"w": torch.zeros(4), "new": new}, 0),
            "embed": None,
            "head": z,
            "both": [torch.zeros(4), torch.zeros(4)],
            "tup": (torch.zeros(4), 0),
        }
        await store.load(into=into, strict=False)
    assert into["x"]["a"] is keep  # the step's 5 does not replace `into`'s tensors
    assert type(into["nt"]) is _Pair and into["nt"].step == 3 and into["nt"].params["new"] is new
    assert torch.equal(into["nt"].params["w"], w)
    assert into["embed"] is None and torch.equal(z, w)  # head read from embed's bytes; embed not added
    assert torch.equal(into["both"][0], w) and torch.equal(into["both"][1], w)
    assert torch.equal(into["tup"][0], w) and into["tup"][1] == 1 and type(into["tup"]) is tuple


@pytest.mark.parametrize("atomic", [False, True])
async def test_a_step_retired_while_it_is_loaded_into_tensors_is_read_whole(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    """A reader's load into its model while the writer's retention deletes that step: the shards
    were opened one at a time, so the first was read into `into` and the next was gone, leaving
    `into` half one step, half the one before, even with atomic=True (helper-28: 5 of 333 loads).
    The shards are kept open from their check on: the unlinked files are read whole."""
    await load_while_its_step_is_retired(tmp_path, monkeypatch, atomic)


async def load_while_its_step_is_retired(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, atomic: bool, engine: aiotensor.Engine | None = None
) -> dict[str, torch.Tensor]:
    """Load step 1 (a shard per tensor) into tensors through ``engine``, the step deleted (as another
    process's retention does) once the first shard is read; checks ``into`` holds step 1 whole."""
    import shutil

    from aiotensor.store import load as store_load

    old, new = ({f"t{i}": torch.full((256,), float(i + k)) for i in range(4)} for k in (0, 100))
    async with TensorStore(tmp_path, engine=aiotensor.PosixEngine(), shard_bytes=1024) as store:
        await store.save(1, new)
    real = store_load.read_tensors
    calls = []

    async def read_then_retire(*args: Any) -> None:
        await real(*args)
        calls.append(1)
        if len(calls) == 1:  # after the first shard landed in `into`: another process retires the step
            shutil.rmtree(tmp_path / "step-000000000001")

    monkeypatch.setattr(store_load, "read_tensors", read_then_retire)
    into = {k: v.clone() for k, v in old.items()}
    async with TensorStore(tmp_path, readonly=True, **({} if engine is None else {"engine": engine})) as reader:
        await reader.load(1, into=into, atomic=atomic)
    assert len(calls) == 4 and not (tmp_path / "step-000000000001").exists()
    assert_state_equal(into, new)
    return new


async def test_loads_cancelled_twice_leave_no_file_open(tmp_path: Any, anyio_backend: Any) -> None:
    """A load into tensors keeps its shards open until it ends: closing them one call each, a second
    Task.cancel() (which an anyio shield does not hold) broke off the closing and left the rest open
    (helper-29: 4,534 descriptors in 300 loads)."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("asyncio's own Task.cancel()")
    import asyncio
    import random

    state = {f"t{i}": torch.full((4096,), float(i)) for i in range(12)}
    async with TensorStore(tmp_path, shard_bytes=20000) as store:  # a shard per tensor
        await store.save(1, state)
    rng = random.Random(0)
    async with TensorStore(tmp_path, readonly=True) as reader:
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        await reader.load(1, into=into)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(40):
            task = asyncio.ensure_future(reader.load(1, into=into))
            await asyncio.sleep(rng.uniform(0, 0.01))
            task.cancel()
            await asyncio.sleep(rng.uniform(0, 0.002))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert len(os.listdir("/proc/self/fd")) == before


async def test_a_mirror_whose_lease_another_writer_holds_is_caught_up_once_it_is_free(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer restarted while its crashed predecessor's lease on the mirror still lived could not
    open at all, and with lock_timeout=None an upload's retry waited for ever, close() with it
    (helper-34). The store opens with a warning and commits here; uploads never wait for the
    lease, refresh() and the next upload try again, and catch up once it is free."""
    monkeypatch.setattr(aiotensor.knobs, "MIRROR_RETRY_S", 0.0)
    mirror, local = tmp_path / "mirror", tmp_path / "local"
    async with TensorStore(mirror) as holder:  # another writer of the mirror
        async with TensorStore(local, mirror=mirror, lock_timeout=None) as store:
            h = store.save(1, {"w": torch.ones(2)})
            await h
            with pytest.raises(OSError, match="cannot be used now"):
                await h.mirrored
            await holder.close()  # (its lease gone: the next upload takes the mirror)
            h = store.save(2, {"w": torch.ones(2) * 2})
            await h.mirrored
            assert await store.refresh() == [1, 2]
            with pytest.raises(CheckpointNotFoundError):  # in neither tier (a first version returned)
                await store.delete(5)
            await store.delete(1)  # both tiers, beside no upload
            assert store.steps() == [2] and store.mirrored_steps() == [2]
    async with TensorStore(mirror, readonly=True) as m:
        assert m.steps() == [2]


async def test_a_tensor_changed_in_place_before_it_was_copied_out_fails_the_save(tmp_path: Any) -> None:
    """A training loop that does not wait for `staged` (a notebook cell that never awaits, a
    terminal IPython Ctrl-C that left a save in flight: helper-55) changed its tensors before the
    save copied them out: steps 0 and 1 were committed holding step 3's values, with valid
    checksums. The version counters taken at save() are compared once the tensors are copied: the
    save fails (StateChangedError naming the tensor), nothing is committed, and the next save, one
    that waits for `staged`, commits the right values."""
    from aiotensor.errors import StateChangedError
    from aiotensor.snapshot import Snapshotter

    w, b = torch.zeros(64), torch.zeros(3)
    async with TensorStore(tmp_path) as store:
        h = store.save(0, {"model": {"w": w, "b": b}, "step": 0})
        w.fill_(1.0)  # the optimizer's step, before the loop ran once: nothing was copied yet
        with pytest.raises(StateChangedError, match=r"'model\.w'") as e:
            await h
        assert "nothing was committed" in str(e.value) and isinstance(e.value, aiotensor.errors.StateError)
        assert store.steps() == [] and not h.committed
        h = store.save(0, {"model": {"w": w, "b": b}, "step": 0})
        await h.staged
        w.fill_(2.0)  # the right way: after staged
        await h
        assert_state_equal((await store.load(0))["model"], {"w": torch.ones(64), "b": torch.zeros(3)})
        # the same through a Snapshotter fed by a loop that never yields to the event loop
        snap = Snapshotter(store)
        for k in range(1, 4):
            w.fill_(10.0 + k)
            snap.save(k, {"model": {"w": w, "b": b}, "step": k})
        failures = 0
        while True:  # drain raises each failed save's error in turn
            try:
                await snap.drain()
                break
            except StateChangedError:
                failures += 1
        assert failures >= 1
        for s in store.steps():  # whatever was committed holds its own step's values
            got = await store.load(s)
            assert float(got["model"]["w"][0]) == (1.0 if s == 0 else 10.0 + got["step"])
        # tensors PyTorch gives no counter (inference mode) are saved as ever
        with torch.inference_mode():
            frozen = torch.full((4,), 7.0)
        await store.save(9, {"frozen": frozen, "w": w})
        assert_state_equal((await store.load(9))["frozen"], frozen)


@pytest.mark.parametrize("small", [False, True])
async def test_a_tensor_replaced_before_it_was_copied_out_or_without_memory_is_refused(
    tmp_path: Any, monkeypatch: Any, small: bool
) -> None:
    """helper-67, two crashes of the process: a tensor whose data another thread replaced by a
    smaller one between save() and its copy was copied by the plan's size, past the end of its
    memory (or past its place in the staging memory, for a bigger one); a ZeroTensor (zeros without
    memory) was copied from address 0. Now a StateChangedError and a StateError naming the tensor,
    nothing committed, the store usable. ``small``: among many small tensors (copied in bulk)."""
    from aiotensor.errors import StateChangedError
    from aiotensor.store import saving

    p = torch.nn.Parameter(torch.randn(16 if small else 1 << 20))
    others = {f"t{i}": torch.ones(4) for i in range(3000 if small else 1)}
    real = saving.stage

    async def replaced_first(*args: Any, **kwargs: Any) -> Any:
        p.data = torch.empty(0) if not small else torch.randn(1 << 16)  # smaller; among small ones, bigger
        return await real(*args, **kwargs)

    async with TensorStore(tmp_path) as store:
        monkeypatch.setattr(saving, "stage", replaced_first)
        with pytest.raises(StateChangedError, match="tensor 'p' is not the size it was when save"):
            await store.save(1, {"p": p, **others})
        monkeypatch.setattr(saving, "stage", real)
        zero = torch._efficientzerotensor((4096,))
        with pytest.raises(StateError, match="tensor 'z' is a ZeroTensor"):
            await store.save(1, {"z": zero, **others})
        with pytest.raises(StateError, match="tensor 'z' is a ZeroTensor"):
            await aiotensor.save_file({"z": zero}, tmp_path / "z.safetensors")
        assert store.steps() == []
        await store.save(1, {"p": p, **others})
        assert_state_equal((await store.load(1))["p"], p.detach())


async def test_a_second_writer_in_the_same_process_is_told_to_close_the_first(tmp_path: Any) -> None:
    """A notebook cell that opens a store, run again while Out[n] or a Snapshotter keeps the first
    open: the error said to pass lock_timeout=, which waits for ever on a store nobody closes
    (helper-55). It says to close that store."""
    async with TensorStore(tmp_path):
        with pytest.raises(StoreLockedError, match=r"in this process.*Close that store first") as e:
            async with TensorStore(tmp_path, lock_timeout=0):
                pass
        assert "lock_timeout" not in str(e.value)


async def test_a_save_handle_awaited_on_another_event_loop_is_refused(tmp_path: Any, anyio_backend: Any) -> None:
    """`await handle` on another thread's loop (a notebook's `executor.submit(asyncio.run,
    store.save(...))`) never woke, the save committed meanwhile: the kernel hung (helper-55). It
    is a RuntimeError, as the store's own calls from another loop are; once the save is done, any
    loop may read its outcome."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("asyncio loops in two threads")
    import asyncio
    import concurrent.futures

    async with TensorStore(tmp_path) as store:
        h = store.save(1, {"w": torch.ones(1 << 20)})
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            with pytest.raises(RuntimeError, match="another event loop"):
                await asyncio.wrap_future(ex.submit(asyncio.run, h.wait()))
            with pytest.raises(RuntimeError, match="another event loop"):  # cancelled before it ran: not the save
                await asyncio.wrap_future(ex.submit(asyncio.run, asyncio.wait_for(h.wait(), 0)))
            await h
            await asyncio.wrap_future(ex.submit(asyncio.run, h.wait()))  # done: read from anywhere
        assert store.steps() == [1]


async def test_a_save_handle_says_how_its_save_ended(tmp_path: Any) -> None:
    """A notebook shows the handle: `<SaveHandle step=1 done>` was shown for a save that failed or
    was cancelled as for one committed; and reading `handle.exception()` did not count as having
    seen the failure, so the next save raised SaveFailedError for it (helper-55)."""
    async with TensorStore(tmp_path) as store:
        h = store.save(1, {"w": torch.ones(4)})
        await h
        assert repr(h) == "<SaveHandle step=1 committed>"
        bad = store.save(2, {"w": object()})  # a value that cannot be stored
        while not bad.done():
            await anyio.sleep(0.01)
        assert repr(bad) == "<SaveHandle step=2 failed: StateError>"
        assert isinstance(bad.exception(), StateError)
        await store.save(3, {"w": torch.ones(4)})  # the failure was seen: no SaveFailedError
        gone = store.save(4, {"w": torch.ones(4)})
        gone.cancel()
        with pytest.raises(SaveCancelledError):
            await gone
        assert repr(gone) == "<SaveHandle step=4 cancelled>"
        unread = store.save(5, {"w": object()})
        while not unread.done():
            await anyio.sleep(0.01)
        with pytest.raises(SaveFailedError):  # never awaited, never read: raised by the next save
            store.save(6, {"w": torch.ones(4)})


async def test_steps_of_a_store_never_opened_are_refused(tmp_path: Any) -> None:
    """`store.latest()` before `open()` was None on a root full of steps: a resume read it as a
    fresh run (helper-55). A store never opened has not looked: StoreClosedError saying how to open
    it; once opened and closed, its last view stays readable."""
    async with TensorStore(tmp_path) as store:
        await store.save(3, {"w": torch.ones(2)})
    fresh = TensorStore(tmp_path)
    assert repr(fresh) == f"<TensorStore {str(tmp_path)!r} never opened>"
    for ask in (fresh.steps, fresh.latest):
        with pytest.raises(StoreClosedError, match=r"never opened.*await store\.open\(\)"):
            ask()
    await fresh.open()
    assert fresh.latest() == 3
    assert repr(fresh) == f"<TensorStore {str(tmp_path)!r} open, steps 3..3 (1)>"
    await fresh.close()
    assert fresh.steps() == [3] and repr(fresh) == f"<TensorStore {str(tmp_path)!r} closed, steps 3..3 (1)>"


def test_a_store_used_outside_a_running_loop_says_so(tmp_path: Any) -> None:
    """Terminal IPython runs a plain cell outside the loop it drives: `store.save()` there raised
    anyio's "Not currently running on any asynchronous event loop" (helper-55)."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        store = TensorStore(tmp_path)
        loop.run_until_complete(store.open())
        with pytest.raises(RuntimeError, match="outside a running event loop"):
            store.save(1, {"w": torch.ones(2)})
        loop.run_until_complete(store.close())
    finally:
        loop.close()


def test_the_version_walk_is_bounded_and_finds_the_tensors() -> None:
    """`save()` walks the state on the caller's thread for the tensors' version counters: a state
    holding itself looped for ever there (it is the save's StateError), a sampler's list of a
    million indices held the loop 230-310 ms (helper-58). Tables of numbers are not looked into; a
    long list of tensors is; namedtuples, OrderedDicts and subclasses of Tensor are."""
    from collections import OrderedDict, namedtuple

    from aiotensor.store.saving import versions

    pair = namedtuple("pair", "a b")
    w, p, q = torch.ones(2), torch.nn.Parameter(torch.ones(3)), torch.zeros(1)
    many = [torch.zeros(1) for _ in range(5000)]
    state: dict[str, Any] = {
        "model": OrderedDict(w=w, p=p),
        "nt": pair(q, [many[0]]),
        "many": many,
        "sampler": {"indices": list(range(100_000)), "losses": {f"s{i}": 0.5 for i in range(10_000)}},
        "step": 3,
    }
    state["self"] = state
    found, counters = versions(state)
    ids = {id(t) for t in found}
    assert {id(w), id(p), id(q)} <= ids and {id(t) for t in many} <= ids
    assert len(counters) == len(found) and all(type(c) is int for c in counters)
    assert versions(w)[0] == [w]


async def test_a_writer_on_a_read_only_file_system_is_told_to_open_it_read_only(tmp_path: Any, monkeypatch: Any) -> None:
    """helper-60: a store opened to save on a read-only mount got a bare EROFS from locking."""
    import errno

    from aiotensor import root as _root

    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(2)})

    def read_only(self: Any) -> bool:
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / ".lock"))

    monkeypatch.setattr(_root.WriterLock, "try_acquire", read_only)
    with pytest.raises(
        OSError, match=r"Read-only file system \(a store that saves writes its lock file there: open it with readonly=True"
    ):
        async with TensorStore(tmp_path):
            pass
    async with TensorStore(tmp_path, readonly=True) as reader:
        assert reader.steps() == [1]


@pytest.mark.parametrize("verify", [False, True])
async def test_a_shard_replaced_between_its_check_and_its_read_fails_the_load(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """A step's shard is checked against the manifest, closed, and opened again for its data (a
    load without ``into``): a step saved again under its number meanwhile (its shard renamed over
    by one of the same layout) gave the new shard's bytes to the old manifest's entries, garbage
    with ``verify=False``. The reopened file must be the one checked: a SourceChangedError."""
    from aiotensor.errors import SourceChangedError
    from aiotensor.store import load as store_load

    ones, twos = ({f"t{i}": torch.full((256,), float(i + k)) for i in range(4)} for k in (1, 2))
    for folder, state in (("a", ones), ("b", twos)):
        async with TensorStore(tmp_path / folder) as store:
            await store.save(1, state)
    (shard,) = (tmp_path / "a" / "step-000000000001").glob("*.safetensors")
    real = store_load._targets

    def targets_then_replace(*args: Any) -> Any:
        out = real(*args)
        os.replace(tmp_path / "b" / "step-000000000001" / shard.name, shard)  # after its check, before its read
        return out

    monkeypatch.setattr(store_load, "_targets", targets_then_replace)
    async with TensorStore(tmp_path / "a", readonly=True) as reader:
        with pytest.raises(SourceChangedError, match="changed while it was being loaded"):
            await reader.load(1, verify=verify)
        monkeypatch.setattr(store_load, "_targets", real)
        with pytest.raises(aiotensor.errors.ChecksumError):  # the new file, read from the start: its bytes are not step 1's
            await reader.load(1)


async def test_a_shard_written_in_place_while_it_is_checked_fails_the_load(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity a load's reopening compares is taken as the shard is opened, before its check:
    taken after, a write in place that landed during the check was part of it, and the new bytes
    were read unchecked (helper-63: with verify=False, silently)."""
    import time

    from aiotensor._io import read as io_read
    from aiotensor.errors import SourceChangedError

    async with TensorStore(tmp_path) as store:
        await store.save(1, {"t": torch.full((256,), 1.0)})
    (shard,) = (tmp_path / "step-000000000001").glob("*.safetensors")
    real = io_read.check_shard

    def check_then_write(*args: Any) -> None:
        real(*args)
        time.sleep(0.05)  # (past the file system's clock tick: the write moves the modification time)
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) - 1024)
            f.write(torch.full((256,), 7.0).numpy().tobytes())

    monkeypatch.setattr(io_read, "check_shard", check_then_write)  # (the check every reader of a shard runs)
    async with TensorStore(tmp_path, readonly=True) as reader:
        with pytest.raises(SourceChangedError, match="changed while it was being loaded"):
            await reader.load(1, verify=False)


async def test_an_int_too_long_for_text_is_a_state_error_naming_its_key_and_leaves_nothing(tmp_path: Any) -> None:
    """An int of more digits than Python writes as text (``sys.get_int_max_str_digits()``: 4,300)
    was json's raw ValueError at the commit; now a StateError naming the key it is under, and the
    step before is all there is."""
    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(2), "ok": 10**4000})
        with pytest.raises(StateError, match=r"more than \d+ digits \(a value under the key 'rng'\)"):
            await store.save(2, {"w": torch.ones(2), "k": {"rng": [1, 7**9000]}})
        assert store.steps() == [1] and (await store.load())["ok"] == 10**4000
    assert sorted(os.listdir(tmp_path)) == [".aiotensor.lock", "latest", "step-000000000001"]


@pytest.mark.parametrize("layout", ["same", "other"])
@pytest.mark.parametrize("how", ["load", "into", "mmap", "stream"])
@pytest.mark.parametrize("verify", [False, True])
async def test_a_step_saved_again_under_its_number_while_it_loads_is_a_source_change(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, layout: str, how: str, verify: bool
) -> None:
    """Another process deletes step 1 and saves step 1 again (its folder replaced whole) after a
    reader checked the first of its shards: the shards checked after it are the new save's, and a
    new shard of the same layout passed the old manifest's check, so loads mixed the two saves
    (helper-64: `into=` and `mmap=True` with verify=False), called them corrupt (verify=True), or a
    new layout damaged (ManifestError). Each shard's check now finds the step's manifest still the
    one read: a SourceChangedError."""
    import shutil

    from aiotensor.errors import SourceChangedError

    old = {f"t{i}": torch.full((256,), 1.0 + i) for i in range(4)}
    new = {f"t{i}": torch.full((256,), 100.0 + i) for i in range(4)}
    async with TensorStore(tmp_path / "a", shard_bytes=1024) as store:  # a shard per tensor
        await store.save(1, old)
    async with TensorStore(tmp_path / "b", shard_bytes=1024 if layout == "same" else 4096) as store:
        await store.save(1, new)
    step = "step-000000000001"
    shards: list[str] = []

    def resave_at_the_second_shard(op: tuple[Any, ...]) -> None:
        if op[0] == "open_read" and op[1].endswith(".safetensors") and op[1] not in shards:
            shards.append(op[1])
            if len(shards) == 2:  # the first shard was checked: the step is saved again by another process
                shutil.rmtree(tmp_path / "a" / step)
                os.rename(tmp_path / "b" / step, tmp_path / "a" / step)

    engine = FaultyEngine(hook=resave_at_the_second_shard)
    into = {k: torch.zeros(256) for k in old}
    with pytest.raises(SourceChangedError, match="was saved again while it was being loaded"):
        if how == "stream":
            sched = aiotensor.Scheduler(engine)
            try:
                async with aiotensor.stream(tmp_path / "a", verify=verify, scheduler=sched) as s:
                    async for _ in s:
                        pass
            finally:
                sched.close()
        else:
            async with TensorStore(tmp_path / "a", readonly=True, engine=engine) as reader:
                kw: dict[str, Any] = {"into": into} if how == "into" else {"mmap": True} if how == "mmap" else {}
                await reader.load(1, verify=verify, **kw)
    assert len(shards) >= 2
    async with TensorStore(tmp_path / "a", readonly=True) as reader:  # loaded again: the new save, whole
        assert_state_equal(await reader.load(1), new)


async def test_a_stream_of_a_root_whose_newest_step_goes_while_it_resolves_says_so(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest step retired between the root's listing and the read of its manifest: a
    CheckpointNotFoundError saying it is gone (helper-64: a FileNotFoundError of a '.metadata' the
    step never had, the resolver having taken it for a DCP checkpoint)."""
    import shutil

    from aiotensor import sources

    async with TensorStore(tmp_path) as store:
        await store.save(1, {"w": torch.ones(2)})
    real = sources.step

    def retired_first(engine: Any, folder: str, number: Any = None) -> Any:
        shutil.rmtree(folder)
        return real(engine, folder, number)

    monkeypatch.setattr(sources, "step", retired_first)
    with pytest.raises(CheckpointNotFoundError, match="is gone: retired"):
        async with aiotensor.stream(tmp_path) as s:
            async for _ in s:
                pass


async def test_a_state_no_reader_takes_is_refused_at_save_and_the_last_good_step_is_kept(tmp_path: Any) -> None:
    """helper-71: what the readers refuse was committed: plain values denser than the density rule
    (a list of 150,000 small ints), a string of many commas (counted as values), a tensor of 65
    dimensions. Each step was listed, never loaded, and keep_last retired the good one before it.
    Now the rule counts values outside strings and lets a million through, and a save that a
    reader would refuse fails with a StateError before anything is committed."""
    async with TensorStore(tmp_path / "store", keep_last=1) as store:
        await store.save(1, {"w": torch.ones(3)})
        for bad in ({"visits": [0] * 1_100_000}, {"t": torch.zeros([1] * 65)}):
            with pytest.raises(StateError, match="denser than aiotensor reads|more than the 64 dimensions"):
                await store.save(2, bad)
            assert store.steps() == [1] and torch.equal((await store.load())["w"], torch.ones(3))
        fine = {"visits": [i % 3 for i in range(150_000)], "labels": ",".join("a" * 1_200_000), "w": torch.ones(3)}
        await store.save(2, fine)
        got = await store.load(2)
        assert got["visits"] == fine["visits"] and got["labels"] == fine["labels"] and store.steps() == [2]
    await aiotensor.save_file({"w": torch.ones(1)}, tmp_path / "m.safetensors", metadata={"labels": fine["labels"]})
    assert (await aiotensor.read_header(tmp_path / "m.safetensors")).metadata["labels"] == fine["labels"]
    with pytest.raises(StateError, match="more than the 64 dimensions"):
        await aiotensor.save_file({"t": torch.zeros([1] * 65)}, tmp_path / "d.safetensors")
    assert not (tmp_path / "d.safetensors").exists()


async def test_a_store_starts_a_new_shard_at_the_tensor_count_a_reader_takes(tmp_path: Any, monkeypatch: Any) -> None:
    """helper-71: a shard of 270,000 tensors (over MAX_TENSORS) loaded through the store, which
    skips parsing a header whose crc it knows, and was refused by load_file; save_file wrote such
    files too. Now a shard holds at most MAX_TENSORS, and save_file refuses more."""
    from aiotensor.formats import safetensors as st

    monkeypatch.setattr(st, "MAX_TENSORS", 100)
    state = {f"t{i}": torch.full((2,), float(i)) for i in range(250)}
    async with TensorStore(tmp_path / "store") as store:
        await store.save(1, state)
        assert_state_equal(await store.load(1), state)
    shards = sorted((tmp_path / "store" / "step-000000000001").glob("*.safetensors"))
    assert len(shards) == 3
    got: dict[str, torch.Tensor] = {}
    for f in shards:
        got |= await aiotensor.load_file(f)
    assert_state_equal(got, state)
    with pytest.raises(StateError, match="250 tensors in one safetensors file"):
        await aiotensor.save_file(state, tmp_path / "many.safetensors")
    # helper-73: a step written before shards were split, one shard over the count, made every
    # later incremental save fail (its header rebuilt to compare was refused); it is not reused
    monkeypatch.setattr(st, "MAX_TENSORS", 1000)
    async with TensorStore(tmp_path / "old") as store:
        await store.save(1, state)
        monkeypatch.setattr(st, "MAX_TENSORS", 100)
        await store.save(2, state)
        assert_state_equal(await store.load(2), state)


async def test_a_progress_that_cannot_report_and_an_empty_path_are_refused_at_the_call(tmp_path: Any) -> None:
    """helper-71: progress="..." failed the save after its copy with a bare TypeError; an async def
    progress was never awaited (the save 'succeeded', no progress came); save_file("") wrote a
    temporary file into the working folder's parent. Each is now a TypeError or ValueError at the
    call, before anything is written."""

    async def later(done: int, total: int) -> None:
        pass

    class Later:
        async def __call__(self, done: int, total: int) -> None:
            pass

    async with TensorStore(tmp_path / "store") as store:
        for bad in ("nope", later, Later()):
            with pytest.raises(TypeError, match="progress"):
                store.save(1, {"w": torch.ones(2)}, progress=bad)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="progress"):
                await aiotensor.load_file(tmp_path / "none.safetensors", progress=bad)  # type: ignore[arg-type]
        await store.save(1, {"w": torch.ones(2)}, progress=lambda done, total: None)
        with pytest.raises(TypeError, match="progress"):
            await store.load(1, progress=later)  # type: ignore[arg-type]
        assert store.steps() == [1]
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="path is empty"):
        await aiotensor.save_file({"w": torch.ones(2)}, "")
    with pytest.raises(ValueError, match="path is empty"):
        await aiotensor.load_file("")
    assert sorted(os.listdir(tmp_path)) == before
