"""docs/configuration.md: keys, defaults, strictness, key paths, secrets."""

import pytest

from relayline.machines.config import Config, Secret, parse_config, structure_config
from relayline.machines.errors import ConfigError


def test_defaults_are_config_md():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim"}}})
    r = cfg.reliability
    assert (r.provider_retries, r.backoff_ms, r.backoff_max_ms, r.retry_after_max_ms) == (2, 500, 10000, 30000)
    assert (r.rate_limit_cooldown_default_s, r.rate_limit_cooldown_max_s, r.max_fallback_depth) == (10, 60, 3)
    assert (r.client_errors, r.context_window, r.on_refusal) == ("advance", "return", "return")
    b = cfg.breaker
    assert (b.enabled, b.window_s, b.failure_threshold, b.open_s) == (True, 300, 3, 60)
    t = cfg.timeouts
    assert (t.headers_s, t.first_token_s, t.idle_s, t.gate_commit_s) == (240, 0, 60, 30)
    assert (cfg.stream.recovery, cfg.stream.continue_after_interrupt) == ("non_streaming", False)
    assert cfg.notices.model_fallback_notice == "off"
    p = cfg.providers["a"]
    assert (p.locality, p.capabilities.streaming, p.capabilities.tools, p.capabilities.vision,
            p.capabilities.prefill) == ("cloud", True, True, True, False)  # docs/wire.md


def test_backoff_floor_is_50ms():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim"}}, "reliability": {"backoff_ms": 1}})
    assert cfg.reliability.first_backoff_s == 0.05


def test_every_problem_is_reported_with_its_key_path():
    with pytest.raises(ConfigError) as info:
        structure_config({
            "active": "anthropic.main",
            "providers": {"anthropic.main": {"family": "anthropic", "fallbacks": ["x", 7], "colour": "red",
                                             "capabilities": {"streaming": "yes"}}},
            "reliability": {"provider_retries": "2", "client_errors": "maybe", "on_refusal": "retry"},
            "routes": [{"hint": "fast"}],
        })
    problems = info.value.problems
    assert 'providers."anthropic.main".fallbacks[1]: expected a string, got a number' in problems
    assert 'providers."anthropic.main".colour: unknown key' in problems
    assert 'providers."anthropic.main".capabilities.streaming: expected a boolean, got a string' in problems
    assert "reliability.provider_retries: expected an integer, got a string" in problems
    assert any(p.startswith("reliability.client_errors: must be one of 'advance', 'stop'") for p in problems)
    assert "reliability.on_refusal: must be one of 'return', 'advance', got 'retry'" in problems
    assert "routes[0].provider: required key is missing" in problems
    assert "routes[0].model: required key is missing" in problems


def test_semantic_problems_name_their_paths():
    with pytest.raises(ConfigError) as info:
        structure_config({
            "active": "ghost",
            "providers": {"a": {"family": "sim", "api_key": "k", "api_keys": ["k1"]}},
            "breaker": {"failure_threshold": 0},
            "routes": [{"hint": "x", "provider": "a", "model": "m"}, {"hint": "x", "provider": "a", "model": "n"}],
            "effort_routing": {"local_hint": "nope"},
        })
    text = "\n".join(info.value.problems)
    assert "active: names no profile" in text
    assert 'providers.a: set only one of api_key, api_key_env, api_keys' in text
    assert "breaker.failure_threshold: must be at least 1" in text
    assert "routes[1].hint: 'x' is already routes[0].hint" in text
    assert "effort_routing.local_hint: no route has hint 'nope'" in text


def test_invalid_toml_is_a_config_error():
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config("active = ", "relayline.toml")


def test_a_secret_never_shows_itself():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim", "api_keys": ["sk-one", "sk-two"]}},
                            "routes": [{"hint": "h", "provider": "a", "model": "m", "api_key": "sk-route"}]})
    text = repr(cfg) + str(cfg)
    for secret in ("sk-one", "sk-two", "sk-route"):
        assert secret not in text
    assert cfg.providers["a"].api_keys[1].reveal() == "sk-two"
    assert str(Secret("x")) == "Secret('***')"


def test_config_is_frozen():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim"}}})
    assert isinstance(cfg, Config)
    with pytest.raises(AttributeError):
        cfg.active = "b"


