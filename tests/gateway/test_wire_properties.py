"""Hypothesis over malformed request bodies against the gateway app (in process, over ASGI):
wrong types, nesting, sizes and encodings, on both routes, streamed and not. Every answer is a
2xx, or a 4xx with a JSON error in the route's own dialect; never a 5xx, never a crash."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from wire_strategies import canonical_requests

from helpers import asgi_post, sim_config
from relayline.adapters import Relay
from relayline.adapters.codecs.common import client_headers
from relayline.adapters.gateway import Gateway
from relayline.machines import dropping, wire
from relayline.machines.config import structure_config

CONFIG = sim_config("m")

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# fields both dialects know, and the places inside a message where shapes go wrong
TOP = ["model", "messages", "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "temperature",
       "top_p", "top_k", "stop", "stop_sequences", "tools", "tool_choice", "parallel_tool_calls", "response_format",
       "reasoning_effort", "user", "system", "metadata", "thinking", "seed"]
MESSAGE = ["role", "content", "tool_calls", "tool_call_id", "name"]
PART = ["type", "text", "image_url", "source", "file", "id", "name", "input", "tool_use_id", "content", "is_error"]
PART_TYPES = ["text", "image_url", "file", "image", "document", "tool_use", "tool_result", "thinking", "x"]


@st.composite
def bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "any_json", "bytes", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "any_json":
        return json.dumps(draw(json_value)).encode()
    if kind == "deep":
        depth = draw(st.integers(10, 5000))
        return b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
    part = {"type": draw(st.sampled_from(PART_TYPES))} | draw(st.dictionaries(st.sampled_from(PART), json_value, max_size=3))
    message = {"role": draw(st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"])),
               "content": draw(st.one_of(st.text(max_size=4000), st.just([part]), json_value))}
    message |= draw(st.dictionaries(st.sampled_from(MESSAGE), json_value, max_size=2))
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}, message]}
    body |= draw(st.dictionaries(st.sampled_from(TOP), json_value, max_size=3))
    if draw(st.booleans()):
        body["stream"] = True
    return json.dumps(body).encode()


async def call(gateway: Gateway, path: str, body: bytes) -> tuple[int, dict, bytes]:
    status, headers, payload = await asgi_post(gateway, path, body, [(b"content-type", b"application/json")])
    return status, dict(headers), payload


@pytest.mark.property
@given(body=bodies(), path=st.sampled_from(["/v1/chat/completions", "/v1/messages"]))
def test_malformed_bodies_get_a_2xx_or_a_4xx_in_the_dialects_shape(body, path):
    async def main():
        async with Relay(structure_config(CONFIG), env={}) as relay:
            return await call(Gateway(relay), path, body)

    status, headers, content = trio.run(main)
    assert 200 <= status < 300 or 400 <= status < 500, (status, content[:300])
    if status >= 400:
        error = json.loads(content)
        if path == "/v1/messages":
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}
    elif headers[b"content-type"] == b"application/json":
        assert json.loads(content)["model"] == "m"
    else:
        assert content.rstrip().endswith(b"[DONE]") or b"message_stop" in content


@given(st.dictionaries(st.sampled_from(["messages", "model", "temperature", "stop", "max_tokens"]), json_value))
def test_the_canonical_request_structures_strictly(data):
    """Embedders may build the canonical request from plain data: cattrs structures it with the
    config's strictness (a string is not a number), or raises; it never half-builds one."""
    try:
        request = wire.converter.structure(data, wire.Request)
    except Exception as exc:  # cattrs reports every problem as one exception group
        assert isinstance(exc, ValueError | TypeError | KeyError | ExceptionGroup)
        return
    assert isinstance(request.messages, tuple) and all(isinstance(m, wire.Message) for m in request.messages)
    assert request.temperature is None or isinstance(request.temperature, float)


def test_a_structured_request_runs_through_the_library():
    data = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "temperature": 0.5,
            "stop": ["END"]}
    request = wire.converter.structure(data, wire.Request)
    assert request.messages[0].text == "hi" and request.stop == ("END",)

    async def main():
        async with Relay(structure_config(CONFIG), env={}) as relay:
            return await relay.complete(request)

    assert trio.run(main).text == "ok"


class _Mapping(dict):
    """A message object that is not exactly a dict: the general path reads it, field by field."""


@given(st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "critic", 3]),
     "content": st.one_of(st.text(max_size=8), st.none(), st.just([{"type": "text", "text": "a"}]))},
    optional={"name": st.text(max_size=3), "tool_call_id": st.text(max_size=3)}), min_size=1, max_size=4))
