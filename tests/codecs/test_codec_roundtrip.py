"""Round trips through the chat codecs (adapters/codecs/), with Hypothesis.

Per codec: for any canonical request, reply or stream the format can carry, reading what the
codec wrote gives back exactly what it was given. What a format cannot carry is mapped out of
the drawn value before the round trip, in one function per format (`openai_carries`,
`anthropic_carries`, ...), each loss named there with its reason; the round trip itself is an
exact equality. Across families: a request translated from one family's body to the other's
keeps every text, image, document, tool call and tool result.
"""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from wire_strategies import base64_text, canonical_requests, expressible, words

from relayline.adapters import jsoncodec
from relayline.adapters.codecs import (
    anthropic_messages,
    anthropic_messages_render,
    openai_chat,
    openai_chat_render,
)
from relayline.adapters.codecs.anthropic_messages_answers import AnthropicDialect, AnthropicStream
from relayline.adapters.codecs.anthropic_messages_replies import AnthropicStreamParser
from relayline.adapters.codecs.anthropic_messages_replies import parse_completion as anthropic_reply
from relayline.adapters.codecs.common import OPENAI_FINISH, TO_OPENAI
from relayline.adapters.codecs.openai_chat_answers import OpenAIDialect, OpenAIStream
from relayline.adapters.codecs.openai_chat_replies import OpenAIStreamParser
from relayline.adapters.codecs.openai_chat_replies import parse_completion as openai_reply
from relayline.adapters.sse import SSEDecoder
from relayline.machines import wire
from relayline.machines.ledger import Usage
from relayline.machines.stream import FINISH, REASONING, TEXT, TOOL_ARGS, TOOL_CALL, USAGE, Event
from relayline.machines.turn import Completion, TurnResult

HINT = {"type": "ephemeral"}
hints = st.none() | st.just(HINT)
counts = st.integers(0, 10**6)
efforts = st.sampled_from(["low", "medium", "high"])
schemas = st.dictionaries(words, st.sampled_from([{"type": "string"}, {"type": "integer"}]), max_size=2).map(
    lambda properties: {"type": "object", "properties": properties})
json_objects = st.dictionaries(words, words | st.integers(-100, 100) | st.booleans(), max_size=3)
tools = st.lists(st.builds(wire.Tool, words, words | st.just(""), schemas, st.booleans(), hints), max_size=2).map(tuple)
tool_choices = st.none() | st.builds(wire.ToolChoice, st.sampled_from(["auto", "none", "required"])) | st.builds(
    wire.ToolChoice, st.just("tool"), words)
unit = st.floats(0, 1, allow_nan=False)


def _hinted(draw, value):
    """`value` (a part, tool call or message) with a caching hint, sometimes."""
    return attrs.evolve(value, cache_control=draw(hints))


# -- requests: OpenAI chat completions ------------------------------------------------------------


@st.composite
def openai_requests(draw) -> wire.Request:
    """Any canonical request (tests/wire_strategies.py), with caching hints and every option a
    chat completions body has, written by an OpenAI client."""
    request = draw(canonical_requests())
    messages = tuple(attrs.evolve(
        _hinted(draw, m), content=tuple(_hinted(draw, p) for p in m.content),
        tool_calls=tuple(_hinted(draw, c) for c in m.tool_calls)) for m in map(expressible, request.messages,
                                                                                 ["openai"] * len(request.messages)))
    form = draw(st.none() | st.builds(wire.ResponseFormat, st.sampled_from(["text", "json_object"])) | st.builds(
        wire.ResponseFormat, st.just("json_schema"), st.fixed_dictionaries({"name": words, "schema": schemas})))
    return attrs.evolve(
        request, messages=messages, source="openai", tools=draw(tools), tool_choice=draw(tool_choices),
        response_format=form, parallel_tool_calls=draw(st.none() | st.booleans()),
        max_tokens=draw(st.none() | st.integers(1, 10**6)), temperature=draw(st.none() | st.floats(0, 2)),
        top_p=draw(st.none() | unit), stop=tuple(draw(st.lists(words, max_size=2))), user=draw(st.none() | words),
        reasoning=draw(st.none() | st.builds(wire.Reasoning, efforts) | st.builds(
            wire.Reasoning, budget_tokens=st.integers(1, 20000)) | st.just(wire.Reasoning(adaptive=True))),
        extra=draw(st.dictionaries(st.sampled_from(["seed", "service_tier", "logit_bias", "metadata.x"]),
                                   st.integers(1, 9) | words, max_size=2)),
    )


