"""The wire dialects the gateway speaks to its clients: OpenAI chat completions and Anthropic
messages. A dialect parses a request into the turn's inputs and renders results and stream
events back; the gateway (what to hold, when to commit, when to flush) is the same for both.
"""

from __future__ import annotations

import json
import time
import uuid

import attrs

from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from ..messages import anthropic_to_openai

# turn error reason -> (HTTP status, OpenAI error type, code, Anthropic error type)
ERRORS = {
    "context_window": (400, "invalid_request_error", "context_length_exceeded", "invalid_request_error"),
    "client_error": (400, "invalid_request_error", "upstream_rejected", "invalid_request_error"),
    "no_candidate": (503, "service_unavailable", "no_candidate", "overloaded_error"),
    "exhausted": (502, "upstream_error", "all_candidates_failed", "api_error"),
    "semantic_empty": (502, "upstream_error", "empty_completion", "api_error"),
    "interrupted": (502, "upstream_error", "stream_interrupted", "api_error"),
    "shutdown": (503, "service_unavailable", "shutting_down", "overloaded_error"),
}
UNKNOWN_ERROR = (502, "upstream_error", None, "api_error")


@attrs.frozen
class ChatRequest:
    messages: list[dict]
    model: str | None
    tools: tuple[dict, ...]
    stream: bool


def _usage(result: TurnResult) -> tuple[int, int]:
    accepted = [r for r in result.ledger if r.accepted]
    return sum(r.input_tokens for r in accepted), sum(r.output_tokens for r in accepted)


def _openai_usage(result: TurnResult) -> dict:
    tokens_in, tokens_out = _usage(result)
    return {"prompt_tokens": tokens_in, "completion_tokens": tokens_out, "total_tokens": tokens_in + tokens_out}


def _tools(result: TurnResult) -> list[tuple[str, str]]:
    """Each tool call's name and JSON arguments ("{}" when the provider sent none)."""
    arguments = list(result.tool_arguments) + [""] * (len(result.tool_calls) - len(result.tool_arguments))
    return [(name, args or "{}") for name, args in zip(result.tool_calls, arguments, strict=False)]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _sse(obj: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- OpenAI chat completions -----------------------------------------------------------------------


class OpenAIDialect:
    @staticmethod
    def new_id() -> str:
        return f"chatcmpl-{uuid.uuid4().hex[:24]}"

    @staticmethod
    def error_body(message: str, type_: str, code: str | None) -> bytes:
        return json.dumps({"error": {"message": message, "type": type_, "code": code, "param": None}}).encode()

    def bad_request(self, message: str) -> tuple[int, bytes]:
        return 400, self.error_body(message, "invalid_request_error", "invalid_body")

    def parse(self, body: dict) -> ChatRequest:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages")
        return ChatRequest(messages, body.get("model"), tuple(body.get("tools") or ()), bool(body.get("stream")))

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        status, type_, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return status, self.error_body(result.message or "failed", type_, code)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict) -> dict:
        message: dict = {"role": "assistant", "content": result.text}
        if result.tool_calls:
            message["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                                     for i, (n, a) in enumerate(_tools(result))]
        return {
            "id": turn_id, "object": "chat.completion", "created": int(time.time()), "model": result.served.model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if result.tool_calls else "stop"}],
            "usage": _openai_usage(result),
            "relayline": relayline,
        }

    def stream_renderer(self, turn_id: str) -> OpenAIStream:
        return OpenAIStream(turn_id)


