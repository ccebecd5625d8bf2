"""Embeddings (`POST /v1/embeddings`, `Relay.embed`): the official openai SDK's
`embeddings.create` against the real gateway on a loopback upstream that answers as OpenAI's
embeddings API does (floats, or base64 float32 when asked) and records what it got; the walk's
failover among entries of the same model, never to another model, and the ledger's rows."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import openai
import pytest

from relayline.adapters.relay import Relay
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import JSON
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import structure_config
from relayline.machines.errors import TurnError

MODEL = "text-embedding-3-small"


def vector(text: str, dimensions: int) -> list[float]:
    """A vector that says which input it is for: its first value is the input's length."""
    return [float(len(text))] + [0.5] * (dimensions - 1)


class EmbeddingsUpstream(BackgroundLoopback):
    """/down/... answers 503; anything else embeds each input as `vector` does, in floats or in
    base64 float32 as the request asks, and bills one token per character."""

    def __init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, seen: Seen) -> Reply:
        if seen.path.startswith("/down/"):
            return Reply(status=503, headers=JSON, pieces=(b'{"error": {"message": "overloaded"}}',))
        body = seen.body or {}
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        inputs = [i if isinstance(i, str) else "t" * len(i) for i in inputs] if not all(
            isinstance(i, int) for i in inputs) else ["t" * len(inputs)]
        data = []
        for index, text in enumerate(inputs):
            values = vector(text, body.get("dimensions", 4))
            embedding = base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode() \
                if body.get("encoding_format") == "base64" else values
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        usage = {"prompt_tokens": sum(len(t) for t in inputs), "total_tokens": sum(len(t) for t in inputs)}
        return Reply(headers=JSON, pieces=(json.dumps({"object": "list", "data": data, "model": body["model"],
                                                       "usage": usage}).encode(),))


def profile(up: EmbeddingsUpstream, where: str, model: str = MODEL, **extra) -> dict:
    return {"family": "openai", "base_url": f"{up.url}/{where}/v1", "api_key": f"sk-emb-{where}", "model": model,
            "price": {"input_per_mtok": 0.02}, **extra}


