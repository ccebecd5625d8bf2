"""An agent's history is read by shortcuts for its common shapes (codecs/openai_chat.py,
codecs/anthropic_messages.py): each must read a message exactly as the general path does, and
leave every other shape to it (where a field may be named as unread or refused)."""

from __future__ import annotations

import contextlib
import json
import pickle
from unittest import mock

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relayline.adapters.codecs import anthropic_messages, openai_chat
from relayline.machines import wire as w

_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3), st.just({}),
                    st.just({"path": "a.py"}), st.just([]), st.just(["x"]))


def _near(fields: dict) -> st.SearchStrategy[dict]:
    """Objects of the given fields' values, each field kept, left out or given an odd value,
    sometimes with a field the shape does not have."""
    def one(key, value):  # (kept most often: a shortcut's shape with one thing changed)
        kept = st.just({key: value})
        return st.one_of(kept, kept, kept, kept, st.just({}), _VALUES.map(lambda v: {key: v}))

    parts = [one(key, value) for key, value in fields.items()]
    extra = st.one_of(st.just({}), st.just({"cache_control": {"type": "ephemeral"}}), st.just({"index": 0}),
                      st.just({"is_error": True}), st.just({"name": "n"}))
    return st.tuples(*parts, extra).map(lambda pieces: {k: v for piece in pieces for k, v in piece.items()})


_OPENAI_CALL = _near({"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}) | \
    _near({"function": {"name": "read", "arguments": "{}", "strict": True}, "id": "call_2"})
_OPENAI = st.one_of(
    _near({"role": "tool", "tool_call_id": "call_1", "content": "result"}),
    st.tuples(_near({"role": "assistant", "content": "Reading."}), st.lists(_OPENAI_CALL, max_size=3) | _VALUES).map(
        lambda p: {**p[0], "tool_calls": p[1]}),
    _near({"role": "assistant", "content": None, "tool_calls": []}))
_ANTHROPIC_BLOCK = st.one_of(_near({"type": "tool_result", "tool_use_id": "toolu_1", "content": "result"}),
                             _near({"type": "text", "text": "Reading."}),
                             _near({"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a"}}),
                             _VALUES)
_ANTHROPIC = st.tuples(st.sampled_from(["user", "assistant", "system", None]), st.lists(_ANTHROPIC_BLOCK, max_size=3),
                       st.sampled_from([{}, {"cache_control": {}}])).map(
    lambda p: {**({} if p[0] is None else {"role": p[0]}), "content": p[1], **p[2]})


def _general(read, raw, where):
    """What `read` makes of `raw`: its result or its WireError's words, and the fields it named."""
    names: list[str] = []
    try:
        return read(raw, where, names), names
    except w.WireError as error:
        return str(error), names


@settings(max_examples=400)  # (pure and quick: enough examples to meet each shape's near misses)
@given(_OPENAI)
@example({"role": "tool", "tool_call_id": "call_1", "content": ""})
@example({"role": "assistant", "content": None, "tool_calls": [
    {"id": "c", "function": {"name": "f", "arguments": "{}", "strict": True}}]})
@example({"role": "assistant", "content": None, "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": "{}"}}]})
@example({"role": "assistant", "content": None, "tool_calls": [
    {"id": "c", "function": {"name": "f", "arguments": "{}"}, "cache_control": {"type": "ephemeral"}}]})
@example({"role": "tool", "tool_call_id": "call_1", "content": "x", "cache_control": {"type": "ephemeral"}})
@example({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]})
def test_an_openai_shortcut_reads_a_message_as_the_general_path_does(raw):
    if openai_chat._common(raw):
        assert _general(openai_chat._any_message, raw, 0) == (openai_chat._read_common(raw), [])
    assert _general(openai_chat._message, raw, 0) == _general(openai_chat._any_message, raw, 0)


