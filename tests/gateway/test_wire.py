"""Wire fidelity (docs/wire.md): the official openai and anthropic SDKs in front of the
gateway, and a loopback upstream that records every body and header it received. Each request
field is checked in each direction (OpenAI->openai, OpenAI->anthropic, Anthropic->anthropic,
Anthropic->openai), streamed and not; then what the provider said on the way back."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_wire_properties import bodies

from helpers import fresh_upstream, recording_gateway
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.recorder import Answer, RecordingUpstream

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
PDF = "JVBERi0xLjQKJcOkw7zDtsOfCjIgMCBvYmoKPDwvTGVuZ3RoIDMgMCBSPj4Kc3RyZWFtCg=="
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def gw():
    with recording_gateway(
        {"openai.up": {"model": "gpt-up"}, "anthropic.up": {"model": "claude-up", "max_output_tokens": 2048},
         "openai.plain": {"model": "gpt-plain", "capabilities": {"vision": False, "tools": False}},
         "anthropic.lenient": {"model": "claude-lenient"}},
        {"openai": "openai.up", "anthropic": "anthropic.up", "plain": "openai.plain"},
        shared={"headers": {"x-team": "core"}},
    ) as gateway:
        yield gateway


def oai(gw, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="gw-key", max_retries=0, timeout=20, **kwargs)


def claude(gw, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="gw-key", max_retries=0, timeout=20, **kwargs)


def openai_call(gw, stream: bool, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
    if stream:
        with oai(gw).chat.completions.create(stream=True, **kwargs) as chunks:
            return list(chunks)
    return oai(gw).chat.completions.create(**kwargs)


def anthropic_call(gw, stream: bool, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
    kwargs.setdefault("max_tokens", 64)
    # this SDK version no longer has sampling parameters of its own: they travel as body fields
    sampling = {k: kwargs.pop(k) for k in ("temperature", "top_p", "top_k") if k in kwargs}
    if sampling:
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **sampling}
    if stream:
        with claude(gw).messages.stream(**kwargs) as events:
            return events.get_final_message()
    return claude(gw).messages.create(**kwargs)


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])


# -- requests: OpenAI clients -------------------------------------------------------------------------

# (case, OpenAI request fields, expected on an openai upstream, expected on an anthropic upstream)
OPENAI_FIELDS = [
    ("temperature_top_p", {"temperature": 0.25, "top_p": 0.5}, {"temperature": 0.25, "top_p": 0.5},
     {"temperature": 0.25, "top_p": 0.5}),
    ("max_tokens", {"max_tokens": 77}, {"max_tokens": 77}, {"max_tokens": 77}),
    ("max_completion_tokens", {"max_completion_tokens": 55}, {"max_completion_tokens": 55}, {"max_tokens": 55}),
    ("default_max_tokens", {}, {}, {"max_tokens": 2048}),
    ("stop", {"stop": ["END", "STOP"]}, {"stop": ["END", "STOP"]}, {"stop_sequences": ["END", "STOP"]}),
    ("stop_string", {"stop": "END"}, {"stop": "END"}, {"stop_sequences": ["END"]}),
    ("user", {"user": "u-42"}, {"user": "u-42"}, {"metadata": {"user_id": "u-42"}}),
    ("system", {"messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "in French"},
                             {"role": "user", "content": "hi"}]},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "in French"},
                   {"role": "user", "content": "hi"}]},
     {"system": "be brief\n\nin French", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    ("tools_required", {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                                    "parameters": WEATHER}}],
                        "tool_choice": "required"},
     {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}}],
      "tool_choice": "required"},
     {"tools": [{"name": "get_weather", "description": "d", "input_schema": WEATHER}], "tool_choice": {"type": "any"}}),
    ("tool_choice_named", {"tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}],
                           "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False},
     {"tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False},
     {"tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True}}),
    ("reasoning_effort", {"reasoning_effort": "medium"}, {"reasoning_effort": "medium"},
     {"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 2048 + 4096}),
    # OpenAI's limit counts the reasoning; Anthropic wants the budget below max_tokens
    ("reasoning_effort_within_a_limit", {"reasoning_effort": "medium", "max_completion_tokens": 3000},
     {"reasoning_effort": "medium", "max_completion_tokens": 3000},
     {"thinking": {"type": "enabled", "budget_tokens": 2999}, "max_tokens": 3000}),
    ("image_base64", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "text", "text": "what is this?"},
         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "text", "text": "what is this?"},
         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}),
    ("image_url", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]},
     {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url",
                                                                             "url": "https://example.com/cat.png"}}]}]}),
    ("pdf", {"messages": [{"role": "user", "content": [
        {"type": "file", "file": {"filename": "a.pdf", "file_data": f"data:application/pdf;base64,{PDF}"}}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "file", "file": {"filename": "a.pdf", "file_data": f"data:application/pdf;base64,{PDF}"}}]}]},
     {"messages": [{"role": "user", "content": [  # (the file's name was left behind)
         {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
          "title": "a.pdf"}]}]}),
    ("tool_loop", {"messages": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
        {"role": "user", "content": "thanks"}]},
     {"messages": [
         {"role": "user", "content": "weather in Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
         {"role": "user", "content": "thanks"}]},
     {"messages": [
         {"role": "user", "content": [{"type": "text", "text": "weather in Paris?"}]},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "call_abc", "name": "get_weather",
                                            "input": {"city": "Paris"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_abc",
                                       "content": [{"type": "text", "text": "sunny"}]},
                                      {"type": "text", "text": "thanks"}]}]}),
    # a system message after the conversation began keeps its place (Anthropic: a system message)
    ("system_mid_conversation", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "developer", "content": "now in French"},
        {"role": "user", "content": "again"}]},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}, {"role": "developer", "content": "now in French"},
                   {"role": "user", "content": "again"}]},
     {"system": "be brief", "messages": [
         {"role": "user", "content": [{"type": "text", "text": "hi"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
         {"role": "system", "content": [{"type": "text", "text": "now in French"}]},
         {"role": "user", "content": [{"type": "text", "text": "again"}]}]}),
    # opencode's caching hints: on the message (it moves to the message's last block), on a part (it stays)
    ("cache_control", {"messages": [
        {"role": "system", "content": "SYSTEM PROMPT", "cache_control": {"type": "ephemeral"}},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "cache_control": {"type": "ephemeral"}},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                     {"type": "text", "text": "d"}]}]},
     {"messages": [
         {"role": "system", "content": "SYSTEM PROMPT", "cache_control": {"type": "ephemeral"}},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
          "cache_control": {"type": "ephemeral"}},
         {"role": "assistant", "content": "ok"},
         {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                      {"type": "text", "text": "d"}]}]},
     {"system": [{"type": "text", "text": "SYSTEM PROMPT", "cache_control": {"type": "ephemeral"}}], "messages": [
         {"role": "user", "content": [{"type": "text", "text": "a"},
                                      {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]},
         {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
         {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                      {"type": "text", "text": "d"}]}]}),
    # on an assistant's tool call (opencode marks the last message of the history, a tool call
    # included): the hint lands on the tool_use block
    ("tool_call_cache_control", {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"},
             "cache_control": {"type": "ephemeral"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     {"messages": [
         {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"},
              "cache_control": {"type": "ephemeral"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]},
     {"messages": [
         {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "f", "input": {},
                                            "cache_control": {"type": "ephemeral"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                       "content": [{"type": "text", "text": "sunny"}]}]}]}),
    # and on a tool (it was read past, and Anthropic's cache prefix lost its tools)
    ("tool_cache_control", {"tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER},
                                       "cache_control": {"type": "ephemeral"}}]},
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER},
                 "cache_control": {"type": "ephemeral"}}]},
     {"tools": [{"name": "f", "description": "", "input_schema": WEATHER, "cache_control": {"type": "ephemeral"}}]}),
]


def subset(expected: dict, body: dict) -> None:
    for key, value in expected.items():
        assert body.get(key) == value, (key, body.get(key))


@STREAM
@pytest.mark.parametrize("case,fields,to_openai,to_anthropic", OPENAI_FIELDS, ids=[c[0] for c in OPENAI_FIELDS])
def test_openai_client_fields_reach_both_families(gw, upstream, stream, case, fields, to_openai, to_anthropic):
    openai_call(gw, stream, model="openai", **fields)
    sent = upstream.seen[-1].body
    subset(to_openai, sent)
    # same family: the client's body as sent, only model/stream/stream_options set by relayline
    assert sent["model"] == "gpt-up" and sent["stream"] is stream
    assert ("stream_options" in sent) is stream and (not stream or sent["stream_options"]["include_usage"])
    assert {k for k in sent if k not in ("model", "stream", "stream_options")} == {
        k for k in {"messages", *fields} if k != "stream_options"}
    openai_call(gw, stream, model="anthropic", **fields)
    sent = upstream.seen[-1].body
    subset(to_anthropic, sent)
    assert sent["model"] == "claude-up" and sent["stream"] is stream and "stream_options" not in sent


@STREAM
def test_same_family_passes_unknown_fields_and_client_headers(gw, upstream, stream):
    client = oai(gw, organization="org-7", project="proj-9", default_headers={"openai-beta": "assistants=v2"})
    kwargs = dict(model="openai", messages=[{"role": "user", "content": "hi"}], seed=7, logprobs=True,
                  extra_body={"provider": {"order": ["x"]}, "guided_json": {"type": "object"}})
    if stream:
        list(client.chat.completions.create(stream=True, **kwargs))
    else:
        client.chat.completions.create(**kwargs)
    seen = upstream.seen[-1]
    assert seen.body["seed"] == 7 and seen.body["logprobs"] is True
    assert seen.body["provider"] == {"order": ["x"]} and seen.body["guided_json"] == {"type": "object"}
    assert seen.headers["openai-beta"] == "assistants=v2"
    # the profile's credential and headers, never the client's, nor its choice of who is billed
    assert "openai-organization" not in seen.headers and "openai-project" not in seen.headers
    assert seen.headers["authorization"] == "Bearer sk-upstream-openai" and seen.headers["x-team"] == "core"


def test_sdk_objects_echoed_into_history_cross_families(gw, upstream):
    """The SDKs' own reply objects, appended to the history as they are (refusal: null,
    annotations: [], citations: null...), say nothing another family must honour."""
    upstream.answer = Answer(text="", tool_calls=(TOOL,))
    first = openai_call(gw, False, model="anthropic", messages=[{"role": "user", "content": "weather?"}])
    history = [{"role": "user", "content": "weather?"}, first.choices[0].message.model_dump(),
               {"role": "tool", "tool_call_id": "call_UP1", "content": "sunny"}]
    upstream.answer = Answer(text="Sunny.")
    assert openai_call(gw, False, model="anthropic", messages=history).choices[0].message.content == "Sunny."
    sent = upstream.seen[-1].body["messages"]
    assert sent[1]["content"] == [{"type": "tool_use", "id": "call_UP1", "name": "get_weather", "input": {"city": "Paris"}}]
    upstream.answer = Answer(text="Cited.")
    message = anthropic_call(gw, False, model="openai")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
               {"role": "user", "content": "more"}]
    assert anthropic_call(gw, False, model="openai", messages=history).content[0].text == "Cited."


@pytest.mark.parametrize("fields,named", [
    ({"seed": 7}, "seed"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"provider": {"order": ["x"]}}}, "provider"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"reasoning_effort": "low", "max_tokens": 1024}, "reasoning_effort"),  # no room for Anthropic's least budget
    # what the Anthropic shapes have no place for is refused, never dropped on the way
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/c.png", "detail": "low"}}]}]},
     "content.image_url.detail"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Par'}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "cut"}]},
     "tool_calls.function.arguments"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "a list"}]},
     "tool_calls.function.arguments"),
    # a tool's or a tool call's keys beside the function were read past, never sent nor named
    ({"tools": [{"type": "function", "function": {"name": "f"}, "defer_loading": True}]}, "tools.defer_loading"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "thought": "x"},
                        "extra_content": {"google": {"thought_signature": "s"}}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "done"}]},
     "messages.tool_calls.extra_content, messages.tool_calls.function.thought"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "f", "why": "x"}, "note": 1}},
     "tool_choice.note, tool_choice.function.why"),
    ({"response_format": {"type": "json_schema", "note": 1, "json_schema": {"name": "n", "schema": WEATHER, "v": 2}}},
     "response_format.note, response_format.json_schema.v"),
    # a custom tool (free-form input) has no Anthropic shape: it was a 400 as if of the wrong shape
    ({"tools": [{"type": "custom", "custom": {"name": "g"}}]}, "tools.custom"),
    # OpenAI's temperature reaches 2, Anthropic's 1: it went on and the provider refused it
    ({"temperature": 1.5}, "temperature"),
])
def test_openai_fields_anthropic_cannot_honour_are_a_400_naming_them(gw, upstream, fields, named):
    with pytest.raises(openai.BadRequestError) as info:
        openai_call(gw, False, model="anthropic", **fields)
    assert named in info.value.message and info.value.code == "unsupported_parameter"
    assert upstream.seen == []  # nothing was sent


def test_images_and_tools_skip_a_profile_without_the_capability(gw, upstream):
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/c.png"}}]}]
    with pytest.raises(openai.BadRequestError) as info:
        openai_call(gw, False, model="plain", messages=image)
    assert "image" in info.value.message and upstream.seen == []
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}]
    with pytest.raises(openai.BadRequestError) as info:
        openai_call(gw, False, model="plain", tools=tools)
    assert "tools" in info.value.message and upstream.seen == []


# -- requests: Anthropic clients ----------------------------------------------------------------------

ANTHROPIC_FIELDS = [
    ("max_tokens", {"max_tokens": 99}, {"max_tokens": 99}, {"max_tokens": 99}),
    ("temperature_top_p", {"temperature": 0.25, "top_p": 0.5}, {"temperature": 0.25, "top_p": 0.5},
     {"temperature": 0.25, "top_p": 0.5}),
    ("stop_sequences", {"stop_sequences": ["END"]}, {"stop_sequences": ["END"]}, {"stop": ["END"]}),
    ("system_string", {"system": "be brief"}, {"system": "be brief"},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    ("system_blocks", {"system": [{"type": "text", "text": "be brief"}]}, {"system": [{"type": "text", "text": "be brief"}]},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    ("metadata", {"metadata": {"user_id": "u-42"}}, {"metadata": {"user_id": "u-42"}}, {"user": "u-42"}),
    ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 8000},
     {"thinking": {"type": "enabled", "budget_tokens": 4096}}, {"reasoning_effort": "medium", "max_tokens": 8000}),
    ("tools_any", {"tools": [{"name": "get_weather", "description": "d", "input_schema": WEATHER}],
                   "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
     {"tools": [{"name": "get_weather", "description": "d", "input_schema": WEATHER}],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
     {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}}],
      "tool_choice": "required", "parallel_tool_calls": False}),
    ("tool_named", {"tools": [{"name": "f", "input_schema": WEATHER}], "tool_choice": {"type": "tool", "name": "f"}},
     {"tool_choice": {"type": "tool", "name": "f"}}, {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("image_base64", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "text", "text": "what is this?"}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
         {"type": "text", "text": "what is this?"}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
         {"type": "text", "text": "what is this?"}]}]}),
    ("image_url", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}]},
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]}),
    ("pdf", {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF}}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "file", "file": {"filename": "document.pdf", "file_data": f"data:application/pdf;base64,{PDF}"}}]}]}),
    # a document's title was a field openai could not honour: it is the file's name
    ("titled_pdf", {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
         "title": "report.pdf"}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
          "title": "report.pdf"}]}]},
     {"messages": [{"role": "user", "content": [
         {"type": "file", "file": {"filename": "report.pdf", "file_data": f"data:application/pdf;base64,{PDF}"}}]}]}),
    ("tool_loop", {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_abc", "content": "sunny"},
                                     {"type": "text", "text": "thanks"}]}]},
     {"messages": [
         {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                           {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                            "input": {"city": "Paris"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_abc", "content": "sunny"},
                                      {"type": "text", "text": "thanks"}]}]},
     {"messages": [
         {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "Checking.", "tool_calls": [
             {"id": "toolu_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "toolu_abc", "content": "sunny"},
         {"role": "user", "content": "thanks"}]}),
    ("system_mid_conversation", {"system": "be brief", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "system", "content": [{"type": "text", "text": "now in French"}]}, {"role": "user", "content": "again"}]},
     {"system": "be brief", "messages": [
         {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "system", "content": [{"type": "text", "text": "now in French"}]}, {"role": "user", "content": "again"}]},
     {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello"}, {"role": "system", "content": "now in French"},
                   {"role": "user", "content": "again"}]}),
    ("adaptive_thinking_effort", {"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}},
     {"thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}, {"reasoning_effort": "low"}),
    ("effort_alone", {"output_config": {"effort": "medium"}}, {"output_config": {"effort": "medium"}},
     {"reasoning_effort": "medium"}),
    # adaptive alone asks for no effort: the openai profile's model thinks at its own default
    ("adaptive_thinking", {"thinking": {"type": "adaptive"}}, {"thinking": {"type": "adaptive"}},
     {"reasoning_effort": None}),
    # caching hints are no content: towards openai they become nothing, and nothing is named dropped
    ("cache_control", {"system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
                       "tools": [{"name": "f", "input_schema": WEATHER, "cache_control": {"type": "ephemeral"}}],
                       "messages": [
        {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "Oslo"},
                                           "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain",
                                      "cache_control": {"type": "ephemeral"}}]}]},
     {"system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]},
     {"tools": [{"type": "function", "function": {"name": "f", "description": "", "parameters": WEATHER}}],
      "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]},
                   {"role": "tool", "tool_call_id": "t1", "content": "rain"}]}),
]


@STREAM
@pytest.mark.parametrize("case,fields,to_anthropic,to_openai", ANTHROPIC_FIELDS, ids=[c[0] for c in ANTHROPIC_FIELDS])
def test_anthropic_client_fields_reach_both_families(gw, upstream, stream, case, fields, to_anthropic, to_openai):
    anthropic_call(gw, stream, model="anthropic", **fields)
    sent = upstream.seen[-1].body
    subset(to_anthropic, sent)
    assert sent["model"] == "claude-up" and sent["stream"] is stream
    anthropic_call(gw, stream, model="openai", **fields)
    sent = upstream.seen[-1].body
    subset(to_openai, sent)
    assert sent["model"] == "gpt-up" and sent["stream"] is stream


@STREAM
def test_anthropic_passthrough_keeps_cache_control_top_k_and_the_beta_header(gw, upstream, stream):
    messages = [{"role": "user", "content": [{"type": "text", "text": "long context",
                                              "cache_control": {"type": "ephemeral"}}]}]
    anthropic_call(gw, stream, model="anthropic", messages=messages, top_k=5, max_tokens=64,
                   extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    seen = upstream.seen[-1]
    assert seen.body["messages"] == messages and seen.body["top_k"] == 5 and seen.body["max_tokens"] == 64
    assert seen.headers["anthropic-beta"] == "prompt-caching-2024-07-31"
    assert seen.headers["x-api-key"] == "sk-upstream-anthropic" and "authorization" not in seen.headers


# what Claude Code sends on its first request (its shapes, shortened): a system prompt and turns
# with cache_control, a system message mid-conversation, adaptive thinking at an effort, context
# editing, tools whose schema names its dialect, and a user id that is a JSON document
CLAUDE_CODE = {
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "fix the failing test",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "<system-reminder>The todo list is empty.</system-reminder>"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "Bash",
                                           "input": {"command": "pytest -x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                      "content": [{"type": "text", "text": "1 failed"}],
                                      "cache_control": {"type": "ephemeral"}}]},
    ],
    "tools": [{"name": "Bash", "description": "Run a command",
               "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                                "properties": {"command": {"type": "string"}}, "required": ["command"],
                                "additionalProperties": False},
               "cache_control": {"type": "ephemeral"}}],
    "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "s-1"})},
    "thinking": {"type": "adaptive"},
    "output_config": {"effort": "high"},
}
CONTEXT_MANAGEMENT = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}


@STREAM
def test_claude_codes_first_request_reaches_an_anthropic_profile_as_sent(gw, upstream, stream):
    # it was a 400 (messages[1].role: must be user or assistant; thinking.type: must be enabled or
    # disabled): the same family is sent what it does not know, not judged
    anthropic_call(gw, stream, model="anthropic", max_tokens=32000, **CLAUDE_CODE,
                   extra_body={"context_management": CONTEXT_MANAGEMENT},
                   extra_headers={"anthropic-beta": "context-management-2025-06-27"})
    sent = upstream.seen[-1].body
    assert {k: v for k, v in sent.items() if k not in ("model", "stream")} == {
        **CLAUDE_CODE, "max_tokens": 32000, "context_management": CONTEXT_MANAGEMENT}
    assert upstream.seen[-1].headers["anthropic-beta"] == "context-management-2025-06-27"


@STREAM
def test_claude_codes_request_crosses_to_an_openai_profile(gw, upstream, stream):
    # it was refused: "no entry can honour the request as asked" (cache_control, the system
    # message, adaptive thinking); each crosses now, and nothing is named dropped
    raw = claude(gw).messages.with_raw_response
    reply = raw.create(model="openai", max_tokens=32000, stream=stream, **CLAUDE_CODE)
    if stream:
        list(reply.parse())
    sent = upstream.seen[-1].body
    assert sent["messages"] == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "fix the failing test"},
        {"role": "system", "content": "<system-reminder>The todo list is empty.</system-reminder>"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_01", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "pytest -x"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "1 failed"}]
    tool = CLAUDE_CODE["tools"][0]
    assert sent["tools"] == [{"type": "function", "function": {"name": "Bash", "description": tool["description"],
                                                               "parameters": tool["input_schema"]}}]
    assert sent["reasoning_effort"] == "high" and sent["user"] == CLAUDE_CODE["metadata"]["user_id"]
    assert "cache_control" not in json.dumps(sent) and "x-relayline-dropped" not in reply.headers


@STREAM
def test_an_anthropic_body_less_a_dropped_field_keeps_claude_codes_shapes(dropping, dropped_to, stream):
    # a dropped field (tools, for a profile without them) goes alone from the client's body: the
    # system message keeps its place, and the caching hints, adaptive thinking, its effort and
    # context editing go as Claude Code wrote them
    raw = claude(dropping).messages.with_raw_response
    reply = raw.create(model="anthropic-notools", max_tokens=32000, stream=stream, **CLAUDE_CODE,
                       extra_body={"context_management": CONTEXT_MANAGEMENT})
    if stream:
        list(reply.parse())
    sent = dropped_to.seen[-1].body
    assert reply.headers["x-relayline-dropped"] == "tools" and "tools" not in sent
    assert sent["system"] == CLAUDE_CODE["system"]
    assert sent["messages"] == CLAUDE_CODE["messages"]
    assert (sent["thinking"], sent["output_config"]) == (CLAUDE_CODE["thinking"], CLAUDE_CODE["output_config"])
    assert sent["metadata"] == CLAUDE_CODE["metadata"] and sent["context_management"] == CONTEXT_MANAGEMENT


@pytest.mark.parametrize("fields,named", [
    ({"top_k": 5}, "top_k"),
    # server-side context editing has no chat completions equivalent; nor has an effort above high
    ({"extra_body": {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}}, "context_management"),
    ({"thinking": {"type": "adaptive"}, "output_config": {"effort": "max"}}, "output_config.effort"),
    ({"thinking": {"type": "a-later-kind"}}, "thinking"),
    # keys beside the ones read were read past, never sent nor named
    ({"thinking": {"type": "enabled", "budget_tokens": 2048, "display": "omitted"}}, "thinking.display"),
    ({"tools": [{"name": "f", "input_schema": WEATHER}], "tool_choice": {"type": "auto", "note": 1}}, "tool_choice.note"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                                 "is_error": True}]}]}, "is_error"),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}}]}]},
     "document.source.text"),
    # a trailing assistant message asks Anthropic to continue it; an OpenAI server answers anew
    ({"messages": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]},
     "prefill"),
    # an OpenAI tool message holds text alone
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}]},
     "tool_result.content.image"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "file_1"}}]}]},
     "image.source.file"),
])
def test_anthropic_fields_openai_cannot_honour_are_an_anthropic_400(gw, upstream, fields, named):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_call(gw, False, model="openai", **fields)
    assert named in info.value.message and info.value.body["type"] == "error"
    assert upstream.seen == []


ANTHROPIC_SOURCES = [
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}, "title": "t"},
    {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "a chunk"}]}},
    {"type": "document", "source": {"type": "file", "file_id": "file_011"}},
    {"type": "image", "source": {"type": "file", "file_id": "file_012"}},
]


@pytest.mark.parametrize("block", ANTHROPIC_SOURCES, ids=["text", "content", "file-document", "file-image"])
def test_anthropic_document_and_file_sources_reach_an_anthropic_profile_as_sent(gw, upstream, block):
    messages = [{"role": "user", "content": [block, {"type": "text", "text": "summarise"}]}]
    assert anthropic_call(gw, False, model="anthropic", messages=messages).content[0].text == "ok"
    assert upstream.seen[-1].body["messages"] == messages


# -- responses --------------------------------------------------------------------------------------

TOOL = ("call_UP1", "get_weather", '{"city": "Paris"}')


@STREAM
@pytest.mark.parametrize("route", ["openai", "anthropic"])
def test_openai_clients_get_finish_reasons_ids_and_usage(gw, upstream, stream, route):
    native = {"openai": "length", "anthropic": "max_tokens"}[route]
    upstream.answer = Answer(text="cut sho", finish=native)
    if stream:
        chunks = openai_call(gw, True, model=route)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"] and all(c.choices for c in chunks)  # no usage chunk: not asked for
    else:
        assert openai_call(gw, False, model=route).choices[0].finish_reason == "length"
    upstream.answer = Answer(text="", tool_calls=(TOOL,))
    if stream:
        chunks = openai_call(gw, True, model=route, stream_options={"include_usage": True})
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        assert calls[0].id == "call_UP1" and calls[0].function.name == "get_weather"
        assert "".join(t.function.arguments or "" for t in calls).replace(" ", "") == '{"city":"Paris"}'
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == 12
    else:
        reply = openai_call(gw, False, model=route)
        message = reply.choices[0].message
        assert message.content is None and message.tool_calls[0].id == "call_UP1"
        assert reply.choices[0].finish_reason == "tool_calls"


@STREAM
@pytest.mark.parametrize("route", ["openai", "anthropic"])
def test_anthropic_clients_get_stop_reasons_ids_and_real_usage(gw, upstream, stream, route):
    upstream.answer = Answer(text="", tool_calls=(TOOL,), usage=(
        {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 100}}
        if route == "openai" else
        {"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 0}))
    message = anthropic_call(gw, stream, model=route)
    assert message.stop_reason == "tool_use" and message.content[-1].id == "call_UP1"
    assert message.content[-1].input == {"city": "Paris"}
    assert (message.usage.input_tokens, message.usage.output_tokens, message.usage.cache_read_input_tokens) == (20, 7, 100)
    upstream.answer = Answer(text="The end", finish="stop" if route == "openai" else "stop_sequence",
                             stop_sequence=None if route == "openai" else "END")
    message = anthropic_call(gw, stream, model=route, stop_sequences=["END"])
    assert message.stop_reason == ("end_turn" if route == "openai" else "stop_sequence")
    assert message.stop_sequence == (None if route == "openai" else "END")  # OpenAI never says which


def test_anthropic_stream_message_start_carries_the_input_tokens(gw, upstream):
    upstream.answer = Answer(text="hello", usage={"input_tokens": 321, "output_tokens": 9})
    with claude(gw).messages.create(model="anthropic", max_tokens=64, stream=True,
                                    messages=[{"role": "user", "content": "hi"}]) as events:
        events = list(events)
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == 321
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens == 9


@STREAM
def test_thinking_reaches_an_anthropic_client_signed_so_it_can_go_back(gw, upstream, stream):
    """Anthropic verifies the signature of each thinking block a client sends back (thinking with
    tools must be sent back): a gateway that drops it breaks the next turn."""
    upstream.answer = Answer(text="Let me check.", reasoning="I should look it up.", tool_calls=(TOOL,),
                             redacted="" if stream else "EmwKAhgBEgy")
    message = anthropic_call(gw, stream, model="anthropic", max_tokens=2048,
                             thinking={"type": "enabled", "budget_tokens": 1024})
    blocks = [b.model_dump(exclude_none=True) for b in message.content]
    assert blocks[0] == {"type": "thinking", "thinking": "I should look it up.", "signature": "sig"}
    if not stream:
        assert blocks[1] == {"type": "redacted_thinking", "data": "EmwKAhgBEgy"}
    assert [b["type"] for b in blocks[-2:]] == ["text", "tool_use"]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": blocks},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": TOOL[0], "content": "sunny"}]}]
    anthropic_call(gw, False, model="anthropic", messages=history, max_tokens=2048,
                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert upstream.seen[-1].body["messages"][1]["content"] == blocks


@STREAM
def test_logprobs_reach_the_openai_client_that_asked_for_them(gw, upstream, stream):
    upstream.answer = Answer(text="Paris", logprobs=True)
    reply = openai_call(gw, stream, model="openai", logprobs=True)
    choices = [c.choices[0] for c in reply if c.choices and c.choices[0].delta.content] if stream else reply.choices
    assert [c.logprobs.model_dump() for c in choices] == [
        {"content": [{"token": "Paris", "logprob": -0.25, "bytes": [80, 97, 114, 105, 115], "top_logprobs": []}],
         "refusal": None}]
    assert upstream.seen[-1].body["logprobs"] is True


@STREAM
def test_a_paused_server_tool_turn_stays_paused_for_an_anthropic_client(gw, upstream, stream):
    """pause_turn asks the client to send the turn back to be continued: it was end_turn."""
    upstream.answer = Answer(text="Searching.", finish="pause_turn")
    assert anthropic_call(gw, stream, model="anthropic").stop_reason == "pause_turn"
    assert openai_call(gw, False, model="anthropic").choices[0].finish_reason == "stop"


def test_url_citations_reach_an_openai_client(gw, upstream):
    """A search model's answer cites its sources in message.annotations: they were dropped."""
    cited = {"type": "url_citation", "url_citation": {"start_index": 0, "end_index": 5, "url": "https://example.com/",
                                                      "title": "Example"}}
    upstream.answer = Answer(text="Paris", annotations=(cited,))
    message = openai_call(gw, False, model="openai").choices[0].message
    assert [a.model_dump() for a in message.annotations] == [cited]
    upstream.answer = Answer(text="Paris")
    assert openai_call(gw, False, model="openai").choices[0].message.annotations is None  # none: none shown


