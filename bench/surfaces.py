"""The Responses API, embeddings and token counting beside chat completions, in one run (never
part of `make test`).

1. The codec alone (CPU, microseconds): a body read into the canonical request, and one text
   frame rendered for the client, for chat completions, Anthropic messages and the Responses
   API, each beside the others.
2. Through the gateway over loopback HTTP (bench/load.py's raw client, concurrency 1): p50 and
   p99 of a non-streamed answer on /v1/chat/completions, /v1/responses (served by an openai
   profile without the Responses API) and /v1/embeddings, beside the same request sent straight
   to the loopback upstream; and the per-frame cost of a long stream on /v1/chat/completions and
   /v1/responses ((a 400-frame stream's time less a 1-frame stream's) / 399). Rounds interleave
   the paths so machine noise hits them alike.

Run: python bench/surfaces.py [--quick]; it prints a table and writes bench/results/surfaces-<date>.json.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from relayline.adapters.codecs import anthropic_messages, openai_chat, responses_answers
from relayline.adapters.codecs import responses as responses_codec
from relayline.adapters.codecs.anthropic_messages_answers import AnthropicStream
from relayline.adapters.codecs.openai_chat_answers import OpenAIStream
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import JSON, SSE, Answer, openai_reply
from relayline.machines.stream import Event, EventKind

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import per_call_us  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
HISTORY = [{"role": "user", "content": f"question {i}"} if i % 2 == 0 else {"role": "assistant", "content": f"answer {i}"}
           for i in range(9)]


def bench_codecs(n: int) -> dict:
    """Parse and per-frame render, each dialect beside the others."""
    chat = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, *HISTORY],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": WEATHER}}], "temperature": 0.5}
    messages = {"model": "m", "system": "be brief", "messages": HISTORY, "max_tokens": 100,
                "tools": [{"name": "w", "input_schema": WEATHER}], "temperature": 0.5}
    responses = {"model": "m", "instructions": "be brief", "input": HISTORY,
                 "tools": [{"type": "function", "name": "w", "parameters": WEATHER, "strict": False}],
                 "temperature": 0.5}
    request = responses_codec.parse_request(responses)
    event = Event(EventKind.TEXT, "a few words")
    renderers = {"chat": OpenAIStream("chatcmpl-1", False), "messages": AnthropicStream("msg_1"),
                 "responses": responses_answers.ResponsesStream("resp_1", request)}
    for renderer in renderers.values():
        renderer.opening("m")
        renderer.event(event)
    return {
        "parse_us": {"chat": per_call_us(lambda: openai_chat.parse_request(chat), n),
                     "messages": per_call_us(lambda: anthropic_messages.parse_request(messages), n),
                     "responses": per_call_us(lambda: responses_codec.parse_request(responses), n)},
        "frame_us": {name: per_call_us(lambda r=r: r.event(event), n * 10) for name, r in renderers.items()},
    }


class Upstream(BackgroundLoopback):
    """OpenAI chat completions (JSON, or a stream of `frames` text chunks asked by the prompt) and
    embeddings, answered at once."""

    def __init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, seen: Seen) -> Reply:
        body = seen.body or {}
        if seen.path.endswith("/embeddings"):
            data = [{"object": "embedding", "index": 0, "embedding": [0.125] * 256}]
            return Reply(headers=JSON, pieces=(json.dumps({"object": "list", "data": data, "model": body["model"],
                                                           "usage": {"prompt_tokens": 3, "total_tokens": 3}}).encode(),))
        stream = bool(body.get("stream"))
        frames = int(body["messages"][-1]["content"].split()[-1]) if stream else 1
        pieces = list(openai_reply(Answer(text="word "), body["model"], stream))
        if stream:  # the text chunk, repeated
            pieces[1:2] = [pieces[1]] * frames
        return Reply(headers=SSE if stream else JSON, pieces=tuple(pieces))


def _timed(client: httpx.Client, url: str, body: dict, stream: bool = False) -> float:
    start = time.perf_counter()
    if stream:
        with client.stream("POST", url, json=body) as reply:
            for _ in reply.iter_raw():
                pass
    else:
        client.post(url, json=body).raise_for_status()
    return (time.perf_counter() - start) * 1e3


def bench_http(rounds: int) -> dict:
    with Upstream() as up:
        config = {"active": "openai.up", "providers": {"openai.up": {
            "family": "openai", "base_url": f"{up.url}/v1", "api_key": "sk-bench", "model": "m"}}}
        with BackgroundGateway(config) as gw, httpx.Client(timeout=30) as client:
            def chat(frames=1, stream=False):
                return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": f"frames {frames}"}]}

            def resp(frames=1, stream=False):
                return {"model": "m", "stream": stream, "input": f"frames {frames}"}

            paths = {
                "direct chat": (f"{up.url}/v1/chat/completions", chat(), False),
                "chat": (f"{gw.url}/v1/chat/completions", chat(), False),
                "responses": (f"{gw.url}/v1/responses", resp(), False),
                "direct embeddings": (f"{up.url}/v1/embeddings", {"model": "m", "input": "hi"}, False),
                "embeddings": (f"{gw.url}/v1/embeddings", {"model": "m", "input": "hi"}, False),
                "chat stream 1": (f"{gw.url}/v1/chat/completions", chat(1, True), True),
                "chat stream 400": (f"{gw.url}/v1/chat/completions", chat(400, True), True),
                "responses stream 1": (f"{gw.url}/v1/responses", resp(1, True), True),
                "responses stream 400": (f"{gw.url}/v1/responses", resp(400, True), True),
            }
            times: dict[str, list[float]] = {name: [] for name in paths}
            for url, body, stream in paths.values():  # warm each path
                for _ in range(20):
                    _timed(client, url, body, stream)
            for _ in range(rounds):
                for name, (url, body, stream) in paths.items():
                    times[name].append(_timed(client, url, body, stream))
    p50 = {name: statistics.median(t) for name, t in times.items()}
    p99 = {name: sorted(t)[int(len(t) * 0.99) - 1] for name, t in times.items()}
    return {
        "p50_ms": p50, "p99_ms": p99, "rounds": rounds,
        "added_ms": {"chat": p50["chat"] - p50["direct chat"], "responses": p50["responses"] - p50["direct chat"],
                     "embeddings": p50["embeddings"] - p50["direct embeddings"]},
        "frame_us": {dialect: (p50[f"{dialect} stream 400"] - p50[f"{dialect} stream 1"]) / 399 * 1e3
                     for dialect in ("chat", "responses")},
    }


def main() -> int:
    quick = "--quick" in sys.argv
    results = {"when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
               "codecs": bench_codecs(2000 if quick else 10000), "http": bench_http(50 if quick else 300)}
    codecs, http = results["codecs"], results["http"]
    print("codec CPU (µs)          chat   messages  responses")
    print(f"  parse                 {codecs['parse_us']['chat']:6.1f} {codecs['parse_us']['messages']:9.1f} "
          f"{codecs['parse_us']['responses']:10.1f}")
    print(f"  render a text frame   {codecs['frame_us']['chat']:6.2f} {codecs['frame_us']['messages']:9.2f} "
          f"{codecs['frame_us']['responses']:10.2f}")
    print(f"\nover loopback HTTP, {http['rounds']} rounds interleaved (ms)   p50     p99")
    for name in http["p50_ms"]:
        print(f"  {name:24} {http['p50_ms'][name]:8.3f} {http['p99_ms'][name]:8.3f}")
    print("  added by the gateway (p50): " + ", ".join(f"{k} {v:.3f} ms" for k, v in http["added_ms"].items()))
    print("  per stream frame (p50):     " + ", ".join(f"{k} {v:.2f} µs" for k, v in http["frame_us"].items()))
    out = HERE / "results" / f"surfaces-{results['when'][:10]}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{out.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
