"""docs/concepts.md "Reliability domains and the attempt order", "Effort routing"."""

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import config, labels, plan
from relayline.machines import plan as plan_module
from relayline.machines.config import Secret
from relayline.machines.effort import EffortDecision, RouteSelection, allowlist, decide, estimate
from relayline.machines.errors import ConfigError
from relayline.machines.plan import build_router, materialise, plan_turn, profile_keys, resolve_ref

# -- materialisation ---------------------------------------------------------------------------


def test_pinned_primary_then_its_fallback_models_in_order():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallback_models": ["m2", "m3"]}})
    p = plan(cfg, model="whatever")
    assert labels(p) == ["a/m1", "a/m2", "a/m3"] and all(e.pinned for e in p.entries)


def test_construction_override_replaces_the_active_model():
    cfg = config(active="a", model="override", providers={"a": {"model": "m1", "fallback_models": ["m2"]}})
    assert labels(plan(cfg)) == ["a/override", "a/m2"]


def test_no_primary_model_gives_one_unpinned_entry_and_skips_fallback_models():
    cfg = config(active="a", providers={"a": {"fallback_models": ["m2"]}})
    p = plan(cfg, model="asked")
    assert labels(p) == ["a/asked"] and not p.entries[0].pinned


def test_fallback_profiles_depth_first_with_their_own_models_not_the_override():
    cfg = config(active="a", model="override", providers={
        "a": {"model": "m1", "fallbacks": ["b", "d"]},
        "b": {"model": "n1", "fallback_models": ["n2"], "fallbacks": ["c"]},
        "c": {},
        "d": {"model": "d1"},
    })
    assert labels(plan(cfg, model="req")) == ["a/override", "b/n1", "b/n2", "c/req", "d/d1"]


def test_entries_keep_their_own_profile():
    cfg = config(active="a", providers={
        "a": {"model": "m1", "fallbacks": ["b"], "headers": {"x-team": "a"}, "price": {"input_per_mtok": 1.0}},
        "b": {"model": "n1", "headers": {"x-team": "b"}, "price": {"input_per_mtok": 2.0}},
    })
    first, second = plan(cfg).entries
    assert first.provider.headers == {"x-team": "a"} and second.provider.headers == {"x-team": "b"}
    assert second.provider.price.input_per_mtok == 2.0


def test_dangling_reference_is_pruned_with_a_warning():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["ghost", "b"]}, "b": {"model": "n"}})
    p = plan(cfg)
    assert labels(p) == ["a/m1", "b/n"]
    assert any(w.startswith('dangling_fallback_ref at providers.a.fallbacks[0]') for w in p.warnings)


def test_cycle_including_self_is_pruned_with_a_warning():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["a", "b"]}, "b": {"model": "n", "fallbacks": ["a"]}})
    p = plan(cfg)
    assert labels(p) == ["a/m1", "b/n"]
    codes = [w for w in p.warnings if w.startswith("fallback_cycle")]
    assert len(codes) == 2 and any("providers.b.fallbacks[0]" in w for w in codes)


def test_edges_deeper_than_max_fallback_depth_are_pruned():
    providers = {f"p{i}": {"model": f"m{i}", "fallbacks": [f"p{i + 1}"]} for i in range(5)}
    providers["p5"] = {"model": "m5"}
    cfg = config(active="p0", providers=providers, reliability={"max_fallback_depth": 2})
    p = plan(cfg)
    assert labels(p) == ["p0/m0", "p1/m1", "p2/m2"]
    assert any(w.startswith("max_fallback_depth_exceeded at providers.p2.fallbacks[0]") for w in p.warnings)


def test_blank_and_primary_duplicate_fallback_models_are_pruned():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallback_models": ["", "m1", "m2"]}})
    p = plan(cfg)
    assert labels(p) == ["a/m1", "a/m2"]
    assert any(w.startswith("empty_fallback_model at providers.a.fallback_models[0]") for w in p.warnings)
    assert any(w.startswith("fallback_model_duplicates_primary at providers.a.fallback_models[1]") for w in p.warnings)


