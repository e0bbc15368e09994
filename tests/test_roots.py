"""Several processes on one root, stray and hostile folders, and what "committed" means (issue 9).

Multi-process cases use real processes (``tests/_procs.py``), never threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from typing import Any

import anyio
import pytest
import torch

import aiotensor
from aiotensor import TensorStore, load_file
from aiotensor.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManifestError,
    ReadOnlyStoreError,
    StaleStepError,
    StoreClosedError,
    StoreLockedError,
    UnsafePathError,
)
from aiotensor.formats import manifest as mf
from aiotensor.store.load import load_checkpoint
from aiotensor.testing import FaultyEngine

from .conftest import assert_state_equal, manifest_rows, set_manifest_rows, small_state, tmp_leftovers

pytestmark = pytest.mark.anyio
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(role: str, root: Any, *args: str, stdin: Any = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests._procs", role, str(root), *args],
        cwd=REPO,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def w(step: int) -> dict[str, Any]:
    return {"w": torch.full((10,), float(step)), "step": step}


# --- one writer, many readers ------------------------------------------------------------------


async def test_a_second_writer_process_is_refused_and_a_killed_writer_lets_go(tmp_path: Any) -> None:
    with child("hold", tmp_path, stdin=subprocess.PIPE) as holder:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=rf"{tmp_path}.*process {holder.pid}.*readonly=True"):
            async with TensorStore(tmp_path):
                pass
        # a reader is never refused, and sees the same (empty) root
        async with TensorStore(tmp_path, readonly=True) as reader:
            assert reader.steps() == []
        os.kill(holder.pid, signal.SIGKILL)  # the kernel drops the flock of a dead process
        holder.wait()
        async with TensorStore(tmp_path) as store:
            await store.save(1, w(1))


async def test_the_lock_goes_with_its_writer_not_with_a_helper_it_forked(tmp_path: Any) -> None:
    """A trainer that forked a long-lived helper, then crashed: the helper inherited the lock's
    open file, and the restarted trainer could not take the lock while the helper lived."""
    with child("hold-and-fork", tmp_path, stdin=subprocess.PIPE) as holder:
        assert holder.stdout is not None
        line = holder.stdout.readline().split()
        assert line[0] == "locked", line
        helper = int(line[1])
        try:
            with pytest.raises(StoreLockedError, match="or pass lock_timeout= to wait"):
                async with TensorStore(tmp_path):
                    pass
            with pytest.raises(StoreLockedError, match=r"lock_timeout=0.2 s was not long enough"):  # (helper-60)
                async with TensorStore(tmp_path, lock_timeout=0.2):
                    pass
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()
            os.kill(helper, 0)  # the helper lives on
            async with TensorStore(tmp_path, lock_timeout=10) as store:
                await store.save(1, w(1))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


def _child_runs(work: Any) -> None:
    """In a forked child: ``work()``, then exit 0, or print what it raised and exit 1 (never returns)."""
    code = 1
    try:
        work()
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def test_a_forked_child_loads_through_its_parents_store_but_never_writes(tmp_path: Any) -> None:
    """A child forked (outside the event loop, as multiprocessing's workers are) from a writer:
    it may load through the parent's store, but a save or delete would write beside the parent,
    which holds the lock: StoreClosedError; its close() leaves the parent's lock and saves alone."""
    store = TensorStore(tmp_path)

    async def parent_opens() -> None:
        await store.open()
        await store.save(1, w(1))

    anyio.run(parent_opens)

    async def child_work() -> None:
        assert (await store.load(1))["step"] == 1
        with pytest.raises(StoreClosedError, match="forked"):
            store.save(2, w(2))
        with pytest.raises(StoreClosedError, match="forked"):
            await store.delete(1)
        await store.close()

    pid = os.fork()
    if pid == 0:
        _child_runs(lambda: anyio.run(child_work))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    async def parent_goes_on() -> None:
        await store.save(2, w(2))  # the parent still holds the lock and writes
        with pytest.raises(StoreLockedError):
            await TensorStore(tmp_path).open()
        assert store.steps() == [1, 2]
        await store.close()

    anyio.run(parent_goes_on)


def test_a_child_forked_while_its_parent_saves_loads_through_its_store_too(tmp_path: Any) -> None:
    """helper-50: a child forked while the parent's saves were in flight (a DataLoader worker started
    mid-training) or just after ``open()`` (its background set-up still running) got RuntimeError
    "busy on another event loop" from ``load()``; allowed, it then waited for ever where the
    parent's writes held every admission slot (helper-53: its copy of the scheduler counted calls
    that never end in it). It loads; a save is refused as documented."""
    writing, slow = threading.Event(), [False]

    def hook(op: tuple[Any, ...]) -> None:
        if op[0] == "pwrite" and slow[0]:
            writing.set()
            time.sleep(1)  # the parent's writes hold their slots when it forks

    store = TensorStore(tmp_path, engine=FaultyEngine(hook=hook), incremental=False)

    async def parent() -> int:
        await store.open()
        await store.save(1, w(1))
        slow[0] = True
        saves = [store.save(s, {f"t{i}": torch.randn(1024, 1024) for i in range(16)}) for s in (2, 3)]
        await anyio.to_thread.run_sync(writing.wait, 30)
        await anyio.sleep(0.2)

        async def child_work() -> None:
            assert (await asyncio.wait_for(store.load(1), 30))["step"] == 1
            with pytest.raises(StoreClosedError, match="forked"):
                store.save(4, w(4))

        pid = os.fork()
        if pid == 0:
            _child_runs(lambda: asyncio.run(child_work()))
        status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
        slow[0] = False
        for h in saves:
            await h
        await store.close()
        return os.waitstatus_to_exitcode(status[1])

    assert anyio.run(parent) == 0


async def test_lock_timeout_waits_for_the_other_writer(tmp_path: Any) -> None:
    with child("hold", tmp_path, stdin=subprocess.PIPE) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def let_go() -> None:
                    await anyio.sleep(0.3)
                    assert holder.stdin is not None
                    holder.stdin.close()  # the holder leaves its `async with`

                tg.start_soon(let_go)
                t0 = time.monotonic()
                async with TensorStore(tmp_path, lock_timeout=20) as store:
                    assert time.monotonic() - t0 >= 0.25
                    await store.save(1, w(1))


async def test_two_stores_in_one_process_cannot_both_write(tmp_path: Any) -> None:
    async with TensorStore(tmp_path) as a:
        with pytest.raises(StoreLockedError):
            await TensorStore(tmp_path).open()
        await a.save(1, w(1))
    async with TensorStore(tmp_path) as b:  # released by close
        assert b.steps() == [1]


@pytest.mark.parametrize("how", ["root moved", "lock file removed"])
async def test_a_writer_whose_lock_file_is_gone_commits_nothing_more(tmp_path: Any, how: str) -> None:
    """A flock stays on the file it was taken on: with the root moved away (``mv ckpts ckpts.old``,
    then a new job at ``ckpts``) or its lock file removed, a second writer locked a new file there
    and both jobs wrote one folder, one's retention deleting the other's steps (helper-32). The
    first now fails each save at its commit point, and its delete and rollback, with
    StoreLockedError, committing and deleting nothing."""
    root = tmp_path / "ckpts"
    async with TensorStore(root, keep_last=1) as a:
        await a.save(1, w(1))
        if how == "root moved":
            os.rename(root, tmp_path / "ckpts.old")
        else:
            os.remove(root / ".aiotensor.lock")
        async with TensorStore(root, keep_last=1) as b:  # the new job
            await b.save(1000, w(1000))
            with pytest.raises(StoreLockedError, match="no longer the lock file this store holds"):
                await a.save(2, w(2))
            with pytest.raises(StoreLockedError):
                await a.delete(1)
            await b.save(1001, w(1001))
            assert b.steps() == [1001]
        assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-000000001001"]  # no step 2
        if how == "root moved":
            assert sorted(n for n in os.listdir(tmp_path / "ckpts.old") if n.startswith("step-")) == ["step-000000000001"]


async def test_reader_processes_never_see_a_broken_step_while_a_writer_saves_and_retires(tmp_path: Any) -> None:
    """Hundreds of cycles: a reader process polls, loads and checks every value, and opens and closes
    evaluator stores, while a writer process saves 200 steps with keep_last=2."""
    with child("reader", tmp_path) as reader, child("writer", tmp_path, "200") as writer:
        try:
            out, err = writer.communicate(timeout=100)
            assert writer.returncode == 0 and out.strip() == "done", err
            (tmp_path / "stop").write_text("")
            rout, rerr = reader.communicate(timeout=30)
            assert reader.returncode == 0, rerr
        finally:
            reader.kill()
            writer.kill()
    loads = int(rout.split()[0].split("=")[1])
    assert loads > 0, rout
    async with TensorStore(tmp_path, readonly=True) as store:
        assert store.steps() == [199, 200]
        assert_state_equal(await store.load(), {"w": torch.full((20_000,), 200.0), "b": torch.full((7,), -200.0), "step": 200})
    assert tmp_leftovers(str(tmp_path)) == []


async def test_a_readonly_store_writes_nothing(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, keep_last=1) as store:
        await store.save(1, w(1))
    (tmp_path / "step-000000000002.tmp-0123abcd").mkdir()  # a writer's save in progress
    eng = FaultyEngine()
    async with TensorStore(tmp_path, readonly=True, engine=eng, keep_last=1) as reader:
        assert await reader.refresh() == [1]
        assert_state_equal(await reader.load(), w(1))
        with pytest.raises(ReadOnlyStoreError):
            reader.save(2, w(2))
        with pytest.raises(ReadOnlyStoreError):
            await reader.delete(1)
    writes = {"create", "pwrite", "truncate", "sync", "mkdir", "rename", "sync_dir", "remove_tree"}
    assert [op for op in eng.ops if op[0] in writes] == []
    assert (tmp_path / "step-000000000002.tmp-0123abcd").is_dir()  # the writer's work is untouched


async def test_a_readonly_store_needs_an_existing_root(tmp_path: Any) -> None:
    with pytest.raises(CheckpointNotFoundError, match="never creates it"):
        await TensorStore(tmp_path / "missing", readonly=True).open()
    assert not (tmp_path / "missing").exists()


@pytest.mark.root
async def test_a_readonly_store_works_on_a_read_only_mount(tmp_path: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    async with TensorStore(src) as store:
        await store.save(3, w(3))
    try:
        subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(ro)], check=True, capture_output=True)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot bind-mount read-only here: {e}")
    try:
        with pytest.raises(OSError) as ei:  # a writer cannot even take the lock there
            await TensorStore(ro).open()
        assert ei.value.errno == errno.EROFS and str(ro) in str(ei.value)
        async with TensorStore(ro, readonly=True) as reader:
            assert_state_equal(await reader.load(3), w(3))
    finally:
        subprocess.run(["umount", str(ro)], check=False)


