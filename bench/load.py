"""The gateway under load (`make bench`; never part of `make test`).

The fault review saw 1,000 concurrent clients collapse the gateway to 38-64 req/s (httpcore's pool scan,
and upstream connections re-opened instead of reused); the performance targets are: at 200 and
1,000 concurrent clients no error, p99 at most 3x p50 and throughput not below the concurrency-16
figure; 5,000 concurrent streams with no error and at most 32 KiB of gateway memory per stream.

Closed-loop clients (each one keep-alive connection, one request after another) run for a fixed
time against the upstream directly and through `relayline serve` (its own process), in the same
run. The client is lean on purpose (raw asyncio streams, pre-built requests, no HTTP library) so
that it is not what is measured; its own CPU per request is reported beside the gateway's. The
upstream (bench/upstream.py) counts the connections it accepted, so the connections the gateway
opened per request are a number, not a guess.

How a row is taken, the same for every level: each level runs `--rounds` times (3), the levels
interleaved round by round and the two targets' order turned every round; a row is the median of
its rounds (req/s, p99 over p50, CPU per request), its rounds' req/s beside it, and its errors
summed. The gateway's CPU per request is counted inside the window (a 1,000-client burst's 1,000
accepts and ~800 upstream connects come before it: `burst_cpu_s`).

Run: python bench/load.py  (results: bench/results/load-<date>.json); a partial run that writes
nothing: python bench/load.py --levels 16,1000 --streams 0 --seconds 4 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    MESSAGES,
    REQUEST_TIMEOUT_S,
    closed_loop,
    raw_connect,
    raw_post,
    raw_response,
    rss_kib,
)
from peers import Processes  # noqa: E402  (bench/peers.py: the upstream and gateway processes)


async def _upstream_connections(upstream: str) -> int:
    reader, writer = await raw_connect(upstream)
    parts = urlsplit(upstream)
    writer.write(f"GET /stats HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-length: 0\r\n\r\n".encode())
    _status, body, _keep = await raw_response(reader)
    writer.close()
    return json.loads(body)["connections"]


async def held_streams(url: str, count: int, gateway_pid: int) -> dict:
    """`count` streams held open at once through the gateway (the upstream sends two frames, then
    holds): how many were in flight together, errors, and the gateway's RSS per stream."""
    request = raw_post(url, {"model": "hold-2", "messages": MESSAGES, "stream": True})
    baseline = rss_kib(gateway_pid)
    flowing = 0
    peak = {"streams": 0, "rss_kib": baseline}
    errors: dict[str, int] = {}
    ok = 0
    all_flowing = asyncio.Event()

    def first_frame() -> None:
        nonlocal flowing
        flowing += 1
        if flowing == count:
            all_flowing.set()

    async def one() -> None:
        nonlocal ok, flowing
        counted = False

        def seen() -> None:
            nonlocal counted
            counted = True
            first_frame()

        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S * 2):
                reader, writer = await raw_connect(url)
                writer.write(request)
                status, body, _keep = await raw_response(reader, b'"content":" w0"', seen)
                writer.close()
            if status == 200 and b"[DONE]" in body and b'"error"' not in body:
                ok += 1
            else:
                errors[f"http {status}"] = errors.get(f"http {status}", 0) + 1
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
        finally:
            if counted:
                flowing -= 1

    async def sample() -> None:
        while True:
            peak["streams"] = max(peak["streams"], flowing)
            peak["rss_kib"] = max(peak["rss_kib"], rss_kib(gateway_pid))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    start = time.perf_counter()
    streams = [asyncio.create_task(one()) for _ in range(count)]
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S * 2):
            await all_flowing.wait()
        all_in_flight_s = round(time.perf_counter() - start, 2)
        peak["streams"] = count
    except TimeoutError:
        all_in_flight_s = None
    await asyncio.gather(*streams)
    sampler.cancel()
    await asyncio.sleep(1.0)
    return {
        "streams": count, "ok": ok, "errors": sum(errors.values()), "error_kinds": errors,
        "max_in_flight_together": peak["streams"], "seconds_until_all_in_flight": all_in_flight_s,
        "gateway_rss_before_kib": baseline, "gateway_rss_peak_kib": peak["rss_kib"],
        "gateway_rss_after_kib": rss_kib(gateway_pid),
        "gateway_kib_per_stream": round((peak["rss_kib"] - baseline) / max(peak["streams"], 1), 2),
    }


