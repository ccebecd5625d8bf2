"""How a stream ended is what the client, the ledger and the profile's health are told: a stream
whose text was complete is delivered and recorded as complete, whatever the upstream failed to
send after it. Real loopback upstreams, the real gateway server, the official SDKs."""

from __future__ import annotations

import json
import logging
import socket
import time

import anthropic
import httpx
import openai
import pytest
import trio

from helpers import serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.otel import Tracing
from relayline.adapters.sim.loopback import BackgroundTrio, LoopbackServer, Reply
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines import wire
from relayline.machines.config import structure_config

HI = [{"role": "user", "content": "hi"}]
SSE = (("content-type", "text/event-stream"),)


def chunk(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def delta(content: str | None = None, finish: str | None = None, **extra) -> bytes:
    body = {} if content is None else {"content": content}
    return chunk({"choices": [{"index": 0, "delta": body, "finish_reason": finish}], **extra})


class GatewayOn(BackgroundTrio):
    """The gateway, its ledger, and loopback upstreams answering with `handlers` (one profile
    each, in order: the first is the active one, the others its fallbacks)."""

    def __init__(self, ledger_path, *handlers, **sections) -> None:
        super().__init__("relayline-gateway")
        self.ledger_path = str(ledger_path)
        self.upstreams = [LoopbackServer(handler) for handler in handlers]
        self.sections = sections
        self.url = ""
        self.gateway: Gateway | None = None

    async def _serve(self, nursery: trio.Nursery) -> None:
        for upstream in self.upstreams:
            await upstream.start(nursery)
        names = [f"p{i}" for i in range(len(self.upstreams))]
        providers = {name: {"family": "openai", "base_url": f"{up.url}/v1", "model": f"m-{name}",
                            "api_key": f"k-{name}", "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
                     for name, up in zip(names, self.upstreams, strict=True)}
        providers["p0"]["fallbacks"] = names[1:]
        config = {"active": "p0", "providers": providers, "reliability": {"provider_retries": 0, "backoff_ms": 10},
                  "timeouts": {"headers_s": 5, "idle_s": 20, "total_s": 60}}
        for name, values in self.sections.items():
            config[name] = {**config.get(name, {}), **values}
        self.relay = Relay(structure_config(config), env={})
        self.gateway = Gateway(self.relay, ledger=LedgerStore(self.ledger_path))
        self.url = await serve_in_process(nursery, self.gateway)

    async def _close(self) -> None:
        await self.relay.aclose()

    def clients(self) -> tuple[openai.OpenAI, anthropic.Anthropic]:
        return (openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=30),
                anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0, timeout=30))

    def health(self) -> dict:
        return httpx.get(f"{self.url}/admin/health", timeout=10).json()["profiles"]


def both_dialects(gw: GatewayOn) -> tuple[str, str, float]:
    """The text each SDK's stream delivered (they must end cleanly), and the slower one's seconds."""
    oa, an = gw.clients()
    began = time.monotonic()
    with oa.chat.completions.with_streaming_response.create(model="m-p0", messages=HI, stream=True) as streamed:
        chunks = list(streamed.parse())
    openai_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    middle = time.monotonic()
    with an.messages.stream(model="m-p0", max_tokens=16, messages=HI) as events:
        anthropic_text = events.get_final_text()
        assert events.get_final_message().stop_reason == "end_turn"
    return openai_text, anthropic_text, max(middle - began, time.monotonic() - middle)


# -- a completed stream is complete ---------------------------------------------------------------

FINISHED = (delta("", role="assistant"), delta("the whole answer"), delta(None, "stop"))
USAGE = chunk({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})