def test_citations_reach_an_anthropic_client_and_the_words_an_openai_one(gw, upstream):
    cited = {"type": "char_location", "cited_text": "The grass is green.", "document_index": 0,
             "document_title": "facts", "start_char_index": 0, "end_char_index": 20}
    upstream.answer = Answer(text="The grass is green.", citations=(cited,))
    message = anthropic_call(gw, False, model="anthropic")
    assert [b.model_dump(exclude_none=True) for b in message.content] == [
        {"type": "text", "text": "The grass is green.", "citations": [cited]}]
    assert openai_call(gw, False, model="anthropic").choices[0].message.content == "The grass is green."


def test_usage_details_and_reasoning_reach_an_openai_client(gw, upstream):
    upstream.answer = Answer(text="42", reasoning="let me think", usage={
        "prompt_tokens": 50, "completion_tokens": 30, "prompt_tokens_details": {"cached_tokens": 20},
        "completion_tokens_details": {"reasoning_tokens": 25}})
    reply = openai_call(gw, False, model="openai")
    assert reply.choices[0].message.model_extra["reasoning_content"] == "let me think"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (50, 30)
    assert reply.usage.prompt_tokens_details.cached_tokens == 20
    assert reply.usage.completion_tokens_details.reasoning_tokens == 25


# -- errors -----------------------------------------------------------------------------------------


