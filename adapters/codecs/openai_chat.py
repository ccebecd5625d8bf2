"""OpenAI chat completions requests read: a client's body as the canonical request (the
gateway's OpenAI dialect and the library use it). The canonical request written as the body an
`openai` profile is sent is `openai_chat_render.py`.

A body of the wrong shape raises WireError naming the field. What the canonical model does not
hold is kept by name in `Request.extra`: a provider of this family gets the client's body as
sent, and another family is not sent a request with a field silently gone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, TypeGuard

from relayline.machines import wire as w

from . import shape
from .common import client_headers, data_url

# request fields the canonical model holds; anything else is the family's own (Request.extra)
KNOWN = frozenset({"model", "messages", "stream", "stream_options", "n", "max_tokens",
                   "max_completion_tokens", "temperature", "top_p", "stop", "tools", "tool_choice",
                   "parallel_tool_calls", "response_format", "reasoning_effort", "user"})


def _part(raw: object, param: str, extra_names: list[str]) -> w.Part:
    if isinstance(raw, str):
        return w.Part(w.TEXT, raw)
    fields = shape.want_dict(raw, param)
    kind = shape.want_str(fields.get("type"), shape.path(param, "type"))
    extra = tuple(shape.extras(fields, ("type", "text", "image_url", "file", "cache_control")))
    # a common extension (opencode, OpenRouter)
    cache = shape.optional(fields, "cache_control", shape.want_dict, param)
    if kind in ("text", "input_text"):
        text = shape.want_str(fields.get("text"), shape.path(param, "text"))
        return w.Part(w.TEXT, text, extra=extra, cache_control=cache)
    if kind == "image_url":
        return _image_part(fields.get("image_url"), param, extra, cache)
    if kind == "file":
        return _file_part(fields.get("file"), param, extra, cache)
    extra_names.append(f"content.{kind}")  # audio and other parts: this family's own
    return w.Part(kind, extra=extra, cache_control=cache)


def _image_part(image: object, param: str, extra: tuple[str, ...],
                cache: dict[str, Any] | None) -> w.Part:
    if isinstance(image, str):
        url = image
    else:
        fields = shape.want_dict(image, shape.path(param, "image_url"))
        url = shape.want_str(fields.get("url"), shape.path(param, "image_url.url"))
        # `detail` (low: fewer tokens; high: more) has no Anthropic equivalent; auto asks nothing
        extra += tuple(f"content.image_url.{k}" for k in shape.extras(fields, ("url",))
                       if not (k == "detail" and fields[k] == "auto"))
    data = data_url(url)
    if data is not None:
        return w.Part(w.IMAGE, data=data[1], media_type=data[0], extra=extra, cache_control=cache)
    return w.Part(w.IMAGE, url=url, extra=extra, cache_control=cache)


def _file_part(raw: object, param: str, extra: tuple[str, ...],
               cache: dict[str, Any] | None) -> w.Part:
    file = shape.want_dict(raw, shape.path(param, "file"))
    extra += tuple(f"content.file.{k}"
                   for k in shape.extras(file, ("file_data", "file_id", "filename")))
    title = shape.optional(file, "filename", shape.want_str, shape.path(param, "file"))
    if file.get("file_data") is None and file.get("file_id") is not None:
        # an uploaded file, by its id: an openai entry gets the body as sent, another cannot
        shape.want_str(file["file_id"], shape.path(param, "file.file_id"))
        return w.Part(w.DOCUMENT, extra=(*extra, w.OPENAI_FILE_ID), cache_control=cache)
    where = shape.path(param, "file.file_data")
    data = data_url(shape.want_str(file.get("file_data"), where))
    if data is None:
        raise w.WireError(where, "expected a base64 data: URL")
    return w.Part(w.DOCUMENT, data=data[1], media_type=data[0], extra=extra, cache_control=cache,
                  title=title)


def _content(raw: object, param: str, extra_names: list[str], *,
             nullable: bool) -> tuple[w.Part, ...]:
    if raw is None:
        if nullable:
            return ()
        raise w.WireError(param, "expected a string or a list of content parts, got null")
    if isinstance(raw, str):
        return (w.Part(w.TEXT, raw),) if raw else ()
    if not isinstance(raw, list):
        raise w.WireError(param,
                          f"expected a string or a list of content parts, got {w.describe(raw)}")
    return tuple(_part(p, shape.path(param, i), extra_names) for i, p in enumerate(raw))


def _tool_call(raw: object, param: str, extra_names: list[str]) -> w.ToolCall:
    fields = shape.want_dict(raw, param)
    function = shape.want_dict(fields.get("function"), shape.path(param, "function"))
    # (`index`, a stream's place of the call, says nothing once the calls are in order)
    extra_names.extend(f"messages.tool_calls.{k}" for k in shape.extras(
        fields, ("id", "type", "function", "index", "cache_control")))
    extra_names.extend(f"messages.tool_calls.function.{k}"
                       for k in shape.extras(function, ("name", "arguments")))
    given = function.get("arguments")
    arguments = ("{}" if given is None
                 else shape.want_str(given, shape.path(param, "function.arguments")))
    return w.ToolCall(shape.want_str(fields.get("id"), shape.path(param, "id")),
                      shape.want_str(function.get("name"), shape.path(param, "function.name")),
                      arguments,
                      # (a caching hint, as on a message)
                      shape.optional(fields, "cache_control", shape.want_dict, param))


# what relayline put beside `reasoning_content` on an answer for its client to send back with it
# (an Anthropic answer's thinking signature and redacted thinking, which Anthropic wants back as
# they were): read on an assistant message of the history, never sent to an openai entry
REASONING_FIELDS = ("reasoning_content", "reasoning_signature", "reasoning_redacted")
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "cache_control")
_ASSISTANT_FIELDS = (*_MESSAGE_FIELDS, *REASONING_FIELDS)


def _reasoning_history(raw: dict[str, Any], param: str) -> tuple[w.Part, ...]:
    """The reasoning an assistant message of the history carries back: its thinking (signed
    when relayline gave the client a signature for it), then its redacted thinking."""
    text = shape.optional(raw, "reasoning_content", shape.want_str, param) or ""
    signature = shape.optional(raw, "reasoning_signature", shape.want_str, param) or ""
    redacted = shape.optional(raw, "reasoning_redacted", shape.want_list, param) or ()
    where = shape.path(param, "reasoning_redacted")
    thinking = (w.Part(w.THINKING, text, signature=signature),) if text or signature else ()
    return thinking + tuple(
        w.Part(w.REDACTED_THINKING, data=shape.want_str(data, shape.path(where, i)))
        for i, data in enumerate(redacted))


# the roles whose message is whole as a role and a string (a tool result also needs its call's id)
_PLAIN_ROLES = {"system": w.SYSTEM, "developer": w.SYSTEM, "user": w.USER, "assistant": w.ASSISTANT}


_CALL_FIELDS = frozenset(("id", "type", "function"))
_FUNCTION_FIELDS = frozenset(("name", "arguments"))
_CALLING_FIELDS = frozenset(("role", "content", "tool_calls"))


def _common(raw: object) -> TypeGuard[dict[str, Any]]:
    """Whether `raw` is a message of the shapes nearly every message of an agent's history has,
    which the general path reads naming no field and refusing nothing: a role and a string; a
    tool's result, a call's id and a string; an assistant's text (or null) and function calls,
    each an id, a name and string arguments. `_read_common` reads one as the general path does,
    without checking it again."""
    if type(raw) is not dict:
        return False
    role = raw.get("role")
    if role == "tool":
        return (len(raw) == 3 and type(raw.get("content")) is str
                and type(raw.get("tool_call_id")) is str)
    if len(raw) == 2 and type(role) is str and role in _PLAIN_ROLES \
            and type(raw.get("content")) is str:
        return True
    return role == "assistant" and _is_calling(raw)


def _is_calling(raw: dict[str, Any]) -> bool:
    content, calls = raw.get("content"), raw.get("tool_calls")
    if (not raw.keys() <= _CALLING_FIELDS or (content is not None and type(content) is not str)
            or type(calls) is not list):
        return False
    for call in calls:
        function = call.get("function") if type(call) is dict else None
        if (type(function) is not dict or not call.keys() <= _CALL_FIELDS
                or not function.keys() <= _FUNCTION_FIELDS):
            return False
        if (type(call.get("id")) is not str or type(function.get("name")) is not str
                or type(function.get("arguments")) is not str):
            return False
    return True


def _read_common(raw: dict[str, Any]) -> w.Message:
    """A message `_common` took, as the general path reads it."""
    content, role = raw.get("content"), raw["role"]  # (content null or left out: no text)
    parts = (w.Part(w.TEXT, content),) if content else ()
    if role == "tool":
        return w.Message(w.TOOL, parts, tool_call_id=raw["tool_call_id"])
    calls = raw.get("tool_calls")
    if not calls:
        return w.Message(_PLAIN_ROLES[role], parts)
    return w.Message(w.ASSISTANT, parts, tuple([
        w.ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"], None)
        for call in calls]))


def _message(raw: object, index: int, extra_names: list[str]) -> w.Message:
    # (nearly every message of an agent's history is of a common shape: no per-field paths,
    # extras and options looked up for it)
    if _common(raw):
        return _read_common(raw)
    return _any_message(raw, index, extra_names)


def _any_message(raw: object, index: int, extra_names: list[str]) -> w.Message:
    param = shape.path("messages", index)
    fields = shape.want_dict(raw, param)
    content = fields.get("content")
    role = shape.want_str(fields.get("role"), shape.path(param, "role"))
    where = shape.path(param, "content")
    known = _ASSISTANT_FIELDS if role == "assistant" else _MESSAGE_FIELDS
    extra_names.extend(f"messages.{k}" for k in shape.extras(fields, known))
    cache = shape.optional(fields, "cache_control", shape.want_dict, param)
    if role in ("system", "developer"):
        return w.Message(w.SYSTEM, _content(content, where, extra_names, nullable=False),
                         cache_control=cache)
    if role == "user":
        return w.Message(w.USER, _content(content, where, extra_names, nullable=False),
                         cache_control=cache)
    if role == "assistant":
        calls = _tool_calls(fields.get("tool_calls"), param, extra_names)
        return w.Message(w.ASSISTANT, _reasoning_history(fields, param)
                         + _content(content, where, extra_names, nullable=True),
                         calls, cache_control=cache)
    if role == "tool":
        call_id = shape.want_str(fields.get("tool_call_id"), shape.path(param, "tool_call_id"))
        return w.Message(w.TOOL, _content(content, where, extra_names, nullable=False),
                         tool_call_id=call_id, cache_control=cache)
    raise w.WireError(shape.path(param, "role"),
                      "must be one of system, developer, user, assistant, tool")


def _tool_calls(raw: object, param: str, extra_names: list[str]) -> tuple[w.ToolCall, ...]:
    if raw is None:
        return ()
    where = shape.path(param, "tool_calls")
    return tuple(_tool_call(c, shape.path(where, i), extra_names)
                 for i, c in enumerate(shape.want_list(raw, where)))


def _tool(raw: object, param: str, extra_names: list[str]) -> w.Tool | None:
    fields = shape.want_dict(raw, param)
    kind = fields.get("type", "function")
    if kind != "function":
        # a custom tool (free-form input): an openai entry gets the body as sent, another cannot
        extra_names.append(f"tools.{shape.want_str(kind, shape.path(param, 'type'))}")
        return None
    where = shape.path(param, "function")
    function = shape.want_dict(fields.get("function"), where)
    extra_names.extend(f"tools.{k}"
                       for k in shape.extras(fields, ("type", "function", "cache_control")))
    extra_names.extend(f"tools.function.{k}" for k in shape.extras(
        function, ("name", "description", "parameters", "strict")))
    parameters = shape.optional(function, "parameters", shape.want_dict, where)
    return w.Tool(shape.want_str(function.get("name"), shape.path(param, "function.name")),
                  shape.optional(function, "description", shape.want_str, where) or "",
                  parameters if parameters is not None else {"type": "object"},
                  bool(shape.optional(function, "strict", shape.want_bool, where)),
                  # (a caching hint, as on a message)
                  shape.optional(fields, "cache_control", shape.want_dict, param))


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The output limit: `max_completion_tokens`, or the older `max_tokens`. Both, with different
    values, is two limits: which one the client meant is theirs to say."""
    limit: int | None = shape.optional(body, "max_completion_tokens", shape.want_int, "", 1)
    legacy: int | None = shape.optional(body, "max_tokens", shape.want_int, "", 1)
    if limit is not None and legacy is not None and limit != legacy:
        raise w.WireError("max_tokens",
                          f"is {legacy} but max_completion_tokens is {limit}: send one of them")
    return limit if limit is not None else legacy


