"""The Responses API (`POST /v1/responses`, docs/wire.md): the official openai SDK's
`responses.create` and `responses.stream` in front of the real gateway, served by an `openai`
profile and by an `anthropic` profile on a loopback upstream that records what it got; a
failover before commit, and a cut after commit that replays nothing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers import recording_gateway
from relayline.adapters.codecs import responses as responses_codec
from relayline.adapters.codecs import responses_answers
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import (
    JSON,
    SSE,
    Answer,
    RecordingUpstream,
    anthropic_reply,
    openai_reply,
)
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import structure_config
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router
from relayline.machines.stream import Event, EventKind

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
                "parameters": WEATHER, "strict": False}
FAMILIES = pytest.mark.parametrize("family", ["openai", "anthropic"])
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


@pytest.fixture(scope="module")
def gw():
    with recording_gateway(
        {"openai.up": {"model": "gpt-up"},
         "openai.native": {"model": "gpt-native", "api_key": "sk-up-native", "capabilities": {"responses": True}},
         "anthropic.up": {"model": "claude-up", "max_output_tokens": 2048}},
        {"openai": "openai.up", "native": "openai.native", "anthropic": "anthropic.up"},
        key="sk-up",
    ) as gateway:
        yield gateway


def oai(gw, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="gw-key", max_retries=0, timeout=20, **kwargs)


def respond(gw, stream: bool, client: dict | None = None, **kwargs):
    """The final response object, and the stream's events when streamed."""
    if not stream:
        return oai(gw, **(client or {})).responses.create(**kwargs), []
    with oai(gw, **(client or {})).responses.stream(**kwargs) as events:
        seen = list(events)
        return events.get_final_response(), seen


def _sent(upstream) -> dict:
    return upstream.seen[-1].body