def test_an_upstream_rejection_is_the_clients_rejection_with_the_upstreams_words(gw, upstream):
    upstream.answer = Answer(status=400, error={"type": "invalid_request_error",
                                                "message": "max_tokens: 999999 > 8192, the maximum for this model"})
    with pytest.raises(openai.BadRequestError) as info:
        openai_call(gw, False, model="openai")
    assert info.value.status_code == 400 and "the maximum for this model" in info.value.message
    assert info.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_call(gw, False, model="anthropic")
    assert info.value.body["error"] == {"type": "invalid_request_error",
                                        "message": "max_tokens: 999999 > 8192, the maximum for this model"}


def test_an_upstream_rejection_never_echoes_a_key(gw, upstream):
    upstream.answer = Answer(status=422, error={"type": "invalid_request_error",
                                                "message": "bad key sk-upstream-openai in request"})
    with pytest.raises(openai.UnprocessableEntityError) as info:
        openai_call(gw, False, model="openai")
    assert "sk-upstream-openai" not in info.value.response.text and "***" in info.value.message


def test_spent_retries_tell_the_sdk_not_to_retry(gw, upstream):
    upstream.answer = Answer(status=500, error={"type": "server_error", "message": "boom"})
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="gw-key", max_retries=2, timeout=20)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="openai", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 502 and info.value.response.headers["x-should-retry"] == "false"
    assert len(upstream.seen) == 1  # the SDK did not multiply relayline's attempts


