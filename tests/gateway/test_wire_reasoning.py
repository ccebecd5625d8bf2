"""Reasoning round trips and structured outputs across families: the official SDKs in front of
the gateway, a loopback upstream that records what it got. Turn 1 answers with reasoning; turn 2
sends that answer back as the SDK gave it, and the upstream must get the history its family
takes (signed thinking as it was; reasoning no signature covers left out). Then strict tools
and JSON schema answers, both ways."""

from __future__ import annotations

import anthropic
import openai
import pytest

from helpers import recording_gateway
from relayline.adapters.sim.recorder import Answer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOL = ("toolu_UP1", "get_weather", '{"city": "Paris"}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])


@pytest.fixture(scope="module")
def gw():
    with recording_gateway(
        {"openai.up": {"model": "gpt-up"}, "anthropic.up": {"model": "claude-up"},
         "anthropic.plain": {"model": "claude-plain", "capabilities": {"structured_outputs": False}},
         "openai.plain": {"model": "gpt-plain", "capabilities": {"structured_outputs": False}},
         "anthropic.whole": {"model": "claude-whole", "capabilities": {"streaming": False}}},
        {"openai": "openai.up", "anthropic": "anthropic.up", "anthropic-plain": "anthropic.plain",
         "openai-plain": "openai.plain", "anthropic-whole": "anthropic.whole"},
    ) as gateway:
        yield gateway


def openai_message(gw, stream: bool, **kwargs) -> dict:
    """The assistant message an OpenAI client keeps for its history, from a whole answer (as
    the SDK's model_dump gives it) or from the deltas of a stream (each field joined)."""
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="gw-key", max_retries=0, timeout=20)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.model_dump(exclude_none=True)
    message: dict = {"role": "assistant"}
    calls: dict[int, dict] = {}
    with client.chat.completions.create(stream=True, **kwargs) as chunks:
        for chunk in chunks:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            fields = {"content": delta.content, **(delta.model_extra or {})}
            for name, value in fields.items():
                if value:  # (a list field's items are appended, a string's pieces joined)
                    message[name] = message.get(name, [] if isinstance(value, list) else "") + value
            for call in delta.tool_calls or ():
                whole = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                      "function": {"name": call.function.name, "arguments": ""}})
                whole["function"]["arguments"] += call.function.arguments or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def claude(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="gw-key", max_retries=0, timeout=20)


def anthropic_blocks(gw, stream: bool, **kwargs) -> list[dict]:
    kwargs.setdefault("max_tokens", 2048)
    if stream:
        with claude(gw).messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = claude(gw).messages.create(**kwargs)
    return [b.model_dump(exclude_none=True) for b in message.content]


# -- reasoning relayline returned, sent back ---------------------------------------------------------


@STREAM
def test_an_answer_with_several_thinking_blocks_goes_back_without_a_signature(gw, upstream, stream):
    """No one signature covers several thinking blocks' words joined. A stream carried each
    block's signature as a delta, which a client joins like every string delta: the next turn
    sent Anthropic a thinking block under the signatures run together, which it refuses. A
    stream now says what a whole answer says: no signature."""
    upstream.answer = Answer(text="Paris.", reasoning="First, ", more_thinking=(("then this.", "sig2"),))
    first = [{"role": "user", "content": "capital of France?"}]
    message = openai_message(gw, stream, model="anthropic", messages=first, reasoning_effort="low")
    assert message["reasoning_content"] == "First, then this." and "reasoning_signature" not in message
    upstream.answer = Answer(text="Berlin.")
    history = [*first, message, {"role": "user", "content": "and Germany?"}]
    openai_message(gw, False, model="anthropic", messages=history, reasoning_effort="low")
    assert upstream.seen[-1].body["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]}


@pytest.mark.parametrize("content", ["", None])
def test_an_assistant_turn_of_unsigned_reasoning_alone_is_left_out_towards_anthropic(gw, upstream, content):
    """An answer cut short while reasoning (content empty) sent back without a signature: the
    turn went as an empty text block, which Anthropic refuses; the same-family path leaves such
    a turn out, and so does a translated request now."""
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "reasoning_content": "Hmm"},
               {"role": "user", "content": "go on"}]
    openai_message(gw, False, model="anthropic", messages=history)
    assert upstream.seen[-1].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "go on"}]}]


