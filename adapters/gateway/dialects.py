"""The wire dialects the gateway speaks to its clients: OpenAI chat completions and Anthropic
messages, OpenAI's Responses API, embeddings and Anthropic's token counting. A dialect reads a
request into the canonical model (machines/wire.py, through the family codecs in providers/ and
the client codecs in codecs/) and renders results, stream events and errors back in its own
shape; the gateway (what to hold, when to commit, when to flush) is the same for all of them.
"""

from __future__ import annotations

import json
import os
import time

from relayline.machines import wire
from relayline.machines.ledger import Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from .. import jsoncodec
from ..codecs import anthropic_messages, count_tokens, embeddings, openai_chat
from ..codecs import responses as responses_codec
from ..codecs.common import ANTHROPIC_TYPES, ERRORS, UNKNOWN_ERROR, ToolIds, answer_tools


def _usage(result: TurnResult) -> Usage:
    return result.usage or Usage()


def openai_usage(usage: Usage) -> dict:
    prompt = usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens
    return {"prompt_tokens": prompt, "completion_tokens": usage.output_tokens,
            "total_tokens": prompt + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cache_read_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def anthropic_usage(usage: Usage) -> dict:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "cache_read_input_tokens": usage.cache_read_tokens,
            "cache_creation_input_tokens": usage.cache_write_tokens}


def _sse(obj: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + jsoncodec.dumps(obj) + b"\n\n"


_SLOT = "\x00relayline-slot\x00"
_SLOT_JSON = jsoncodec.dumps(_SLOT)


def _slotted(chunk: bytes) -> tuple[bytes, bytes]:
    """A chunk rendered with `_SLOT` as its one varying string, cut around it. Stream chunks that
    differ only in that string (text and reasoning deltas: nearly every frame) are then written
    by encoding the string alone, and the bytes are those of encoding the whole chunk."""
    head, _, tail = chunk.partition(_SLOT_JSON)
    return head, tail


def signed_reasoning(blocks) -> dict:
    """What an OpenAI client needs beside `reasoning_content` to send an Anthropic answer's
    reasoning back as it was (Anthropic wants a tool turn's thinking back signed): the signature
    of its thinking, when that is one block (several: no one signature covers the words joined),
    and the data of its redacted thinking blocks."""
    thinking = [b for b in blocks if b.get("type") == "thinking"]
    out: dict = {}
    if len(thinking) == 1 and isinstance(signature := thinking[0].get("signature"), str) and signature:
        out["reasoning_signature"] = signature
    redacted = [b["data"] for b in blocks if b.get("type") == "redacted_thinking" and isinstance(b.get("data"), str)]
    if redacted:
        out["reasoning_redacted"] = redacted
    return out


def _finish(result: TurnResult, tools: int) -> str:
    return wire.finish_reason(result.finish_reason, tools)


# -- OpenAI chat completions -----------------------------------------------------------------------


class OpenAIDialect:
    name = "openai"

    @staticmethod
    def new_id() -> str:
        return f"chatcmpl-{os.urandom(12).hex()}"  # (uuid4 costs 4x: an object per id)

    @staticmethod
    def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
        return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()

    def http_error(self, status: int, message: str, code: str | None = None) -> bytes:
        type_ = "invalid_request_error" if status < 500 else "server_error"
        return self.error_body(message, type_, code)

    def bad_request(self, error: wire.WireError) -> tuple[int, bytes]:
        return 400, self.error_body(str(error), "invalid_request_error", "invalid_body", error.param or None)

    def parse(self, body, headers=(), query: str = "") -> wire.Request:
        return openai_chat.parse_request(body, headers, query)

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        if result.rejection is not None:
            r = result.rejection
            return r.status, self.error_body(r.message, r.type, "upstream_rejected")
        status, type_, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return status, self.error_body(result.message or "failed", type_, code)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict, request: wire.Request | None = None) -> dict:
        tools = answer_tools(result, ToolIds("call_")) if result.tool_calls else []
        message: dict = {"role": "assistant", "content": result.text or (None if tools else "")}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.blocks:  # an Anthropic provider's: its thinking's signature, its redacted thinking
            message.update(signed_reasoning(result.blocks))
        if result.annotations:  # a search model's url citations, as the provider sent them
            message["annotations"] = list(result.annotations)
        if tools:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                                     for i, n, a in tools]
        return {
            "id": turn_id, "object": "chat.completion", "created": int(time.time()), "model": result.served.model,
            "choices": [{"index": 0, "message": message, "finish_reason": wire.TO_OPENAI[_finish(result, len(tools))]}
                        | ({"logprobs": result.logprobs} if result.logprobs is not None else {})],
            "usage": openai_usage(_usage(result)),
            "relayline": relayline,
        }

    def stream_renderer(self, turn_id: str, request: wire.Request) -> OpenAIStream:
        return OpenAIStream(turn_id, request.include_usage)


