"""Anthropic messages replies: what an `anthropic` profile answered, whole (JSON) or streamed
(SSE events), read into the canonical completion and stream frames.

Stream events: message_start (preamble; input and cache usage), content_block_start / delta /
stop (text, thinking as reasoning, tool_use with input_json_delta, server_tool_use and its
results as provider-executed tool work), ping, message_delta (stop_reason, output usage),
message_stop (the completion signal), and in-band `error` events. EOF after
message_delta.stop_reason but before message_stop is truncation.
"""

from __future__ import annotations

import json
from typing import Any

from relayline.machines import classify as fc
from relayline.machines import wire as w
from relayline.machines.ledger import Usage
from relayline.machines.stream import (
    EXECUTED_TOOL,
    FINISH,
    PING,
    PREAMBLE,
    REASONING,
    REDACTED_REASONING,
    TEXT,
    TOOL_ARGS,
    TOOL_CALL,
    USAGE,
    Frame,
)
from relayline.machines.turn import Completion

from .. import jsoncodec
from ..sse import SSEEvent
from . import count_tokens, shape
from .common import ANTHROPIC_STOP, ProviderFailure, json_frame


def _usage(raw: object, param: str = "usage", base: Usage | None = None) -> Usage:
    raw = shape.want_dict(raw, param)
    base = base or Usage()

    def count(name: str, default: int) -> int:
        value = shape.optional(raw, name, shape.want_int, param)
        return default if value is None else value

    return Usage(count("input_tokens", base.input_tokens),
                 count("output_tokens", base.output_tokens),
                 count("cache_read_input_tokens", base.cache_read_tokens),
                 count("cache_creation_input_tokens", base.cache_write_tokens))


def _raise_error(error: object) -> None:
    error = error if isinstance(error, dict) else {}
    raise ProviderFailure(fc.classify_stream_error(f"{error.get('type', '')} "
                                                   f"{error.get('message', '')}".strip()))


def _stop(raw: object, param: str) -> str | None:
    if raw is None:
        return None
    return ANTHROPIC_STOP.get(shape.want_str(raw, param), w.STOP)


def _executed(block_type: str) -> bool:
    return block_type == "server_tool_use" or block_type.endswith("_tool_result")


def parse_completion(body: dict[str, Any]) -> Completion:
    if body.get("type") == "error" or body.get("error"):
        _raise_error(body.get("error"))
    text, reasoning, tools, arguments, ids = [], [], [], [], []
    content = shape.want_list(body.get("content"), "content")
    # a block the canonical fields do not hold: the content goes to Anthropic clients as sent
    kept = False
    for i, block in enumerate(content):
        where = f"content[{i}]"
        block = shape.want_dict(block, where)
        btype = block.get("type")
        if btype == "text":
            text.append(shape.want_str(block.get("text"), f"{where}.text"))
            kept = kept or bool(block.get("citations"))
        elif btype == "tool_use":
            tools.append(shape.want_str(block.get("name"), f"{where}.name"))
            arguments.append(json.dumps(shape.want_dict(block.get("input", {}), f"{where}.input")))
            ids.append(shape.optional(block, "id", shape.want_str, where) or "")
        else:  # thinking (signed), redacted_thinking, server tools and their results
            if btype == "thinking":
                reasoning.append(shape.want_str(block.get("thinking"), f"{where}.thinking"))
            kept = True
    # none reported: the ledger bills the answer at an estimate
    usage = _usage(body["usage"]) if body.get("usage") is not None else None
    return Completion("".join(text), "".join(reasoning), tuple(tools), usage, tuple(arguments),
                      tuple(ids),
                      _stop(body.get("stop_reason"), "stop_reason"),
                      shape.optional(body, "stop_sequence", shape.want_str),
                      tuple(content) if kept else ())


def _index(obj: dict[str, Any]) -> int | None:
    """A content block event's `index`: an integer (or none sent), never another JSON value
    taken for one (a list or an object cannot key the blocks: a malformed stream, not a crash)."""
    index: int | None = shape.optional(obj, "index", shape.want_int)
    return index