def test_retry_after_wait_max_s_is_off_by_default_and_not_negative():
    cfg = structure_config({"active": "a", "providers": {"a": {"family": "sim"}}})
    assert cfg.reliability.retry_after_wait_max_s == 0
    with pytest.raises(ConfigError, match=r"reliability.retry_after_wait_max_s: must not be negative"):
        structure_config({"active": "a", "providers": {"a": {"family": "sim"}},
                          "reliability": {"retry_after_wait_max_s": -1}})


# -- every check at its boundary: the last valid value passes, the first invalid one is named ------

AT_THE_EDGE = {
    "active": "a",
    "providers": {"a": {"family": "sim", "api_key_env": "KEY_1", "base_url": "http://h", "model": "m",
                        "max_output_tokens": 1, "price": {"input_per_mtok": 0, "output_per_mtok": 0},
                        "models": {"c": "id-c"}, "prices": {"c": {"input_per_mtok": 0}}},
                  "x.b": {"family": "sim", "base_url": "https://h:8443/v1"}},
    "reliability": {"provider_retries": 20, "backoff_ms": 0, "backoff_max_ms": 0, "retry_after_max_ms": 0,
                    "max_fallback_depth": 0, "rate_limit_cooldown_default_s": 0, "rate_limit_cooldown_max_s": 0,
                    "retry_after_wait_max_s": 0},
    "breaker": {"failure_threshold": 1, "window_s": 0.001, "open_s": 0.001},
    "timeouts": {"headers_s": 0, "first_token_s": 0, "idle_s": 0, "gate_commit_s": 0, "total_s": 0.001},
    "limits": {"max_response_bytes": 1},
    "gateway": {"max_body_bytes": 1, "max_header_bytes": 1, "max_in_flight": 0, "body_timeout_s": 0.001,
                "keep_alive_s": 0.001, "drain_s": 0, "api_keys_env": "K", "admin_keys_env": "A"},
    "routes": [{"hint": "local", "provider": "a", "model": "m"}, {"hint": "cloud", "provider": "b", "model": "n"}],
    "effort_routing": {},
    "catalog": [{"model": "c", "channels": ["a", "b"], "max_hops": 1}],
    "health": {"store": "rediss://h:6380/0", "key_prefix": "r"},
    "ledger": {"url": "postgres://u@h/db"},
}


def test_every_value_at_its_limit_is_valid():
    cfg = structure_config(AT_THE_EDGE)
    assert cfg.breaker.window_s == 0.001 and cfg.catalog[0].channels == ("a", "b")
    for store in ("memory", "redis://h:6379/0", "unix:///run/redis.sock"):
        assert structure_config({**AT_THE_EDGE, "health": {"store": store}}).health.store == store
    assert structure_config({**AT_THE_EDGE, "ledger": {"url": "postgresql://h/db"}}).ledger.url == "postgresql://h/db"