def test_a_finish_reason_with_neither_done_nor_eof_after_it_is_a_complete_stream(tmp_path):
    # the usage chunk came, then the upstream kept the body open: the clients waited idle_s (20 s
    # here) and got an interruption, the ledger said interrupted and the breaker counted a failure
    def upstream(seen) -> Reply:
        return Reply(headers=SSE, pieces=(*FINISHED, USAGE, 60.0))

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        openai_text, anthropic_text, slowest = both_dialects(gw)
        health = gw.health()["p0"]
    assert openai_text == anthropic_text == "the whole answer"
    assert slowest < 10
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    assert [(r["accepted"], r["outcome"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        (1, "ok", 7, 3)] * 2
    assert (health["recent_failures"], health["success_rate"]) == (0, 1.0)


def test_a_wrongly_typed_usage_chunk_after_the_finish_leaves_the_stream_complete(tmp_path):
    # the finish chunk carried the usage; a second usage chunk, malformed, followed it: the whole
    # text was reported as a malformed, interrupted stream
    finish_with_usage = delta(None, "stop", usage={"prompt_tokens": 7, "completion_tokens": 3})
    broken = chunk({"choices": [], "usage": {"prompt_tokens": "seven"}})

    def upstream(seen) -> Reply:
        return Reply(headers=SSE, pieces=(*FINISHED[:2], finish_with_usage, broken, b"data: [DONE]\n\n"))

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        openai_text, anthropic_text, _ = both_dialects(gw)
        health = gw.health()["p0"]
    assert openai_text == anthropic_text == "the whole answer"
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    assert [(r["accepted"], r["outcome"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        (1, "ok", 7, 3)] * 2
    assert (health["recent_failures"], health["success_rate"]) == (0, 1.0)


# -- the consumer's end is not the provider's ---------------------------------------------------------

SLOW = (delta("", role="assistant"), *[piece for i in range(40) for piece in (0.05, delta(f"w{i} "))],
        delta(None, "stop"), USAGE, b"data: [DONE]\n\n")


def hang_up_mid_stream(url: str) -> None:
    """A raw client that reads the stream's first text, then closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "m-p0", "stream": True, "messages": HI}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        seen = b""
        while b"w1 " not in seen:
            data = sock.recv(65536)
            assert data, seen
            seen += data


def test_a_client_hanging_up_is_no_failure_of_the_provider_in_its_success_rate(tmp_path):
    # four hang-ups mid-stream read as four provider failures: success_rate 0.0 before the one
    # completed stream, 0.2 after it
    def upstream(seen) -> Reply:
        return Reply(headers=SSE, pieces=SLOW)

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        for _ in range(4):
            hang_up_mid_stream(gw.url)
        deadline = time.monotonic() + 10
        while gw.gateway.in_flight and time.monotonic() < deadline:  # (the cancelled turns settle)
            time.sleep(0.02)
        oa, _ = gw.clients()
        streamed = oa.chat.completions.create(model="m-p0", messages=HI, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).startswith("w0 w1 ")
        health = gw.health()["p0"]
        console = httpx.get(f"{gw.url}/admin/console/state", timeout=10).json()["health"]["profiles"]
    assert (health["attempts_in_window"], health["success_rate"]) == (1, 1.0)
    assert [(p["attempts"], p["success_rate"]) for p in console if p["profile"] == "p0"] == [(1, 1.0)]


# -- output forwarded, then no usage: still billed ----------------------------------------------------


def test_output_forwarded_then_a_hang_up_or_a_stall_is_an_estimated_row_naming_the_profile(tmp_path, caplog):
    # the provider bills what it streamed; without its usage, the hang-up wrote no row and the
    # stall a row of zero tokens, and the access line said served=none and nothing else
    caplog.set_level(logging.INFO, logger="relayline.access")

    def upstream(seen) -> Reply:
        if seen.body["messages"][0]["content"] == "stall":
            return Reply(headers=SSE, pieces=(delta("", role="assistant"), delta("w0 w1 w2 "), 30.0))
        return Reply(headers=SSE, pieces=SLOW)

    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with GatewayOn(tmp_path / "ledger.sqlite3", upstream, timeouts={"idle_s": 0.5}) as gw:
        gw.gateway.tracing = Tracing(provider)
        hang_up_mid_stream(gw.url)
        oa, _ = gw.clients()
        try:
            for _ in oa.chat.completions.create(model="m-p0", messages=[{"role": "user", "content": "stall"}],
                                                stream=True):
                pass
        except openai.APIError as exc:
            assert "not replayed" in str(exc)
        else:
            raise AssertionError("the stalled stream ended without its interruption")
        deadline = time.monotonic() + 10
        while gw.gateway.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    assert sorted((r["provider"], r["outcome"], r["accepted"], r["estimated"]) for r in rows) == [
        ("p0", "cancelled", 0, 1), ("p0", "interrupted", 0, 1)]
    for r in rows:
        # "hi" is one token in, "stall" two (4 characters a token); what the client saw ("w0 w1 "
        # at least) two or more out
        assert r["input_tokens"] == (1 if r["outcome"] == "cancelled" else 2), r
        assert r["output_tokens"] >= 2 and r["cost_usd"] > 0, r
    access = [record.fields for record in caplog.records if record.name == "relayline.access"]
    assert [(a["served"], a["partial_from"], a["output_tokens"] >= 2) for a in access if a["path"].startswith("/v1/")] == [
        (None, "p0/m-p0", True)] * 2
    turns = [span for span in exporter.get_finished_spans() if span.parent is None]
    assert [(t.attributes.get("relayline.served"), t.attributes["relayline.partial_from"]) for t in turns] == [
        (None, "p0/m-p0")] * 2


# -- headers sent before anything was served name no one ---------------------------------------------


@pytest.mark.parametrize("recovery", ["non_streaming", "streaming"])
def test_headers_committed_by_the_gate_timer_never_name_a_provider_that_served_nothing(tmp_path, recovery):
    # p0 sends its role chunk, says nothing decisive past gate_commit_s (the headers and the
    # opening go out) and then drops the connection; p1 answers the recovery. The header and
    # the opening chunks named p0, which served nothing
    def silent_then_gone(seen) -> Reply:
        return Reply(headers=SSE, pieces=(delta("", role="assistant"), 0.6), end=False)

    def answers(seen) -> Reply:
        if seen.body.get("stream"):
            return Reply(headers=SSE, pieces=(delta("", role="assistant"), delta("from "), delta("p1"),
                                              delta(None, "stop"), b"data: [DONE]\n\n"))
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(
            {"choices": [{"index": 0, "message": {"role": "assistant", "content": "from p1"}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode(),))

    with GatewayOn(tmp_path / "ledger.sqlite3", silent_then_gone, answers, timeouts={"gate_commit_s": 0.2},
                   stream={"recovery": recovery}) as gw:
        oa, an = gw.clients()
        with oa.chat.completions.with_streaming_response.create(model="m-p0", messages=HI, stream=True) as streamed:
            openai_headers = streamed.headers
            chunks = list(streamed.parse())
        with an.messages.with_streaming_response.create(model="m-p0", max_tokens=16, messages=HI,
                                                        stream=True) as raw:
            anthropic_headers = raw.headers
            events = [json.loads(line[6:]) for line in raw.iter_lines() if line.startswith("data: ")]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "from p1"
    for headers in (openai_headers, anthropic_headers):
        assert headers.get("x-relayline-served") in (None, "p1/m-p1"), headers
    # every chunk names p1's model or none; the last one says who served, for certain
    assert {c.model for c in chunks} <= {"", "m-p1"} and chunks[-1].model == "m-p1"
    assert {c.model for c in chunks if c.choices and c.choices[0].delta.content} == {"m-p1"}
    assert chunks[-1].model_extra["relayline"]["served"] == "p1/m-p1"
    # (the final event's `relayline` field lists p0's failed attempt: that names no server)
    assert "m-p0" not in json.dumps([{k: v for k, v in e.items() if k != "relayline"} for e in events])
    assert [e["message"]["model"] for e in events if e["type"] == "message_start"] == [""]
    assert [e["relayline"]["served"] for e in events if e["type"] == "message_delta"] == ["p1/m-p1"]


def test_a_completed_answer_without_provider_usage_is_an_estimated_row(tmp_path):
    # the provider billed the answer but reported no usage: the row said 0 tokens and $0
    answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m-p0",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "the whole answer"},
                           "finish_reason": "stop"}]}

    def upstream(seen) -> Reply:
        if seen.body.get("stream"):
            return Reply(headers=SSE, pieces=(*FINISHED, b"data: [DONE]\n\n"))
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(answer).encode(),))

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        oa, _ = gw.clients()
        assert oa.chat.completions.create(model="m-p0", messages=HI).choices[0].message.content == "the whole answer"
        streamed = oa.chat.completions.create(model="m-p0", messages=HI, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "the whole answer"
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    # "hi" is one token in, "the whole answer" (16 characters) four out, at 4 characters a token
    assert sorted((r["mode"], r["outcome"], r["accepted"], r["estimated"], r["input_tokens"], r["output_tokens"])
                  for r in rows) == [("complete", "ok", 1, 1, 1, 4), ("stream", "ok", 1, 1, 1, 4)]
    assert all(r["cost_usd"] > 0 for r in rows)


def test_an_answer_with_empty_choices_is_an_empty_completion_billed_at_an_estimate_not_zero(tmp_path):
    # `choices: []` and no usage: the row said 0 tokens (the provider reported none, it did not
    # report zero), while the same with usage was billed as reported
    empty = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m-p0", "choices": []}
    usage = {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}
    bodies = iter([empty, {**empty, "usage": usage}])

    def upstream(seen) -> Reply:
        if seen.body.get("stream"):  # a stream that finishes without a word, nor usage
            return Reply(headers=SSE, pieces=(delta("", role="assistant"), delta(None, "stop"), b"data: [DONE]\n\n"))
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(next(bodies)).encode(),))

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        oa, _ = gw.clients()
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as refused:
                oa.chat.completions.create(model="m-p0", messages=HI)
            assert refused.value.status_code == 502 and refused.value.body["code"] == "empty_completion", refused.value.body
        with pytest.raises(openai.APIStatusError) as refused:
            oa.chat.completions.create(model="m-p0", messages=HI, stream=True)
        assert refused.value.status_code == 502, refused.value.body
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    assert [(r["mode"], r["accepted"], r["estimated"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("complete", 0, 1, 1, 0), ("complete", 0, 0, 7, 0), ("stream", 0, 1, 1, 0)], rows


def test_a_refusal_advanced_past_without_usage_is_billed_at_an_estimate_not_zero(tmp_path):
    refusal = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m-p0",
               "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "refusal": "I can't"},
                            "finish_reason": "stop"}]}
    answer = {**refusal, "choices": [{"index": 0, "message": {"role": "assistant", "content": "from p1"},
                                      "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}

    def p0(seen) -> Reply:
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(refusal).encode(),))

    def p1(seen) -> Reply:
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(answer).encode(),))

    with GatewayOn(tmp_path / "ledger.sqlite3", p0, p1, reliability={"on_refusal": "advance"}) as gw:
        oa, _ = gw.clients()
        assert oa.chat.completions.create(model="m-p0", messages=HI).choices[0].message.content == "from p1"
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    # "hi" is one token in; "I can't" (7 characters) two out
    assert [(r["provider"], r["accepted"], r["estimated"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("p0", 0, 1, 1, 2), ("p1", 1, 0, 7, 2)], rows


def test_a_streamed_refusal_that_stands_without_usage_is_billed_at_an_estimate_not_zero(tmp_path):
    # on_refusal = "return": a stream refused before any output is the answer; the provider
    # billed its prompt though it reported no usage, so the row must not say 0 tokens and $0
    def upstream(seen) -> Reply:
        return Reply(headers=SSE, pieces=(delta("", role="assistant"), delta(None, "content_filter"),
                                          b"data: [DONE]\n\n"))

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        oa, _ = gw.clients()
        chunks = list(oa.chat.completions.create(model="m-p0", messages=HI, stream=True))
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "content_filter"]
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    # "hi" is one token in, nothing out
    assert [(r["mode"], r["accepted"], r["estimated"], r["input_tokens"], r["output_tokens"]) for r in rows] == [
        ("stream", 1, 1, 1, 0)], rows
    assert rows[0]["cost_usd"] > 0


def test_a_requests_text_is_counted_only_for_an_answer_without_usage(tmp_path, monkeypatch):
    # the estimate reads every part and tool of the history: an answer with usage never needs it
    counted = []
    chars = wire.Request.prompt_chars
    monkeypatch.setattr(wire.Request, "prompt_chars", property(lambda self: counted.append(1) or chars.fget(self)))
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m-p0",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "answer"}, "finish_reason": "stop"}]}
    bodies = iter([{**answer, "usage": usage}, answer])

    def upstream(seen) -> Reply:
        return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(next(bodies)).encode(),))

    with GatewayOn(tmp_path / "ledger.sqlite3", upstream) as gw:
        oa, _ = gw.clients()
        oa.chat.completions.create(model="m-p0", messages=HI)
        assert counted == []
        oa.chat.completions.create(model="m-p0", messages=HI)
        assert counted == [1]
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    assert [(r["estimated"], r["input_tokens"], r["output_tokens"]) for r in rows] == [(0, 7, 2), (1, 1, 2)]