def test_bare_alias_resolves_when_unique_and_dangles_when_ambiguous():
    cfg = config(active="anthropic.main", providers={
        "anthropic.main": {"model": "c", "fallbacks": ["backup", "main"]},
        "openai.backup": {"model": "g"},
        "openai.main": {"model": "o"},
    })
    p = plan(cfg)
    assert labels(p) == ["anthropic.main/c", "openai.backup/g"]
    assert any("dangling_fallback_ref" in w and "'main'" in w for w in p.warnings)


def test_missing_credential_on_a_reachable_profile_is_fatal_and_named():
    cfg = config(active="a", providers={"a": {"model": "m", "fallbacks": ["openai.backup"]},
                                        "openai.backup": {"family": "openai", "model": "g", "api_key_env": "NOPE_UNSET"}})
    with pytest.raises(ConfigError, match="openai.backup"):
        build_router(cfg, {})
    assert build_router(cfg, {"NOPE_UNSET": "sk-x"}).keys["openai.backup"][0].reveal() == "sk-x"


def test_unreachable_profile_without_credential_is_not_fatal():
    cfg = config(active="a", providers={"a": {"model": "m"}, "openai.unused": {"family": "openai", "api_key_env": "NOPE_UNSET"}})
    build_router(cfg, {})


def test_unknown_family_on_a_reachable_profile_is_fatal():
    cfg = config(active="a", providers={"a": {"family": "carrier-pigeon", "model": "m"}})
    with pytest.raises(ConfigError, match='providers.a.family: unknown family'):
        build_router(cfg, {})


def test_all_entries_of_a_profile_share_one_health_key():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallback_models": ["m2"]}})
    assert {e.profile for e in plan(cfg).entries} == {"a"}


def test_fatal_problems_are_every_reachable_profiles_sorted_once():
    cfg = config(active="a", providers={
        "a": {"family": "openai", "model": "m", "fallbacks": ["b", "c"]},
        "b": {"family": "anthropic", "model": "n", "api_key_env": "NOPE"},
        "c": {"family": "pigeon", "model": "x", "fallbacks": ["b"]},
    }, routes=[{"hint": "b", "provider": "b", "model": "n"}])
    with pytest.raises(ConfigError) as info:
        build_router(cfg, {"NOPE": ""})
    assert info.value.problems == [
        "providers.a: the openai public API needs a credential (api_key, api_key_env or api_keys)",
        "providers.b.api_key_env: environment variable NOPE is not set",
        "providers.c.family: unknown family 'pigeon' (known: openai, anthropic, sim)",
    ]


def test_a_profile_gives_its_pool_else_its_key_else_its_variable():
    def keys(env=None, **body):
        return profile_keys("x.p", config(active="x.p", providers={"x.p": body}).providers["x.p"], env or {})

    pool, problem = keys(api_keys=["k1", "k2"])
    assert [k.reveal() for k in pool] == ["k1", "k2"] and problem is None
    assert [k.reveal() for k in keys(api_key="one")[0]] == ["one"]
    assert keys({"V": "from-env"}, api_key_env="V")[0] == (Secret("from-env"),)
    assert keys({}, api_key_env="V") == ((), 'providers."x.p".api_key_env: environment variable V is not set')
    assert keys() == ((), None)  # the scripted family needs no credential
    assert keys(family="anthropic", base_url="http://127.0.0.1:9") == ((), None)  # a self-hosted endpoint
    assert keys(family="anthropic") == ((), 'providers."x.p": the anthropic public API needs a credential '
                                            "(api_key, api_key_env or api_keys)")