def sdk(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.mark.parametrize("encoding", ["base64", "float"])
def test_list_input_with_dimensions_in_either_encoding(encoding):
    with EmbeddingsUpstream() as up, BackgroundGateway({"active": "openai.a",
                                                        "providers": {"openai.a": profile(up, "a")}}) as gw:
        # the SDK asks for base64 itself when no encoding is given, and decodes it
        extra = {"encoding_format": "float"} if encoding == "float" else {}
        reply = sdk(gw).embeddings.with_raw_response.create(model=MODEL, input=["hi", "hello"], dimensions=3,
                                                            user="u-1", **extra)
    result = reply.parse()
    assert [d.embedding for d in result.data] == [vector("hi", 3), vector("hello", 3)]
    assert result.model == MODEL and result.usage.prompt_tokens == 7
    assert reply.headers["x-relayline-served"] == f"openai.a/{MODEL}"
    assert up.seen[-1].path == "/a/v1/embeddings"
    assert up.seen[-1].body == {"input": ["hi", "hello"], "model": MODEL, "dimensions": 3, "encoding_format": encoding,
                                "user": "u-1"}


def test_token_arrays_go_as_sent():
    with EmbeddingsUpstream() as up, BackgroundGateway({"active": "openai.a",
                                                        "providers": {"openai.a": profile(up, "a")}}) as gw:
        sdk(gw).embeddings.create(model=MODEL, input=[[1, 2, 3], [4, 5]], encoding_format="float")
        sdk(gw).embeddings.create(model=MODEL, input=[7, 8, 9], encoding_format="float")
    assert [s.body["input"] for s in up.seen] == [[[1, 2, 3], [4, 5]], [7, 8, 9]]


def test_a_failover_goes_to_the_same_model_only_and_bills_the_input_tokens(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with EmbeddingsUpstream() as up:
        config = {"active": "openai.first", "reliability": {"provider_retries": 0},
                  "providers": {"openai.first": profile(up, "down", fallbacks=["openai.other", "openai.second"]),
                                "openai.other": profile(up, "other", model="another-embedding-model"),
                                "openai.second": profile(up, "second")}}
        with BackgroundGateway(config, ledger_path=str(path)) as gw:
            result = sdk(gw).embeddings.create(model=MODEL, input="hello", encoding_format="float")
    assert result.data[0].embedding == vector("hello", 4)
    # the other model's entry is never asked: its vectors would not be comparable
    assert [s.path for s in up.seen] == ["/down/v1/embeddings", "/second/v1/embeddings"]
    relayline = result.model_extra["relayline"]
    assert relayline["served"] == f"openai.second/{MODEL}" and relayline["fallback"] is True
    rows = LedgerStore(path).rows()
    assert [(r["provider"], r["accepted"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("openai.second", 1, 5, 0)]
    assert rows[0]["cost_usd"] == pytest.approx(5 * 0.02 / 1e6)


@pytest.mark.parametrize("drop", [False, True], ids=["skip", "drop_unsupported_params"])
def test_an_entry_that_cannot_embed_is_skipped_and_none_left_is_a_400_naming_it(drop):
    # (dropping unsupported fields never sends an embeddings request to a family without the API)
    with EmbeddingsUpstream() as up:
        config = {"active": "anthropic.a", "gateway": {"drop_unsupported_params": drop},
                  "providers": {"anthropic.a": {"family": "anthropic", "base_url": up.url, "api_key": "sk-a",
                                                "model": MODEL},
                                "openai.off": profile(up, "off", capabilities={"embeddings": False})},
                  "routes": [{"hint": "off", "provider": "openai.off", "model": MODEL}]}
        with BackgroundGateway(config) as gw:
            for model in (MODEL, "off"):
                reply = httpx.post(f"{gw.url}/v1/embeddings", json={"model": model, "input": "hi"}, timeout=20)
                assert reply.status_code == 400 and "embeddings" in reply.json()["error"]["message"]
            bad = httpx.post(f"{gw.url}/v1/embeddings", json={"model": MODEL, "input": [1.5]}, timeout=20)
    assert up.seen == []
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0]"


def test_the_library_embeds_with_the_same_walk():
    with EmbeddingsUpstream() as up:
        config = {"active": "openai.first", "reliability": {"provider_retries": 0},
                  "providers": {"openai.first": profile(up, "down", fallbacks=["openai.other", "openai.second"]),
                                "openai.other": profile(up, "other", model="another-embedding-model"),
                                "openai.second": profile(up, "second")}}
        with Relay(structure_config(config), env={}) as relay:
            embeddings = relay.embed_sync(["a", "abc"], dimensions=2, encoding_format="float")
        del config["providers"]["openai.second"]
        config["providers"]["openai.first"]["fallbacks"] = ["openai.other"]
        with Relay(structure_config(config), env={}) as relay, pytest.raises(TurnError):
            relay.embed_sync("x")  # the one entry of the model is down: no other model stands in
    assert embeddings.vectors == (vector("a", 2), vector("abc", 2))
    assert embeddings.served == f"openai.second/{MODEL}" and embeddings.fallback and embeddings.input_tokens == 4
    assert "/other/v1/embeddings" not in [s.path for s in up.seen]


def test_a_field_relayline_does_not_read_goes_to_the_openai_profile_as_sent():
    # an OpenAI-compatible embeddings server's own fields (NVIDIA NIM's `input_type`, vLLM's
    # `truncate_prompt_tokens`) were dropped: the same request to the same family keeps them,
    # as a chat request's do
    with EmbeddingsUpstream() as up, BackgroundGateway({"active": "openai.a",
                                                        "providers": {"openai.a": profile(up, "a")}}) as gw:
        sdk(gw).embeddings.create(model=MODEL, input="hi", encoding_format="float",
                                  extra_body={"input_type": "query", "truncate_prompt_tokens": 8})
    assert up.seen[-1].body == {"input": "hi", "model": MODEL, "encoding_format": "float", "input_type": "query",
                                "truncate_prompt_tokens": 8}