def _openai_content(message: wire.Message) -> tuple[wire.Part, ...]:
    content = tuple(attrs.evolve(p, extra=(), title=(p.title or "document.pdf") if p.type == wire.DOCUMENT else None)
                    for p in message.content)
    if all(p.type == wire.TEXT and p.cache_control is None for p in content):
        # a message of plain text parts is one string: its parts come back as one
        text = "".join(p.text for p in content)
        return (wire.Part(wire.TEXT, text),) if text else ()
    return content


def openai_carries(request: wire.Request, stream: bool) -> wire.Request:
    """What a chat completions body carries of `request`, written for model "m":
    - part `extra` names fields relayline does not translate (the client's body carries them to
      its own family as sent), so the translated body has none;
    - an untitled document is written as "document.pdf" (an OpenAI file part is named);
    - a tool result has no `is_error`, a body no `top_k`;
    - reasoning is an effort: a thinking budget stands as the effort it is worth, adaptive
      thinking as none; extra fields go as they are, those named with a dot (a nested field's
      name, without its value) cannot;
    - the model and `stream` are the entry's; a stream always asks for usage (the ledger's)."""
    effort = request.reasoning.as_effort() if request.reasoning is not None else None
    messages = tuple(attrs.evolve(m, content=_openai_content(m), is_error=False) for m in request.messages)
    return attrs.evolve(
        request, messages=messages, model="m", stream=stream, include_usage=stream, top_k=None,
        reasoning=wire.Reasoning(effort) if effort else None,
        extra={k: v for k, v in request.extra.items() if "." not in k}, passthrough=None)


@pytest.mark.property
@given(openai_requests(), st.booleans())
def test_an_openai_request_reads_back_as_written(request, stream):
    carried = openai_carries(request, stream)
    body = json.loads(jsoncodec.dumps(openai_chat_render.render_request(request, "m", stream)))
    assert openai_chat.parse_request(body, passthrough=False) == carried


# -- requests: Anthropic messages -----------------------------------------------------------------

_signed = st.builds(wire.Part, st.just(wire.THINKING), words | st.just(""), signature=words)
_redacted = st.builds(wire.Part, st.just(wire.REDACTED_THINKING), data=base64_text)
_text = st.builds(wire.Part, st.just(wire.TEXT), words, cache_control=hints)
_image = st.one_of(
    st.builds(wire.Part, st.just(wire.IMAGE), url=words.map("https://x/{}".format), cache_control=hints),
    st.builds(wire.Part, st.just(wire.IMAGE), data=base64_text, media_type=st.just("image/png"), cache_control=hints))
_document = st.builds(wire.Part, st.just(wire.DOCUMENT), data=base64_text, media_type=st.just("application/pdf"),
                      cache_control=hints, title=st.none() | words)
_document_by_url = st.builds(wire.Part, st.just(wire.DOCUMENT), url=words.map("https://x/{}.pdf".format),
                             cache_control=hints, title=st.none() | words)
_calls = st.lists(st.builds(wire.ToolCall, words, words, json_objects.map(json.dumps), hints), max_size=2).map(tuple)


@st.composite
def conversations(draw, *, by_url: bool = True, reasoning: bool = True) -> tuple[wire.Message, ...]:
    """A conversation as Anthropic takes one, turn for turn: a system prompt of one text first,
    then the user's turns (their words, or tool results and then perhaps words) and the
    assistant's (reasoning, words, tool calls), alternating; nothing empty."""
    user_parts = st.lists(st.one_of(_text, _text, _image, _document, *([_document_by_url] if by_url else [])),
                          min_size=1, max_size=3).map(tuple)
    assistant_parts = st.lists(st.one_of(_text, *([_signed, _redacted] if reasoning else [])), max_size=3).map(tuple)
    messages: list[wire.Message] = []
    if draw(st.booleans()):
        messages.append(wire.Message(wire.SYSTEM, (draw(_text),)))
    for turn in range(draw(st.integers(1, 5))):
        if turn % 2:
            content, calls = draw(assistant_parts), draw(_calls)
            if not content and not calls:
                content = (draw(_text),)
            messages.append(wire.Message(wire.ASSISTANT, content, calls))
            continue
        results = draw(st.lists(st.builds(wire.Message, st.just(wire.TOOL), user_parts | st.just(()),
                                          tool_call_id=words, is_error=st.booleans(), cache_control=hints),
                                max_size=2)) if turn else []
        messages.extend(results)
        if not results or draw(st.booleans()):
            messages.append(wire.Message(wire.USER, draw(user_parts)))
    return tuple(messages)