@STREAM
def test_an_openai_client_sends_back_reasoning_from_an_anthropic_route(gw, upstream, stream):
    """opencode sends the reasoning_content it got back on the next turn, without the signature
    (it does not know relayline's field): it was a 400 (messages.reasoning_content). Anthropic
    cannot verify words with no signature: they are left out of the history it gets."""
    upstream.answer = Answer(text="Paris.", reasoning="The capital of France.")
    first = [{"role": "user", "content": "capital of France?"}]
    message = openai_message(gw, stream, model="anthropic", messages=first, reasoning_effort="low")
    assert message["reasoning_content"] == "The capital of France." and message["reasoning_signature"] == "sig"
    del message["reasoning_signature"]
    upstream.answer = Answer(text="Berlin.")
    history = [*first, message, {"role": "user", "content": "and Germany?"}]
    reply = openai_message(gw, False, model="anthropic", messages=history, reasoning_effort="low")
    assert reply["content"] == "Berlin."
    assert upstream.seen[-1].body["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]}
    # towards openai, earlier turns' reasoning is the client's own body, as sent (same family)
    openai_message(gw, False, model="openai", messages=history)
    assert upstream.seen[-1].body["messages"][1]["reasoning_content"] == "The capital of France."


@STREAM
def test_an_anthropic_client_sends_back_thinking_relayline_made(gw, upstream, stream):
    """LangChain's ChatAnthropic with thinking, turn 2 on an OpenAI route: the thinking block
    relayline made (signature "") came back and was a 400 (content.thinking). Towards openai the
    history's reasoning is left out; towards anthropic thinking no provider signed is left out."""
    upstream.answer = Answer(text="Paris.", reasoning="The capital of France.")
    first = [{"role": "user", "content": "capital of France?"}]
    blocks = anthropic_blocks(gw, stream, model="openai", messages=first,
                              thinking={"type": "enabled", "budget_tokens": 1024})
    assert blocks == [{"type": "thinking", "thinking": "The capital of France.", "signature": ""},
                      {"type": "text", "text": "Paris."}]
    history = [*first, {"role": "assistant", "content": blocks}, {"role": "user", "content": "and Germany?"}]
    upstream.answer = Answer(text="Berlin.")
    assert anthropic_blocks(gw, False, model="openai", messages=history) == [{"type": "text", "text": "Berlin."}]
    assert upstream.seen[-1].body["messages"][1] == {"role": "assistant", "content": "Paris."}
    # the same history to an anthropic route (a fallback answered turn 1): as sent, less that block
    anthropic_blocks(gw, False, model="anthropic", messages=history)
    assert upstream.seen[-1].body["messages"] == [*first, {"role": "assistant", "content": [blocks[1]]}, history[2]]


def test_a_signed_thinking_block_is_left_out_towards_openai(gw, upstream):
    signed = [{"role": "user", "content": "q"},
              {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                                {"type": "redacted_thinking", "data": "EmwKAhgBEgy"},
                                                {"type": "text", "text": "a"}]},
              {"role": "user", "content": "more"}]
    anthropic_blocks(gw, False, model="openai", messages=signed)
    assert upstream.seen[-1].body["messages"][1] == {"role": "assistant", "content": "a"}
    with pytest.raises(anthropic.BadRequestError) as info:  # reasoning is an assistant's
        anthropic_blocks(gw, False, model="openai", messages=[{"role": "user", "content": [signed[1]["content"][0]]}])
    assert "messages[0].content" in info.value.message and upstream.seen[-1].body["messages"][1]["content"] == "a"


