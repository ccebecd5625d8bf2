"""The ledger on disk: one SQLite row per billable attempt, in WAL mode.

The gateway writes a turn's rows before its response completes, so a client that saw an answer
can find what it cost. One connection and a lock serialise writes. `report` backs `relayline
ledger`. A fleet keeps the same rows in PostgreSQL instead (stores/postgres.py); `open_ledger`
picks the store a config names.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from relayline.machines.config import Ledger
from relayline.machines.turn import TurnResult

DEFAULT_PATH = "relayline-ledger.sqlite3"

SCHEMA = """
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    turn TEXT NOT NULL,
    requested TEXT NOT NULL,
    provider TEXT NOT NULL,
    model TEXT NOT NULL,
    mode TEXT NOT NULL,
    outcome TEXT NOT NULL,
    accepted INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_ts ON attempts (ts);
"""


COLUMNS = ("ts", "turn", "requested", "provider", "model", "mode", "outcome", "accepted", "input_tokens",
           "output_tokens", "cost_usd")


def ledger_rows(turn_id: str, result: TurnResult, now: float | None = None) -> list[tuple]:
    """A turn's ledger rows as tuples in COLUMNS order (both stores write these)."""
    ts = time.time() if now is None else now
    return [(ts, turn_id, result.requested, r.provider, r.model, r.mode, r.outcome, int(r.accepted),
             r.input_tokens, r.output_tokens, r.cost_usd) for r in result.ledger]


class LedgerStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)

    def write(self, turn_id: str, result: TurnResult, now: float | None = None) -> int:
        rows = ledger_rows(turn_id, result, now)
        if not rows:
            return 0
        with self._lock:
            self._conn.executemany(
                "INSERT INTO attempts (ts, turn, requested, provider, model, mode, outcome, accepted, "
                "input_tokens, output_tokens, cost_usd) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        return len(rows)

    async def record(self, turn_id: str, result: TurnResult) -> int:
        # in the loop's thread: a WAL insert takes ~60 µs here, a hop to a worker thread ~250 µs
        return self.write(turn_id, result)

    def rows(self, since: float = 0.0) -> list[dict]:
        with self._lock:
            cur = self._conn.execute(
                "SELECT ts, turn, requested, provider, model, mode, outcome, accepted, input_tokens, "
                "output_tokens, cost_usd FROM attempts WHERE ts >= ? ORDER BY id", (since,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def report(self, since: float = 0.0) -> list[dict]:
        """Cost per profile and model, accepted versus rejected."""
        with self._lock:
            cur = self._conn.execute(
                "SELECT provider, model, "
                "SUM(accepted), SUM(1 - accepted), "
                "SUM(CASE WHEN accepted THEN cost_usd ELSE 0 END), SUM(CASE WHEN accepted THEN 0 ELSE cost_usd END), "
                "SUM(input_tokens), SUM(output_tokens) "
                "FROM attempts WHERE ts >= ? GROUP BY provider, model ORDER BY provider, model", (since,))
            return [
                {"provider": p, "model": m, "accepted": int(a), "rejected": int(r), "accepted_cost_usd": ac,
                 "rejected_cost_usd": rc, "input_tokens": int(ti), "output_tokens": int(to)}
                for p, m, a, r, ac, rc, ti, to in cur.fetchall()
            ]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_ledger(config: Ledger):
    """The store a config's [ledger] names: PostgreSQL when `url` is set (it wins), else SQLite."""
    if config.url:
        from .postgres import PostgresLedger

        return PostgresLedger(config.url)
    return LedgerStore(config.path or DEFAULT_PATH)


def parse_since(text: str | None, now: float | None = None) -> float:
    """`--since 90s|15m|1h|2d` as an epoch time; None means everything."""
    if not text:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        amount, unit = float(text[:-1]), units[text[-1]]
    except (ValueError, KeyError):
        raise ValueError(f"--since takes a number and a unit (s, m, h, d), got {text!r}") from None
    return (time.time() if now is None else now) - amount * unit
