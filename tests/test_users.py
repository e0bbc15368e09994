"""What a serving and training user hit (issue 23), on files made by the real writers: safetensors'
``save_file``, ``torch.save``, DCP's ``FileSystemWriter``, Hugging Face folder layouts as
``save_pretrained`` writes them. Each test failed on the code before the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import anyio
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from aiotensor import TensorStore, load_file, load_torch, stream
from aiotensor.cli import main
from aiotensor.dcp import AiotensorReader, AiotensorWriter
from aiotensor.errors import MismatchError

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _weights(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"model.layers.{i}.weight": torch.randn(32, 16, generator=g) for i in range(n)} | {
        "lm_head.weight": torch.randn(8, 16, generator=g)
    }


def _hf_folder(folder: Any, w: dict[str, torch.Tensor], *, kind: str) -> None:
    """A folder as transformers' save_pretrained writes it: one file, or shards with an index; of
    safetensors (safetensors.torch.save_file) or of torch.save (.bin)."""
    folder.mkdir()
    if kind == "safetensors":
        name, write, index = (
            "model{}.safetensors",
            lambda d, p: safetensors.torch.save_file(d, p, {"format": "pt"}),
            "model.safetensors.index.json",
        )
    else:
        name, write, index = "pytorch_model{}.bin", lambda d, p: torch.save(d, p), "pytorch_model.bin.index.json"
    keys = sorted(w)
    if len(keys) == 1 or kind.endswith("single"):
        write(w, folder / name.format(""))
        return
    shards = [keys[i::2] for i in range(2)]
    weight_map = {}
    for i, ks in enumerate(shards):
        fname = name.format(f"-{i + 1:05d}-of-{len(shards):05d}")
        write({k: w[k] for k in ks}, folder / fname)
        weight_map |= dict.fromkeys(ks, fname)
    (folder / index).write_text(
        json.dumps({"metadata": {"total_size": sum(t.nbytes for t in w.values())}, "weight_map": weight_map})
    )


def _flip(path: Any, at: int = -64) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


# --- 23.5: verify says what it could check ------------------------------------------------------------


def test_verify_of_files_without_checksums_is_not_ok(tmp_path: Any, capsys: Any) -> None:
    """safetensors' own files and DCP's FileSystemWriter carry no checksum: verify reads them whole
    (structure) but cannot vouch for their bytes; exit 3 and says so, also after a flipped bit."""
    w = _weights()
    _hf_folder(tmp_path / "hf", w, kind="safetensors")
    dcp.save({"model": w, "step": 3}, checkpoint_id=tmp_path / "dcp")
    for path in (tmp_path / "hf", tmp_path / "dcp"):
        assert main(["verify", str(path)]) == 3, path
        out = capsys.readouterr().out
        assert not out.startswith("OK") and "checksum" in out, out
    assert main(["verify", str(tmp_path / "hf")]) == 3
    out = capsys.readouterr().out
    assert "2 files" in out and "5 tensors" in out, out
    _flip(tmp_path / "hf" / "model-00001-of-00002.safetensors")
    assert main(["verify", str(tmp_path / "hf")]) == 3  # read whole, not vouched for: never "OK"
    assert not capsys.readouterr().out.startswith("OK")


def test_verify_counts_the_files_of_a_checksummed_store(tmp_path: Any, capsys: Any) -> None:
    async def make() -> None:
        async with TensorStore(tmp_path / "ckpts", shard_bytes=4096) as store:
            await store.save(1, {"model": _weights(), "step": 1})

    anyio.run(make)
    assert main(["verify", str(tmp_path / "ckpts")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and "5 tensors" in out and "1 file" not in out, out


# --- 23.6: stream(dtype=) converts floating point only ------------------------------------------------


async def test_stream_dtype_leaves_integer_tensors_alone(tmp_path: Any) -> None:
    w = {"position_ids": torch.arange(300).unsqueeze(0), "w": torch.randn(4, 4, dtype=torch.float32)}
    safetensors.torch.save_file(w, tmp_path / "m.safetensors")
    got = {k: t async for k, t in stream(tmp_path / "m.safetensors", dtype=torch.bfloat16)}
    assert got["position_ids"].dtype == torch.int64 and torch.equal(got["position_ids"], w["position_ids"])
    assert got["w"].dtype == torch.bfloat16
    every = {k: t async for k, t in stream(tmp_path / "m.safetensors", dtype=lambda name, d: torch.bfloat16)}
    assert every["position_ids"].dtype == torch.bfloat16  # asked for explicitly: 257 becomes 256, as asked
    for bad in ("float16", 5):  # a rule that returns other than a dtype or None: TypeError, as documented (helper-50)
        with pytest.raises(TypeError, match="'w'"):
            async for _ in stream(tmp_path / "m.safetensors", dtype=lambda name, d, bad=bad: None if name != "w" else bad):
                pass


# --- 23.7, 23.9, 23.10: convert keeps what the target holds, writes where the user said ---------------


def _trained_state() -> dict[str, Any]:
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(2):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        sched.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "step": 7}


@pytest.mark.parametrize("source", ["store", "dcp"])
@pytest.mark.parametrize("target", ["torch", "checkpoint"])
def test_convert_keeps_the_training_state(tmp_path: Any, source: str, target: str) -> None:
    from .conftest import assert_state_equal

    state = _trained_state()
    if source == "store":

        async def make() -> None:
            async with TensorStore(tmp_path / "src") as store:
                await store.save(7, state)

        anyio.run(make)
    else:
        dcp.save(state, checkpoint_id=tmp_path / "src")
    dst = tmp_path / ("out.pt" if target == "torch" else "out")
    # --step: of a store root, the step read; of a DCP folder, a checkpoint output's step
    step = ["--step", "7"] if source == "store" or target == "checkpoint" else []
    assert main(["convert", str(tmp_path / "src"), str(dst), "--to", target, *step]) == 0

    async def back() -> Any:
        if target == "torch":
            return await load_torch(dst)
        async with TensorStore(dst, readonly=True) as s:
            return await s.load()

    got = anyio.run(back)
    assert got["step"] == 7 and got["optim"]["param_groups"][0]["lr"] == state["optim"]["param_groups"][0]["lr"]
    assert got["optim"]["param_groups"][0]["betas"] == state["optim"]["param_groups"][0]["betas"] or source == "dcp"
    assert_state_equal(got["model"], state["model"])
    assert_state_equal(got["sched"], state["sched"])


def test_convert_to_safetensors_names_what_it_drops(tmp_path: Any, capsys: Any) -> None:
    async def make() -> None:
        async with TensorStore(tmp_path / "src") as store:
            await store.save(7, _trained_state())

    anyio.run(make)
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out.safetensors")]) == 0
    said = "".join(capsys.readouterr())
    assert "dropped 24 values" in said and "optim.param_groups.0.lr" in said, said
    got = anyio.run(load_file, tmp_path / "out.safetensors")
    assert "model.weight" in got and "optim.state.0.exp_avg" in got


def test_convert_to_a_folder_with_shard_size_writes_into_that_folder(tmp_path: Any, capsys: Any) -> None:
    """Under the shard size: dst/model.safetensors (as save_pretrained), not a file named dst-2GB."""
    safetensors.torch.save_file(_weights(), tmp_path / "m.safetensors")
    assert main(["convert", str(tmp_path / "m.safetensors"), str(tmp_path / "out") + "/", "--shard-size", "2GB"]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out-")]
    assert str(tmp_path / "out") in capsys.readouterr().out


def test_convert_writes_format_pt_metadata_as_transformers_expects(tmp_path: Any) -> None:
    torch.save(_weights(), tmp_path / "m.pt")
    for dst, extra in ((tmp_path / "one.safetensors", []), (tmp_path / "hf", ["--shard-size", "1KB"])):
        assert main(["convert", str(tmp_path / "m.pt"), str(dst), *extra]) == 0
        files = [dst] if dst.is_file() else sorted(dst.glob("*.safetensors"))
        assert len(files) == (1 if not extra else 5)
        for f in files:
            with safetensors.safe_open(f, "pt") as h:
                assert h.metadata()["format"] == "pt", f  # what transformers 4's from_pretrained checks


# --- 23.8: every folder layout from_pretrained reads ---------------------------------------------------


@pytest.mark.parametrize("kind", ["bin-single", "bin", "safetensors"])
def test_every_hf_folder_layout_inspects_verifies_converts_and_streams(tmp_path: Any, kind: str, capsys: Any) -> None:
    w = _weights()
    _hf_folder(tmp_path / "hf", w, kind=kind)
    assert main(["inspect", str(tmp_path / "hf"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total_bytes"] == sum(t.nbytes for t in w.values())
    assert main(["verify", str(tmp_path / "hf")]) in (0, 3)  # .bin: each storage's zip CRC-32 is a checksum
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "out.safetensors")]) == 0
    back = anyio.run(load_file, tmp_path / "out.safetensors")
    assert back.keys() == w.keys() and all(torch.equal(back[k], w[k]) for k in w)

    async def streamed() -> dict[str, torch.Tensor]:
        return {k: t async for k, t in stream(tmp_path / "hf")}

    got = anyio.run(streamed)
    assert got.keys() == w.keys() and all(torch.equal(got[k], w[k]) for k in w)


# --- 23.12: selectors that select nothing ---------------------------------------------------------------


async def test_selectors_mean_what_they_say(tmp_path: Any) -> None:
    w = _weights()
    safetensors.torch.save_file(w, tmp_path / "m.safetensors")
    path = tmp_path / "m.safetensors"
    one = [k async for k, _ in stream(path, keys="lm_head.weight")]  # a bare string is one name
    assert one == ["lm_head.weight"]
    layer = [k async for k, _ in stream(path, keys=["model.layers.1."])]
    assert layer == ["model.layers.1.weight"]
    for bad in (["model.layers.1"], ["lm_head.wieght"], "lm_head"):
        with pytest.raises(MismatchError, match="select"):
            [k async for k, _ in stream(path, keys=bad)]
    with pytest.raises(MismatchError, match="lm_head.bias"):
        [k async for k, _ in stream(path, rows={"lm_head.bias": (0, 2)})]
    rows = {k: t async for k, t in stream(path, keys="lm_head.weight", rows={"lm_head.weight": (2, 5)})}
    assert torch.equal(rows["lm_head.weight"], w["lm_head.weight"][2:5])


# --- 23.13: shared storages stay shared -----------------------------------------------------------------


async def test_load_torch_keeps_tied_tensors_shared_and_inspect_counts_them_once(tmp_path: Any, capsys: Any) -> None:
    emb = torch.randn(64, 32)
    torch.save({"embed.weight": emb, "lm_head.weight": emb, "norm": torch.ones(32)}, tmp_path / "tied.pt")
    got = await load_torch(tmp_path / "tied.pt")
    assert got["embed.weight"].data_ptr() == got["lm_head.weight"].data_ptr()
    ref = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert ref["embed.weight"].data_ptr() == ref["lm_head.weight"].data_ptr()  # as torch.load does
    assert main(["inspect", str(tmp_path / "tied.pt"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total_bytes"] == emb.nbytes + 32 * 4, doc["total_bytes"]


# --- 23.16: the smaller ones ----------------------------------------------------------------------------


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path: Any) -> None:
    safetensors.torch.save_file({f"t{i}": torch.zeros(2) for i in range(5000)}, tmp_path / "m.safetensors")
    r = subprocess.run(
        ["/bin/bash", "-c", f"set -o pipefail; {sys.executable} -m aiotensor inspect {tmp_path / 'm.safetensors'} | head -2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "Broken pipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ls_of_a_folder_that_is_not_a_store_fails(tmp_path: Any, capsys: Any) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["ls", str(tmp_path)]) == 1
    assert "store" in capsys.readouterr().err


def test_dcp_writer_takes_an_empty_folder_and_refuses_a_full_one(tmp_path: Any) -> None:
    w = {"w": torch.arange(8.0)}
    (tmp_path / "empty").mkdir()
    dcp.save(w, storage_writer=AiotensorWriter(tmp_path / "empty"))  # as FileSystemWriter accepts it
    got = {"w": torch.zeros(8)}
    dcp.load(got, storage_reader=AiotensorReader(tmp_path / "empty"))
    assert torch.equal(got["w"], w["w"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointException) as e:  # DCP wraps every rank's error in its own
        dcp.save(w, storage_writer=AiotensorWriter(tmp_path / "full"))
    assert "CheckpointExistsError" in str(e.value) and "new or empty folder" in str(e.value)
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine" and os.listdir(tmp_path / "full") == ["notes.txt"]