@st.composite
def anthropic_requests(draw) -> wire.Request:
    """A conversation Anthropic takes, with every option a messages body has, written by an
    Anthropic client."""
    limit = draw(st.integers(2, 10**6))
    choice = draw(tool_choices)
    return wire.Request(
        draw(conversations()), source="anthropic", max_tokens=limit, temperature=draw(st.none() | unit),
        top_p=draw(st.none() | unit), top_k=draw(st.none() | st.integers(1, 500)),
        stop=tuple(draw(st.lists(words, max_size=2))), tools=draw(tools), tool_choice=choice,
        # Anthropic's tool choice says only that parallel tool use is off
        parallel_tool_calls=draw(st.none() | st.just(False)) if choice is not None else None,
        response_format=draw(st.none() | schemas.map(lambda schema: wire.ResponseFormat(
            "json_schema", {"name": anthropic_messages.OUTPUT_FORMAT_NAME, "schema": schema, "strict": True}))),
        reasoning=draw(st.none() | st.builds(wire.Reasoning, st.none() | efforts, st.integers(1, limit - 1))
                       | st.builds(wire.Reasoning, st.none() | efforts, adaptive=st.just(True))
                       | st.builds(wire.Reasoning, efforts)),
        user=draw(st.none() | words),
        extra=draw(st.dictionaries(st.sampled_from(["service_tier", "container", "mcp_servers"]), words, max_size=2)),
    )


def anthropic_carries(request: wire.Request, stream: bool) -> wire.Request:
    """What a messages body carries of a conversation drawn by `anthropic_requests`, written for
    model "m": all of it (the strategy draws only what the format holds: a system prompt of one
    text, since several are joined into one; roles alternating, since consecutive messages of
    one role are one message; a caching hint on a block, since a whole message's goes on its
    last block; a limit always, since Anthropic requires one and a profile's default would stand
    in; a parallel tool use only switched off); the model and `stream` are the entry's, and an
    Anthropic stream always carries usage."""
    return attrs.evolve(request, model="m", stream=stream, include_usage=True, passthrough=None)


@pytest.mark.property
@given(anthropic_requests(), st.booleans())
def test_an_anthropic_request_reads_back_as_written(request, stream):
    body = json.loads(jsoncodec.dumps(anthropic_messages_render.render_request(request, "m", stream)))
    assert anthropic_messages.parse_request(body, passthrough=False) == anthropic_carries(request, stream)


# -- requests across families ---------------------------------------------------------------------


def _said(request: wire.Request) -> list:
    """What each message of a conversation says: its role, its words (a message's text parts
    joined: one string in a chat completions body), its images and documents, the tool calls it
    makes (arguments as the JSON object they are) and the call a tool result answers. Reasoning
    is not in it: a chat completions server is sent none back."""
    return [(m.role, "".join(p.text for p in m.content if p.type == wire.TEXT),
             [(p.type, p.url, p.data, p.media_type) for p in m.content if p.type in (wire.IMAGE, wire.DOCUMENT)],
             [(c.id, c.name, wire.json_object(c.arguments)) for c in m.tool_calls], m.tool_call_id)
            for m in request.messages]


@pytest.mark.property
@given(conversations(by_url=False), st.sampled_from(["openai", "anthropic"]))
def test_a_request_translated_across_families_keeps_what_each_message_says(messages, source):
    """A conversation both families carry (a document by URL has no place in a chat completions
    body), written by a client of one family, translated into the other family's body and read
    back: every text, image, document, tool call and tool result is there, in its place."""
    request = wire.Request(messages, source=source, max_tokens=64)
    render, parse = ((anthropic_messages_render.render_request, anthropic_messages.parse_request)
                     if source == "openai" else (openai_chat_render.render_request, openai_chat.parse_request))
    body = json.loads(jsoncodec.dumps(render(request, "m", False)))
    translated = parse(body, passthrough=False)
    assert _said(translated) == _said(request)