def test_a_route_credential_stands_in_for_its_target_but_not_for_the_active_profile():
    cfg = config(active="a", providers={"a": {"family": "openai", "model": "m", "api_key": "own"},
                                        "t": {"family": "openai", "model": "tm"}},
                 routes=[{"hint": "home", "provider": "a", "model": "m", "api_key": "route-a"},
                         {"hint": "t", "provider": "t", "model": "tm", "api_key": "route-t"}])
    assert plan(cfg, model="hint:home").entries[0].keys == (Secret("own"),)
    assert plan(cfg, model="hint:t").entries[0].keys == (Secret("route-t"),)
    keyless = config(active="a", providers={"a": {"family": "openai", "model": "m", "api_key": "own"},
                                            "t": {"family": "openai", "model": "tm"}},
                     routes=[{"hint": "t", "provider": "t", "model": "tm"},
                             {"hint": "t2", "provider": "t", "model": "tm", "api_key": "late"}])
    assert plan(keyless, model="hint:t").entries[0].keys == (Secret("late"),)


def test_a_warning_repeated_by_two_domains_is_reported_once():
    cfg = config(active="a", providers={"a": {"model": "m", "fallbacks": ["ghost", "b"]}, "b": {"model": "n"}},
                 routes=[{"hint": "b", "provider": "b", "model": "n"}, {"hint": "g", "provider": "nowhere", "model": "x"}])
    router = build_router(cfg, {})
    assert [str(w) for w in router.warnings] == [
        "dangling_fallback_ref at providers.a.fallbacks[0]: 'ghost' names no profile (or an ambiguous bare alias); pruned",
        "unknown_route_provider at routes[1].provider: 'nowhere' names no profile; route 'g' dropped",
    ]


def test_materialise_names_each_pruned_edge_in_its_warning():
    cfg = config(active="a", providers={"a": {"model": "m", "fallback_models": [" ", "m"], "fallbacks": ["b"]},
                                        "b": {"model": "n", "fallbacks": ["a", "c"]}, "c": {"model": "o"}},
                 reliability={"max_fallback_depth": 1})
    entries, warnings = materialise(cfg, "a", "m")
    assert [(e.profile, e.model, e.pinned) for e in entries] == [("a", "m", True), ("b", "n", True)]
    assert [str(w) for w in warnings] == [
        "empty_fallback_model at providers.a.fallback_models[0]: blank model id pruned",
        "fallback_model_duplicates_primary at providers.a.fallback_models[1]: 'm' is the primary model; pruned",
        "fallback_cycle at providers.b.fallbacks[0]: 'a' is already on the path a -> b; pruned",
        "max_fallback_depth_exceeded at providers.b.fallbacks[1]: 'c' is at depth 2 > max_fallback_depth 1; pruned",
    ]


def test_a_fallback_model_listed_twice_is_attempted_once():
    cfg = config(active="a", providers={"a": {"model": "m", "fallback_models": ["n", "n", "o"]}})
    assert labels(plan(cfg)) == ["a/m", "a/n", "a/o"]


def test_a_profile_reached_through_two_branches_is_attempted_once_where_first_reached():
    cfg = config(active="a", providers={"a": {"model": "m", "fallbacks": ["b", "c"]}, "b": {"model": "n", "fallbacks": ["d"]},
                                        "c": {"model": "o", "fallbacks": ["d"]}, "d": {"model": "q"}})
    assert labels(plan(cfg)) == ["a/m", "b/n", "d/q", "c/o"]


# -- one turn's plan ------------------------------------------------------------------------------