@FAMILIES
@STREAM
def test_text_answer_reaches_the_sdk_from_both_families(gw, upstream, family, stream):
    upstream.answer = Answer(text="Paris is sunny")
    response, events = respond(gw, stream, model=family, input="weather in Paris?", instructions="be brief",
                               max_output_tokens=300, temperature=0.5, top_p=0.9, user="u-7",
                               metadata={"ticket": "42"})
    assert response.output_text == "Paris is sunny" and response.status == "completed"
    assert response.usage.input_tokens == 12 and response.usage.output_tokens == 3
    assert response.metadata == {"ticket": "42"}
    sent = _sent(upstream)
    assert sent["temperature"] == 0.5 and sent["top_p"] == 0.9 and sent["max_tokens"] == 300
    if family == "openai":
        assert sent["messages"] == [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "weather in Paris?"}]
        assert sent["user"] == "u-7" and "metadata" not in sent
    else:
        assert sent["system"] == "be brief" or sent["system"] == [{"type": "text", "text": "be brief"}]
        assert sent["messages"] == [{"role": "user", "content": "weather in Paris?"}] or \
            sent["messages"][0]["content"][0]["text"] == "weather in Paris?"
        assert sent["metadata"] == {"user_id": "u-7"}
    if stream:
        kinds = [e.type for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", "response.completed"]
        assert [e.sequence_number for e in events] == list(range(len(events)))


@FAMILIES
@STREAM
def test_a_function_tool_round_trip_keeps_the_call_ids(gw, upstream, family, stream):
    upstream.answer = Answer(text="", tool_calls=(("call_up_1", "get_weather", '{"city": "Paris"}'),))
    response, events = respond(gw, stream, model=family, input="weather in Paris?", tools=[WEATHER_TOOL],
                               tool_choice="required", parallel_tool_calls=False)
    call = next(o for o in response.output if o.type == "function_call")
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_up_1", "get_weather", {"city": "Paris"})
    sent = _sent(upstream)
    if family == "openai":
        assert sent["tools"][0]["function"]["name"] == "get_weather" and sent["tool_choice"] == "required"
        assert sent["parallel_tool_calls"] is False
    else:
        assert sent["tools"][0]["input_schema"] == WEATHER
        assert sent["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    if stream:
        assert [e.type for e in events if "function_call_arguments" in e.type] == [
            "response.function_call_arguments.delta", "response.function_call_arguments.done"]

    # the next turn: the call and its output go back as items; the provider sees its own id
    upstream.answer = Answer(text="It is sunny")
    response, _ = respond(gw, stream, model=family, tools=[WEATHER_TOOL], input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": "call_up_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_up_1", "output": "sunny, 21C"}])
    assert response.output_text == "It is sunny"
    messages = _sent(upstream)["messages"]
    if family == "openai":
        assert messages[1]["tool_calls"][0]["id"] == "call_up_1"
        assert messages[2] == {"role": "tool", "tool_call_id": "call_up_1", "content": "sunny, 21C"}
    else:
        assert messages[1]["content"][-1] == {"type": "tool_use", "id": "call_up_1", "name": "get_weather",
                                              "input": {"city": "Paris"}}
        assert messages[2]["content"][0]["tool_use_id"] == "call_up_1"


def test_json_schema_output_and_reasoning_effort_reach_an_openai_profile(gw, upstream):
    upstream.answer = Answer(text='{"city": "Paris"}')
    schema = {"type": "json_schema", "name": "place", "schema": WEATHER, "strict": True}
    response = oai(gw).responses.create(model="openai", input="where?", text={"format": schema},
                                        reasoning={"effort": "high"})
    assert json.loads(response.output_text) == {"city": "Paris"}
    sent = _sent(upstream)
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "place", "schema": WEATHER, "strict": True}}
    assert sent["reasoning_effort"] == "high"


def test_reasoning_effort_is_a_thinking_budget_for_an_anthropic_profile(gw, upstream):
    upstream.answer = Answer(text="42", reasoning="let me think")
    response = oai(gw).responses.create(model="anthropic", input="6 x 7?", reasoning={"effort": "low"},
                                        max_output_tokens=4000)
    assert _sent(upstream)["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    kinds = [o.type for o in response.output]
    assert kinds == ["reasoning", "message"] and response.output[0].summary[0].text == "let me think"


@STREAM
def test_anthropic_thinking_goes_back_signed_in_relaylines_reasoning_token(gw, upstream, stream):
    upstream.answer = Answer(text="", reasoning="check the weather",
                             tool_calls=(("toolu_1", "get_weather", '{"city": "Oslo"}'),))
    response, _ = respond(gw, stream, model="anthropic", input="weather in Oslo?", tools=[WEATHER_TOOL],
                          reasoning={"effort": "low"}, max_output_tokens=4000)
    reasoning, call = response.output
    assert reasoning.summary[0].text == "check the weather"
    assert reasoning.encrypted_content == "relayline-signature.sig"  # the upstream's signature, in relayline's token
    history = [{"role": "user", "content": "weather in Oslo?"},
               reasoning.model_dump(exclude_none=True), call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": "toolu_1", "output": "cold"}]
    upstream.answer = Answer(text="It is cold")
    for model in ("anthropic", "openai"):
        respond(gw, stream, model=model, input=history, tools=[WEATHER_TOOL], reasoning={"effort": "low"},
                max_output_tokens=4000)
        assistant = _sent(upstream)["messages"][1]
        if model == "anthropic":
            assert assistant["content"][0] == {"type": "thinking", "thinking": "check the weather", "signature": "sig"}
            assert assistant["content"][1]["type"] == "tool_use"
        else:  # reasoning from history is left out towards openai
            assert "reasoning_content" not in assistant and assistant["tool_calls"][0]["id"] == "toolu_1"


@STREAM
def test_max_tokens_is_an_incomplete_response_with_its_reason(gw, upstream, stream):
    upstream.answer = Answer(text="cut sho", finish="length")
    if stream:  # (the SDK's final response is only a completed one: the last event carries this one)
        with oai(gw).responses.stream(model="openai", input="a long story") as events:
            last = list(events)[-1]
        assert last.type == "response.incomplete"
        response = last.response
    else:
        response = oai(gw).responses.create(model="openai", input="a long story")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output_text == "cut sho"


def test_built_in_tools_are_withdrawn_and_named_a_namespace_is_flattened(gw, upstream):
    upstream.answer = Answer(text="", tool_calls=(("call_2", "spawn_agent", "{}"),))
    tools = [{"type": "web_search"}, WEATHER_TOOL,
             {"type": "namespace", "name": "multi_agent_v1", "description": "agents",
              "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"},
                         "strict": False}]}]
    raw = oai(gw).responses.with_raw_response.create(model="anthropic", input="go", tools=tools)
    assert raw.headers["x-relayline-dropped"] == "tools.web_search"
    assert [t["name"] for t in _sent(upstream)["tools"]] == ["get_weather", "spawn_agent"]
    call = raw.parse().output[0]
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")


