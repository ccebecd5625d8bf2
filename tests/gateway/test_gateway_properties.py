"""Hypothesis over the gateway's wire: random upstream behaviour (statuses, in-band errors,
truncation, reasoning, tools, pauses), streamed through the real gateway to a raw HTTP client.

Whatever happens upstream, the client sees exactly one of:
- an HTTP error status with an error body, and nothing streamed (a failure before commit);
- a 200 stream that ends with `data: [DONE]` and no error event (a success);
- a 200 stream that ends with one error event and no `[DONE]` (a failure after commit).
Never a clean-looking end to a broken answer, never content after an error event."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayline.adapters.sim.background import BackgroundGateway

words = st.sampled_from(["alpha", "beta", "gamma"])
frame = st.one_of(
    st.just({"role": True}),
    st.just({"ping": True}),
    words.map(lambda w: {"text": w + " "}),
    words.map(lambda w: {"reasoning": w}),
    st.just({"tool_call": "lookup"}),
    st.floats(0.01, 0.05).map(lambda s: {"wait": round(s, 3)}),
)
ending = st.sampled_from([{"done": True}, {"eof": True}, {"error": "overloaded_error"}, {"malformed": True}])
reply = st.one_of(
    words.map(lambda w: {"text": f"{w} answer"}),
    st.just({"status": 503}),
    st.just({"status": 400, "error": "context_length_exceeded"}),
    st.just({"empty": True}),
    st.tuples(st.lists(frame, max_size=5), ending).map(lambda t: {"frames": t[0] + [t[1]]}),
)


def config(retries: int) -> dict:
    return {
        "active": "anthropic.primary",
        "reliability": {"provider_retries": retries, "backoff_ms": 50},
        "timeouts": {"idle_s": 2.0},
        "providers": {
            "anthropic.primary": {"family": "sim", "model": "m1", "fallbacks": ["openai.backup"]},
            "openai.backup": {"family": "sim", "model": "m2"},
        },
    }


@pytest.mark.property
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(primary=st.lists(reply, min_size=1, max_size=3), backup=st.lists(reply, min_size=1, max_size=2),
       retries=st.integers(0, 1))
def test_the_wire_is_always_one_clean_story(primary, backup, retries):
    replies = [{"provider": "anthropic.primary", "script": primary}, {"provider": "openai.backup", "script": backup}]
    with BackgroundGateway(config(retries), replies) as gw:
        for _ in range(2):
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=30,
                              json={"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}) as r:
                body = r.read().decode()
            if r.status_code != 200:
                assert "data:" not in body and "error" in json.loads(body)
                continue
            events = [line[len("data: "):] for line in body.split("\n") if line.startswith("data: ")]
            assert events, body
            errors = [i for i, e in enumerate(events) if e != "[DONE]" and "error" in json.loads(e)]
            if events[-1] == "[DONE]":
                assert not errors, body
            else:
                assert errors == [len(events) - 1], body  # one error event, last, and no [DONE]
