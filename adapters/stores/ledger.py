"""The ledger on disk: one SQLite row per billable attempt, in WAL mode.

The gateway writes a turn's rows before its response completes, so a client that saw an answer
can find what it cost. One connection and a lock serialise writes. `report` backs `relayline
ledger`. Each row names the gateway client by its key id (a short hash, never the key; empty
for library turns and gateways without keys). A ledger written before that column existed is
migrated in place when opened. A fleet keeps the same rows in PostgreSQL instead
(stores/postgres.py); `open_ledger` picks the store a config names.
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
    cost_usd REAL NOT NULL,
    client TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS attempts_ts ON attempts (ts);
"""

# columns added after the first release: (name, definition), applied to older files in order
MIGRATIONS = (("client", "TEXT NOT NULL DEFAULT ''"),)
# what `relayline ledger --by` groups on (both stores)
GROUPS = {"model": ("provider", "model"), "client": ("client",)}

COLUMNS = ("ts", "turn", "requested", "provider", "model", "mode", "outcome", "accepted", "input_tokens",
           "output_tokens", "cost_usd", "client")


def ledger_rows(turn_id: str, result: TurnResult, now: float | None = None, *, client: str = "") -> list[tuple]:
    """A turn's ledger rows as tuples in COLUMNS order (both stores write these)."""
    ts = time.time() if now is None else now
    return [(ts, turn_id, result.requested, r.provider, r.model, r.mode, r.outcome, int(r.accepted),
             r.input_tokens, r.output_tokens, r.cost_usd, client) for r in result.ledger]


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
            self._migrate()

    def _migrate(self) -> None:
        have = {row[1] for row in self._conn.execute("PRAGMA table_info(attempts)")}
        for name, definition in MIGRATIONS:
            if name not in have:
                self._conn.execute(f"ALTER TABLE attempts ADD COLUMN {name} {definition}")

    def write(self, turn_id: str, result: TurnResult, now: float | None = None, *, client: str = "") -> int:
        rows = ledger_rows(turn_id, result, now, client=client)
        if not rows:
            return 0
        with self._lock:
            self._conn.executemany(
                f"INSERT INTO attempts ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", rows)
        return len(rows)

    def writable(self) -> bool:
        """Whether a write could be made now (readiness): takes and releases the write lock on a
        connection of its own that waits at most 50 ms, so a probe never stalls the gateway."""
        if self.path == ":memory:":
            return True
        try:
            probe = sqlite3.connect(self.path, timeout=0.05, isolation_level=None)
            try:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
            finally:
                probe.close()
        except sqlite3.Error:
            return False
        return True

    async def record(self, turn_id: str, result: TurnResult, *, client: str = "") -> int:
        # in the loop's thread: a WAL insert takes ~60 µs here, a hop to a worker thread ~250 µs
        return self.write(turn_id, result, client=client)

    def rows(self, since: float = 0.0) -> list[dict]:
        with self._lock:
            cur = self._conn.execute(f"SELECT {', '.join(COLUMNS)} FROM attempts WHERE ts >= ? ORDER BY id", (since,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def report(self, since: float = 0.0, by: str = "model") -> list[dict]:
        """Cost per profile and model (by="model") or per client key id (by="client"),
        accepted versus rejected."""
        group = GROUPS[by]
        columns = ", ".join(group)
        with self._lock:
            cur = self._conn.execute(
                f"SELECT {columns}, "
                "SUM(accepted), SUM(1 - accepted), "
                "SUM(CASE WHEN accepted THEN cost_usd ELSE 0 END), SUM(CASE WHEN accepted THEN 0 ELSE cost_usd END), "
                "SUM(input_tokens), SUM(output_tokens) "
                f"FROM attempts WHERE ts >= ? GROUP BY {columns} ORDER BY {columns}", (since,))
            out = []
            for row in cur.fetchall():
                a, r, ac, rc, ti, to = row[len(group):]
                out.append({**dict(zip(group, row, strict=False)), "accepted": int(a), "rejected": int(r),
                            "accepted_cost_usd": ac, "rejected_cost_usd": rc, "input_tokens": int(ti),
                            "output_tokens": int(to)})
            return out

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