# --- what counts as a step ---------------------------------------------------------------------


async def test_stray_folders_are_ignored_and_never_counted_by_retention(tmp_path: Any, caplog: Any) -> None:
    (tmp_path / "step-999999999999").mkdir()  # empty: no manifest
    (tmp_path / "step-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff19").mkdir()  # full-width digits
    (tmp_path / "step-000000000003-old").mkdir()
    with caplog.at_level(logging.WARNING, logger="aiotensor"):
        async with TensorStore(tmp_path, keep_last=1) as store:
            assert store.steps() == []
            assert set(store.ignored) == {
                "step-999999999999",
                "step-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff19",
                "step-000000000003-old",
            }
            await store.save(2, w(2))
            assert store.steps() == [2]
            assert_state_equal(await store.load(), w(2))
    assert (tmp_path / "latest").read_text().strip() == "step-000000000002"
    assert (tmp_path / "step-999999999999").is_dir()  # not ours to delete
    assert "ignoring step-999999999999" in caplog.text


@pytest.mark.parametrize("keep_last", [1, None])
async def test_saving_a_step_older_than_a_committed_one_is_refused_and_rollback_allows_it(tmp_path: Any, keep_last: Any) -> None:
    """helper-44: a resume from an earlier step without rollback saved its steps beside the newer
    ones: `latest` (every later resume) still named the abandoned run's newest, and keep_last
    retired the new steps as they came; re-saving a committed step pointed at delete only."""
    async with TensorStore(tmp_path, keep_last=keep_last) as store:
        await store.save(200, w(200))  # left by an earlier run
        with pytest.raises(StaleStepError, match=r"would still name step 200.*rollback\(1\)"):
            store.save(2, w(2))
        with pytest.raises(CheckpointExistsError, match=r"rollback\(199\)"):
            store.save(200, w(200))
        assert store.steps() == [200]
        assert await store.rollback(1) == [200]
        assert store.steps() == []
        assert not (tmp_path / "latest").exists()
        await store.save(2, w(2))
        assert store.steps() == [2]
    assert (tmp_path / "latest").read_text().strip() == "step-000000000002"


