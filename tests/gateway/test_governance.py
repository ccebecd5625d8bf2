"""Named keys and teams: who calls the gateway, what it may name, and what it spent, by name.

Real loopback upstreams and a real gateway over HTTP (adapters/sim/background.py); keys come
from the environment or as their SHA-256, never in clear in the file, the ledger or a log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import subprocess
import time

import httpx
import pytest
from test_ops import CLI, HI, Captured, profiles, samples

from relayline.adapters.gateway.auth import key_id, load_access
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import structure_config
from relayline.machines.errors import ConfigError

SEARCH_KEY = "sk-search-0123456789"
ADS_KEY = "sk-ads-9876543210"
FLAT_KEY = "sk-flat-key"
ENV = {"SEARCH_KEY": SEARCH_KEY}


def governed(**gateway) -> dict:
    """Two profiles behind the route hints "fast" and "big"; a named key by env var on the team
    "search", and one given as its SHA-256 with an allowlist of "fast"."""
    config = profiles(routes=[{"hint": "fast", "provider": "openai.main", "model": "gpt-4o"},
                              {"hint": "big", "provider": "openai.backup", "model": "gpt-4o-mini"}])
    config["gateway"] = {
        "keys": [{"name": "search-bot", "key_env": "SEARCH_KEY", "team": "search"},
                 {"name": "ads-bot", "key_sha256": hashlib.sha256(ADS_KEY.encode()).hexdigest(), "team": "ads",
                  "models": ["fast"]}],
        "teams": [{"name": "search"}, {"name": "ads"}],
        **gateway,
    }
    return config


def chat(gw, key: str, model: str = "fast", path: str = "/v1/chat/completions") -> httpx.Response:
    if path == "/v1/messages":
        return httpx.post(f"{gw.url}{path}", json={"model": model, "messages": HI, "max_tokens": 16},
                          headers={"x-api-key": key, "anthropic-version": "2023-06-01"}, timeout=20)
    return httpx.post(f"{gw.url}{path}", json={"model": model, "messages": HI},
                      headers={"authorization": f"Bearer {key}"}, timeout=20)


# -- config ------------------------------------------------------------------------------------


def test_named_keys_and_teams_are_read_with_their_limits():
    cfg = structure_config(governed())
    search, ads = cfg.gateway.keys
    assert (search.name, search.key_env, search.team, search.models) == ("search-bot", "SEARCH_KEY", "search", None)
    assert ads.models == ("fast",) and ads.budget_period == "month" and cfg.gateway.limits_on_store_error == "local"


@pytest.mark.parametrize(("key", "problem"), [
    ({"name": "x"}, "gateway.keys[2]: set exactly one of key_env, key_sha256"),
    ({"name": "x", "key_env": "A", "key_sha256": "0" * 64}, "gateway.keys[2]: set exactly one of key_env, key_sha256"),
    ({"name": "x", "key_sha256": "ABC"}, "gateway.keys[2].key_sha256: must be 64 lowercase hex digits"),
    ({"name": "x", "key_env": "sk-pasted-key"}, "gateway.keys[2].key_env: must name an environment variable"),
    ({"name": "x", "key_env": "A", "team": "nobody"}, "gateway.keys[2].team: names no [[gateway.teams]] entry"),
    ({"name": "x", "key_env": "A", "models": ["nothing-such"]},
     "gateway.keys[2].models[0]: 'nothing-such' is neither a route hint nor a catalog model"),
    ({"name": "search-bot", "key_env": "A"}, "gateway.keys[2].name: 'search-bot' is already gateway.keys[0].name"),
    ({"name": "x", "key_env": "A", "rpm": 0}, "gateway.keys[2].rpm: must be at least 1"),
    ({"name": "x", "key_env": "A", "budget_period": "year"}, "gateway.keys[2].budget_period: must be one of"),
])
def test_a_wrong_named_key_is_refused_at_load_with_its_path(key, problem):
    config = governed()
    config["gateway"]["keys"].append(key)
    with pytest.raises(ConfigError) as caught:
        structure_config(config)
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems
    assert "sk-pasted-key" not in " ".join(caught.value.problems)  # a key pasted by mistake is not repeated


def test_a_named_key_whose_variable_is_unset_fails_closed_and_the_same_key_twice_is_refused():
    cfg = structure_config(governed())
    with pytest.raises(ConfigError) as unset:
        load_access(cfg, {})
    assert unset.value.problems == ["gateway.keys[0].key_env: names SEARCH_KEY, which is unset or empty "
                                    "(set it to the key named 'search-bot', or remove that key)"]
    with pytest.raises(ConfigError) as twice:
        load_access(cfg, {"SEARCH_KEY": ADS_KEY})
    assert twice.value.problems == ["gateway.keys: 'ads-bot' and 'search-bot' are the same key"]


# -- the gateway -------------------------------------------------------------------------------


def test_a_named_key_is_known_by_its_name_in_the_ledger_the_access_log_and_the_metrics(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with Captured(logging.INFO) as logs, BackgroundGateway(governed(), api_keys={FLAT_KEY}, env=ENV,
                                                          ledger_path=str(path)) as gw:
        assert chat(gw, SEARCH_KEY, "big").status_code == 200
        assert chat(gw, ADS_KEY).status_code == 200
        assert chat(gw, FLAT_KEY).status_code == 200  # the flat list works as before
        assert chat(gw, "sk-nobody").status_code == 401
        metrics = samples(httpx.get(f"{gw.url}/metrics", headers={"authorization": f"Bearer {FLAT_KEY}"}).text)
    rows = LedgerStore(path).rows()
    assert [(r["key_name"], r["team"], r["client"]) for r in rows] == [
        ("search-bot", "search", key_id(SEARCH_KEY)), ("ads-bot", "ads", key_id(ADS_KEY)), ("", "", key_id(FLAT_KEY))]
    lines = [json.loads(line) for line in logs.text.splitlines() if '"msg": "access"' in line]
    chats = [line for line in lines if line["path"] == "/v1/chat/completions"]
    assert [(line.get("key"), line.get("team")) for line in chats] == [
        ("search-bot", "search"), ("ads-bot", "ads"), (None, None), (None, None)]
    assert SEARCH_KEY not in logs.text and ADS_KEY not in logs.text
    assert metrics[("relayline_key_cost_usd_total", (("key", "search-bot"), ("team", "search")))] > 0
    assert metrics[("relayline_key_tokens_total", (("key", "ads-bot"), ("team", "ads")))] == 11


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_model_outside_the_keys_allowlist_is_a_403_that_names_it_and_nothing_is_sent(tmp_path, path):
    ledger = tmp_path / "ledger.sqlite3"
    with BackgroundGateway(governed(), env=ENV, ledger_path=str(ledger)) as gw:
        refused = chat(gw, ADS_KEY, "big", path)
        assert chat(gw, ADS_KEY, "hint:fast", path).status_code == 200
        assert chat(gw, SEARCH_KEY, "big", path).status_code == 200  # no allowlist: every model
        served = gw.sim.calls
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert "'ads-bot' may not use model 'big'" in error["message"] and "fast" in error["message"]
    assert (error.get("code"), error["type"]) == (("model_not_allowed", "invalid_request_error") if "chat" in path
                                                  else (None, "permission_error"))
    assert served == 2 and len(LedgerStore(ledger).rows()) == 2  # the refused request reached no upstream


def test_ledger_reports_spend_by_named_key_and_by_team(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with BackgroundGateway(governed(), env=ENV, ledger_path=str(path)) as gw:
        for key in (SEARCH_KEY, SEARCH_KEY, ADS_KEY):
            assert chat(gw, key).status_code == 200
    for by, name, count in (("key", "search-bot", 2), ("team", "ads", 1)):
        out = subprocess.run([*CLI, "ledger", "--path", path, "--by", by, "--json"], capture_output=True, text=True,
                             timeout=60)
        rows = {row["key_name" if by == "key" else "team"]: row for row in json.loads(out.stdout)["rows"]}
        assert rows[name]["accepted"] == count
        table = subprocess.run([*CLI, "ledger", "--path", path, "--by", by], capture_output=True, text=True,
                               timeout=60).stdout
        assert name in table and SEARCH_KEY not in table
    assert LedgerStore(path).spend("team", "search", 0.0) == pytest.approx(2 * (10 * 2 + 1 * 10) / 1e6)


def test_a_ledger_from_before_named_keys_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE attempts (id INTEGER PRIMARY KEY, ts REAL NOT NULL, turn TEXT NOT NULL,
            requested TEXT NOT NULL, provider TEXT NOT NULL, model TEXT NOT NULL, mode TEXT NOT NULL,
            outcome TEXT NOT NULL, accepted INTEGER NOT NULL, input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL, cost_usd REAL NOT NULL, client TEXT NOT NULL DEFAULT '');
        INSERT INTO attempts VALUES (1, 1.0, 't1', 'p/m', 'p', 'm', 'complete', 'ok', 1, 10, 2, 0.5, 'k-abc');
    """)
    old.commit()
    old.close()
    store = LedgerStore(path)
    assert store.rows()[0] | {"key_name": "", "team": ""} == store.rows()[0]
    assert store.report(by="key")[0]["key_name"] == "" and store.spend("key", "", 0.0) == 0.5
    store.close()