@STREAM
def test_an_openai_refusal_is_the_answer_in_both_dialects_not_an_empty_completion(gw, upstream, stream):
    """OpenAI declines in `message.refusal` (content null, finish_reason stop); it was read as
    an empty answer, retried and ended in a 502 that never showed the client the refusal."""
    upstream.answer = Answer(text="", refusal="I'm sorry, I can't help with that.")
    if stream:
        chunks = openai_call(gw, True, model="openai")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = openai_call(gw, False, model="openai").choices[0]
        text, finish = choice.message.content, [choice.finish_reason]
    assert (text, finish) == ("I'm sorry, I can't help with that.", ["content_filter"])
    message = anthropic_call(gw, stream, model="openai")
    assert [b.text for b in message.content] == ["I'm sorry, I can't help with that."]
    assert message.stop_reason == "refusal" and len(upstream.seen) == 2


def test_a_200_carrying_an_error_is_a_failure_not_an_empty_answer(gw, upstream):
    upstream.answer = Answer(text="", error={"type": "server_error", "message": "overloaded"})
    with pytest.raises(openai.APIStatusError) as info:
        openai_call(gw, False, model="openai")
    assert info.value.status_code == 502 and "empty" not in info.value.message


@pytest.mark.parametrize("body,param", [
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "x", "messages": "x"}, "messages"),
    ({"model": "x", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "x", "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}], "tools": [1]}, "tools[0]"),
    ({"model": "x\nforged log line", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "m" * 300, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    # two limits that disagree: max_tokens was read past in silence
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 9},
     "max_tokens"),
    # an empty effort was read as none
    ({"model": "x", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": ""}, "reasoning_effort"),
])
def test_wrong_shapes_are_a_400_naming_the_field(gw, upstream, body, param):
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"authorization": "Bearer gw-key"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert upstream.seen == []


@pytest.mark.property
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/messages"]),
       route=st.sampled_from(["openai", "anthropic"]))
def test_odd_bodies_through_both_families_get_a_2xx_or_a_4xx(gw, body, path, route):
    """Odd values (nulls, huge numbers, lone surrogates, empty lists, deep nesting...) read and
    translated for a real family, each way: an answer or a 4xx, never a crash."""
    if body.startswith(b'{"model": "m"'):
        body = body.replace(b'"m"', json.dumps(route).encode(), 1)
    answer = httpx.post(f"{gw.url}{path}", content=body, timeout=30,
                        headers={"authorization": "Bearer gw-key", "x-api-key": "gw-key"})
    assert answer.status_code < 300 or 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])


