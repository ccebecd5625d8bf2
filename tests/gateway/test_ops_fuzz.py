"""Fuzzed: whatever clients send and upstreams answer, no configured secret and no prompt text
reaches the gateway's logs (every logger, at DEBUG), its metrics, its admin output or its error
responses. Requests mix valid and broken bodies, streams, wrong and right keys, odd paths and
request ids; the upstreams fail, rate-limit, cut streams and answer. (`make fuzz` runs it long.)"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_ops import Captured

from relayline.adapters.sim.background import BackgroundGateway

pytestmark = [pytest.mark.property, pytest.mark.fuzz]

PROVIDER_KEYS = ("sk-prov-7QmT2-secret", "sk-pool-a-9XkL-secret", "sk-pool-b-4RzW-secret")
CLIENT_KEY = "gw-client-3HdY-secret"
ADMIN_KEY = "gw-admin-8PvN-secret"
SECRETS = (*PROVIDER_KEYS, CLIENT_KEY, ADMIN_KEY)
MARKER = "PROMPTMARK"  # every prompt carries it; nothing an operator reads may

REPLIES = [
    {"provider": "openai.main", "script": [
        {"status": 500}, {"text": "fine"}, {"status": 429, "retry_after": 1}, {"frames": [
            {"role": True}, {"text": "part"}, {"error": "overloaded_error"}]},
        {"status": 401, "error": "invalid_api_key"}, {"text": "again"}, {"empty": True, "usage": [5, 0]}]},
    {"provider": "anthropic.backup", "script": [
        {"text": "backup"}, {"status": 529}, {"frames": [{"role": True}, {"text": "b"}, {"done": True}]}]},
]
CONFIG = {
    "active": "openai.main",
    "reliability": {"provider_retries": 1, "backoff_ms": 50},
    "breaker": {"failure_threshold": 2, "open_s": 0.2},
    "notices": {"model_fallback_notice": "detailed"},
    "providers": {
        "openai.main": {"family": "sim", "model": "gpt-4o", "fallbacks": ["anthropic.backup"],
                        "api_keys": list(PROVIDER_KEYS[1:]), "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
        "anthropic.backup": {"family": "sim", "model": "claude-haiku", "api_key": PROVIDER_KEYS[0]},
    },
}

prompts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40).map(
    lambda t: f"{t} {MARKER} {t}")
keys = st.sampled_from([None, CLIENT_KEY, ADMIN_KEY, "wrong", CLIENT_KEY[:-1], CLIENT_KEY + "x"])


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(["openai", "anthropic", "admin", "odd"]))
    key = draw(keys)
    headers = {}
    if key is not None:
        headers["x-api-key" if draw(st.booleans()) else "authorization"] = (
            key if "x-api-key" in headers or draw(st.booleans()) else f"Bearer {key}")
    if draw(st.booleans()):
        headers["x-request-id"] = draw(st.text(alphabet="abcXYZ019-_.:/@%", min_size=1, max_size=20))
    prompt = draw(prompts)
    stream = draw(st.booleans())
    if kind == "openai":
        body = {"model": draw(st.sampled_from(["gpt-4o", "claude-haiku", "nobody"])), "stream": stream,
                "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": prompt}]}
        return "POST", "/v1/chat/completions", headers, _maybe_break(draw, body)
    if kind == "anthropic":
        body = {"model": "gpt-4o", "max_tokens": 16, "stream": stream, "system": prompt,
                "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]}
        return "POST", "/v1/messages", headers, _maybe_break(draw, body)
    if kind == "admin":
        path = draw(st.sampled_from(["/metrics", "/admin/health", "/admin/plan?model=gpt-4o", "/readyz"]))
        return "GET", path, headers, None
    return draw(st.sampled_from(["GET", "POST", "DELETE"])), "/v1/" + draw(st.sampled_from(["x", "models"])), \
        headers, None


def _maybe_break(draw, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    how = draw(st.sampled_from(["whole", "whole", "truncated", "not-json"]))
    if how == "truncated":
        return raw[: draw(st.integers(1, len(raw) - 1))]
    if how == "not-json":
        return f"{{{MARKER}: nope".encode()
    return raw


def test_no_secret_and_no_prompt_text_in_logs_metrics_admin_output_or_errors():
    seen: list[str] = []
    with Captured(logging.DEBUG) as logs, BackgroundGateway(CONFIG, REPLIES, api_keys={CLIENT_KEY},
                                                            admin_keys={ADMIN_KEY}) as gw:
        http = httpx.Client(base_url=gw.url, timeout=20)

        @given(st.lists(requests(), min_size=1, max_size=4))
        def exchange(batch):
            for method, path, headers, body in batch:
                response = http.request(method, path, headers=headers, content=body)
                text = response.text
                if response.status_code != 200 or path.startswith(("/admin", "/metrics", "/readyz")):
                    assert MARKER not in text, (path, response.status_code, text[:300])
                seen.append(text)
                seen.append(json.dumps(dict(response.headers)))

        exchange()
        for path in ("/metrics", "/admin/health", "/admin/plan?model=gpt-4o"):
            out = http.get(path, headers={"authorization": f"Bearer {ADMIN_KEY}"})
            assert out.status_code == 200 and MARKER not in out.text
            seen.append(out.text)
        http.close()
    log_text = logs.text
    assert log_text.count('"logger": "relayline.access"') >= 20  # the run did log, and was looked at
    assert MARKER not in log_text
    everything = log_text + "".join(seen)
    for secret in SECRETS:
        assert secret not in everything, secret