async def test_delete_and_re_save_a_step(tmp_path: Any) -> None:
    async with TensorStore(tmp_path) as store:
        await store.save(1, w(1))
        await store.save(2, w(2))
        with pytest.raises(CheckpointExistsError, match="delete"):
            store.save(2, w(20))
        await store.delete(2)
        assert store.steps() == [1]
        assert (tmp_path / "latest").read_text().strip() == "step-000000000001"
        await store.save(2, w(20))
        assert_state_equal(await store.load(2), w(20))
        with pytest.raises(CheckpointNotFoundError):
            await store.delete(7)


async def test_rollback_refuses_while_a_newer_save_runs(tmp_path: Any) -> None:
    async with TensorStore(tmp_path) as store:
        await store.save(1, w(1))
        h = store.save(5, w(5))
        with pytest.raises(CheckpointExistsError, match=r"\[5\] are being saved"):
            await store.rollback(1)
        await h
        assert await store.rollback(1) == [5]


async def test_swapped_step_folders_are_refused(tmp_path: Any) -> None:
    async with TensorStore(tmp_path) as store:
        await store.save(1, w(1))
        await store.save(2, w(2))
    os.rename(tmp_path / "step-000000000001", tmp_path / "x")
    os.rename(tmp_path / "step-000000000002", tmp_path / "step-000000000001")
    os.rename(tmp_path / "x", tmp_path / "step-000000000002")
    async with TensorStore(tmp_path, readonly=True) as store:
        assert store.steps() == []
        with pytest.raises(ManifestError, match="of step 1, but its folder is step-000000000002"):
            await store.load(2)
    with pytest.raises(ManifestError, match="of step 2, but its folder"):
        await load_checkpoint(aiotensor.Scheduler(), tmp_path / "step-000000000001", step=1)