@pytest.mark.property
@given(canonical_requests())
def test_any_request_translated_to_anthropic_keeps_its_tool_calls_and_results(request):
    """Any canonical request (roles in any order, several system messages, empty messages):
    Anthropic joins consecutive messages of one role and the system prompt, yet every tool call
    and every tool result reaches the messages body and reads back, in order. (A request of
    system messages alone has no place there: a messages body holds at least one message.)"""
    assume(any(m.role != wire.SYSTEM for m in request.messages))
    request = attrs.evolve(request, source="openai",
                           messages=tuple(expressible(m, "anthropic") for m in request.messages))
    body = json.loads(jsoncodec.dumps(anthropic_messages_render.render_request(request, "m", False)))
    translated = anthropic_messages.parse_request(body, passthrough=False)

    def tool_work(r: wire.Request) -> tuple[list, list]:
        return ([(c.id, c.name, wire.json_object(c.arguments)) for m in r.messages for c in m.tool_calls],
                [m.tool_call_id for m in r.messages if m.role == wire.TOOL])

    assert tool_work(translated) == tool_work(request)


# -- replies, whole ----------------------------------------------------------------------------------

SERVED = attrs.make_class("Served", {"model": attrs.field(), "label": attrs.field()})("m", "p/m")
finishes = st.none() | st.sampled_from(wire.FINISH_REASONS)
usages = st.builds(Usage, counts, counts, counts, counts, counts)


@st.composite
def replies(draw, arguments) -> Completion:
    """A canonical reply: words, reasoning, tool calls (each with the id its provider gave), a
    finish reason, usage."""
    calls = draw(st.lists(st.tuples(words, words, arguments), max_size=3))
    return Completion(draw(st.just("") | words), draw(st.just("") | words), tuple(c[0] for c in calls),
                      draw(usages), tuple(c[2] for c in calls), tuple(c[1] for c in calls), draw(finishes),
                      draw(st.none() | words))


def _result(reply: Completion) -> TurnResult:
    return TurnResult("ok", None, None, "p/m", SERVED, reply.text, reply.reasoning, reply.tool_calls, None, None,
                      False, (), (), (), reply.tool_arguments, reply.tool_ids, reply.finish_reason,
                      reply.stop_sequence, reply.usage)


def openai_reply_carries(reply: Completion) -> Completion:
    """What a chat completion carries of a reply: the finish reason in OpenAI's words (a stop
    sequence and a paused turn are `stop`; none is what the answer shows), no stop sequence,
    and usage whose cache writes count as input (chat completions reports none apart)."""
    usage = reply.usage or Usage()
    return attrs.evolve(
        reply, finish_reason=OPENAI_FINISH[TO_OPENAI[wire.finish_reason(reply.finish_reason,
                                                                                  len(reply.tool_calls))]],
        stop_sequence=None, usage=Usage(usage.input_tokens + usage.cache_write_tokens, usage.output_tokens,
                                        usage.cache_read_tokens, 0, usage.reasoning_tokens))


def anthropic_reply_carries(reply: Completion) -> Completion:
    """What a message carries of a reply: all but the reasoning tokens (Anthropic counts them in
    the output, reported not apart); no finish reason is what the answer shows."""
    usage = reply.usage or Usage()
    return attrs.evolve(reply, finish_reason=wire.finish_reason(reply.finish_reason, len(reply.tool_calls)),
                        usage=attrs.evolve(usage, reasoning_tokens=0))


@pytest.mark.property
@given(replies(words))
def test_an_openai_answer_reads_back_as_the_reply_it_was(reply):
    """What relayline answers an OpenAI client is what an OpenAI provider answers: read by the
    family's reply codec, it gives back the reply."""
    answer = json.loads(jsoncodec.dumps(OpenAIDialect().completion("chatcmpl-1", _result(reply), {})))
    assert openai_reply(answer) == openai_reply_carries(reply)


