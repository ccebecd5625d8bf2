"""Anthropic messages requests read: a client's body as the canonical request (the gateway's
Anthropic dialect). The canonical request written as the body an `anthropic` profile is sent is
`anthropic_messages_render.py`.

A body of the wrong shape raises WireError naming the field; a block where its role has no
place for it is refused rather than left out. What the canonical model does not hold is kept
by name in `Request.extra`: a provider of this family gets the client's body as sent, and
another family is not sent a request with a field silently gone.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any, TypeGuard

from relayline.machines import wire as w

from . import shape
from .common import client_headers

KNOWN = frozenset({"model", "messages", "system", "max_tokens", "stream", "temperature", "top_p",
                   "top_k", "stop_sequences", "tools", "tool_choice", "metadata", "thinking",
                   "output_config", "output_format"})


# sources no other family has: a plain-text or chunked document, and the Files API's file ids
OWN_SOURCES = ("text", "content", "file")


def _source(raw: dict[str, Any], param: str, block: str,
            extra: tuple[str, ...]) -> dict[str, Any]:
    source = shape.want_dict(raw.get("source"), shape.path(param, "source"))
    kind = shape.want_str(source.get("type"), shape.path(param, "source.type"))
    extra += tuple(f"{block}.source.{k}"
                   for k in shape.extras(source, ("type", "media_type", "data", "url")))
    if kind == "base64":
        return {"media_type": shape.want_str(source.get("media_type"),
                                             shape.path(param, "source.media_type")),
                "data": shape.want_str(source.get("data"), shape.path(param, "source.data")),
                "extra": extra}
    if kind == "url":
        return {"url": shape.want_str(source.get("url"), shape.path(param, "source.url")),
                "extra": extra}
    if kind in OWN_SOURCES:
        # an anthropic profile gets the client's body as sent; another family cannot take it
        return {"extra": (*extra, f"{block}.source.{kind}")}
    raise w.WireError(shape.path(param, "source.type"),
                      f"must be one of base64, url, {', '.join(OWN_SOURCES)}")


def _reasoning_block(raw: dict[str, Any], param: str, kind: str) -> w.Part:
    """A thinking block of the history (with its signature; "" when it has none, as on thinking
    relayline showed from a provider that signs nothing) or a redacted one (its opaque data)."""
    extra = tuple(shape.extras(raw, ("type", "thinking", "signature", "data")))
    if kind == w.THINKING:
        text = shape.want_str(raw.get("thinking"), shape.path(param, "thinking"))
        return w.Part(w.THINKING, text, extra=extra,
                      signature=shape.optional(raw, "signature", shape.want_str, param) or "")
    data = shape.want_str(raw.get("data"), shape.path(param, "data"))
    return w.Part(w.REDACTED_THINKING, data=data, extra=extra)


# what a block may carry beside its type that this codec reads
_BLOCK_FIELDS = ("type", "text", "source", "id", "name", "input", "tool_use_id", "content",
                 "is_error", "cache_control")

Block = w.Part | w.ToolCall | w.Message | None


def _block(raw: object, param: str, extra_names: list[str]) -> Block:
    fields = shape.want_dict(raw, param)
    kind = shape.want_str(fields.get("type"), shape.path(param, "type"))
    if kind in w.REASONING_PARTS:
        return _reasoning_block(fields, param, kind)
    extra = tuple(shape.extras(fields, _BLOCK_FIELDS))
    cache = shape.optional(fields, "cache_control", shape.want_dict, param)
    if kind == "text":
        text = shape.want_str(fields.get("text"), shape.path(param, "text"))
        return w.Part(w.TEXT, text, extra=extra, cache_control=cache)
    if kind == "image":
        return w.Part(w.IMAGE, **_source(fields, param, kind, extra), cache_control=cache)
    if kind == "document":  # (its title is an OpenAI file's name)
        source = _source(fields, param, kind, tuple(k for k in extra if k != "title"))
        return w.Part(w.DOCUMENT, **source, cache_control=cache,
                      title=shape.optional(fields, "title", shape.want_str, param))
    if kind in ("tool_use", "tool_result"):
        # a tool block's fields relayline does not read: this family's own
        extra_names.extend(extra)
    if kind == "tool_use":
        call_id = shape.want_str(fields.get("id"), shape.path(param, "id"))
        name = shape.want_str(fields.get("name"), shape.path(param, "name"))
        arguments = shape.want_dict(fields.get("input", {}), shape.path(param, "input"))
        return w.ToolCall(call_id, name, json.dumps(arguments), cache)
    if kind == "tool_result":
        return _tool_result(fields, param, extra_names, cache)
    extra_names.append(f"content.{kind}")  # server tools and their results: this family's own
    return None


def _tool_result(fields: dict[str, Any], param: str, extra_names: list[str],
                 cache: dict[str, Any] | None) -> w.Message:
    content = fields.get("content", "")
    parts: tuple[w.Part, ...]
    if isinstance(content, str):
        parts = (w.Part(w.TEXT, content),) if content else ()
    else:
        where = shape.path(param, "content")
        blocks = [_block(b, shape.path(where, i), extra_names)
                  for i, b in enumerate(shape.want_list(content, where))]
        _refuse_misplaced(blocks, (w.ToolCall, w.Message), where,
                          "a tool result holds no tool_use or tool_result")
        parts = tuple(p for p in blocks if isinstance(p, w.Part))
    call_id = shape.want_str(fields.get("tool_use_id"), shape.path(param, "tool_use_id"))
    return w.Message(w.TOOL, parts, tool_call_id=call_id,
                     is_error=bool(shape.optional(fields, "is_error", shape.want_bool, param)),
                     cache_control=cache)


def _refuse_misplaced(blocks: list[Block], kind: type | tuple[type, ...], where: str,
                      message: str) -> None:
    """A block where its role has no place for it (a tool_use in a user turn...) is a 400 naming
    it: no family could be sent it, and leaving it out would drop what the client said."""
    for i, block in enumerate(blocks):
        if isinstance(block, kind):
            raise w.WireError(shape.path(where, i), message)


# a system message inside `messages` (Claude Code's mid-conversation instructions) keeps its place
_ROLES = {"user": w.USER, "assistant": w.ASSISTANT, "system": w.SYSTEM}


_RESULT_FIELDS = frozenset(("type", "tool_use_id", "content"))
_TEXT_FIELDS = frozenset(("type", "text"))
_USE_FIELDS = frozenset(("type", "id", "name", "input"))


def _common(raw: object) -> TypeGuard[dict[str, Any]]:
    """Whether `raw` is a turn of the shapes nearly every turn of an agent's history has, which
    the general path reads naming no field and refusing nothing: a user turn of tool_result
    blocks, each a call's id and a string; an assistant turn of text blocks and tool_use blocks,
    each with no field beside its own and an input nested at most two deep. `_read_common` reads
    one as the general path does, without checking it again: later, for a body sent on as it
    came, so nothing it does may fail (writing a deeper input as JSON text can exhaust the
    stack, which the general path answers with a 400 at once)."""
    if type(raw) is not dict or len(raw) != 2:
        return False
    blocks, role = raw.get("content"), raw.get("role")
    if type(blocks) is not list or not blocks:
        return False
    if role == "user":
        for block in blocks:
            if (type(block) is not dict or block.keys() != _RESULT_FIELDS
                    or block["type"] != "tool_result" or type(block["content"]) is not str
                    or type(block["tool_use_id"]) is not str):
                return False
        return True
    if role != "assistant":
        return False
    for block in blocks:
        kind = block.get("type") if type(block) is dict else None
        if kind == "text":
            if block.keys() != _TEXT_FIELDS or type(block["text"]) is not str:
                return False
        elif (kind != "tool_use" or block.keys() != _USE_FIELDS or type(block["id"]) is not str
                or type(block["name"]) is not str or type(block["input"]) is not dict
                or not _shallow(block["input"])):
            return False
    return True


def _shallow(value: dict[str, Any]) -> bool:
    """Whether no container in `value` holds another container."""
    for item in value.values():
        kind = type(item)
        if kind is dict or kind is list:
            for inner in (item.values() if kind is dict else item):
                if type(inner) is dict or type(inner) is list:
                    return False
    return True


def _read_common(raw: dict[str, Any]) -> list[w.Message]:
    """A turn `_common` took, as the general path reads it."""
    blocks = raw["content"]
    if raw["role"] == "user":
        return [w.Message(w.TOOL, (w.Part(w.TEXT, block["content"]),) if block["content"] else (),
                          tool_call_id=block["tool_use_id"]) for block in blocks]
    parts: list[w.Part] = []
    calls: list[w.ToolCall] = []
    for block in blocks:
        if block["type"] == "text":
            parts.append(w.Part(w.TEXT, block["text"]))
        else:
            calls.append(w.ToolCall(block["id"], block["name"], json.dumps(block["input"]), None))
    return [w.Message(w.ASSISTANT, tuple(parts), tuple(calls))]


def _messages(raw: object, param: str, extra_names: list[str]) -> list[w.Message]:
    # (nearly every turn of an agent's history is of a common shape: no per-field paths for it)
    if _common(raw):
        return _read_common(raw)
    return _any_messages(raw, param, extra_names)


def _any_messages(raw: object, param: str, extra_names: list[str]) -> list[w.Message]:
    fields = shape.want_dict(raw, param)
    role = shape.want_str(fields.get("role"), shape.path(param, "role"))
    if role not in _ROLES:
        raise w.WireError(shape.path(param, "role"), "must be user, assistant or system")
    content = fields.get("content")
    where = shape.path(param, "content")
    extra_names.extend(f"messages.{k}" for k in shape.extras(fields, ("role", "content")))
    if isinstance(content, str):
        return [w.Message(_ROLES[role], (w.Part(w.TEXT, content),) if content else ())]
    blocks = [_block(b, shape.path(where, i), extra_names)
              for i, b in enumerate(shape.want_list(content, where))]
    parts = tuple(b for b in blocks if isinstance(b, w.Part))
    if role == "assistant":
        _refuse_misplaced(blocks, w.Message, where,
                          "a tool_result block belongs to a user message")
        calls = tuple(b for b in blocks if isinstance(b, w.ToolCall))
        return [w.Message(w.ASSISTANT, parts, calls)]
    if any(p.type in w.REASONING_PARTS for p in parts):
        raise w.WireError(where, "thinking blocks belong to assistant messages")
    if role == "system":
        _refuse_misplaced(blocks, (w.ToolCall, w.Message), where,
                          "a system message holds no tool_use or tool_result blocks")
        return [w.Message(w.SYSTEM, parts)]
    _refuse_misplaced(blocks, w.ToolCall, where,
                      "a tool_use block belongs to an assistant message")
    # tool results become tool messages, first: they answer the assistant turn just before
    out = [b for b in blocks if isinstance(b, w.Message)]
    if parts or not out:
        out.append(w.Message(w.USER, parts))
    return out


def _system(raw: object) -> tuple[w.Message, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (w.Message(w.SYSTEM, (w.Part(w.TEXT, raw),)),) if raw else ()
    blocks = shape.want_list(raw, "system")
    parts = []
    for i, block in enumerate(blocks):
        part = _block(block, shape.path("system", i), [])
        if not isinstance(part, w.Part) or part.type != w.TEXT:
            raise w.WireError(shape.path("system", i), "expected a text block")
        parts.append(part)
    return (w.Message(w.SYSTEM, tuple(parts)),)


def _tool(raw: object, param: str, extra_names: list[str]) -> w.Tool | None:
    fields = shape.want_dict(raw, param)
    if fields.get("type") not in (None, "custom"):  # server tools
        extra_names.append(f"tools.{shape.want_str(fields['type'], shape.path(param, 'type'))}")
        return None
    extra_names.extend(f"tools.{k}" for k in shape.extras(
        fields, ("type", "name", "description", "input_schema", "strict", "cache_control")))
    schema = shape.optional(fields, "input_schema", shape.want_dict, param)
    return w.Tool(shape.want_str(fields.get("name"), shape.path(param, "name")),
                  shape.optional(fields, "description", shape.want_str, param) or "",
                  schema if schema is not None else {"type": "object"},
                  bool(shape.optional(fields, "strict", shape.want_bool, param)),
                  shape.optional(fields, "cache_control", shape.want_dict, param))


def _tools(body: dict[str, Any], extra_names: list[str]) -> tuple[w.Tool, ...]:
    listed = shape.optional(body, "tools", shape.want_list) or ()
    read = (_client_tool(t) or _tool(t, shape.path("tools", i), extra_names)
            for i, t in enumerate(listed))
    return tuple(t for t in read if t is not None)


_TOOL_FIELDS = frozenset(("name", "description", "input_schema", "strict", "cache_control"))


def _client_tool(raw: object) -> w.Tool | None:
    """A client tool of a name and, each optional, a description, an input schema, strict and a
    caching hint, as the general path reads it; None for any other shape. An agent sends 20 to
    40 of them on every turn."""
    if type(raw) is not dict or not raw.keys() <= _TOOL_FIELDS:
        return None
    name, description, schema = raw.get("name"), raw.get("description"), raw.get("input_schema")
    strict, cache = raw.get("strict"), raw.get("cache_control")
    if (type(name) is not str or (description is not None and type(description) is not str)
            or (schema is not None and type(schema) is not dict)
            or (strict is not None and type(strict) is not bool)
            or (cache is not None and type(cache) is not dict)):
        return None
    schema = schema if schema is not None else {"type": "object"}
    return w.Tool(name, description or "", schema, bool(strict), cache)


# an OpenAI json_schema format must be named and Anthropic's output format has no name: this one
# stands in for it towards an openai entry
OUTPUT_FORMAT_NAME = "response"


def _output_format(body: dict[str, Any], extra_names: list[str]) -> w.ResponseFormat | None:
    """The JSON schema the answer must match: `output_config.format`, or the same object as the
    structured outputs beta wrote it (`output_format`)."""
    config = shape.optional(body, "output_config", shape.want_dict) or {}
    if config.get("format") is not None and body.get("output_format") is not None:
        raise w.WireError("output_format",
                          "and output_config.format are the same setting: send one of them")
    where = "output_config.format" if config.get("format") is not None else "output_format"
    raw = config.get("format") if config.get("format") is not None else body.get("output_format")
    if raw is None:
        return None
    fields = shape.want_dict(raw, where)
    if shape.want_str(fields.get("type"), shape.path(where, "type")) != "json_schema":
        raise w.WireError(shape.path(where, "type"), "must be json_schema")
    extra_names.extend(f"{where}.{k}" for k in shape.extras(fields, ("type", "schema")))
    schema = shape.want_dict(fields.get("schema"), shape.path(where, "schema"))
    return w.ResponseFormat("json_schema",
                            {"name": OUTPUT_FORMAT_NAME, "schema": schema, "strict": True})


def _tool_choice(raw: object,
                 extra_names: list[str]) -> tuple[w.ToolChoice | None, bool | None]:
    if raw is None:
        return None, None
    fields = shape.want_dict(raw, "tool_choice")
    extra_names.extend(f"tool_choice.{k}" for k in shape.extras(
        fields, ("type", "name", "disable_parallel_tool_use")))
    kind = shape.want_str(fields.get("type"), "tool_choice.type")
    modes = {"auto": "auto", "none": "none", "any": "required", "tool": "tool"}
    if kind not in modes:
        raise w.WireError("tool_choice.type", "must be auto, any, tool or none")
    name = shape.want_str(fields.get("name"), "tool_choice.name") if kind == "tool" else None
    disable = shape.optional(fields, "disable_parallel_tool_use", shape.want_bool, "tool_choice")
    return w.ToolChoice(modes[kind], name), (None if disable is None else not disable)


def _reasoning(body: dict[str, Any], extra: dict[str, Any]) -> w.Reasoning | None:
    """`thinking` and `output_config.effort` as the canonical reasoning. A thinking type this
    module does not know stays in `extra`: an anthropic profile gets it as sent, another family
    cannot honour it."""
    output = shape.optional(body, "output_config", shape.want_dict) or {}
    effort = shape.optional(output, "effort", shape.want_str, "output_config")
    rest = {k: output[k] for k in shape.extras(output, ("effort", "format"))}
    if rest:
        extra["output_config"] = rest  # (what relayline does not read: this family's own)
    raw = body.get("thinking")
    if raw is None:
        return None if effort is None else w.Reasoning(effort)
    thinking = shape.want_dict(raw, "thinking")
    kind = shape.want_str(thinking.get("type"), "thinking.type")
    if kind in ("enabled", "adaptive"):
        extra.update({f"thinking.{k}": None
                      for k in shape.extras(thinking, ("type", "budget_tokens"))})
    if kind == "enabled":
        budget = shape.want_int(thinking.get("budget_tokens"), "thinking.budget_tokens", 1)
        return w.Reasoning(effort, budget)
    if kind == "adaptive":  # the model decides how much to think, at the effort asked for
        return w.Reasoning(effort, adaptive=True)
    if kind != "disabled":
        extra["thinking"] = raw
    return None if effort is None else w.Reasoning(effort)


def parse_request(raw: object, headers: Iterable[tuple[str, str]] = (), query: str = "", *,
                  passthrough: bool = True, read: w.ReadBytes | None = None) -> w.Request:
    """A messages body (and its request headers) as the canonical request; a body of the wrong
    shape raises WireError naming the field."""
    body = shape.want_dict(raw, "")
    messages = shape.want_list(body.get("messages"), "messages")
    if not messages:
        raise w.WireError("messages", "must not be empty")
    extra_names: list[str] = []
    # (sent on as it came to an entry of this family, which reads no message: every turn is
    # checked now, as reading it would, and those of a common shape read only if something asks
    # for them, `wire.History`)
    built = ({i: _any_messages(m, shape.path("messages", i), extra_names)
             for i, m in enumerate(messages) if not _common(m)} if passthrough
             else {i: _messages(m, shape.path("messages", i), extra_names)
                   for i, m in enumerate(messages)})
    stop = shape.optional(body, "stop_sequences", shape.want_list) or []
    tools = _tools(body, extra_names)
    choice, parallel = _tool_choice(body.get("tool_choice"), extra_names)
    metadata = shape.optional(body, "metadata", shape.want_dict) or {}
    extra_names.extend(f"metadata.{k}" for k in shape.extras(metadata, ("user_id",)))
    response_format = _output_format(body, extra_names)
    extra = {k: body[k] for k in shape.extras(body, KNOWN)}
    extra.update({name: None for name in extra_names})
    reasoning = _reasoning(body, extra)
    system = _system(body.get("system"))
    return w.Request(
        messages=w.History(functools.partial(_history, system, messages, built)) if passthrough
        else _history(system, messages, built),
        model=shape.check_model(body.get("model")),
        stream=bool(shape.optional(body, "stream", shape.want_bool)),
        include_usage=True,  # Anthropic streams always carry usage
        max_tokens=shape.optional(body, "max_tokens", shape.want_int, "", 1),
        temperature=shape.optional(body, "temperature", shape.want_number, "", 0, 1),
        top_p=shape.optional(body, "top_p", shape.want_number, "", 0, 1),
        top_k=shape.optional(body, "top_k", shape.want_int, "", 1),
        stop=tuple(shape.want_str(s, shape.path("stop_sequences", i)) for i, s in enumerate(stop)),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=response_format,
        reasoning=reasoning,
        user=shape.optional(metadata, "user_id", shape.want_str, "metadata"),
        extra=extra,
        source="anthropic",
        passthrough=w.Passthrough(_signed_history(body), client_headers(headers), query, read)
        if passthrough else None,
    )


def _history(system: tuple[w.Message, ...], turns: list[Any],
             built: dict[int, list[w.Message]]) -> tuple[w.Message, ...]:
    """The messages of the turns `parse_request` checked: those it built already, the others built
    now, after the system prompt."""
    return (*system, *[m for i, turn in enumerate(turns)
                       for m in (built[i] if i in built else _read_common(turn))])


def _unsigned(block: object) -> bool:
    return type(block) is dict and block.get("type") == "thinking" and not block.get("signature")


def _signed_history(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as an anthropic entry gets it: as sent, less thinking with no signature
    (relayline showed it from a provider that signs nothing), which Anthropic would refuse; an
    assistant message left with no content goes too (Anthropic joins the turns around it)."""
    for message in body["messages"]:  # (a loop: this runs on every request, and finds nothing)
        content = message.get("content")
        if type(content) is list and any(map(_unsigned, content)):
            break
    else:
        return body
    messages = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list) and any(map(_unsigned, content)):
            content = [b for b in content if not _unsigned(b)]
            if not content:
                continue
            message = {**message, "content": content}
        messages.append(message)
    return {**body, "messages": messages}