async def test_load_checks_the_type_of_step(tmp_path: Any) -> None:
    async with TensorStore(tmp_path) as store:
        await store.save(10, w(10))
        with pytest.raises(TypeError, match="step must be an int, got str '10'"):
            await store.load("10")  # type: ignore[arg-type]


# --- after the commit point --------------------------------------------------------------------

# (operation, which call of it): every file-system step after the step's rename and root fsync
AFTER_COMMIT = [
    ("create", 3), ("pwrite", 3), ("sync", 3), ("rename", 2), ("sync_dir", 3),  # `latest`
    ("rename", 3), ("sync_dir", 4),  # retiring step 1
    ("remove_tree", 1),  # deleting its files, in the background: logged only
]  # fmt: skip


@pytest.mark.parametrize("op,n", AFTER_COMMIT, ids=[f"{op}{n}" for op, n in AFTER_COMMIT])
async def test_a_fault_after_the_commit_point_never_fails_the_save(tmp_path: Any, op: str, n: int) -> None:
    async with TensorStore(tmp_path, keep_last=1) as store:
        await store.save(1, w(1))
    eng = FaultyEngine(fail={op: (n, errno.ENOSPC)})
    async with TensorStore(tmp_path, keep_last=1, engine=eng) as store:
        h = store.save(2, w(2))
        await h  # committed: no exception
        assert h.committed and 2 in store.steps()
        if op != "remove_tree":
            assert len(h.warnings) == 1 and "committed" in h.warnings[0], h.warnings
        # `latest` never names a step that is gone: where moving it failed, the step it names is not
        # retired (it was, and `ls` showed a latest that was not there: helper-32's full disk)
        named = (tmp_path / "latest").read_text().strip()
        assert (tmp_path / named / "manifest.json").exists(), f"latest names {named}, which is gone"
    assert eng.counts[op] >= n, "the fault was injected"
    async with TensorStore(tmp_path, keep_last=1) as store:  # the next open repairs
        assert_state_equal(await store.load(2), w(2))
        await store.save(3, w(3))
        assert store.steps() == [3]
    assert (tmp_path / "latest").read_text().strip() == "step-000000000003"
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["latest", "step-000000000003"]


