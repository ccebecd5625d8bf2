"""The SQLite ledger's checkpoints: a write commits to the WAL and returns; copying the WAL into
the database (with its fsync) is the store's own thread's work, never the event loop's."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading
import time

import trio
import trio.testing

from relayline.adapters.stores import ledger as ledger_module
from relayline.adapters.stores.ledger import LedgerStore
from relayline.machines.ledger import LedgerRow
from relayline.machines.turn import TurnResult


def _result() -> TurnResult:
    row = LedgerRow(provider="p", model="m", mode="complete", outcome="ok", accepted=True, input_tokens=3,
                    output_tokens=5, cost_usd=0.001)
    return TurnResult(outcome="ok", error=None, message=None, requested="p", served=None, text="hi", reasoning="",
                      tool_calls=(), partial_text=None, notice=None, fallback=False, attempts=(), skipped=(),
                      ledger=(row,))


def _wait_for(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_writes_leave_the_checkpoint_to_the_stores_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "CHECKPOINT_EVERY", 20)
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0  # no write checkpoints itself
    size = os.path.getsize(path)
    for i in range(19):
        store.write(f"t{i}", _result())
    assert store._checkpointer is None and os.path.getsize(path) == size  # all of it still in the WAL
    store.write("t19", _result())
    # the 20th write woke the checkpointer: the WAL's pages reach the database file
    assert _wait_for(lambda: os.path.getsize(path) > size)
    assert store._checkpointer is not None and store._checkpointer.name == "relayline-ledger-checkpoint"
    assert [r["turn"] for r in store.rows()] == [f"t{i}" for i in range(20)]
    store.close()
    assert not store._checkpointer.is_alive()
    assert not os.path.exists(f"{path}-wal")  # the last connection closed: nothing left in a WAL
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*), SUM(output_tokens) FROM attempts").fetchone() == (20, 100)


def test_a_store_in_memory_has_no_wal_and_no_checkpointer():
    store = LedgerStore(":memory:")
    for i in range(ledger_module.CHECKPOINT_EVERY + 1):
        store.write(f"t{i}", _result())
    assert store._checkpointer is None and len(store.rows()) == ledger_module.CHECKPOINT_EVERY + 1
    store.close()


async def test_turns_that_finish_together_share_one_commit_and_a_turn_alone_commits_at_once(tmp_path):
    store = LedgerStore(tmp_path / "ledger.sqlite3")
    with trio.testing.assert_no_checkpoints():  # alone (the default): no wait for company
        assert await store.record("alone", _result()) == 1
    assert store._since_checkpoint == 1
    store.together = lambda: True
    returned: list[str] = []

    async def finish(turn: str) -> None:
        await store.record(turn, _result())
        returned.append(turn)

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(finish, f"t{i}")
    assert store._since_checkpoint == 2  # the ten turns' rows: one transaction
    assert sorted(returned) == sorted(f"t{i}" for i in range(10))
    assert sorted(r["turn"] for r in store.rows()) == sorted(["alone", *(f"t{i}" for i in range(10))])
    store.close()


def _recording(store: LedgerStore, failed: list[str]):
    """A turn's end that records its row and notes the turn in `failed` when the commit fails."""

    async def finish(turn: str) -> None:
        try:
            await store.record(turn, _result())
        except sqlite3.OperationalError:
            failed.append(turn)

    return finish


