"""GET /v1/models in each client's list shape: the official openai SDK's `models.list()` gets
OpenAI's list, the official anthropic SDK's (it sends `anthropic-version`) Anthropic's page, whose
paging the SDK follows, and a bad key is refused in the asking client's error shape."""

from __future__ import annotations

import anthropic
import openai
import pytest

from relayline.adapters.sim.background import BackgroundGateway

OFFERED = ["fast", "deep", "claude-sonnet-4"]  # the route hints, then the default model


def config() -> dict:
    return {"active": "anthropic.primary",
            "providers": {"anthropic.primary": {"family": "sim", "model": "claude-sonnet-4"},
                          "openai.backup": {"family": "sim", "model": "gpt-4o-mini"}},
            "routes": [{"hint": "fast", "provider": "openai.backup", "model": "gpt-4o-mini"},
                       {"hint": "deep", "provider": "anthropic.primary", "model": "claude-sonnet-4"}]}


def claude(gw, key="unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=20)


def test_the_anthropic_sdk_lists_the_offered_models_in_anthropics_shape():
    with BackgroundGateway(config()) as gw:
        page = claude(gw).models.list()
        paged = [m.id for m in claude(gw).models.list(limit=2)]  # the SDK follows has_more/last_id
        second = claude(gw).models.list(limit=2, after_id="deep")
        before = claude(gw).models.list(limit=1, before_id="claude-sonnet-4")
        chat = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0).models.list()
    assert [m.id for m in page.data] == OFFERED and paged == OFFERED
    model = page.data[0]
    assert (model.type, model.display_name, model.lifecycle, model.created_at.year) == ("model", "fast", "active", 1970)
    assert (page.has_more, page.first_id, page.last_id) == (False, "fast", "claude-sonnet-4")
    assert [m.id for m in second.data] == ["claude-sonnet-4"] and second.has_more is False
    assert [m.id for m in before.data] == ["deep"] and before.has_more is True
    assert [m.id for m in chat.data] == OFFERED and chat.data[0].object == "model"


def test_a_bad_key_on_the_anthropic_list_is_refused_in_anthropics_shape():
    with BackgroundGateway(config(), api_keys={"gw-secret"}) as gw, pytest.raises(anthropic.AuthenticationError) as info:
        claude(gw, "wrong").models.list()
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
