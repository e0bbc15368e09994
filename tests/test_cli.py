"""The `aiotensor` command (issue 15): each command on real files, bad input, exit codes, --json,
progress on a real pseudo-terminal and silence off it."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from typing import Any

import anyio
import pytest
import torch

from aiotensor import TensorStore, load_file, load_torch, save_file
from aiotensor.cli import main, parser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aiotensor", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.fixture
def files(tmp_path: Any) -> dict[str, Any]:
    w = {f"layers.{i}.w": torch.randn(128, 64) for i in range(4)}

    async def make() -> None:
        async with TensorStore(tmp_path / "ckpts") as store:
            await store.save(1, {"model": w, "step": 1})
            await store.save(2, {"model": w, "step": 2})
        await save_file(w, tmp_path / "m.safetensors")

    anyio.run(make)
    torch.save(w, tmp_path / "m.pt")
    (tmp_path / "ckpts" / "step-000000000009.tmp-0123abcd").mkdir()
    (tmp_path / "ckpts" / "step-999").mkdir()
    return {"root": tmp_path, "w": w}


def test_ls_inspect_verify(files: dict[str, Any], capsys: Any) -> None:
    root = files["root"]
    assert main(["ls", str(root / "ckpts")]) == 0
    out = capsys.readouterr().out
    assert "step            1" in out and "step            2" in out and "in progress" in out and "ignored" in out
    assert main(["ls", str(root / "ckpts"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in doc["entries"] if e["state"] == "committed"] == [1, 2]
    for path, kind in [(root / "ckpts", "root"), (root / "m.safetensors", "safetensors"), (root / "m.pt", "torch")]:
        assert main(["inspect", str(path), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["kind"] == kind and doc["total_bytes"] == 4 * 128 * 64 * 4, path
        assert main(["verify", str(path)]) == 0, path
        assert capsys.readouterr().out.startswith("OK")


def test_verify_names_the_bad_tensor_and_file(files: dict[str, Any], capsys: Any) -> None:
    shard = files["root"] / "ckpts" / "step-000000000002" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x08
    shard.write_bytes(bytes(data))
    assert main(["verify", str(files["root"] / "ckpts")]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "ChecksumError" in out and "shard-00000" in out and "layers.3.w" in out
    assert out.splitlines()[-1].endswith("ckpts: 1 problem; 1 of 2 sources read whole"), out  # and a count


@pytest.mark.parametrize("damage", ["dtype", "shape digit", "padding", "bytes appended", "shard gone"])
def test_every_reader_of_a_step_refuses_a_shard_its_load_refuses(files: dict[str, Any], damage: str, capsys: Any) -> None:
    """helper-60: a byte changed in a shard's header, or bytes appended, and `verify` said OK (its
    stream of the step read by the manifest's offsets) while the store's load() refused the step;
    a shard gone made ls list no step at all, and verify call it retired. Now the step's readers
    check each shard as load() does, as they open it for its data: verify, stream and load_into
    fail; ls, which reads no data, lists a step whose shard is gone as damaged beside the good one
    (exit 1)."""
    from aiotensor import load_into, stream
    from aiotensor.errors import FormatError

    root = files["root"] / "ckpts"
    step = root / "step-000000000002"
    shard = step / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode()
    if damage == "dtype":
        data[8 + header.index('"F32"') + 2] ^= 1  # F32 -> F22
    elif damage == "shape digit":
        data[8 + header.index('"shape":[') + 9] ^= 1
    elif damage == "padding":
        data[8 + n - 1] ^= 1  # a space of the pad: no longer one
    elif damage == "bytes appended":
        data += b"\0" * 100
    shard.write_bytes(bytes(data))
    if damage == "shard gone":
        shard.unlink()

    async def load() -> None:
        async with TensorStore(root, readonly=True) as store:
            await store.load(2)

    bad = (FormatError, FileNotFoundError)
    with pytest.raises(bad):
        anyio.run(load)
    assert main(["verify", str(step)]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and ("damaged, a file it lists is not there" in out if damage == "shard gone" else "shard-00000" in out)

    async def streamed() -> None:
        async with stream(step) as s:
            async for _ in s:
                pass

    with pytest.raises(bad):
        anyio.run(streamed)
    holder = torch.nn.Module()  # of the step's names: model.layers.{i}.w
    for k, v in files["w"].items():
        *path, leaf = f"model.{k}".split(".")
        m = holder
        for p in path:
            if not hasattr(m, p):
                m.add_module(p, torch.nn.Module())
            m = getattr(m, p)
        m.register_buffer(leaf, torch.empty_like(v))
    with pytest.raises(bad):
        anyio.run(load_into, holder, step)
    from aiotensor import dcp as aiotensor_dcp

    with pytest.raises(bad):  # (helper-62: DCP's readers of a step skipped the check)
        aiotensor_dcp.load_full(step)
    assert main(["ls", str(root)]) == (1 if damage == "shard gone" else 0)
    out = capsys.readouterr().out
    assert "step            1" in out and ("step-000000000002  [damaged:" in out) == (damage == "shard gone"), out


def test_verify_of_a_root_being_trained_on_an_odd_step_folder_and_an_empty_root(
    files: dict[str, Any], capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-31/32's trials: a step retired by the writer while verify ran (a store being trained
    on, keep_last=) was BAD, exit 1, every time; a folder named as a step that is none (no
    manifest, or unreadable: `latest` may name it) was passed over with OK; a root with nothing
    to verify said OK, "every byte checked", exit 0."""
    import shutil

    import aiotensor.cli as cli_module

    ckpts = files["root"] / "ckpts"
    resolve = cli_module._resolve

    def retiring(path: str) -> Any:
        if path.endswith("step-000000000001"):
            shutil.rmtree(path)  # the writer's retention, as verify reaches it
        return resolve(path)

    monkeypatch.setattr(cli_module, "_resolve", retiring)
    assert main(["verify", str(ckpts)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "1 step (1 step retired by its writer meanwhile: step-000000000001)" in out, out
    monkeypatch.setattr(cli_module, "_resolve", resolve)
    (ckpts / "step-000000000005").mkdir()  # named as a step, no manifest
    assert main(["verify", str(ckpts)]) == 1
    out = capsys.readouterr().out
    assert "BAD  step-000000000005:" in out and out.splitlines()[-1].endswith("1 problem; 1 of 1 source read whole"), out
    empty = files["root"] / "empty"
    empty.mkdir()
    (empty / ".aiotensor.lock").write_text("")
    assert main(["verify", str(empty)]) == 3
    assert capsys.readouterr().out.startswith("NONE")


def test_convert_step_of_a_store_root_is_the_step_read(files: dict[str, Any], capsys: Any) -> None:
    """`convert ROOT out.safetensors --step 1` made a store folder named out.safetensors holding the
    newest step labelled step 1, exit 0 (helper-32): of a store root, --step is the step read (a
    .safetensors DST is safetensors); a step converted to a checkpoint keeps its number; of another
    source, --step names a checkpoint output's step and is refused with other outputs."""
    root = files["root"]
    (root / "ckpts" / "step-999").rmdir()
    anyio.run(_save_step_3, root / "ckpts")
    assert main(["convert", str(root / "ckpts"), str(root / "out.safetensors"), "--step", "1"]) == 0
    assert torch.equal(anyio.run(load_file, root / "out.safetensors")["model.layers.0.w"], files["w"]["layers.0.w"])
    assert main(["convert", str(root / "ckpts"), str(root / "copy"), "--to", "checkpoint", "--step", "2"]) == 0
    assert sorted(n for n in os.listdir(root / "copy") if n.startswith("step-")) == ["step-000000000002"]
    assert main(["convert", str(root / "m.pt"), str(root / "x.safetensors"), "--step", "1"]) == 1
    assert "no store root" in capsys.readouterr().err
    assert main(["convert", str(root / "ckpts"), str(root / "y.safetensors"), "--step", "5"]) == 1
    assert "no committed step 5" in capsys.readouterr().err
    assert main(["convert", str(root / "ckpts"), str(root / "again"), "--step", "1"]) == 0  # no suffix: a checkpoint
    assert sorted(n for n in os.listdir(root / "again") if n.startswith("step-")) == ["step-000000000001"]


async def _save_step_3(path: Any) -> None:
    async with TensorStore(path) as store:
        await store.save(3, {"model": {"layers.0.w": torch.zeros(2)}, "step": 3})


def test_bad_input_and_usage(tmp_path: Any, capsys: Any) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_text("not a tensor file at all, just text")
    assert main(["verify", str(tmp_path / "junk.safetensors")]) == 1
    assert "not a safetensors file" in "".join(capsys.readouterr())
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    for sub in ("ls", "inspect", "verify", "convert"):
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0 and "example" in capsys.readouterr().out
    r = cli("--help")  # the real entry point, as a user runs it
    assert r.returncode == 0 and "examples:" in r.stdout


def test_convert_between_formats(files: dict[str, Any]) -> None:
    root, w = files["root"], files["w"]
    assert main(["convert", str(root / "m.pt"), str(root / "out.safetensors")]) == 0
    assert all(torch.equal(v, w[k]) for k, v in anyio.run(load_file, root / "out.safetensors").items())
    assert main(["convert", str(root / "ckpts"), str(root / "hf"), "--shard-size", "40KB"]) == 0
    index = json.loads((root / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4 and not [n for n in os.listdir(root) if ".tmp-" in n]
    assert main(["convert", str(root / "hf"), str(root / "back.pt")]) == 0
    got = anyio.run(load_torch, root / "back.pt")
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in w.items())
    assert main(["convert", str(root / "m.safetensors"), str(root / "store2"), "--step", "5"]) == 0

    async def check() -> None:
        async with TensorStore(root / "store2", readonly=True) as s:
            assert s.steps() == [5] and torch.equal((await s.load())["layers.0.w"], w["layers.0.w"])

    anyio.run(check)


def test_a_torch_file_of_parameters_inspects_and_converts_to_every_output(tmp_path: Any, capsys: Any) -> None:
    """helper-39: a torch.save file holding nn.Parameters (state_dict(keep_vars=True), one with an
    attribute) crashed inspect and convert (AttributeError), convert after writing its output."""
    p = torch.nn.Parameter(torch.randn(2, 3))
    p.tp_dim = 0  # Megatron-style
    torch.save({"w": p, "b": torch.nn.Parameter(torch.ones(3), requires_grad=False), "lr": 0.5}, tmp_path / "p.pt")
    assert main(["inspect", str(tmp_path / "p.pt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "torch"
    assert main(["convert", str(tmp_path / "p.pt"), str(tmp_path / "p.safetensors")]) == 0
    assert "dropped 1 values" in capsys.readouterr().out
    assert torch.equal(anyio.run(load_file, tmp_path / "p.safetensors")["w"], p.detach())
    assert main(["convert", str(tmp_path / "p.pt"), str(tmp_path / "q.pt")]) == 0
    assert anyio.run(load_torch, tmp_path / "q.pt")["lr"] == 0.5
    assert main(["convert", str(tmp_path / "p.pt"), str(tmp_path / "ck"), "--to", "checkpoint"]) == 0


def test_convert_names_the_tensors_it_renames_and_refuses_a_shard_size_under_one_byte(tmp_path: Any, capsys: Any) -> None:
    """helper-39: two paths of one dotted name were renamed (``a.b#2``) without a word; a shard
    size of 0 or -1 wrote a shard per tensor, and inf was a traceback."""
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, tmp_path / "dot.pt")
    assert main(["convert", str(tmp_path / "dot.pt"), str(tmp_path / "dot.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "1 tensor renamed" in out and ": a.b#2)" in out, out
    from safetensors.torch import save_file as st_save  # a flat file's own "x#2" is no rename (helper-41)

    st_save({"x": torch.ones(1), "x#2": torch.zeros(1)}, tmp_path / "h.safetensors")
    assert main(["convert", str(tmp_path / "h.safetensors"), str(tmp_path / "h2.safetensors")]) == 0
    assert "renamed" not in capsys.readouterr().out
    for bad in ("0", "-1", "inf", "0.1"):
        with pytest.raises(SystemExit) as e:
            main(["convert", str(tmp_path / "dot.pt"), str(tmp_path / f"o{bad}/"), "--shard-size", bad])
        assert e.value.code == 2 and "positive size" in capsys.readouterr().err, bad
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o")]


def test_progress_on_a_terminal_only(files: dict[str, Any]) -> None:
    target = str(files["root"] / "m.safetensors")
    r = cli("verify", target)
    assert "\r" not in r.stderr and "verifying" not in r.stderr  # not a terminal: quiet
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child, on a pseudo-terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "aiotensor", "verify", target])
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, out
    assert b"verifying" in out and b"100%" in out and b"/s" in out, out


def test_bench_writes_a_report_and_a_plot(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "report.md"
    assert main(["bench", "--dir", str(tmp_path), "--size", "8MB", "--reps", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| aiotensor |" in text and "| torch.save |" in text and "| safetensors |" in text and "| dcp |" in text
    assert "load / disk read" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot" in text
    else:
        png = tmp_path / "report.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "report.png" in text
    assert not [n for n in os.listdir(tmp_path) if n.startswith("aiotensor-bench-")], "the bench cleans up"


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_dcp_checkpoints_inspect_verify_and_convert(tmp_path: Any, capsys: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from aiotensor.dcp import AiotensorWriter

    w = {"model": {"w": torch.randn(8, 4), "b": torch.zeros(4)}}
    dcp.save(w, storage_writer=AiotensorWriter(tmp_path / "ours" / "step-000000000001"))
    dcp.save(w, checkpoint_id=tmp_path / "theirs")  # DCP's FileSystemWriter
    capsys.readouterr()
    for path in (tmp_path / "ours" / "step-000000000001", tmp_path / "theirs"):
        record = ".metadata.json" if path.name.startswith("step") else ".metadata"
        assert main(["inspect", str(path / record)]) == 0  # its record named: the checkpoint (helper-60: "a legacy torch.save")
        assert capsys.readouterr().out.split(": ")[1].startswith("dcp, 2 tensors")
        code = main(["inspect", str(path), "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        doc = json.loads(captured.out)
        assert doc["kind"] == "dcp" and doc["tensors"]["model.w"]["shape"] == [8, 4]
        assert main(["verify", str(path)]) == 0
        out = tmp_path / f"{path.name}.safetensors"
        assert main(["convert", str(path), str(out)]) == 0
        assert torch.equal(anyio.run(load_file, out)["model.w"], w["model"]["w"])
        capsys.readouterr()
    # a tensor inside a pickled value (a tuple) is a value the safetensors output drops, named (helper-41)
    dcp.save({"w": torch.randn(3), "pair": (torch.ones(2), 3)}, checkpoint_id=tmp_path / "pair")
    assert main(["convert", str(tmp_path / "pair"), str(tmp_path / "pair.safetensors")]) == 0
    assert "dropped 2 values safetensors cannot hold: pair.0, pair.1" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_before_or_after_the_command(tmp_path: Any, where: str) -> None:
    """`aiotensor ls -v ckpts/` was a usage error: -v was the top parser's only (helper-50)."""

    async def make() -> None:
        async with TensorStore(tmp_path / "ck", keep_last=1) as store:
            for step in (1, 2):
                await store.save(step, {"w": torch.ones(2)})

    anyio.run(make)
    args = ["-v", "ls", str(tmp_path / "ck")] if where == "before" else ["ls", "-v", str(tmp_path / "ck")]
    out = subprocess.run([sys.executable, "-m", "aiotensor", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "step" in out.stdout
    no_v = subprocess.run(
        [sys.executable, "-m", "aiotensor", "ls", str(tmp_path / "ck")], capture_output=True, text=True, timeout=120
    )
    assert no_v.returncode == 0 and no_v.stdout == out.stdout
    assert parser().parse_args(args).verbose is True
    assert parser().parse_args(["ls", "x"]).verbose is False


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")  # (DCP's, as test_dcp)
def test_a_checkpoint_of_dcps_own_writer_in_a_store_root_is_said_to_be_one(tmp_path: Any, capsys: Any) -> None:
    """A folder named as a step that DCP's own writer made: `ls` said it was no checkpoint, and
    `verify` of the root counted it bad (exit 1), while `verify` of the folder read it (helper-64).
    It is a checkpoint the store did not commit: said so, and not counted bad."""
    import torch.distributed.checkpoint as dcp

    async def save() -> None:
        async with TensorStore(tmp_path) as store:
            await store.save(1, {"w": torch.ones(2)})

    anyio.run(save)
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / "step-000000000002")  # DCP's FileSystemWriter
    capsys.readouterr()
    assert main(["ls", str(tmp_path)]) == 0
    assert "a checkpoint of DCP's own writer (.metadata), not a step of this store" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 0
    assert main(["verify", str(tmp_path / "step-000000000002")]) == 0  # read whole, against DCP's own CRC-32s
    capsys.readouterr()
    assert main(["info", str(tmp_path / "step-000000000002")]) == 0  # (inspect's other name, as the store's info())
    assert "w" in capsys.readouterr().out