@pytest.mark.parametrize("fields", [{"previous_response_id": "resp_1"}, {"store": True},
                                    {"tool_choice": {"type": "web_search"}, "tools": [{"type": "web_search"}]}],
                         ids=["previous_response_id", "store", "forced-builtin"])
def test_what_only_a_storing_provider_serves_is_a_400_naming_it(gw, upstream, fields):
    reply = httpx.post(f"{gw.url}/v1/responses", headers={"authorization": "Bearer gw-key"},
                       json={"model": "openai", "input": "hi", **fields}, timeout=20)
    assert reply.status_code == 400 and upstream.seen == []
    name = "tool_choice" if "tool_choice" in fields else next(iter(fields))
    assert name in reply.json()["error"]["message"]


def test_content_only_the_responses_api_holds_is_never_dropped():
    with RecordingUpstream() as upstream:
        config = {"active": "openai.up", "gateway": {"drop_unsupported_params": True},
                  "providers": {"openai.up": {"family": "openai", "base_url": f"{upstream.url}/v1",
                                              "api_key": "sk-up", "model": "gpt-up"}}}
        with BackgroundGateway(config) as gw:
            reply = httpx.post(f"{gw.url}/v1/responses", json={"model": "gpt-up", "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "what is in it?"},
                                             {"type": "input_image", "file_id": "file-1"}]}]}, timeout=20)
    assert reply.status_code == 400 and "image.source.file_id" in reply.json()["error"]["message"]
    assert upstream.seen == []


def test_hints_are_left_out_and_a_wrong_shape_is_a_400_naming_the_field(gw, upstream):
    oai(gw).responses.create(model="openai", input="hi", prompt_cache_key="k1", store=False,
                             include=["reasoning.encrypted_content"], extra_body={"client_metadata": {"a": "b"}})
    assert {"prompt_cache_key", "client_metadata", "include", "store"}.isdisjoint(_sent(upstream))
    reply = httpx.post(f"{gw.url}/v1/responses", headers={"authorization": "Bearer gw-key"},
                       json={"model": "openai", "input": [{"role": "user", "content": 7}]}, timeout=20)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input[0].content"


# -- passthrough to a profile that serves the Responses API ----------------------------------------


@STREAM
def test_a_profile_serving_the_responses_api_gets_the_body_as_sent(gw, upstream, stream):
    upstream.answer = Answer(text="", reasoning="plan", tool_calls=(("call_n1", "get_weather", '{"city": "Oslo"}'),))
    tools = [WEATHER_TOOL, {"type": "web_search"}]
    raw = oai(gw, default_headers={"openai-beta": "responses=v1", "originator": "codex_exec"}).responses
    fields = dict(model="native", input="weather in Oslo?", tools=tools, store=True, prompt_cache_key="k1",
                  include=["reasoning.encrypted_content"], extra_body={"client_metadata": {"a": "b"}})
    if stream:
        with raw.stream(**fields) as events:
            response = events.get_final_response()
    else:
        reply = raw.with_raw_response.create(**fields)
        assert "x-relayline-dropped" not in reply.headers  # the built-in tool was offered as sent
        response = reply.parse()
    seen = upstream.seen[-1]
    assert seen.path == "/v1/responses" and seen.headers["openai-beta"] == "responses=v1"
    assert "originator" not in seen.headers and seen.headers["authorization"] == "Bearer sk-up-native"
    assert seen.body == {"model": "gpt-native", "input": "weather in Oslo?", "tools": tools, "store": True,
                         "prompt_cache_key": "k1", "include": ["reasoning.encrypted_content"],
                         "client_metadata": {"a": "b"}, "stream": stream}
    reasoning, call = response.output
    assert reasoning.encrypted_content == "enc-up" and reasoning.summary[0].text == "plan"
    assert (call.call_id, call.name, json.loads(call.arguments)) == ("call_n1", "get_weather", {"city": "Oslo"})
    assert response.usage.input_tokens == 12


