"""OpenAI's Responses API answers: the canonical result written as a `response` object, or as
the Responses event stream, the fields that echo the request taken from the client's body as
OpenAI's do.
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
from .common import ERRORS, SLOT, SLOT_JSON, UNKNOWN_ERROR, ToolIds, answer_tools
from .responses import NAMESPACE, TOKEN
from .responses_replies import CITATIONS, ENCRYPTED, ITEM

# Responses status for a canonical finish reason that cuts an answer short
INCOMPLETE = {w.LENGTH: "max_output_tokens", w.CONTENT_FILTER: "content_filter"}


def usage(usage: Usage | None) -> dict[str, Any]:
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
    body = (
        request.passthrough.body if request is not None and request.passthrough is not None else {}
    )
    out: dict[str, str] = {}
    for tool in body.get("tools") or ():
        if isinstance(tool, dict) and tool.get("type") == NAMESPACE:
            for inner in tool.get("tools") or ():
                if isinstance(inner, dict) and isinstance(inner.get("name"), str):
                    out[inner["name"]] = str(tool.get("name"))
    return out


def _call_item_out(item_id: str, call_id: str, name: str, arguments: str, space: str | None,
                   status: str) -> dict[str, Any]:
    item = {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name,
            "arguments": arguments}
    return item | ({"namespace": space} if space else {})


def _message_out(item_id: str, text: str, status: str,
                 annotations: list[Any] | None = None) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": annotations or [],
                         "logprobs": []}]
            if text or status == "in_progress" else []}


def _reasoning_out(item_id: str, text: str, signature: str = "") -> dict[str, Any]:
    # the signature an Anthropic provider gave its thinking travels as relayline's opaque token;
    # a Responses provider's own encrypted content, as it sent it
    token = (
        signature[len(ENCRYPTED) :]
        if signature.startswith(ENCRYPTED)
        else TOKEN + signature
        if signature
        else None
    )
    return {"id": item_id, "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}] if text else [],
            "encrypted_content": token}


def _envelope(response_id: str, created: int, model: str, request: w.Request | None, status: str,
              kept: bool = False) -> dict[str, Any]:
    """The response object's fields that echo the request, as OpenAI's does. `kept`: a provider
    that keeps answers served it, so `store` and `previous_response_id` are what it honoured."""
    body = (
        request.passthrough.body if request is not None and request.passthrough is not None else {}
    )
    text: dict[str, Any] = body["text"] if isinstance(body.get("text"), dict) else {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id") if kept else None,
        "reasoning": body.get("reasoning")
        if isinstance(body.get("reasoning"), dict)
        else {"effort": None},
        "store": body.get("store", True) is not False if kept else False,
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}} | text,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def _finished(envelope: dict[str, Any], result: TurnResult, tools: int) -> dict[str, Any]:
    reason = INCOMPLETE.get(w.finish_reason(result.finish_reason, tools))
    envelope["status"] = "incomplete" if reason else "completed"
    envelope["incomplete_details"] = {"reason": reason} if reason else None
    envelope["usage"] = usage(result.usage)
    return envelope


def response_object(turn_id: str, result: TurnResult, relayline: dict[str, Any] | None,
                    request: w.Request | None = None) -> dict[str, Any]:
    """A whole answer as the Responses API's `response` object (with the gateway's `relayline`
    field when given)."""
    tools = _tools_of(result)
    finish = w.finish_reason(result.finish_reason, len(tools))
    status = "incomplete" if INCOMPLETE.get(finish) else "completed"
    output: list[dict[str, Any]] = []
    if result.reasoning:
        signed = [b.get("signature") or "" for b in result.blocks if b.get("type") == w.THINKING]
        output.append(_reasoning_out(new_id("rs"), result.reasoning,
                                     signed[0] if len(signed) == 1 else ""))
    if result.text or not result.tool_calls:
        output.append(_message_out(new_id("msg"), result.text or "", status))
    spaces = namespaces(request)
    output += [_call_item_out(new_id("fc"), i, n, a, spaces.get(n), status) for i, n, a in tools]
    kept = _passed_through(request, result)
    if kept:
        output = [dict(item) for item in result.blocks]  # the provider's own items, as it sent them
    # the provider's id, when it keeps answers: the one its previous_response_id knows
    envelope = _envelope(result.response_id or turn_id if kept else turn_id, int(time.time()),
                         result.served.model if result.served else "", request, "completed", kept)
    envelope["output"] = output
    return _finished(envelope, result,
                     len(tools)) | ({"relayline": relayline} if relayline is not None else {})


def _passed_through(request: w.Request | None, result: TurnResult) -> bool:
    """Whether the answer came from a provider that speaks the Responses API itself."""
    served = result.served
    return bool(result.blocks) and request is not None and served is not None and w.passes_through(
        request, served.provider.family, served.provider.capabilities)


def _tools_of(result: TurnResult) -> list[tuple[str, str, str]]:
    return answer_tools(result, ToolIds("call_")) if result.tool_calls else []


# stand-ins for a text delta event's two varying values, cut out of its rendered bytes
_SEQ = "\x00relayline-sequence\x00"
_SEQ_JSON = jsoncodec.dumps(_SEQ)


def _sse(obj: dict[str, Any]) -> bytes:
    kind: str = obj["type"]
    return b"event: " + kind.encode() + b"\ndata: " + jsoncodec.dumps(obj) + b"\n\n"


class ResponsesStream:
    """The Responses event sequence for one answer. Output items open as the event kinds
    change (reasoning, a message, each function call) and are closed, each with its `.done`
    events, before the next opens; every event carries the stream's next sequence number."""

    __slots__ = ("response_id", "request", "created", "model", "sequence", "output", "item", "text",
                 "ids",
                 "spaces", "calls", "signature", "slotted", "kept", "cited")

    def __init__(self, response_id: str, request: w.Request) -> None:
        self.response_id = response_id
        self.request = request
        self.created = int(time.time())
        self.model = ""
        self.sequence = 0
        # the items done so far, for the final response object
        self.output: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open item
        self.text: list[str] = []  # the open item's text or arguments so far
        self.ids = ToolIds("call_")
        self.spaces = namespaces(request)
        self.calls = 0
        self.signature = ""
        # the open message's delta, cut
        self.slotted: tuple[str, bytes, bytes, bytes] = ("", b"", b"", b"")
        self.kept = False  # a provider that keeps answers named this one before the opening
        self.cited: list[Any] = []  # the open message's citations, as its provider gave them

    def _text_delta(self, delta: str) -> bytes:
        """A text delta event: nearly every frame of a stream. Its bytes are cut once per item
        around its two varying values, the sequence number and the delta, and the frame writes
        those alone; the bytes are those of `_event` rendering the whole event."""
        assert self.item is not None  # (a text delta is written into the open message)
        if self.slotted[0] != self.item["id"]:
            head, _, rest = self._event_bytes("response.output_text.delta", _SEQ,
                                              item_id=self.item["id"],
                                              output_index=self._index(), content_index=0,
                                              delta=SLOT,
                                              logprobs=[]).partition(_SEQ_JSON)
            middle, _, tail = rest.partition(SLOT_JSON)
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

    def _envelope(self, status: str) -> dict[str, Any]:
        envelope = _envelope(self.response_id, self.created, self.model, self.request, status,
                             self.kept)
        envelope["output"] = list(self.output)
        return envelope

    def opening(self, model: str, usage: Usage | None = None) -> bytes:
        self.model = model
        return (self._event("response.created", response=self._envelope("in_progress"))
                + self._event("response.in_progress", response=self._envelope("in_progress")))

    # -- items

    def serving(self, model: str) -> None:
        """The model that serves, known only after the opening went out (headers the gate timer
        sent): the response objects from here on name it."""
        self.model = model

    def _index(self) -> int:
        return len(self.output)

    def _open(self, item: dict[str, Any]) -> bytes:
        out = self._close()
        self.item, self.text = item, []
        out += self._event("response.output_item.added", output_index=self._index(), item=item)
        if item["type"] == "message":
            out += self._event("response.content_part.added", item_id=item["id"],
                               output_index=self._index(),
                               content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [],
                                                      "logprobs": []})
        elif item["type"] == "reasoning":
            out += self._event("response.reasoning_summary_part.added", item_id=item["id"],
                               output_index=self._index(), summary_index=0,
                               part={"type": "summary_text", "text": ""})
        return out

    def _close(self, status: str = "completed") -> bytes:
        item = self.item
        if item is None:
            return b""
        self.item = None
        text, index, out = "".join(self.text), self._index(), b""
        if item["type"] == "message":
            cited, self.cited = self.cited, []
            done = _message_out(item["id"], text, status, cited)
            part = {"type": "output_text", "text": text, "annotations": cited, "logprobs": []}
            for n, annotation in enumerate(cited):
                out += self._event("response.output_text.annotation.added", item_id=item["id"],
                                   output_index=index,
                                   content_index=0, annotation_index=n, annotation=annotation)
            out += self._event("response.output_text.done", item_id=item["id"], output_index=index,
                               content_index=0,
                               text=text, logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)
        elif item["type"] == "reasoning":
            done, self.signature = _reasoning_out(item["id"], text, self.signature), ""
            out += self._event("response.reasoning_summary_text.done", item_id=item["id"],
                               output_index=index,
                               summary_index=0, text=text)
            out += self._event("response.reasoning_summary_part.done", item_id=item["id"],
                               output_index=index,
                               summary_index=0, part={"type": "summary_text", "text": text})
        else:
            done = item | {"arguments": text or "{}", "status": status}
            out += self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index,
                               name=item["name"], arguments=text or "{}")
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def _whole_item(self, item: dict[str, Any]) -> bytes:
        """A built-in tool's call, as the provider sent it once done: added and done at once."""
        out = self._close()
        out += self._event("response.output_item.added", output_index=self._index(), item=item)
        out += self._event("response.output_item.done", output_index=self._index(), item=item)
        self.output.append(item)
        return out

    def event(self, event: Event) -> bytes:
        kind = event.kind
        # (before the opening) the id a provider that keeps answers gave this one
        if kind == "preamble":
            if self.sequence == 0 and event.ref:
                self.response_id, self.kept = event.ref, True
            return b""
        if kind == "text":
            if event.ref and event.ref.startswith(CITATIONS):  # the message just shown, cited
                if self.item is not None and self.item["type"] == "message":
                    self.cited += jsoncodec.loads(event.ref[len(CITATIONS):])
                return b""
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
            assert self.item is not None  # (the reasoning item open, or just opened)
            self.text.append(event.value)
            return out + self._event("response.reasoning_summary_text.delta",
                                     item_id=self.item["id"],
                                     output_index=self._index(), summary_index=0, delta=event.value)
        if kind == "tool":
            self.calls += 1
            return self._open(_call_item_out(new_id("fc"), self.ids(event.ref), event.value, "",
                                             self.spaces.get(event.value), "in_progress"))
        if kind == "tool_args" and self.item is not None and self.item["type"] == "function_call":
            self.text.append(event.value)
            return self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                               output_index=self._index(), delta=event.value)
        if kind == "executed_tool" and event.ref.startswith(ITEM):
            return self._whole_item(jsoncodec.loads(event.ref[len(ITEM):]))
        return b""  # an Anthropic server tool's work has no item here; it shows in the ledger

    def ok(self, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        if result.served is not None:
            self.model = result.served.model
        reason = INCOMPLETE.get(w.finish_reason(result.finish_reason, self.calls))
        out = self._close("incomplete" if reason else "completed")
        envelope = _finished(self._envelope("completed"), result, self.calls)
        kind = "response.incomplete" if reason else "response.completed"
        return out + self._event(kind, response=envelope | {"relayline": relayline})

    def failed(self, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        # after commit: the answer so far stays as sent, and the response says it failed
        out = self._close("incomplete")
        _, _, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        envelope = self._envelope("failed")
        envelope["error"] = {"code": code or "server_error", "message": result.message or "failed"}
        envelope["usage"] = usage(result.usage)
        return out + self._event("response.failed", response=envelope | {"relayline": relayline})