async def test_latest_replaced_by_a_folder_does_not_stop_retention(tmp_path: Any) -> None:
    async with TensorStore(tmp_path, keep_last=1) as store:
        await store.save(1, w(1))
    os.remove(tmp_path / "latest")
    (tmp_path / "latest").mkdir()
    async with TensorStore(tmp_path, keep_last=1) as store:
        for s in (2, 3):
            h = store.save(s, w(s))
            await h
            assert any("latest" in m for m in h.warnings)
        assert store.steps() == [3]  # retention ran regardless
    assert not (tmp_path / "step-000000000001").exists() and not (tmp_path / "step-000000000002").exists()


async def test_the_real_error_is_raised_and_the_clean_up_failure_is_a_note(tmp_path: Any) -> None:
    eng = FaultyEngine(fail={"sync": (1, errno.EIO), "remove_tree": (1, errno.EROFS)})
    async with TensorStore(tmp_path, engine=eng) as store:
        with pytest.raises(OSError) as ei:
            await store.save(1, w(1))
    err = ei.value
    assert err.errno == errno.EIO and "shard-00000.safetensors" in str(err), err
    assert any("clean-up could not remove" in n and ".tmp-" in n for n in getattr(err, "__notes__", [])), err
    async with TensorStore(tmp_path) as store:  # the next writer removes the leftover
        assert store.steps() == []
    assert tmp_leftovers(str(tmp_path)) == []