def test_every_value_past_its_limit_is_named_with_its_key_path():
    past = {
        "active": "ghost",
        "providers": {"a": {"family": "sim", "api_key_env": "sk-live 123", "base_url": "ftp://h", "model": " ",
                            "api_key": "k", "api_keys": ["k1"], "max_output_tokens": 0,
                            "price": {"input_per_mtok": -1, "output_per_mtok": -0.5},
                            "models": {"c": " ", "gone": "id"}, "prices": {"c": {"output_per_mtok": -1}}},
                      "x.b": {"family": "sim", "base_url": "https://user:pw@h"},
                      "y.b": {"family": "sim", "base_url": "http://h /v1"},
                      "c.d": {"family": "sim", "base_url": "https://"}},
        "reliability": {"provider_retries": 21, "backoff_ms": -1, "backoff_max_ms": -1, "retry_after_max_ms": -1,
                        "max_fallback_depth": -1, "rate_limit_cooldown_default_s": -0.1,
                        "rate_limit_cooldown_max_s": -0.1, "retry_after_wait_max_s": -0.1},
        "breaker": {"failure_threshold": 0, "window_s": 0, "open_s": 0},
        "timeouts": {"headers_s": -1, "first_token_s": -1, "idle_s": -1, "gate_commit_s": -1, "total_s": 0},
        "limits": {"max_response_bytes": 0},
        "gateway": {"max_body_bytes": 0, "max_header_bytes": 0, "max_in_flight": -1, "body_timeout_s": 0,
                    "keep_alive_s": 0, "drain_s": -1, "api_keys_env": " ", "admin_keys_env": ""},
        "routes": [{"hint": " local", "provider": "a", "model": "m"}, {"hint": "", "provider": "a", "model": " "},
                   {"hint": "h", "provider": "a", "model": "m"}, {"hint": "h", "provider": "a", "model": "m"}],
        "effort_routing": {"cloud_hint": "h"},
        "catalog": [{"model": "c", "channels": ["a", "a", "b", "ghost"], "max_hops": 0},
                    {"model": "c", "channels": []}, {"model": " c", "channels": ["a"]},
                    {"model": "hint:x", "channels": ["a"]}, {"model": "auto", "channels": ["a"]},
                    {"model": "h", "channels": ["a"]}],
        "health": {"store": "memcached://h", "key_prefix": ""},
        "ledger": {"url": "mysql://h/db"},
    }
    with pytest.raises(ConfigError) as info:
        structure_config(past)
    assert info.value.problems == [
        "active: names no profile under [providers] ('ghost')",
        "reliability.backoff_ms: must not be negative",
        "reliability.backoff_max_ms: must not be negative",
        "reliability.retry_after_max_ms: must not be negative",
        "reliability.max_fallback_depth: must not be negative",
        "reliability.provider_retries: at most 20",
        "reliability.rate_limit_cooldown_default_s: must not be negative",
        "reliability.rate_limit_cooldown_max_s: must not be negative",
        "reliability.retry_after_wait_max_s: must not be negative",
        "breaker.failure_threshold: must be at least 1",
        "breaker.window_s: must be positive",
        "breaker.open_s: must be positive",
        "timeouts.headers_s: must not be negative",
        "timeouts.first_token_s: must not be negative",
        "timeouts.idle_s: must not be negative",
        "timeouts.gate_commit_s: must not be negative",
        "timeouts.total_s: must be positive (every turn ends)",
        "limits.max_response_bytes: must be at least 1",
        "gateway.max_body_bytes: must be at least 1",
        "gateway.max_header_bytes: must be at least 1",
        "gateway.max_in_flight: must not be negative (0 = unbounded)",
        "gateway.body_timeout_s: must be positive",
        "gateway.keep_alive_s: must be positive",
        "gateway.drain_s: must not be negative",
        "gateway.api_keys_env: must name an environment variable (leave it out for none)",
        "gateway.admin_keys_env: must name an environment variable (leave it out for none)",
        "providers.a.api_key_env: must name an environment variable (letters, digits and underscores, not "
        "starting with a digit); to give the key itself use api_key",
        "providers.a.base_url: must be an http(s) URL such as https://api.example.com/v1",
        "providers.a: set only one of api_key, api_key_env, api_keys (found api_key, api_key_env, api_keys)",
        "providers.a.price.input_per_mtok: must not be negative",
        "providers.a.price.output_per_mtok: must not be negative",
        "providers.a.max_output_tokens: must be at least 1",
        "providers.a.model: must not be blank (leave it out for an unpinned profile)",
        'providers."x.b".base_url: must not carry credentials (user:password@); give the key with api_key_env',
        'providers."y.b".base_url: must be an http(s) URL such as https://api.example.com/v1',
        'providers."c.d".base_url: must be an http(s) URL such as https://api.example.com/v1',
        "routes[0].hint: must be a non-blank name without surrounding spaces",
        "routes[1].hint: must be a non-blank name without surrounding spaces",
        "routes[1].model: must not be blank",
        "routes[3].hint: 'h' is already routes[2].hint",
        'health.store: must be "memory" or a redis://host:port/db URL',
        "health.key_prefix: must not be empty (every worker's keys live under it)",
        "ledger.url: must be a postgresql://user@host/db URL",
        "effort_routing.local_hint: no route has hint 'local'",
        "catalog[0].channels[1]: 'a' is already channels[0]",
        "catalog[0].channels[2]: 'b' names no profile (or an ambiguous bare alias)",
        "catalog[0].channels[3]: 'ghost' names no profile (or an ambiguous bare alias)",
        "catalog[0].max_hops: must be at least 1",
        "catalog[1].model: 'c' is already catalog[0].model",
        "catalog[1].channels: must list at least one profile",
        "catalog[2].model: must be a non-blank name without surrounding spaces",
        "catalog[3].model: 'hint:x' is reserved (hint:NAME selects a route, auto effort routing)",
        "catalog[4].model: 'auto' is reserved (hint:NAME selects a route, auto effort routing)",
        "catalog[5].model: 'h' is also routes[2].hint; a name is either a route hint or a catalog model",
        "providers.a.models.c: must not be blank",
        "providers.a.models.gone: names no [[catalog]] model",
        "providers.a.prices.c.output_per_mtok: must not be negative",
    ]
    assert "sk-live" not in str(info.value) and "user:pw" not in str(info.value)