@pytest.mark.parametrize("path,headers,status", [
    ("/v1/messages", {}, 401),
    ("/v1/messages/nope", {"x-api-key": "gw-key"}, 404),
])
def test_every_anthropic_route_error_has_the_anthropic_shape(gw, path, headers, status):
    r = httpx.post(f"{gw.url}{path}", json={"model": "x", "max_tokens": 5, "messages": []}, headers=headers)
    assert r.status_code == status and r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}


@pytest.mark.parametrize("block,says", [
    ({"type": "tool_use", "id": "t1", "name": "f", "input": {}},
     "messages[1].content[0]: a system message holds no tool_use or tool_result blocks"),
    ({"type": "thinking", "thinking": "hmm", "signature": "sig"},
     "messages[1].content: thinking blocks belong to assistant messages"),
])
def test_a_system_message_inside_messages_holds_what_a_system_prompt_can(gw, upstream, block, says):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_call(gw, False, model="anthropic", messages=[
            {"role": "user", "content": "hi"}, {"role": "system", "content": [block]}])
    assert says in info.value.message and upstream.seen == []


CALL = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "done"}


@pytest.mark.parametrize("route", ["openai", "anthropic"])
@pytest.mark.parametrize("messages,says", [
    ([{"role": "user", "content": [{"type": "text", "text": "q"}, CALL]}],
     "messages[0].content[1]: a tool_use block belongs to an assistant message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text", "text": "a"}, RESULT]},
      {"role": "user", "content": "more"}],
     "messages[1].content[1]: a tool_result block belongs to a user message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [CALL]},
      {"role": "user", "content": [{**RESULT, "content": [{"type": "text", "text": "r"}, {**CALL, "id": "t2"}]}]}],
     "messages[2].content[0].content[1]: a tool result holds no tool_use or tool_result"),
], ids=["call-in-user", "result-in-assistant", "call-in-result"])
def test_a_tool_block_where_its_role_has_no_place_is_a_400_naming_it(gw, upstream, route, messages, says):
    # towards openai such a block was left out of the request without a word
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_call(gw, False, model=route, messages=messages)
    assert says in info.value.message and upstream.seen == []


