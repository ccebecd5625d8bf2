"""The streaming path's levers, before and after, in one run (`python bench/frames.py`).

bench/run.py takes the stream figures once, for the code as it is. A lever in the stream path
(the library's hand-off, the gateway's tasks per stream) changes code that has no switch to turn
it off, so its before/after needs two trees: `--base DIR` names a checkout of the code before the
lever (its package directory, e.g. a `git worktree add --detach` of the commit before), and the
two are measured alternately, each in its own child process with its own upstream and gateway,
so that machine noise hits both alike. Each child reports, for 1- and 200-frame streams from the
loopback upstream (bench/upstream.py): first byte added and per frame added end to end (the
slope from 1 to 200 frames, minus the direct httpx call's), for the gateway and for the library
in process; and the gateway's RSS per in-flight stream with `--held` streams open at once (from
a fresh gateway, bench/load.py's raw asyncio client). Loopback only; every loop is bounded.

    python bench/frames.py --base /tmp/base-tree [--after /tmp/other-tree] [--pairs 3] [--rounds 20] [--held 5000]
    python bench/frames.py            # this tree alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import alternate, tree_arguments  # noqa: E402


def child(rounds: int, held: int) -> dict:
    import httpx
    import load
    import trio
    from common import library_stream_timing, stream_timing
    from peers import Processes, stream_row

    from relayline.adapters import Relay

    out: dict = {"load_average": os.getloadavg()[0]}
    with Processes(hold_s=3.0) as procs:
        async def streams() -> dict:
            runs: dict = {f"{name}_{frames}": [] for name in ("direct", "gateway", "library") for frames in (1, 200)}
            async with httpx.AsyncClient(timeout=60) as client, Relay.from_toml(procs.config_text, env={}) as relay:
                direct = f"{procs.upstream}/v1/chat/completions"
                gateway = f"{procs.gateway}/v1/chat/completions"
                for _ in range(5):  # warm: connections, caches
                    await stream_timing(client, direct, 200)
                    await stream_timing(client, gateway, 200)
                    await library_stream_timing(relay, 200)
                for _ in range(rounds):
                    for frames in (1, 200):
                        runs[f"direct_{frames}"].append(await stream_timing(client, direct, frames))
                        runs[f"gateway_{frames}"].append(await stream_timing(client, gateway, frames))
                        runs[f"library_{frames}"].append(await library_stream_timing(relay, frames))
            return {name: stream_row(runs, name, "direct") for name in ("gateway", "library")}

        out["stream"] = trio.run(streams)
    if held:
        # a fresh gateway (no freed heap from earlier requests), and a hold long enough for every
        # stream to be in flight at once (as bench/load.py's): with 3 s, a gateway that takes the
        # burst faster ended its first streams before the last began, and its figure was per fewer
        with Processes(hold_s=40.0) as procs:
            out["held"] = asyncio.run(load.held_streams(f"{procs.gateway}/v1/chat/completions", held,
                                                        procs.gateway_pid))
    return out


FIGURES = (("gateway first byte added, ms", "stream", "gateway", "first_byte_added_ms"),
           ("gateway per frame added, µs", "stream", "gateway", "per_frame_added_us"),
           ("library first byte added, ms", "stream", "library", "first_byte_added_ms"),
           ("library per frame added, µs", "stream", "library", "per_frame_added_us"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arguments(parser)
    parser.add_argument("--rounds", type=int, default=20, help="1- and 200-frame streams per method per child")
    parser.add_argument("--held", type=int, default=1000, help="streams held at once for RSS per stream (0: none)")
    parser.add_argument("--out", help="write the figures and every child's results here (JSON)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.held)))
        return 0
    sides = alternate(__file__, args, ["--rounds", str(args.rounds), "--held", str(args.held)])
    rows = [(label, [statistics.median(r[part][who][key] for r in runs) for runs in sides.values()])
            for label, part, who, key in FIGURES]
    if args.held:
        rows.append((f"gateway RSS per stream, {args.held} held, KiB",
                     [statistics.median(r["held"]["gateway_kib_per_stream"] for r in runs) for runs in sides.values()]))
        rows.append(("held streams with an error",
                     [max(r["held"]["errors"] for r in runs) for runs in sides.values()]))
    loads = [r["load_average"] for runs in sides.values() for r in runs]
    print(f"medians of {args.pairs} children each ({args.rounds} rounds); load average {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'':<44}" + "".join(f"{side:>12}" for side in sides))
    for label, values in rows:
        print(f"{label:<44}" + "".join(f"{v:>12.2f}" for v in values))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": dict(rows), "sides": sides}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