@pytest.mark.parametrize("raw, problem", [
    ({"providers": {}}, "active: required key is missing"),
    ({"active": "a", "providers": []}, "providers: expected a table, got a list"),
    ({"active": "a", "providers": {"a": "sim"}}, "providers.a: expected a table, got a string"),
    ({"active": "a", "providers": {"a": {"family": "sim", "fallbacks": "b"}}},
     "providers.a.fallbacks: expected a list, got a string"),
    ({"active": "a", "providers": {"a": {"family": "sim", "fallback_models": [1.5]}}},
     "providers.a.fallback_models[0]: expected a string, got a number"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "reliability": {"provider_retries": True}},
     "reliability.provider_retries: expected an integer, got a boolean"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "breaker": {"enabled": 1}},
     "breaker.enabled: expected a boolean, got a number"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "breaker": {"open_s": "1"}},
     "breaker.open_s: expected a number, got a string"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "breaker": {"open_s": [1]}},
     "breaker.open_s: expected a number, got a list"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "breaker": {"open_s": {"s": 1}}},
     "breaker.open_s: expected a number, got a table"),
    ({"active": "a", "providers": {"a": {"family": "sim", "api_key": 5}}},
     "providers.a.api_key: expected a string, got a number"),
    ({"active": "a", "providers": {"my-box_2": {"family": "sim", "api_keys": ["k", False]}}},
     "providers.my-box_2.api_keys[1]: expected a string, got a boolean"),
    ({"active": "a", "providers": {"a": {"family": "sim", "locality": "edge"}}},
     "providers.a.locality: must be one of 'cloud', 'local', got 'edge'"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "catalog": [{"model": "c", "channels": ["a"]}, {}]},
     "catalog[1].model: required key is missing"),
    ({"active": "a", "providers": {"a": {"family": "sim"}}, "2fast": 1}, '"2fast": unknown key'),
    ({"active": "a", "providers": {"a": {"family": "sim", "models": ["m"]}}},
     "providers.a.models: expected a table, got a list"),
    ({"active": "a", "providers": {"a": {"family": "sim", "headers": "x-team: a"}}},
     "providers.a.headers: expected a table, got a string"),
    ({"active": "a", "providers": {"a": {"family": "sim", "prices": {"m": 3}}}},
     "providers.a.prices.m: expected a table, got a number"),
])
def test_a_value_of_the_wrong_kind_is_named_with_its_path(raw, problem):
    with pytest.raises(ConfigError) as info:
        structure_config(raw)
    assert problem in info.value.problems


def test_a_whole_number_is_a_valid_float_and_dates_are_named_by_their_type():
    cfg = parse_config('active = "a"\n[providers.a]\nfamily = "sim"\n[breaker]\nopen_s = 5\n')
    assert cfg.breaker.open_s == 5.0 and isinstance(cfg.breaker.open_s, float)
    with pytest.raises(ConfigError) as info:
        parse_config('active = 1979-05-27\n[providers.a]\nfamily = "sim"\n')
    assert info.value.problems == ["active: expected a string, got date"]
    with pytest.raises(ConfigError) as info:
        structure_config(["not", "a", "table"])
    assert info.value.problems == ["config: expected a table"]
    with pytest.raises(ConfigError) as info:
        parse_config("active = ", "relayline.toml")
    assert info.value.problems[0].startswith("relayline.toml: not valid TOML: ")


def test_a_config_text_without_a_source_is_named_config():
    with pytest.raises(ConfigError) as info:
        parse_config("active = ")
    assert info.value.problems[0].startswith("config: not valid TOML: ")