def test_both_forms_of_the_output_format_are_a_400_naming_output_format(gw, upstream):
    # output_format was read past in silence when output_config.format was also sent
    schema = {"type": "json_schema", "schema": WEATHER}
    for route in ("anthropic", "openai"):
        with pytest.raises(anthropic.BadRequestError) as info:
            anthropic_call(gw, False, model=route, max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                           extra_body={"output_config": {"format": schema}, "output_format": schema})
        assert "output_format" in info.value.message
    assert upstream.seen == []
    anthropic_call(gw, False, model="openai", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                   extra_body={"output_config": {"format": schema}})
    assert upstream.seen[-1].body["response_format"]["json_schema"]["schema"] == WEATHER


def test_anthropic_body_errors_have_the_anthropic_shape(gw):
    r = httpx.post(f"{gw.url}/v1/messages", content=b"{nope", headers={"x-api-key": "gw-key"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(f"{gw.url}/v1/messages", headers={"x-api-key": "gw-key"},
                   json={"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
    assert r.status_code == 400 and "messages[0].content[0].source" in r.json()["error"]["message"]


@STREAM
def test_an_entry_that_cannot_honour_the_request_is_skipped_and_the_walk_goes_on(stream):
    with RecordingUpstream() as upstream:
        config = {"active": "anthropic.a", "providers": {
            "anthropic.a": {"family": "anthropic", "base_url": upstream.url, "api_key": "sk-wire-test-0003",
                            "model": "claude-a", "fallbacks": ["openai.b"]},
            "openai.b": {"family": "openai", "base_url": f"{upstream.url}/v1", "api_key": "sk-wire-test-0004",
                         "model": "gpt-b"}}}
        with BackgroundGateway(config) as gw:
            raw = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0).chat.completions.with_raw_response
            reply = raw.create(model="claude-a", messages=[{"role": "user", "content": "hi"}], seed=7, stream=stream)
            chunks = list(reply.parse()) if stream else [reply.parse()]
        assert [s.path for s in upstream.seen] == ["/v1/chat/completions"] and upstream.seen[0].body["seed"] == 7
    assert reply.headers["x-relayline-served"] == "openai.b/gpt-b"
    extra = next(c.model_extra["relayline"] for c in reversed(chunks) if "relayline" in c.model_extra)
    assert extra["skipped"] == ["anthropic.a/claude-a unsupported (seed)"]


@pytest.fixture(scope="module")
def dropping():
    """A gateway that drops what an entry cannot honour (`drop_unsupported_params`), before a
    recording upstream: routes `openai`, `anthropic`, `plain` (an openai profile without vision) and
    `anthropic-notools` (an anthropic profile without tools)."""
    with recording_gateway(
        {"openai.up": {"model": "gpt-up"}, "anthropic.up": {"model": "claude-up"},
         "openai.plain": {"model": "gpt-plain", "capabilities": {"vision": False}},
         "anthropic.notools": {"model": "claude-notools", "capabilities": {"tools": False}},
         "openai.notools": {"model": "gpt-notools", "capabilities": {"tools": False, "structured_outputs": False}}},
        {"openai": "openai.up", "anthropic": "anthropic.up", "plain": "openai.plain",
         "anthropic-notools": "anthropic.notools", "openai-notools": "openai.notools"},
        key="sk-drop", gateway={"drop_unsupported_params": True},
    ) as gateway:
        yield gateway


@pytest.fixture
def dropped_to(dropping):
    return fresh_upstream(dropping)


CACHED = {"type": "ephemeral"}


@STREAM
def test_a_drop_keeps_the_text_of_anthropic_blocks_that_carried_the_dropped_key(dropping, dropped_to, stream):
    # Claude Code's system prompt and turns, each block with a cache_control, to an openai route:
    # the key went and so did the whole block, and the provider was asked an empty conversation
    # (a caching hint is translated now, to nothing: the text block's citations are what is dropped)
    system = [{"type": "text", "text": "SYSTEM PROMPT", "cache_control": CACHED}]
    cited = {"type": "char_location", "cited_text": "x", "document_index": 0, "start_char_index": 0, "end_char_index": 1}
    messages = [{"role": "user", "content": [{"type": "text", "text": "USER TURN", "cache_control": CACHED}]},
                {"role": "assistant", "content": [{"type": "text", "text": "CITED ANSWER", "citations": [cited]}]},
                {"role": "user", "content": "thanks"}]
    raw = claude(dropping).messages.with_raw_response
    reply = raw.create(model="openai", system=system, messages=messages, max_tokens=64, stream=stream)
    if stream:
        list(reply.parse())
    sent = dropped_to.seen[-1].body
    assert sent["messages"] == [{"role": "system", "content": "SYSTEM PROMPT"}, {"role": "user", "content": "USER TURN"},
                                {"role": "assistant", "content": "CITED ANSWER"}, {"role": "user", "content": "thanks"}]
    assert reply.headers["x-relayline-dropped"] == "citations"


@STREAM
def test_a_drop_keeps_the_text_of_openai_parts_that_carried_the_dropped_key(dropping, dropped_to, stream):
    messages = [{"role": "system", "content": [{"type": "text", "text": "SYSTEM PROMPT", "cache_control": CACHED}]},
                {"role": "user", "content": [{"type": "text", "text": "USER TURN", "cache_control": CACHED},
                                             {"type": "image_url", "image_url": {"url": "https://x/c.png"},
                                              "cache_control": CACHED}]}]
    raw = oai(dropping).chat.completions.with_raw_response
    reply = raw.create(model="anthropic", messages=messages, stream=stream)
    if stream:
        list(reply.parse())
    sent = dropped_to.seen[-1].body
    # (the caching hints are translated now: each stays on its block)
    assert sent["system"] == [{"type": "text", "text": "SYSTEM PROMPT", "cache_control": CACHED}]
    assert sent["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "USER TURN", "cache_control": CACHED},
        {"type": "image", "source": {"type": "url", "url": "https://x/c.png"}, "cache_control": CACHED}]}]
    assert "x-relayline-dropped" not in reply.headers


@pytest.mark.parametrize("fields", [
    {"tools": [{"type": "custom", "custom": {"name": "g"}}]},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}}},
], ids=["custom-tool", "allowed-tools"])
def test_openai_tool_shapes_relayline_does_not_read_go_to_an_openai_entry_as_sent(gw, upstream, fields):
    # valid chat completions bodies: they were a 400 before anything was sent
    openai_call(gw, False, model="openai", **fields)
    assert {k: upstream.seen[-1].body[k] for k in fields} == fields