class OpenAIStream:
    DELTAS = {"text": "content", "reasoning": "reasoning_content"}

    # slotted, as every per-stream object: thousands of streams are in flight at once
    __slots__ = ("turn_id", "include_usage", "created", "model", "tools", "ids", "slotted", "signatures")

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

    def _chunk(self, delta: dict | None, finish: str | None = None, **extra) -> bytes:
        return _sse({"id": self.turn_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

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
                return _sse({"id": self.turn_id, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": [{"index": 0, "delta": {field: event.value},
                                                               "logprobs": jsoncodec.loads(event.ref),
                                                               "finish_reason": None}]})
            parts = self.slotted.get(field)
            if parts is None:
                parts = self.slotted[field] = _slotted(self._chunk({field: _SLOT}))
            return parts[0] + jsoncodec.dumps(event.value) + parts[1]
        if event.kind == "tool":
            self.tools += 1
            return self._chunk({"tool_calls": [{"index": self.tools - 1, "id": self.ids(event.ref),
                                                "type": "function", "function": {"name": event.value, "arguments": ""}}]})
        if event.kind == "tool_args":
            index = int(event.ref) if event.ref.isdigit() else max(self.tools - 1, 0)  # (ref: an earlier call's)
            return self._chunk({"tool_calls": [{"index": index, "function": {"arguments": event.value}}]})
        if event.kind == "redacted_reasoning":  # (an Anthropic provider's, to be sent back)
            return self._chunk({"reasoning_redacted": [event.value]})
        return b""  # provider-executed tool work has no chunk shape here; it shows in the ledger

    def ok(self, result: TurnResult, relayline: dict) -> bytes:
        if result.served is not None:
            self.model = result.served.model
        finish = wire.TO_OPENAI[_finish(result, self.tools)]
        signed = self._chunk({"reasoning_signature": self.signatures[0]}) if len(self.signatures) == 1 else b""
        return signed + self._finish(finish, result, relayline)

    def _finish(self, finish: str, result: TurnResult, relayline: dict) -> bytes:
        if not self.include_usage:
            # the relayline field rides on the last chunk: a usage-only chunk (choices: []) goes
            # only to clients that asked for it, as the OpenAI API does
            return self._chunk({}, finish, relayline=relayline) + b"data: [DONE]\n\n"
        return (self._chunk({}, finish)
                + self._chunk(None, usage=openai_usage(_usage(result)), relayline=relayline) + b"data: [DONE]\n\n")

    def failed(self, result: TurnResult, relayline: dict) -> bytes:
        # after commit: an explicit error event and no [DONE], never a clean-looking end
        _, type_, code, _ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return _sse({"error": {"message": result.message or "failed", "type": type_, "code": code},
                     "relayline": relayline})


# -- Anthropic messages ----------------------------------------------------------------------------


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

    def parse(self, body, headers=(), query: str = "") -> wire.Request:
        return anthropic_messages.parse_request(body, headers, query)

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        if result.rejection is not None:
            r = result.rejection
            return r.status, self.error_body(r.message, ANTHROPIC_TYPES.get(r.status, "invalid_request_error")
                                             if r.type not in ANTHROPIC_TYPES.values() else r.type)
        status, _, _, type_ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return status, self.error_body(result.message or "failed", type_)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict, request: wire.Request | None = None) -> dict:
        tools = answer_tools(result, ToolIds("toolu_"))
        if result.blocks:  # an Anthropic provider's content as it sent it
            content = [dict(block) for block in result.blocks]
        else:
            content = [{"type": "thinking", "thinking": result.reasoning, "signature": ""}] if result.reasoning else []
            if result.text:
                content.append({"type": "text", "text": result.text})
            content += [{"type": "tool_use", "id": i, "name": n, "input": wire.json_object(a) or {}}
                        for i, n, a in tools]
        return {"id": turn_id, "type": "message", "role": "assistant", "model": result.served.model, "content": content,
                "stop_reason": wire.TO_ANTHROPIC[_finish(result, len(tools))], "stop_sequence": result.stop_sequence,
                "usage": anthropic_usage(_usage(result)), "relayline": relayline}

    def stream_renderer(self, turn_id: str, request: wire.Request) -> AnthropicStream:
        return AnthropicStream(turn_id)


