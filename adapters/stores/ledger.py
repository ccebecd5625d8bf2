"""The ledger on disk: one SQLite row per billable attempt, in WAL mode.

The gateway writes a turn's rows before its response completes, so a client that saw an answer
can find what it cost. One connection and a lock serialise writes; the turns that finish
together share a transaction (`record`). The connection has no busy handler (busy_timeout 0): a
turn waits for another process's write lock (the gateway's workers share the file) in the event
loop, and the synchronous `write` waits in its own thread. The readers have a connection of their
own, which reads beside the writer. The WAL is copied into the
database (a checkpoint, with its fsync) by a thread of the store's own, never by the write that
crossed the threshold: in the event loop that write stalled every client for the fsync (a few
ms, once every ~250 turns). `report` backs `relayline
ledger`. Each row names the gateway client by its key id (a short hash, never the key; empty
for library turns and gateways without keys), says whether its tokens are relayline's
estimate (`estimated`: output forwarded, then the attempt ended without the provider's usage),
and names a named key and its team; `spend` is what a key's or team's budget reads. A ledger
written before those columns existed is migrated in place when opened. A fleet keeps the same rows
in PostgreSQL instead (stores/postgres.py); `open_ledger` picks the store a config names.
"""

from __future__ import annotations

import copy
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from relayline.machines.config import Ledger
from relayline.machines.turn import TurnResult

# LedgerUnavailable: what open_ledger's stores raise, importable beside it
from .schema import COLUMNS, GROUPS, SPEND_COLUMNS, LedgerBackend, LedgerUnavailable, ledger_rows  # noqa: F401

log = logging.getLogger("relayline.ledger")
T = TypeVar("T")

DEFAULT_PATH = "relayline-ledger.sqlite3"

# The id is the rowid without AUTOINCREMENT: AUTOINCREMENT rewrote its sqlite_sequence row (one
# more page in every commit, a sixth of a write's CPU) only to keep the ids of deleted rows from
# being given again, and a ledger never deletes. A file made with it is rebuilt once when opened.
SCHEMA = """
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY,
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
    client TEXT NOT NULL DEFAULT '',
    estimated INTEGER NOT NULL DEFAULT 0,
    key_name TEXT NOT NULL DEFAULT '',
    team TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS attempts_ts ON attempts (ts);
"""

# A new file's page size. A commit writes each page it changed to the WAL whole, with its checksum:
# a row's table leaf and index leaf, 8 KiB a commit at SQLite's default 4 KiB pages, 2 KiB at 1 KiB
# (a row is about 100 bytes). Must be set before the file's first write, so files made before keep
# theirs.
PAGE_BYTES = 1024

# columns added after the first release: (name, definition), applied to older files in order
MIGRATIONS = (("client", "TEXT NOT NULL DEFAULT ''"), ("estimated", "INTEGER NOT NULL DEFAULT 0"),
              ("key_name", "TEXT NOT NULL DEFAULT ''"), ("team", "TEXT NOT NULL DEFAULT ''"))
INSERT = f"INSERT INTO attempts ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
BUSY_S = 5.0  # how long a statement waits for another connection's write lock (sqlite3's default)
MIGRATION_WAIT_S = 600.0  # how long opening waits for another process's migration of the same file
CHECKPOINT_EVERY = 250  # writes (about 1,000 WAL pages: SQLite's own autocheckpoint threshold)
# a turn's commit that finds another process's write lock (the gateway's workers share the file)
# tries again after these waits in the event loop, doubling, until BUSY_S: a commit holds the lock
# only briefly
LOCKED_WAIT_S = (0.0002, 0.005)
# the same in the caller's thread (`write`, opening): SQLite's busy handler's own pace
SYNC_WAIT_S = (0.001, 0.05)


def _busy(exc: sqlite3.OperationalError) -> bool:
    """Another connection holds the lock (SQLITE_BUSY and its extended codes)."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_BUSY


def _waited(call: Callable[[], T]) -> T:
    """`call()`, with another connection's lock waited for in this thread: short sleeps, BUSY_S in
    all (SQLite's busy handler would do the same, but the writer's connection has none: in the
    event loop's thread it would stall every turn)."""
    deadline = time.monotonic() + BUSY_S
    pause, most = SYNC_WAIT_S
    while True:
        try:
            return call()
        except sqlite3.OperationalError as exc:
            if not _busy(exc) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, most)


