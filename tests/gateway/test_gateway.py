"""The gateway end to end: the official openai and anthropic SDKs as clients, over real
loopback HTTP, in front of loopback sim upstreams speaking the OpenAI and Anthropic protocols."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.stores.ledger import LedgerStore

HI = [{"role": "user", "content": "hi"}]


def two_profiles(**extra):
    config = {
        "active": "anthropic.primary",
        "reliability": {"provider_retries": 1, "backoff_ms": 50},
        "notices": {"model_fallback_notice": "detailed"},
        "providers": {
            "anthropic.primary": {"family": "sim", "model": "claude-sonnet-4", "fallbacks": ["openai.backup"],
                                  "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}},
            "openai.backup": {"family": "sim", "model": "gpt-4o-mini", "price": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}},
        },
        "routes": [{"hint": "fast", "provider": "openai.backup", "model": "gpt-4o-mini"}],
    }
    config.update(extra)
    return config


def samples(text: str) -> dict:
    """Prometheus text, parsed by prometheus-client: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def client(gw, key="unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=20)


def test_non_streaming_success_with_attribution():
    with BackgroundGateway(two_profiles(), [{"provider": "anthropic.primary", "script": [{"text": "hello there"}]}]) as gw:
        raw = client(gw).chat.completions.with_raw_response.create(model="claude-sonnet-4", messages=HI)
        completion = raw.parse()
    assert completion.choices[0].message.content == "hello there"
    assert completion.model == "claude-sonnet-4"
    assert raw.headers["x-relayline-served"] == "anthropic.primary/claude-sonnet-4"
    assert raw.headers["x-relayline-requested"] == "anthropic.primary/claude-sonnet-4"
    assert raw.headers["x-relayline-fallback"] == "false" and raw.headers["x-relayline-attempts"] == "1"
    assert float(raw.headers["x-relayline-cost-usd"]) == pytest.approx((10 * 3 + 2 * 15) / 1e6)
    assert completion.usage.prompt_tokens == 10 and completion.usage.completion_tokens == 2


def test_failover_reports_the_served_model_and_a_notice():
    replies = [{"provider": "anthropic.primary", "script": [{"status": 503}]},
               {"provider": "openai.backup", "script": [{"text": "from the backup"}]}]
    with BackgroundGateway(two_profiles(), replies) as gw:
        raw = client(gw).chat.completions.with_raw_response.create(model="claude-sonnet-4", messages=HI)
        completion = raw.parse()
    assert completion.model == "gpt-4o-mini" and completion.choices[0].message.content == "from the backup"
    assert raw.headers["x-relayline-fallback"] == "true" and raw.headers["x-relayline-attempts"] == "3"
    extra = completion.model_extra["relayline"]
    assert "anthropic.primary/claude-sonnet-4" in extra["notice"] and extra["served"] == "openai.backup/gpt-4o-mini"


def test_streaming_sends_chunks_and_usage_last_when_asked():
    with BackgroundGateway(two_profiles(), [{"provider": "anthropic.primary", "script": [{"text": "one two three"}]}]) as gw:
        raw = client(gw).chat.completions.with_raw_response.create(model="claude-sonnet-4", messages=HI, stream=True,
                                                                   stream_options={"include_usage": True})
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert raw.headers["x-relayline-served"] == "anthropic.primary/claude-sonnet-4"
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_the_sdk_quickstart_loop_works_without_include_usage():
    """Every chunk has a choice unless the client asked for the usage chunk (the OpenAI API's
    own rule), so `chunk.choices[0].delta.content` never raises IndexError."""
    with BackgroundGateway(two_profiles(), [{"provider": "anthropic.primary", "script": [{"text": "one two"}]}]) as gw:
        stream = client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "one two"


def test_stream_failing_before_output_is_recovered_invisibly():
    replies = [{"provider": "anthropic.primary", "script": [{"frames": [{"role": True}, {"error": "overloaded_error"}]}]},
               {"provider": "openai.backup", "script": [{"text": "recovered answer"}]}]
    with BackgroundGateway(two_profiles(), replies) as gw:
        chunks = list(client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "recovered answer"
    assert chunks[-1].model == "gpt-4o-mini"


def test_stream_cut_after_output_surfaces_as_an_error_in_the_sdk():
    replies = [{"provider": "anthropic.primary", "script": [
        {"frames": [{"role": True}, {"text": "Partial"}, {"text": " answer"}, {"error": "overloaded_error"}]}]}]
    received = []
    with BackgroundGateway(two_profiles(), replies) as gw:
        stream = client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI, stream=True)
        with pytest.raises(openai.APIError):
            for chunk in stream:
                if chunk.choices:
                    received.append(chunk.choices[0].delta.content or "")
        health = httpx.get(f"{gw.url}/admin/health").json()
    assert "".join(received) == "Partial answer"
    assert health["profiles"]["anthropic.primary"]["attempts_in_window"] == 1


def test_a_stream_that_fails_before_commit_gets_a_real_status():
    replies = [{"provider": "anthropic.primary", "script": [{"status": 400, "error": "context_length_exceeded"}]}]
    with BackgroundGateway(two_profiles(), replies) as gw, pytest.raises(openai.BadRequestError) as info:
        client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI, stream=True)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"