@settings(max_examples=400)
@given(_ANTHROPIC)
@example({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": ""}]})
@example({"role": "user", "content": [{"type": "text", "tool_use_id": "t", "content": "x"}]})
@example({"role": "user", "content": [{"type": "tool_result", "tool_use_id": 7, "content": "x"}]})
@example({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": ["x"]}]})
@example({"role": "assistant", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]})
@example({"role": "assistant", "content": [{"type": "text", "text": ""},
                                           {"type": "tool_use", "id": "t", "name": "f", "input": {"n": [1, "é"]}}]})
def test_an_anthropic_shortcut_reads_a_turn_as_the_general_path_does(raw):
    assert _general(anthropic_messages._messages, raw, "messages[0]") == \
        _general(anthropic_messages._any_messages, raw, "messages[0]")


def test_the_shortcuts_take_an_agents_usual_turns():
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": json.dumps({"p": 1})}}
    assert openai_chat._common({"role": "tool", "tool_call_id": "call_1", "content": "x"})
    assert openai_chat._common({"role": "assistant", "content": None, "tool_calls": [call]})
    assert openai_chat._common({"role": "developer", "content": "Be brief."})
    assert anthropic_messages._common({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]})
    assert anthropic_messages._common({"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "f", "input": {}}]})


# a history: the shortcuts' shapes and their near misses, plain messages and theirs (a role of
# another kind: a number, a list...)
_OPENAI_PLAIN = st.tuples(_near({"role": "user", "content": "Go on."}),
                          st.sampled_from(["system", "developer", "user", "assistant", "tool", "critic"])).map(
    lambda p: {**p[0], "role": p[1]} if p[0].get("role") == "user" else p[0])
_OPENAI_HISTORY = st.lists(st.one_of(_OPENAI, _OPENAI_PLAIN, _OPENAI_PLAIN, _VALUES), max_size=5)


def _three_ways(codec, body):
    """What `codec` makes of `body` by its general path alone, read at once (as for the library:
    no body to send on) and checked now, read later (as for a client's body sent on to its own
    family): the request less its passthrough, or the WireError's field and words."""
    out = []
    for general, passthrough in ((True, False), (False, False), (False, True)):
        with mock.patch.object(codec, "_common", lambda raw: False) if general else contextlib.nullcontext():
            try:
                request = codec.parse_request(body, passthrough=passthrough)
            except w.WireError as error:
                out.append((error.param, str(error)))
                continue
        out.append(attrs.evolve(request, passthrough=None))
    return out


@settings(max_examples=300)
@given(_OPENAI_HISTORY, st.sampled_from([{}, {"temperature": 0.5}, {"tools": "x"}]))
@example([{"role": "user", "content": "hi"}, {"role": ["user"], "content": "x"}], {})
@example([{"role": "assistant", "tool_calls": []}], {})
@example([{"role": "user", "content": "hi"}, {"role": "user", "content": "x", "name": "n"}], {})
def test_an_openai_history_read_later_is_the_one_read_at_once(history, options):
    """A client's body sent on as it came is checked at once and read only when asked: it must
    be refused exactly as reading it refuses it (the same field, the same words), and read to
    the same request, the fields it names unread included."""
    body = {"model": "m", "messages": history, **options}
    general, at_once, later = _three_ways(openai_chat, body)
    assert later == at_once == general
    if isinstance(later, w.Request):
        assert later.messages == at_once.messages and later.extra == at_once.extra


@settings(max_examples=300)
@given(st.lists(_ANTHROPIC, max_size=4),
       st.sampled_from([{}, {"system": "Be brief."}, {"system": [{"type": "text", "text": "a"}]}, {"system": 3},
                        {"max_tokens": "x"}]))
@example([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                                                                                  "name": "f", "input": []}]}], {})
def test_an_anthropic_history_read_later_is_the_one_read_at_once(history, options):
    body = {"model": "m", "max_tokens": 10, "messages": history, **options}
    general, at_once, later = _three_ways(anthropic_messages, body)
    assert later == at_once == general
    if isinstance(later, w.Request):
        assert later.messages == at_once.messages and later.extra == at_once.extra


def test_a_tool_input_too_deep_to_write_is_refused_at_once_on_either_path():
    """A tool_use input nested deeper than JSON text can be written (the stack runs out) is
    refused while the body is read, a 400, also when the body is sent on as it came: a reading
    left for later would fail mid-turn instead."""
    deep: object = "leaf"
    for _ in range(1100):
        deep = {"a": deep}
    turn = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": deep}]}
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}, turn]}
    for passthrough in (False, True):
        with pytest.raises(RecursionError):
            anthropic_messages.parse_request(body, passthrough=passthrough)
    shallow = {"path": "a.py", "edits": [{"old": "x", "new": "y"}], "todo": ["a"]}
    assert not anthropic_messages._shallow(shallow) and anthropic_messages._shallow({"todo": ["a"], "n": 1})


