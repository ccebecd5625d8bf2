"""OpenAI's Responses API (`POST /v1/responses`) as a client dialect: its body read into the
canonical request (the answers, a `response` object or the Responses event stream, are
codecs/responses_answers.py; docs/wire.md, "The Responses API").

relayline stores no responses. What only a provider that keeps them can honour (`store: true`,
`previous_response_id`, `conversation`, background runs) is named as the family's own field, so
an entry that cannot serve it is skipped as `unsupported`. Built-in tools (web search, file
search, code interpreter...) run on OpenAI's side: an entry that cannot run them does not offer
them to the model, and the gateway names them in `x-relayline-dropped`; a `tool_choice` that
forces one makes the entry `unsupported` instead. Hints that carry no content
(`prompt_cache_key`, `client_metadata`, `include`) are left out; other top-level fields
relayline does not know are left out too, named as built-in tools are.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relayline.machines import wire as w

from . import shape
from .common import client_headers, data_url

# top-level fields only a provider that stores responses, or runs them in the background, can serve
STORED = ("store", "previous_response_id", "conversation", "background")
# top-level fields with a meaning no family translation keeps: named, so the entry is skipped
UNTRANSLATED = ("top_logprobs", "max_tool_calls", "prompt")
# the tool kinds that are functions the client runs; any other kind runs on the provider's side
FUNCTION = "function"
NAMESPACE = "namespace"

# a reasoning item's encrypted_content when relayline made it: the signature an Anthropic provider
# gave its thinking, so the thinking can go back to it on the next turn
TOKEN = "relayline-signature."

# -- requests: Responses body -> canonical -------------------------------------------------------


class _Reader:
    """One body's reading: the canonical messages so far, the family-own field names, and the
    built-in tools withdrawn."""

    def __init__(self) -> None:
        self.messages: list[w.Message] = []
        self.extra: dict[str, Any] = {}
        self.withdrawn: list[str] = []
        # reasoning items sent back, for the assistant turn they open
        self.thinking: list[w.Part] = []

    def own(self, name: str, value: Any = None) -> None:
        self.extra.setdefault(name, value)

    def add(self, message: w.Message) -> None:
        if message.role == w.ASSISTANT and self.thinking:
            message = w.Message(w.ASSISTANT, (*self.thinking, *message.content), message.tool_calls)
        self.thinking = []
        self.messages.append(message)

    def add_call(self, call: w.ToolCall) -> None:
        """A function_call item: joined to the assistant message it follows (the model said
        some text and then called), as a chat completions assistant message holds both."""
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == w.ASSISTANT and not self.thinking:
            self.messages[-1] = w.Message(w.ASSISTANT, last.content, (*last.tool_calls, call))
        else:
            self.add(w.Message(w.ASSISTANT, (), (call,)))

    def add_reasoning(self, raw: dict[str, Any], param: str) -> None:
        """A reasoning item sent back: its summary, signed, when relayline's token carries the
        signature its provider gave; anything else is left out, as reasoning from history is."""
        token = raw.get("encrypted_content")
        if isinstance(token, str) and token.startswith(TOKEN):
            summary = shape.optional(raw, "summary", shape.want_list, param) or []
            text = "".join(s.get("text", "") for s in summary if isinstance(s, dict))
            self.thinking.append(w.Part(w.THINKING, text, signature=token[len(TOKEN):]))


def _text_part(raw: dict[str, Any], param: str, field: str = "text") -> w.Part:
    return w.Part(w.TEXT, shape.want_str(raw.get(field), shape.path(param, field)))


def _image_part(raw: dict[str, Any], param: str, reader: _Reader) -> w.Part:
    if raw.get("file_id") is not None:
        reader.own("image.source.file_id")  # (content: an image only OpenAI's file store holds)
        return w.Part(w.IMAGE)
    url = shape.want_str(raw.get("image_url"), shape.path(param, "image_url"))
    detail = raw.get("detail")
    extra = ("input_image.detail",) if detail not in (None, "auto") else ()
    reader.extra.update(dict.fromkeys(extra))
    data = data_url(url)
    if data is not None:
        return w.Part(w.IMAGE, data=data[1], media_type=data[0], extra=extra)
    return w.Part(w.IMAGE, url=url, extra=extra)


def _file_part(raw: dict[str, Any], param: str, reader: _Reader) -> w.Part:
    if raw.get("file_data") is not None:
        data = data_url(shape.want_str(raw["file_data"], shape.path(param, "file_data")))
        if data is None:
            raise w.WireError(shape.path(param, "file_data"), "expected a base64 data: URL")
        return w.Part(w.DOCUMENT, data=data[1], media_type=data[0])
    if raw.get("file_url") is not None:
        url = shape.want_str(raw["file_url"], shape.path(param, "file_url"))
        return w.Part(w.DOCUMENT, url=url)
    reader.own("document.source.file_id")
    return w.Part(w.DOCUMENT)


def _part(raw: object, param: str, reader: _Reader) -> w.Part | None:
    raw = shape.want_dict(raw, param)
    kind = shape.want_str(raw.get("type"), shape.path(param, "type"))
    if kind in ("input_text", "output_text", "text"):
        return _text_part(raw, param)
    if kind == "refusal":  # an earlier answer's refusal, echoed back in history: its words
        return _text_part(raw, param, "refusal")
    if kind == "input_image":
        return _image_part(raw, param, reader)
    if kind == "input_file":
        return _file_part(raw, param, reader)
    reader.own(f"content.{kind}")  # (content: a part this dialect alone has)
    return None


def _content(raw: object, param: str, reader: _Reader) -> tuple[w.Part, ...]:
    if isinstance(raw, str):
        return (w.Part(w.TEXT, raw),) if raw else ()
    parts = (_part(p, shape.path(param, i), reader)
             for i, p in enumerate(shape.want_list(raw, param)))
    return tuple(p for p in parts if p is not None)


_ROLES = {"system": w.SYSTEM, "developer": w.SYSTEM, "user": w.USER, "assistant": w.ASSISTANT}


def _message_item(raw: dict[str, Any], param: str, reader: _Reader) -> None:
    role = shape.want_str(raw.get("role"), shape.path(param, "role"))
    if role not in _ROLES:
        raise w.WireError(shape.path(param, "role"),
                          "must be one of system, developer, user, assistant")
    content = _content(raw.get("content"), shape.path(param, "content"), reader)
    if _ROLES[role] == w.ASSISTANT and reader.messages and reader.messages[-1].role == w.ASSISTANT \
            and not reader.messages[-1].tool_calls and not reader.thinking:
        last = reader.messages[-1]  # an answer in several message items: one assistant turn
        reader.messages[-1] = w.Message(w.ASSISTANT, (*last.content, *content))
        return
    reader.add(w.Message(_ROLES[role], content))


def _call_item(raw: dict[str, Any], param: str, reader: _Reader) -> None:
    arguments = raw.get("arguments")
    reader.add_call(w.ToolCall(shape.want_str(raw.get("call_id"), shape.path(param, "call_id")),
                               shape.want_str(raw.get("name"), shape.path(param, "name")),
                               "{}" if arguments is None
                               else shape.want_str(arguments, shape.path(param, "arguments"))))


def _output_item(raw: dict[str, Any], param: str, reader: _Reader) -> None:
    call_id = shape.want_str(raw.get("call_id"), shape.path(param, "call_id"))
    output = raw.get("output")
    content = _content("" if output is None else output, shape.path(param, "output"), reader)
    reader.add(w.Message(w.TOOL, content, tool_call_id=call_id))


def _input(body: dict[str, Any], reader: _Reader) -> None:
    raw = body.get("input")
    if isinstance(raw, str):
        reader.add(w.Message(w.USER, (w.Part(w.TEXT, raw),)))
        return
    for index, item in enumerate(shape.want_list(raw, "input")):
        param = shape.path("input", index)
        item = shape.want_dict(item, param)
        kind = item.get("type", "message")
        if kind == "message":
            _message_item(item, param, reader)
        elif kind == "function_call":
            _call_item(item, param, reader)
        elif kind == "function_call_output":
            _output_item(item, param, reader)
        elif kind == "reasoning":
            reader.add_reasoning(item, param)
        else:
            # any other item (a built-in tool's call, an item_reference) is something only the
            # API that made it can read
            reader.own(f"content.{shape.want_str(kind, shape.path(param, 'type'))}")
    if not reader.messages:
        raise w.WireError("input", "must not be empty")


def _function(raw: dict[str, Any], param: str) -> w.Tool:
    parameters = shape.optional(raw, "parameters", shape.want_dict, param)
    return w.Tool(shape.want_str(raw.get("name"), shape.path(param, "name")),
                  shape.optional(raw, "description", shape.want_str, param) or "",
                  parameters if parameters is not None else {"type": "object"},
                  strict=bool(shape.optional(raw, "strict", shape.want_bool, param)))


def _tools(body: dict[str, Any], reader: _Reader) -> tuple[w.Tool, ...]:
    tools: list[w.Tool] = []
    for index, raw in enumerate(shape.optional(body, "tools", shape.want_list) or ()):
        param = shape.path("tools", index)
        raw = shape.want_dict(raw, param)
        kind = shape.want_str(raw.get("type"), shape.path(param, "type"))
        if kind == FUNCTION:
            tools.append(_function(raw, param))
        elif kind == NAMESPACE:
            inner = shape.want_list(raw.get("tools"), shape.path(param, "tools"))
            for i, tool in enumerate(inner):
                where = shape.path(shape.path(param, "tools"), i)
                tool = shape.want_dict(tool, where)
                if tool.get("type") == FUNCTION:
                    tools.append(_function(tool, where))
                else:
                    inner_type = shape.want_str(tool.get("type"), shape.path(where, "type"))
                    reader.withdrawn.append(f"tools.{NAMESPACE}.{inner_type}")
        else:
            reader.withdrawn.append(f"tools.{kind}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        # two functions of one name: flattening them would not be exact
        reader.own("tools.namespace")
    return tuple(tools)


def _tool_choice(raw: object, reader: _Reader) -> w.ToolChoice | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise w.WireError("tool_choice", "must be auto, none, required or an object")
        return w.ToolChoice(raw)
    raw = shape.want_dict(raw, "tool_choice")
    kind = shape.want_str(raw.get("type"), "tool_choice.type")
    if kind == FUNCTION:
        return w.ToolChoice("tool", shape.want_str(raw.get("name"), "tool_choice.name"))
    reader.own("tool_choice", kind)  # a built-in tool, custom tool or allowed list, forced
    return None


def _text_format(body: dict[str, Any]) -> w.ResponseFormat | None:
    text = shape.optional(body, "text", shape.want_dict) or {}
    raw = shape.optional(text, "format", shape.want_dict, "text")
    if raw is None:
        return None
    kind = shape.want_str(raw.get("type"), "text.format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return w.ResponseFormat("json_object")
    if kind != "json_schema":
        raise w.WireError("text.format.type", "must be text, json_object or json_schema")
    schema = shape.want_dict(raw.get("schema"), "text.format.schema")
    # chat completions' json_schema object: the same fields, one level down
    spec = {"name": shape.want_str(raw.get("name"), "text.format.name"), "schema": schema}
    spec.update({k: raw[k] for k in ("description", "strict") if raw.get(k) is not None})
    return w.ResponseFormat("json_schema", spec)


def _reasoning(body: dict[str, Any]) -> w.Reasoning | None:
    raw = shape.optional(body, "reasoning", shape.want_dict) or {}
    effort = shape.optional(raw, "effort", shape.want_str, "reasoning")
    return None if effort in (None, "none") else w.Reasoning(effort=effort)


# every top-level field relayline reads, or leaves out knowingly (a hint with no content); any
# other is named as withdrawn, so a translating entry's answer says it was left out
KNOWN = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
         "stream", "max_output_tokens", "temperature", "top_p", "text", "reasoning", "user",
         "safety_identifier", "metadata", "truncation", *STORED, *UNTRANSLATED,
         "prompt_cache_key", "prompt_cache_retention", "client_metadata", "include",
         "service_tier", "stream_options")


def _own_fields(body: dict[str, Any], reader: _Reader) -> None:
    reader.withdrawn.extend(name for name in body if name not in KNOWN)
    for name in (*STORED, *UNTRANSLATED):
        if name in shape.extras({name: body.get(name)}, ()):
            reader.own(name, body[name])
    if body.get("truncation") not in (None, "disabled"):
        reader.own("truncation", body["truncation"])


def parse_request(body: object, headers: Iterable[tuple[str, str]] = (), query: str = "", *,
                  passthrough: bool = True, read: w.ReadBytes | None = None) -> w.Request:
    """A Responses body (and its request headers) as the canonical request; a body of the wrong
    shape raises WireError naming the field."""
    body = shape.want_dict(body, "")
    reader = _Reader()
    instructions = shape.optional(body, "instructions", shape.want_str)
    if instructions:
        reader.add(w.Message(w.SYSTEM, (w.Part(w.TEXT, instructions),)))
    _input(body, reader)
    tools = _tools(body, reader)
    tool_choice = _tool_choice(body.get("tool_choice"), reader)
    _own_fields(body, reader)
    # echoed in the response object; never sent upstream
    shape.optional(body, "metadata", shape.want_dict)
    user = shape.optional(body, "user", shape.want_str) \
        or shape.optional(body, "safety_identifier", shape.want_str)
    return w.Request(
        messages=tuple(reader.messages),
        model=shape.check_model(body.get("model")),
        stream=bool(shape.optional(body, "stream", shape.want_bool)),
        max_tokens=shape.optional(body, "max_output_tokens", shape.want_int, "", 1),
        temperature=shape.optional(body, "temperature", shape.want_number, "", 0, 2),
        top_p=shape.optional(body, "top_p", shape.want_number, "", 0, 1),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=shape.optional(body, "parallel_tool_calls", shape.want_bool),
        response_format=_text_format(body),
        reasoning=_reasoning(body),
        user=user,
        extra=reader.extra,
        withdrawn=tuple(dict.fromkeys(reader.withdrawn)),
        source=w.RESPONSES,
        passthrough=(w.Passthrough(body, client_headers(headers), query, read) if passthrough
                     else None),
    )


def render_request(sent: w.Passthrough, model: str, stream: bool) -> dict[str, Any]:
    """The body for an openai profile that serves the Responses API itself: the client's own
    (`sent`), as sent, with the entry's model and `stream`."""
    return {**sent.body, "model": model, "stream": stream}
