"""The OpenAI-compatible and Anthropic adapters against real protocol transcripts, served by a
real loopback HTTP server (adapters/sim/loopback.py) through the real driver."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import PRICE, family_config
from relayline.adapters import Relay
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply, sse_events
from relayline.machines.config import Config, structure_config

TRANSCRIPTS = Path(__file__).resolve().parents[1] / "transcripts"
KEY = "sk-test-transcript-4242"


def config(family: str, url: str, retries: int = 0, **tables) -> Config:
    """The family's one profile on the transcript's server, with a header of its own."""
    profile = family_config(family, url, retries=retries, api_key=KEY, headers={"x-team": "core"}, price=PRICE)
    return structure_config({**profile, **tables})


def summary(result, events) -> dict:
    return {
        "outcome": result.outcome,
        "attempts": [(a.outcome, a.reason) for a in result.attempts],
        "events": [str(e) for e in events],
        "ledger": [(r.input_tokens, r.output_tokens, r.accepted) for r in result.ledger],
        "partial": result.partial_text,
        "tools": result.tool_calls,
        "arguments": result.tool_arguments,
    }


async def run_stream(family: str, handler, retries: int = 0):
    events = []

    async def sink(event):
        if event.visible:
            events.append(event)

    async with trio.open_nursery() as nursery:
        server = LoopbackServer(handler)
        await server.start(nursery)
        async with Relay(config(family, server.url, retries), env={}) as relay:
            with trio.fail_after(10):
                result = await turns_of(relay).run([{"role": "user", "content": "hi"}], stream=True, sink=sink)
        nursery.cancel_scope.cancel()
    return summary(result, events), server.seen


def serve(pieces, end=True, status=200):
    return lambda seen: Reply(status=status, pieces=tuple(pieces), end=end)


def family_of(name: str) -> str:
    return name.split("_", 1)[0]


EXPECTED = {
    "openai_text": dict(outcome="ok", events=["text:Hello", "text:! How can I help", "text: today? été 😀"],
                        ledger=[(19, 10, True)]),
    "openai_tools": dict(outcome="ok", events=["tool:get_weather", 'tool_args:{"', "tool_args:location",
                                               'tool_args:":"Paris"}'], ledger=[(82, 17, True)], tools=("get_weather",)),
    "openai_reasoning_keepalive": dict(outcome="ok", events=["reasoning:The user greets me.", "text:Hi there."],
                                       ledger=[(11, 9, True)]),
    "openai_midstream_error": dict(outcome="error", events=[], attempts=[("stream_failed", "retryable")]),
    "anthropic_text": dict(outcome="ok", events=["text:Hello", "text:! How can I help?"], ledger=[(25, 15, True)]),
    "anthropic_thinking_tool": dict(outcome="ok", events=[
        # (the empty reasoning event carries the thinking's signature, in its ref)
        "reasoning:I should look up the weather.", "reasoning:", "text:Let me check.", "tool:get_weather",
        'tool_args:{"location": "San Fra', 'tool_args:ncisco, CA"}'], ledger=[(2572, 89, True)], tools=("get_weather",)),
    "anthropic_overloaded": dict(outcome="error", events=[], attempts=[("stream_failed", "retryable")]),
    "anthropic_server_tool": dict(outcome="ok", events=[
        "executed_tool:web_search", "executed_tool:web_search_tool_result", "text:It is sunny in New York."],
        ledger=[(10682, 510, True)]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
async def test_transcript(name):
    data = (TRANSCRIPTS / f"{name}.sse").read_bytes()
    got, seen = await run_stream(family_of(name), serve([data]))
    for key, want in EXPECTED[name].items():
        assert got[key] == want, (key, got)
    request = seen[0]
    if family_of(name) == "openai":
        assert request.path == "/v1/chat/completions"
        assert request.headers["authorization"] == f"Bearer {KEY}"
        assert request.body["stream_options"] == {"include_usage": True}
    else:
        assert request.path == "/v1/messages"
        assert request.headers["x-api-key"] == KEY and request.headers["anthropic-version"] == "2023-06-01"
        assert request.body["max_tokens"] > 0
    assert request.headers["x-team"] == "core" and request.body["model"] == "model-x" and request.body["stream"]


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"


async def test_openai_tool_call_pieces_go_to_the_call_their_index_names():
    """Two calls opened in one chunk, then each one's arguments: a piece belongs to the call its
    `index` names, not to whichever call was opened last."""
    calls = [{"index": i, "id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": ""}}
             for i, n in enumerate(["first", "second"])]
    pieces = [_chunk({"role": "assistant", "content": None}), _chunk({"tool_calls": calls}),
              _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}),
              _chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"y": 2}'}}]}),
              _chunk({}, "tool_calls"), b"data: [DONE]\n\n"]
    got, _ = await run_stream("openai", serve(pieces))
    assert (got["outcome"], got["tools"], got["arguments"]) == ("ok", ("first", "second"), ('{"x": 1}', '{"y": 2}'))


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("end", [True, False], ids=["clean_eof", "dropped"])
async def test_truncation_at_every_frame_boundary(name, end):
    """Cut after each event: never a success with a partial answer; output already forwarded
    means interrupted (and that text is the partial), none means a recoverable failure."""
    data = (TRANSCRIPTS / f"{name}.sse").read_bytes()
    whole, _ = await run_stream(family_of(name), serve([data]))
    events = sse_events(data)
    for k in range(len(events)):
        got, _ = await run_stream(family_of(name), serve(events[:k], end=end))
        if got["outcome"] == "ok":
            assert got["events"] == whole["events"], k  # complete already (finish_reason, then EOF)
            continue
        first = got["attempts"][0][0]
        assert first == ("interrupted" if got["events"] else "stream_failed"), (k, got)
        text = "".join(e[len("text:"):] for e in got["events"] if e.startswith("text:"))
        assert (got["partial"] or "") == (text if first == "interrupted" else "")
        assert got["events"] == whole["events"][: len(got["events"])]


@pytest.mark.property
@settings(max_examples=15)
@given(name=st.sampled_from(sorted(EXPECTED)), cuts=st.lists(st.floats(0, 1), max_size=10))
def test_any_byte_split_gives_identical_results(name, cuts):
    data = (TRANSCRIPTS / f"{name}.sse").read_bytes()
    points = sorted({int(c * len(data)) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]

    async def both():
        whole, _ = await run_stream(family_of(name), serve([data]))
        split, _ = await run_stream(family_of(name), serve(pieces))
        return whole, split

    whole, split = trio.run(both)
    assert split == whole


async def test_malformed_frames_are_protocol_errors_not_crashes():
    bad = b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\ndata: {not json\n\n'
    got, _ = await run_stream("openai", serve([bad]))
    assert got["outcome"] == "error" and got["attempts"][0] == ("stream_failed", "retryable")
    got, _ = await run_stream("anthropic", serve([b"event: ping\ndata: \xff\xfe\n\n"]))
    assert got["attempts"][0] == ("stream_failed", "retryable")
    # a tool call's index that is no integer (a list: unhashable as the parser's key)
    bad = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":[0],"id":"c",'
           b'"function":{"name":"f","arguments":""}}]}}]}\n\n')
    got, _ = await run_stream("openai", serve([bad]))
    assert got["attempts"][0] == ("stream_failed", "malformed")  # (it was an internal error: a TypeError)
    # an Anthropic content block's index that is no integer (it keys the block's type)
    for index in (b"[0]", b'{"i":0}'):
        bad = (b'event: content_block_start\ndata: {"type":"content_block_start","index":' + index +
               b',"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}\n\n')
        got, _ = await run_stream("anthropic", serve([bad]))
        assert got["attempts"][0] == ("stream_failed", "malformed"), got  # (an internal error too)


# -- complete mode and HTTP errors -----------------------------------------------------------------


async def run_complete(family: str, handler, retries: int = 0):
    async with trio.open_nursery() as nursery:
        server = LoopbackServer(handler)
        await server.start(nursery)
        async with Relay(config(family, server.url, retries), env={}) as relay:
            with trio.fail_after(10):
                result = await turns_of(relay).run([{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}])
        nursery.cancel_scope.cancel()
    return result, server.seen


def json_reply(status: int, body: dict, headers=()):
    return Reply(status=status, headers=(("content-type", "application/json"), *headers),
                 pieces=(json.dumps(body).encode(),))


async def test_openai_complete_with_tools_and_usage():
    body = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 10}}}
    result, seen = await run_complete("openai", lambda s: json_reply(200, body))
    assert result.outcome == "ok" and result.tool_calls == ("get_weather",)
    assert result.tool_arguments == ('{"city": "Paris"}',)
    assert result.ledger[0].input_tokens == 30 and result.ledger[0].output_tokens == 5
    assert seen[0].body["messages"][0] == {"role": "system", "content": "be brief"} and not seen[0].body["stream"]


async def test_anthropic_complete_moves_system_prompts_to_the_top():
    body = {"id": "msg_1", "type": "message", "role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "x"}, {"type": "text", "text": "Hi."},
        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}],
        "stop_reason": "end_turn", "usage": {"input_tokens": 8, "output_tokens": 3}}
    result, seen = await run_complete("anthropic", lambda s: json_reply(200, body))
    assert (result.outcome, result.text, result.reasoning) == ("ok", "Hi.", "hm")
    assert result.tool_calls == ("lookup",) and result.tool_arguments == ('{"q": "x"}',)
    assert seen[0].body["system"] == "be brief" and all(m["role"] != "system" for m in seen[0].body["messages"])


@pytest.mark.parametrize("family,status,body,headers,outcome", [
    ("openai", 429, {"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}},
     (("retry-after-ms", "1200"),), "rate_limited"),
    ("openai", 429, {"error": {"message": "You exceeded your current quota", "type": "insufficient_quota",
                               "code": "insufficient_quota"}}, (), "quota"),
    ("openai", 400, {"error": {"message": "This model's maximum context length is 128000 tokens.",
                               "type": "invalid_request_error", "code": "context_length_exceeded"}}, (), "context_window"),
    ("openai", 401, {"error": {"message": f"Incorrect API key provided: {KEY}.", "type": "invalid_request_error",
                               "code": "invalid_api_key"}}, (), "rejected"),
    ("anthropic", 529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, (), "retryable"),
    ("anthropic", 400, {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "prompt is too long: 210000 tokens > 200000 maximum"}},
     (), "context_window"),
])
async def test_http_errors_are_classified(family, status, body, headers, outcome, caplog):
    caplog.set_level(logging.DEBUG)
    result, _ = await run_complete(family, lambda s: json_reply(status, body, headers))
    assert result.attempts[0].outcome == outcome
    exposed = caplog.text + str(result.message) + repr(result)
    assert KEY not in exposed and "Incorrect API key" not in exposed


async def test_the_retry_after_header_drives_the_wait(autojump_clock):
    replies = iter([json_reply(429, {"error": {"type": "rate_limit_error"}}, (("retry-after", "3"),)),
                    json_reply(200, {"choices": [{"message": {"content": "ok"}}]})])
    result, _ = await run_complete("openai", lambda s: next(replies), retries=1)
    assert [a.outcome for a in result.attempts] == ["rate_limited", "ok"]
    assert result.attempts[1].at - result.attempts[0].at == pytest.approx(3.0, abs=0.01)


async def test_connection_refused_is_retryable():
    relay = Relay(config("openai", "http://127.0.0.1:9"), env={})
    async with relay:
        result = await turns_of(relay).run([{"role": "user", "content": "hi"}])
    assert result.attempts[0].outcome == "retryable" and result.attempts[0].detail == "connection error"


async def test_headers_s_is_enforced_on_the_real_socket():
    async with trio.open_nursery() as nursery:
        server = LoopbackServer(lambda s: Reply(delay=30.0, pieces=(b"{}",)))
        await server.start(nursery)
        async with Relay(config("openai", server.url, timeouts={"headers_s": 0.3}), env={}) as relay:
            with trio.fail_after(5):
                result = await turns_of(relay).run([{"role": "user", "content": "hi"}])
        nursery.cancel_scope.cancel()
    assert [a.outcome for a in result.attempts] == ["timeout"]


@pytest.mark.property
@settings(max_examples=20)
@given(status=st.sampled_from([400, 401, 403, 404, 408, 429, 500, 502, 503, 529]),
       echo=st.sampled_from(["message", "code", "type", "header"]), stream=st.booleans())
def test_no_secret_in_any_adapter_failure(status, echo, stream):
    """Whatever a provider echoes back (bodies quoting the key, headers), the key never reaches
    an exception, a log record or a trace."""
    error = {"message": "ok", "type": "t", "code": "c"}
    headers = [("content-type", "application/json")]
    if echo == "header":
        headers.append(("x-echo", KEY))
    else:
        error[echo] = f"Incorrect API key provided: {KEY}"
    reply = Reply(status=status, headers=tuple(headers), pieces=(json.dumps({"error": error}).encode(),))
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger()
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.DEBUG)

    async def main():
        if stream:
            return await run_stream("openai", lambda s: reply)
        return await run_complete("openai", lambda s: reply)

    try:
        got, _ = trio.run(main)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    exposed = repr(got) + str(getattr(got, "message", "")) + "\n".join(records)
    assert KEY not in exposed


async def test_an_answer_that_ends_the_turn_leaves_the_attempts_deadline_where_it_is(monkeypatch):
    """The attempt's deadline moves with the provider's phases (the request written: headers_s;
    the head, each body read: idle_s) and not again once the answer is read: nothing is awaited
    between an answer decoded inline and the turn's end, so no deadline can fire there (a
    deadline moved for nothing cost ~2 µs a turn)."""
    import sys

    body = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                    "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    moved_by: list[str] = []
    deadline = trio.CancelScope.deadline
    turn_task = trio.lowlevel.current_task()

    def counted(scope, value: float) -> None:
        if trio.lowlevel.current_task() is turn_task:
            moved_by.append(sys._getframe(1).f_code.co_name)
        deadline.fset(scope, value)

    async with trio.open_nursery() as nursery:
        server = LoopbackServer(lambda seen: Reply(headers=(("content-type", "application/json"),),
                                                   pieces=(body.encode(),)))
        await server.start(nursery)
        async with Relay(config("openai", server.url), env={}) as relay:
            await turns_of(relay).run([{"role": "user", "content": "hi"}])  # (a warm connection)
            monkeypatch.setattr(trio.CancelScope, "deadline", property(deadline.fget, counted))
            with trio.fail_after(10):
                result = await turns_of(relay).run([{"role": "user", "content": "hi"}])
            monkeypatch.undo()
        nursery.cancel_scope.cancel()
    assert result.outcome == "ok" and result.text == "hello"
    assert moved_by[0] == "sent" and set(moved_by) <= {"sent", "headers", "received"}, moved_by
