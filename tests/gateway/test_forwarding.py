"""What of the client's request reaches a provider beyond its body: its headers (only each
family's own version and beta headers, and those a profile names in `forward_headers`; never a
credential or a billing choice otherwise) and the query of its URL (on the same-family path).
The official SDKs in front of a real gateway, a recording loopback upstream behind it."""

from __future__ import annotations

import logging
import time

import anthropic
import openai
import pytest

from helpers import base_url
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.recorder import RecordingUpstream

CLIENT_HEADERS = {"openai-organization": "org-7", "openai-project": "proj-9", "openai-beta": "assistants=v2",
                  "anthropic-beta": "prompt-caching-2024-07-31", "x-trace-id": "t-1", "x-custom": "c",
                  "x-pinned": "from-client"}


def _gateway(named: bool):
    """Profiles of both families that name no header (oa-plain, an-plain) and, when `named`,
    two that name some (oa-named, an-named), each behind the route hint of its name."""
    with RecordingUpstream() as upstream:
        def profile(family, model, **extra):
            return {"family": family, "base_url": base_url(family, upstream.url), "api_key": f"sk-up-{model}", "model": model, **extra}

        forwarding = {"forward_headers": ["x-trace-id", "OpenAI-Organization", "x-pinned"],
                      "headers": {"X-Pinned": "from-profile"}}
        providers = {"oa.plain": profile("openai", "gpt-plain"), "an.plain": profile("anthropic", "claude-plain")}
        if named:
            providers |= {"oa.named": profile("openai", "gpt-named", **forwarding),
                          "an.named": profile("anthropic", "claude-named", **forwarding)}
        config = {"active": "oa.plain", "reliability": {"provider_retries": 0}, "providers": providers,
                  "routes": [{"hint": alias.replace(".", "-"), "provider": alias, "model": p["model"]}
                             for alias, p in providers.items()]}
        with BackgroundGateway(config, api_keys={"gw-key"}) as gateway:
            gateway.upstream = upstream
            yield gateway


@pytest.fixture(scope="module")
def gw():
    yield from _gateway(named=True)


@pytest.fixture(scope="module")
def plain_gw():
    yield from _gateway(named=False)


@pytest.fixture
def upstream(gw):
    gw.upstream.seen.clear()
    return gw.upstream


def oai(gw) -> openai.OpenAI:
    # (the SDK writes these two itself, from its own arguments)
    others = {k: v for k, v in CLIENT_HEADERS.items() if k not in ("openai-organization", "openai-project")}
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="gw-key", max_retries=0, timeout=20,
                         organization="org-7", project="proj-9", default_headers=others)


def claude(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="gw-key", max_retries=0, timeout=20,
                               default_headers=CLIENT_HEADERS)


HI = [{"role": "user", "content": "hi"}]
NEVER = ("openai-project", "x-custom", "x-api-key")  # (no profile names them)


def _client_sent(seen) -> dict[str, str]:
    return {k: v for k, v in seen.headers.items() if k in CLIENT_HEADERS or k in ("authorization", "x-api-key")}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_an_openai_client_s_billing_headers_stay_home_unless_a_profile_names_them(gw, upstream, stream):
    """Before, every openai-* header reached the provider: the client chose whose organization
    and project were billed."""
    for model in ("oa-plain", "oa-named"):
        if stream:
            list(oai(gw).chat.completions.create(model=model, messages=HI, stream=True))
        else:
            oai(gw).chat.completions.create(model=model, messages=HI)
    plain, named = (_client_sent(seen) for seen in upstream.seen)
    assert plain == {"openai-beta": "assistants=v2", "authorization": "Bearer sk-up-gpt-plain"}
    assert named == {"openai-beta": "assistants=v2", "openai-organization": "org-7", "x-trace-id": "t-1",
                     "x-pinned": "from-profile", "authorization": "Bearer sk-up-gpt-named"}  # the profile's wins


def test_an_anthropic_client_s_version_and_beta_reach_its_own_family_only(gw, upstream):
    for model in ("an-plain", "an-named", "oa-plain", "oa-named"):
        claude(gw).messages.create(model=model, max_tokens=16, messages=HI)
    an_plain, an_named, oa_plain, oa_named = (_client_sent(seen) for seen in upstream.seen)
    version = upstream.seen[0].headers["anthropic-version"]  # (the SDK's own)
    assert an_plain == {"anthropic-beta": "prompt-caching-2024-07-31", "x-api-key": "sk-up-claude-plain"}
    assert upstream.seen[0].headers["anthropic-version"] == version
    assert an_named == {"anthropic-beta": "prompt-caching-2024-07-31", "x-trace-id": "t-1", "x-pinned": "from-profile",
                        "openai-organization": "org-7", "x-api-key": "sk-up-claude-named"}
    # across families, only what the profile names: the other family's flags mean nothing there
    assert oa_plain == {"authorization": "Bearer sk-up-gpt-plain"}
    assert oa_named == {"x-trace-id": "t-1", "x-pinned": "from-profile", "openai-organization": "org-7",
                        "authorization": "Bearer sk-up-gpt-named"}
    for seen in upstream.seen:
        assert not set(NEVER) & set(seen.headers) - {"x-api-key"} and "gw-key" not in seen.headers.values()