async def test_a_shared_commit_that_fails_raises_in_every_turn_that_shared_it(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    store.together = lambda: True
    with sqlite3.connect(path) as other:
        other.execute("DROP TABLE attempts")  # the next commit fails: a real error, from SQLite
    failed: list[str] = []
    finish = _recording(store, failed)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(finish, f"t{i}")
    assert sorted(failed) == ["t0", "t1", "t2"]
    store.close()


async def test_each_turn_of_a_failed_shared_commit_raises_its_own_error_with_a_bounded_traceback(tmp_path):
    # the same exception object raised in every joined turn took each raise's frames into its one
    # traceback: each logged `ledger_write_error` was longer than the last (20 turns: 20 times)
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    store.together = lambda: True
    with sqlite3.connect(path) as other:
        other.execute("DROP TABLE attempts")
    errors: dict[str, BaseException] = {}

    async def finish(turn: str) -> None:
        try:
            await store.record(turn, _result())
        except sqlite3.OperationalError as exc:
            errors[turn] = exc

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(finish, f"t{i}")
    depths = []
    for exc in errors.values():
        assert "no such table: attempts" in str(exc)
        # what a log line prints: the exception and what caused it, each frame of each traceback
        chain, depth = exc, 0
        while chain is not None:
            tb = chain.__traceback__
            while tb is not None:
                depth, tb = depth + 1, tb.tb_next
            chain = chain.__cause__ or chain.__context__
        depths.append(depth)
    assert max(depths) <= 10, depths  # one turn's frames and the commit's, never the other turns'
    assert len(errors) == 20 and len({id(exc) for exc in errors.values()}) == 20
    store.close()


async def test_a_shared_commit_waits_for_another_workers_lock_with_the_loop_free(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    store.together = lambda: True
    other = sqlite3.connect(path, isolation_level=None)  # another worker, in its commit
    other.execute("BEGIN IMMEDIATE")
    ticks = 0
    returned: list[str] = []

    async def finish(turn: str) -> None:
        await store.record(turn, _result())
        returned.append(turn)

    async def other_clients() -> None:  # what SQLite's own busy wait would have stalled
        nonlocal ticks
        while not returned:
            ticks += 1
            await trio.sleep(0.001)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_clients)
        for i in range(3):
            nursery.start_soon(finish, f"t{i}")
        await trio.sleep(0.1)
        assert returned == [] and ticks >= 20  # the turns wait (their rows are not written), the loop runs
        other.execute("COMMIT")
    other.close()
    assert sorted(returned) == ["t0", "t1", "t2"]
    assert sorted(r["turn"] for r in store.rows()) == ["t0", "t1", "t2"]
    store.close()


async def test_a_lock_held_beyond_the_busy_wait_fails_every_turn_of_the_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_module, "BUSY_S", 0.2)
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    store.together = lambda: True
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    failed: list[str] = []
    finish = _recording(store, failed)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(finish, f"t{i}")
    other.execute("ROLLBACK")
    other.close()
    assert sorted(failed) == ["t0", "t1"]
    assert store.rows() == []  # and no transaction left open: the next commit goes through
    assert await store.record("after", _result()) == 1
    store.close()


class _OtherWorker:
    """Another process (another gateway worker) that takes the ledger file's write lock and holds
    it until `release()`, or until it exits."""

    CODE = ("import sqlite3, sys; conn = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "conn.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.readline(); "
            "conn.execute('COMMIT')")

    def __init__(self, path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def release(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=10) == 0

    def release_after(self, seconds: float) -> threading.Thread:
        timer = threading.Timer(seconds, self.release)
        timer.start()
        return timer


def _busy_timeout(store: LedgerStore) -> int:
    return store._conn.execute("PRAGMA busy_timeout").fetchone()[0]


async def test_a_turn_alone_waits_for_another_processs_lock_in_the_loop_not_in_sqlite(tmp_path):
    """The store's connection has no busy handler, ever: a turn alone that meets another worker's
    write lock waits in the event loop (the loop runs meanwhile), and commits once it is free."""
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    assert _busy_timeout(store) == 0
    other = _OtherWorker(path)
    ticks = 0
    returned: list[str] = []

    async def finish(turn: str) -> None:
        await store.record(turn, _result())
        returned.append(turn)

    async def other_clients() -> None:  # what a sleep in SQLite's busy handler would have stalled
        nonlocal ticks
        while not returned:
            ticks += 1
            await trio.sleep(0.001)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_clients)
            nursery.start_soon(finish, "alone")
            await trio.sleep(0.1)
            assert returned == [] and ticks >= 20  # the turn waits, the loop runs
            nursery.start_soon(finish, "joined")  # a turn that finishes meanwhile joins its commit
            await trio.sleep(0.02)
            assert _busy_timeout(store) == 0
            other.release()
    assert sorted(returned) == ["alone", "joined"]
    assert store._since_checkpoint == 1  # one commit for both
    assert sorted(r["turn"] for r in store.rows()) == ["alone", "joined"]
    store.close()