class AnthropicStreamParser:
    def __init__(self) -> None:
        self.done = False
        self.stopped = False
        self.usage = Usage()
        self.blocks: dict[int | None, str] = {}  # (each block's type by its index, as sent)

    def complete_at_eof(self) -> bool:
        return False  # message_stop is required, even after a stop_reason

    def feed(self, event: SSEEvent) -> list[Frame]:
        # nearly every event is a text delta: read once, without the digit-run check, since the
        # text read from it is a string (jsoncodec.loads_shape); any other is read exactly
        obj = jsoncodec.loads_shape(event.data)
        if type(obj) is dict and obj.get("type") == "content_block_delta":
            delta = obj.get("delta")
            if (
                type(delta) is dict
                and delta.get("type") == "text_delta"
                and type(text := delta.get("text")) is str
            ):
                return [Frame(TEXT, text)]
        obj = json_frame(event, obj)
        try:
            return self._frames(obj, obj.get("type") or event.event)
        except w.WireError as exc:
            raise ProviderFailure(fc.malformed(f"stream event {exc}")) from None

    def _frames(self, obj: dict[str, Any], kind: object) -> list[Frame]:
        if kind == "content_block_delta":
            delta = shape.want_dict(obj.get("delta"), "delta")
            dtype = delta.get("type")
            if dtype == "text_delta":
                return [Frame(TEXT, shape.want_str(delta.get("text", ""), "delta.text"))]
            if dtype == "thinking_delta":
                return [Frame(REASONING,
                              shape.want_str(delta.get("thinking", ""), "delta.thinking"))]
            if dtype == "input_json_delta" and not _executed(self.blocks.get(_index(obj), "")):
                return [Frame(TOOL_ARGS,
                              shape.want_str(delta.get("partial_json", ""), "delta.partial_json"))]
            if dtype == "signature_delta":
                return [Frame(REASONING, "",
                              ref=shape.want_str(delta.get("signature"), "delta.signature"))]
            return []  # citations_delta: nothing to show
        if kind == "content_block_start":
            block = shape.want_dict(obj.get("content_block"), "content_block")
            btype = shape.want_str(block.get("type", ""), "content_block.type")
            self.blocks[_index(obj)] = btype
            if btype == "text":
                return [Frame(TEXT, shape.want_str(block.get("text", ""), "content_block.text"))]
            if btype == "thinking":
                return [Frame(REASONING,
                              shape.want_str(block.get("thinking", ""), "content_block.thinking"))]
            if btype == "redacted_thinking":  # whole in its start: no deltas follow
                return [Frame(REDACTED_REASONING,
                              shape.want_str(block.get("data"), "content_block.data"))]
            if btype == "tool_use":
                return [Frame(TOOL_CALL, shape.want_str(block.get("name"), "content_block.name"),
                              ref=shape.optional(block, "id", shape.want_str,
                                                 "content_block") or "")]
            if _executed(btype):
                return [Frame(EXECUTED_TOOL, block.get("name") or btype)]
            return [Frame(PREAMBLE, btype)]
        if kind == "ping":
            return [Frame(PING)]
        if kind == "message_start":
            message = shape.want_dict(obj.get("message"), "message")
            if message.get("usage") is not None:
                self.usage = _usage(message["usage"], "message.usage")
            return [Frame(PREAMBLE, "message_start"), Frame(USAGE, usage=self.usage)]
        if kind == "message_delta":
            frames = []
            delta = shape.optional(obj, "delta", shape.want_dict) or {}
            stop = _stop(delta.get("stop_reason"), "delta.stop_reason")
            if stop:
                self.stopped = True
                frames.append(Frame(FINISH, stop,
                                    ref=shape.optional(delta, "stop_sequence", shape.want_str,
                                                       "delta") or ""))
            if obj.get("usage") is not None:
                self.usage = _usage(obj["usage"], "usage", self.usage)
            return [*frames, Frame(USAGE, usage=self.usage)]
        if kind == "message_stop":
            self.done = True
            return []
        if kind == "error":
            _raise_error(obj.get("error"))
        return []  # content_block_stop, unknown future events


def parse_reply(body: dict[str, Any]) -> Completion:
    """A whole reply of an `anthropic` profile: a message, or a count when it was asked to count."""
    if count_tokens.is_count(body):
        return count_tokens.parse_reply(body)
    return parse_completion(body)