# -- admission: rpm, tpm and budgets, before anything is sent -----------------------------------


def limited(key: dict | None = None, team: dict | None = None, **gateway) -> dict:
    config = governed(**gateway)
    config["gateway"]["keys"][0].update(key or {})
    config["gateway"]["teams"][0].update(team or {})
    return config


def calls_and_rows(gw, ledger) -> tuple[int, int]:
    return gw.sim.calls, len(LedgerStore(ledger).rows())


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_requests_past_rpm_are_429s_with_retry_after_and_openai_headers_and_are_never_sent(tmp_path, path):
    ledger = tmp_path / "ledger.sqlite3"
    with BackgroundGateway(limited({"rpm": 2}), env=ENV, ledger_path=str(ledger)) as gw:
        answers = [chat(gw, SEARCH_KEY, path=path) for _ in range(3)]
        sent = calls_and_rows(gw, ledger)
    first, second, refused = answers
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"],
            second.headers["x-ratelimit-remaining-requests"]) == ("2", "1", "0")
    assert first.headers["x-ratelimit-reset-requests"] in ("59s", "1m0s")
    assert 55 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "0" and "x-should-retry" not in refused.headers
    error = refused.json()["error"]
    assert "'search-bot' is over its limit of 2 requests per minute" in error["message"]
    assert (error.get("code") or error["type"]) == ("rate_limit_exceeded" if "chat" in path else "rate_limit_error")
    assert sent == (2, 2)  # the refused request reached no upstream and left no ledger row


