"""OpenAI's Responses API (`POST /v1/responses`) as a client dialect: its body read into the
canonical request, and the canonical result rendered as a `response` object or as the Responses
event stream (docs/wire.md, "The Responses API").

relayline stores no responses. What only a provider that keeps them can honour (`store: true`,
`previous_response_id`, `conversation`, background runs) is named as the family's own field, so
an entry that cannot serve it is skipped as `unsupported`. Built-in tools (web search, file
search, code interpreter...) run on OpenAI's side: an entry that cannot run them does not offer
them to the model, and the gateway names them in `x-relayline-dropped`; a `tool_choice` that
forces one makes the entry `unsupported` instead. Hints that carry no content
(`prompt_cache_key`, `client_metadata`, `include`, unknown top-level fields) are left out.
"""

from __future__ import annotations

import os
import time
from typing import Any

from relayline.machines import wire as w
from relayline.machines.ledger import Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from .. import jsoncodec
from . import shape
from .common import ERRORS, UNKNOWN_ERROR, ToolIds, answer_tools, client_headers, data_url
from .responses_replies import ENCRYPTED

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

# Responses status for a canonical finish reason that cuts an answer short
INCOMPLETE = {w.LENGTH: "max_output_tokens", w.CONTENT_FILTER: "content_filter"}


# -- requests: Responses body -> canonical ------------------------------------------------------------


class _Reader:
    """One body's reading: the canonical messages so far, the family-own field names, and the
    built-in tools withdrawn."""

    def __init__(self) -> None:
        self.messages: list[w.Message] = []
        self.extra: dict[str, Any] = {}
        self.withdrawn: list[str] = []
        self.thinking: list[w.Part] = []  # reasoning items sent back, for the assistant turn they open

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

    def add_reasoning(self, raw: dict, param: str) -> None:
        """A reasoning item sent back: its summary, signed, when relayline's token carries the
        signature its provider gave; anything else is left out, as reasoning from history is."""
        token = raw.get("encrypted_content")
        if isinstance(token, str) and token.startswith(TOKEN):
            summary = shape.optional(raw, "summary", shape.want_list, param) or []
            text = "".join(s.get("text", "") for s in summary if isinstance(s, dict))
            self.thinking.append(w.Part(w.THINKING, text, signature=token[len(TOKEN):]))


def _text_part(raw: dict, param: str, field: str = "text") -> w.Part:
    return w.Part(w.TEXT, shape.want_str(raw.get(field), shape.path(param, field)))


def _image_part(raw: dict, param: str, reader: _Reader) -> w.Part:
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


def _file_part(raw: dict, param: str, reader: _Reader) -> w.Part:
    if raw.get("file_data") is not None:
        data = data_url(shape.want_str(raw["file_data"], shape.path(param, "file_data")))
        if data is None:
            raise w.WireError(shape.path(param, "file_data"), "expected a base64 data: URL")
        return w.Part(w.DOCUMENT, data=data[1], media_type=data[0])
    if raw.get("file_url") is not None:
        return w.Part(w.DOCUMENT, url=shape.want_str(raw["file_url"], shape.path(param, "file_url")))
    reader.own("document.source.file_id")
    return w.Part(w.DOCUMENT)


def _part(raw, param: str, reader: _Reader) -> w.Part | None:
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


def _content(raw, param: str, reader: _Reader) -> tuple[w.Part, ...]:
    if isinstance(raw, str):
        return (w.Part(w.TEXT, raw),) if raw else ()
    parts = (_part(p, shape.path(param, i), reader) for i, p in enumerate(shape.want_list(raw, param)))
    return tuple(p for p in parts if p is not None)


_ROLES = {"system": w.SYSTEM, "developer": w.SYSTEM, "user": w.USER, "assistant": w.ASSISTANT}


def _message_item(raw: dict, param: str, reader: _Reader) -> None:
    role = shape.want_str(raw.get("role"), shape.path(param, "role"))
    if role not in _ROLES:
        raise w.WireError(shape.path(param, "role"), "must be one of system, developer, user, assistant")
    content = _content(raw.get("content"), shape.path(param, "content"), reader)
    if _ROLES[role] == w.ASSISTANT and reader.messages and reader.messages[-1].role == w.ASSISTANT \
            and not reader.messages[-1].tool_calls and not reader.thinking:
        last = reader.messages[-1]  # an answer in several message items: one assistant turn
        reader.messages[-1] = w.Message(w.ASSISTANT, (*last.content, *content))
        return
    reader.add(w.Message(_ROLES[role], content))


