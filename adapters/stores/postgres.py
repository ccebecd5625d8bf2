"""The ledger of a fleet: one PostgreSQL row per billable attempt, shared by every worker.

The same rows and report as the SQLite ledger (stores/ledger.py), so `relayline ledger` reads
either. psycopg 3's async connections need asyncio, so the gateway (trio) writes through the
blocking driver and its connection pool in worker threads, at most as many at once as the pool
has connections. A turn's rows go in one transaction before its response completes.

The schema is migrated on start: each migration runs once, in order, under an advisory lock so
that workers starting together do not race, and is recorded in relayline_schema.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from relayline.machines.turn import TurnResult

from .schema import COLUMNS, GROUPS, SPEND_COLUMNS, LedgerUnavailable, ledger_rows

if TYPE_CHECKING:
    from psycopg import Connection

MIGRATIONS = (
    # 1: the attempts table (the SQLite ledger's columns)
    """
    CREATE TABLE IF NOT EXISTS relayline_attempts (
        id BIGSERIAL PRIMARY KEY,
        ts DOUBLE PRECISION NOT NULL,
        turn TEXT NOT NULL,
        requested TEXT NOT NULL,
        provider TEXT NOT NULL,
        model TEXT NOT NULL,
        mode TEXT NOT NULL,
        outcome TEXT NOT NULL,
        accepted INTEGER NOT NULL,
        input_tokens BIGINT NOT NULL,
        output_tokens BIGINT NOT NULL,
        cost_usd DOUBLE PRECISION NOT NULL
    );
    CREATE INDEX IF NOT EXISTS relayline_attempts_ts ON relayline_attempts (ts);
    """,
    # 2: the gateway client's key id (a short hash, never the key), as in the SQLite ledger
    "ALTER TABLE relayline_attempts ADD COLUMN IF NOT EXISTS client TEXT NOT NULL DEFAULT ''",
    # 3: whether the row's tokens are relayline's estimate, as in the SQLite ledger
    "ALTER TABLE relayline_attempts ADD COLUMN IF NOT EXISTS estimated INTEGER NOT NULL DEFAULT 0",
    # 4: a named key's name and team, and what a budget's spend reads
    "ALTER TABLE relayline_attempts ADD COLUMN IF NOT EXISTS key_name TEXT NOT NULL DEFAULT '';"
    "ALTER TABLE relayline_attempts ADD COLUMN IF NOT EXISTS team TEXT NOT NULL DEFAULT ''",
)
MIGRATION_LOCK = 0x72656C61  # any constant shared by every worker: "rela"
POOL_SIZE = 4


class _GaveUp(Exception):
    pass


class _Write:
    """One write in its worker thread, and whether the event loop still waits for it."""

    __slots__ = ("ledger", "gave_up", "ended")

    def __init__(self, ledger: PostgresLedger) -> None:
        self.ledger = ledger
        self.gave_up = False
        self.ended = False

    def run(self, turn_id: str, result: TurnResult, client: str, key: str, team: str) -> int:
        try:
            return self.ledger.write(turn_id, result, client=client, key=key, team=team,
                                     wanted=lambda: not self.gave_up)
        finally:
            with self.ledger._abandon_lock:
                self.ended = True
                if self.gave_up:
                    self.ledger.abandoned -= 1

    def give_up(self) -> None:
        with self.ledger._abandon_lock:
            self.gave_up = True
            if not self.ended:
                self.ledger.abandoned += 1


def _connect_error(url: str, exc: Exception) -> RuntimeError:
    # the URL may carry a password: name the host part only
    where = url.rsplit("@", 1)[-1]
    return RuntimeError(f"ledger.url: cannot use the PostgreSQL ledger at {where}: "
                        f"{type(exc).__name__}")


class PostgresLedger:
    def __init__(self, url: str, *, pool_size: int = POOL_SIZE, timeout_s: float = 10.0) -> None:
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError:  # pragma: no cover - the fleet extra is part of dev
            raise RuntimeError(
                "ledger.url needs the fleet extra: pip install 'relayline[fleet]'"
            ) from None
        self.url = url
        try:
            # one direct connection first: an unreachable server fails at once, not after the
            # pool's retries, and the schema is ready before any worker writes
            with psycopg.connect(url, connect_timeout=max(1, int(timeout_s)),
                                 autocommit=True) as conn:
                self._migrate(conn)
        except Exception as exc:
            raise _connect_error(url, exc) from None
        # connect_timeout: a new connection to a server that hangs gives up (libpq waits forever).
        # check: a pooled connection is tried (one empty round trip) before it carries a write,
        # so the writes after a server restart take new connections instead of being lost on
        # the dead ones (one write per pooled connection)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            timeout=timeout_s,
            open=True,
            kwargs={"autocommit": True, "connect_timeout": max(1, int(timeout_s))},
            check=ConnectionPool.check_connection,
        )
        self._limiter = trio.CapacityLimiter(pool_size)
        self.timeout_s = timeout_s
        self.abandoned = 0  # writes given up on whose thread still waits on the server
        self._abandon_lock = threading.Lock()

    @staticmethod
    def _migrate(conn: Connection[Any]) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS relayline_schema (version INTEGER PRIMARY "
                         "KEY, "
                         "applied_at DOUBLE PRECISION NOT NULL)")
            done = {v for (v,) in conn.execute("SELECT version FROM relayline_schema").fetchall()}
            for version, sql in enumerate(MIGRATIONS, start=1):
                if version not in done:
                    conn.execute(sql)
                    conn.execute("INSERT INTO relayline_schema (version, applied_at) VALUES (%s, "
                                 "%s)",
                                  (version, time.time()))

    @property
    def schema_version(self) -> int:
        with self._pool.connection() as conn:
            row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM relayline_schema").fetchone()
        assert row is not None  # (an aggregate answers one row)
        return int(row[0])

    def write(self, turn_id: str, result: TurnResult, now: float | None = None, *, client: str = "",
              key: str = "",
              team: str = "", wanted: Callable[[], bool] | None = None) -> int:
        """Insert a turn's rows in one transaction; `wanted()` false after the insert (the caller
        gave up waiting) rolls it back instead of committing."""
        rows = ledger_rows(turn_id, result, now, client=client, key=key, team=team)
        if not rows:
            return 0
        placeholders = ", ".join(["%s"] * len(COLUMNS))
        with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            cur.executemany(f"INSERT INTO relayline_attempts ({', '.join(COLUMNS)}) VALUES "
                            f"({placeholders})", rows)
            if wanted is not None and not wanted():
                raise _GaveUp  # (the transaction rolls back)
        return len(rows)

    async def record(self, turn_id: str, result: TurnResult, *, client: str = "", key: str = "",
                     team: str = "") -> int:
        """Write a turn's rows from the event loop: a blocking insert in a bounded worker thread,
        waited for at most timeout_s (LedgerUnavailable). A server that hangs with its connections
        open (stopped, swapping, a stalled disk) would hold the thread, and the answer behind it,
        forever: libpq has no read timeout. The thread given up on is left to end on its own, and
        rolls back rather than commit rows the operator was told are lost (the one window left: a
        COMMIT already sent when the wait ends)."""
        if not result.ledger:
            return 0
        write = _Write(self)
        # shielded: a client that went away after its turn ended still leaves the turn's rows
        with trio.CancelScope(shield=True), trio.move_on_after(self.timeout_s):
            return await trio.to_thread.run_sync(
                partial(write.run, turn_id, result, client, key, team),
                limiter=self._limiter,
                abandon_on_cancel=True,
            )
        write.give_up()
        raise LedgerUnavailable(self.timeout_s)

    def writable(self) -> bool:
        """Readiness: a connection from the pool answers (blocking: run it in a worker thread)."""
        try:
            with self._pool.connection(timeout=2.0) as conn:
                conn.execute("SELECT 1")
        except Exception:
            return False
        return True

    def rows(self, since: float = 0.0) -> list[dict[str, Any]]:
        with self._pool.connection() as conn, conn.cursor() as cur:
            cur.execute(f"SELECT {', '.join(COLUMNS)} FROM relayline_attempts WHERE ts >= %s ORDER "
                        "BY id", (since,))
            return [dict(zip(COLUMNS, row, strict=True)) for row in cur.fetchall()]

    def report(self, since: float = 0.0, by: str = "model") -> list[dict[str, Any]]:
        group = GROUPS[by]
        columns = ", ".join(group)
        with self._pool.connection() as conn, conn.cursor() as cur:
            cur.execute(
                f"SELECT {columns}, SUM(accepted), SUM(1 - accepted), "
                "SUM(CASE WHEN accepted = 1 THEN cost_usd ELSE 0 END), "
                "SUM(CASE WHEN accepted = 1 THEN 0 ELSE cost_usd END), SUM(input_tokens), "
                "SUM(output_tokens), SUM(estimated) "
                f"FROM relayline_attempts WHERE ts >= %s GROUP BY {columns} ORDER BY {columns}",
                (since,))
            out = []
            for row in cur.fetchall():
                a, r, ac, rc, ti, to, est = row[len(group):]
                out.append({**dict(zip(group, row, strict=False)), "accepted": int(a),
                            "rejected": int(r),
                            "accepted_cost_usd": float(ac), "rejected_cost_usd": float(rc),
                            "input_tokens": int(ti),
                            "output_tokens": int(to), "estimated": int(est)})
            return out

    def spend(self, scope: str, name: str, since: float) -> float:
        """As the SQLite ledger's: a key's or team's cost since `since`."""
        column = SPEND_COLUMNS[scope]
        with self._pool.connection() as conn:
            row = conn.execute(f"SELECT COALESCE(SUM(cost_usd), 0) FROM relayline_attempts "
                               f"WHERE {column} = %s AND ts >= %s", (name, since)).fetchone()
        assert row is not None  # (an aggregate answers one row)
        return float(row[0])

    def close(self) -> None:
        self._pool.close()
