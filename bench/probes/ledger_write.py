"""The SQLite ledger's write in process: CPU per commit, user and system apart, two trees
alternated in one run (a ledger lever's before and after; never part of `make test`).

The gateway commits a turn alone at concurrency 1 (one row) and the turns that finish together
in one transaction (`--rows`, the shared commit). Each child opens a new ledger file (the page
size is chosen when a file is made) with `--existing` rows already in it, warms it, then times
`--writes` commits through the store's own insert. The figures are CPU (getrusage), so the
machine's load moves them less than wall time, and the writing thread's alone (the checkpointer
thread's copies are not the write's); each side's figure is the median of its pairs.

Run: python bench/probes/ledger_write.py [--base DIR [--after DIR]] [--pairs 4] [--rows 1]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # bench/: common.py, upstream.py, the standing benches
sys.path.insert(0, str(BENCH))

from common import alternate, tree_arguments  # noqa: E402

# the writing thread's CPU alone: the store's checkpointer thread copies the WAL meanwhile
THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def measure(rows: int, existing: int, writes: int) -> dict:
    from relayline.adapters.stores import ledger

    def batch(k: int) -> list[tuple]:
        # by column name, so a tree with fewer or more ledger columns than this one writes its own rows
        rows = [{"ts": time.time(), "turn": f"turn-{i}", "requested": "bench.upstream/frames-1",
                 "provider": "bench.upstream", "model": "frames-1", "mode": "complete", "outcome": "ok",
                 "accepted": 1, "input_tokens": 12, "output_tokens": 34, "cost_usd": 0.000123, "client": "",
                 "estimated": 0, "key_name": "", "team": ""} for i in range(k)]
        return [tuple(row[column] for column in ledger.COLUMNS) for row in rows]

    # (before the wait-in-the-loop lever a shared commit turned SQLite's busy handler off and on)
    shared = {"busy_wait": False} if "busy_wait" in inspect.signature(ledger.LedgerStore._insert).parameters \
        and rows > 1 else {}
    with tempfile.TemporaryDirectory() as tmp:
        store = ledger.LedgerStore(os.path.join(tmp, "ledger.sqlite3"))
        for start in range(0, existing, 10_000):
            store._insert(batch(min(10_000, existing - start)))
        for _ in range(300):
            store._insert(batch(rows), **shared)
        before, wall = resource.getrusage(THREAD), time.perf_counter()
        for _ in range(writes):
            store._insert(batch(rows), **shared)
        after, wall = resource.getrusage(THREAD), time.perf_counter() - wall
        page = store._conn.execute("PRAGMA page_size").fetchone()[0]
        store.close()
    user, system = (after.ru_utime - before.ru_utime) / writes * 1e6, (after.ru_stime - before.ru_stime) / writes * 1e6
    return {"cpu_us": user + system, "user_us": user, "system_us": system, "wall_us": wall / writes * 1e6,
            "page_bytes": page}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arguments(parser, pairs=4)
    parser.add_argument("--rows", type=int, default=1, help="rows a commit (1: a turn alone)")
    parser.add_argument("--existing", type=int, default=20_000, help="rows in the file before the timed writes")
    parser.add_argument("--writes", type=int, default=3_000)
    parser.add_argument("--out", help="write the figures here (JSON)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows, args.existing, args.writes)))
        return 0
    sides = alternate(__file__, args, ["--rows", str(args.rows), "--existing", str(args.existing),
                                       "--writes", str(args.writes)])
    out = {"load_average": os.getloadavg()[0], "rows": args.rows,
           "sides": {side: {key: statistics.median(run[key] for run in runs) for key in runs[0]} | {"runs": runs}
                     for side, runs in sides.items()}}
    print(f"a ledger commit of {args.rows} row(s), in process, medians of {args.pairs} (load average "
          f"{out['load_average']:.1f}): µs")
    for side, row in out["sides"].items():
        print(f"  {side:<7} CPU {row['cpu_us']:6.1f} (user {row['user_us']:5.1f}, system {row['system_us']:5.1f}); "
              f"wall {row['wall_us']:6.1f}; pages of {row['page_bytes']:.0f} bytes")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
