"""What every codec shares: the error each turn failure is, in each dialect's words, the tool
call ids an answer gives its client, a provider's classified failure, the client headers that
may travel upstream, `data:` URLs, the usage an OpenAI-family reply reports, a stream frame's
JSON object, and what the chat answers share: an answer's usage and finish reason, an SSE event
written, and a stream chunk cut around its one varying string."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

from relayline.machines import classify as fc
from relayline.machines import wire as w
from relayline.machines.classify import Failure
from relayline.machines.ledger import Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from .. import jsoncodec
from ..sse import SSEEvent
from . import shape


class ProviderFailure(Exception):
    """A provider call failed; `failure` is already classified. The message is relayline's own."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.detail)
        self.failure = failure


def client_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The client request headers that may travel upstream (the gateway decodes only the names
    some entry may be sent: `TRAVELLING` and the profiles' `forward_headers`), names lowercase."""
    return tuple([(k.lower(), v) for k, v in headers])


def openai_reply_usage(raw: Any, param: str = "usage",
                       counts: tuple[str, str] = ("prompt", "completion")) -> Usage | None:
    """The canonical usage of an OpenAI-family usage object, or None when the reply had none.
    `counts` names its two counts, `{input}_tokens` and `{output}_tokens`, each with its
    `_details`: prompt/completion in Chat Completions, input/output in the Responses API."""
    if raw is None:
        return None
    into, out = counts
    raw = shape.want_dict(raw, param)
    details = shape.optional(raw, f"{into}_tokens_details", shape.want_dict, param) or {}
    at = shape.path(param, f"{into}_tokens_details")
    cached = shape.optional(details, "cached_tokens", shape.want_int, at) or 0
    out_details = shape.optional(raw, f"{out}_tokens_details", shape.want_dict, param) or {}
    at = shape.path(param, f"{out}_tokens_details")
    reasoning = shape.optional(out_details, "reasoning_tokens", shape.want_int, at) or 0
    prompt = shape.optional(raw, f"{into}_tokens", shape.want_int, param) or 0
    output = shape.optional(raw, f"{out}_tokens", shape.want_int, param) or 0
    # the input count already includes the cached tokens: kept apart so they are not billed twice
    return Usage(max(prompt - cached, 0), output, cached, 0, reasoning)


def json_frame(event: SSEEvent, shaped: Any) -> dict[str, Any]:
    """A data line's JSON object; `shaped` is `jsoncodec.loads_shape(event.data)`, already read."""
    try:
        obj = jsoncodec.loads_after_shape(event.data, shaped)
    except ValueError:
        failure = fc.truncated("malformed frame: a data line that is not valid JSON")
        raise ProviderFailure(failure) from None
    if not isinstance(obj, dict):
        raise ProviderFailure(fc.truncated("malformed frame: not a JSON object"))
    return obj


def data_url(url: str) -> tuple[str, str] | None:
    """(media type, base64) of a `data:` URL."""
    if not url.startswith("data:") or ";base64," not in url:
        return None
    head, data = url[5:].split(";base64,", 1)
    return head or "application/octet-stream", data

# a finish reason in each family's words, read (a provider's) and written (to a client): the
# canonical reasons are OpenAI's, with Anthropic's stop_sequence and pause_turn kept apart
OPENAI_FINISH = {"stop": w.STOP, "length": w.LENGTH, "tool_calls": w.TOOL_CALLS,
                 "function_call": w.TOOL_CALLS, "content_filter": w.CONTENT_FILTER}
ANTHROPIC_STOP = {"end_turn": w.STOP, "stop_sequence": w.STOP_SEQUENCE, "max_tokens": w.LENGTH,
                  "tool_use": w.TOOL_CALLS, "refusal": w.CONTENT_FILTER, "pause_turn": w.PAUSE,
                  "model_context_window_exceeded": w.LENGTH}
TO_OPENAI = {w.STOP: "stop", w.STOP_SEQUENCE: "stop", w.LENGTH: "length",
             w.TOOL_CALLS: "tool_calls", w.CONTENT_FILTER: "content_filter", w.PAUSE: "stop"}
TO_ANTHROPIC = {w.STOP: "end_turn", w.STOP_SEQUENCE: "stop_sequence", w.LENGTH: "max_tokens",
                w.TOOL_CALLS: "tool_use", w.CONTENT_FILTER: "refusal", w.PAUSE: "pause_turn"}

# turn error reason -> (HTTP status, OpenAI error type, code, Anthropic error type)
ERRORS = {
    "context_window":
        (400, "invalid_request_error", "context_length_exceeded", "invalid_request_error"),
    "client_error": (400, "invalid_request_error", "upstream_rejected", "invalid_request_error"),
    "unsupported": (400, "invalid_request_error", "unsupported_parameter", "invalid_request_error"),
    "no_candidate": (503, "service_unavailable", "no_candidate", "overloaded_error"),
    "exhausted": (502, "upstream_error", "all_candidates_failed", "api_error"),
    "semantic_empty": (502, "upstream_error", "empty_completion", "api_error"),
    "interrupted": (502, "upstream_error", "stream_interrupted", "api_error"),
    "deadline": (504, "upstream_error", "turn_deadline", "api_error"),
    "internal": (500, "server_error", "internal_error", "api_error"),
    "shutdown": (503, "service_unavailable", "shutting_down", "overloaded_error"),
}
UNKNOWN_ERROR = (502, "upstream_error", None, "api_error")
# HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 408: "invalid_request_error",
                   413: "request_too_large",
                   431: "invalid_request_error", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class ToolIds:
    """Tool call ids as the upstream sent them; one generated (unique) only where it sent none."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, given: str) -> str:
        return given or f"{self.prefix}{os.urandom(12).hex()}"


def answer_tools(result: TurnResult, ids: ToolIds) -> list[tuple[str, str, str]]:
    """Each tool call's id, name and JSON arguments ("{}" when the provider sent none)."""
    n = len(result.tool_calls)
    arguments = list(result.tool_arguments) + [""] * (n - len(result.tool_arguments))
    given = list(result.tool_ids) + [""] * (n - len(result.tool_ids))
    return [(ids(i), name, args or "{}")
            for i, name, args in zip(given, result.tool_calls, arguments, strict=False)]


# -- what the chat answers share ----------------------------------------------------------------


class StreamRenderer(Protocol):
    """One streamed answer in a client dialect's events. The gateway decides what is sent and
    when; the renderer writes each piece: the opening (with the model known then, often none
    yet), the model that serves once it is known, each event, and the close of an answer or of a
    failure after the answer began."""

    def opening(self, model: str, usage: Usage | None = None) -> bytes: ...

    def serving(self, model: str) -> None: ...

    def event(self, event: Event) -> bytes: ...

    def ok(self, result: TurnResult, relayline: dict[str, Any]) -> bytes: ...

    def failed(self, result: TurnResult, relayline: dict[str, Any]) -> bytes: ...


def answer_usage(result: TurnResult) -> Usage:
    return result.usage or Usage()


def sse_event(obj: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + jsoncodec.dumps(obj) + b"\n\n"


SLOT = "\x00relayline-slot\x00"
SLOT_JSON = jsoncodec.dumps(SLOT)


def slotted(chunk: bytes) -> tuple[bytes, bytes]:
    """A chunk rendered with `SLOT` as its one varying string, cut around it. Stream chunks that
    differ only in that string (text and reasoning deltas: nearly every frame) are then written
    by encoding the string alone, and the bytes are those of encoding the whole chunk."""
    head, _, tail = chunk.partition(SLOT_JSON)
    return head, tail


def answer_finish(result: TurnResult, tools: int) -> str:
    return w.finish_reason(result.finish_reason, tools)