def _call_item(raw: dict, param: str, reader: _Reader) -> None:
    arguments = raw.get("arguments")
    reader.add_call(w.ToolCall(shape.want_str(raw.get("call_id"), shape.path(param, "call_id")),
                               shape.want_str(raw.get("name"), shape.path(param, "name")),
                               "{}" if arguments is None else shape.want_str(arguments, shape.path(param, "arguments"))))


def _output_item(raw: dict, param: str, reader: _Reader) -> None:
    call_id = shape.want_str(raw.get("call_id"), shape.path(param, "call_id"))
    output = raw.get("output")
    content = _content("" if output is None else output, shape.path(param, "output"), reader)
    reader.add(w.Message(w.TOOL, content, tool_call_id=call_id))


def _input(body: dict, reader: _Reader) -> None:
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


def _function(raw: dict, param: str) -> w.Tool:
    parameters = shape.optional(raw, "parameters", shape.want_dict, param)
    return w.Tool(shape.want_str(raw.get("name"), shape.path(param, "name")),
                  shape.optional(raw, "description", shape.want_str, param) or "",
                  parameters if parameters is not None else {"type": "object"},
                  strict=bool(shape.optional(raw, "strict", shape.want_bool, param)))


def _tools(body: dict, reader: _Reader) -> tuple[w.Tool, ...]:
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
                    reader.withdrawn.append(f"tools.{NAMESPACE}.{shape.want_str(tool.get('type'), shape.path(where, 'type'))}")
        else:
            reader.withdrawn.append(f"tools.{kind}")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        reader.own("tools.namespace")  # two functions of one name: flattening them would not be exact
    return tuple(tools)


def _tool_choice(raw, reader: _Reader) -> w.ToolChoice | None:
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


def _text_format(body: dict) -> w.ResponseFormat | None:
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


def _reasoning(body: dict) -> w.Reasoning | None:
    raw = shape.optional(body, "reasoning", shape.want_dict) or {}
    effort = shape.optional(raw, "effort", shape.want_str, "reasoning")
    return None if effort in (None, "none") else w.Reasoning(effort=effort)


def _own_fields(body: dict, reader: _Reader) -> None:
    for name in (*STORED, *UNTRANSLATED):
        if name in shape.extras({name: body.get(name)}, ()):
            reader.own(name, body[name])
    if body.get("truncation") not in (None, "disabled"):
        reader.own("truncation", body["truncation"])


def parse_request(body, headers=(), query: str = "", *, passthrough: bool = True) -> w.Request:
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
    shape.optional(body, "metadata", shape.want_dict)  # echoed in the response object; never sent upstream
    user = shape.optional(body, "user", shape.want_str) or shape.optional(body, "safety_identifier", shape.want_str)
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
        passthrough=w.Passthrough(body, client_headers(headers), query) if passthrough else None,
    )


# -- replies: canonical -> Responses ---------------------------------------------------------------


def usage(usage: Usage | None) -> dict:
    usage = usage or Usage()
    prompt = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage.cache_read_tokens,
                                     "cache_write_tokens": usage.cache_write_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": prompt + usage.output_tokens}


def new_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


def namespaces(request: w.Request | None) -> dict[str, str]:
    """Each flattened function's namespace, by the function's name: a call the model makes to
    it goes back to the client under its namespace, as the client offered it."""
    body = request.passthrough.body if request is not None and request.passthrough is not None else {}
    out: dict[str, str] = {}
    for tool in body.get("tools") or ():
        if isinstance(tool, dict) and tool.get("type") == NAMESPACE:
            for inner in tool.get("tools") or ():
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    out[inner["name"]] = str(tool.get("name"))
    return out


def _call_item_out(item_id: str, call_id: str, name: str, arguments: str, space: str | None, status: str) -> dict:
    item = {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}
    return item | ({"namespace": space} if space else {})


def _message_out(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "in_progress" else []}


def _reasoning_out(item_id: str, text: str, signature: str = "") -> dict:
    # the signature an Anthropic provider gave its thinking travels as relayline's opaque token;
    # a Responses provider's own encrypted content, as it sent it
    token = signature[len(ENCRYPTED):] if signature.startswith(ENCRYPTED) else TOKEN + signature if signature else None
    return {"id": item_id, "type": "reasoning", "summary": [{"type": "summary_text", "text": text}] if text else [],
            "encrypted_content": token}