def test_tokens_are_estimated_at_admission_and_settled_with_the_billed_usage(tmp_path):
    # each request: "hi" (1 token) + 1 message + max_tokens 16 = 18 estimated; the upstream bills
    # 11 (10 in, 1 out). Settled: 0+18, 11+18, 22+18 = 40 fit in tpm 40, 33+18 does not; counted
    # at the estimate only, the third would already be over (36+18)
    with BackgroundGateway(limited({"tpm": 40}), env=ENV) as gw:
        answers = [httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "fast", "messages": HI,
                                                                     "max_tokens": 16},
                              headers={"authorization": f"Bearer {SEARCH_KEY}"}, timeout=20) for _ in range(4)]
        too_large = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "fast", "messages": HI,
                                                                      "max_tokens": 100},
                               headers={"authorization": f"Bearer {SEARCH_KEY}"}, timeout=20)
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert answers[0].headers["x-ratelimit-remaining-tokens"] == "22"  # 40 - 18, before its settlement
    assert answers[2].headers["x-ratelimit-remaining-tokens"] == "0"  # 40 - (11 + 11 + 18)
    assert "tokens per minute" in answers[3].json()["error"]["message"]
    assert too_large.status_code == 429 and too_large.headers["x-should-retry"] == "false"
    assert "larger than the key 'search-bot''s limit of 40 tokens per minute" in too_large.json()["error"]["message"]


def test_a_spent_budget_is_a_429_not_to_be_retried_and_the_ledger_remembers_it(tmp_path):
    # a request costs 30e-6 (10 in at $2, 1 out at $10 per Mtok); spend is below 50e-6 twice
    ledger = tmp_path / "ledger.sqlite3"
    config = limited({"budget_usd": 0.00005, "budget_period": "day"})
    with BackgroundGateway(config, env=ENV, ledger_path=str(ledger)) as gw:
        answers = [chat(gw, SEARCH_KEY) for _ in range(3)]
        sent = calls_and_rows(gw, ledger)
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert float(answers[0].headers["x-relayline-budget-remaining-usd"]) == pytest.approx(0.00005)
    refused = answers[2]
    assert refused.json()["error"]["code"] == "budget_exceeded" and refused.headers["x-should-retry"] == "false"
    assert "spent its budget of $5e-05 for this day (UTC)" in refused.json()["error"]["message"]
    assert 0 < int(refused.headers["retry-after"]) <= 86400 and sent == (2, 2)
    with BackgroundGateway(config, env=ENV, ledger_path=str(ledger)) as again:  # a restart: spend is the ledger's
        assert chat(again, SEARCH_KEY).status_code == 429 and again.sim.calls == 0


