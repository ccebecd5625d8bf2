"""Failure classification from what real providers send."""

import email.utils

import pytest

from relayline.machines import classify as fc


@pytest.mark.parametrize("status,body,kind", [
    (503, None, fc.RETRYABLE),
    (500, "internal error", fc.RETRYABLE),
    (502, None, fc.RETRYABLE),
    (408, None, fc.RETRYABLE),
    (529, '{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}', fc.RETRYABLE),
    (429, '{"error":{"type":"rate_limit_error"}}', fc.RATE_LIMITED),
    (429, '{"error":{"code":"insufficient_quota","message":"You exceeded your current quota"}}', fc.QUOTA),
    (402, '{"error":{"message":"Insufficient credits"}}', fc.QUOTA),
    (400, "Your credit balance is too low to access the Anthropic API", fc.QUOTA),
    (403, "The model is not available on your current plan", fc.QUOTA),
    # context windows, as OpenAI, Anthropic, OpenRouter, Groq, vLLM, Ollama, llama.cpp word them
    (400, '{"error":{"code":"context_length_exceeded"}}', fc.CONTEXT_WINDOW),
    (400, "prompt is too long: 210000 tokens > 200000 maximum", fc.CONTEXT_WINDOW),
    (400, "This endpoint's maximum context length is 128000 tokens", fc.CONTEXT_WINDOW),
    (400, "Please reduce the length of the messages or completion.", fc.CONTEXT_WINDOW),
    (400, "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens", fc.CONTEXT_WINDOW),
    (400, "input length exceeds maximum context length", fc.CONTEXT_WINDOW),
    (500, "the request exceeds the available context size, try increasing it", fc.CONTEXT_WINDOW),
    (401, '{"error":{"code":"invalid_api_key"}}', fc.REJECTED),
    (404, "model_not_found", fc.REJECTED),
    (422, None, fc.REJECTED),
    # content policy: a refusal (the turn keeps it a rejection unless on_refusal = "advance")
    (400, "content_policy_violation", fc.REFUSED),
    (400, '{"error":{"code":"content_filter","message":"The response was filtered"}}', fc.REFUSED),
    (400, '{"error":{"message":"Your request was rejected as a result of our safety system","code":'
          '"content_policy_violation","type":"invalid_request_error"}}', fc.REFUSED),
    (403, "content_policy_violation", fc.REJECTED),  # only a 400 names a refusal
])
def test_http_classification(status, body, kind):
    assert fc.classify_http(status, body).kind == kind


def test_detail_never_carries_the_provider_body():
    failure = fc.classify_http(500, "secret-ish provider text sk-abc")
    assert "sk-abc" not in failure.detail and "provider text" not in failure.detail


def test_retry_after_seconds_ms_and_http_date():
    assert fc.parse_retry_after({"Retry-After": "7"}) == 7.0
    assert fc.parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 42, usegmt=True)
    assert fc.parse_retry_after({"Retry-After": date}, now_epoch=now) == pytest.approx(42, abs=1)
    assert fc.parse_retry_after({"Retry-After": "soon"}) is None
    assert fc.parse_retry_after({"Retry-After": "-3"}) is None


def test_a_429_carries_its_retry_after():
    assert fc.classify_http(429, None, {"retry-after": "12"}).retry_after_s == 12.0


@pytest.mark.parametrize("error,kind", [
    ("overloaded_error", fc.RETRYABLE),
    ("api_error", fc.RETRYABLE),
    ("rate_limit_error", fc.RATE_LIMITED),
    ("invalid_request_error", fc.REJECTED),
    ("content_filter", fc.REFUSED),
])
def test_in_band_stream_errors(error, kind):
    assert fc.classify_stream_error(error).kind == kind