def test_exhaustion_is_a_502_with_the_aggregated_error():
    replies = [{"provider": "anthropic.primary", "script": [{"status": 503}]},
               {"provider": "openai.backup", "script": [{"status": 500}]}]
    with BackgroundGateway(two_profiles(), replies) as gw, pytest.raises(openai.APIStatusError) as info:
        client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI)
    assert info.value.status_code == 502 and "#4 openai.backup/gpt-4o-mini" in info.value.message


def test_gateway_keys_are_required_when_configured():
    with BackgroundGateway(two_profiles(), api_keys={"gw-secret-1"}) as gw:
        with pytest.raises(openai.AuthenticationError):
            client(gw, "wrong").chat.completions.create(model="claude-sonnet-4", messages=HI)
        assert client(gw, "gw-secret-1").chat.completions.create(model="claude-sonnet-4", messages=HI).choices[0].message.content == "ok"
        assert httpx.get(f"{gw.url}/metrics").status_code == 401
        assert httpx.get(f"{gw.url}/metrics", headers={"authorization": "Bearer gw-secret-1"}).status_code == 200


def test_models_plan_metrics_and_a_route_hint_as_model():
    with BackgroundGateway(two_profiles()) as gw:
        ids = [m.id for m in client(gw).models.list()]
        served = client(gw).chat.completions.with_raw_response.create(model="fast", messages=HI)
        plan = httpx.get(f"{gw.url}/admin/plan", params={"model": "fast"}).json()
        metrics = httpx.get(f"{gw.url}/metrics").text
    assert "fast" in ids and "claude-sonnet-4" in ids
    assert served.headers["x-relayline-served"] == "openai.backup/gpt-4o-mini"
    assert plan["domain"] == "openai.backup" and plan["entries"][0]["model"] == "gpt-4o-mini"
    found = samples(metrics)
    assert found[("relayline_attempts_total", (("model", "gpt-4o-mini"), ("outcome", "ok"),
                                               ("provider", "openai.backup")))] == 1
    assert found[("relayline_turn_seconds_count", (("model", "gpt-4o-mini"), ("provider", "openai.backup")))] == 1
    assert found[("relayline_breaker_transitions_total", (("provider", "openai.backup"),))] == 0


def test_oversized_and_malformed_bodies_are_refused():
    with BackgroundGateway(two_profiles(gateway={"max_body_bytes": 1000})) as gw:
        big = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "claude-sonnet-4", "messages": [{"role": "user", "content": "x" * 5000}]})
        bad = httpx.post(f"{gw.url}/v1/chat/completions", content=b"{nope")
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert bad.status_code == 400


def test_ledger_rows_are_written_before_the_response_completes(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    replies = [{"provider": "anthropic.primary", "script": [{"empty": True, "usage": [10, 0]}, {"text": "ok now"}]}]
    with BackgroundGateway(two_profiles(), replies, ledger_path=str(path)) as gw:
        client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI)
        rows = LedgerStore(path).rows()
    assert [(r["provider"], r["outcome"], r["accepted"]) for r in rows] == [
        ("anthropic.primary", "empty", 0), ("anthropic.primary", "ok", 1)]
    out = subprocess.run([sys.executable, "-m", "relayline.adapters.cli", "ledger", "--path", str(path), "--since", "1h",
                          "--json"], capture_output=True, text=True, timeout=60)
    report = json.loads(out.stdout)["rows"]
    assert report == [{"provider": "anthropic.primary", "model": "claude-sonnet-4", "accepted": 1, "rejected": 1,
                       "accepted_cost_usd": pytest.approx((10 * 3 + 2 * 15) / 1e6),
                       "rejected_cost_usd": pytest.approx(10 * 3 / 1e6), "input_tokens": 20, "output_tokens": 2,
                       "estimated": 0}]


