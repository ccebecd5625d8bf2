"""Provider replies are validated where they are read into the canonical model: valid JSON of
the wrong types or ranges (usage must be a non-negative integer below a sane bound, choices a
list, content a string...) is a retryable `malformed` failure that fails over to a healthy
fallback, never a crash; a 200 that carries an error is a classified failure, not an empty
answer. Real loopback HTTP, the real driver."""

from __future__ import annotations

import json

import pytest
import trio

from helpers import PRICE, family_config
from relayline.adapters import Relay
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

OK_OPENAI = {"id": "c", "object": "chat.completion", "model": "m",
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
OK_ANTHROPIC = {"id": "m", "type": "message", "role": "assistant", "model": "m", "stop_reason": "end_turn",
                "content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 3, "output_tokens": 1}}


def patched(base: dict, path: str, value) -> dict:
    body = json.loads(json.dumps(base))
    *parents, last = path.split(".")
    target = body
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[int(last) if last.isdigit() else last] = value
    return body


OPENAI_BAD = [
    ("usage.prompt_tokens", "abc"), ("usage.prompt_tokens", -5), ("usage.completion_tokens", 1e300),
    ("usage.completion_tokens", 10**12), ("choices", {}), ("choices.0", "x"), ("choices.0.message.content", 5),
    ("choices.0.message.tool_calls", "x"), ("choices.0.message.tool_calls", [{"function": {"name": 5}}]),
    ("choices.0.finish_reason", 5), ("usage", [1, 2]),
]
ANTHROPIC_BAD = [
    ("content", "x"), ("content.0.text", 5), ("usage.input_tokens", "abc"), ("usage.input_tokens", -1),
    ("usage.output_tokens", 1e300), ("stop_reason", 5), ("content.0", [1]),
]


async def turn(family: str, pieces: tuple[bytes, ...], stream: bool = False, status: int = 200):
    headers = (("content-type", "text/event-stream" if stream else "application/json"),)
    async with trio.open_nursery() as nursery:
        server = LoopbackServer(lambda seen: Reply(status=status, headers=headers, pieces=pieces))
        await server.start(nursery)
        config = family_config(family, server.url, fallback="m2", api_key="sk-wire-test-0001", price=PRICE)
        async with Relay(structure_config(config), env={}) as relay:
            with trio.fail_after(10):
                result = await turns_of(relay).run([{"role": "user", "content": "hi"}], stream=stream)
        nursery.cancel_scope.cancel()
    return result


def check_failed_over(result, outcome: str = "malformed") -> None:
    assert result.outcome == "ok" and result.served.label == "sim.b/m2" and result.text == "ok"
    assert result.attempts[0].outcome == outcome, result.attempts
    assert all(r.cost_usd >= 0 and r.input_tokens >= 0 and r.output_tokens >= 0 for r in result.ledger)


@pytest.mark.parametrize("field,value", OPENAI_BAD, ids=[f"{f}={v!r}"[:40] for f, v in OPENAI_BAD])
async def test_openai_replies_of_the_wrong_shape_fail_over(field, value):
    result = await turn("openai", (json.dumps(patched(OK_OPENAI, field, value)).encode(),))
    check_failed_over(result)
    assert field.split(".")[-1] in result.attempts[0].detail or field.split(".")[0] in result.attempts[0].detail


@pytest.mark.parametrize("field,value", ANTHROPIC_BAD, ids=[f"{f}={v!r}"[:40] for f, v in ANTHROPIC_BAD])
async def test_anthropic_replies_of_the_wrong_shape_fail_over(field, value):
    check_failed_over(await turn("anthropic", (json.dumps(patched(OK_ANTHROPIC, field, value)).encode(),)))


@pytest.mark.parametrize("family,body", [
    ("openai", {"error": {"type": "server_error", "message": "overloaded"}}),
    ("openai", {**OK_OPENAI, "choices": [], "error": {"code": 503, "message": "upstream unavailable"}}),
    ("anthropic", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
])
async def test_a_200_carrying_an_error_is_a_classified_failure(family, body):
    check_failed_over(await turn(family, (json.dumps(body).encode(),)), outcome="retryable")


def sse(obj, event=None) -> bytes:
    return (f"event: {event}\n" if event else "").encode() + f"data: {json.dumps(obj)}\n\n".encode()


@pytest.mark.parametrize("chunk", [
    {"choices": {}},
    {"choices": [{"index": 0, "delta": {"content": 5}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": 7}}]}}]},
    {"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 2}},
])
async def test_openai_stream_chunks_of_the_wrong_shape_fail_over_before_output(chunk):
    pieces = (sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), sse(chunk), b"data: [DONE]\n\n")
    check_failed_over(await turn("openai", pieces, stream=True), outcome="stream_failed")


@pytest.mark.parametrize("event", [
    sse({"type": "message_start", "message": {"usage": {"input_tokens": "x"}}}, "message_start"),
    sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 5}}, "content_block_delta"),
    sse({"type": "message_delta", "delta": {"stop_reason": 3}}, "message_delta"),
])
async def test_anthropic_stream_events_of_the_wrong_shape_fail_over_before_output(event):
    start = sse({"type": "message_start", "message": {"usage": {"input_tokens": 3}}}, "message_start")
    check_failed_over(await turn("anthropic", (start, event, sse({"type": "message_stop"}, "message_stop")), stream=True),
                      outcome="stream_failed")