async def test_a_writer_refuses_a_folder_that_is_a_checkpoint_itself(tmp_path: Any) -> None:
    """helper-40: TensorStore(a DCP checkpoint folder) opened it as an empty root and dropped its
    lock file into the user's checkpoint; a step folder of a store too."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "dcp"))
    async with TensorStore(tmp_path / "root") as s:
        await s.save(1, w(1))
    for folder in (tmp_path / "dcp", tmp_path / "root" / "step-000000000001"):
        before = sorted(os.listdir(folder))
        with pytest.raises(aiotensor.errors.CheckpointExistsError, match="is a checkpoint itself"):
            async with TensorStore(folder):
                pass
        assert sorted(os.listdir(folder)) == before


async def test_a_file_never_made_is_not_named_for_the_user_to_delete(tmp_path: Any, caplog: Any) -> None:
    """helper-39: on a read-only folder, save_file's temporary file failed to be made, then its
    clean-up failed too (EROFS) and a warning told the user to delete a file that was never there."""
    eng = FaultyEngine(fail={"create": (1, errno.EROFS), "remove_file": (1, errno.EROFS)})
    with pytest.raises(OSError) as ei:
        await aiotensor.save_file({"a": torch.ones(4)}, tmp_path / "x.safetensors", scheduler=aiotensor.Scheduler(eng))
    assert ei.value.errno == errno.EROFS and not getattr(ei.value, "__notes__", [])
    assert "delete it" not in caplog.text and os.listdir(tmp_path) == []
    made = FaultyEngine(fail={"sync": (1, errno.EIO), "remove_file": (1, errno.EROFS)})  # a file made, then left
    with pytest.raises(OSError) as ei:
        await aiotensor.save_file({"a": torch.ones(4)}, tmp_path / "y.safetensors", scheduler=aiotensor.Scheduler(made))
    assert any("delete it" in n for n in getattr(ei.value, "__notes__", [])) and "delete it" in caplog.text

    class Unseen(FaultyEngine):  # the leftover's stat fails too: it may be there, so it is named
        def stat(self, path: str) -> os.stat_result:
            if ".tmp-" in path:
                raise OSError(errno.EIO, "injected EIO on stat", path)
            return super().stat(path)

    unseen = Unseen(fail={"sync": (1, errno.EIO), "remove_file": (1, errno.EIO)})
    with pytest.raises(OSError) as ei:
        await aiotensor.save_file({"a": torch.ones(4)}, tmp_path / "z.safetensors", scheduler=aiotensor.Scheduler(unseen))
    assert any("delete it" in n for n in getattr(ei.value, "__notes__", []))


# --- the user's own files: never removed, replaced or written into ------------------------------


async def test_a_folder_named_latest_is_the_users_and_is_never_removed(tmp_path: Any, caplog: Any) -> None:
    notes = tmp_path / "latest" / "eval"
    notes.mkdir(parents=True)
    (notes / "results.json").write_text('{"acc": 0.9}')
    async with TensorStore(tmp_path) as store:  # no committed step: `latest` used to be removed here
        assert "folder" in store.ignored["latest"]
        h = store.save(1, w(1))
        await h
        assert any("latest" in m and "left alone" in m for m in h.warnings), h.warnings
        await store.delete(1)  # no step left: and here
        await store.save(2, w(2))
        await store.save(3, w(3))
        assert await store.rollback(1) == [3, 2]  # and here
    assert (notes / "results.json").read_text() == '{"acc": 0.9}'
    assert "left alone" in caplog.text


@pytest.mark.parametrize("kind", ["symlink", "hard link", "other contents"])
async def test_a_latest_file_aiotensor_did_not_write_is_left_alone(tmp_path: Any, kind: str) -> None:
    root, mine = tmp_path / "root", tmp_path / "mine.txt"
    root.mkdir()
    mine.write_text("step-000000000009\n")  # even a step name: only the library's own file is replaced
    latest = root / "latest"
    if kind == "symlink":
        latest.symlink_to(mine)
    elif kind == "hard link":
        os.link(mine, latest)
    else:
        latest.write_text("my notes\n")
    before = os.lstat(latest)
    async with TensorStore(root) as store:
        assert "latest" in store.ignored
        await store.save(1, w(1))
        await store.save(2, w(2))
        await store.delete(2)
        await store.delete(1)
    after = os.lstat(latest)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # the same entry, never replaced
    assert mine.read_text() == "step-000000000009\n"
    if kind == "other contents":
        assert latest.read_text() == "my notes\n"


@pytest.mark.parametrize("kind", ["hard link", "symlink", "fifo", "folder", "other contents"])
async def test_a_lock_file_aiotensor_did_not_make_is_refused_and_never_written(tmp_path: Any, kind: str) -> None:
    root, mine = tmp_path / "root", tmp_path / "mine.txt"
    root.mkdir()
    mine.write_text("precious\n")
    lock = root / ".aiotensor.lock"
    if kind == "hard link":
        os.link(mine, lock)  # the old code truncated mine.txt and wrote its pid there
    elif kind == "symlink":
        lock.symlink_to(mine)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        lock.write_text("precious\n")
    with pytest.raises(UnsafePathError, match=r"\.aiotensor\.lock: is .*not the lock file aiotensor makes"):
        async with TensorStore(root):
            pass
    assert mine.read_text() == "precious\n"
    if kind == "other contents":
        assert lock.read_text() == "precious\n"
    async with TensorStore(root, readonly=True) as reader:  # readers never touch the lock
        assert reader.steps() == []


async def test_the_lock_file_is_never_truncated_before_it_is_held(tmp_path: Any) -> None:
    with child("hold", tmp_path, stdin=subprocess.PIPE) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=rf"process {holder.pid}"):
            async with TensorStore(tmp_path):
                pass
        assert (tmp_path / ".aiotensor.lock").read_text() == f"{holder.pid}\n"  # the holder's pid, intact
        holder.stdin.close()
        holder.wait()


# --- hostile and damaged folders ---------------------------------------------------------------


async def _one_step(root: Any) -> Any:
    async with TensorStore(root) as store:
        await store.save(1, small_state(1))
    return root / "step-000000000001"


@pytest.mark.parametrize("name", ["shard-00000.safetensors", "manifest.json"])
async def test_a_fifo_in_a_checkpoint_is_refused_never_read(tmp_path: Any, name: str) -> None:
    folder = await _one_step(tmp_path)
    os.remove(folder / name)
    os.mkfifo(folder / name)
    with anyio.fail_after(10):
        async with TensorStore(tmp_path, readonly=True) as store:
            if name == "manifest.json":
                assert "step-000000000001" in store.ignored
            with pytest.raises(UnsafePathError, match="FIFO"):
                await store.load(1)


async def test_symlinks_inside_a_root_are_never_followed(tmp_path: Any) -> None:
    root = tmp_path / "root"
    folder = await _one_step(root)
    outside = tmp_path / "outside.safetensors"
    os.rename(folder / "shard-00000.safetensors", outside)
    os.symlink(outside, folder / "shard-00000.safetensors")
    async with TensorStore(root, readonly=True) as store:
        with pytest.raises(UnsafePathError, match="symbolic link"):
            await store.load(1)
    os.remove(folder / "shard-00000.safetensors")
    os.rename(outside, folder / "shard-00000.safetensors")
    os.rename(folder, tmp_path / "real-step")
    os.symlink(tmp_path / "real-step", folder)  # a step folder that is a link
    async with TensorStore(root, readonly=True) as store:
        assert store.steps() == [] and "symbolic link" in store.ignored["step-000000000001"]


async def test_load_file_refuses_fifos_and_devices(tmp_path: Any) -> None:
    os.mkfifo(tmp_path / "pipe.safetensors")
    with anyio.fail_after(10):
        with pytest.raises(UnsafePathError, match="FIFO"):
            await load_file(tmp_path / "pipe.safetensors")
        with pytest.raises(UnsafePathError, match="character device"):
            await load_file("/dev/zero")


def _sealed_manifest(doc: dict[str, Any]) -> bytes:
    return mf.seal(doc)


async def test_hostile_manifests_are_refused_within_bounded_memory(tmp_path: Any) -> None:
    """A correctly sealed manifest (an attacker can compute crc32c) full of junk: refused, with parse
    memory within a small multiple of the file's size and a short message."""
    folder = tmp_path / "step-000000000001"
    folder.mkdir()
    cases = {
        "shape of 4M dims": {"format": mf.FORMAT, "version": 1, "step": 1, "shards": [], "aliases": {}, "tree": None,
                             "tensors": {"t": {"shard": "s", "dtype": "F32", "shape": [1] * 4_000_000, "offset": 0, "nbytes": 4, "crc32c": 0}}},
        "a million empty objects": {"format": mf.FORMAT, "version": 1, "step": 1, "junk": [{}] * 1_000_000},
    }  # fmt: skip
    for what, doc in cases.items():
        data = _sealed_manifest(doc)
        (folder / "manifest.json").write_bytes(data)
        tracemalloc.start()
        try:
            with pytest.raises(ManifestError) as ei:
                await load_checkpoint(aiotensor.Scheduler(), folder)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 * len(data) + (16 << 20), f"{what}: parsing took {peak} bytes for a {len(data)} byte file"
        assert len(str(ei.value)) < 1000, f"{what}: a {len(str(ei.value))} character message"


