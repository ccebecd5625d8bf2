"""docs/concepts.md "The catalog": validation with key paths, the chain, prices."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import config, labels, plan
from relayline.adapters.cli import main as cli
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router

LLAMA = "llama-3.3-70b"


def catalog_config(*, catalog=None, **providers):
    providers = providers or {
        "groq.main": {"model": "llama-3.3-70b-versatile", "fallbacks": ["together.main"],
                      "price": {"input_per_mtok": 0.59, "output_per_mtok": 0.79}},
        "together.main": {"models": {LLAMA: "meta-llama/Llama-3.3-70B-Instruct-Turbo"},
                          "prices": {LLAMA: {"input_per_mtok": 0.88, "output_per_mtok": 0.88}}},
        "openrouter.main": {"models": {LLAMA: "meta-llama/llama-3.3-70b-instruct"},
                            "prices": {LLAMA: {"input_per_mtok": 0.12, "output_per_mtok": 0.3}}},
    }
    catalog = catalog or [{"model": LLAMA, "channels": ["groq.main", "together.main", "openrouter.main"]}]
    return config(active=next(iter(providers)), providers=providers, catalog=catalog)


def problems_of(**top):
    with pytest.raises(ConfigError) as info:
        config(**top)
    return info.value.problems


# -- validation ---------------------------------------------------------------------------------


def test_every_malformed_catalog_entry_is_an_error_naming_its_key_path():
    problems = problems_of(
        active="a",
        providers={"a": {"models": {"ghost": "x", LLAMA: " "}, "prices": {LLAMA: {"input_per_mtok": -1.0}}},
                   "b": {"models": {LLAMA: 7}}},
        routes=[{"hint": "fast", "provider": "b", "model": "m"}],
        catalog=[
            {"model": LLAMA, "channels": ["a", "nowhere", "a"], "order": "cheapest", "max_hops": 0},
            {"model": LLAMA, "channels": []},
            {"model": "fast", "channels": ["a"]},
            {"model": "hint:x", "channels": "a"},
            {"channels": ["a"], "colour": "red"},
            {"model": " padded", "channels": ["b"], "max_hops": "3"},
        ],
    )
    text = "\n".join(problems)
    expected = [
        "catalog[0].order: must be one of 'cost', 'config', got 'cheapest'",
        "catalog[3].channels: expected a list, got a string",
        "catalog[4].model: required key is missing",
        "catalog[4].colour: unknown key",
        "catalog[5].max_hops: expected an integer, got a string",
        'providers.b.models."llama-3.3-70b": expected a string, got a number',
    ]
    for problem in expected:
        assert problem in problems, text
    # the semantic checks run once the shapes are right
    problems = problems_of(
        active="a",
        providers={"a": {"models": {"ghost": "x", LLAMA: " "}, "prices": {LLAMA: {"input_per_mtok": -1.0}}},
                   "b": {}},
        routes=[{"hint": "fast", "provider": "b", "model": "m"}],
        catalog=[
            {"model": LLAMA, "channels": ["a", "nowhere", "a"], "max_hops": 0},
            {"model": LLAMA, "channels": []},
            {"model": "fast", "channels": ["a"]},
            {"model": "hint:x", "channels": ["a"]},
            {"model": " padded", "channels": ["b"]},
        ],
    )
    text = "\n".join(problems)
    for problem in [
        "catalog[0].channels[1]: 'nowhere' names no profile",
        "catalog[0].channels[2]: 'a' is already channels[0]",
        "catalog[0].max_hops: must be at least 1",
        "catalog[1].model: 'llama-3.3-70b' is already catalog[0].model",
        "catalog[1].channels: must list at least one profile",
        "catalog[2].model: 'fast' is also routes[0].hint",
        "catalog[3].model: 'hint:x' is reserved",
        "catalog[4].model: must be a non-blank name without surrounding spaces",
        "providers.a.models.ghost: names no [[catalog]] model",
        'providers.a.models."llama-3.3-70b": must not be blank',
        'providers.a.prices."llama-3.3-70b".input_per_mtok: must not be negative',
    ]:
        assert problem in text, text


def test_check_prints_the_key_paths_and_exits_1(tmp_path, capsys):
    path = tmp_path / "relayline.toml"
    path.write_text("""