def test_a_responses_capability_outside_the_openai_family_is_a_config_error():
    config = {"active": "anthropic.a", "providers": {"anthropic.a": {
        "family": "anthropic", "base_url": "http://127.0.0.1:9", "api_key": "sk-x", "model": "c",
        "capabilities": {"responses": True}}}}
    with pytest.raises(ConfigError, match=r"providers.\"anthropic.a\".capabilities.responses: only an openai profile"):
        build_router(structure_config(config), {})


# -- failover before commit, a cut after commit -----------------------------------------------------


class Scripted(BackgroundLoopback):
    """An upstream answering by path: /down/... is a 503, /cut/... sends part of an answer and
    drops the connection, the rest answer in their family's shape."""

    def __init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, seen: Seen) -> Reply:
        body = seen.body or {}
        stream, model = bool(body.get("stream")), body.get("model", "")
        if seen.path.startswith("/down/"):
            return Reply(status=503, headers=JSON, pieces=(b'{"error": {"message": "overloaded"}}',))
        anthropic = seen.path.endswith("/v1/messages")
        render = anthropic_reply if anthropic else openai_reply
        pieces = render(Answer(text="from " + model), model, stream)
        if seen.path.startswith("/cut/"):
            return Reply(headers=SSE, pieces=pieces[:2], end=False)
        return Reply(headers=SSE if stream else JSON, pieces=pieces)


def _failover_config(up: Scripted, first: str) -> dict:
    return {"active": "openai.first", "reliability": {"provider_retries": 0},
            "providers": {"openai.first": {"family": "openai", "base_url": f"{up.url}/{first}/v1", "api_key": "sk-a",
                                           "model": "gpt-first", "fallbacks": ["anthropic.second"]},
                          "anthropic.second": {"family": "anthropic", "base_url": f"{up.url}/ok", "api_key": "sk-b",
                                               "model": "claude-second"}}}


@STREAM
def test_a_failover_before_commit_answers_from_the_next_family(tmp_path, stream):
    path = tmp_path / "ledger.sqlite3"
    with Scripted() as up, BackgroundGateway(_failover_config(up, "down"), ledger_path=str(path)) as gw:
        response, events = respond(gw, stream, model="gpt-first", input="hi")
    assert response.output_text == "from claude-second"
    assert [s.path for s in up.seen] == ["/down/v1/chat/completions", "/ok/v1/messages"]
    relayline = response.model_extra["relayline"]
    assert relayline["served"] == "anthropic.second/claude-second" and relayline["fallback"] is True
    if stream:  # nothing of the failed attempt reached the client
        assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
        assert sum(e.type == "response.created" for e in events) == 1
    rows = LedgerStore(path).rows()
    failed = "stream_failed" if stream else "retryable"
    assert relayline["attempts"] == [f"openai.first/gpt-first {failed}", "anthropic.second/claude-second ok"]
    # the refused attempt produced no tokens: the one row bills the answer
    assert [(r["provider"], r["accepted"]) for r in rows] == [("anthropic.second", 1)]
    assert rows[-1]["input_tokens"] == 12 and rows[-1]["output_tokens"] == 3


