"""Anthropic messages answers: the canonical result, stream events and errors written in the shape
an Anthropic client reads (a `message`, its event sequence from message_start to message_stop,
an `error` object). The gateway decides what is sent and when; this module only writes it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from relayline.machines import wire
from relayline.machines.ledger import Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from .. import jsoncodec
from . import anthropic_messages
from .common import (
    ANTHROPIC_TYPES,
    ERRORS,
    SLOT,
    TO_ANTHROPIC,
    UNKNOWN_ERROR,
    ToolIds,
    answer_finish,
    answer_tools,
    answer_usage,
    slotted,
    sse_event,
)


def _page_limit(raw: str) -> int:
    # Anthropic's page size: 20 unless asked, between 1 and 1000
    return min(max(int(raw), 1), 1000) if raw.isdigit() else 20


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "cache_read_input_tokens": usage.cache_read_tokens,
            "cache_creation_input_tokens": usage.cache_write_tokens}


class AnthropicDialect:
    name = "anthropic"

    @staticmethod
    def new_id() -> str:
        return f"msg_{os.urandom(12).hex()}"

    @staticmethod
    def error_body(message: str, type_: str) -> bytes:
        return json.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()

    def http_error(self, status: int, message: str, code: str | None = None) -> bytes:
        return self.error_body(message, ANTHROPIC_TYPES.get(status, "api_error"))

    def bad_request(self, error: wire.WireError) -> tuple[int, bytes]:
        return 400, self.error_body(str(error), "invalid_request_error")

    def parse(self, body: object, headers: Iterable[tuple[str, str]] = (),
              query: str = "", read: wire.ReadBytes | None = None) -> wire.Request:
        return anthropic_messages.parse_request(body, headers, query, read=read)

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        if result.rejection is not None:
            r = result.rejection
            return r.status, self.error_body(r.message,
                                             ANTHROPIC_TYPES.get(r.status, "invalid_request_error")
                                             if r.type not in ANTHROPIC_TYPES.values() else r.type)
        status, _, _, type_ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return status, self.error_body(result.message or "failed", type_)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict[str, Any],
                   request: wire.Request | None = None) -> dict[str, Any]:
        assert result.served is not None  # an accepted answer always has a server
        tools = answer_tools(result, ToolIds("toolu_"))
        content: list[dict[str, Any]]
        if result.blocks:  # an Anthropic provider's content as it sent it
            content = [dict(block) for block in result.blocks]
        else:
            content = [{"type": "thinking", "thinking": result.reasoning,
                        "signature": ""}] if result.reasoning else []
            if result.text:
                content.append({"type": "text", "text": result.text})
            content += [{"type": "tool_use", "id": i, "name": n, "input": wire.json_object(a) or {}}
                        for i, n, a in tools]
        return {"id": turn_id, "type": "message", "role": "assistant", "model": result.served.model,
                "content": content,
                "stop_reason": TO_ANTHROPIC[answer_finish(result, len(tools))],
                "stop_sequence": result.stop_sequence,
                "usage": anthropic_usage(answer_usage(result)), "relayline": relayline}

    def stream_renderer(self, turn_id: str, request: wire.Request) -> AnthropicStream:
        return AnthropicStream(turn_id)

    @staticmethod
    def model_list(ids: list[str], query: str = "") -> dict[str, Any]:
        """GET /v1/models as Anthropic lists models: a page (`limit`, `after_id`, `before_id`)
        with `has_more`, `first_id` and `last_id`. A name's release date is not known here: its
        `created_at` is the epoch, as Anthropic's API does for an unknown date."""
        asked = parse_qs(query)
        limit = _page_limit(asked.get("limit", [""])[0])
        after, before = asked.get("after_id", [""])[0], asked.get("before_id", [""])[0]
        if before in ids and after not in ids:  # the page that ends just before `before_id`
            end = ids.index(before)
            page, more = ids[max(0, end - limit):end], end > limit
        else:
            start = ids.index(after) + 1 if after in ids else 0
            page, more = ids[start:start + limit], start + limit < len(ids)
        data = [{"type": "model", "id": i, "display_name": i, "created_at": "1970-01-01T00:00:00Z",
                 "lifecycle": "active"} for i in page]
        return {"data": data, "has_more": more, "first_id": page[0] if page else None,
                "last_id": page[-1] if page else None}


