"""Anthropic Messages: POST {base_url}/v1/messages (base_url without the version, as the official
SDK's: https://api.anthropic.com).

The family's transport: where a request goes and with which headers, over the shared connection
pools. Its wire, both ways, is the codecs' (codecs/anthropic_messages_render.py for requests,
codecs/anthropic_messages_replies.py for replies and streams, codecs/count_tokens.py for token
counting).
"""

from __future__ import annotations

from typing import Any

from relayline.machines.turn import Completion

from ..codecs import count_tokens
from ..codecs.anthropic_messages_render import DEFAULT_MAX_TOKENS, render_request
from ..codecs.anthropic_messages_replies import AnthropicStreamParser, parse_reply
from ..codecs.http1 import UpstreamRequest
from .base import CallRequest, credential
from .http import FixedHeads, HttpProvider
from .pool import Pools

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"


class AnthropicProtocol:
    family = "anthropic"

    def __init__(self) -> None:
        self.heads = FixedHeads()
        self.counting_heads = FixedHeads()  # the same profiles' heads for /v1/messages/count_tokens

    def build(self, request: CallRequest) -> UpstreamRequest:
        provider, key = request.entry.provider, request.key
        counting = request.request.counting
        heads, path = (self.counting_heads, "/v1/messages/count_tokens") if counting \
            else (self.heads, "/v1/messages")
        forwarded = request.forwarded_headers("anthropic")
        query = request.forwarded_query("anthropic")
        fixed = heads.get(provider, key, forwarded, query)
        if fixed is None:
            base = (provider.base_url or DEFAULT_BASE_URL).rstrip("/")
            headers = {"content-type": "application/json", "anthropic-version": API_VERSION,
                       **dict(forwarded), **provider.headers}
            if key is not None:
                name, value = credential(provider, key, "x-api-key", key.reveal())
                headers[name] = value
            fixed = heads.keep(provider, key, forwarded, query, f"{base}{path}", headers)
        # the client's body, when the one sent is that body with relayline's own members set (model,
        # stream, stream_options, a default max_tokens)
        sent = None
        if counting:
            body = count_tokens.render_request(request.request, request.model)
        else:
            wire_request = request.wire_request()
            body = render_request(wire_request, request.model, request.stream,
                                  provider.max_output_tokens or DEFAULT_MAX_TOKENS)
            if wire_request.source == "anthropic":
                sent = wire_request.passthrough
        return UpstreamRequest(fixed.url, dict(fixed.headers), request.body_bytes(body, sent),
                               fixed)

    def completion(self, body: dict[str, Any]) -> Completion:
        return parse_reply(body)

    def parser(self) -> AnthropicStreamParser:
        return AnthropicStreamParser()


def AnthropicClient(pools: Pools | None = None) -> HttpProvider:  # noqa: N802 - reads as a class
    return HttpProvider(AnthropicProtocol(), pools)