active = "a"
[providers.a]
family = "sim"
models = { "qwen" = "qwen2.5-72b" }
[[catalog]]
model = "llama"
channels = ["a", "b"]
max_hops = 0
""")
    assert cli(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert "catalog[0].channels[1]: 'b' names no profile" in err
    assert "catalog[0].max_hops: must be at least 1" in err
    assert "providers.a.models.qwen: names no [[catalog]] model" in err


def test_a_catalog_channel_needs_its_own_credential_even_when_a_route_keys_it():
    cfg = config(active="a", providers={"a": {}, "b": {"family": "openai"}},
                 routes=[{"hint": "h", "provider": "b", "model": "m", "api_key": "sk-route"}])
    build_router(cfg, {})  # a route's credential stands in for its target's
    cfg = config(active="a", providers={"a": {}, "b": {"family": "openai"}},
                 routes=[{"hint": "h", "provider": "b", "model": "m", "api_key": "sk-route"}],
                 catalog=[{"model": LLAMA, "channels": ["a", "b"]}])
    with pytest.raises(ConfigError, match=r"providers\.b: the openai public API needs a credential"):
        build_router(cfg, {})


# -- the chain ----------------------------------------------------------------------------------


def test_cheapest_first_with_each_channels_id_and_price_and_no_fallbacks_walked():
    p = plan(catalog_config(), model=LLAMA)
    assert labels(p) == ["openrouter.main/meta-llama/llama-3.3-70b-instruct", "groq.main/llama-3.3-70b",
                         "together.main/meta-llama/Llama-3.3-70B-Instruct-Turbo"]
    assert [(e.price.input_per_mtok, e.price.output_per_mtok) for e in p.entries] == [(0.12, 0.3), (0.59, 0.79),
                                                                                      (0.88, 0.88)]
    assert all(e.pinned for e in p.entries)
    assert p.domain == "catalog" and p.requested == f"catalog/{LLAMA}" and p.catalog.model == LLAMA
    assert p.as_json()["entries"][0]["price"] == {"input_per_mtok": 0.12, "output_per_mtok": 0.3}


def test_a_catalog_model_is_chosen_by_library_callers_and_operators_too():
    cfg = catalog_config()
    assert plan(cfg, model=LLAMA).domain == "catalog"
    assert plan(cfg, model=LLAMA, gateway=True).domain == "catalog"
    assert plan(cfg, operator_model=LLAMA).domain == "catalog"
    assert labels(plan(cfg, model="other")) == ["groq.main/llama-3.3-70b-versatile",
                                                 "together.main/other"]


def test_order_config_and_max_hops():
    cat = [{"model": LLAMA, "channels": ["together.main", "groq.main", "openrouter.main"], "order": "config",
            "max_hops": 2}]
    assert [e.profile for e in plan(catalog_config(catalog=cat), model=LLAMA).entries] == ["together.main", "groq.main"]


def test_an_unpriced_channel_in_a_cost_ordered_chain_is_a_warning():
    providers = {"a": {"price": {"input_per_mtok": 1.0}}, "b": {"prices": {"other": {"input_per_mtok": 1.0}}},
                 "c": {"models": {"cm": "c-id"}, "prices": {"c-id": {"input_per_mtok": 1.0}}}}
    router = build_router(config(active="a", providers=providers,
                                 catalog=[{"model": "cm", "channels": ["a", "b", "c"]}]), {})
    assert [(w.code, w.path) for w in router.warnings] == [("unpriced_catalog_channel", "catalog[0].channels[1]")]
    listed = build_router(config(active="a", providers=providers,
                                 catalog=[{"model": "cm", "channels": ["a", "b", "c"], "order": "config"}]), {})
    assert listed.warnings == ()


def test_prices_apply_to_any_model_the_profile_serves():
    cfg = config(active="a", providers={"a": {"model": "big", "fallback_models": ["small"],
                                              "price": {"input_per_mtok": 5.0, "output_per_mtok": 15.0},
                                              "prices": {"small": {"input_per_mtok": 0.5, "output_per_mtok": 1.5}}}})
    big, small = plan(cfg).entries
    assert (big.price.input_per_mtok, small.price.input_per_mtok) == (5.0, 0.5)


@given(
    prices=st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.0]), min_size=1, max_size=6),
    order=st.sampled_from(["cost", "config"]),
    max_hops=st.integers(1, 7),
    per_model=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_chain_properties(prices, order, max_hops, per_model):
    providers = {}
    for i, price in enumerate(prices):
        body = {"model": f"own{i}", "fallbacks": [f"p{(i + 1) % len(prices)}"]}
        if per_model[i]:
            body["models"] = {"cm": f"id{i}"}
            body["prices"] = {"cm": {"input_per_mtok": price, "output_per_mtok": price}}
        else:
            body["price"] = {"input_per_mtok": price, "output_per_mtok": price}
        providers[f"p{i}"] = body
    cfg = config(active="p0", providers=providers,
                 catalog=[{"model": "cm", "channels": list(providers), "order": order, "max_hops": max_hops}])
    entries = plan(cfg, model="cm").entries
    indexes = [int(e.profile[1:]) for e in entries]
    # cut at max_hops, each channel once, pinned to its own id for the catalog model
    assert len(entries) == min(max_hops, len(prices)) and len(set(indexes)) == len(indexes)
    for e in entries:
        i = int(e.profile[1:])
        assert e.pinned and e.model == (f"id{i}" if per_model[i] else "cm")
        assert e.price.input_per_mtok == prices[i]
    if order == "config":
        assert indexes == list(range(len(entries)))
    else:
        # cheapest first, ties in listed order, and nothing cheaper was cut
        assert indexes == sorted(range(len(prices)), key=lambda i: prices[i])[:max_hops]


# -- the gateway ----------------------------------------------------------------------------------


def test_gateway_lists_catalog_models_and_serves_the_chain(tmp_path):
    import httpx
    import openai

    from relayline.adapters.sim.background import BackgroundGateway

    raw = {
        "active": "sim.groq",
        "reliability": {"provider_retries": 0},
        "providers": {
            "sim.groq": {"family": "sim", "model": "llama-3.3-70b-versatile",
                         "price": {"input_per_mtok": 0.59, "output_per_mtok": 0.79}},
            "sim.together": {"family": "sim", "models": {LLAMA: "meta-llama/Llama-3.3-70B-Instruct-Turbo"},
                             "prices": {LLAMA: {"input_per_mtok": 0.1, "output_per_mtok": 0.2}}},
        },
        "routes": [{"hint": "fast", "provider": "sim.groq", "model": "x"}],
        "catalog": [{"model": LLAMA, "channels": ["sim.groq", "sim.together"]}],
    }
    replies = [{"provider": "sim.together", "model": "meta-llama/Llama-3.3-70B-Instruct-Turbo",
                "script": [{"text": "from together"}]}]
    with BackgroundGateway(raw, replies, ledger_path=str(tmp_path / "ledger.sqlite3")) as gw:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)
        ids = [m.id for m in client.models.list()]
        answer = client.chat.completions.with_raw_response.create(model=LLAMA, messages=[{"role": "user", "content": "hi"}])
        plan_json = httpx.get(f"{gw.url}/admin/plan", params={"model": LLAMA}).json()
        upstream = [seen.body["model"] for seen in gw.sim.server.seen]
        rows = gw.gateway.ledger.rows()
    # the channel's own id went over the wire, and the ledger billed its price for the model
    assert upstream == ["meta-llama/Llama-3.3-70B-Instruct-Turbo"]
    assert [(r["provider"], r["model"], r["accepted"]) for r in rows] == [
        ("sim.together", "meta-llama/Llama-3.3-70B-Instruct-Turbo", 1)]
    assert rows[0]["cost_usd"] == pytest.approx((10 * 0.1 + 2 * 0.2) / 1e6)
    assert ids[:2] == ["fast", LLAMA] and "llama-3.3-70b-versatile" in ids
    completion = answer.parse()
    assert completion.choices[0].message.content == "from together"
    assert completion.model == "meta-llama/Llama-3.3-70B-Instruct-Turbo"
    assert answer.headers["x-relayline-requested"] == f"catalog/{LLAMA}"
    assert answer.headers["x-relayline-served"] == "sim.together/meta-llama/Llama-3.3-70B-Instruct-Turbo"
    assert float(answer.headers["x-relayline-cost-usd"]) == pytest.approx((10 * 0.1 + 2 * 0.2) / 1e6)
    assert plan_json["catalog"] == {"model": LLAMA, "channels": ["sim.groq", "sim.together"], "order": "cost",
                                    "max_hops": 3}
    assert [(e["provider"], e["price"]["input_per_mtok"]) for e in plan_json["entries"]] == [
        ("sim.together", 0.1), ("sim.groq", 0.59)]


def test_plan_cli_prints_the_chain_with_prices(tmp_path, capsys):
    path = tmp_path / "relayline.toml"
    path.write_text(f"""
active = "groq.main"
[[catalog]]
model = "{LLAMA}"
channels = ["groq.main", "openrouter.main"]
[providers."groq.main"]
family = "sim"
price = {{ input_per_mtok = 0.59, output_per_mtok = 0.79 }}
[providers."openrouter.main"]
family = "sim"
models = {{ "{LLAMA}" = "meta-llama/llama-3.3-70b-instruct" }}
prices = {{ "{LLAMA}" = {{ input_per_mtok = 0.12, output_per_mtok = 0.3 }} }}
""")
    assert cli(["plan", str(path), "--model", LLAMA]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [["1", "openrouter.main", "meta-llama/llama-3.3-70b-instruct", "yes", "0.12", "0.30", "yes"],
                    ["2", "groq.main", LLAMA, "yes", "0.59", "0.79", "yes"]]
    assert f"catalog:   {LLAMA}: 2 channels, order cost, max_hops 3" in out
