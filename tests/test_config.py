"""CONFIG.md "File shape": keys, defaults, strictness, key paths, secrets."""

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
            p.capabilities.prefill) == ("cloud", True, True, True, False)  # CONFIG.md "The wire"


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
