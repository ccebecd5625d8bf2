"""The library takes a Responses API request and gives back a Responses answer: a body read by
`responses_request` into `Relay.complete` / `Relay.stream`, served by an openai profile, an
anthropic profile and a profile that speaks the Responses API itself (each on a real loopback
upstream that records what it was sent), and `Reply.response()` / `StreamTurn.response()`
rendering the answer as the `response` object a Responses client reads."""

from __future__ import annotations

import json

import pytest

from helpers import family_config
from relayline.adapters import Relay, WireError, responses_request
from relayline.adapters.sim.recorder import Answer, RecordingUpstream
from relayline.machines.config import structure_config

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BODY = {
    "instructions": "be brief",
    "input": [
        {"role": "developer", "content": "answer in JSON"},
        {"role": "user", "content": [{"type": "input_text", "text": "weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_w1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_w1", "output": "sunny"},
    ],
    "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
    "max_output_tokens": 300,
    "text": {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
    "reasoning": {"effort": "low"},
    "metadata": {"ticket": "42"},
}


def relay_for(up: RecordingUpstream, family: str, **capabilities) -> Relay:
    config = family_config(family, up.url, model=f"{family}-model", api_key="sk-up", capabilities=capabilities)
    return Relay(structure_config(config), env={})


def test_responses_input_reaches_an_openai_profile_translated():
    with RecordingUpstream() as up, relay_for(up, "openai") as relay:
        up.answer = Answer(text='{"city": "Paris"}')
        reply = relay.complete_sync(responses_request(BODY))
    sent = up.seen[-1]
    assert sent.path == "/v1/chat/completions"
    assert sent.body["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "answer in JSON"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_w1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_w1"}]
    assert sent.body["max_tokens"] == 300 and sent.body["reasoning_effort"] == "low"
    assert sent.body["response_format"]["json_schema"]["schema"] == SCHEMA
    response = reply.response()
    assert response["object"] == "response" and response["id"].startswith("resp_")
    assert response["status"] == "completed" and response["incomplete_details"] is None
    [message] = response["output"]
    assert message["type"] == "message" and json.loads(message["content"][0]["text"]) == {"city": "Paris"}
    assert response["usage"]["input_tokens"] == 12 and response["usage"]["output_tokens"] == 3
    assert response["instructions"] == "be brief" and response["max_output_tokens"] == 300
    assert response["metadata"] == {"ticket": "42"} and "relayline" not in response


def test_an_anthropic_profile_thinks_and_calls_a_tool_with_its_own_call_id():
    with RecordingUpstream() as up, relay_for(up, "anthropic") as relay:
        up.answer = Answer(text="", reasoning="look it up", signature="sig-1",
                           tool_calls=(("toolu_7", "get_weather", '{"city": "Oslo"}'),))
        # (a thinking budget must fit under max_tokens)
        body = {k: v for k, v in BODY.items() if k != "text"} | {"max_output_tokens": 2048}
        reply = relay.complete_sync(responses_request(body))
    sent = up.seen[-1].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 1024} and sent["system"] == "be brief\n\nanswer in JSON"
    reasoning, call = reply.response()["output"]
    # the thinking's signature rides relayline's token, so the next turn can send it back
    assert reasoning["summary"][0]["text"] == "look it up" and reasoning["encrypted_content"].endswith("sig-1")
    assert (call["type"], call["call_id"], call["name"]) == ("function_call", "toolu_7", "get_weather")
    assert json.loads(call["arguments"]) == {"city": "Oslo"}


def test_max_tokens_is_an_incomplete_response_streamed_too():
    with RecordingUpstream() as up, relay_for(up, "openai") as relay:
        up.answer = Answer(text="Paris is", finish="length")
        with relay.stream_sync(responses_request({"input": "weather in Paris?", "max_output_tokens": 2})) as turn:
            text = "".join(e.value for e in turn if e.kind == "text")
        response = turn.response()
    assert up.seen[-1].body["stream"] is True and up.seen[-1].body["max_tokens"] == 2
    assert text == "Paris is" and response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["content"][0]["text"] == "Paris is"


def test_a_profile_that_speaks_the_responses_api_is_sent_the_body_and_names_the_answer():
    with RecordingUpstream() as up, relay_for(up, "openai", responses=True) as relay:
        up.answer = Answer(text="stored", reasoning="plan")
        body = {"input": "remember this", "store": True, "include": ["reasoning.encrypted_content"]}
        reply = relay.complete_sync(responses_request(body))
    sent = up.seen[-1]
    assert sent.path == "/v1/responses" and sent.body == {**body, "model": "openai-model", "stream": False}
    response = reply.response()
    assert response["id"] == "resp_up" and response["store"] is True  # the provider's: its next turn names it
    reasoning, message = response["output"]
    assert reasoning["encrypted_content"] == "enc-up" and message["content"][0]["text"] == "stored"


def test_what_the_call_decides_or_a_wrong_shape_is_refused_in_the_caller():
    with pytest.raises(TypeError, match="model"):
        responses_request({"model": "gpt-x", "input": "hi"})
    with pytest.raises(TypeError, match="stream"):
        responses_request({"input": "hi", "stream": True})
    with pytest.raises(WireError, match="max_output_tokens"):
        responses_request({"input": "hi", "max_output_tokens": "many"})