def _profiler(pid: int, seconds: float, path: str) -> subprocess.Popen:
    """py-spy sampling the gateway: an SVG flame graph for a path ending .svg, speedscope's JSON for
    .json, else collapsed stacks (one line per stack, its sample count last) to add up by frame."""
    fmt = {".svg": "flamegraph", ".json": "speedscope"}.get(Path(path).suffix, "raw")
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--format", fmt,
                             "--duration", str(int(seconds)), "--rate", "200", "--nonblocking", "-o", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _start_without(procs: Processes, lever: str) -> tuple[str, int]:
    """A second gateway with one of bench/gateway_cpu.py's levers put back to its former code (its
    own ledger file), measured beside the gateway as it is at every level: a lever's before/after
    under load in one run."""
    import gateway_cpu

    config = Path(procs.tmp.name) / "without.toml"
    config.write_text(procs.config_text.replace("ledger.sqlite3", "ledger-without.sqlite3"))
    proc, url = gateway_cpu.start_with_lever(lever, config)
    procs.procs.append(proc)
    return url, proc.pid


async def run(procs: Processes, *, seconds: float, levels: tuple[int, ...], streams: int, rounds: int = 3,
              profile: str | None = None, without: str | None = None) -> dict:
    direct = f"{procs.upstream}/v1/chat/completions"
    gateway = f"{procs.gateway}/v1/chat/completions"
    pids = {"gateway": procs.gateway_pid}
    targets = [("direct", direct), ("gateway", gateway)]
    await closed_loop(gateway, 16, 1.0)  # warm up: imports, caches, the first connections
    if without:
        url, pids["without"] = _start_without(procs, without)
        targets.append(("without", url))
        await closed_loop(url, 16, 1.0)
    out: dict = {"closed_loop": {}}
    if streams:
        # first, on a gateway whose heap has not grown yet: later, memory freed by the load runs
        # would be reused by the streams and the figure per stream would read low
        out["streams"] = await held_streams(gateway, streams, procs.gateway_pid)
        print(f"  streams: {out['streams']}", flush=True)
        if without:
            out["streams_without"] = await held_streams(targets[2][1], streams, pids["without"])
            print(f"  streams without: {out['streams_without']}", flush=True)
    upstream_pid = procs.procs[0].pid
    rounds_out: list[dict] = []
    for round_ in range(rounds):
        rows: dict = {}
        for concurrency in levels:
            row = rows[str(concurrency)] = {}
            # every other round the other order: no target always runs first, on the cooler machine
            for name, url in (targets if round_ % 2 == 0 else targets[::-1]):
                opened = await _upstream_connections(procs.upstream)
                watched = {"upstream": upstream_pid} | ({"gateway": pids[name]} if name in pids else {})
                spy = _profiler(procs.gateway_pid, seconds, profile) if profile and name == "gateway" \
                    and concurrency == levels[-1] and round_ == 0 else None
                row[name] = await closed_loop(url, concurrency, seconds, pids=watched)
                if spy is not None:
                    spy.wait(seconds + 30)
                row[name]["upstream_connections_opened"] = await _upstream_connections(procs.upstream) - opened - 1
                window = row[name]["window_cpu_ms_per_request"]
                if name in pids:
                    row[name]["gateway_cpu_ms_per_request"] = window["gateway"]
                row[name]["upstream_cpu_ms_per_request"] = window["upstream"]
                if name in pids:
                    row[name]["gateway_busy_share"] = row[name]["window_busy_share"]["gateway"]
                print(f"  {name:8} c={concurrency:5} round {round_ + 1}: {row[name]}", flush=True)
        rounds_out.append(rows)
    out["rounds"] = rounds_out
    out["closed_loop"] = {str(level): {name: _median_row([r[str(level)][name] for r in rounds_out])
                                       for name, _ in targets} for level in levels}
    return out