def _tool_choice(raw: object, extra_names: list[str]) -> w.ToolChoice | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise w.WireError("tool_choice", "must be auto, none, required or a function")
        return w.ToolChoice(raw)
    fields = shape.want_dict(raw, "tool_choice")
    kind = fields.get("type", "function")
    if kind != "function":  # allowed_tools, a custom tool: an openai entry gets them as sent
        extra_names.append(f"tool_choice.{shape.want_str(kind, 'tool_choice.type')}")
        return None
    function = shape.want_dict(fields.get("function"), "tool_choice.function")
    extra_names.extend(f"tool_choice.{k}" for k in shape.extras(fields, ("type", "function")))
    extra_names.extend(f"tool_choice.function.{k}" for k in shape.extras(function, ("name",)))
    return w.ToolChoice("tool", shape.want_str(function.get("name"), "tool_choice.function.name"))


def _response_format(raw: object, extra_names: list[str]) -> w.ResponseFormat | None:
    if raw is None:
        return None
    fields = shape.want_dict(raw, "response_format")
    kind = shape.want_str(fields.get("type"), "response_format.type")
    if kind not in ("text", "json_object", "json_schema"):
        raise w.WireError("response_format.type", "must be text, json_object or json_schema")
    schema = shape.optional(fields, "json_schema", shape.want_dict, "response_format")
    extra_names.extend(f"response_format.{k}"
                       for k in shape.extras(fields, ("type", "json_schema")))
    if schema is not None:
        extra_names.extend(f"response_format.json_schema.{k}" for k in shape.extras(
            schema, ("name", "schema", "strict", "description")))
    return w.ResponseFormat(kind, schema)


