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

import httpx
import pytest

from relayline.adapters.gateway.auth import key_id, load_access
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.config import structure_config
from relayline.machines.errors import ConfigError

from test_ops import CLI, HI, Captured, profiles, samples

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
