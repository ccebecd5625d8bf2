"""The gateway's CPU per streamed frame and per stream, before and after a lever (`python
bench/stream_cpu.py --base DIR`; never part of `make test`).

bench/frames.py's end-to-end figures move by tens of µs a frame when the 2-core machine is
loaded (three processes take turns on it); the CPU the gateway process spends does not depend
on whose turn it is. Here one raw asyncio client (bench/load.py's) asks a `relayline serve`
in front of the loopback upstream (bench/upstream.py) for 1-frame and F-frame streams on one
keep-alive connection, one after another, and reads the gateway's CPU from /proc around each
batch: the CPU per 1-frame stream, and per frame the slope from 1 to F frames. With `--base`,
the trees alternate, each in its own child process. Loopback only; every loop is bounded.

    python bench/stream_cpu.py --base /tmp/base-tree [--after DIR] [--pairs 3] [--frames 1000] [--streams 300]
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


def child(frames: int, streams: int) -> dict:
    from common import cpu_s, raw_connect, raw_post, raw_response
    from peers import Processes

    with Processes(hold_s=3.0) as procs:
        url = f"{procs.gateway}/v1/chat/completions"
        requests = {n: raw_post(url, {"model": f"frames-{n}", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": True}) for n in (1, frames)}

        async def main() -> dict[int, list[float]]:
            reader, writer = await raw_connect(url)

            async def one(n: int) -> None:
                writer.write(requests[n])
                status, body, _ = await raw_response(reader)
                if status != 200 or b"[DONE]" not in body:
                    raise SystemExit(f"stream failed: {status} {body[-300:]!r}")

            for n in (1, frames):  # warm: connections, caches
                for _ in range(20):
                    await one(n)
            cpu: dict[int, list[float]] = {1: [], frames: []}
            for _ in range(3):
                for n, count in ((1, streams), (frames, max(streams // 10, 5))):
                    start = cpu_s(procs.gateway_pid)
                    for _ in range(count):
                        await one(n)
                    cpu[n].append((cpu_s(procs.gateway_pid) - start) / count * 1e6)
            writer.close()
            return cpu

        cpu = asyncio.run(main())
    one_frame, many = statistics.median(cpu[1]), statistics.median(cpu[frames])
    return {"cpu_us_per_stream": one_frame, "cpu_us_per_frame": (many - one_frame) / (frames - 1),
            "load_average": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arguments(parser)
    parser.add_argument("--frames", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=300, help="1-frame streams per batch (a tenth as many long ones)")
    parser.add_argument("--out", help="write every child's results here (JSON)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.frames, args.streams)))
        return 0
    sides = alternate(__file__, args, ["--frames", str(args.frames), "--streams", str(args.streams)])
    loads = [r["load_average"] for runs in sides.values() for r in runs]
    print(f"gateway CPU (10 ms ticks, summed over batches); medians of {args.pairs}; load {min(loads):.1f}-{max(loads):.1f}")
    for side, runs in sides.items():
        print(f"{side:>7}: {statistics.median(r['cpu_us_per_frame'] for r in runs):.2f} µs a frame "
              f"({', '.join(format(r['cpu_us_per_frame'], '.2f') for r in runs)}), "
              f"{statistics.median(r['cpu_us_per_stream'] for r in runs):.0f} µs a 1-frame stream")
    if args.out:
        Path(args.out).write_text(json.dumps(sides, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
