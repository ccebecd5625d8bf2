"""What a held stream keeps in the gateway's Python heap, by allocation site (`python
bench/probes/stream_heap.py`; never part of `make test`).

The gateway runs in this process (its own HTTP/1.1 server) in front of the loopback upstream
(bench/upstream.py, its own process, "hold" streams: two text frames, then it waits); a client
process (bench/load.py's raw asyncio client) opens `--held` streams at once. Once every stream
sent its request upstream and read its first frames, a tracemalloc snapshot is compared with
one taken before: the heap per held stream, its peak, and the allocation sites that hold the
most. `--base DIR` measures a checkout of the code before a lever too, the two alternated, each
in its own child process (bench/frames.py's --base). `--prompt-words N` sends a prompt of N
words instead of "hi" (what a stream keeps of its request grows with it). Loopback only; every
wait is bounded.

    python bench/probes/stream_heap.py [--base /tmp/base-tree] [--pairs 3] [--held 1000] [--prompt-words 800]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import tracemalloc
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # bench/: common.py, upstream.py, the standing benches
sys.path.insert(0, str(BENCH))

from common import alternate, tree_arguments  # noqa: E402


def child(held: int, prompt_words: int, top: int) -> dict:
    import trio

    from relayline.adapters import Relay
    from relayline.adapters.gateway.app import Gateway
    from relayline.adapters.gateway.serving import serve

    up = subprocess.Popen([sys.executable, str(BENCH / "upstream.py"), "0", "30"], stdout=subprocess.PIPE, text=True)
    tmp = tempfile.TemporaryDirectory()
    try:
        upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        relay = Relay.from_toml(textwrap.dedent(f"""
            active = "bench.upstream"
            [ledger]
            path = "{tmp.name}/ledger.sqlite3"
            [providers."bench.upstream"]
            family = "openai"
            base_url = "{upstream}/v1"
            api_key = "bench-key"
            """), env={})
        gateway = Gateway.from_relay_config(relay, env={})
        out: dict = {}

        def client(url: str, count: int) -> list[str]:
            code = (f"import asyncio, sys; sys.path.insert(0, {str(BENCH)!r}); import load; "
                    f"load.MESSAGES[0]['content'] = 'word ' * {prompt_words} or 'hi'; "
                    f"print(asyncio.run(load.held_streams({url!r}, {count}, {os.getpid()})))")
            return [sys.executable, "-c", code]

        def streaming() -> int:
            """Streams whose first frames went out to their client (committed)."""
            return sum(1 for o in gc.get_objects() if type(o).__name__ == "_StreamWire" and o.started)

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                binds = await nursery.start(lambda task_status: serve(gateway, port=0, task_status=task_status))
                url = binds[0] + "/v1/chat/completions"
                await trio.run_process(client(url, 50), capture_stdout=True)  # warm: caches, the ledger
                gc.collect()
                tracemalloc.start()
                before = tracemalloc.take_snapshot()
                base = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                nursery.start_soon(lambda: trio.run_process(client(url, held), capture_stdout=True))
                with trio.move_on_after(120):
                    while gateway.in_flight < held:
                        await trio.sleep(0.1)
                    await trio.sleep(1.0)
                    while streaming() < held:
                        await trio.sleep(0.5)
                out["in_flight"] = gateway.in_flight
                gc.collect()
                current, peak = tracemalloc.get_traced_memory()
                after = tracemalloc.take_snapshot()
                tracemalloc.stop()
                out["heap_kib_per_stream"] = (current - base) / held / 1024
                out["peak_kib_per_stream"] = (peak - base) / held / 1024
                stats = after.compare_to(before, "lineno")
                out["objects_per_stream"] = sum(s.count_diff for s in stats) / held
                out["sites"] = [[f"{'/'.join(Path(s.traceback[0].filename).parts[-2:])}:{s.traceback[0].lineno}",
                                 round(s.size_diff / held), round(s.count_diff / held, 2)] for s in stats[:top]]
                nursery.cancel_scope.cancel()

        trio.run(run)
        return out
    finally:
        up.terminate()
        up.wait(10)
        tmp.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arguments(parser)
    parser.add_argument("--held", type=int, default=1000)
    parser.add_argument("--prompt-words", type=int, default=0)
    parser.add_argument("--top", type=int, default=25, help="allocation sites listed")
    parser.add_argument("--out", help="write every child's results here (JSON)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.held, args.prompt_words, args.top)))
        return 0
    sides = alternate(__file__, args, ["--held", str(args.held), "--prompt-words", str(args.prompt_words),
                                       "--top", str(args.top)], timeout_s=600)
    print(f"{args.held} held streams, prompt {args.prompt_words or 'hi'} words; medians of {args.pairs}")
    for side, runs in sides.items():
        each = ", ".join(f"{r['heap_kib_per_stream']:.1f}" for r in runs)
        print(f"{side:>7}: heap {statistics.median(r['heap_kib_per_stream'] for r in runs):.2f} KiB/stream, "
              f"peak {statistics.median(r['peak_kib_per_stream'] for r in runs):.2f}, "
              f"{statistics.median(r['objects_per_stream'] for r in runs):.0f} objects "
              f"(runs: {each})")
    for side, runs in sides.items():
        print(f"\n{side}: the sites holding the most per stream (last run): bytes, objects")
        for where, size, count in runs[-1]["sites"]:
            print(f"  {size:6d} B {count:6.2f}  {where}")
    if args.out:
        Path(args.out).write_text(json.dumps(sides, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