@pytest.mark.property
@given(replies(json_objects.map(json.dumps)))
def test_an_anthropic_answer_reads_back_as_the_reply_it_was(reply):
    answer = json.loads(jsoncodec.dumps(AnthropicDialect().completion("msg_1", _result(reply), {})))
    assert anthropic_reply(answer) == anthropic_reply_carries(reply)


# -- replies, streamed ----------------------------------------------------------------------------


@st.composite
def streamed(draw) -> tuple[list[Event], Completion]:
    """A stream's events (words, reasoning, tool calls and their arguments in pieces) and the
    reply they end with."""
    events: list[Event] = []
    for kind in draw(st.lists(st.sampled_from(["text", "reasoning", "tool"]), max_size=6)):
        if kind != "tool":
            events.append(Event(kind, draw(words)))
            continue
        events.append(Event("tool", draw(words), draw(words)))
        events.extend(Event("tool_args", piece) for piece in draw(st.lists(words, max_size=2)))
    calls = [e for e in events if e.kind == "tool"]
    reply = Completion("".join(e.value for e in events if e.kind == "text"),
                       "".join(e.value for e in events if e.kind == "reasoning"), tuple(e.value for e in calls),
                       draw(usages), (), tuple(e.ref for e in calls), draw(finishes), draw(st.none() | words))
    return events, reply


def _gathered(frames, finish_ref: bool) -> Completion:
    """The reply a stream's frames make, gathered as the driver does (arguments to the call
    opened last, or to the earlier one a piece names)."""
    text, reasoning, names, ids, arguments = [], [], [], [], []
    finish, stop, usage = None, None, None
    for frame in frames:
        if frame.kind == TEXT:
            text.append(frame.value)
        elif frame.kind == REASONING:
            reasoning.append(frame.value)
        elif frame.kind == TOOL_CALL:
            names.append(frame.value)
            ids.append(frame.ref)
            arguments.append("")
        elif frame.kind == TOOL_ARGS:
            place = int(frame.ref) if frame.ref else len(arguments) - 1
            arguments[place] += frame.value
        elif frame.kind == FINISH:
            finish, stop = frame.value, (frame.ref or None) if finish_ref else None
        elif frame.kind == USAGE:
            usage = frame.usage
    return Completion("".join(text), "".join(reasoning), tuple(names), usage, tuple(arguments), tuple(ids), finish,
                      stop)


def _read(stream: bytes, parser) -> list:
    frames = []
    for event in SSEDecoder().feed(stream):
        frames.extend(parser.feed(event))
    assert parser.done
    return frames


def _arguments(events: list[Event]) -> tuple[str, ...]:
    arguments: list[str] = []
    for event in events:
        if event.kind == "tool":
            arguments.append("")
        elif event.kind == "tool_args":
            arguments[-1] += event.value
    return tuple(arguments)


@pytest.mark.property
@given(streamed())
def test_an_openai_stream_reads_back_as_the_events_it_was(drawn):
    """What relayline streams to an OpenAI client is what an OpenAI provider streams: read by
    the family's stream codec, its frames make the same reply."""
    events, reply = drawn
    renderer = OpenAIStream("chatcmpl-1", True)
    result = attrs.evolve(_result(reply), tool_arguments=_arguments(events))
    stream = renderer.opening("m") + b"".join(renderer.event(e) for e in events) + renderer.ok(result, {})
    expected = openai_reply_carries(attrs.evolve(reply, tool_arguments=_arguments(events)))
    assert _gathered(_read(stream, OpenAIStreamParser()), finish_ref=False) == expected


@pytest.mark.property
@given(streamed())
def test_an_anthropic_stream_reads_back_as_the_events_it_was(drawn):
    events, reply = drawn
    renderer = AnthropicStream("msg_1")
    result = attrs.evolve(_result(reply), tool_arguments=_arguments(events))
    stream = renderer.opening("m") + b"".join(renderer.event(e) for e in events) + renderer.ok(result, {})
    expected = anthropic_reply_carries(attrs.evolve(reply, tool_arguments=_arguments(events)))
    assert _gathered(_read(stream, AnthropicStreamParser()), finish_ref=True) == expected