def test_the_turns_bookkeeping_waits_for_the_answer_and_never_fails_it(tmp_path, caplog):
    """The ledger row is committed before the answer completes; the turn's metrics, console,
    trace and log lines and the access line come after its bytes are written, and a failing one
    is logged: the answer stands and the gateway serves on."""
    import threading

    path = tmp_path / "ledger.sqlite3"
    replies = [{"provider": "anthropic.primary", "script": [{"text": "first"}, {"text": "second"}]}]
    with BackgroundGateway(two_profiles(), replies, ledger_path=str(path)) as gw:
        answered, observed = threading.Event(), threading.Event()
        seen: list[tuple[bool, int]] = []
        observe = gw.gateway.console.observe

        def observed_after_the_answer(turn_id, result, latency_s, *ended):
            # the client has its whole answer before this returns (else it waits here 5 s in vain)
            seen.append((answered.wait(5), len(LedgerStore(path).rows())))
            observe(turn_id, result, latency_s, *ended)
            observed.set()

        gw.gateway.console.observe = observed_after_the_answer
        assert client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI).choices[0].message.content == "first"
        answered.set()
        assert observed.wait(5)

        def failing(result, seconds):
            raise RuntimeError("a metrics bug")

        gw.gateway.metrics.turn = failing
        assert client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI).choices[0].message.content == "second"
        metrics = samples(httpx.get(f"{gw.url}/metrics").text)
    assert seen == [(True, 1)]  # and the ledger row was there before the answer
    assert any("turn_bookkeeping_error" in r.getMessage() for r in caplog.records)
    # what the failing step left out is the turn's own; the request's metrics were kept
    assert metrics[("relayline_http_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 2
    assert metrics[("relayline_turns_total", (("outcome", "ok"),))] == 1


def test_a_client_disconnect_cancels_the_turn_without_a_retry():
    replies = [{"provider": "anthropic.primary", "script": [
        {"frames": [{"role": True}, {"text": "first"}, {"wait": 3.0}, {"text": " never"}, {"done": True}]}]}]
    with BackgroundGateway(two_profiles(), replies) as gw:
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions",
                          json={"model": "claude-sonnet-4", "messages": HI, "stream": True}, timeout=10) as response:
            for line in response.iter_lines():
                if "first" in line:
                    break  # hang up mid-stream
        deadline = time.monotonic() + 5
        metrics = ""
        cancelled = ("relayline_turns_total", (("outcome", "cancelled"),))
        while time.monotonic() < deadline and samples(metrics).get(cancelled) != 1:
            time.sleep(0.05)
            metrics = httpx.get(f"{gw.url}/metrics").text
        calls = gw.sim.calls
    assert samples(metrics)[cancelled] == 1
    assert calls == 1


def test_a_client_that_hangs_up_cancels_a_non_streamed_turn():
    """The server calls the gateway back when the client hangs up (no task of the turn's own
    waits in receive()): a non-streamed turn still waiting for its upstream is cancelled at once,
    even when the client sent more bytes before it closed."""
    replies = [{"provider": "anthropic.primary", "script": [{"text": "too late", "delay": 5.0}]}]
    with BackgroundGateway(two_profiles(), replies) as gw:
        host, port = gw.url.removeprefix("http://").rsplit(":", 1)
        body = json.dumps({"model": "claude-sonnet-4", "messages": HI}).encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            while gw.sim.calls < 1:
                time.sleep(0.01)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")  # pipelined, unread: the hang-up still shows
        hung_up = time.monotonic()
        cancelled = ("relayline_turns_total", (("outcome", "cancelled"),))
        metrics = ""
        while time.monotonic() < hung_up + 4 and samples(metrics).get(cancelled) != 1:
            time.sleep(0.05)
            metrics = httpx.get(f"{gw.url}/metrics").text
    assert samples(metrics)[cancelled] == 1 and time.monotonic() - hung_up < 4  # not the upstream's 5 s
    assert gw.sim.calls == 1


def test_a_drain_cut_short_cancels_a_non_streamed_turn_with_a_503_and_its_ledger_row(tmp_path):
    """A non-streamed turn has no cancel scope of the gateway's around it (its run's own is the
    one the hang-up and the drain cancel): a drain cut short answers it 503 `shutting_down`,
    once, with no retry."""
    import trio

    replies = [{"provider": "anthropic.primary", "script": [{"text": "too late", "delay": 5.0}]}]
    with BackgroundGateway(two_profiles(), replies, ledger_path=str(tmp_path / "ledger.sqlite3")) as gw:
        with httpx.Client(timeout=10) as http:
            answer: list[httpx.Response] = []
            asked = time.monotonic()
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(http.post, f"{gw.url}/v1/chat/completions", json={"model": "claude-sonnet-4", "messages": HI})
                while gw.sim.calls < 1 and time.monotonic() < asked + 5:
                    time.sleep(0.01)
                trio.from_thread.run_sync(gw.gateway.cancel_turns, trio_token=gw._token)
                answer.append(pending.result())
        rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    response = answer[0]
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down", response.text
    assert response.headers["retry-after"] == "1" and time.monotonic() - asked < 4  # not the upstream's 5 s
    assert gw.sim.calls == 1
    assert rows == []  # (an attempt cancelled before its answer has no usage to bill)


def test_fast_streams_arrive_whole_every_time():
    """Frames that arrive together are written together, and arrive whole. (`make bench`, whose
    upstream sends 200 frames in one write from another process, is what caught a flusher
    cancelled mid-send at the turn's end; this in-process version rarely hits that timing.)"""
    words = " ".join(f"w{i}" for i in range(300))
    with BackgroundGateway(two_profiles(), [{"provider": "anthropic.primary", "script": [{"text": words}]}]) as gw:
        for _ in range(15):
            chunks = list(client(gw).chat.completions.create(model="claude-sonnet-4", messages=HI, stream=True))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == words


# -- the Anthropic messages dialect, with the official anthropic SDK --------------------------------

def claude(gw, key="unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=20)


def test_anthropic_sdk_non_streaming_with_failover():
    replies = [{"provider": "anthropic.primary", "script": [{"status": 529}]},
               {"provider": "openai.backup", "script": [{"text": "backup here", "reasoning": "hmm"}]}]
    with BackgroundGateway(two_profiles(), replies) as gw:
        raw = claude(gw).messages.with_raw_response.create(model="claude-sonnet-4", max_tokens=64, system="be brief",
                                                            messages=[{"role": "user", "content": "hi"}])
        message = raw.parse()
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[1].text == "backup here"
    assert message.model == "gpt-4o-mini" and message.stop_reason == "end_turn"
    assert raw.headers["x-relayline-fallback"] == "true" and message.usage.input_tokens == 10


def test_anthropic_sdk_streaming_and_tools():
    replies = [{"provider": "anthropic.primary", "script": [
        {"frames": [{"role": True}, {"reasoning": "thinking"}, {"text": "Let me"}, {"text": " look."},
                    {"tool_call": "get_weather"}, {"done": True}]}]}]
    with BackgroundGateway(two_profiles(), replies) as gw:
        with claude(gw).messages.stream(model="claude-sonnet-4", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert text == "Let me look."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"] and final.content[2].name == "get_weather"
    assert final.stop_reason == "tool_use"


def test_anthropic_sdk_sees_an_interruption_as_an_error():
    replies = [{"provider": "anthropic.primary", "script": [
        {"frames": [{"role": True}, {"text": "Partial"}, {"error": "overloaded_error"}]}]}]
    received = []
    with BackgroundGateway(two_profiles(), replies) as gw:
        with pytest.raises(anthropic.APIStatusError):
            with claude(gw).messages.stream(model="claude-sonnet-4", max_tokens=64, messages=[{"role": "user", "content": "hi"}]) as stream:
                for text in stream.text_stream:
                    received.append(text)
    assert "".join(received) == "Partial"


def test_anthropic_sdk_gets_anthropic_errors_before_commit():
    replies = [{"provider": "anthropic.primary", "script": [{"status": 400, "error": "prompt is too long"}]}]
    with BackgroundGateway(two_profiles(), replies) as gw, pytest.raises(anthropic.BadRequestError) as info:
        claude(gw).messages.create(model="claude-sonnet-4", max_tokens=64, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert info.value.status_code == 400 and info.value.body["error"]["type"] == "invalid_request_error"


def test_tool_call_arguments_reach_both_dialects():
    import attrs

    from relayline.adapters.codecs.dialects import ANTHROPIC, OPENAI
    from relayline.machines.turn import TurnResult

    served = attrs.make_class("Served", {"model": attrs.field(), "label": attrs.field()})("m", "p/m")
    result = TurnResult("ok", None, None, "p/m", served, "", "", ("get_weather",), None, None, False, (), (), (),
                        tool_arguments=('{"city": "Paris"}',))
    call = OPENAI.completion("id", result, {})["choices"][0]["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_")  # the upstream sent none: a unique one
    block = ANTHROPIC.completion("id", attrs.evolve(result, tool_ids=("toolu_up1",)), {})["content"][0]
    assert block == {"type": "tool_use", "id": "toolu_up1", "name": "get_weather", "input": {"city": "Paris"}}