def test_the_query_of_the_client_s_url_reaches_its_own_family_and_the_access_line(plain_gw, caplog):
    """Claude Code posts /v1/messages?beta=true. Before, the query was dropped on the way up and
    missing from the access line."""
    gw, upstream = plain_gw, plain_gw.upstream
    caplog.set_level(logging.INFO, logger="relayline.access")
    beta = {"beta": "true"}  # (as Claude Code's requests carry it)
    claude(gw).messages.create(model="an-plain", max_tokens=16, messages=HI, extra_query=beta)
    claude(gw).messages.create(model="oa-plain", max_tokens=16, messages=HI, extra_query=beta)
    oai(gw).chat.completions.create(model="oa-plain", messages=HI, extra_query={"trace": "a b", "x": "1"})
    oai(gw).chat.completions.create(model="an-plain", messages=HI, extra_query={"trace": "2"})
    assert [seen.path for seen in upstream.seen] == [
        "/v1/messages?beta=true", "/v1/chat/completions",  # across families: not sent
        "/v1/chat/completions?trace=a+b&x=1", "/v1/messages"]
    def queries():
        return [r.fields.get("query") for r in caplog.records if r.name == "relayline.access"]

    deadline = time.monotonic() + 10
    while len(queries()) < 4 and time.monotonic() < deadline:  # (a line is written once its answer is out)
        time.sleep(0.01)
    assert queries() == ["beta=true", "beta=true", "trace=a+b&x=1", "trace=2"]


def test_forward_headers_names_only_headers_a_request_may_pass_on():
    from relayline.machines.config import parse_config
    from relayline.machines.errors import ConfigError

    base = 'active = "p"\n[providers.p]\nfamily = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n'
    assert parse_config(base + 'forward_headers = ["x-trace-id", "OpenAI-Organization"]\n').providers[
        "p"].forward_headers == ("x-trace-id", "OpenAI-Organization")
    with pytest.raises(ConfigError) as refused:
        parse_config(base + 'forward_headers = ["Content-Length", "x trace", "host"]\n')
    assert refused.value.problems == [
        "providers.p.forward_headers[0]: Content-Length describes the connection or the body, not the request: "
        "it is never forwarded",
        "providers.p.forward_headers[1]: not a header name",
        "providers.p.forward_headers[2]: host describes the connection or the body, not the request: it is never "
        "forwarded"]


def test_the_header_that_carried_the_gateway_key_never_travels_even_when_a_profile_names_it():
    """A profile naming `authorization` or `x-api-key` in forward_headers passes on a key the
    client holds for the provider. The header that carried the client's key to this gateway is
    the gateway's own credential: it was sent upstream as written (Bearer gw-key to a profile
    without a key of its own, or beside the x-api-key of an anthropic one)."""
    with RecordingUpstream() as upstream:
        credentials = ["authorization", "x-api-key"]
        providers = {"an.byok": {"family": "anthropic", "base_url": upstream.url, "api_key": "sk-up-claude",
                                 "model": "claude-byok", "forward_headers": credentials},
                     "oa.byok": {"family": "openai", "base_url": f"{upstream.url}/v1", "model": "gpt-byok",
                                 "forward_headers": credentials}}
        config = {"active": "oa.byok", "reliability": {"provider_retries": 0}, "providers": providers,
                  "routes": [{"hint": alias.replace(".", "-"), "provider": alias, "model": p["model"]}
                             for alias, p in providers.items()]}
        with BackgroundGateway(config, api_keys={"gw-key"}) as gw:
            for model in ("an-byok", "oa-byok"):
                openai.OpenAI(base_url=f"{gw.url}/v1", api_key="gw-key", max_retries=0, timeout=20).chat \
                    .completions.create(model=model, messages=HI)
                anthropic.Anthropic(base_url=gw.url, api_key="gw-key", max_retries=0, timeout=20).messages.create(
                    model=model, max_tokens=16, messages=HI)
            # a client's own provider key in the other credential header still travels, as named
            anthropic.Anthropic(base_url=gw.url, auth_token="gw-key", max_retries=0, timeout=20,
                                default_headers={"x-api-key": "sk-client-own"}).messages.create(
                model="oa-byok", max_tokens=16, messages=HI)
    sent = [_client_sent(seen) for seen in upstream.seen]
    assert sent[:4] == [{"x-api-key": "sk-up-claude"}] * 2 + [{}] * 2, sent
    assert sent[4] == {"x-api-key": "sk-client-own"}, sent
    assert not any("gw-key" in value for seen in upstream.seen for value in seen.headers.values())