def _median_row(runs: list[dict]) -> dict:
    """One level's figures over its rounds: the medians, the spread of req/s, errors summed."""
    def median(key: str):
        values = [run[key] for run in runs if run.get(key) is not None]
        return statistics.median(values) if values else None

    row = {key: median(key) for key in ("rps", "p50_ms", "p99_ms", "gateway_cpu_ms_per_request", "gateway_busy_share",
                                        "upstream_cpu_ms_per_request", "client_cpu_ms_per_request",
                                        "upstream_connections_opened")}
    ratios = [run["p99_ms"] / run["p50_ms"] for run in runs if run.get("p50_ms")]
    row.update(rounds=len(runs), rps_each=[run["rps"] for run in runs], errors=sum(run["errors"] for run in runs),
               p99_over_p50=round(statistics.median(ratios), 2) if ratios else None)
    return row


def verdicts(result: dict) -> dict:
    loop = result["closed_loop"]
    base = loop.get("16", {}).get("gateway", {}).get("rps")
    out = {}
    for level in ("200", "1000"):
        if level not in loop:
            continue
        g = loop[level]["gateway"]
        holds = (g["errors"] == 0 and g["p99_over_p50"] is not None and g["p99_over_p50"] <= 3
                 and base is not None and g["rps"] >= base)
        out[f"under_load_{level}"] = {"holds": holds, "rps": g["rps"], "rps_at_16": base,
                                      "p99_over_p50": g["p99_over_p50"], "errors": g["errors"],
                                      "rps_each": g["rps_each"], "rps_at_16_each": loop.get("16", {}).get("gateway", {}).get("rps_each")}
    if "streams" in result:
        s = result["streams"]
        out["streams"] = {"holds": s["errors"] == 0 and s["max_in_flight_together"] == s["streams"]
                          and s["gateway_kib_per_stream"] <= 32, "kib_per_stream": s["gateway_kib_per_stream"],
                          "errors": s["errors"], "streams": s["streams"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="16,200,1000", help="client concurrencies, comma-separated")
    parser.add_argument("--streams", type=int, default=5000, help="concurrent held streams (0: none)")
    parser.add_argument("--seconds", type=float, default=8.0, help="each closed-loop run's length")
    parser.add_argument("--rounds", type=int, default=3, help="every level this many times, the levels interleaved")
    parser.add_argument("--out", help="write the results here (default: bench/results/load-<date>.json, full runs only)")
    parser.add_argument("--without", help="also a gateway with this bench/gateway_cpu.py lever put back, beside")
    parser.add_argument("--profile", help="py-spy the gateway at the highest level into this file (.svg: a flame "
                        "graph, .json: speedscope, else collapsed stacks)")
    args = parser.parse_args()
    full = (args.levels, args.streams, args.seconds, args.rounds, args.without) == ("16,200,1000", 5000, 8.0, 3, None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # every stream holds a client, a gateway and an upstream socket; the processes inherit this
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    levels = tuple(int(level) for level in args.levels.split(","))
    result = {"date": dt.date.today().isoformat(), "python": platform.python_version(),
              "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    with Processes(hold_s=40.0) as procs:
        result.update(asyncio.run(run(procs, seconds=args.seconds, levels=levels, streams=args.streams,
                                      rounds=args.rounds, profile=args.profile, without=args.without)))
    result["load_average_after"] = os.getloadavg()
    result["targets"] = verdicts(result)
    print(json.dumps(result["targets"], indent=2))
    if full or args.out:
        out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"load-{result['date']}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
