"""OpenAI-compatible chat completions: OpenAI, OpenRouter, Groq, vLLM, Ollama, llama.cpp server.

base_url includes the version prefix, as the official SDK's does (https://api.openai.com/v1,
http://127.0.0.1:11434/v1); requests go to {base_url}/chat/completions. Streams ask for usage
(`stream_options.include_usage`). Completion is `data: [DONE]`, or a choice with a finish_reason
(some compatible servers close right after it); EOF before either is truncation.
"""

from __future__ import annotations

import httpx

from relayline.machines import classify as fc
from relayline.machines.ledger import Usage
from relayline.machines.stream import (
    PREAMBLE,
    REASONING,
    ROLE,
    TEXT,
    TOOL_ARGS,
    TOOL_CALL,
    USAGE,
    Frame,
)
from relayline.machines.turn import Completion

from ..sse import SSEEvent
from .base import CallRequest, ProviderFailure
from .http import HttpProvider, json_frame

DEFAULT_BASE_URL = "https://api.openai.com/v1"


def _usage(raw) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    # prompt_tokens already counts cached tokens: keep them apart so they are not billed twice
    return Usage(int(raw.get("prompt_tokens") or 0) - cached, int(raw.get("completion_tokens") or 0), cached)


def _reasoning(message: dict) -> str:
    value = message.get("reasoning_content") or message.get("reasoning") or ""
    return value if isinstance(value, str) else ""


class OpenAIStreamParser:
    def __init__(self) -> None:
        self.done = False
        self.finished = False

    def complete_at_eof(self) -> bool:
        return self.finished

    def feed(self, event: SSEEvent) -> list[Frame]:
        if event.data.strip() == "[DONE]":
            self.done = True
            return []
        obj = json_frame(event)
        error = obj.get("error")
        if error:
            text = error if isinstance(error, str) else " ".join(
                str(error.get(k, "")) for k in ("code", "type", "message") if isinstance(error, dict))
            raise ProviderFailure(fc.classify_stream_error(text))
        frames: list[Frame] = []
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("role"):
                frames.append(Frame(ROLE))
            reasoning = _reasoning(delta)
            if reasoning:
                frames.append(Frame(REASONING, reasoning))
            content = delta.get("content")
            if isinstance(content, str):
                frames.append(Frame(TEXT, content) if content else Frame(PREAMBLE))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if function.get("name"):
                    frames.append(Frame(TOOL_CALL, function["name"]))
                if function.get("arguments"):
                    frames.append(Frame(TOOL_ARGS, function["arguments"]))
            if choice.get("finish_reason"):
                self.finished = True
        usage = _usage(obj.get("usage"))
        if usage is not None:
            frames.append(Frame(USAGE, usage=usage))
        return frames


class OpenAIProtocol:
    def build(self, client: httpx.AsyncClient, request: CallRequest) -> httpx.Request:
        provider = request.entry.provider
        base = (provider.base_url or DEFAULT_BASE_URL).rstrip("/")
        headers = {"content-type": "application/json", **provider.headers}
        if request.key is not None:
            headers["authorization"] = f"Bearer {request.key.reveal()}"
        body: dict = {"model": request.model, "messages": list(request.messages), "stream": request.stream}
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        if request.tools:
            body["tools"] = list(request.tools)
        return client.build_request("POST", f"{base}/chat/completions", json=body, headers=headers)

    def completion(self, body: dict) -> Completion:
        choices = body.get("choices") or []
        message = (choices[0].get("message") if choices and isinstance(choices[0], dict) else None) or {}
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        functions = [c.get("function") or {} for c in message.get("tool_calls") or ()]
        return Completion(text, _reasoning(message), tuple(f.get("name", "") for f in functions),
                          _usage(body.get("usage")) or Usage(), tuple(f.get("arguments") or "" for f in functions))

    def parser(self) -> OpenAIStreamParser:
        return OpenAIStreamParser()


def OpenAIClient(client: httpx.AsyncClient | None = None) -> HttpProvider:  # noqa: N802 - reads as a class
    return HttpProvider(OpenAIProtocol(), client)