async def test_absurd_zero_element_shapes_are_format_errors(tmp_path: Any) -> None:
    folder = await _one_step(tmp_path)
    doc = json.loads((folder / "manifest.json").read_bytes())
    rows = manifest_rows(doc)
    key = next(iter(rows))
    rows[key]["shape"] = [0, 2**70]
    rows[key]["nbytes"] = 0
    set_manifest_rows(doc, rows)
    (folder / "manifest.json").write_bytes(mf.seal(doc))
    with pytest.raises(ManifestError, match="shape"):
        await load_checkpoint(aiotensor.Scheduler(), folder)


async def test_a_load_keeps_few_files_open(tmp_path: Any) -> None:
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(300)}
    async with TensorStore(tmp_path, shard_bytes=256) as store:  # one shard per tensor
        await store.save(1, state)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 40, hard))
    try:
        async with TensorStore(tmp_path, readonly=True) as store:
            assert_state_equal(await store.load(1), state)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_dense_safetensors_header_is_refused_within_bounded_memory(tmp_path: Any) -> None:
    """A 20 MB header of `{"t":{"dtype":"F32","shape":[1,1,1,...]}}` (10M dims) is refused before parsing."""
    text = b'{"t":{"dtype":"F32","shape":[' + b"1," * 10_000_000 + b'1],"data_offsets":[0,4]}}'
    path = tmp_path / "dense.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"\0" * 4)
    tracemalloc.start()
    try:
        with pytest.raises(aiotensor.errors.HeaderError) as ei:
            await load_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(text) + (16 << 20), peak
    assert len(str(ei.value)) < 1000