def _envelope(response_id: str, created: int, model: str, request: w.Request | None, status: str) -> dict:
    """The response object's fields that echo the request, as OpenAI's does."""
    body = request.passthrough.body if request is not None and request.passthrough is not None else {}
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"), "max_output_tokens":
            body.get("max_output_tokens"), "model": model, "output": [], "parallel_tool_calls":
            body.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {"effort": None},
            "store": False, "temperature": body.get("temperature"), "text": {"format": {"type": "text"}} | text,
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p"), "truncation": "disabled", "usage": None, "user": body.get("user"),
            "metadata": body.get("metadata") or {}}


def _finished(envelope: dict, result: TurnResult, tools: int) -> dict:
    reason = INCOMPLETE.get(w.finish_reason(result.finish_reason, tools))
    envelope["status"] = "incomplete" if reason else "completed"
    envelope["incomplete_details"] = {"reason": reason} if reason else None
    envelope["usage"] = usage(result.usage)
    return envelope


def response_object(turn_id: str, result: TurnResult, relayline: dict, request: w.Request | None = None) -> dict:
    """A whole answer as the Responses API's `response` object."""
    tools = _tools_of(result)
    status = "incomplete" if INCOMPLETE.get(w.finish_reason(result.finish_reason, len(tools))) else "completed"
    output: list[dict] = []
    if result.reasoning:
        signed = [b.get("signature") for b in result.blocks if b.get("type") == w.THINKING]
        output.append(_reasoning_out(new_id("rs"), result.reasoning, signed[0] if len(signed) == 1 else ""))
    if result.text or not result.tool_calls:
        output.append(_message_out(new_id("msg"), result.text or "", status))
    spaces = namespaces(request)
    output += [_call_item_out(new_id("fc"), i, n, a, spaces.get(n), status) for i, n, a in tools]
    if _passed_through(request, result):
        output = [dict(item) for item in result.blocks]  # the provider's own items, as it sent them
    envelope = _envelope(turn_id, int(time.time()), result.served.model if result.served else "", request,
                         "completed")
    envelope["output"] = output
    return _finished(envelope, result, len(tools)) | {"relayline": relayline}


def _passed_through(request: w.Request | None, result: TurnResult) -> bool:
    """Whether the answer came from a provider that speaks the Responses API itself."""
    served = result.served
    return bool(result.blocks) and request is not None and served is not None and w.passes_through(
        request, served.provider.family, served.provider.capabilities)


def _tools_of(result: TurnResult) -> list[tuple[str, str, str]]:
    return answer_tools(result, ToolIds("call_")) if result.tool_calls else []


# stand-ins for a text delta event's two varying values, cut out of its rendered bytes
_SEQ, _SLOT = "\x00relayline-sequence\x00", "\x00relayline-slot\x00"
_SEQ_JSON, _SLOT_JSON = jsoncodec.dumps(_SEQ), jsoncodec.dumps(_SLOT)