def test_a_cut_after_commit_is_response_failed_and_replays_nothing(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with Scripted() as up, BackgroundGateway(_failover_config(up, "cut"), ledger_path=str(path)) as gw:
        lines = []
        with httpx.stream("POST", f"{gw.url}/v1/responses", json={"model": "gpt-first", "input": "hi",
                                                                     "stream": True}, timeout=20) as reply:
            lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
    assert "response.completed" not in kinds and kinds.count("response.created") == 1
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "stream_interrupted"
    assert [s.path for s in up.seen] == ["/cut/v1/chat/completions"]  # the fallback was never asked
    assert [(r["provider"], r["accepted"]) for r in LedgerStore(path).rows()] == [("openai.first", 0)]


def test_a_text_delta_written_from_its_cut_bytes_is_the_whole_event_rendered():
    request = responses_codec.parse_request({"model": "m", "input": "hi"})
    stream = responses_answers.ResponsesStream("resp_1", request)
    stream.opening("m")
    texts = ["he", 'llo "q" \u00e9 \U0001f600 \\ </script>', "\x00\n", ""]
    written = [stream.event(Event(EventKind.TEXT, t)) for t in texts]
    item = stream.item["id"]
    whole = [responses_answers.ResponsesStream._event_bytes(
        "response.output_text.delta", n, item_id=item, output_index=0, content_index=0, delta=t, logprobs=[])
        for n, t in zip(range(4, 8), texts, strict=True)]
    assert written[0].endswith(whole[0]) and written[1:] == whole[1:]


@pytest.mark.parametrize("path, body, anthropic_shape", [
    ("/v1/responses", {"input": "hi"}, False),
    ("/v1/embeddings", {"input": "hi"}, False),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}, True)])
def test_a_model_nothing_offers_is_a_404_on_every_new_surface(gw, upstream, path, body, anthropic_shape):
    reply = httpx.post(f"{gw.url}{path}", headers={"authorization": "Bearer gw-key"},
                       json={"model": "no-such-model", **body}, timeout=20)
    assert reply.status_code == 404 and upstream.seen == []
    error = reply.json()["error"]
    assert "no-such-model" in error["message"]
    assert error["type"] == ("not_found_error" if anthropic_shape else "invalid_request_error")


def test_a_stream_whose_head_the_gate_sent_before_any_answer_is_answered_whole():
    """The gate timer sends a Responses stream's head while the provider has not answered yet, so
    `response.created` names no model; the model that then serves is told to the stream with
    its first frame, and the answer reaches the SDK whole, naming it."""
    pieces = openai_reply(Answer(text="late but whole"), "gpt-slow", True)
    with BackgroundLoopback(lambda seen: Reply(headers=SSE, delay=0.6, pieces=pieces)) as up:
        config = {"active": "openai.slow", "timeouts": {"gate_commit_s": 0.1},
                  "providers": {"openai.slow": {"family": "openai", "base_url": f"{up.url}/v1", "api_key": "sk-a",
                                                "model": "gpt-slow"}}}
        with BackgroundGateway(config) as gw:
            response, events = respond(gw, True, model="gpt-slow", input="hi")
    assert events[0].type == "response.created" and events[0].response.model == ""
    assert response.output_text == "late but whole" and response.status == "completed"
    assert response.model == "gpt-slow"
    assert [e.sequence_number for e in events] == list(range(len(events)))


@FAMILIES
@STREAM
def test_a_top_level_field_relayline_does_not_know_is_named_when_left_out(gw, upstream, family, stream):
    # a translating entry cannot send it, and it was left out without a word; the native entry
    # sends the body as sent, so nothing is left out there
    kwargs = {"model": family, "input": "hi", "extra_body": {"frobnicate": {"level": 3}}}
    if stream:
        with oai(gw).responses.with_streaming_response.create(stream=True, **kwargs) as raw:
            headers = raw.headers
            raw.read()
    else:
        headers = oai(gw).responses.with_raw_response.create(**kwargs).headers
    assert headers.get("x-relayline-dropped") == "frobnicate" and "frobnicate" not in _sent(upstream)
    native = oai(gw).responses.with_raw_response.create(**{**kwargs, "model": "native"})
    assert "x-relayline-dropped" not in native.headers and _sent(upstream)["frobnicate"] == {"level": 3}
