"""Anthropic Messages: POST {base_url}/v1/messages (base_url without the version, as the official
SDK's: https://api.anthropic.com).

Stream events: message_start (preamble; input and cache usage), content_block_start / delta /
stop (text, thinking as reasoning, tool_use with input_json_delta, server_tool_use and its
results as provider-executed tool work), ping, message_delta (stop_reason, output usage),
message_stop (the completion signal), and in-band `error` events. EOF after
message_delta.stop_reason but before message_stop is truncation.
"""

from __future__ import annotations

import json

import httpx

from relayline.machines import classify as fc
from relayline.machines.ledger import Usage
from relayline.machines.stream import (
    EXECUTED_TOOL,
    PING,
    PREAMBLE,
    REASONING,
    TEXT,
    TOOL_ARGS,
    TOOL_CALL,
    USAGE,
    Frame,
)
from relayline.machines.turn import Completion

from ..messages import openai_to_anthropic
from ..sse import SSEEvent
from .base import CallRequest, ProviderFailure
from .http import HttpProvider, json_frame

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096


def _usage(raw: dict, output: int | None = None) -> Usage:
    return Usage(
        int(raw.get("input_tokens") or 0),
        int(output if output is not None else raw.get("output_tokens") or 0),
        int(raw.get("cache_read_input_tokens") or 0),
        int(raw.get("cache_creation_input_tokens") or 0),
    )


def _executed(block_type: str) -> bool:
    return block_type == "server_tool_use" or block_type.endswith("_tool_result")


class AnthropicStreamParser:
    def __init__(self) -> None:
        self.done = False
        self.stopped = False
        self.usage = Usage()
        self.blocks: dict[int, str] = {}

    def complete_at_eof(self) -> bool:
        return False  # message_stop is required, even after a stop_reason

    def feed(self, event: SSEEvent) -> list[Frame]:
        obj = json_frame(event)
        kind = obj.get("type") or event.event
        if kind == "content_block_delta":
            delta = obj.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "text_delta":
                return [Frame(TEXT, delta.get("text") or "")]
            if dtype == "thinking_delta":
                return [Frame(REASONING, delta.get("thinking") or "")]
            if dtype == "input_json_delta" and not _executed(self.blocks.get(obj.get("index"), "")):
                return [Frame(TOOL_ARGS, delta.get("partial_json") or "")]
            return []  # signature_delta, citations_delta: nothing to show
        if kind == "content_block_start":
            block = obj.get("content_block") or {}
            btype = block.get("type", "")
            self.blocks[obj.get("index")] = btype
            if btype == "text":
                return [Frame(TEXT, block.get("text") or "")]
            if btype == "thinking":
                return [Frame(REASONING, block.get("thinking") or "")]
            if btype == "tool_use":
                return [Frame(TOOL_CALL, block.get("name") or "")]
            if _executed(btype):
                return [Frame(EXECUTED_TOOL, block.get("name") or btype)]
            return [Frame(PREAMBLE, btype)]
        if kind == "ping":
            return [Frame(PING)]
        if kind == "message_start":
            self.usage = _usage((obj.get("message") or {}).get("usage") or {})
            return [Frame(PREAMBLE, "message_start")]
        if kind == "message_delta":
            if (obj.get("delta") or {}).get("stop_reason"):
                self.stopped = True
            usage = obj.get("usage") or {}
            self.usage = Usage(
                int(usage.get("input_tokens") or self.usage.input_tokens),
                int(usage.get("output_tokens") or 0),
                int(usage.get("cache_read_input_tokens") or self.usage.cache_read_tokens),
                int(usage.get("cache_creation_input_tokens") or self.usage.cache_write_tokens),
            )
            return [Frame(USAGE, usage=self.usage)]
        if kind == "message_stop":
            self.done = True
            return []
        if kind == "error":
            error = obj.get("error") or {}
            raise ProviderFailure(fc.classify_stream_error(f"{error.get('type', '')} {error.get('message', '')}".strip()))
        return []  # content_block_stop, unknown future events


def _anthropic_tools(tools) -> list[dict]:
    out = []
    for tool in tools:
        fn = tool.get("function") if tool.get("type") == "function" else None
        if fn is not None:
            out.append({"name": fn.get("name"), "description": fn.get("description", ""),
                        "input_schema": fn.get("parameters") or {"type": "object"}})
        else:
            out.append(dict(tool))
    return out


class AnthropicProtocol:
    def build(self, client: httpx.AsyncClient, request: CallRequest) -> httpx.Request:
        provider = request.entry.provider
        base = (provider.base_url or DEFAULT_BASE_URL).rstrip("/")
        headers = {"content-type": "application/json", "anthropic-version": API_VERSION, **provider.headers}
        if request.key is not None:
            headers["x-api-key"] = request.key.reveal()
        system, messages = openai_to_anthropic(request.messages)
        body: dict = {"model": request.model, "max_tokens": DEFAULT_MAX_TOKENS, "messages": messages,
                      "stream": request.stream}
        if system:
            body["system"] = system
        if request.tools:
            body["tools"] = _anthropic_tools(request.tools)
        return client.build_request("POST", f"{base}/v1/messages", json=body, headers=headers)

    def completion(self, body: dict) -> Completion:
        text, reasoning, tools, arguments = [], [], [], []
        for block in body.get("content") or ():
            btype = block.get("type")
            if btype == "text":
                text.append(block.get("text") or "")
            elif btype == "thinking":
                reasoning.append(block.get("thinking") or "")
            elif btype == "tool_use":
                tools.append(block.get("name") or "")
                arguments.append(json.dumps(block.get("input") or {}))
        return Completion("".join(text), "".join(reasoning), tuple(tools), _usage(body.get("usage") or {}),
                          tuple(arguments))

    def parser(self) -> AnthropicStreamParser:
        return AnthropicStreamParser()


def AnthropicClient(client: httpx.AsyncClient | None = None) -> HttpProvider:  # noqa: N802 - reads as a class
    return HttpProvider(AnthropicProtocol(), client)
