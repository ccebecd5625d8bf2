"""Requested versus served, for every model form a client may name (docs/concepts.md, "Reliability
domains and the attempt order", "The catalog", "Attribution"): the plan's label, and every place the gateway shows it (the
attribution header, the `relayline` answer field, the ledger row, the console), through the
official SDKs over loopback HTTP."""

from __future__ import annotations

import anthropic
import httpx
import openai
from hypothesis import given
from hypothesis import strategies as st

from helpers import config, labels, plan
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.stores.ledger import LedgerStore

HI = [{"role": "user", "content": "hi"}]


def forms_config(root_model: str | None = "m-main"):
    root = {"fallbacks": ["anthropic.backup"]} | ({"model": root_model} if root_model else {})
    return config(active="openai.main",
                  providers={"openai.main": root, "anthropic.backup": {"model": "m-backup"}, "un.pinned": {},
                             "sim.c1": {"model": "x"}, "sim.c2": {"models": {"llama": "c2-llama"}}},
                  routes=[{"hint": "fast", "provider": "un.pinned", "model": "fm"}],
                  catalog=[{"model": "llama", "channels": ["sim.c1", "sim.c2"]}])


def test_a_profile_model_naming_the_default_profile_is_not_doubled():
    for root_model in ("m-main", None):
        p = plan(forms_config(root_model), model="openai.main/m-main", gateway=True)
        assert p.requested == "openai.main/m-main"
        assert labels(p)[0] == "openai.main/m-main"  # unpinned: the model, not "openai.main/m-main" as an id


def test_each_model_form_is_labelled_as_config_md_says():
    cfg = forms_config()
    expected = {
        None: ("openai.main/m-main", "openai.main/m-main"),
        "m-main": ("openai.main/m-main", "openai.main/m-main"),
        "m-other": ("openai.main/m-other", "openai.main/m-main"),  # a pin serves its pin
        "openai.main/m-other": ("openai.main/m-other", "openai.main/m-main"),
        "hint:fast": ("un.pinned/fm", "un.pinned/fm"),
        "hint:nope": ("openai.main/hint:nope", "openai.main/m-main"),  # the literal stays requested
        "fast": ("un.pinned/fm", "un.pinned/fm"),  # the gateway: a route's hint names a model
        "llama": ("catalog/llama", "sim.c1/llama"),  # no price: the listed order
        # another profile's name is a model literal of the default domain (any other
        # model value uses the default domain unchanged)
        "anthropic.backup/m-backup": ("openai.main/anthropic.backup/m-backup", "openai.main/m-main"),
        "openai.main/": ("openai.main/openai.main/", "openai.main/m-main"),
    }
    for model, (requested, first) in expected.items():
        p = plan(cfg, model=model, gateway=True)
        assert (p.requested, labels(p)[0] if p.entries else None) == (requested, first), model
    assert plan(cfg, model="fast").requested == "openai.main/fast"  # the library: hints only as hint:NAME


@given(st.from_regex(r"[a-z][a-z0-9.\-]{0,12}(/[a-z0-9.\-]{1,8}){0,2}", fullmatch=True),
       st.sampled_from(["m-main", None]), st.booleans())
def test_the_requested_label_names_the_domain_once_and_the_model_asked(model, root_model, gateway):
    cfg = forms_config(root_model)
    p = plan(cfg, model=model, gateway=gateway)
    if p.catalog is not None or p.hint is not None:
        return
    asked = model.removeprefix("openai.main/") or model
    assert p.requested == f"openai.main/{asked}"
    if root_model is None:  # the unpinned root forwards exactly the model asked for
        assert labels(p)[0] == f"openai.main/{asked}"


def _gateway_config(root_model: str | None) -> dict:
    root = {"family": "sim", "fallbacks": ["anthropic.backup"]} | ({"model": root_model} if root_model else {})
    return {"active": "openai.main", "reliability": {"provider_retries": 0, "backoff_ms": 50},
            "providers": {"openai.main": root, "anthropic.backup": {"family": "sim", "model": "m-backup"}}}


def test_every_place_the_gateway_shows_the_requested_label(tmp_path):
    """The SDKs, streamed and not, both dialects: header, answer field, ledger row and console
    all say what the client asked; the unpinned profile is sent the model, not profile/model."""
    path = tmp_path / "ledger.sqlite3"
    replies = [{"provider": "openai.main", "model": "m-x", "script": [{"text": "from m-x"}] * 4}]
    with BackgroundGateway(_gateway_config(None), replies, ledger_path=str(path)) as gw:
        oa = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)
        an = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=20)
        raw = oa.chat.completions.with_raw_response.create(model="openai.main/m-x", messages=HI)
        completion = raw.parse()
        with oa.chat.completions.with_streaming_response.create(
                model="openai.main/m-x", messages=HI, stream=True) as streamed:
            chunks = list(streamed.parse())
        message = an.messages.with_raw_response.create(model="openai.main/m-x", max_tokens=16, messages=HI)
        with an.messages.stream(model="openai.main/m-x", max_tokens=16, messages=HI) as events:
            text = events.get_final_text()
            stream_headers = events.response.headers
        console = httpx.get(f"{gw.url}/admin/console/turns").json()["turns"]
    assert completion.choices[0].message.content == "from m-x" and text == "from m-x"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "from m-x"
    for headers in (raw.headers, streamed.headers, message.headers, stream_headers):
        assert (headers["x-relayline-requested"], headers["x-relayline-served"]) == (
            "openai.main/m-x", "openai.main/m-x")
    assert completion.model_extra["relayline"]["requested"] == "openai.main/m-x"
    assert [c.model_extra["relayline"]["requested"] for c in chunks if "relayline" in c.model_extra] == [
        "openai.main/m-x"]
    assert message.parse().model_extra["relayline"]["requested"] == "openai.main/m-x"
    assert [r["requested"] for r in LedgerStore(path).rows()] == ["openai.main/m-x"] * 4
    assert [t["requested"] for t in console] == ["openai.main/m-x"] * 4