class AnthropicStream:
    """Content blocks are opened as the event kinds change: text, thinking, tool_use."""

    BLOCKS = {"text": ("text", "text_delta", "text"),
              "reasoning": ("thinking", "thinking_delta", "thinking")}

    __slots__ = ("turn_id", "index", "block", "tool_blocks", "ids", "slotted")

    def __init__(self, turn_id: str) -> None:
        self.turn_id = turn_id
        self.index = -1
        self.block: str | None = None
        self.tool_blocks: list[int] = []  # each tool call's block index
        self.ids = ToolIds("toolu_")
        self.slotted: tuple[int, str, bytes, bytes] = (-1, "", b"", b"")  # the open block's delta

    def serving(self, model: str) -> None:
        """The model that serves, known after message_start went out (with no model: headers the
        gate timer committed): nothing later names it; message_delta's `relayline` field says
        who served."""

    def opening(self, model: str, usage: Usage | None = None) -> bytes:
        # the input tokens are known here when the upstream said them before its first token
        # (Anthropic's message_start); message_delta carries the final counts either way
        message: dict[str, Any] = {"id": self.turn_id, "type": "message", "role": "assistant",
                                   "content": [], "model": model,
                   "stop_reason": None, "stop_sequence": None,
                   "usage": anthropic_usage(usage or Usage())}
        return sse_event({"type": "message_start", "message": message}, "message_start")

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        self.block = None
        return sse_event({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.block = kind
        return out + sse_event(
            {"type": "content_block_start", "index": self.index, "content_block": block},
            "content_block_start",
        )

    def event(self, event: Event) -> bytes:
        out = b""
        # the signature of the thinking block just shown
        if event.ref and event.kind == "reasoning":
            return sse_event({"type": "content_block_delta", "index": self.index,
                         "delta": {"type": "signature_delta", "signature": event.ref}},
                        "content_block_delta") if self.block == "reasoning" else b""
        if event.kind in self.BLOCKS:
            block_type, delta_type, field = self.BLOCKS[event.kind]
            if self.block != event.kind:
                start = {"type": block_type,
                         field: ""} | ({"signature": ""} if block_type == "thinking" else {})
                out += self._open(event.kind, start)
            index, kind, head, tail = self.slotted
            if index != self.index or kind != delta_type:
                head, tail = slotted(sse_event({"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": delta_type, field: SLOT}},
                                            "content_block_delta"))
                self.slotted = (self.index, delta_type, head, tail)
            return out + head + jsoncodec.dumps(event.value) + tail
        # a block whole in its start, as Anthropic streams it
        if event.kind == "redacted_reasoning":
            return self._open("redacted", {"type": "redacted_thinking", "data": event.value})
        if event.kind == "tool":
            out = self._open("tool",
                             {"type": "tool_use", "id": self.ids(event.ref), "name": event.value,
                              "input": {}})
            self.tool_blocks.append(self.index)
            return out
        if event.kind == "tool_args":
            # a piece of a call opened before the last one names its place: to its own block (the
            # SDKs gather by index); any other, to the open tool block
            place = int(event.ref) if event.ref.isdigit() else -1
            target = self.tool_blocks[place] if 0 <= place < len(self.tool_blocks) else (
                self.index if self.block == "tool" else None)
            if target is not None:
                return sse_event({"type": "content_block_delta", "index": target,
                             "delta": {"type": "input_json_delta", "partial_json": event.value}},
                             "content_block_delta")
        return b""

    def ok(self, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": TO_ANTHROPIC[answer_finish(result, len(self.tool_blocks))],
                "stop_sequence": result.stop_sequence,
            },
            "usage": anthropic_usage(answer_usage(result)),
            "relayline": relayline,
        }
        return (
            self._close()
            + sse_event(delta, "message_delta")
            + sse_event({"type": "message_stop"}, "message_stop")
        )

    def failed(self, result: TurnResult, relayline: dict[str, Any]) -> bytes:
        _, _, _, type_ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return sse_event(
            {"type": "error", "error": {"type": type_, "message": result.message or "failed"}},
            "error",
        )