def test_a_plain_message_read_at_once_is_what_the_general_path_reads(messages):
    """codecs/openai_chat.py reads a message of a role and a string at once; whatever the message,
    the request (or the refusal, by field and message) is the one the field-by-field path makes."""
    from relayline.adapters.codecs.openai_chat import parse_request

    def read(body):
        try:
            return parse_request(body, passthrough=False)
        except wire.WireError as error:
            return ("refused", error.param, str(error))

    fast = read({"model": "m", "messages": messages})
    general = read({"model": "m", "messages": [_Mapping(m) for m in messages]})
    assert fast == general


_option = st.sampled_from([("stream", True), ("stream", "yes"), ("temperature", 0.5), ("temperature", 7),
                           ("stop", "END"), ("n", 2), ("seed", 3), ("max_tokens", 0), ("user", "u"),
                           ("stream_options", {"include_usage": True}), ("reasoning_effort", "low")])


@given(model=st.one_of(st.none(), st.just("m"), st.just(""), st.just(3), st.just("x" * 300)),
       messages=st.one_of(st.just([]), st.just("hi"), st.lists(st.fixed_dictionaries(
           {"role": st.sampled_from(["user", "assistant", "critic"]), "content": st.one_of(st.text(max_size=4), st.none())},
           optional={"name": st.just("n")}), min_size=1, max_size=3)),
       options=st.lists(_option, max_size=2), has_model=st.booleans(),
       headers=st.lists(st.sampled_from([("OpenAI-Beta", "b"), ("openai-organization", "o"), ("Authorization", "k")]),
                        max_size=2))
def test_a_bare_body_read_at_once_is_what_the_options_path_reads(model, messages, options, has_model, headers):
    """codecs/openai_chat.py reads a body of messages and a model at once; whatever the body, the
    request (or the refusal) is the one the path that reads every option makes."""
    from relayline.adapters.codecs.openai_chat import _messages, _with_options, parse_request

    body = {"messages": messages, **dict(options)}
    if has_model:
        body["model"] = model

    def read(how):
        try:
            return how()
        except wire.WireError as error:
            return ("refused", error.param, str(error))

    def general():
        parsed, names = _messages(body, lazy=False)
        return _with_options(body, parsed, names, wire.Passthrough(body, client_headers(headers)))

    assert read(lambda: parse_request(body, headers)) == read(general)


_count = st.one_of(st.integers(0, 10**9), st.integers(-3, 10**9 + 3), st.sampled_from([True, None, 2.0, "3", 10**12]))
_plain_body = st.fixed_dictionaries(
    {"choices": st.lists(st.fixed_dictionaries(
        {"message": st.fixed_dictionaries({"role": st.just("assistant"), "content": st.text(max_size=6)})},
        optional={"finish_reason": st.one_of(st.none(), st.sampled_from(["stop", "length", "tool_calls", "x"]))}),
        min_size=1, max_size=2)},
    optional={"usage": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        "prompt_tokens": _count, "completion_tokens": _count, "total_tokens": _count}))})
_any_body = st.fixed_dictionaries(
    {"choices": st.one_of(st.just([]), st.lists(st.fixed_dictionaries(
        {"message": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
            "role": st.just("assistant"),
            "content": st.one_of(st.text(max_size=6), st.none(), st.just([{"type": "text", "text": "a"}]), st.just(3)),
            "tool_calls": st.one_of(st.none(), st.just([]), st.just([{"function": {"name": "f", "arguments": "{}"}}])),
            "reasoning_content": st.one_of(st.none(), st.text(max_size=3)),
            "reasoning": st.one_of(st.none(), st.text(max_size=3))}))},
        optional={"finish_reason": st.one_of(st.none(), st.sampled_from(["stop", "length", "tool_calls", "x"]),
                                             st.just(3))}), min_size=1, max_size=2))},
    optional={"usage": st.one_of(st.none(), st.just([]), st.fixed_dictionaries({}, optional={
        "prompt_tokens": _count, "completion_tokens": _count,
        "prompt_tokens_details": st.one_of(st.none(), st.just({}), st.just({"cached_tokens": 2})),
        "completion_tokens_details": st.one_of(st.none(), st.just({"reasoning_tokens": 1}))})),
        "error": st.one_of(st.none(), st.just(""), st.just("overloaded"))})


@given(st.one_of(_plain_body, _any_body))
def test_a_plain_answer_read_at_once_is_what_the_general_walk_reads(body):
    """codecs/openai_chat_replies.py reads a plain non-streamed answer at once; whatever the answer, what it
    reads is what the field-by-field walk reads, and an answer the walk refuses is never read."""
    from relayline.adapters.codecs.openai_chat_replies import _plain_answer, _walk_completion

    plain = _plain_answer(body)
    try:
        walked = _walk_completion(body)
    except Exception:  # (refused: malformed, or the provider's error)
        assert plain is None
        return
    assert plain is None or plain == walked


