"""OpenAI-compatible chat completions: OpenAI, OpenRouter, Groq, vLLM, Ollama, llama.cpp server.

The family's transport: where a request goes and with which headers, over the shared connection
pools. Its wire, both ways, is the codecs' (codecs/openai_chat_render.py for requests,
codecs/openai_chat_replies.py for replies, and the Responses API and embeddings codecs for a
profile asked in those APIs).

base_url includes the version prefix, as the official SDK's does (https://api.openai.com/v1,
http://127.0.0.1:11434/v1); requests go to {base_url}/chat/completions. Streams ask for usage
(`stream_options.include_usage`).
"""

from __future__ import annotations

from typing import Any

from relayline.machines import wire as w
from relayline.machines.turn import Completion

from ..codecs import embeddings, responses
from ..codecs.http1 import UpstreamRequest
from ..codecs.openai_chat_render import render_request
from ..codecs.openai_chat_replies import OpenAIStreamParser, parse_reply
from .base import CallRequest, credential
from .http import FixedHeads, HttpProvider
from .pool import Pools

DEFAULT_BASE_URL = "https://api.openai.com/v1"


class OpenAIProtocol:
    family = "openai"

    def __init__(self) -> None:
        self.heads = FixedHeads()
        self.responses_heads = FixedHeads()  # the same profiles' heads for {base_url}/responses
        self.embeddings_heads = FixedHeads()  # and for {base_url}/embeddings

    def build(self, request: CallRequest) -> UpstreamRequest:
        provider, key = request.entry.provider, request.key
        wire_request = request.wire_request()
        own_responses = wire_request.passthrough is not None \
            and wire_request.source == w.RESPONSES and provider.capabilities.responses
        heads, path = (self.responses_heads, "/responses") if own_responses \
            else (self.heads, "/chat/completions")
        if wire_request.embedding is not None:
            heads, path = self.embeddings_heads, "/embeddings"
        forwarded, query = request.forwarded_headers("openai"), request.forwarded_query("openai")
        fixed = heads.get(provider, key, forwarded, query)
        if fixed is None:
            base = (provider.base_url or DEFAULT_BASE_URL).rstrip("/")
            headers = {"content-type": "application/json", **dict(forwarded), **provider.headers}
            if key is not None:
                name, value = credential(provider, key, "authorization", f"Bearer {key.reveal()}")
                headers[name] = value
            fixed = heads.keep(provider, key, forwarded, query, f"{base}{path}", headers)
        # the client's body, when the one sent is that body with relayline's own members set (model,
        # stream, stream_options, a default max_tokens)
        sent = None
        if wire_request.embedding is not None:
            body = embeddings.render_request(wire_request, request.model)
        elif own_responses and wire_request.passthrough is not None:
            body = responses.render_request(wire_request.passthrough, request.model, request.stream)
            sent = wire_request.passthrough
        else:
            body = render_request(wire_request, request.model, request.stream)
            if wire_request.source == "openai":
                sent = wire_request.passthrough
        return UpstreamRequest(fixed.url, dict(fixed.headers), request.body_bytes(body, sent),
                               fixed)

    def completion(self, body: dict[str, Any]) -> Completion:
        return parse_reply(body)

    def parser(self) -> OpenAIStreamParser:
        return OpenAIStreamParser()


def OpenAIClient(pools: Pools | None = None) -> HttpProvider:  # noqa: N802 - reads as a class
    return HttpProvider(OpenAIProtocol(), pools)