# a body of these fields alone (nearly every one: the messages and a model) has no option to read
_BARE = frozenset({"model", "messages"})


def parse_request(raw: object, headers: Iterable[tuple[str, str]] = (), query: str = "", *,
                  passthrough: bool = True, read: w.ReadBytes | None = None) -> w.Request:
    """A chat completions body (and its request headers) as the canonical request; a body of the
    wrong shape raises WireError naming the field."""
    body = shape.want_dict(raw, "")
    parsed, extra_names = _messages(body, lazy=passthrough)
    kept = (w.Passthrough(_without_relayline_fields(body), client_headers(headers), query, read)
            if passthrough else None)
    if not extra_names and body.keys() <= _BARE:
        # what `_with_options` makes of it, without its eleven absent options looked up and
        # checked one by one (a property test holds the two equal)
        return w.Request(messages=parsed, model=shape.check_model(body.get("model")),
                         source="openai", passthrough=kept)
    return _with_options(body, parsed, extra_names, kept)


def _without_relayline_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as an openai entry gets it: as sent, less the signature and redacted
    thinking relayline gave it for an Anthropic provider, which no chat completions server knows
    (reasoning_content goes as sent)."""
    for message in body["messages"]:  # (a loop: this runs on every request, and finds nothing)
        if "reasoning_signature" in message or "reasoning_redacted" in message:
            break
    else:
        return body
    return {**body, "messages": [{k: v for k, v in m.items() if k not in REASONING_FIELDS[1:]}
                                 for m in body["messages"]]}


def _messages(body: dict[str, Any], *,
              lazy: bool) -> tuple[tuple[w.Message, ...] | w.History, list[str]]:
    """The body's messages, and the names of the fields in them this family alone has. `lazy`:
    the body goes on as sent to an entry of this family, which reads no message: they are all
    checked now, as reading them would, and those of a common shape are read only if something
    asks for them (`wire.History`)."""
    if body.get("n") not in (None, 1):
        raise w.WireError("n", "only n = 1 is supported")
    messages = shape.want_list(body.get("messages"), "messages")
    if not messages:
        raise w.WireError("messages", "must not be empty")
    extra_names: list[str] = []
    if not lazy:
        return tuple([_message(m, i, extra_names) for i, m in enumerate(messages)]), extra_names
    read = {i: _any_message(m, i, extra_names)
            for i, m in enumerate(messages) if not _common(m)}
    return w.History(functools.partial(_history, messages, read)), extra_names


def _history(messages: list[Any], read: dict[int, w.Message]) -> tuple[w.Message, ...]:
    """The messages `_messages` checked: those it read already, the others read now."""
    if not read:
        return tuple([_read_common(m) for m in messages])
    return tuple([read[i] if i in read else _read_common(m) for i, m in enumerate(messages)])


def _stop(raw: object) -> tuple[str, ...]:
    if raw is None:
        return ()
    if isinstance(raw, str):
        return (raw,)
    return tuple(shape.want_str(s, shape.path("stop", i))
                 for i, s in enumerate(shape.want_list(raw, "stop")))


def _tools(body: dict[str, Any], extra_names: list[str]) -> tuple[w.Tool, ...]:
    listed = shape.optional(body, "tools", shape.want_list) or ()
    read = (_function_tool(t) or _tool(t, shape.path("tools", i), extra_names)
            for i, t in enumerate(listed))
    return tuple(t for t in read if t is not None)


_TOOL_FIELDS = frozenset(("type", "function", "cache_control"))
_TOOL_FUNCTION_FIELDS = frozenset(("name", "description", "parameters", "strict"))


def _function_tool(raw: object) -> w.Tool | None:
    """A function tool of a name and, each optional, a description, a parameters schema, strict
    and a caching hint, as the general path reads it; None for any other shape. An agent sends
    20 to 40 of them on every turn."""
    if type(raw) is not dict or not raw.keys() <= _TOOL_FIELDS:
        return None
    function, cache = raw.get("function"), raw.get("cache_control")
    if (raw.get("type", "function") != "function" or type(function) is not dict
            or not function.keys() <= _TOOL_FUNCTION_FIELDS
            or (cache is not None and type(cache) is not dict)):
        return None
    name, description = function.get("name"), function.get("description")
    parameters, strict = function.get("parameters"), function.get("strict")
    if (type(name) is not str or (description is not None and type(description) is not str)
            or (parameters is not None and type(parameters) is not dict)
            or (strict is not None and type(strict) is not bool)):
        return None
    schema = parameters if parameters is not None else {"type": "object"}
    return w.Tool(name, description or "", schema, bool(strict), cache)


def _with_options(body: dict[str, Any], parsed: tuple[w.Message, ...] | w.History,
                  extra_names: list[str], passthrough: w.Passthrough | None) -> w.Request:
    stop = _stop(body.get("stop"))
    tools = _tools(body, extra_names)
    tool_choice = _tool_choice(body.get("tool_choice"), extra_names)
    response_format = _response_format(body.get("response_format"), extra_names)
    options = shape.optional(body, "stream_options", shape.want_dict) or {}
    extra_names.extend(f"stream_options.{k}" for k in shape.extras(options, ("include_usage",)))
    effort = shape.optional(body, "reasoning_effort", shape.want_str)
    if effort == "":
        raise w.WireError("reasoning_effort",
                          "is empty: name an effort (low, medium, high...) or leave it out")
    max_tokens = _max_tokens(body)
    extra = {k: body[k] for k in shape.extras(body, KNOWN)}
    extra.update({name: None for name in extra_names})
    return w.Request(
        messages=parsed,
        model=shape.check_model(body.get("model")),
        stream=bool(shape.optional(body, "stream", shape.want_bool)),
        include_usage=bool(shape.optional(options, "include_usage", shape.want_bool,
                                          "stream_options")),
        max_tokens=max_tokens,
        temperature=shape.optional(body, "temperature", shape.want_number, "", 0, 2),
        top_p=shape.optional(body, "top_p", shape.want_number, "", 0, 1),
        stop=stop,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=shape.optional(body, "parallel_tool_calls", shape.want_bool),
        response_format=response_format,
        reasoning=w.Reasoning(effort=effort) if effort else None,
        user=shape.optional(body, "user", shape.want_str),
        extra=extra,
        source="openai",
        passthrough=passthrough,
    )