def test_a_named_key_and_a_team_name_each_limit_past_its_edge():
    # at the edge (1 request or token a minute, a budget of nothing) every limit is valid
    edge = {"rpm": 1, "tpm": 1, "budget_usd": 0.0}
    structure_config({"active": "a", "providers": {"a": {"family": "sim"}},
                      "gateway": {"teams": [{"name": "t", **edge}],
                                  "keys": [{"name": "k", "key_env": "K", "team": "t", **edge}]}})
    past = {"rpm": 0, "tpm": 0, "budget_usd": -0.01}
    with pytest.raises(ConfigError) as info:
        structure_config({"active": "a", "providers": {"a": {"family": "sim"}},
                          "gateway": {"teams": [{"name": "t"}, {"name": "u", **past}],
                                      "keys": [{"name": "k", "key_env": "K", **past}]}})
    assert info.value.problems == [
        "gateway.teams[1].rpm: must be at least 1",
        "gateway.teams[1].tpm: must be at least 1",
        "gateway.teams[1].budget_usd: must not be negative",
        "gateway.keys[0].rpm: must be at least 1",
        "gateway.keys[0].tpm: must be at least 1",
        "gateway.keys[0].budget_usd: must not be negative",
    ]


def test_a_document_nested_past_the_parsers_depth_is_named_not_raised():
    # tomllib recurses per level: a RecursionError is no config problem of the operator's words
    with pytest.raises(ConfigError) as info:
        parse_config("a = " + "[" * 100_000 + "]" * 100_000, "deep.toml")
    assert info.value.problems == ["deep.toml: not a usable config: its tables or arrays nest too deeply"]


def test_headers_auth_and_named_keys_past_their_edge_are_named_with_their_paths():
    good = {"active": "a", "providers": {"a": {"family": "sim", "forward_headers": ["X-Team", "OpenAI-Organization"],
                                               "auth_header": "api-key"}},
            "routes": [{"hint": "fast", "provider": "a", "model": "m"}],
            "gateway": {"auth": "none", "teams": [{"name": "t"}],
                        "keys": [{"name": "k", "key_sha256": "0" * 64, "team": "t", "models": ["fast"]}]}}
    with pytest.raises(ConfigError) as info:  # auth = "none" with named keys is a contradiction
        structure_config(good)
    assert info.value.problems == ['gateway.auth: "none" says the gateway takes no client keys, but '
                                   "gateway.api_keys_env or [[gateway.keys]] names some: remove one of the two"]
    good["gateway"]["auth"] = "keys"
    structure_config(good)
    structure_config({"active": "a", "providers": {"a": {"family": "sim"}}, "gateway": {"auth": "none"}})
    past = {"active": "a",
            "providers": {"a": {"family": "sim", "forward_headers": ["x team", "Host", "content-type"],
                                "auth_header": "Content-Length"},
                          "b": {"family": "sim", "auth_header": "bad header"}},
            "gateway": {"auth": "none", "api_keys_env": "K",
                        "teams": [{"name": "t"}, {"name": "t"}, {"name": " u"}, {"name": ""}],
                        "keys": [{"name": "k", "key_env": "K", "key_sha256": "0" * 64},
                                 {"name": "k"},
                                 {"name": "bad\tname", "key_sha256": "ABC", "models": []},
                                 {"name": "a b", "key_env": "K"}]}}
    with pytest.raises(ConfigError) as info:
        structure_config(past)
    assert info.value.problems == [
        'gateway.auth: "none" says the gateway takes no client keys, but gateway.api_keys_env or [[gateway.keys]] '
        "names some: remove one of the two",
        "gateway.teams[1].name: 't' is already gateway.teams[0].name",
        "gateway.teams[2].name: must be a non-blank name without spaces",
        "gateway.teams[3].name: must be a non-blank name without spaces",
        "gateway.keys[1].name: 'k' is already gateway.keys[0].name",
        "gateway.keys[2].name: must be a non-blank name without spaces",
        "gateway.keys[3].name: must be a non-blank name without spaces",
        "gateway.keys[0]: set exactly one of key_env, key_sha256",
        "gateway.keys[1]: set exactly one of key_env, key_sha256",
        "gateway.keys[2].key_sha256: must be 64 lowercase hex digits (the key's SHA-256)",
        "gateway.keys[2].models: must list at least one model (leave it out for all)",
        "providers.a.forward_headers[0]: not a header name",
        "providers.a.forward_headers[1]: Host describes the connection or the body, not the request: it is never "
        "forwarded",
        "providers.a.forward_headers[2]: content-type describes the connection or the body, not the request: it is "
        "never forwarded",
        "providers.a.auth_header: not a header name that can carry a key",
        "providers.b.auth_header: not a header name that can carry a key",
    ]