def test_an_openai_file_by_id_goes_to_an_openai_entry_as_sent(gw, upstream):
    # a valid chat completions part: it was a 400 (file.file_data expected a string)
    content = [{"type": "text", "text": "summarise"}, {"type": "file", "file": {"file_id": "file-abc123"}}]
    openai_call(gw, False, model="openai", messages=[{"role": "user", "content": content}])
    assert upstream.seen[-1].body["messages"] == [{"role": "user", "content": content}]


def test_a_drop_for_the_clients_own_family_keeps_what_relayline_does_not_read(dropping, dropped_to):
    # an entry of the client's own family that lacks tools got a body rendered anew from what
    # relayline reads: a server tool's blocks, a text's citations and metadata it does not know
    # were gone, and a text document went as a base64 source with no data
    search = [{"type": "server_tool_use", "id": "srv_1", "name": "web_search", "input": {"query": "x"}},
              {"type": "web_search_tool_result", "tool_use_id": "srv_1", "content": []},
              {"type": "text", "text": "found", "citations": [{"type": "web_search_result_location", "url": "https://x",
                                                             "title": "t", "encrypted_index": "e", "cited_text": "c"}]}]
    messages = [{"role": "user", "content": "look it up"}, {"role": "assistant", "content": search},
                {"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                             "data": "plain words"}},
                                             {"type": "text", "text": "and this?"}]}]
    tools = [{"name": "f", "input_schema": WEATHER, "input_examples": [{"city": "Paris"}]}]
    raw = claude(dropping).messages.with_raw_response
    reply = raw.create(model="anthropic-notools", messages=messages, tools=tools, max_tokens=64,
                       metadata={"user_id": "u1"}, extra_body={"metadata": {"user_id": "u1", "team": "red"}})
    sent = dropped_to.seen[-1].body
    assert reply.headers["x-relayline-dropped"] == "tools" and "tools" not in sent
    assert sent["messages"] == messages and sent["metadata"] == {"user_id": "u1", "team": "red"}