def test_a_typical_answer_takes_the_plain_read():
    from relayline.adapters.codecs.openai_chat_replies import _plain_answer, parse_completion

    body = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "hi", "refusal": None}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
    plain = _plain_answer(body)
    assert plain is not None and plain == parse_completion(body)
    assert (plain.text, plain.finish_reason, plain.usage.input_tokens, plain.usage.output_tokens) == ("hi", "length", 12, 3)


# -- drop_unsupported_params never deletes content ------------------------------------------------------

# every name `wire.unsupported` can give, fields and content alike, and names no rule knows
DROP_NAMES = ["cache_control", "content.image_url.detail", "title", "citations", "seed", "metadata.x", "tools",
              "top_k", "response_format", "reasoning_effort", "tool_result.is_error", "image", "prefill",
              "document.source.url", "document.source.text", "image.source.file", "tool_result.content.image",
              "tool_result.content.document", "messages.tool_calls.function.arguments", "content.input_audio",
              "content.thinking", "x"]
def _content(request: wire.Request) -> list:
    """Every text, image, document and tool datum of a canonical request, in order."""
    return [(m.role, m.tool_call_id, [(p.type, p.text, p.url, p.data, p.media_type) for p in m.content],
             [(c.id, c.name, c.arguments) for c in m.tool_calls]) for m in request.messages]


def _openai_data(body: dict) -> tuple[str, str, Counter]:
    """(system text, other text, images, documents and tool data) of a chat completions body."""
    system, other, data = [], [], Counter()
    for message in body["messages"]:
        texts = system if message["role"] == "system" else other
        if message["role"] == "tool":
            data["result", message["tool_call_id"]] += 1
        content = message["content"] or ""
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part["type"] == "text":
                texts.append(part["text"])
            elif part["type"] == "image_url":
                data["image", part["image_url"]["url"]] += 1
            else:
                data["document", part["file"]["file_data"]] += 1
        for call in message.get("tool_calls") or ():
            data["call", call["id"], call["function"]["name"], call["function"]["arguments"]] += 1
    return "".join(system), "".join(other), data


def _anthropic_data(body: dict) -> tuple[str, str, Counter]:
    """(system text, other text, images, documents and tool data) of a messages body."""
    system, other, data = body.get("system", ""), [], Counter()
    system = [system] if isinstance(system, str) else [b["text"] for b in system]

    def blocks(content: list, texts: list[str]) -> None:
        for block in content:
            kind = block["type"]
            if kind == "text":
                texts.append(block["text"])
            elif kind in ("image", "document"):
                source = block["source"]
                url = source["url"] if source["type"] == "url" else f"data:{source['media_type']};base64,{source['data']}"
                data[kind, url] += 1
            elif kind == "tool_use":
                data["call", block["id"], block["name"], json.dumps(block["input"])] += 1
            else:
                data["result", block["tool_use_id"]] += 1
                blocks(block["content"], texts)

    for message in body["messages"]:  # (a system message after the conversation began stays in place)
        blocks(message["content"], system if message["role"] == "system" else other)
    return "".join(system), "".join(other), data


def _sent(request: wire.Request, family: str) -> tuple[list[str], list[str], Counter]:
    """What the canonical request says, in the shape `_openai_data` / `_anthropic_data` read."""
    system, other, data = [], [], Counter()
    for message in request.messages:
        texts = system if message.role == wire.SYSTEM else other
        if message.role == wire.TOOL:
            data["result", message.tool_call_id] += 1
        for part in message.content:
            if part.type == wire.TEXT:
                texts.append(part.text)
            else:
                url = part.url if part.url is not None else f"data:{part.media_type};base64,{part.data}"
                data["image" if part.type == wire.IMAGE else "document", url] += 1
        for call in message.tool_calls:
            arguments = call.arguments if family == "openai" else json.dumps(wire.json_object(call.arguments))
            data["call", call.id, call.name, arguments] += 1
    return system, other, data


def _in_order(texts: list[str], rendered: str) -> bool:
    at = 0
    for text in texts:
        found = rendered.find(text, at)
        if found < 0:
            return False
        at = found + len(text)
    return True


@pytest.mark.property
@given(request=canonical_requests(), names=st.lists(st.sampled_from(DROP_NAMES), unique=True).map(tuple),
       vision=st.booleans(), prefill=st.booleans())