def test_a_request_read_later_is_written_and_read_back_by_the_converter():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "tool", "tool_call_id": "c", "content": "x"}]}
    request = attrs.evolve(openai_chat.parse_request(body), passthrough=None)
    data = w.converter.unstructure(request)
    assert data["messages"][1]["tool_call_id"] == "c" and "_messages" not in data
    assert w.converter.structure(data, w.Request) == request


def test_a_history_sent_on_is_read_only_when_asked_and_then_once():
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Read it."},
                                       {"role": "assistant", "content": None, "tool_calls": [call]},
                                       {"role": "tool", "tool_call_id": "call_1", "content": "text"}]}
    request = openai_chat.parse_request(body)
    held = request._messages
    assert isinstance(held, w.History) and held._messages is None  # (nothing read yet)
    assert request.messages == openai_chat.parse_request(body, passthrough=False).messages
    assert held._messages is not None and request.messages is request.messages
    # what a request is once read: pickled, it holds its messages
    assert pickle.loads(pickle.dumps(request)) == request
    assert attrs.evolve(request, model="n").messages is request.messages


_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
_OPENAI_TOOL = st.one_of(
    _near({"type": "function", "function": {"name": "read", "description": "Reads.", "parameters": _SCHEMA}}),
    st.tuples(_near({"type": "function"}),
              _near({"name": "read", "description": "Reads.", "parameters": _SCHEMA, "strict": True})).map(
        lambda p: {**p[0], "function": p[1]}),
    _VALUES)
_ANTHROPIC_TOOL = st.one_of(
    _near({"name": "read", "description": "Reads.", "input_schema": _SCHEMA}),
    _near({"name": "read", "input_schema": _SCHEMA, "strict": False, "cache_control": {"type": "ephemeral"}}),
    _near({"type": "custom", "name": "read", "input_schema": _SCHEMA}),
    _VALUES)


def _one_tool(read, raw):
    """What `read` (the general path: one tool or None) makes of a list of `raw` alone."""
    names: list[str] = []
    try:
        tool = read(raw, "tools[0]", names)
        return (() if tool is None else (tool,)), names
    except w.WireError as error:
        return str(error), names


def _tool_list(codec, raw):
    """What the codec makes of a body's tools list of `raw` alone, shortcut first."""
    names: list[str] = []
    try:
        return codec._tools({"tools": [raw]}, names), names
    except w.WireError as error:
        return str(error), names


@settings(max_examples=400)
@given(_OPENAI_TOOL)
@example({"type": "function", "function": {"name": "f", "description": None, "parameters": None}})
@example({"function": {"name": "f", "strict": False}, "cache_control": {"type": "ephemeral"}})
@example({"type": "function", "function": {"name": "f", "strict": 1}})
@example({"type": None, "function": {"name": "f"}})
def test_an_openai_tool_shortcut_reads_a_tool_as_the_general_path_does(raw):
    read = openai_chat._function_tool(raw)
    if read is not None:
        assert _one_tool(openai_chat._tool, raw) == ((read,), [])
    assert _tool_list(openai_chat, raw) == _one_tool(openai_chat._tool, raw)


@settings(max_examples=400)
@given(_ANTHROPIC_TOOL)
@example({"name": "f", "description": None, "input_schema": None})
@example({"name": "f", "strict": 0})
@example({"name": "f", "strict": True})
@example({"name": "f", "cache_control": "ephemeral"})
def test_an_anthropic_tool_shortcut_reads_a_tool_as_the_general_path_does(raw):
    read = anthropic_messages._client_tool(raw)
    if read is not None:
        assert _one_tool(anthropic_messages._tool, raw) == ((read,), [])
    assert _tool_list(anthropic_messages, raw) == _one_tool(anthropic_messages._tool, raw)


def test_the_tool_shortcuts_take_an_agents_usual_tools():
    assert openai_chat._function_tool(
        {"type": "function", "function": {"name": "read", "description": "Reads.", "parameters": _SCHEMA}}) \
        == w.Tool("read", "Reads.", _SCHEMA)
    assert anthropic_messages._client_tool(
        {"name": "read", "description": "Reads.", "input_schema": _SCHEMA, "cache_control": {"type": "ephemeral"}}) \
        == w.Tool("read", "Reads.", _SCHEMA, cache_control={"type": "ephemeral"})
