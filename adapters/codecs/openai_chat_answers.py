"""OpenAI chat completions answers: the canonical result, stream events and errors written in the
shape an OpenAI client reads (a `chat.completion`, `chat.completion.chunk` events, an `error`
object). The gateway decides what is sent and when; this module only writes it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from relayline.machines import wire
from relayline.machines.ledger import Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from .. import jsoncodec
from . import openai_chat
from .common import (
    ERRORS,
    SLOT,
    TO_OPENAI,
    UNKNOWN_ERROR,
    StreamRenderer,
    ToolIds,
    answer_finish,
    answer_tools,
    answer_usage,
    slotted,
    sse_event,
)


def openai_usage(usage: Usage) -> dict[str, Any]:
    prompt = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
    return {"prompt_tokens": prompt, "completion_tokens": usage.output_tokens,
            "total_tokens": prompt + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cache_read_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def signed_reasoning(blocks: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """What an OpenAI client needs beside `reasoning_content` to send an Anthropic answer's
    reasoning back as it was (Anthropic wants a tool turn's thinking back signed): the signature
    of its thinking, when that is one block (several: no one signature covers the words joined),
    and the data of its redacted thinking blocks."""
    thinking = [b for b in blocks if b.get("type") == "thinking"]
    out: dict[str, Any] = {}
    signature = thinking[0].get("signature") if len(thinking) == 1 else None
    if isinstance(signature, str) and signature:
        out["reasoning_signature"] = signature
    redacted = [
        b["data"]
        for b in blocks
        if b.get("type") == "redacted_thinking" and isinstance(b.get("data"), str)
    ]
    if redacted:
        out["reasoning_redacted"] = redacted
    return out


class OpenAIDialect:
    name = "openai"

    @staticmethod
    def new_id() -> str:
        return f"chatcmpl-{os.urandom(12).hex()}"  # (not uuid4: it makes an object per id)

    @staticmethod
    def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
        return json.dumps({"error": {"message": message, "type": type_, "param": param,
                                     "code": code}}).encode()

    def http_error(self, status: int, message: str, code: str | None = None) -> bytes:
        type_ = "invalid_request_error" if status < 500 else "server_error"
        return self.error_body(message, type_, code)

    def bad_request(self, error: wire.WireError) -> tuple[int, bytes]:
        return 400, self.error_body(str(error), "invalid_request_error", "invalid_body",
                                    error.param or None)

    def parse(self, body: object, headers: Iterable[tuple[str, str]] = (),
              query: str = "", read: wire.ReadBytes | None = None) -> wire.Request:
        return openai_chat.parse_request(body, headers, query, read=read)

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        if result.rejection is not None:
            r = result.rejection
            return r.status, self.error_body(r.message, r.type, "upstream_rejected")
        status, type_, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return status, self.error_body(result.message or "failed", type_, code)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict[str, Any],
                   request: wire.Request | None = None) -> dict[str, Any]:
        assert result.served is not None  # an accepted answer always has a server
        tools = answer_tools(result, ToolIds("call_")) if result.tool_calls else []
        message: dict[str, Any] = {"role": "assistant",
                                   "content": result.text or (None if tools else "")}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        # an Anthropic provider's: its thinking's signature, its redacted thinking
        if result.blocks:
            message.update(signed_reasoning(result.blocks))
        if result.annotations:  # a search model's url citations, as the provider sent them
            message["annotations"] = list(result.annotations)
        if tools:
            message["tool_calls"] = [{"id": i, "type": "function",
                                      "function": {"name": n, "arguments": a}}
                                     for i, n, a in tools]
        return {
            "id": turn_id, "object": "chat.completion", "created": int(time.time()),
            "model": result.served.model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": TO_OPENAI[answer_finish(result, len(tools))]}
                        | ({"logprobs": result.logprobs} if result.logprobs is not None else {})],
            "usage": openai_usage(answer_usage(result)),
            "relayline": relayline,
        }

    def stream_renderer(self, turn_id: str, request: wire.Request) -> StreamRenderer:
        return OpenAIStream(turn_id, request.include_usage)

    @staticmethod
    def model_list(ids: list[str], query: str = "") -> dict[str, Any]:
        """GET /v1/models as OpenAI lists models: every name at once."""
        created = int(time.time())
        return {"object": "list",
                "data": [{"id": i, "object": "model", "created": created, "owned_by": "relayline"}
                                          for i in ids]}


class OpenAIStream:
    DELTAS = {"text": "content", "reasoning": "reasoning_content"}

    # slotted, as every per-stream object: thousands of streams are in flight at once
    __slots__ = ("turn_id", "include_usage", "created", "model", "tools", "ids", "slotted",
                 "signatures")

    def __init__(self, turn_id: str, include_usage: bool) -> None:
        self.turn_id = turn_id
        self.include_usage = include_usage
        self.created = int(time.time())
        self.model = ""
        self.tools = 0
        self.ids = ToolIds("call_")
        self.slotted: dict[str, tuple[bytes, bytes]] = {}  # delta field -> chunk around it
        # the thinking blocks' signatures, held to the end: one goes to the client, as on a
        # whole answer; several (no one covers the words joined, and a client joins string
        # deltas into one it would send back) go as none
        self.signatures: list[str] = []

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None,
               **extra: Any) -> bytes:
        return sse_event(
            {
                "id": self.turn_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": []
                if delta is None
                else [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
        )

    def opening(self, model: str, usage: Usage | None = None) -> bytes:
        self.model = model
        self.slotted = {}
        self.signatures = []
        return self._chunk({"role": "assistant", "content": ""})

    def serving(self, model: str) -> None:
        """The model that serves, known only after the opening went out (headers the gate timer
        committed): the chunks from here on name it."""
        self.model = model
        self.slotted = {}

    def event(self, event: Event) -> bytes:
        field = self.DELTAS.get(event.kind)
        if field is not None:
            if event.ref:
                if field != "content":  # the signature of the thinking just shown (Anthropic's)
                    self.signatures.append(event.ref)
                    return b""
                # text with the logprobs the client asked for
                return sse_event(
                    {
                        "id": self.turn_id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {field: event.value},
                                "logprobs": jsoncodec.loads(event.ref),
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            parts = self.slotted.get(field)
            if parts is None:
                parts = self.slotted[field] = slotted(self._chunk({field: SLOT}))
            return parts[0] + jsoncodec.dumps(event.value) + parts[1]
        if event.kind == "tool":
            self.tools += 1
            return self._chunk(
                {
                    "tool_calls": [
                        {
                            "index": self.tools - 1,
                            "id": self.ids(event.ref),
                            "type": "function",
                            "function": {"name": event.value, "arguments": ""},
                        }
                    ]
                }
            )
        if event.kind == "tool_args":
            # (ref: an earlier call's)
            index = int(event.ref) if event.ref.isdigit() else max(self.tools - 1, 0)
            return self._chunk({"tool_calls": [{"index": index,
                                                "function": {"arguments": event.value}}]})
        if event.kind == "redacted_reasoning":  # (an Anthropic provider's, to be sent back)
            return self._chunk({"reasoning_redacted": [event.value]})
        return b""  # provider-executed tool work has no chunk shape here; it shows in the ledger

    def ok(self, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        if result.served is not None:
            self.model = result.served.model
        finish = TO_OPENAI[answer_finish(result, self.tools)]
        signed = (
            self._chunk({"reasoning_signature": self.signatures[0]})
            if len(self.signatures) == 1
            else b""
        )
        return signed + self._finish(finish, result, relayline)

    def _finish(self, finish: str, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        if not self.include_usage:
            # the relayline field rides on the last chunk: a usage-only chunk (choices: []) goes
            # only to clients that asked for it, as the OpenAI API does
            return self._chunk({}, finish, relayline=relayline) + b"data: [DONE]\n\n"
        return (self._chunk({}, finish)
                + self._chunk(None, usage=openai_usage(answer_usage(result)),
                              relayline=relayline) + b"data: [DONE]\n\n")

    def failed(self, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        # after commit: an explicit error event and no [DONE], never a clean-looking end
        _, type_, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return sse_event(
            {
                "error": {"message": result.message or "failed", "type": type_, "code": code},
                "relayline": relayline,
            }
        )
