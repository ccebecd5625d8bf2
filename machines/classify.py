"""Failure classification: what a provider's answer means for the walk.

Providers disagree on how they say "your prompt is too long" or "you are out of credit"; the
walk must not. Everything a provider sends (status, error code, message, Retry-After headers) is
reduced here to one of the failure classes (docs/concepts.md) plus a short `detail` that relayline
writes itself. The provider's message is read, never kept: it does not reach errors or traces.
"""

from __future__ import annotations

import email.utils
import re
from collections.abc import Mapping

import attrs

from .vocab import FailureClass, Outcome

OK = Outcome.OK
EMPTY = FailureClass.EMPTY
RETRYABLE = FailureClass.RETRYABLE
MALFORMED = FailureClass.MALFORMED
TIMEOUT = FailureClass.TIMEOUT
RATE_LIMITED = FailureClass.RATE_LIMITED
QUOTA = FailureClass.QUOTA
CONTEXT_WINDOW = FailureClass.CONTEXT_WINDOW
REJECTED = FailureClass.REJECTED
REFUSED = FailureClass.REFUSED
TOO_LARGE = FailureClass.TOO_LARGE
INTERNAL = FailureClass.INTERNAL

FAILURE_CLASSES = tuple(FailureClass)
# only these teach the breaker anything about a profile's health
BREAKER_CLASSES = frozenset({RETRYABLE, MALFORMED, TIMEOUT})

# Context-window phrasings seen from OpenAI, Anthropic, OpenRouter, Groq, vLLM, Ollama, llama.cpp
_CONTEXT = re.compile(
    r"context_length_exceeded|maximum context length|context length|context window|"
    r"prompt is too long|too many tokens|exceeds? the (?:available )?context|"
    r"input (?:is )?too long|reduce the length of the (?:messages|prompt)|n_ctx|"
    r"string_above_max_length|model_context_window_exceeded|input length exceeds",
    re.IGNORECASE,
)
# Quota and billing: a 429 that waiting will not fix
_QUOTA = re.compile(
    r"insufficient_quota|exceeded your current quota|quota exceeded|"
    r"insufficient (?:balance|credits?|funds)|credit balance is too low|billing|payment required|"
    r"plan does not include|not (?:available|included) (?:on|in) your (?:current )?plan|"
    r"upgrade your plan",
    re.IGNORECASE,
)
# Content policy: OpenAI's content_policy_violation, Azure's content_filter, and their phrasings
_CONTENT_POLICY = re.compile(
    r"content_policy_violation|content_filter|content[ _-]policy|content management policy",
    re.IGNORECASE,
)
# 4xx statuses that waiting fixes (beside 5xx): timeouts, conflicts, too early, and Groq's 498
# (its flex tier out of capacity, which its documentation says to retry with backoff)
RETRYABLE_STATUSES = frozenset({408, 409, 425, 498})
_OVERLOADED = re.compile(r"overloaded|server_error|internal|unavailable|timeout|api_error",
                         re.IGNORECASE)


@attrs.frozen
class Failure:
    kind: FailureClass
    detail: str  # written by relayline: "HTTP 503", "connection error", never a provider body
    status: int | None = None
    retry_after_s: float | None = None
    # a client rejection's upstream error type and message, bounded and redacted by the adapter:
    # the one provider text a client gets back (docs/wire.md), never in `detail`
    error_type: str | None = attrs.field(default=None, repr=False)
    error_message: str | None = attrs.field(default=None, repr=False)


def parse_retry_after(headers: Mapping[str, str] | None,
                      now_epoch: float | None = None) -> float | None:
    """Seconds to wait, from retry-after-ms, or Retry-After as seconds or an HTTP date."""
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    ms = lowered.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
            if value >= 0:
                return value
        except ValueError:
            pass
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
        return value if value >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None or now_epoch is None:
        return None
    return max(0.0, when.timestamp() - now_epoch)


def classify_http(
    status: int,
    error: str | None = None,
    headers: Mapping[str, str] | None = None,
    now_epoch: float | None = None,
) -> Failure:
    """Classify an HTTP error response. `error` is the provider's code and/or message."""
    text = error or ""
    retry_after = parse_retry_after(headers, now_epoch)
    detail = f"HTTP {status}"
    if _CONTEXT.search(text) and status in (400, 413, 422, 500):
        # some servers (llama.cpp, older vLLM) answer 500 for an over-long prompt
        return Failure(CONTEXT_WINDOW, f"{detail} context window exceeded", status)
    if _QUOTA.search(text) and status in (400, 402, 403, 429):
        return Failure(QUOTA, f"{detail} quota or billing", status)
    if _CONTENT_POLICY.search(text) and status == 400:
        return Failure(REFUSED, f"{detail} content policy", status)
    if status == 429:
        return Failure(RATE_LIMITED, f"{detail} rate limited", status, retry_after)
    if status in RETRYABLE_STATUSES or status >= 500:
        return Failure(RETRYABLE, detail, status, retry_after)
    return Failure(REJECTED, detail, status)


def classify_stream_error(error: str | None) -> Failure:
    """An in-band error event in a stream (Anthropic `error`, an OpenAI chunk with `error`)."""
    text = error or ""
    if _CONTEXT.search(text):
        return Failure(CONTEXT_WINDOW, "stream error: context window exceeded")
    if _QUOTA.search(text):
        return Failure(QUOTA, "stream error: quota or billing")
    if "rate_limit" in text.lower():
        return Failure(RATE_LIMITED, "stream error: rate limited")
    if _CONTENT_POLICY.search(text):
        return Failure(REFUSED, "stream error: content policy")
    if text.lower() in ("invalid_request_error", "authentication_error", "permission_error",
                        "not_found_error"):
        return Failure(REJECTED, f"stream error: {text.lower()}")
    detail = "stream error: overloaded" if _OVERLOADED.search(text) else "stream error"
    return Failure(RETRYABLE, detail)


def malformed(detail: str) -> Failure:
    """A reply of the wrong shape; `detail` names the field, never its value."""
    return Failure(MALFORMED, f"malformed response: {detail}")


def connection_error() -> Failure:
    return Failure(RETRYABLE, "connection error")


def truncated(detail: str = "stream truncated before its completion signal") -> Failure:
    return Failure(RETRYABLE, detail)


def timed_out(what: str, seconds: float) -> Failure:
    return Failure(TIMEOUT, f"no {what} within {seconds:g}s")


def too_large(limit: int, what: str = "response") -> Failure:
    return Failure(TOO_LARGE, f"{what} larger than limits.max_response_bytes ({limit} bytes)")


def internal(exc: BaseException) -> Failure:
    # the exception's type only: its message may quote a provider body or a request
    return Failure(INTERNAL, f"internal error ({type(exc).__name__})")