def _own(error: Exception) -> Exception:
    """A shared commit's error as one joined turn raises it: a copy (same type, message and
    SQLite codes) caused by the original. Raising the one object in every joined turn appended
    each turn's frames to its one traceback, so each logged error was longer than the last."""
    try:
        own = copy.copy(error)
    except Exception:  # (an exception type that cannot be made again from its args)
        own = RuntimeError(f"the shared ledger commit failed: {error!r}")
    own.__cause__ = error
    return own


class _Batch:
    """The rows of the turns that finish in one pass of the scheduler: one commit."""

    __slots__ = ("rows", "committed", "error")

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = list(rows)
        self.committed = trio.Event()
        self.error: Exception | None = None


class LedgerStore:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=BUSY_S, check_same_thread=False,
                                     isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            # (a file made before keeps its own)
            self._conn.execute(f"PRAGMA page_size = {PAGE_BYTES}")
            wal = self._enter_wal()
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)
            self._migrate()
            if wal:
                self._conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
            # from here on no statement of this connection sleeps in SQLite's busy handler: each
            # caller waits for a lock its own way (`record` in the event loop, the others `_waited`)
            self._conn.execute("PRAGMA busy_timeout = 0")
        # the writer's one cursor: a cursor per statement (`Connection.execute`) was an object made
        # and freed with each commit
        self._writer = self._conn.cursor()
        self._since_checkpoint = 0
        self._checkpoint_every = CHECKPOINT_EVERY if wal else 0
        self._batch: _Batch | None = None
        # the readers' own connection (`_reading`); in memory there is one database, this one
        self._reader: sqlite3.Connection | None = None if wal else self._conn
        self._read_lock = threading.Lock() if wal else self._lock
        # whether other turns are in flight, so that rows may wait a pass for company (the
        # gateway's count; alone, a turn's rows are committed at once)
        self.together: Callable[[], bool] = lambda: False
        self._kick = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._closed = False

    def _enter_wal(self) -> bool:
        """The file in WAL mode; False where it cannot be (":memory:").

        A file still in rollback-journal mode (made by another tool, or by a relayline before
        WAL) is switched under an exclusive lock. While another connection holds a write lock on
        it (another worker switching it at the same moment), SQLite refuses the switch at once,
        without its busy handler (waiting could deadlock), so the wait is here (`_waited`)."""
        return _waited(
            lambda: bool(self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal")
        )

    def _migrate(self) -> None:
        if not self._outdated():  # (a read: a current file is opened without the write lock)
            return
        # IMMEDIATE: the gateway's workers open one file together; the second sees the first's
        # work. A rebuild of a large file takes seconds, far beyond the usual busy wait: the
        # others wait for it rather than fail at start
        self._conn.execute(f"PRAGMA busy_timeout = {int(MIGRATION_WAIT_S * 1000)}")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                outdated = self._outdated()  # (again: another worker may have done it meanwhile)
                if outdated is not None:
                    missing, autoincrement = outdated
                    for name, definition in MIGRATIONS:
                        if name in missing:
                            self._conn.execute(f"ALTER TABLE attempts ADD COLUMN {name} "
                                               f"{definition}")
                    if autoincrement:
                        self._rebuild()
                self._conn.execute("COMMIT")
            except BaseException:
                # (not when BEGIN itself failed: its error is the one to see)
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise
        finally:
            self._conn.execute(f"PRAGMA busy_timeout = {int(BUSY_S * 1000)}")

    def _outdated(self) -> tuple[set[str], bool] | None:
        """What the file lacks (MIGRATIONS' columns, the id without AUTOINCREMENT); None:
        nothing."""
        have = {row[1] for row in self._conn.execute("PRAGMA table_info(attempts)")}
        missing = {name for name, _ in MIGRATIONS if name not in have}
        (made,
         ) = self._conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = "
                                "'attempts'"
                                     ).fetchone()
        autoincrement = "AUTOINCREMENT" in made.upper()
        return (missing, autoincrement) if missing or autoincrement else None

    def _rebuild(self) -> None:
        """The attempts table made again from SCHEMA with every row and its id (SQLite cannot drop
        AUTOINCREMENT from a table in place); the caller's transaction makes it all or nothing."""
        columns = ", ".join(("id", *COLUMNS))
        self._conn.execute("ALTER TABLE attempts RENAME TO attempts_before")
        self._conn.execute("DROP INDEX IF EXISTS attempts_ts")
        for statement in SCHEMA.split(";"):
            if statement.strip():
                self._conn.execute(statement)
        self._conn.execute(
            f"INSERT INTO attempts ({columns}) SELECT {columns} FROM attempts_before"
        )
        self._conn.execute("DROP TABLE attempts_before")
        log.info("ledger_migrated path=%s change=no_autoincrement", self.path)

    def write(self, turn_id: str, result: TurnResult, now: float | None = None, *, client: str = "",
              key: str = "",
              team: str = "") -> int:
        """A turn's rows, from synchronous code: another process's write lock is waited for in
        this thread (`record` is the event loop's)."""
        rows = ledger_rows(turn_id, result, now, client=client, key=key, team=team)
        if rows:
            _waited(lambda: self._insert(rows))
        return len(rows)

    def _insert(self, rows: list[tuple[Any, ...]]) -> None:
        """One transaction for all of `rows` (in autocommit, executemany commits each row).
        Another connection's write lock is an immediate SQLITE_BUSY: the caller waits for it."""
        with self._lock:
            self._insert_locked(rows)

    def _insert_locked(self, rows: list[tuple[Any, ...]]) -> None:
        writer = self._writer
        if len(rows) == 1:
            writer.execute(INSERT, rows[0])
        else:
            writer.execute("BEGIN")
            try:
                writer.executemany(INSERT, rows)
                writer.execute("COMMIT")
            except BaseException:
                # a failed COMMIT can leave the transaction open (SQLITE_BUSY does): the
                # next turn's rows must not join a transaction that never ends
                if self._conn.in_transaction:
                    writer.execute("ROLLBACK")
                raise
        self._since_checkpoint += 1
        if self._checkpoint_every and self._since_checkpoint >= self._checkpoint_every:
            self._since_checkpoint = 0
            self._start_checkpoint()

    async def _commit_waiting_in_the_loop(self, batch: _Batch) -> None:
        """`batch`'s rows in one transaction, with another process's write lock waited for in the
        event loop. SQLite's own busy handler would sleep in this thread (1 ms, then 2, 5, 10 ...),
        stalling every turn in flight: with `--workers 2` about one shared commit in 50 met the
        other worker's lock (bench/workers.py, perf's syscall counts).
        The batch stays open while it waits: the turns that finish meanwhile join it, so a wait
        makes one larger commit, as the stall did, not a queue of small ones."""
        wait, most = LOCKED_WAIT_S
        deadline = None
        while True:
            try:
                self._insert(batch.rows)
                # (no await before the caller closes the batch: no record() joins a committed one)
                return
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    raise
                now = trio.current_time()
                deadline = now + BUSY_S if deadline is None else deadline
                if now >= deadline:
                    raise
            await trio.sleep(wait)
            wait = min(wait * 2, most)

    def _start_checkpoint(self) -> None:
        """Wake the checkpointer (started on the first need: most stores never get there)."""
        if self._checkpointer is None:
            self._checkpointer = threading.Thread(target=self._checkpoints,
                                                  name="relayline-ledger-checkpoint",
                                                  daemon=True)
            self._checkpointer.start()
        self._kick.set()

    def _checkpoints(self) -> None:
        # its own connection: a PASSIVE checkpoint runs beside the writer (WAL) and never waits
        # for it; sqlite3 releases the GIL while it copies and syncs
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            while True:
                self._kick.wait()
                self._kick.clear()
                if self._closed:
                    return
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:  # the next one retries; the rows are safe in the WAL
                    log.warning("ledger_checkpoint_error path=%s error=%s", self.path, exc)
        finally:
            conn.close()

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

    async def record(self, turn_id: str, result: TurnResult, *, client: str = "", key: str = "",
                     team: str = "") -> int:
        """A turn's rows, written before this returns. In the loop's thread: a WAL insert costs
        less than the hop to a worker thread would (docs/performance.md, "Figures behind the
        code's choices"). When other turns are in flight
        (`together`, set by the gateway), the turns that finish in the same pass of the scheduler
        share one transaction: the first waits that one pass, then commits every row given
        meanwhile, and each returns once its rows are committed (or raises what the commit did).
        A turn alone that finds another process's write lock waits for it as a shared commit does,
        and the turns that finish meanwhile join it."""
        rows = ledger_rows(turn_id, result, client=client, key=key, team=team)
        if not rows:
            return 0
        batch = self._batch
        if batch is not None:
            batch.rows.extend(rows)
            # a pass, or another worker's lock: this turn's bill
            with trio.CancelScope(shield=True):
                await batch.committed.wait()
            if batch.error is not None:
                raise _own(batch.error)
            return len(rows)
        if not self.together():
            try:
                self._insert(rows)
                return len(rows)
            except sqlite3.OperationalError as exc:
                if not _busy(exc):
                    raise
        batch = self._batch = _Batch(rows)
        try:
            with trio.CancelScope(shield=True):  # the rows are the turns' bill
                await trio.lowlevel.checkpoint()
                await self._commit_waiting_in_the_loop(batch)
        except Exception as exc:
            batch.error = exc
            raise
        finally:
            self._batch = None
            batch.committed.set()
        return len(rows)

    def _reading(self) -> sqlite3.Connection:
        """The readers' connection, opened at the first read. In WAL mode a read runs beside the
        writer: a long report (the console's cost windows over a large ledger, every 5 s while a
        console is open, in a worker thread) never holds the writer's lock, which the event
        loop's next commit would wait for. Another process's lock is waited for by SQLite's busy
        handler, in the reader's own thread."""
        if self._reader is None:
            self._reader = sqlite3.connect(self.path, timeout=BUSY_S, check_same_thread=False,
                                           isolation_level=None)
        return self._reader

    def rows(self, since: float = 0.0) -> list[dict[str, Any]]:
        with self._read_lock:
            cur = self._reading().execute(f"SELECT {', '.join(COLUMNS)} FROM attempts WHERE ts >= "
                                          "? ORDER BY id",
                                          (since,))
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def report(self, since: float = 0.0, by: str = "model") -> list[dict[str, Any]]:
        """Cost per profile and model (by="model") or per client key id (by="client"),
        accepted versus rejected."""
        group = GROUPS[by]
        columns = ", ".join(group)
        with self._read_lock:
            cur = self._reading().execute(
                f"SELECT {columns}, "
                "SUM(accepted), SUM(1 - accepted), "
                "SUM(CASE WHEN accepted THEN cost_usd ELSE 0 END), SUM(CASE WHEN accepted THEN 0 "
                "ELSE cost_usd END), "
                "SUM(input_tokens), SUM(output_tokens), SUM(estimated) "
                f"FROM attempts WHERE ts >= ? GROUP BY {columns} ORDER BY {columns}", (since,))
            out = []
            for row in cur.fetchall():
                a, r, ac, rc, ti, to, est = row[len(group):]
                out.append({**dict(zip(group, row, strict=False)), "accepted": int(a),
                            "rejected": int(r),
                            "accepted_cost_usd": ac, "rejected_cost_usd": rc,
                            "input_tokens": int(ti),
                            "output_tokens": int(to), "estimated": int(est)})
            return out

    def spend(self, scope: str, name: str, since: float) -> float:
        """The cost of every billed attempt of a key or team (scope "key" | "team") since `since`
        (the start of its budget period): what its budget has spent."""
        column = SPEND_COLUMNS[scope]
        with self._read_lock:
            (total,) = self._reading().execute(
                f"SELECT COALESCE(SUM(cost_usd), 0) FROM attempts WHERE {column} = ? AND ts >= ?",
                (name, since)
            ).fetchone()
        return float(total)

    def close(self) -> None:
        self._closed = True
        if self._checkpointer is not None:
            self._kick.set()
            self._checkpointer.join(timeout=5)
        with self._read_lock:
            if self._reader is not None and self._reader is not self._conn:
                self._reader.close()
        with self._lock:
            self._conn.close()  # the last connection to close checkpoints what is left


def open_ledger(config: Ledger) -> LedgerBackend:
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