class AnthropicStream:
    """Content blocks are opened as the event kinds change: text, thinking, tool_use."""

    BLOCKS = {"text": ("text", "text_delta", "text"), "reasoning": ("thinking", "thinking_delta", "thinking")}

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
        message = {"id": self.turn_id, "type": "message", "role": "assistant", "content": [], "model": model,
                   "stop_reason": None, "stop_sequence": None, "usage": anthropic_usage(usage or Usage())}
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
        if event.ref and event.kind == "reasoning":  # the signature of the thinking block just shown
            return _sse({"type": "content_block_delta", "index": self.index,
                         "delta": {"type": "signature_delta", "signature": event.ref}},
                        "content_block_delta") if self.block == "reasoning" else b""
        if event.kind in self.BLOCKS:
            block_type, delta_type, field = self.BLOCKS[event.kind]
            if self.block != event.kind:
                start = {"type": block_type, field: ""} | ({"signature": ""} if block_type == "thinking" else {})
                out += self._open(event.kind, start)
            index, kind, head, tail = self.slotted
            if index != self.index or kind != delta_type:
                head, tail = _slotted(_sse({"type": "content_block_delta", "index": self.index,
                                            "delta": {"type": delta_type, field: _SLOT}}, "content_block_delta"))
                self.slotted = (self.index, delta_type, head, tail)
            return out + head + jsoncodec.dumps(event.value) + tail
        if event.kind == "redacted_reasoning":  # a block whole in its start, as Anthropic streams it
            return self._open("redacted", {"type": "redacted_thinking", "data": event.value})
        if event.kind == "tool":
            out = self._open("tool", {"type": "tool_use", "id": self.ids(event.ref), "name": event.value, "input": {}})
            self.tool_blocks.append(self.index)
            return out
        if event.kind == "tool_args":
            # a piece of a call opened before the last one names its place: to its own block (the
            # SDKs gather by index); any other, to the open tool block
            place = int(event.ref) if event.ref.isdigit() else -1
            index = self.tool_blocks[place] if 0 <= place < len(self.tool_blocks) else (
                self.index if self.block == "tool" else None)
            if index is not None:
                return _sse({"type": "content_block_delta", "index": index,
                             "delta": {"type": "input_json_delta", "partial_json": event.value}}, "content_block_delta")
        return b""

    def ok(self, result: TurnResult, relayline: dict) -> bytes:
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": wire.TO_ANTHROPIC[_finish(result, len(self.tool_blocks))],
                           "stop_sequence": result.stop_sequence},
                 "usage": anthropic_usage(_usage(result)), "relayline": relayline}
        return self._close() + _sse(delta, "message_delta") + _sse({"type": "message_stop"}, "message_stop")

    def failed(self, result: TurnResult, relayline: dict) -> bytes:
        _, _, _, type_ = ERRORS.get(result.error or "", UNKNOWN_ERROR)
        return _sse({"type": "error", "error": {"type": type_, "message": result.message or "failed"}}, "error")


class EmbeddingsDialect(OpenAIDialect):
    """OpenAI's embeddings API: errors in OpenAI's shape, the answer a list of vectors."""

    name = "embeddings"

    def parse(self, body, headers=(), query: str = "") -> wire.Request:
        return embeddings.parse_request(body, headers, query)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict, request: wire.Request | None = None) -> dict:
        return embeddings.answer(result, relayline)


class CountTokensDialect(AnthropicDialect):
    """Anthropic's token counting: errors in Anthropic's shape; with no anthropic entry to ask, a
    404 that says so (the count is that API's alone)."""

    name = "count_tokens"

    def parse(self, body, headers=(), query: str = "") -> wire.Request:
        return count_tokens.parse_request(body, headers, query)

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        if result.error == "unsupported":
            return 404, self.error_body("token counting is served by anthropic profiles, and the requested model's "
                                        "chain has none", "not_found_error")
        return super().error(result)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict, request: wire.Request | None = None) -> dict:
        return count_tokens.answer(result, relayline)


class ResponsesDialect(OpenAIDialect):
    """OpenAI's Responses API: errors in OpenAI's shape (the API's own); answers as a `response`
    object, streams as its event sequence (adapters/codecs/responses.py)."""

    name = wire.RESPONSES

    @staticmethod
    def new_id() -> str:
        return responses_codec.new_id("resp")

    def parse(self, body, headers=(), query: str = "") -> wire.Request:
        return responses_codec.parse_request(body, headers, query)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict, request: wire.Request | None = None) -> dict:
        return responses_codec.response_object(turn_id, result, relayline, request)

    def stream_renderer(self, turn_id: str, request: wire.Request) -> responses_codec.ResponsesStream:
        return responses_codec.ResponsesStream(turn_id, request)


OPENAI = OpenAIDialect()
EMBEDDINGS = EmbeddingsDialect()
COUNT_TOKENS = CountTokensDialect()
RESPONSES = ResponsesDialect()
ANTHROPIC = AnthropicDialect()