def test_server_tools_alone_are_tools_a_profile_without_them_cannot_take(dropping, dropped_to):
    # a request whose only tool is a server tool went to a profile that said it takes no tools
    raw = claude(dropping).messages.with_raw_response
    reply = raw.create(model="anthropic-notools", max_tokens=64, messages=[{"role": "user", "content": "news?"}],
                       tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert reply.headers["x-relayline-dropped"] == "tools" and "tools" not in dropped_to.seen[-1].body


def test_a_drop_for_the_clients_own_family_keeps_its_openai_fields(dropping, dropped_to):
    content = [{"type": "text", "text": "hear this"}, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
               {"type": "image_url", "image_url": {"url": "https://x/c.png", "detail": "low"}}]
    messages = [{"role": "user", "name": "bob", "content": content}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER, "strict": True}}]
    schema = {"type": "json_schema", "json_schema": {"name": "r", "schema": WEATHER}}
    raw = oai(dropping).chat.completions.with_raw_response
    reply = raw.create(model="openai-notools", messages=messages, tools=tools, tool_choice="auto", response_format=schema)
    sent = dropped_to.seen[-1].body
    assert reply.headers["x-relayline-dropped"] == "tools, tools.function.strict, response_format"
    assert sent["messages"] == messages and not {"tools", "tool_choice", "response_format"} & set(sent)


# content an entry cannot take is never dropped, whatever drop_unsupported_params says: the entry
# stays unfit for the request, and with no other entry the answer is a 400 naming it
CONTENT_UNSUPPORTED = [
    ("image-without-vision", "openai", "plain",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "https://x/c.png"}}]}]},
     "image"),
    ("prefill", "anthropic", "openai",
     {"messages": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]},
     "prefill"),
    ("tool-result-image", "anthropic", "openai",
     {"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                       {"type": "text", "text": "the chart:"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}]},
     "tool_result.content.image"),
    ("document-url", "anthropic", "openai",
     {"messages": [{"role": "user", "content": [
         {"type": "document", "source": {"type": "url", "url": "https://x/report.pdf"}},
         {"type": "text", "text": "summarise"}]}]},
     "document.source.url"),
    ("text-document", "anthropic", "openai",
     {"messages": [{"role": "user", "content": [
         {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain words"}}]}]},
     "document.source.text"),
    ("openai-file-id", "openai", "anthropic",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "summarise"},
                                                {"type": "file", "file": {"file_id": "file-abc123"}}]}]},
     "content.file.file_id"),
    ("cut-arguments", "openai", "anthropic",
     {"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"city": "Par'}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "cut"}]},
     "messages.tool_calls.function.arguments"),
]


@pytest.mark.parametrize("case,dialect,route,fields,named", CONTENT_UNSUPPORTED, ids=[c[0] for c in CONTENT_UNSUPPORTED])
def test_a_drop_never_deletes_content_the_entry_cannot_take(dropping, dropped_to, case, dialect, route, fields, named):
    if dialect == "openai":
        with pytest.raises(openai.BadRequestError) as info:
            openai_call(dropping, False, model=route, **fields)
        assert info.value.code == "unsupported_parameter"
    else:
        with pytest.raises(anthropic.BadRequestError) as info:
            anthropic_call(dropping, False, model=route, **fields)
    assert named in info.value.message and dropped_to.seen == []  # nothing was sent, nothing deleted


def _seed_to_claude_dropping(api_key: str, **create):
    """An OpenAI-dialect request with a `seed` (which the anthropic family cannot honour) to a
    gateway that drops what its entry cannot honour: the reply, and the body the upstream got."""
    with RecordingUpstream() as upstream:
        config = {"active": "anthropic.up", "gateway": {"drop_unsupported_params": True},
                  "providers": {"anthropic.up": {"family": "anthropic", "base_url": upstream.url, "api_key": api_key,
                                                 "model": "claude-up"}}}
        with BackgroundGateway(config) as gw:
            raw = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0).chat.completions.with_raw_response
            reply = raw.create(model="claude-up", messages=[{"role": "user", "content": "hi"}], seed=7, **create)
            if create.get("stream"):
                list(reply.parse())
    return reply, upstream.seen[-1].body


def test_drop_unsupported_params_drops_and_names_them():
    reply, sent = _seed_to_claude_dropping("sk-wire-test-0002", temperature=0.5)
    assert reply.headers["x-relayline-dropped"] == "seed"
    assert "seed" not in sent and sent["temperature"] == 0.5
    reply, sent = _seed_to_claude_dropping("sk-wire-test-0007", temperature=1.5)
    assert reply.headers["x-relayline-dropped"] == "seed, temperature"
    assert "seed" not in sent and "temperature" not in sent


@STREAM
def test_a_dropped_field_whose_name_is_no_plain_header_text_is_named_quoted_not_a_500(stream):
    # the names in x-relayline-dropped are the client's own JSON keys: one with a line feed, a
    # NUL, a comma or non-ASCII text was written into the head raw, which the server refused
    # (a 500 for a client's field, then a dropped connection)
    odd = {"x\ny": 1, "a\u0000": 2, "b, c": 3, "\u00e9t\u00e9": 4, "q\"": 5}
    reply, sent = _seed_to_claude_dropping("sk-wire-test-0006", stream=stream, extra_body=odd)
    assert reply.status_code == 200
    dropped = reply.headers["x-relayline-dropped"]
    assert dropped.isascii() and dropped.isprintable()
    assert json.loads(f"[{dropped.replace('seed', json.dumps('seed'))}]") == ["seed", *odd]
    assert not set(odd) & set(sent) and "seed" not in sent


def test_the_library_takes_and_returns_the_same_model():
    import trio

    from relayline.adapters import Relay

    async def main(url):
        toml = f"""
active = "anthropic.up"
[providers."anthropic.up"]
family = "anthropic"
base_url = "{url}"
api_key = "sk-wire-test-0001"
model = "claude-up"
"""
        async with Relay.from_toml(toml, env={}) as relay:
            reply = await relay.complete([{"role": "user", "content": "hi"}], temperature=0.2, max_tokens=33,
                                         stop=["X"], tools=[{"type": "function", "function": {"name": "get_weather",
                                                                                              "parameters": WEATHER}}])
            async with relay.stream([{"role": "user", "content": "hi"}], max_tokens=12) as turn:
                events = [e async for e in turn]
        return reply, events, turn

    with RecordingUpstream() as upstream:
        upstream.answer = Answer(text="", tool_calls=(TOOL,), usage={"input_tokens": 5, "output_tokens": 2,
                                                                    "cache_read_input_tokens": 7})
        reply, events, turn = trio.run(main, upstream.url)
        first, second = (s.body for s in upstream.seen)
    assert (first["temperature"], first["max_tokens"], first["stop_sequences"]) == (0.2, 33, ["X"])
    assert first["tools"][0]["input_schema"] == WEATHER and second["max_tokens"] == 12
    assert reply.finish_reason == "tool_calls" and reply.tool_call_ids == ("call_UP1",)
    assert json.loads(reply.tool_arguments[0]) == {"city": "Paris"}
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.cache_read_tokens) == (5, 2, 7)
    assert [e.ref for e in events if e.kind == "tool"] == ["call_UP1"] and turn.finish_reason == "tool_calls"