@STREAM
def test_an_anthropic_tool_loop_with_thinking_works_through_an_openai_client(gw, upstream, stream):
    """With thinking and tools Anthropic wants the tool turn's thinking back with its signature,
    before the tool_use: an OpenAI client gets the signature (reasoning_signature) and the
    redacted thinking (reasoning_redacted) beside reasoning_content and sends them back."""
    upstream.answer = Answer(text="Let me check.", reasoning="I should look it up.", tool_calls=(TOOL,),
                             redacted="EmwKAhgBEgy")
    first = [{"role": "user", "content": "weather in Paris?"}]
    message = openai_message(gw, stream, model="anthropic", messages=first, tools=TOOLS, reasoning_effort="low")
    assert message["reasoning_signature"] == "sig" and message["tool_calls"][0]["id"] == "toolu_UP1"
    assert message["reasoning_redacted"] == ["EmwKAhgBEgy"]
    upstream.answer = Answer(text="Sunny.")
    history = [*first, message, {"role": "tool", "tool_call_id": "toolu_UP1", "content": "sunny"}]
    assert openai_message(gw, stream, model="anthropic", messages=history, tools=TOOLS,
                          reasoning_effort="low")["content"] == "Sunny."
    thinking = [{"type": "thinking", "thinking": "I should look it up.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "EmwKAhgBEgy"}]
    assert upstream.seen[-1].body["messages"][1] == {"role": "assistant", "content": [
        *thinking, {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_UP1", "name": "get_weather", "input": {"city": "Paris"}}]}
    # an openai entry never gets relayline's own fields (reasoning_content goes as sent)
    openai_message(gw, False, model="openai", messages=history, tools=TOOLS)
    sent = upstream.seen[-1].body["messages"][1]
    assert sent["reasoning_content"] == "I should look it up."
    assert "reasoning_signature" not in sent and "reasoning_redacted" not in sent


@pytest.mark.parametrize("served", ["stream", "whole"])
def test_redacted_thinking_reaches_a_streaming_anthropic_client(gw, upstream, served):
    """A stream carried a redacted_thinking block to neither dialect (it was a held preamble
    frame): an Anthropic client streaming with thinking and tools could not send it back. Also
    when the stream is served from a whole answer (a profile that does not stream)."""
    upstream.answer = Answer(text="Checking.", reasoning="hm", redacted="EmwKAhgBEgy", tool_calls=(TOOL,))
    blocks = anthropic_blocks(gw, True, model="anthropic" if served == "stream" else "anthropic-whole",
                              messages=[{"role": "user", "content": "weather?"}],
                              thinking={"type": "enabled", "budget_tokens": 1024})
    assert upstream.seen[-1].body["stream"] is (served == "stream")
    assert blocks[:2] == [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                          {"type": "redacted_thinking", "data": "EmwKAhgBEgy"}]
    assert [b["type"] for b in blocks[2:]] == ["text", "tool_use"]


# -- structured outputs --------------------------------------------------------------------------------

STRICT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}


@STREAM
def test_strict_tools_and_a_json_schema_reach_anthropic_structured_outputs(gw, upstream, stream):
    """The OpenAI Agents SDK's function tools are strict by default, `llm --schema` asks for a
    json_schema: both were refused towards anthropic."""
    upstream.answer = Answer(text='{"city": "Paris"}')
    message = openai_message(gw, stream, model="anthropic", messages=[{"role": "user", "content": "q"}],
                             tools=STRICT_TOOLS, response_format=SCHEMA_FORMAT)
    assert message["content"] == '{"city": "Paris"}'
    sent = upstream.seen[-1].body
    assert sent["tools"] == [{"name": "get_weather", "description": "", "input_schema": WEATHER, "strict": True}]
    assert sent["output_config"] == {"format": {"type": "json_schema", "schema": WEATHER}}


@pytest.mark.parametrize("fields,named", [
    ({"tools": STRICT_TOOLS}, "tools.function.strict"),
    ({"response_format": SCHEMA_FORMAT}, "response_format"),
])
@pytest.mark.parametrize("route", ["anthropic-plain", "openai-plain"])
def test_structured_outputs_skip_a_profile_without_the_capability(gw, upstream, fields, named, route):
    with pytest.raises(openai.BadRequestError) as info:
        openai_message(gw, False, model=route, messages=[{"role": "user", "content": "q"}], **fields)
    assert named in info.value.message and info.value.code == "unsupported_parameter" and upstream.seen == []


def test_a_json_schema_description_has_no_anthropic_place(gw, upstream):
    described = {"type": "json_schema", "json_schema": {"name": "w", "description": "the weather", "schema": WEATHER}}
    with pytest.raises(openai.BadRequestError) as info:
        openai_message(gw, False, model="anthropic", messages=[{"role": "user", "content": "q"}],
                       response_format=described)
    assert "response_format.json_schema.description" in info.value.message and upstream.seen == []


ANTHROPIC_STRICT = [{"name": "get_weather", "input_schema": WEATHER, "strict": True}]
OPENAI_SCHEMA = {"type": "json_schema", "json_schema": {"name": "response", "schema": WEATHER, "strict": True}}


@STREAM
@pytest.mark.parametrize("form", ["output_config", "output_format"])
def test_anthropic_structured_outputs_reach_openai_as_json_schema_and_strict(gw, upstream, stream, form):
    fields = ({"output_config": {"format": {"type": "json_schema", "schema": WEATHER}}} if form == "output_config"
              else {"output_format": {"type": "json_schema", "schema": WEATHER}})
    upstream.answer = Answer(text='{"city": "Paris"}')
    blocks = anthropic_blocks(gw, stream, model="openai", messages=[{"role": "user", "content": "q"}],
                              tools=ANTHROPIC_STRICT, extra_body=fields)
    assert blocks == [{"type": "text", "text": '{"city": "Paris"}'}]
    sent = upstream.seen[-1].body
    assert sent["response_format"] == OPENAI_SCHEMA
    assert sent["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "",
                                                               "parameters": WEATHER, "strict": True}}]
    # the same family gets them as sent
    anthropic_blocks(gw, stream, model="anthropic", messages=[{"role": "user", "content": "q"}],
                     tools=ANTHROPIC_STRICT, extra_body=fields)
    sent = upstream.seen[-1].body
    assert sent["tools"] == ANTHROPIC_STRICT and {k: sent[k] for k in fields} == fields
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_blocks(gw, False, model="openai-plain", messages=[{"role": "user", "content": "q"}], extra_body=fields)
    assert "output_config.format" in info.value.message


def test_an_output_config_keeps_its_other_fields_beside_the_format():
    """output_config holds more than the format (effort, and fields relayline does not read): a
    body rendered from the canonical request (a field dropped for the entry) keeps them beside it;
    towards openai the effort is `reasoning_effort` and the rest is named."""
    from relayline.adapters.codecs import (
        anthropic_messages,
        anthropic_messages_render,
        openai_chat_render,
    )
    from relayline.machines import wire

    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "q"}],
            "output_config": {"effort": "high", "format": {"type": "json_schema", "schema": WEATHER},
                              "a_later_field": 1}}
    request = anthropic_messages.parse_request(body, passthrough=False)
    assert anthropic_messages_render.render_request(request, "claude-up", False)["output_config"] == body["output_config"]
    assert openai_chat_render.render_request(request, "gpt-up", False)["reasoning_effort"] == "high"
    assert wire.unsupported(request, "openai", wire.Capabilities()) == ("output_config",)
    assert wire.unsupported(request, "openai", wire.Capabilities(structured_outputs=False)) == (
        "output_config.format", "output_config")


def test_dropping_structured_outputs_removes_exactly_the_named_field():
    """drop_unsupported_params: a tool's strictness or a format's description goes, never the
    tool or the schema."""
    from relayline.adapters.codecs import anthropic_messages_render, openai_chat
    from relayline.machines import dropping, wire

    described = {"type": "json_schema", "json_schema": {"name": "w", "description": "d", "schema": WEATHER}}
    request = openai_chat.parse_request({"messages": [{"role": "user", "content": "q"}], "tools": STRICT_TOOLS,
                                           "response_format": described})
    names = wire.unsupported(request, "anthropic", wire.Capabilities(structured_outputs=False))
    assert names == ("tools.function.strict", "response_format", "response_format.json_schema.description")
    body = anthropic_messages_render.render_request(dropping.without(request, ("tools.function.strict",)), "m", False)
    assert body["tools"] == [{"name": "get_weather", "description": "", "input_schema": WEATHER}]
    kept = dropping.without(request, ("response_format.json_schema.description",))
    assert kept.response_format.json_schema == {"name": "w", "schema": WEATHER} and kept.tools[0].strict
    body = anthropic_messages_render.render_request(kept, "m", False)
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": WEATHER}}
