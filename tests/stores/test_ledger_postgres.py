"""The PostgreSQL ledger ([ledger] url) against a real PostgreSQL server: the migration on start,
one row per billable attempt, `relayline ledger` reading it with the same totals as SQLite, and a
server that hangs or restarts under it. Real clock: a write's wait is bounded on trio's clock,
which an autojump clock would skip while the worker thread waits on the server."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid

import pytest
import trio

from helpers import sim_toml
from relayline.adapters import Relay
from relayline.adapters.providers.sim import SimUpstream
from relayline.adapters.relay import turns_of
from relayline.adapters.stores.ledger import LedgerStore, LedgerUnavailable, open_ledger
from relayline.adapters.stores.postgres import MIGRATIONS, PostgresLedger
from relayline.machines.config import Ledger

PROFILES = ({"model": "m1", "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
            {"model": "m2", "price": {"input_per_mtok": 3.0, "output_per_mtok": 4.0}})
RELIABILITY = {"provider_retries": 1, "backoff_ms": 50}
TWO = sim_toml(*PROFILES, reliability=RELIABILITY)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def pg_url(postgres_server):
    """A fresh database per test, so row counts are this test's own."""
    import psycopg

    name = f"t{uuid.uuid4().hex}"  # (an object's hash is its address, which the next test's may reuse)
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_server.url.rsplit("/", 1)[0] + "/" + name


async def _turns(relay, n):
    results = []
    for _ in range(n):
        results.append(await turns_of(relay).run(HI))
    return results


async def test_the_schema_is_migrated_once_and_a_turn_writes_one_row_per_billable_attempt(pg_url):
    first = PostgresLedger(pg_url)
    second = PostgresLedger(pg_url)  # another worker starting: the migration is not applied twice
    assert first.schema_version == second.schema_version == len(MIGRATIONS)
    sim = SimUpstream.from_replies([
        {"provider": "sim.a", "script": [{"text": "", "usage": [5, 0]}, {"text": "", "usage": [5, 0]}]},
        {"provider": "sim.b", "script": [{"text": "from b", "usage": [100, 50]}]}])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    result = await turns_of(relay).run(HI)
    # two empty completions (billable, rejected) then the fallback's answer (accepted)
    assert await first.record("turn-1", result) == 3
    rows = second.rows()
    assert [(r["provider"], r["accepted"], r["outcome"]) for r in rows] == [
        ("sim.a", 0, "empty"), ("sim.a", 0, "empty"), ("sim.b", 1, "ok")]
    assert {r["turn"] for r in rows} == {"turn-1"}
    report = {(r["provider"], r["model"]): r for r in second.report()}
    assert report[("sim.b", "m2")]["accepted_cost_usd"] == pytest.approx((100 * 3 + 50 * 4) / 1e6)
    assert report[("sim.a", "m1")]["rejected"] == 2 and report[("sim.a", "m1")]["input_tokens"] == 10
    first.close()
    second.close()


async def test_relayline_ledger_reads_postgres_and_sqlite_with_equal_totals(pg_url, tmp_path):
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "ok", "usage": [1000, 500]}] * 7}])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    pg = open_ledger(Ledger(url=pg_url))
    sqlite = open_ledger(Ledger(path=str(tmp_path / "l.sqlite3")))
    assert isinstance(pg, PostgresLedger) and isinstance(sqlite, LedgerStore)
    for i, result in enumerate(await _turns(relay, 7)):
        await pg.record(f"t{i}", result)
        await sqlite.record(f"t{i}", result)
    pg.close()
    sqlite.close()
    config = tmp_path / "fleet.toml"
    config.write_text(sim_toml(*PROFILES, reliability=RELIABILITY,
                                ledger={"url": pg_url, "path": str(tmp_path / "ignored.sqlite3")}))
    reports = []
    for args in (["--config", config], ["--url", pg_url], ["--path", tmp_path / "l.sqlite3"]):
        out = subprocess.run([sys.executable, "-m", "relayline.adapters.cli", "ledger", "--json", *map(str, args)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(out.stdout)["rows"])
    assert reports[0] == reports[1]
    assert [(r["provider"], r["accepted"], r["input_tokens"]) for r in reports[0]] == [("sim.a", 7, 7000)]
    assert reports[0][0]["accepted_cost_usd"] == pytest.approx(reports[2][0]["accepted_cost_usd"])
    assert reports[0][0]["accepted_cost_usd"] == pytest.approx(7 * (1000 * 1 + 500 * 2) / 1e6)


def test_an_unreachable_postgres_is_a_clear_error_without_the_password(tmp_path):
    from services import free_port

    url = f"postgresql://relayline:hunter2secret@127.0.0.1:{free_port()}/nowhere"
    out = subprocess.run([sys.executable, "-m", "relayline.adapters.cli", "ledger", "--url", url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "ledger.url" in out.stderr and "127.0.0.1" in out.stderr and "hunter2secret" not in out.stderr


async def _until(predicate, seconds: float) -> bool:
    with trio.move_on_after(seconds):
        while not predicate():
            await trio.sleep(0.05)
        return True
    return False


async def test_a_frozen_postgres_holds_a_write_at_most_timeout_s_and_the_abandoned_rows_never_land_later(
        pg_url, postgres_server):
    """A server that hangs with its connections open (stopped, swapping, a stalled disk): the
    write gives up after the ledger's timeout_s, however it hangs (the insert on a pooled
    connection, or a new connection), and what it gave up on is rolled back, never committed
    when the server comes back (the operator was told those rows are lost)."""
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "ok", "usage": [10, 5]}] * 8}])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    ledger = PostgresLedger(pg_url, timeout_s=1.0)
    result = await turns_of(relay).run(HI)
    assert await ledger.record("before", result) == 1
    with postgres_server.frozen():
        for turn in ("during-1", "during-2"):
            started = trio.current_time()
            with trio.fail_after(5), pytest.raises(LedgerUnavailable, match="within 1 s"):
                await ledger.record(turn, result)
            assert trio.current_time() - started < 3
    # the server answers again: the abandoned inserts finish and roll back, a new write lands
    assert await _until(lambda: ledger.abandoned == 0, 10), "the abandoned writes ended"
    assert await ledger.record("after", result) == 1
    assert [r["turn"] for r in ledger.rows()] == ["before", "after"]
    ledger.close()