def test_a_synchronous_write_waits_for_another_processs_lock_in_its_own_thread(tmp_path, monkeypatch):
    path = tmp_path / "ledger.sqlite3"
    store = LedgerStore(path)
    other = _OtherWorker(path)
    assert [r["turn"] for r in store.rows()] == []  # readers go on while the lock is held (WAL)
    other.release_after(0.2)
    started = time.monotonic()
    assert store.write("waited", _result()) == 1
    assert time.monotonic() - started >= 0.15  # it waited for the lock, then wrote
    assert [r["turn"] for r in store.rows()] == ["waited"]
    assert [r["output_tokens"] for r in store.report()] == [5]
    assert _busy_timeout(store) == 0

    monkeypatch.setattr(ledger_module, "BUSY_S", 0.2)  # a lock held beyond the wait: the write fails
    other = _OtherWorker(path)
    started = time.monotonic()
    try:
        store.write("lost", _result())
    except sqlite3.OperationalError as exc:
        assert ledger_module._busy(exc)
    else:
        raise AssertionError("a write beyond the busy wait succeeded")
    assert 0.1 <= time.monotonic() - started < 2
    other.release()
    assert store.write("after", _result()) == 1  # no transaction was left open
    assert [r["turn"] for r in store.rows()] == ["waited", "after"]
    store.close()


async def test_a_report_in_progress_never_holds_up_a_turns_commit(tmp_path):
    """The console reads its cost windows in a worker thread every few seconds; over a large
    ledger a report takes long. It reads on a connection of its own, beside the writer: a turn's
    commit in the event loop does not wait for it."""
    store = LedgerStore(tmp_path / "ledger.sqlite3")
    for i in range(50):
        store.write(f"t{i}", _result())
    reading, go_on = threading.Event(), threading.Event()

    def paused() -> int:  # SQLite calls this while the report's statement runs: it holds there
        reading.set()
        go_on.wait(10)
        return 0

    store._reading().set_progress_handler(paused, 100)
    report = threading.Thread(target=lambda: store.report(since=0.0))
    report.start()
    assert reading.wait(5)
    started = time.monotonic()
    assert await store.record("during", _result()) == 1
    waited = time.monotonic() - started
    go_on.set()
    report.join(10)
    store._reading().set_progress_handler(None, 0)
    assert waited < 2  # (on the writer's connection and lock it waited for the report: the 10 s)
    assert store.rows()[-1]["turn"] == "during"
    store.close()


# the schema every ledger file was made with before the id lost AUTOINCREMENT
SCHEMA_WITH_AUTOINCREMENT = """
CREATE TABLE attempts (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, turn TEXT NOT NULL, requested TEXT NOT NULL,
    provider TEXT NOT NULL, model TEXT NOT NULL, mode TEXT NOT NULL, outcome TEXT NOT NULL,
    accepted INTEGER NOT NULL, input_tokens INTEGER NOT NULL, output_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, client TEXT NOT NULL DEFAULT ''
);
CREATE INDEX attempts_ts ON attempts (ts);
"""


def _tables(path) -> dict[str, str]:
    with sqlite3.connect(path) as conn:
        return dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table', 'index')"))


def test_a_ledger_made_with_autoincrement_is_rebuilt_once_keeping_every_row_and_id(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(SCHEMA_WITH_AUTOINCREMENT)
        # ids with a gap, as an older ledger may have: each keeps its id
        old.executemany("INSERT INTO attempts VALUES (?, ?, ?, 'p/m', 'p', 'm', 'complete', 'ok', 1, 10, 2, 0.5, ?)",
                        [(1, 1.0, "t1", ""), (2, 2.0, "t2", "k1"), (7, 3.0, "t7", "k2")])
    old.close()
    assert "sqlite_sequence" in _tables(path)
    store = LedgerStore(path)
    tables = _tables(path)
    assert "AUTOINCREMENT" not in tables["attempts"].upper() and "attempts_before" not in tables
    assert tables["attempts_ts"] is not None  # the index on ts is there again for `--since`
    assert [(r["turn"], r["client"], r["cost_usd"]) for r in store.rows()] == [
        ("t1", "", 0.5), ("t2", "k1", 0.5), ("t7", "k2", 0.5)]
    assert [r["turn"] for r in store.rows(since=2.5)] == ["t7"]
    store.write("t8", _result(), now=4.0)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT id, turn FROM attempts ORDER BY id").fetchall() == [
            (1, "t1"), (2, "t2"), (7, "t7"), (8, "t8")]
    store.close()
    LedgerStore(path).close()  # opening it again changes nothing
    assert _tables(path) == tables


def test_a_new_ledger_writes_no_sequence_row_per_commit(tmp_path):
    path = tmp_path / "new.sqlite3"
    store = LedgerStore(path)
    store.write("t1", _result())
    assert "sqlite_sequence" not in _tables(path)
    store.close()