def test_a_plan_as_json_shows_the_domain_effort_allowlist_entries_and_warnings():
    p = plan(config(**{**EFFORT, "providers": {
        "local.main": {"model": "small", "locality": "local", "fallbacks": ["cloud.main"],
                       "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
        "cloud.main": {"model": "big"}}}), text="hi")
    assert p.as_json() == {
        "domain": "local.main",
        "effort": p.effort.as_json(),
        "allowlist": ["local.main"],
        "catalog": None,
        "entries": [{"provider": "local.main", "model": "small", "pinned": True,
                     "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
                    {"provider": "cloud.main", "model": "big", "pinned": True,
                     "price": {"input_per_mtok": 0.0, "output_per_mtok": 0.0}}],
        "warnings": [],
    }
    plain = plan(config(active="a", providers={"a": {"model": "m"}}))
    assert plain.as_json()["effort"] is None and plain.as_json()["allowlist"] is None
    assert plain.requested == "a/m" and plan(config(active="a", providers={"a": {}}), model="x").requested == "a/x"


def test_a_plan_serves_an_allowed_profile_that_can_honour_the_request():
    import attrs

    p = plan(config(**EFFORT), text="hi")
    assert p.serves("local.main") and not p.serves("cloud.main")
    unfit = attrs.evolve(p, unfit={"local.main": ("images",)})
    assert not unfit.serves("local.main") and unfit.allows("local.main")
    assert attrs.evolve(p, allowlist=None).serves("cloud.main")


def test_the_turns_model_comes_from_operator_then_request_then_effort_then_the_scope():
    cfg = config(**EFFORT)
    operator = RouteSelection().select("hint:cloud")
    assert plan(cfg, model="hint:local", operator_model="hint:cloud").domain == "cloud.main"
    assert plan(cfg, model="hint:local", selection=operator).domain == "cloud.main"
    assert plan(cfg, model="hint:local", operator_model="auto", selection=operator).domain == "local.main"
    assert plan(cfg, model="auto", text=COMPLEX).domain == "cloud.main"  # "auto" is effort's
    assert plan(cfg, model="hint:cloud", text="hi").effort is None
    plain = config(active="a", providers={"a": {}}, routes=[{"hint": "r", "provider": "a", "model": "rm"}])
    assert labels(plan(plain, selection=RouteSelection().model_switch("chosen"))) == ["a/chosen"]
    p = plan(plain)
    assert p.entries == () and p.warnings == ("no_model: a is unpinned and the request names no model; skipped",)
    assert p.requested == "a/"
    assert plan(plain, model="hint:r").hint == "r" and plan(plain, model="r", gateway=True).hint == "r"
    assert plan(plain, model="r").hint is None and labels(plan(plain, model="r")) == ["a/r"]
    assert plan(plain, model="hint:nope").warnings == (
        "unknown_hint: 'hint:nope' names no route; the default domain serves it",)


# a router keeps the plans it made without an effort decision: the same choice reads the same
# plan, equal to one a fresh router makes, whatever the choice, its owner or a second ask
CHOICES = st.sampled_from([None, "auto", "fast", "r", "m1", "hint:fast", "hint:pin", "hint:home", "hint:nope",
                           "hint:FAST", "c1", "whatever"])


@given(model=CHOICES, operator=CHOICES, gateway=st.booleans(), switched=st.one_of(st.none(), CHOICES))
def test_a_kept_plan_is_the_plan_made_afresh(model, operator, gateway, switched):
    cfg = config(**ROUTED)
    kept = build_router(cfg, {})
    selection = RouteSelection().model_switch(switched) if switched else None
    ask = dict(model=model, operator_model=operator, selection=selection, gateway=gateway)
    first = plan_turn(kept, **ask)
    again = plan_turn(kept, **ask)
    assert again is first
    assert first == plan_turn(build_router(cfg, {}), **ask)


def test_plans_with_an_effort_decision_are_made_each_turn_and_the_kept_ones_are_bounded(monkeypatch):
    router = build_router(config(**EFFORT), {})
    assert plan_turn(router, text=COMPLEX).effort is not None and not router.plans
    monkeypatch.setattr(plan_module, "MAX_CACHED_PLANS", 3)
    for i in range(7):
        assert labels(plan_turn(router, model=f"hint:cloud{i}"))
        assert len(router.plans) <= 3


# -- routes and hints ---------------------------------------------------------------------------

ROUTED = dict(active="a", providers={
    "a": {"model": "m1", "fallbacks": ["c"]},
    "fast": {"fallback_models": ["ignored"], "fallbacks": ["c"]},
    "pinned": {"model": "p1"},
    "c": {"model": "c1"},
}, routes=[
    {"hint": "fast", "provider": "fast", "model": "fast-model"},
    {"hint": "pin", "provider": "pinned", "model": "route-model-ignored"},
    {"hint": "home", "provider": "a", "model": "route-model-ignored"},
    {"hint": "fast2", "provider": "fast", "model": "other"},
])


def test_hint_selects_the_route_domain():
    p = plan(config(**ROUTED), model="hint:fast")
    assert p.domain == "fast" and labels(p) == ["fast/fast-model", "c/c1"]


def test_unpinned_route_target_gets_the_route_model_without_its_fallback_models_but_with_fallbacks():
    p = plan(config(**ROUTED), model="hint:fast")
    assert not p.entries[0].pinned and "fast/ignored" not in labels(p) and "c/c1" in labels(p)


def test_pinned_route_target_ignores_the_route_model():
    assert labels(plan(config(**ROUTED), model="hint:pin")) == ["pinned/p1"]


def test_a_hint_to_the_active_profile_keeps_the_default_pin():
    assert labels(plan(config(**ROUTED), model="hint:home")) == ["a/m1", "c/c1"]


def test_one_domain_per_unique_target_profile():
    router = build_router(config(**ROUTED), {})
    assert router.domains["fast"] is router.domains["fast2"]
    assert router.domains["home"] is router.default


def test_unknown_hint_warns_uses_default_and_keeps_the_literal():
    cfg = config(active="a", providers={"a": {}}, routes=[{"hint": "fast", "provider": "a", "model": "x"}])
    p = plan(cfg, model="hint:nope")
    assert labels(p) == ["a/hint:nope"]
    assert any(w.startswith("unknown_hint") for w in p.warnings)


def test_hints_are_exact_and_case_sensitive():
    p = plan(config(**ROUTED), model="hint:FAST")
    assert p.domain == "a"


def test_plain_model_uses_the_default_domain_except_in_the_gateway():
    cfg = config(**ROUTED)
    assert plan(cfg, model="fast").domain == "a"
    assert plan(cfg, model="fast", gateway=True).domain == "fast"


def test_unknown_route_provider_is_a_warning():
    cfg = config(active="a", providers={"a": {"model": "m"}}, routes=[{"hint": "x", "provider": "ghost", "model": "m"}])
    router = build_router(cfg, {})
    assert "x" not in router.domains
    assert any(w.code == "unknown_route_provider" and w.path == "routes[0].provider" for w in router.warnings)


def test_first_route_credential_wins_for_a_shared_target():
    cfg = config(active="a", providers={"a": {"model": "m"}, "t": {"model": "tm"}}, routes=[
        {"hint": "one", "provider": "t", "model": "x", "api_key": "first"},
        {"hint": "two", "provider": "t", "model": "x", "api_key": "second"},
    ])
    assert plan(cfg, model="hint:two").entries[0].keys[0].reveal() == "first"


# -- effort routing ------------------------------------------------------------------------------

EFFORT = dict(active="local.main", providers={
    "local.main": {"model": "small", "locality": "local", "fallbacks": ["cloud.main"]},
    "cloud.main": {"model": "big", "fallbacks": ["local.main"]},
}, routes=[{"hint": "local", "provider": "local.main", "model": "small"},
           {"hint": "cloud", "provider": "cloud.main", "model": "big"}],
    effort_routing={"escalation": "auto"})

COMPLEX = "Please analyze and design a refactor of this algorithm, then prove its complexity.\n```py\nx = 1\n```"


def test_effort_estimator_is_deterministic_and_holds_no_text():
    assert estimate("hi")[0] == "simple"
    level, score, features = estimate(COMPLEX)
    assert level == "complex" and estimate(COMPLEX) == (level, score, features)
    assert all(isinstance(v, int) for v in features.values())


def test_simple_turns_go_local_with_a_local_allowlist():
    p = plan(config(**EFFORT), text="hi")
    assert p.effort.level == "simple" and p.domain == "local.main" and p.allowlist == {"local.main"}
    assert not p.allows("cloud.main")


def test_complex_turns_escalate_to_cloud_when_auto():
    p = plan(config(**EFFORT), text=COMPLEX)
    assert p.domain == "cloud.main" and p.allowlist == {"local.main", "cloud.main"}


def test_complex_turns_stay_local_when_escalation_is_off():
    cfg = config(**{**EFFORT, "effort_routing": {"escalation": "off"}})
    assert plan(cfg, text=COMPLEX).domain == "local.main"


def test_explicit_operator_selection_disables_effort_routing_and_auto_restores_it():
    cfg = config(**EFFORT)
    p = plan(cfg, text="hi", operator_model="hint:cloud")
    assert p.effort is None and p.domain == "cloud.main" and p.allowlist is None
    assert plan(cfg, text="hi", operator_model="auto").domain == "local.main"
    sel = RouteSelection().select("hint:cloud")
    assert plan(cfg, text="hi", selection=sel).domain == "cloud.main"
    assert plan(cfg, text="hi", selection=sel.select("auto")).domain == "local.main"


def test_model_switch_changes_the_model_not_the_owner():
    sel = RouteSelection().model_switch("hint:cloud")
    assert sel.owner == "auto" and sel.model == "hint:cloud"
    assert plan(config(**EFFORT), text="hi", selection=sel).domain == "local.main"  # effort still owns it
    owned = RouteSelection().select("hint:local").model_switch("hint:cloud")
    assert owned.owner == "operator" and plan(config(**EFFORT), text="hi", selection=owned).domain == "cloud.main"


def _words(n):
    return " ".join(["word"] * n)


@pytest.mark.parametrize(("text", "score"), [
    # words: > 40 / 120 / 400 add 1 / 2 / 3
    (_words(40), 0), (_words(41), 1), (_words(120), 1), (_words(121), 2), (_words(400), 2), (_words(401), 3),
    # a fenced code block adds 2, however many there are; an unclosed fence is no block
    ("```\nx\n```", 2), ("```a``` ```b```", 2), ("``` x", 0),
    # each reasoning term adds 1, at most 4; a word that merely contains one is not one
    ("debug", 1), ("analyze, prove; design", 3), ("analyze prove design debug optimize refactor", 4),
    ("debugger redesign", 0), ("Step-by-step TRADE-OFF", 2),
    # more than 20 lines adds 1
    ("\n" * 19, 0), ("\n" * 20, 1),
    # three or more question marks add 1
    ("?" * 2, 0), ("?" * 3, 1),
    # three or more constraint words add 1 (whole words or phrases only)
    ("must should", 0), ("must, should, without", 1), ("at least one, at most two, ensure it", 1),
    ("mustard shoulder", 0), ("MUST must Must", 1),
])
def test_effort_estimator_scores_each_rule_of_the_readme(text, score):
    assert estimate(text)[1] == score


@pytest.mark.parametrize(("score_text", "level"), [
    ("", "simple"), ("debug", "simple"), ("debug prove", "standard"), ("debug prove design", "standard"),
    ("debug prove design refactor", "complex"),
])
def test_effort_levels_are_simple_to_1_standard_to_3_complex_from_4(score_text, level):
    assert estimate(score_text)[0] == level


def test_effort_features_are_the_counts_of_each_rule():
    text = "Must we debug it?\n```\ncode\n```\nShould we? Without tests?"
    assert estimate(text)[2] == {"words": 11, "lines": 5, "code_blocks": 1, "reasoning_terms": 1,
                                 "questions": 3, "constraints": 3}
    assert estimate("")[2]["lines"] == 0 and estimate("one line")[2]["lines"] == 1


def test_effort_decision_picks_the_hint_and_shows_counts_only():
    cfg = config(**EFFORT)
    assert decide(config(active="local.main", providers=EFFORT["providers"]), COMPLEX) is None
    simple, hard = decide(cfg, "hi"), decide(cfg, COMPLEX)
    assert (simple.level, simple.hint, simple.score) == ("simple", "local", 0)
    assert (hard.level, hard.hint) == ("complex", "cloud")
    assert hard.as_json() == {"level": "complex", "hint": "cloud", "score": hard.score, "features": hard.features}
    assert decide(config(**{**EFFORT, "effort_routing": {"escalation": "off"}}), COMPLEX).hint == "local"
    standard = decide(cfg, "debug prove")
    assert (standard.level, standard.hint) == ("standard", "local")


def test_effort_allowlist_keeps_a_local_decision_local():
    cfg = config(**{**EFFORT, "providers": {**EFFORT["providers"], "edge": {"model": "e", "locality": "local"}}})
    assert allowlist(cfg, None) is None
    assert allowlist(cfg, decide(cfg, "hi")) == {"local.main", "edge"}
    assert allowlist(cfg, decide(cfg, COMPLEX)) == {"local.main", "edge", "cloud.main"}
    assert allowlist(cfg, EffortDecision("complex", "elsewhere", 9, {})) == {"local.main", "edge", "cloud.main"}


def test_route_selection_owner_follows_the_operator():
    assert RouteSelection() == RouteSelection("auto", None)
    assert RouteSelection().select("hint:cloud") == RouteSelection("operator", "hint:cloud")
    assert RouteSelection("operator", "m").select("auto") == RouteSelection("auto", None)


# -- properties over generated configs ------------------------------------------------------------

ALIASES = ["p0", "p1", "p2", "x.p3", "y.p3", "p5"]


@st.composite
def graphs(draw):
    providers = {}
    for alias in ALIASES:
        providers[alias] = {
            "model": draw(st.one_of(st.none(), st.sampled_from(["m1", "m2", "m3"]))),
            "fallback_models": draw(st.lists(st.sampled_from(["", "m1", "m2", "m4"]), max_size=3)),
            "fallbacks": draw(st.lists(st.sampled_from(ALIASES + ["ghost", "p3"]), max_size=3)),
        }
        if providers[alias]["model"] is None:
            del providers[alias]["model"]
    depth = draw(st.integers(0, 4))
    root = draw(st.sampled_from(ALIASES))
    return config(active=root, providers=providers, reliability={"max_fallback_depth": depth})


@pytest.mark.property
@given(cfg=graphs(), requested=st.sampled_from(["req-a", "m1"]))
def test_materialisation_properties(cfg, requested):
    entries, _ = materialise(cfg, cfg.active, cfg.providers[cfg.active].model)
    profiles = [e.profile for e in entries]
    # no cycle and no repeat: each profile's entries are contiguous and appear once
    seen = []
    for alias in profiles:
        if not seen or seen[-1] != alias:
            assert alias not in seen
            seen.append(alias)
    # every entry's profile is reachable from the root within max_fallback_depth
    depth = {cfg.active: 0}  # shortest reference depth, breadth first
    frontier = deque([cfg.active])
    while frontier:
        alias = frontier.popleft()
        for ref in cfg.providers[alias].fallbacks:
            target = resolve_ref(cfg, ref)
            if target and target not in depth and depth[alias] + 1 <= cfg.reliability.max_fallback_depth:
                depth[target] = depth[alias] + 1
                frontier.append(target)
    assert set(profiles) <= set(depth)
    # a pinned entry never carries the requested model; the plan is deterministic
    p1 = plan(cfg, model=requested)
    p2 = plan(cfg, model=requested)
    assert p1 == p2
    for e in p1.entries:
        if e.pinned:  # its own pin, whatever was requested
            pins = [cfg.model if e.profile == cfg.active and cfg.model else e.provider.model, *e.provider.fallback_models]
            assert e.model in pins
        else:
            assert e.model == requested


def test_a_catalog_plan_shows_its_catalog_entry_and_prices_each_channel_by_its_own_id():
    cfg = config(active="a", providers={
        "a": {"models": {"cm": "a-id"}, "prices": {"a-id": {"input_per_mtok": 3.0}}},
        "b": {"models": {"cm": "b-id"}, "prices": {"b-id": {"input_per_mtok": 1.0}}},
        "c": {}}, catalog=[{"model": "cm", "channels": ["a", "b", "c"]}])
    p = plan(cfg, model="cm")
    assert labels(p) == ["c/cm", "b/b-id", "a/a-id"]  # c is unpriced: free, first
    assert p.as_json()["catalog"] == {"model": "cm", "channels": ("a", "b", "c"), "order": "cost", "max_hops": 3}
    assert [str(w) for w in build_router(cfg, {}).warnings] == [
        "unpriced_catalog_channel at catalog[0].channels[2]: 'c' has no price for 'cm' (prices or price): "
        "it is ordered as free"]


def test_a_bare_alias_is_everything_after_the_family():
    cfg = config(active="openai.main.eu", providers={"openai.main.eu": {"model": "m", "fallbacks": ["main.us"]},
                                                     "openai.main.us": {"model": "n"}})
    assert labels(plan(cfg)) == ["openai.main.eu/m", "openai.main.us/n"]


def test_a_turn_without_text_is_scored_on_nothing():
    p = plan(config(**EFFORT))
    assert (p.effort.level, p.effort.score) == ("simple", 0) and set(p.effort.features.values()) == {0}


def test_every_domains_warnings_are_kept_and_a_dropped_route_drops_only_itself():
    cfg = config(active="a", providers={"a": {"model": "m", "fallbacks": ["ghost"]}, "b": {"model": "n"},
                                        "c": {"model": "o", "fallbacks": ["gone"]}},
                 routes=[{"hint": "x", "provider": "nowhere", "model": "m"}, {"hint": "c", "provider": "c", "model": "o"}],
                 catalog=[{"model": "cm", "channels": ["b"], "order": "config"}])
    router = build_router(cfg, {})
    assert [w.code for w in router.warnings] == ["dangling_fallback_ref", "unknown_route_provider",
                                                 "dangling_fallback_ref"]
    assert set(router.domains) == {"c"}


def test_auto_from_the_operator_hands_the_choice_back_to_effort_routing():
    assert plan(config(**EFFORT), text=COMPLEX, operator_model="auto").domain == "cloud.main"


def test_an_unpinned_entry_without_a_model_is_skipped_and_the_chain_goes_on():
    cfg = config(active="a", providers={"a": {"fallbacks": ["b"]}, "b": {"model": "n"}})
    p = plan(cfg)
    assert labels(p) == ["b/n"] and [e.index for e in p.entries] == [0]


def test_outside_a_catalog_an_entry_is_priced_by_its_own_model_not_the_name_asked_for():
    cfg = config(active="a", providers={"a": {"model": "m1", "prices": {"asked": {"input_per_mtok": 9.0}}}})
    assert plan(cfg, model="asked").entries[0].price.input_per_mtok == 0.0


def test_a_pinned_default_domain_offers_only_what_it_sends_and_what_the_config_names():
    from relayline.machines.config import structure_config
    from relayline.machines.plan import model_offered

    # (tests/gateway/test_names.py asks the same through a gateway: unknown_models = "reject")
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim", "model": "m1", "fallback_models": ["m2"]},
                                                         "b": {"family": "sim", "model": "bm"}},
                            "routes": [{"hint": "fast", "provider": "b", "model": "bm"}],
                            "catalog": [{"model": "big", "channels": ["b"]}]})
    router = build_router(cfg, {})
    offered = ["auto", "fast", "hint:fast", "big", "m1", "m2", "a/m1", "a/m2"]
    assert [name for name in offered if not model_offered(router, name)] == []
    refused = ["AUTO", "hint:slow", "slow", "bm", "b/bm", "a/", "a/bm", "xa/m1", "m1/a", "hint:"]
    assert [name for name in refused if model_offered(router, name)] == []