async def test_a_step_retired_while_the_root_is_listed_is_not_reported(tmp_path: Any, caplog: Any) -> None:
    async with TensorStore(tmp_path) as store:
        await store.save(1, w(1))
        await store.save(2, w(2))

    class Racing(aiotensor.PosixEngine):
        """A writer retires step 1 between this reader's listdir and its look at the folder."""

        def listdir(self, path: str) -> list[str]:
            names = super().listdir(path)
            one = os.path.join(path, "step-000000000001")
            if os.path.exists(one):
                os.rename(one, os.path.join(path, "step-000000000001.tmp-del0123abcd"))
            return names

    caplog.set_level(logging.INFO, logger="aiotensor")
    async with TensorStore(tmp_path, readonly=True, engine=Racing()) as reader:
        assert reader.steps() == [2]
        assert "step-000000000001" not in reader.ignored  # it was retired, not broken
    assert "no manifest" not in caplog.text and "ignoring step-000000000001" not in caplog.text


async def test_latest_replaced_while_it_is_read_is_read_again_not_taken_for_a_foreign_file(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that opened `latest` just as the writer renamed a new one over it found a file with
    no link left and called it foreign (a warning, and `ls` said so: 11 of 75,129 listings,
    helper-32). It reads the new one."""
    from aiotensor import root as root_module

    async with TensorStore(tmp_path) as store:
        await store.save(1, w(1))
    real, calls = os.fstat, []

    def replaced_once(fd: int) -> os.stat_result:
        meta = real(fd)
        calls.append(fd)
        if len(calls) == 1:  # as if the writer's rename had just unlinked it
            fields = list(meta)
            fields[3] = 0  # st_nlink
            return os.stat_result(fields)
        return meta

    monkeypatch.setattr(root_module.os, "fstat", replaced_once)
    assert root_module.read_latest(aiotensor.PosixEngine(), str(tmp_path)) == ("step-000000000001", "")
    assert len(calls) == 2