class OpenAIStream:
    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.created = int(time.time())
        self.model = ""
        self.tools = 0

    def _chunk(self, delta: dict | None, finish: str | None = None, **extra) -> bytes:
        return _sse({"id": self.turn_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

    def opening(self, model: str) -> bytes:
        self.model = model
        return self._chunk({"role": "assistant", "content": ""})

    def event(self, event: Event) -> bytes:
        if event.kind == "text":
            return self._chunk({"content": event.value})
        if event.kind == "reasoning":
            return self._chunk({"reasoning_content": event.value})
        if event.kind == "tool":
            self.tools += 1
            return self._chunk({"tool_calls": [{"index": self.tools - 1, "id": f"call_{self.tools - 1}",
                                                "type": "function", "function": {"name": event.value, "arguments": ""}}]})
        if event.kind == "tool_args":
            return self._chunk({"tool_calls": [{"index": max(self.tools - 1, 0), "function": {"arguments": event.value}}]})
        return b""  # provider-executed tool work has no chunk shape here; it shows in the ledger

    def ok(self, result: TurnResult, relayline: dict) -> bytes:
        if result.served is not None:
            self.model = result.served.model
        return (self._chunk({}, "tool_calls" if self.tools else "stop")
                + self._chunk(None, usage=_openai_usage(result), relayline=relayline) + b"data: [DONE]\n\n")

    def failed(self, result: TurnResult, relayline: dict) -> bytes:
        # after commit: an explicit error event and no [DONE], never a clean-looking end
        _, type_, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return _sse({"error": {"message": result.message or "failed", "type": type_, "code": code},
                     "relayline": relayline})


# -- Anthropic messages ----------------------------------------------------------------------------


class AnthropicDialect:
    @staticmethod
    def new_id() -> str:
        return f"msg_{uuid.uuid4().hex[:24]}"

    @staticmethod
    def error_body(message: str, type_: str) -> bytes:
        return json.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()

    def bad_request(self, message: str) -> tuple[int, bytes]:
        return 400, self.error_body(message, "invalid_request_error")

    def parse(self, body: dict) -> ChatRequest:
        """Anthropic messages in, the turn's (OpenAI-shaped) messages out (adapters/messages.py)."""
        messages = anthropic_to_openai(body.get("system"), body["messages"])
        tools = tuple({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                        "parameters": t.get("input_schema") or {"type": "object"}}}
                      for t in body.get("tools") or ())
        return ChatRequest(messages, body.get("model"), tools, bool(body.get("stream")))

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        status, _, _, type_ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return status, self.error_body(result.message or "failed", type_)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict) -> dict:
        content: list[dict] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.text:
            content.append({"type": "text", "text": result.text})
        content += [{"type": "tool_use", "id": f"toolu_{i}", "name": n, "input": _json_object(a)}
                    for i, (n, a) in enumerate(_tools(result))]
        tokens_in, tokens_out = _usage(result)
        return {"id": turn_id, "type": "message", "role": "assistant", "model": result.served.model, "content": content,
                "stop_reason": "tool_use" if result.tool_calls else "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}, "relayline": relayline}

    def stream_renderer(self, turn_id: str) -> AnthropicStream:
        return AnthropicStream(turn_id)


class AnthropicStream:
    """Content blocks are opened as the event kinds change: text, thinking, tool_use."""

    BLOCKS = {"text": ("text", "text_delta", "text"), "reasoning": ("thinking", "thinking_delta", "thinking")}

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.index = -1
        self.block: str | None = None
        self.tools = 0

    def opening(self, model: str) -> bytes:
        message = {"id": self.turn_id, "type": "message", "role": "assistant", "content": [], "model": model,
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return _sse({"type": "message_start", "message": message}, "message_start")

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return _sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _open(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + _sse({"type": "content_block_start", "index": self.index, "content_block": block},
                          "content_block_start")

    def event(self, event: Event) -> bytes:
        out = b""
        if event.kind in self.BLOCKS:
            block_type, delta_type, field = self.BLOCKS[event.kind]
            if self.block != event.kind:
                start = {"type": block_type, field: ""} | ({"signature": ""} if block_type == "thinking" else {})
                out += self._open(event.kind, start)
            return out + _sse({"type": "content_block_delta", "index": self.index,
                               "delta": {"type": delta_type, field: event.value}}, "content_block_delta")
        if event.kind == "tool":
            self.tools += 1
            return self._open("tool", {"type": "tool_use", "id": f"toolu_{self.tools - 1}", "name": event.value,
                                       "input": {}})
        if event.kind == "tool_args" and self.block == "tool":
            return _sse({"type": "content_block_delta", "index": self.index,
                         "delta": {"type": "input_json_delta", "partial_json": event.value}}, "content_block_delta")
        return b""

    def ok(self, result: TurnResult, relayline: dict) -> bytes:
        _, tokens_out = _usage(result)
        delta = {"type": "message_delta", "delta": {"stop_reason": "tool_use" if self.tools else "end_turn",
                                                    "stop_sequence": None},
                 "usage": {"output_tokens": tokens_out}, "relayline": relayline}
        return self._close() + _sse(delta, "message_delta") + _sse({"type": "message_stop"}, "message_stop")

    def failed(self, result: TurnResult, relayline: dict) -> bytes:
        _, _, _, type_ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return _sse({"type": "error", "error": {"type": type_, "message": result.message or "failed"}}, "error")


OPENAI = OpenAIDialect()
ANTHROPIC = AnthropicDialect()