def test_a_teams_limit_counts_every_key_of_the_team(tmp_path):
    config = limited(team={"rpm": 3})
    config["gateway"]["keys"][1]["team"] = "search"
    with BackgroundGateway(config, env=ENV) as gw:
        statuses = [chat(gw, key).status_code for key in (SEARCH_KEY, ADS_KEY, SEARCH_KEY, ADS_KEY)]
    assert statuses == [200, 200, 200, 429]


def test_the_openai_sdk_waits_out_retry_after_and_does_not_retry_a_spent_budget():
    import openai

    config = limited({"rpm": 1}, team={"budget_usd": 0.00005})  # two requests spend 60e-6
    config["gateway"]["keys"][1]["team"] = "search"
    with BackgroundGateway(config, env=ENV) as gw:
        store = gw.gateway.limiter.local
        real = store.clock
        store.clock = lambda: real() - 58  # the key's first request was 58 s ago: a slot frees in 2 s
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=SEARCH_KEY, max_retries=2)
        assert client.chat.completions.create(model="fast", messages=HI).choices[0].message.content
        store.clock = real
        started = time.monotonic()
        waited = client.chat.completions.with_raw_response.create(model="fast", messages=HI)
        assert waited.status_code == 200 and 1.5 < time.monotonic() - started < 15  # one 429, then Retry-After
        assert waited.retries_taken == 1
        spender = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=ADS_KEY, max_retries=2)
        with pytest.raises(openai.RateLimitError) as spent:
            spender.chat.completions.create(model="fast", messages=HI)
        metrics = samples(httpx.get(f"{gw.url}/metrics", headers={"authorization": f"Bearer {SEARCH_KEY}"}).text)
    assert spent.value.code == "budget_exceeded"
    decisions = {labels: value for (name, labels), value in metrics.items() if name == "relayline_key_requests_total"}
    assert decisions[(("decision", "budget_exceeded"), ("key", "ads-bot"), ("team", "search"))] == 1  # not retried
    assert decisions[(("decision", "rate_limited"), ("key", "search-bot"), ("team", "search"))] == 1


def test_the_console_the_health_view_and_the_metrics_show_spend_and_what_is_left():
    config = limited({"rpm": 5, "tpm": 10000, "budget_usd": 1.0}, team={"budget_usd": 2.0, "budget_period": "week"})
    with BackgroundGateway(config, env=ENV) as gw:
        assert chat(gw, SEARCH_KEY).status_code == 200
        auth = {"authorization": f"Bearer {SEARCH_KEY}"}
        console = httpx.get(f"{gw.url}/admin/console/state", headers=auth).json()["limits"]
        health = httpx.get(f"{gw.url}/admin/health", headers=auth).json()["limits"]
        metrics = samples(httpx.get(f"{gw.url}/metrics", headers=auth).text)
    key = next(row for row in console if row["scope"] == "key")
    assert (key["name"], key["requests_left"], key["rpm"], key["budget_state"]) == ("search-bot", 4, 5, "open")
    assert key["spend_usd"] == pytest.approx(30e-6) and console == health
    team = next(row for row in console if row["scope"] == "team")
    assert team["budget_period"] == "week" and team["requests_left"] is None
    assert metrics[("relayline_limit_remaining", (("limit", "requests"), ("name", "search-bot"), ("scope", "key")))] == 4
    assert metrics[("relayline_budget_spend_usd", (("name", "search"), ("scope", "team")))] == pytest.approx(30e-6)


def test_named_keys_are_client_keys_for_the_bind_the_reload_and_auth_none():
    from relayline.adapters.gateway.auth import bind_refusal, keyless
    from relayline.adapters.gateway.reload import accept_reload

    named = structure_config(governed())
    assert not keyless(named) and bind_refusal(named, "0.0.0.0") is None
    bare = structure_config(profiles())
    assert keyless(bare) and "[[gateway.keys]]" in bind_refusal(bare, "0.0.0.0")
    with pytest.raises(ConfigError) as off:  # a reload never turns authentication off
        accept_reload(named, load_access(named, ENV), bare, ENV)
    assert "a reload never turns authentication off" in off.value.problems[0]
    with pytest.raises(ConfigError) as both:
        structure_config(governed(auth="none"))
    assert any(p.startswith('gateway.auth: "none" says the gateway takes no client keys') for p in both.value.problems)
