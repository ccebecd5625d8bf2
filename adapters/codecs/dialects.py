"""The dialects the gateway speaks to its clients, each a codec that reads a request into the
canonical model and writes results, stream events and errors back in its own shape: OpenAI chat
completions and Anthropic messages, and the APIs built on their error shapes (OpenAI's
embeddings and Responses API, Anthropic's token counting). The gateway (what to hold, when to
commit, when to flush) is the same for all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relayline.machines import wire
from relayline.machines.turn import TurnResult

from . import count_tokens, embeddings, responses, responses_answers
from .anthropic_messages_answers import AnthropicDialect
from .openai_chat_answers import OpenAIDialect


class EmbeddingsDialect(OpenAIDialect):
    """OpenAI's embeddings API: errors in OpenAI's shape, the answer a list of vectors."""

    name = "embeddings"

    def parse(self, body: object, headers: Iterable[tuple[str, str]] = (),
              query: str = "", read: wire.ReadBytes | None = None) -> wire.Request:
        return embeddings.parse_request(body, headers, query)  # (its body is written anew)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict[str, Any],
                   request: wire.Request | None = None) -> dict[str, Any]:
        return embeddings.answer(result, relayline)


class CountTokensDialect(AnthropicDialect):
    """Anthropic's token counting: errors in Anthropic's shape; with no anthropic entry to ask, a
    404 that says so (the count is that API's alone)."""

    name = "count_tokens"

    def parse(self, body: object, headers: Iterable[tuple[str, str]] = (),
              query: str = "", read: wire.ReadBytes | None = None) -> wire.Request:
        return count_tokens.parse_request(body, headers, query)  # (its body is written anew)

    def error(self, result: TurnResult) -> tuple[int, bytes]:
        if result.error == "unsupported":
            return 404, self.error_body("token counting is served by anthropic profiles, and the "
                                        "requested model's chain has none", "not_found_error")
        return super().error(result)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict[str, Any],
                   request: wire.Request | None = None) -> dict[str, Any]:
        return count_tokens.answer(result, relayline)


class ResponsesDialect(OpenAIDialect):
    """OpenAI's Responses API: errors in OpenAI's shape (the API's own); answers as a `response`
    object, streams as its event sequence (codecs/responses_answers.py)."""

    name = wire.RESPONSES

    @staticmethod
    def new_id() -> str:
        return responses_answers.new_id("resp")

    def parse(self, body: object, headers: Iterable[tuple[str, str]] = (),
              query: str = "", read: wire.ReadBytes | None = None) -> wire.Request:
        return responses.parse_request(body, headers, query, read=read)

    def completion(self, turn_id: str, result: TurnResult, relayline: dict[str, Any],
                   request: wire.Request | None = None) -> dict[str, Any]:
        return responses_answers.response_object(turn_id, result, relayline, request)

    def stream_renderer(self, turn_id: str, request: wire.Request
                        ) -> responses_answers.ResponsesStream:
        return responses_answers.ResponsesStream(turn_id, request)


OPENAI = OpenAIDialect()
EMBEDDINGS = EmbeddingsDialect()
COUNT_TOKENS = CountTokensDialect()
RESPONSES = ResponsesDialect()
ANTHROPIC = AnthropicDialect()
# a client dialect: each of the above is one of the two shapes, OpenAI's or Anthropic's
Dialect = OpenAIDialect | AnthropicDialect
