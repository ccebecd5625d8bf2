"""The PostgreSQL ledger ([ledger] url) against a real PostgreSQL server: the migration on start,
one row per billable attempt, and `relayline ledger` reading it with the same totals as SQLite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relayline.adapters import Relay
from relayline.adapters.sim.provider import SimUpstream
from relayline.adapters.stores.ledger import LedgerStore, open_ledger
from relayline.adapters.stores.postgres import MIGRATIONS, PostgresLedger
from relayline.machines.config import Ledger

TWO = """
active = "sim.a"
[reliability]
provider_retries = 1
[providers."sim.a"]
family = "sim"
model = "m1"
fallbacks = ["sim.b"]
price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }
[providers."sim.b"]
family = "sim"
model = "m2"
price = { input_per_mtok = 3.0, output_per_mtok = 4.0 }
"""
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def pg_url(postgres_server):
    """A fresh database per test, so row counts are this test's own."""
    import psycopg

    name = f"t{abs(hash(object()))}"
    with psycopg.connect(postgres_server.url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_server.url.rsplit("/", 1)[0] + "/" + name


async def _turns(relay, n):
    results = []
    for _ in range(n):
        results.append(await relay._run_turn(HI))
    return results


async def test_the_schema_is_migrated_once_and_a_turn_writes_one_row_per_billable_attempt(pg_url, autojump_clock):
    first = PostgresLedger(pg_url)
    second = PostgresLedger(pg_url)  # another worker starting: the migration is not applied twice
    assert first.schema_version == second.schema_version == len(MIGRATIONS)
    sim = SimUpstream.from_replies([
        {"provider": "sim.a", "script": [{"text": "", "usage": [5, 0]}, {"text": "", "usage": [5, 0]}]},
        {"provider": "sim.b", "script": [{"text": "from b", "usage": [100, 50]}]}])
    relay = Relay.from_toml(TWO, env={}, sim=sim)
    result = await relay._run_turn(HI)
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


async def test_relayline_ledger_reads_postgres_and_sqlite_with_equal_totals(pg_url, tmp_path, autojump_clock):
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"text": "ok", "usage": [1000, 500]}] * 7}])
    relay = Relay.from_toml(TWO, env={}, sim=sim)
    pg = open_ledger(Ledger(url=pg_url))
    sqlite = open_ledger(Ledger(path=str(tmp_path / "l.sqlite3")))
    assert isinstance(pg, PostgresLedger) and isinstance(sqlite, LedgerStore)
    for i, result in enumerate(await _turns(relay, 7)):
        await pg.record(f"t{i}", result)
        await sqlite.record(f"t{i}", result)
    pg.close()
    sqlite.close()
    config = tmp_path / "fleet.toml"
    config.write_text(TWO + f'[ledger]\nurl = "{pg_url}"\npath = "{tmp_path / "ignored.sqlite3"}"\n')
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