def _sse(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + jsoncodec.dumps(obj) + b"\n\n"


class ResponsesStream:
    """The Responses event sequence for one answer. Output items open as the event kinds
    change (reasoning, a message, each function call) and are closed, each with its `.done`
    events, before the next opens; every event carries the stream's next sequence number."""

    __slots__ = ("response_id", "request", "created", "model", "sequence", "output", "item", "text", "ids",
                 "spaces", "calls", "signature", "slotted")

    def __init__(self, response_id: str, request: w.Request) -> None:
        self.response_id = response_id
        self.request = request
        self.created = int(time.time())
        self.model = ""
        self.sequence = 0
        self.output: list[dict] = []  # the items done so far, for the final response object
        self.item: dict | None = None  # the open item
        self.text: list[str] = []  # the open item's text or arguments so far
        self.ids = ToolIds("call_")
        self.spaces = namespaces(request)
        self.calls = 0
        self.signature = ""
        self.slotted: tuple[str, bytes, bytes, bytes] = ("", b"", b"", b"")  # the open message's delta, cut

    def _text_delta(self, delta: str) -> bytes:
        """A text delta event: nearly every frame of a stream. Its bytes are cut once per item
        around its two varying values, the sequence number and the delta, and the frame writes
        those alone; the bytes are those of `_event` rendering the whole event."""
        assert self.item is not None  # (a text delta is written into the open message)
        if self.slotted[0] != self.item["id"]:
            head, _, rest = self._event_bytes("response.output_text.delta", _SEQ, item_id=self.item["id"],
                                              output_index=self._index(), content_index=0, delta=_SLOT,
                                              logprobs=[]).partition(_SEQ_JSON)
            middle, _, tail = rest.partition(_SLOT_JSON)
            self.slotted = (self.item["id"], head, middle, tail)
        _, head, middle, tail = self.slotted
        sequence, self.sequence = self.sequence, self.sequence + 1
        return head + str(sequence).encode() + middle + jsoncodec.dumps(delta) + tail

    @staticmethod
    def _event_bytes(kind: str, sequence: object, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": sequence, **fields})

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = self._event_bytes(kind, self.sequence, **fields)
        self.sequence += 1
        return out

    def _envelope(self, status: str) -> dict:
        envelope = _envelope(self.response_id, self.created, self.model, self.request, status)
        envelope["output"] = list(self.output)
        return envelope

    def opening(self, model: str, usage: Usage | None = None) -> bytes:
        self.model = model
        return (self._event("response.created", response=self._envelope("in_progress"))
                + self._event("response.in_progress", response=self._envelope("in_progress")))

    # -- items

    def _index(self) -> int:
        return len(self.output)

    def _open(self, item: dict) -> bytes:
        out = self._close()
        self.item, self.text = item, []
        out += self._event("response.output_item.added", output_index=self._index(), item=item)
        if item["type"] == "message":
            out += self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                               content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []})
        elif item["type"] == "reasoning":
            out += self._event("response.reasoning_summary_part.added", item_id=item["id"],
                               output_index=self._index(), summary_index=0, part={"type": "summary_text", "text": ""})
        return out

    def _close(self, status: str = "completed") -> bytes:
        item = self.item
        if item is None:
            return b""
        self.item = None
        text, index, out = "".join(self.text), self._index(), b""
        if item["type"] == "message":
            done = _message_out(item["id"], text, status)
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        elif item["type"] == "reasoning":
            done, self.signature = _reasoning_out(item["id"], text, self.signature), ""
            out += self._event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                               summary_index=0, text=text)
            out += self._event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                               summary_index=0, part={"type": "summary_text", "text": text})
        else:
            done = item | {"arguments": text or "{}", "status": status}
            out += self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=text or "{}")
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def event(self, event: Event) -> bytes:
        kind = event.kind
        if kind == "text":
            out = b"" if self.item is not None and self.item["type"] == "message" else self._open(
                _message_out(new_id("msg"), "", "in_progress"))
            self.text.append(event.value)
            return out + self._text_delta(event.value)
        if kind == "reasoning":
            if event.ref:  # the signature of the thinking just shown
                self.signature = event.ref
                return b""
            out = b"" if self.item is not None and self.item["type"] == "reasoning" else self._open(
                {"id": new_id("rs"), "type": "reasoning", "summary": []})
            self.text.append(event.value)
            return out + self._event("response.reasoning_summary_text.delta", item_id=self.item["id"],
                                     output_index=self._index(), summary_index=0, delta=event.value)
        if kind == "tool":
            self.calls += 1
            return self._open(_call_item_out(new_id("fc"), self.ids(event.ref), event.value, "",
                                             self.spaces.get(event.value), "in_progress"))
        if kind == "tool_args" and self.item is not None and self.item["type"] == "function_call":
            self.text.append(event.value)
            return self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                               output_index=self._index(), delta=event.value)
        return b""  # provider-executed tool work has no event here; it shows in the ledger

    def ok(self, result: TurnResult, relayline: dict) -> bytes:
        if result.served is not None:
            self.model = result.served.model
        reason = INCOMPLETE.get(w.finish_reason(result.finish_reason, self.calls))
        out = self._close("incomplete" if reason else "completed")
        envelope = _finished(self._envelope("completed"), result, self.calls)
        kind = "response.incomplete" if reason else "response.completed"
        return out + self._event(kind, response=envelope | {"relayline": relayline})

    def failed(self, result: TurnResult, relayline: dict) -> bytes:
        # after commit: the answer so far stays as sent, and the response says it failed
        out = self._close("incomplete")
        _, _, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        envelope = self._envelope("failed")
        envelope["error"] = {"code": code or "server_error", "message": result.message or "failed"}
        envelope["usage"] = usage(result.usage)
        return out + self._event("response.failed", response=envelope | {"relayline": relayline})

