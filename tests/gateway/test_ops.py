"""Running the gateway in production, over real loopback sockets: fail-closed keys,
the admin key, probes, client limits, load shedding, access lines, metrics, request ids, spend
per client key, and the drain on SIGTERM with `relayline serve` as its own process."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from fleet import ServeProcess
from prometheus_client.parser import text_string_to_metric_families

from helpers import to_toml
from relayline.adapters.gateway.auth import KeyRing, is_loopback, key_id
from relayline.adapters.logs import JsonFormatter
from relayline.adapters.sim.background import BackgroundGateway, BackgroundUpstreams
from relayline.adapters.stores.ledger import LedgerStore

HI = [{"role": "user", "content": "hi"}]
CLI = [sys.executable, "-m", "relayline.adapters.cli"]


def profiles(**extra) -> dict:
    config = {
        "active": "openai.main",
        "reliability": {"provider_retries": 0, "backoff_ms": 50},
        "providers": {
            "openai.main": {"family": "sim", "model": "gpt-4o", "fallbacks": ["openai.backup"],
                            "price": {"input_per_mtok": 2.0, "output_per_mtok": 10.0}},
            "openai.backup": {"family": "sim", "model": "gpt-4o-mini",
                              "price": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}},
        },
    }
    config.update(extra)
    return config


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def chat(gw, key: str | None = None, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": HI, **body},
                      headers=headers, timeout=20)


class Captured:
    """The gateway's records as JSON lines, the way `--log-format json` writes them."""

    def __init__(self, level=logging.DEBUG) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(JsonFormatter())
        self.level = level

    def __enter__(self) -> Captured:
        root = logging.getLogger()
        self.old_level = root.level
        root.addHandler(self.handler)
        root.setLevel(self.level)
        return self

    def __exit__(self, *exc_info) -> None:
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.setLevel(self.old_level)

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def access(self) -> list[dict]:
        return [line for line in map(json.loads, self.text.splitlines()) if line["logger"] == "relayline.access"]


# -- keys -----------------------------------------------------------------------------------------