async def test_after_a_postgres_restart_the_next_write_lands(pg_url, postgres_server):
    """The pool's connections died with the server: the first write after it came back takes a
    live one, it is not lost on a dead one."""
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "ok", "usage": [10, 5]}] * 4}])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    ledger = PostgresLedger(pg_url, timeout_s=5.0)
    result = await turns_of(relay).run(HI)
    assert await ledger.record("before", result) == 1
    postgres_server.restart()
    assert await ledger.record("after", result) == 1
    assert [r["turn"] for r in ledger.rows()] == ["before", "after"]
    ledger.close()


async def test_a_gateway_over_a_frozen_postgres_answers_within_the_ledger_timeout_and_logs_the_lost_rows(
        pg_url, postgres_server, caplog):
    from helpers import asgi_post
    from relayline.adapters.gateway import Gateway

    caplog.set_level(logging.ERROR, logger="relayline.gateway")
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "billed anyway", "usage": [10, 5]}] * 3}])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    gateway = Gateway(relay, ledger=PostgresLedger(pg_url, timeout_s=1.0))
    body = json.dumps({"model": "m1", "messages": HI}).encode()
    with postgres_server.frozen():
        status, _, answer = await asgi_post(gateway, "/v1/chat/completions", body, bound=5)
        with trio.fail_after(5):  # /readyz says so, in its own time, with the write still hung
            assert await gateway.admin.ledger_ready() == "the ledger did not answer within 2 s"
    assert status == 200 and json.loads(answer)["choices"][0]["message"]["content"] == "billed anyway"
    lost = [r for r in caplog.records if r.getMessage().startswith("ledger_write_error")]
    assert len(lost) == 1 and lost[0].exc_info is None, "an outage's reason, not a trace"
    lost = [r.getMessage() for r in lost]
    assert len(lost) == 1 and "rows=1" in lost[0] and "waited_s=1" in lost[0], lost
    status, _, _ = await asgi_post(gateway, "/v1/chat/completions", body, bound=15)
    assert status == 200 and len(gateway.ledger.rows()) == 1
    await relay.aclose()
    gateway.ledger.close()


async def test_a_named_keys_rows_carry_its_name_and_team_and_its_spend_is_read_back(pg_url):
    ledger = PostgresLedger(pg_url)
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "ok", "usage": [100, 50]}] * 2}])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    await ledger.record("t1", await turns_of(relay).run(HI), client="k-1", key="search-bot", team="search")
    await ledger.record("t2", await turns_of(relay).run(HI), client="k-2", key="ads-bot", team="search")
    assert [(r["key_name"], r["team"]) for r in ledger.rows()] == [("search-bot", "search"), ("ads-bot", "search")]
    assert {r["key_name"]: r["accepted"] for r in ledger.report(by="key")} == {"search-bot": 1, "ads-bot": 1}
    one = ledger.spend("key", "ads-bot", 0.0)
    assert one > 0 and ledger.spend("team", "search", 0.0) == pytest.approx(2 * one)
    assert ledger.spend("key", "search-bot", time.time() + 60) == 0.0  # nothing in a later period
    ledger.close()
