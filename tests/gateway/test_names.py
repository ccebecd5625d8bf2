"""What names mean: a model name a gateway client sends that nothing offers is refused before
anything is sent (not answered by another model), a misspelled library keyword is the caller's
TypeError (not a field sent upstream), and a route hint's bare name reads the same way wherever
it is documented to."""

from __future__ import annotations

import logging

import anthropic
import openai
import pytest

from relayline.adapters.relay import Relay, wire_request
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.recorder import RecordingUpstream
from relayline.machines.config import structure_config
from relayline.machines.plan import build_router, model_offered


def _config(url: str, **gateway) -> dict:
    return {
        "active": "openai.main",
        "reliability": {"provider_retries": 0, "backoff_ms": 50},
        "gateway": gateway,
        "providers": {
            "openai.main": {"family": "openai", "base_url": f"{url}/v1", "api_key": "sk-up", "model": "gpt-4o",
                            "fallback_models": ["gpt-4o-mini"]},
            "anthropic.fast": {"family": "anthropic", "base_url": url, "api_key": "sk-up-a"},
        },
        "routes": [{"hint": "fast", "provider": "anthropic.fast", "model": "claude-haiku-4"}],
    }


@pytest.fixture(scope="module")
def upstream():
    with RecordingUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def gw(upstream):
    with BackgroundGateway(_config(upstream.url)) as gateway:
        yield gateway


def _oai(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="none", max_retries=0, timeout=20)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("model", ["gtp-4o-mini-typo", "openai/gpt-4o", "hint:nope", "anthropic.fast/gpt-4o"])
def test_an_unknown_model_is_a_404_naming_it_before_anything_is_sent(gw, upstream, model):
    upstream.seen.clear()
    with pytest.raises(openai.NotFoundError) as caught:
        _oai(gw).chat.completions.create(model=model, messages=HI)
    error = caught.value.body
    assert caught.value.status_code == 404 and error["code"] == "model_not_found"
    assert repr(model) in error["message"] and "GET /v1/models" in error["message"]
    assert "openai.main" not in error["message"] and "sk-" not in error["message"]
    with pytest.raises(anthropic.NotFoundError) as caught_a:
        anthropic.Anthropic(base_url=gw.url, api_key="none", max_retries=0).messages.create(
            model=model, max_tokens=10, messages=HI)
    assert caught_a.value.body["error"]["type"] == "not_found_error"
    assert repr(model) in caught_a.value.body["error"]["message"]
    assert upstream.seen == []  # nothing went upstream


@pytest.mark.parametrize("model, served", [("gpt-4o", "openai.main/gpt-4o"), ("gpt-4o-mini", "openai.main/gpt-4o"),
                                           ("openai.main/gpt-4o", "openai.main/gpt-4o"),
                                           ("fast", "anthropic.fast/claude-haiku-4"),
                                           ("hint:fast", "anthropic.fast/claude-haiku-4")])
def test_every_name_the_config_offers_is_served(gw, model, served):
    reply = _oai(gw).chat.completions.with_raw_response.create(model=model, messages=HI)
    assert reply.headers["x-relayline-served"] == served


def test_a_request_without_a_model_is_a_400_naming_the_parameter(gw, upstream):
    upstream.seen.clear()
    with pytest.raises(openai.BadRequestError) as caught:
        _oai(gw).post("/chat/completions", body={"messages": HI}, cast_to=object)  # the SDK's own transport
    assert caught.value.body["param"] == "model"
    assert upstream.seen == []


def test_unknown_models_default_keeps_the_library_rule(upstream, caplog):
    with BackgroundGateway(_config(upstream.url, unknown_models="default")) as gateway, \
            caplog.at_level(logging.WARNING, "relayline"):
        for _ in range(2):
            reply = _oai(gateway).chat.completions.with_raw_response.create(model="gtp-4o-mini-typo", messages=HI)
            assert reply.headers["x-relayline-served"] == "openai.main/gpt-4o"
            assert reply.headers["x-relayline-requested"] == "openai.main/gtp-4o-mini-typo"
    assert [r.fields["model"] for r in caplog.records if r.getMessage() == "unknown_model"] == ["gtp-4o-mini-typo"]


def test_a_domain_that_starts_unpinned_knows_every_name():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim"}, "b": {"family": "sim", "model": "m"}},
                            "routes": [{"hint": "r", "provider": "b", "model": "m"}]})
    router = build_router(cfg, {})
    assert model_offered(router, "anything-at-all") and model_offered(router, "r")
    assert not model_offered(router, "hint:nope")


def test_a_catalog_id_of_a_default_profile_is_offered():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim", "model": "m1", "models": {"big": "a-big"}}},
                            "catalog": [{"model": "big", "channels": ["a"]}]})
    router = build_router(cfg, {})
    assert all(model_offered(router, name) for name in ("m1", "big", "a-big", "a/m1", "auto"))
    assert not model_offered(router, "m2") and not model_offered(router, "b/m1")


# -- the library ---------------------------------------------------------------------------------


@pytest.fixture
def relay(upstream):
    upstream.seen.clear()
    with Relay(structure_config(_config(upstream.url))) as relay:
        yield relay


def test_a_misspelled_keyword_is_a_type_error_naming_it_and_its_close_match(relay, upstream):
    with pytest.raises(TypeError, match=r"^complete_sync\(\) got .*'temprature'.*did you mean 'temperature'"):
        relay.complete_sync(HI, model="gpt-4o", temprature=0.2)
    with pytest.raises(TypeError, match=r"^stream_sync\(\) got .*'max_token'"):
        relay.stream_sync(HI, model="gpt-4o", max_token=5)
    with pytest.raises(TypeError, match=r"^stream\(\) got .*'max_token'"):
        relay.stream(HI, model="gpt-4o", max_token=5)
    with pytest.raises(TypeError, match=r"^complete_sync\(\): extra_body may not set model"):
        relay.complete_sync(HI, extra_body={"model": "gpt-4o-mini"})
    request = wire_request(HI)
    with pytest.raises(TypeError, match="temperature, extra_body: a wire.Request carries its own"):
        relay.complete_sync(request, model="gpt-4o", temperature=0.2, extra_body={"seed": 1})
    assert upstream.seen == []


def test_vendor_fields_travel_in_extra_body_and_parameters_by_name(relay, upstream):
    relay.complete_sync(HI, model="gpt-4o", temperature=0.2, extra_body={"seed": 7, "logprobs": True})
    with relay.stream_sync(HI, model="gpt-4o", extra_body={"seed": 8}) as turn:
        list(turn)
    first, second = (seen.body for seen in upstream.seen)
    assert first["temperature"] == 0.2 and first["seed"] == 7 and first["logprobs"] is True
    assert second["seed"] == 8 and second["stream"] is True


def test_the_library_serves_a_bare_hint_from_the_default_domain_and_says_how_to_route(relay, caplog):
    with caplog.at_level(logging.WARNING, "relayline"):
        for _ in range(2):
            assert relay.complete_sync(HI, model="fast").served == "openai.main/gpt-4o"
        assert relay.complete_sync(HI, model="hint:fast").served == "anthropic.fast/claude-haiku-4"
        relay.complete_sync(HI, model="gtp-4o-typo")
    events = [(r.getMessage(), getattr(r, "fields", {})) for r in caplog.records]
    assert [f["route_with"] for m, f in events if m == "model_names_route_hint"] == ["hint:fast"]
    assert [f["model"] for m, f in events if m == "unknown_model"] == ["gtp-4o-typo"]
