"""The cost of a fleet's shared state, beside the single process's, in the same run.

- health: a library turn (plan, walk, turn machine, the driver, the in-process sim upstream) with
  [health] store = "memory" and with "redis://" on a private loopback redis-server, one turn at
  a time and 50 at once (concurrent turns share store rounds);
- ledger: a turn's rows written to SQLite (in the loop) and to PostgreSQL (pool, worker thread).

Run alone (`python bench/fleet.py`) or as part of `make bench`. Needs redis-server and
PostgreSQL (.ci/services installs them); a missing one is reported and skipped.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from relayline.adapters import Relay  # noqa: E402
from relayline.adapters.relay import turns_of  # noqa: E402
from relayline.adapters.stores.ledger import LedgerStore  # noqa: E402
from relayline.adapters.stores.postgres import PostgresLedger  # noqa: E402
from services import PostgresServer, RedisServer  # noqa: E402

HI = [{"role": "user", "content": "hi"}]


def toml(store: str) -> str:
    return f"""
active = "a"
[health]
store = "{store}"
key_prefix = "bench:{time.monotonic_ns()}:"
[providers.a]
family = "sim"
model = "m1"
fallbacks = ["b"]
[providers.b]
family = "sim"
model = "m2"
"""


def turns_us(store: str, turns: int, concurrency: int) -> tuple[float, float]:
    """Mean wall time per turn (µs), and store rounds per turn."""
    relay = Relay.from_toml(toml(store), env={})

    async def main():
        async with relay:
            async def worker(n):
                for _ in range(n):
                    await turns_of(relay).run(HI)

            await worker(20)  # warm up
            rounds = getattr(relay.health, "rounds", 0)
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker, turns // concurrency)
            elapsed = time.perf_counter() - start
            return elapsed / turns * 1e6, (getattr(relay.health, "rounds", 0) - rounds) / turns

    return trio.run(main)


def bench_health(redis_url: str, turns: int = 600) -> dict:
    out = {}
    for concurrency in (1, 50):
        memory, shared, rounds = [], [], []
        for _ in range(3):
            memory.append(turns_us("memory", turns, concurrency)[0])
            us, per_turn = turns_us(redis_url, turns, concurrency)
            shared.append(us)
            rounds.append(per_turn)
        m, s = statistics.median(memory), statistics.median(shared)
        out[f"concurrency_{concurrency}"] = {"memory_turn_us": m, "redis_turn_us": s, "added_us": s - m,
                                             "ratio": s / m, "store_rounds_per_turn": statistics.median(rounds)}
    return out


def bench_ledger(pg_url: str, turns: int = 300) -> dict:
    relay = Relay.from_toml(toml("memory"), env={})
    result = trio.run(turns_of(relay).run, HI)
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = LedgerStore(Path(tmp) / "bench.sqlite3")
        pg = PostgresLedger(pg_url)

        async def write(store):
            start = time.perf_counter()
            for i in range(turns):
                await store.record(f"t{i}", result)
            return (time.perf_counter() - start) / turns * 1e6

        s = statistics.median(trio.run(write, sqlite) for _ in range(3))
        p = statistics.median(trio.run(write, pg) for _ in range(3))
        sqlite.close()
        pg.close()
    return {"sqlite_row_us": s, "postgres_row_us": p, "ratio": p / s}


def run() -> dict:
    results: dict = {}
    if RedisServer.unavailable():
        results["health"] = {"skipped": RedisServer.unavailable()}
    else:
        redis = RedisServer()
        redis.start()
        try:
            results["health"] = bench_health(redis.url)
        finally:
            redis.stop()
    if PostgresServer.unavailable():
        results["ledger"] = {"skipped": PostgresServer.unavailable()}
    else:
        pg = PostgresServer()
        pg.start()
        try:
            results["ledger"] = bench_ledger(pg.url)
        finally:
            pg.stop()
    return results


def report(results: dict) -> None:
    print("\nshared state (a fleet) beside one process, same run")
    health = results["health"]
    if "skipped" in health:
        print(f"  health: skipped ({health['skipped']})")
    else:
        for name, row in health.items():
            print(f"  library turn, {name.replace('_', ' ')}: memory {row['memory_turn_us']:.0f} µs, redis "
                  f"{row['redis_turn_us']:.0f} µs (+{row['added_us']:.0f} µs, {row['ratio']:.2f}x; "
                  f"{row['store_rounds_per_turn']:.2f} store rounds per turn)")
    ledger = results["ledger"]
    if "skipped" in ledger:
        print(f"  ledger: skipped ({ledger['skipped']})")
    else:
        print(f"  ledger, one turn's row: SQLite {ledger['sqlite_row_us']:.0f} µs, PostgreSQL "
              f"{ledger['postgres_row_us']:.0f} µs ({ledger['ratio']:.1f}x)")


if __name__ == "__main__":
    report(run())