def test_serve_refuses_to_start_when_the_key_variable_is_unset(tmp_path):
    path = tmp_path / "gw.toml"
    path.write_text(to_toml(profiles(gateway={"api_keys_env": "RELAYLINE_TEST_KEYS"})))
    env = {k: v for k, v in os.environ.items() if k != "RELAYLINE_TEST_KEYS"}
    for value in (None, " , "):  # unset, or only separators and blanks
        if value is not None:
            env["RELAYLINE_TEST_KEYS"] = value
        out = subprocess.run([*CLI, "serve", "--config", path, "--port", "0"], capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [out.stderr.strip()]  # one line
        assert "gateway.api_keys_env: names RELAYLINE_TEST_KEYS, which is unset or empty" in out.stderr
        assert "Traceback" not in out.stderr
    check = subprocess.run([*CLI, "check", path], capture_output=True, text=True, timeout=60, env=env)
    assert check.returncode == 1 and "gateway.api_keys_env" in check.stderr


def test_admin_endpoints_need_the_admin_key_and_chat_needs_a_client_key():
    with BackgroundGateway(profiles(), api_keys={"client-key-1"}, admin_keys={"admin-key-1"}) as gw:
        def get(path, key=None):
            return httpx.get(f"{gw.url}{path}", headers={"authorization": f"Bearer {key}"} if key else {})

        for path in ("/metrics", "/admin/health", "/admin/plan"):
            assert get(path).status_code == 401
            assert get(path, "client-key-1").status_code == 401  # a client key is not an admin key
            assert get(path, "admin-key-1").status_code == 200
        assert httpx.get(f"{gw.url}/admin/health", headers={"x-api-key": "admin-key-1"}).status_code == 200
        assert chat(gw).status_code == 401
        assert chat(gw, "admin-key-1").status_code == 401  # nor an admin key a client key
        assert chat(gw, "client-key-1").status_code == 200
        assert get("/healthz").status_code == 200 and get("/readyz").status_code == 200  # probes need no key


def test_without_admin_keys_admin_takes_a_client_key_or_loopback_only():
    with BackgroundGateway(profiles(), api_keys={"client-key-1"}) as gw:
        assert httpx.get(f"{gw.url}/metrics").status_code == 401
        assert httpx.get(f"{gw.url}/metrics", headers={"authorization": "Bearer client-key-1"}).status_code == 200
    with BackgroundGateway(profiles()) as gw:
        assert httpx.get(f"{gw.url}/admin/health").status_code == 200  # the test client is on loopback
    assert is_loopback(("127.0.0.1", 5)) and is_loopback(("::1", 5))
    assert not is_loopback(("10.0.0.1", 5)) and not is_loopback(None) and not is_loopback(("unix", 0))


def test_key_ring_matches_by_digest_and_names_keys_by_a_short_hash():
    ring = KeyRing.of(["alpha-key", "beta-key"])
    assert ring.match("alpha-key") == key_id("alpha-key") and ring.match("beta-key") == key_id("beta-key")
    assert ring.match("alpha-ke") is None and ring.match("") is None and ring.match(None) is None
    assert "alpha-key" not in repr(ring) and key_id("alpha-key") != key_id("beta-key")
    assert key_id("alpha-key").startswith("k-") and len(key_id("alpha-key")) == 14


# -- probes -----------------------------------------------------------------------------------------


def test_healthz_and_readyz(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with BackgroundGateway(profiles(), api_keys={"k"}, ledger_path=str(path)) as gw:
        assert httpx.get(f"{gw.url}/healthz").json() == {"status": "ok"}
        ready = httpx.get(f"{gw.url}/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"config": "ok", "ledger": "ok"}

        async def unreachable():
            return "the shared store does not answer"

        # a shared health store that is down is reported, and the gateway stays ready: it
        # serves on local health (a 503 would take every worker of the fleet out at once)
        gw.gateway.degradations["shared_store"] = unreachable  # the hook a shared health store uses
        ready = httpx.get(f"{gw.url}/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "degraded", "checks": {
            "config": "ok", "ledger": "ok", "shared_store": "the shared store does not answer"}}
        gw.gateway.readiness["ledger"] = unreachable  # (as a ledger that cannot be written)
        ready = httpx.get(f"{gw.url}/readyz")
        assert ready.status_code == 503 and ready.json()["status"] == "not ready"


def test_readyz_reports_a_ledger_that_cannot_be_written(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with BackgroundGateway(profiles(), ledger_path=str(path)) as gw:
        blocker = sqlite3.connect(path, isolation_level=None, timeout=0)
        blocker.execute("BEGIN EXCLUSIVE")  # another writer holds the database
        try:
            ready = httpx.get(f"{gw.url}/readyz", timeout=30)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert ready.status_code == 503 and ready.json()["checks"]["ledger"] == "the ledger is not writable"
        assert httpx.get(f"{gw.url}/readyz").status_code == 200


# -- client limits ----------------------------------------------------------------------------------


def test_a_slow_body_is_answered_408_within_the_timeout():
    with BackgroundGateway(profiles(gateway={"body_timeout_s": 0.5})) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            started = time.monotonic()
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100\r\n\r\n{\"model\":")  # 9 bytes of 100
            reply = b""
            while b"\r\n\r\n" not in reply:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
            waited = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408"), reply[:100]
        assert 0.4 <= waited < 5


def test_headers_beyond_the_limit_are_refused():
    with BackgroundGateway(profiles(gateway={"max_header_bytes": 4096})) as gw:
        big = httpx.get(f"{gw.url}/healthz", headers={"x-filler": "a" * 8000})
        small = httpx.get(f"{gw.url}/healthz", headers={"x-filler": "a" * 1000})
    assert big.status_code == 431 and small.status_code == 200


def test_a_whole_head_beyond_the_limit_is_refused_in_its_routes_dialect_with_a_request_id():
    # why the app, not the server, decides a whole head's 431 (app.py's _route)
    with BackgroundGateway(profiles(gateway={"max_header_bytes": 4096})) as gw:
        big = httpx.post(f"{gw.url}/v1/messages", json={}, headers={"x-filler": "a" * 8000})
    assert big.status_code == 431 and big.headers["x-request-id"] and big.headers["connection"] == "close"
    assert big.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": "request headers larger than 4096 bytes"}}


def test_a_query_string_counts_toward_the_header_limit():
    # a head that arrives whole in one read is measured by the app: the query is part of it
    with BackgroundGateway(profiles(gateway={"max_header_bytes": 4096})) as gw:
        big = httpx.get(f"{gw.url}/healthz", params={"q": "a" * 8000})
        small = httpx.get(f"{gw.url}/healthz", params={"q": "a" * 1000})
    assert big.status_code == 431 and small.status_code == 200


def test_load_beyond_max_in_flight_is_shed_with_retry_after_and_nothing_is_lost(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    replies = [{"provider": "openai.main", "script": [{"text": "slow answer", "delay": 0.6}]}]
    with BackgroundGateway(profiles(gateway={"max_in_flight": 3}), replies, ledger_path=str(path)) as gw:
        results: list[httpx.Response] = []

        async def one(client: httpx.AsyncClient) -> None:
            results.append(await client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": HI}))

        async def burst() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                async with trio.open_nursery() as nursery:
                    for _ in range(12):
                        nursery.start_soon(one, client)

        trio.run(burst)
        calls = gw.sim.calls
        rows = LedgerStore(path).rows()
    ok = [r for r in results if r.status_code == 200]
    shed = [r for r in results if r.status_code == 503]
    assert len(ok) + len(shed) == 12 and 3 <= len(ok) < 12
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded" for r in shed)
    assert all(r.json()["choices"][0]["message"]["content"] == "slow answer" for r in ok)
    # nothing lost: every admitted turn reached the upstream once and was billed; no shed one did
    assert calls == len(ok) and len(rows) == len(ok)
    assert {r["turn"] for r in rows} == {r.json()["id"] for r in ok}


# -- logs, request ids, metrics ---------------------------------------------------------------------


def test_access_lines_are_json_with_the_request_id_which_is_echoed_and_sent_upstream():
    replies = [{"provider": "openai.main", "script": [{"status": 503}]},
               {"provider": "openai.backup", "script": [{"text": "from the backup"}]}]
    with Captured(logging.INFO) as logs, BackgroundGateway(profiles(), replies) as gw:
        given = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": HI},
            headers={"x-request-id": "req-abc.123"})
        made = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": HI},
                          headers={"x-request-id": "not a token\tat all"})
        httpx.get(f"{gw.url}/nowhere")
        seen_upstream = list(gw.sim.request_ids)
    assert given.headers["x-request-id"] == "req-abc.123"
    generated = made.headers["x-request-id"]
    assert generated != "not a token\tat all" and len(generated) == 32
    assert seen_upstream[:2] == ["req-abc.123", "req-abc.123"] and seen_upstream[2] == generated
    lines = logs.access()
    assert [line["request_id"] for line in lines[:2]] == ["req-abc.123", generated]
    first = lines[0]
    assert first["method"] == "POST" and first["path"] == "/v1/chat/completions" and first["status"] == 200
    assert first["requested"] == "openai.main/gpt-4o" and first["served"] == "openai.backup/gpt-4o-mini"
    assert first["attempts"] == 2 and first["input_tokens"] == 10 and first["output_tokens"] == 3
    assert first["cost_usd"] == pytest.approx(13 / 1e6) and first["latency_ms"] >= first["ttfb_ms"] > 0
    assert lines[2]["status"] == 404 and lines[2]["path"] == "/nowhere"
    warnings = [json.loads(line) for line in logs.text.splitlines() if '"level": "warning"' in line]
    # an event's fields are JSON fields, as the access line's are (a missing value is null)
    assert {"msg": "fallback", "request_id": "req-abc.123", "requested": "openai.main/gpt-4o",
            "served": "openai.backup/gpt-4o-mini", "attempts": 2}.items() <= warnings[0].items()
    turns = [json.loads(line) for line in logs.text.splitlines() if '"msg": "turn"' in line]
    assert turns and turns[0]["error"] is None and turns[0]["served"] == "openai.backup/gpt-4o-mini"


def test_breaker_transitions_and_exhausted_turns_are_warnings():
    config = profiles(breaker={"failure_threshold": 1, "open_s": 30})
    replies = [{"provider": "openai.main", "script": [{"status": 503}]},
               {"provider": "openai.backup", "script": [{"status": 500}]}]
    with Captured(logging.WARNING) as logs, BackgroundGateway(config, replies) as gw:
        assert chat(gw).status_code == 502
    records = [json.loads(line) for line in logs.text.splitlines()]
    assert any(r["msg"] == "turn_failed" and r["reason"] == "exhausted" and r["attempts"] == 2 for r in records)
    for profile in ("openai.main", "openai.backup"):
        assert {"msg": "breaker_transition", "profile": profile, "from": "closed", "to": "open"} in [
            {k: r.get(k) for k in ("msg", "profile", "from", "to")} for r in records]


def test_metrics_parse_and_carry_the_operating_series():
    replies = [{"provider": "openai.main", "script": [{"status": 503}, {"text": "second"}]},
               {"provider": "openai.backup", "script": [{"text": "from the backup"}]}]
    # unknown_models = "default": a name nothing offers is served, and must still not become a label
    config = profiles(breaker={"failure_threshold": 1, "open_s": 30}, gateway={"unknown_models": "default"})
    with BackgroundGateway(config, replies) as gw:
        assert chat(gw).status_code == 200  # main fails (its breaker opens), the backup answers
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions",
                          json={"model": "gpt-4o", "messages": HI, "stream": True}) as response:
            assert response.status_code == 200 and response.read()
        assert chat(gw, model="somebody-else's-model").status_code == 200
        text = httpx.get(f"{gw.url}/metrics").text
    found = samples(text)
    backup = (("model", "gpt-4o-mini"), ("provider", "openai.backup"))
    assert found[("relayline_breaker_state", (("provider", "openai.main"),))] == 2  # open
    assert found[("relayline_breaker_state", (("provider", "openai.backup"),))] == 0
    assert 29 < found[("relayline_cooldown_seconds", (("provider", "openai.main"),))] + 30 <= 60
    assert found[("relayline_in_flight", ())] == 0
    assert found[("relayline_time_to_first_token_seconds_count", backup)] == 3
    assert found[("relayline_tokens_total", (("direction", "input"), *backup))] == 30
    assert found[("relayline_cost_usd_total", backup)] == pytest.approx(3 * 13 / 1e6)
    assert found[("relayline_http_requests_total", (("route", "/v1/chat/completions"), ("status", "200")))] == 3
    assert found[("relayline_attempts_total", (("model", "gpt-4o"), ("outcome", "retryable"),
                                               ("provider", "openai.main")))] == 1
    assert found[("relayline_breaker_transitions_total", (("provider", "openai.main"),))] == 1
    # label sets stay bounded: a model nobody configured is not a label value
    assert not any("somebody" in value for _, labels in found for _, value in labels)


# -- the ledger: spend per client key ---------------------------------------------------------------


def test_spend_is_reported_per_client_key_id(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with BackgroundGateway(profiles(), api_keys={"team-a-key", "team-b-key"}, ledger_path=str(path)) as gw:
        for key in ("team-a-key", "team-a-key", "team-b-key"):
            assert chat(gw, key).status_code == 200
    out = subprocess.run([*CLI, "ledger", "--path", path, "--by", "client", "--json"], capture_output=True,
                         text=True, timeout=60)
    rows = {row["client"]: row for row in json.loads(out.stdout)["rows"]}
    assert set(rows) == {key_id("team-a-key"), key_id("team-b-key")}
    assert rows[key_id("team-a-key")]["accepted"] == 2 and rows[key_id("team-b-key")]["accepted"] == 1
    assert rows[key_id("team-a-key")]["accepted_cost_usd"] == pytest.approx(2 * (10 * 2 + 1 * 10) / 1e6)  # "ok": 10 in, 1 out
    table = subprocess.run([*CLI, "ledger", "--path", path, "--by", "client"], capture_output=True, text=True,
                           timeout=60).stdout
    assert key_id("team-b-key") in table and "team-b-key" not in table


def test_a_ledger_from_before_client_ids_is_migrated_in_place(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE attempts (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, turn TEXT NOT NULL,
            requested TEXT NOT NULL, provider TEXT NOT NULL, model TEXT NOT NULL, mode TEXT NOT NULL,
            outcome TEXT NOT NULL, accepted INTEGER NOT NULL, input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL, cost_usd REAL NOT NULL);
        INSERT INTO attempts VALUES (1, 1.0, 't1', 'p/m', 'p', 'm', 'complete', 'ok', 1, 10, 2, 0.5);
    """)
    old.commit()
    old.close()
    store = LedgerStore(path)
    assert store.rows()[0]["client"] == "" and store.rows()[0]["cost_usd"] == 0.5
    assert store.rows()[0]["estimated"] == 0  # (the provider's usage, as every row before the column)
    assert store.report(by="client") == [{"client": "", "accepted": 1, "rejected": 0, "accepted_cost_usd": 0.5,
                                          "rejected_cost_usd": 0, "input_tokens": 10, "output_tokens": 2,
                                          "estimated": 0}]
    store.close()
    LedgerStore(path).close()  # opening a migrated ledger again changes nothing


# -- the command line -------------------------------------------------------------------------------


def run(*args, **kwargs):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=60, **kwargs)


def test_bare_relayline_prints_help_and_version_prints_the_version():
    bare = run()
    assert bare.returncode == 0 and "usage: relayline" in bare.stdout and "serve" in bare.stdout
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("relayline 0.")


def test_every_flag_has_help_and_shows_its_default():
    from relayline.adapters.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    assert "(default: 8080)" in " ".join(run("serve", "--help").stdout.split())


@pytest.mark.parametrize("port", ["abc", "-1", "70000"])
def test_a_bad_port_is_one_usage_line(port):
    out = run("serve", "--port", port)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "a port is a number" in out.stderr


def test_a_port_in_use_is_one_line(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        out = run("serve", "--port", holder.getsockname()[1])
    finally:
        holder.close()
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "error: cannot listen on 127.0.0.1:" in out.stderr


def test_config_encodings(tmp_path):
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b'\xef\xbb\xbfactive = "a"\n[providers.a]\nfamily = "sim"\n')
    assert run("check", bom).returncode == 0
    latin = tmp_path / "latin.toml"
    latin.write_bytes('active = "caf\xe9"\n'.encode("latin-1"))
    for args in (("check", latin), ("plan", latin), ("serve", "--config", latin, "--port", "0")):
        out = run(*args)
        assert out.returncode in (1, 2) and "Traceback" not in out.stderr
        assert "not UTF-8 text (byte 0xe9 at offset 13)" in out.stderr


def test_plan_into_a_closed_pipe_is_quiet(tmp_path):
    config = profiles()
    config["providers"]["openai.main"]["fallback_models"] = [f"model-{i}" for i in range(3000)]
    path = tmp_path / "c.toml"
    path.write_text(to_toml(config))
    # a plan far longer than a pipe buffer, read by a reader that leaves after 10 bytes
    out = subprocess.run(f"{sys.executable} -m relayline.adapters.cli plan {path} --json | head -c 10", shell=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout == "{\n  \"domai" and out.stderr == ""


def test_check_flags_what_an_operator_gets_wrong(tmp_path):
    bad = profiles(gateway={"max_body_bytes": 0})
    bad["providers"]["openai.main"]["base_url"] = "not a url"
    path = tmp_path / "bad.toml"
    path.write_text(to_toml(bad))
    out = run("check", path)
    assert out.returncode == 1
    assert 'providers."openai.main".base_url: must be an http(s) URL' in out.stderr
    assert "gateway.max_body_bytes: must be at least 1" in out.stderr

    routed = profiles(routes=[{"hint": "fast", "provider": "openai.ghost", "model": "m"}])
    routed["providers"]["openai.main"]["family"] = "openai"
    routed["providers"]["openai.main"]["api_key"] = "sk-test"
    routed["providers"]["openai.main"].pop("price")
    path.write_text(to_toml(routed))
    out = run("check", path)
    assert out.returncode == 1 and "routes[0].provider: 'openai.ghost' names no profile" in out.stderr
    routed.pop("routes")
    path.write_text(to_toml(routed))
    out = run("check", path)
    assert out.returncode == 0
    assert 'warning: missing_price at providers."openai.main".price' in out.stdout and "cost 0" in out.stdout


# -- the drain ---------------------------------------------------------------------------------------


def test_sigterm_during_50_streams_drains_then_cancels_and_exits_0(tmp_path):
    short = {"frames": [{"role": True}, {"text": "short"}, {"wait": 0.3}, {"text": " answer"}, {"usage": [10, 2]},
                        {"done": True}]}
    # usage comes first: a long stream cut by the drain is still a billable attempt
    long = {"frames": [{"role": True}, {"usage": [10, 1]}, {"text": "long"}, {"wait": 20}, {"text": " never"},
                       {"done": True}]}
    config = {
        "active": "openai.short",
        "reliability": {"provider_retries": 0},
        "gateway": {"drain_s": 1.5},
        "ledger": {"path": str(tmp_path / "ledger.sqlite3")},
        "providers": {"openai.short": {"family": "sim", "model": "short-model"},
                      "openai.long": {"family": "sim", "model": "long-model"}},
        "routes": [{"hint": "long", "provider": "openai.long", "model": "long-model"}],
    }
    with BackgroundUpstreams([{"provider": "openai.short", "script": [short]},
                        {"provider": "openai.long", "script": [long]}]) as sim:
        path = tmp_path / "gw.toml"
        path.write_text(to_toml(sim.wire(config)))
        with ServeProcess(path, "--log-format", "json") as gateway:
            outcomes = trio.run(_fifty_streams, gateway.url, gateway.proc)
            assert gateway.proc.wait(timeout=30) == 0
        stderr = gateway.stderr
    assert "Traceback" not in stderr
    done = [o for o in outcomes if o["end"] == "done"]
    cut = [o for o in outcomes if o["end"] == "error"]
    assert len(done) == 25 and len(cut) == 25  # the short ones finished inside drain_s, the long ones did not
    assert all(o["text"] == "short answer" for o in done) and all(o["text"] == "long" for o in cut)
    assert all(o["error"]["code"] == "shutting_down" for o in cut)
    rows = LedgerStore(tmp_path / "ledger.sqlite3").rows()
    by_turn = {r["turn"]: r for r in rows}
    assert len(rows) == 50 and set(by_turn) == {o["id"] for o in outcomes}
    assert all(by_turn[o["id"]]["outcome"] == "ok" for o in done)
    assert all(by_turn[o["id"]]["outcome"] == "cancelled" for o in cut)
    drain = next(json.loads(line) for line in stderr.splitlines() if '"msg": "draining"' in line)
    assert drain["signal"] == "SIGTERM" and drain["drain_s"] == 1.5 and isinstance(drain["in_flight"], int)


async def _fifty_streams(url: str, proc: subprocess.Popen) -> list[dict]:
    outcomes: list[dict] = []
    committed = 0
    all_committed = trio.Event()

    async def stream(client: httpx.AsyncClient, model: str) -> None:
        nonlocal committed
        outcome = {"text": "", "end": "eof", "id": None, "error": None}
        body = {"model": model, "messages": HI, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome["end"] = "done"
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome["end"], outcome["error"] = "error", event["error"]
                    continue
                outcome["id"] = event["id"]
                for choice in event["choices"]:
                    if choice["delta"].get("content") and not outcome["text"]:
                        committed += 1
                        if committed == 50:
                            all_committed.set()
                    outcome["text"] += choice["delta"].get("content") or ""
        outcomes.append(outcome)

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(stream, client, "long" if i % 2 else "short-model")
            with trio.fail_after(20):
                await all_committed.wait()
            proc.send_signal(signal.SIGTERM)
    return outcomes


def test_sigint_exits_0_without_a_traceback(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(to_toml(profiles(ledger={"path": str(tmp_path / "l.sqlite3")})))
    with ServeProcess(path, "--log-format", "json") as gateway:
        assert httpx.get(f"{gateway.url}/healthz").status_code == 200
        gateway.signal(signal.SIGINT)
        assert gateway.proc.wait(timeout=30) == 0
    assert "Traceback" not in gateway.stderr


def test_sigterm_during_a_stream_refuses_new_connections_and_the_stream_finishes(tmp_path):
    slow = {"frames": [{"role": True}, {"text": "first"}, {"wait": 0.5}, {"text": " last"}, {"usage": [10, 2]},
                       {"done": True}]}
    config = {"active": "openai.slow", "reliability": {"provider_retries": 0}, "gateway": {"drain_s": 10},
              "ledger": {"path": str(tmp_path / "ledger.sqlite3")},
              "providers": {"openai.slow": {"family": "sim", "model": "slow-model"}}}
    refused = False
    with BackgroundUpstreams([{"provider": "openai.slow", "script": [slow]}]) as sim:
        path = tmp_path / "gw.toml"
        path.write_text(to_toml(sim.wire(config)))
        with ServeProcess(path, "--log-format", "json") as gateway:
            port = int(gateway.url.rsplit(":", 1)[1])
            body = {"model": "slow-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=10) as response:
                lines = response.iter_lines()
                seen = next(line for line in lines if '"first"' in line)  # committed: the stream is running
                gateway.signal(signal.SIGTERM)
                deadline = time.monotonic() + 5
                while not refused and time.monotonic() < deadline:
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=1).close()
                        time.sleep(0.05)
                    except ConnectionRefusedError:
                        refused = True
                rest = [line for line in lines if line.startswith("data: ")]
            assert gateway.proc.wait(timeout=30) == 0
    assert seen and refused
    assert rest[-1] == "data: [DONE]" and any('" last"' in line for line in rest)


# -- OpenTelemetry (the otel extra; part of dev, so make test runs this) ------------------------------



TRACING_SET_UP_LATER = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from relayline.adapters.otel import Tracing
from relayline.machines.turn import TurnResult

result = TurnResult(outcome="ok", error=None, message=None, requested="p/m", served=None, text="hi", reasoning="",
                    tool_calls=(), partial_text=None, notice=None, fallback=False, attempts=(), skipped=(), ledger=())
tracing = Tracing()  # made before any SDK: the API alone, spans not built
assert not tracing._recording()
tracing.turn(result, started=1.0, ended=2.0, clock_now=2.0)
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # the SDK set up since: the next turn is traced
tracing.turn(result, started=2.0, ended=3.0, clock_now=3.0, request_id="later")
assert [s.attributes["relayline.request_id"] for s in exporter.get_finished_spans()] == ["later"]
print("ok")
"""


def test_an_sdk_set_up_after_the_gateway_traces_the_turns_from_then_on():
    pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
    # (its own process: a global tracer provider can be set once a process)
    done = subprocess.run([sys.executable, "-c", TRACING_SET_UP_LATER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_turns_and_attempts_are_genai_spans():
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from relayline.adapters.otel import Tracing

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    replies = [{"provider": "openai.main", "script": [{"status": 503}]},
               {"provider": "openai.backup", "script": [{"text": "from the backup"}]}]
    with BackgroundGateway(profiles(), replies) as gw:
        gw.gateway.tracing = Tracing(provider)
        response = httpx.post(f"{gw.url}/v1/chat/completions", headers={"x-request-id": "trace-me-1"},
                              json={"model": "gpt-4o", "messages": [{"role": "user", "content": "SECRET PROMPT"}]})
        assert response.status_code == 200
    spans = exporter.get_finished_spans()
    turn = next(s for s in spans if s.parent is None)
    attempts = sorted((s for s in spans if s.parent is not None), key=lambda s: s.start_time)
    assert turn.name == "chat gpt-4o" and turn.attributes["gen_ai.operation.name"] == "chat"
    assert turn.attributes["gen_ai.response.model"] == "gpt-4o-mini"
    assert turn.attributes["relayline.served"] == "openai.backup/gpt-4o-mini"
    assert turn.attributes["relayline.request_id"] == "trace-me-1" and turn.attributes["relayline.fallback"]
    assert turn.attributes["gen_ai.usage.input_tokens"] == 10 and turn.attributes["gen_ai.usage.output_tokens"] == 3
    assert [(s.name, s.attributes["relayline.outcome"]) for s in attempts] == [
        ("chat gpt-4o", "retryable"), ("chat gpt-4o-mini", "ok")]
    assert all(s.parent.span_id == turn.context.span_id for s in attempts)
    assert attempts[0].attributes["error.type"] == "retryable" and attempts[0].status.status_code.name == "ERROR"
    assert attempts[1].attributes["gen_ai.provider.name"] == "openai"
    assert attempts[1].attributes["gen_ai.usage.output_tokens"] == 3
    assert turn.start_time <= attempts[0].start_time <= attempts[1].end_time <= turn.end_time
    assert "SECRET PROMPT" not in repr([dict(s.attributes) for s in spans])


def test_the_production_example_checks_clean_only_with_its_gateway_keys():
    example = Path(__file__).resolve().parents[2] / "examples" / "production.toml"
    env = {**os.environ, "ANTHROPIC_API_KEY": "a", "OPENAI_API_KEY": "b", "OPENROUTER_API_KEY": "c",
           "RELAYLINE_GATEWAY_KEYS": "client-1,client-2", "RELAYLINE_ADMIN_KEYS": "admin-1"}
    out = run("check", example, env=env)
    assert out.returncode == 0 and out.stdout.rstrip().endswith("0 warnings"), out.stdout + out.stderr
    env.pop("RELAYLINE_ADMIN_KEYS")
    out = run("check", example, env=env)
    assert out.returncode == 1 and "gateway.admin_keys_env: names RELAYLINE_ADMIN_KEYS" in out.stderr


def test_an_answer_before_the_body_was_read_closes_the_connection():
    with BackgroundGateway(profiles(), api_keys={"k"}) as gw:
        refused = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": HI})
        answered = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": HI},
                              headers={"authorization": "Bearer k"})
    # the 401 came before the body was read: the client must not send its next request on it
    assert refused.status_code == 401 and refused.headers["connection"] == "close"
    assert answered.status_code == 200 and "connection" not in answered.headers


def test_a_probing_breaker_is_half_open_in_the_metrics_not_an_unknown_state():
    """While one turn probes a half-open profile the breaker's state is `probing`: the gauge says
    half-open (1), one of the three values its help text names, not -1."""
    import threading

    config = profiles(breaker={"failure_threshold": 1, "open_s": 0.3})
    replies = [{"provider": "openai.main", "script": [{"status": 503}, {"text": "probe", "delay": 1.5}]},
               {"provider": "openai.backup", "script": [{"text": "from the backup"}]}]
    with BackgroundGateway(config, replies) as gw:
        assert chat(gw).status_code == 200  # main fails: its breaker opens
        time.sleep(0.4)  # half-open: the next turn probes, slowly
        probe = threading.Thread(target=chat, args=(gw,))
        probe.start()
        try:
            deadline = time.monotonic() + 5
            while httpx.get(f"{gw.url}/admin/health").json()["profiles"]["openai.main"]["breaker"] != "probing":
                assert time.monotonic() < deadline, "the probe never started"
                time.sleep(0.02)
            found = samples(httpx.get(f"{gw.url}/metrics").text)
        finally:
            probe.join(10)
    assert found[("relayline_breaker_state", (("provider", "openai.main"),))] == 1