def _page_size(path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA page_size").fetchone()[0]


def test_a_new_ledger_has_small_pages_and_one_made_before_keeps_its_own(tmp_path):
    # a commit writes each page it changed to the WAL whole: a new file's are 1 KiB, not 4
    store = LedgerStore(tmp_path / "new.sqlite3")
    store.write("t1", _result())
    store.close()
    assert _page_size(tmp_path / "new.sqlite3") == ledger_module.PAGE_BYTES == 1024
    old = tmp_path / "old.sqlite3"
    with sqlite3.connect(old) as conn:  # made before, at SQLite's default page size
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(ledger_module.SCHEMA)
        conn.execute(ledger_module.INSERT, ledger_module.ledger_rows("t0", _result(), 1.0)[0])
    store = LedgerStore(old)
    store.write("t1", _result())
    assert [r["turn"] for r in store.rows()] == ["t0", "t1"]
    store.close()
    assert _page_size(old) == 4096


def test_a_worker_opening_a_ledger_while_another_rebuilds_it_waits_for_the_rebuild(tmp_path, monkeypatch):
    """`serve --workers` opens one file in each worker at once. A large ledger made with
    AUTOINCREMENT takes one of them seconds to rebuild (2 million rows: 15 s); the others must
    wait for it, not fail at start with `database is locked` once the usual busy wait is over."""
    monkeypatch.setattr(ledger_module, "BUSY_S", 0.1)  # the usual wait, short here; the rebuild below is longer
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:
        old.execute("PRAGMA journal_mode=WAL")  # (as every LedgerStore made it)
        old.executescript(SCHEMA_WITH_AUTOINCREMENT)
        old.execute("INSERT INTO attempts VALUES (1, 1.0, 't1', 'p/m', 'p', 'm', 'complete', 'ok', 1, 10, 2, 0.5, '')")
    old.close()
    rebuilding = sqlite3.connect(path, isolation_level=None)  # the first worker, in its rebuild
    rebuilding.execute("BEGIN IMMEDIATE")
    opened: list[object] = []
    second = threading.Thread(target=lambda: opened.append(_open_or_error(path)))
    second.start()
    time.sleep(0.5)
    rebuilding.execute("COMMIT")
    rebuilding.close()
    second.join(10)
    store = opened[0]
    assert isinstance(store, LedgerStore), store
    assert [r["turn"] for r in store.rows()] == ["t1"] and "AUTOINCREMENT" not in _tables(path)["attempts"].upper()
    store.close()


def _open_or_error(path):
    try:
        return LedgerStore(path)
    except Exception as exc:
        return exc


def test_a_current_ledger_is_opened_without_taking_the_write_lock(tmp_path, monkeypatch):
    # `relayline ledger` reads while a gateway writes: opening a ledger that needs no migration
    # must not wait for (or fail on) the writer's lock
    monkeypatch.setattr(ledger_module, "BUSY_S", 0.1)
    path = tmp_path / "current.sqlite3"
    LedgerStore(path).close()
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        store = LedgerStore(path)
        assert store.rows() == []
        store.close()
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_a_file_another_connection_is_writing_in_rollback_mode_is_switched_to_wal_once_it_is_done(tmp_path):
    # SQLite refuses the switch to WAL at once, without its busy handler, while another
    # connection holds a write lock on a rollback-journal file (workers opening one old or new
    # file together raced into this): opening waits for the write, as any busy statement does
    path = tmp_path / "rollback.sqlite3"
    with sqlite3.connect(path) as made:
        made.execute("CREATE TABLE other (a)")
    made.close()
    writing = threading.Event()

    def write_for_a_while() -> None:
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        other.execute("INSERT INTO other VALUES (1)")
        writing.set()
        time.sleep(0.3)
        other.execute("COMMIT")
        other.close()

    writer = threading.Thread(target=write_for_a_while)
    writer.start()
    assert writing.wait(10)
    store = LedgerStore(path)
    writer.join(10)
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_workers_opening_one_old_ledger_together_rebuild_it_once(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as old:
        old.executescript(SCHEMA_WITH_AUTOINCREMENT)
        old.executemany("INSERT INTO attempts VALUES (?, ?, ?, 'p/m', 'p', 'm', 'complete', 'ok', 1, 10, 2, 0.5, '')",
                        [(i, float(i), f"t{i}") for i in range(1, 2001)])
    old.close()
    stores: list[LedgerStore] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_it() -> None:
        start.wait()
        try:
            stores.append(LedgerStore(path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [] and len(stores) == 4
    assert "AUTOINCREMENT" not in _tables(path)["attempts"].upper()
    assert [r["turn"] for r in stores[0].rows()] == [f"t{i}" for i in range(1, 2001)]
    for store in stores:
        store.close()
