"""docs/concepts.md "Refusals" at the gateway: the official openai and anthropic SDKs as clients, sim
upstreams speaking the real protocols over loopback (an Anthropic `refusal` stop reason, an
OpenAI `content_filter` finish reason, a content-policy 400)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from relayline.adapters.sim.background import BackgroundGateway

HI = [{"role": "user", "content": "hi"}]
REFUSE = {"text": "I can't help with that.", "finish": "content_filter"}
REFUSE_BEFORE_OUTPUT = {"frames": [{"role": True}, {"done": True, "finish": "content_filter"}]}
POLICY_400 = {"status": 400, "error": "content_policy_violation"}


def config(on_refusal: str) -> dict:
    return {
        "active": "anthropic.a",
        "reliability": {"provider_retries": 0, "on_refusal": on_refusal},
        "notices": {"model_fallback_notice": "redacted"},
        "providers": {
            "anthropic.a": {"family": "sim", "model": "claude-x", "fallbacks": ["openai.b"]},
            "openai.b": {"family": "sim", "model": "gpt-y"},
        },
    }


def gpt(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)


def claude(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=20)


def test_return_gives_the_refusal_to_both_dialects_with_its_finish_reason():
    replies = [{"provider": "anthropic.a", "script": [REFUSE]}]
    with BackgroundGateway(config("return"), replies) as gw:
        completion = gpt(gw).chat.completions.create(model="claude-x", messages=HI)
        message = claude(gw).messages.create(model="claude-x", max_tokens=64, messages=HI)
    assert completion.choices[0].finish_reason == "content_filter"
    assert completion.choices[0].message.content == "I can't help with that."
    assert message.stop_reason == "refusal" and message.content[0].text == "I can't help with that."


def test_advance_serves_a_stream_from_another_profile_after_a_refusal_before_output():
    replies = [{"provider": "anthropic.a", "script": [REFUSE_BEFORE_OUTPUT]},
               {"provider": "openai.b", "script": [{"text": "from b"}]}]
    with BackgroundGateway(config("advance"), replies) as gw:
        with gpt(gw).chat.completions.with_streaming_response.create(model="claude-x", messages=HI,
                                                                     stream=True) as response:
            served = response.headers["x-relayline-served"]
            chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "from b" and served == "openai.b/gpt-y"
    relayline = chunks[-1].model_extra["relayline"]
    assert relayline["attempts"] == ["anthropic.a/claude-x refused", "openai.b/gpt-y ok"]
    assert relayline["notice"] and "fallback" in relayline["notice"]


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_a_refusal_with_nothing_to_show_and_nothing_left_is_still_a_clean_stream(dialect):
    replies = [{"provider": "anthropic.a", "script": [REFUSE_BEFORE_OUTPUT]},
               {"provider": "openai.b", "script": [REFUSE_BEFORE_OUTPUT]}]
    with BackgroundGateway(config("advance"), replies) as gw:
        if dialect == "openai":
            chunks = list(gpt(gw).chat.completions.create(model="claude-x", messages=HI, stream=True))
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finishes == ["content_filter"]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        else:
            with claude(gw).messages.stream(model="claude-x", max_tokens=64, messages=HI) as stream:
                final = stream.get_final_message()
            assert final.stop_reason == "refusal" and final.content == []


def test_content_policy_400s_everywhere_are_the_upstreams_client_error():
    replies = [{"provider": "anthropic.a", "script": [POLICY_400]}, {"provider": "openai.b", "script": [POLICY_400]}]
    with BackgroundGateway(config("advance"), replies) as gw:
        with pytest.raises(openai.BadRequestError) as info:
            gpt(gw).chat.completions.create(model="claude-x", messages=HI)
    assert info.value.status_code == 400
    assert info.value.response.headers["x-relayline-attempts"] == "2"
