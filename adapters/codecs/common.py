"""What every client dialect's codec shares: the error each turn failure is, in each dialect's
words, and the tool call ids an answer gives its client."""

from __future__ import annotations

import os

from relayline.machines.turn import TurnResult

# turn error reason -> (HTTP status, OpenAI error type, code, Anthropic error type)
ERRORS = {
    "context_window": (400, "invalid_request_error", "context_length_exceeded", "invalid_request_error"),
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
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
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
    return [(ids(i), name, args or "{}") for i, name, args in zip(given, result.tool_calls, arguments, strict=False)]