def test_dropping_unsupported_fields_never_deletes_content(request, names, vision, prefill):
    """Any canonical request, any set of names to drop: every text, image, document and tool datum
    is still in the request, and reaches the body rendered for either family whenever that
    family's entry may serve the request at all (nothing it cannot take is content)."""
    from relayline.adapters.codecs import anthropic_messages_render, openai_chat_render
    from relayline.machines.config import Capabilities

    for family, render, read in (("openai", openai_chat_render.render_request, _openai_data),
                                 ("anthropic", anthropic_messages_render.render_request, _anthropic_data)):
        capabilities = Capabilities(vision=vision, prefill=prefill)
        dropped = (*names, *dropping.droppable(request, family, capabilities))
        kept = dropping.without(request, dropped)
        assert _content(kept) == _content(request)
        if dropping.refused(request, family, capabilities, drop=True):
            continue  # the entry is skipped: nothing is sent to it
        system, other, data = read(render(kept, "m", False))
        want_system, want_other, want_data = _sent(request, family)
        assert _in_order(want_system, system) and _in_order(want_other, other), (want_system, want_other, system, other)
        assert not want_data - data, want_data - data


# -- every field a client sent crosses families, or is named ------------------------------------------

# bodies with every shape the codecs read, in each dialect; a key is added to one or more of their
# objects (never inside a caching hint: a hint towards openai is documented to become nothing)
_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
_CACHED = {"type": "ephemeral"}
FULL_BODIES = {
    "openai": {
        "model": "m", "max_tokens": 3000, "reasoning_effort": "low", "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "be brief", "cache_control": _CACHED},
            {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": _CACHED},
                                         {"type": "image_url", "image_url": {"url": "https://x/c.png"}},
                                         {"type": "file", "file": {"file_data": "data:application/pdf;base64,AA"}}]},
            {"role": "assistant", "content": "a", "reasoning_content": "r", "reasoning_signature": "sig",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "done"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": _SCHEMA, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": _SCHEMA}},
    },
    "anthropic": {
        "model": "m", "max_tokens": 3000, "system": [{"type": "text", "text": "be brief", "cache_control": _CACHED}],
        "thinking": {"type": "enabled", "budget_tokens": 2000}, "metadata": {"user_id": "u"},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": _SCHEMA}},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"},
                                         {"type": "image", "source": {"type": "url", "url": "https://x/c.png"}},
                                         {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                                         "data": "AA"}}]},
            {"role": "system", "content": "mid"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "r", "signature": "sig"},
                                              {"type": "text", "text": "a"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "done"}]}]}],
        "tools": [{"name": "f", "input_schema": _SCHEMA, "strict": True}],
        "tool_choice": {"type": "tool", "name": "f"},
    },
}


def _objects(value, inside: str = ""):
    """Every JSON object of a body a client writes its own keys into (not a caching hint), with
    the key it sits under (a name for the whole object names what the client added to it)."""
    if isinstance(value, dict):
        if inside != "cache_control":
            yield value, inside
        for key, item in value.items():
            yield from _objects(item, key)
    elif isinstance(value, list):
        for item in value:
            yield from _objects(item, inside)


@pytest.mark.property
@given(source=st.sampled_from(["openai", "anthropic"]), data=st.data())
def test_every_field_a_client_sent_crosses_families_or_is_named(source, data):
    """For a body the parser accepts, a key added anywhere either reaches the other family's
    request or is named unsupported (the entry is skipped, or with drop_unsupported_params the
    key is dropped and named): never read past in silence."""
    from relayline.adapters.codecs import (
        anthropic_messages,
        anthropic_messages_render,
        openai_chat,
        openai_chat_render,
    )
    from relayline.machines.config import Capabilities

    body = json.loads(json.dumps(FULL_BODIES[source]))
    objects = list(_objects(body))
    chosen = data.draw(st.lists(st.integers(0, len(objects) - 1), min_size=1, max_size=3, unique=True))
    for i in chosen:
        objects[i][0][f"zq{i}"] = f"MARK{i}"
    parse, render = ((openai_chat.parse_request, anthropic_messages_render.render_request) if source == "openai"
                     else (anthropic_messages.parse_request, openai_chat_render.render_request))
    request = parse(body)
    family = "anthropic" if source == "openai" else "openai"
    names = wire.unsupported(request, family, Capabilities())
    sent = json.dumps(render(request, "m", False))
    for i in chosen:
        assert f"MARK{i}" in sent or any(n.split(".")[-1] in (f"zq{i}", objects[i][1]) for n in names), (i, objects[i], names)
