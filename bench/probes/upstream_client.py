"""The upstream client lever: the gateway on its lean HTTP/1.1 client
(providers/upstream.py) beside the same gateway on httpx (RELAYLINE_UPSTREAM_CLIENT=httpx), in
the same run, against the same raw asyncio upstream (bench/upstream.py), rounds interleaved.

Figures, each beside the direct httpx call of the same round: added latency p50/p99 of a
non-streamed request at concurrency 1, the gateway's CPU per request, the first byte added and
the per-frame slope of a stream (1 and 200 frames), and throughput at concurrency 1 and 16 as a
share of direct's.

Run: python bench/probes/upstream_client.py [rounds]  (prints a table and appends the run to
bench/results/upstream-client-<date>.json)
"""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: common.py and peers.py

from common import cpu_s, httpx_throughput, stream_timing, timed_posts  # noqa: E402
from peers import Processes  # noqa: E402

CLIENTS = ("lean", "httpx")


def start_gateway(procs: Processes, client: str) -> tuple[str, int]:
    before = os.environ.get("RELAYLINE_UPSTREAM_CLIENT")
    os.environ["RELAYLINE_UPSTREAM_CLIENT"] = client
    try:
        url, pid = procs.start_gateway()
    finally:
        if before is None:
            del os.environ["RELAYLINE_UPSTREAM_CLIENT"]
        else:
            os.environ["RELAYLINE_UPSTREAM_CLIENT"] = before
    return f"{url}/v1/chat/completions", pid


def measure(rounds: int, n: int) -> dict:
    raw: dict = {"latency": {k: [] for k in ("direct", *CLIENTS)}, "cpu_s": dict.fromkeys(CLIENTS, 0.0),
                 "stream": {f"{k}_{f}": [] for k in ("direct", *CLIENTS) for f in (1, 200)},
                 "throughput": {c: {k: [] for k in ("direct", *CLIENTS)} for c in (1, 16)}}
    with Processes() as procs:
        gateways = {client: start_gateway(procs, client) for client in CLIENTS}
        direct = f"{procs.upstream}/v1/chat/completions"

        async def main() -> None:
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
            async with httpx.AsyncClient(limits=limits, timeout=60) as http:
                for url in (direct, *(url for url, _ in gateways.values())):
                    await timed_posts(http, url, 50)
                for _ in range(rounds):
                    raw["latency"]["direct"] += await timed_posts(http, direct, n)
                    for client, (url, pid) in gateways.items():
                        before = cpu_s(pid)
                        raw["latency"][client] += await timed_posts(http, url, n)
                        raw["cpu_s"][client] += cpu_s(pid) - before
                    for _ in range(5):
                        for frames in (1, 200):
                            raw["stream"][f"direct_{frames}"].append(await stream_timing(http, direct, frames))
                            for client, (url, _) in gateways.items():
                                raw["stream"][f"{client}_{frames}"].append(await stream_timing(http, url, frames))
                    for concurrency in (1, 16):
                        total = 300 if concurrency == 1 else 512
                        raw["throughput"][concurrency]["direct"].append(
                            await httpx_throughput(http, direct, concurrency, total))
                        for client, (url, _) in gateways.items():
                            raw["throughput"][concurrency][client].append(
                                await httpx_throughput(http, url, concurrency, total))

        trio.run(main)
    return summarise(raw, rounds * n)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(raw: dict, requests: int) -> dict:
    lat = raw["latency"]
    out: dict = {"load_average": os.getloadavg()[0]}
    stream = raw["stream"]

    def med(key: str, i: int) -> float:
        return statistics.median(t[i] for t in stream[key])

    for client in CLIENTS:
        first_added = med(f"{client}_200", 0) - med("direct_200", 0)
        slope = (med(f"{client}_200", 1) - med(f"{client}_1", 1)) / 199
        direct_slope = (med("direct_200", 1) - med("direct_1", 1)) / 199
        out[client] = {
            "added_p50_ms": (_pct(lat[client], 0.5) - _pct(lat["direct"], 0.5)) * 1e3,
            "added_p99_ms": (_pct(lat[client], 0.99) - _pct(lat["direct"], 0.99)) * 1e3,
            "cpu_ms_per_request": raw["cpu_s"][client] / requests * 1e3,
            "first_byte_added_ms": first_added * 1e3,
            "added_per_frame_us": (slope - direct_slope) * 1e6,
            **{f"throughput_c{c}_share": statistics.median(raw["throughput"][c][client])
               / statistics.median(raw["throughput"][c]["direct"]) for c in (1, 16)},
            **{f"throughput_c{c}_rps": statistics.median(raw["throughput"][c][client]) for c in (1, 16)},
        }
    out["direct"] = {"p50_ms": _pct(lat["direct"], 0.5) * 1e3,
                     **{f"throughput_c{c}_rps": statistics.median(raw["throughput"][c]["direct"]) for c in (1, 16)}}
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    load = os.getloadavg()[0]
    result = measure(rounds, 200)
    result["load_average_start"] = load
    lean, old = result["lean"], result["httpx"]
    print(f"load average {load:.1f} -> {result['load_average']:.1f}; direct p50 {result['direct']['p50_ms']:.2f} ms")
    print(f"{'measure':34} {'httpx':>10} {'lean':>10}")
    for key in lean:
        print(f"{key:34} {old[key]:10.3f} {lean[key]:10.3f}")
    path = Path(__file__).resolve().parent.parent / "results" / f"upstream-client-{dt.date.today()}.json"
    runs = json.loads(path.read_text())["runs"] if path.exists() else []  # a day's runs, each kept
    path.write_text(json.dumps({"bench": "bench/probes/upstream_client.py", "runs": [*runs, result]}, indent=2) + "\n")
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
