"""Where the gateway's own tail comes from: each request's time in the server, from its head read
to its last byte written, beside what ran in the process meanwhile (never part of `make test`).

A client's p99 on a shared 2-core machine is mostly the scheduler's: the direct call to the
upstream has a p99 many times its p50 too. This probe separates the two. It starts `relayline
serve` (the default configuration: info logging to a file, the SQLite ledger) with a few hooks
put in from outside, in its own process: the server's connection notes the time a request's head
was read and the time its last byte was written, Python's collector notes each pass (its
generation and duration), and the ledger's commit, the access log's write and the thread CPU of
the process are timed. Each request's span also carries the process's CPU time in it (every task's): a tail request
whose span holds no more CPU than a median one's waited, for the CPU or for the upstream. The
raw asyncio client of bench/load.py then sends one-message requests
at concurrency 1 and 16 through it to the loopback upstream (bench/upstream.py). For each level:
the client's p50/p99, the server's p50/p99, and of the requests above the server's p99, how many
overlapped a collector pass, a slow ledger commit or a slow log write, and how many had none of
them (the scheduler's, or the loop's own).

    python bench/probes/tail_sources.py [--seconds 10] [--levels 1,16] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from common import listening_logged, percentile, raw_connect, raw_post, raw_response  # noqa: E402

# put into the gateway's process before `relayline serve` starts: every hook appends to a list,
# and the lists are written out as JSON when the process exits (SIGINT drains it)
HOOKS = textwrap.dedent("""
    import atexit, gc, json, logging, os, sys, time
    from relayline.adapters.gateway.http11 import connection
    from relayline.adapters.stores import ledger
    clock = time.perf_counter_ns
    requests, passes, commits, emits = [], [], [], []
    original_request, original_write = connection.Connection._request, connection.Connection._write

    last_write = {}  # (the connection has slots: its last write's time is kept here, by id)

    async def _request(self, head):
        start, cpu = clock(), time.process_time_ns()
        last_write[id(self)] = (start, cpu)
        try:
            await original_request(self, head)
        finally:
            written, written_cpu = last_write.pop(id(self), (start, cpu))
            requests.append((start, written, clock(), written_cpu - cpu))

    async def _write(self, data):
        await original_write(self, data)
        last_write[id(self)] = (clock(), time.process_time_ns())

    connection.Connection._request, connection.Connection._write = _request, _write
    started = {}

    def collector(phase, info):
        if phase == "start":
            started["at"] = clock()
        elif "at" in started:
            passes.append((started.pop("at"), clock(), info["generation"]))

    gc.callbacks.append(collector)
    original_insert = ledger.LedgerStore._insert_locked

    def _insert_locked(self, rows):
        start = clock()
        try:
            return original_insert(self, rows)
        finally:
            commits.append((start, clock()))

    ledger.LedgerStore._insert_locked = _insert_locked
    original_emit = logging.StreamHandler.emit

    def emit(self, record):
        start = clock()
        try:
            return original_emit(self, record)
        finally:
            emits.append((start, clock()))

    logging.StreamHandler.emit = emit

    def dump():
        with open(os.environ["TAIL_PROBE_OUT"], "w") as sink:
            json.dump({"requests": requests, "passes": passes, "commits": commits, "emits": emits}, sink)

    atexit.register(dump)
    from relayline.adapters.cli import main
    sys.exit(main(sys.argv[1:]))
""")

SLOW_NS = 200_000  # a commit or a log write above this is named as a cause


async def _level(url: str, concurrency: int, seconds: float) -> list[float]:
    """Closed-loop clients for `seconds`: each request's latency (s), the first second dropped."""
    request = raw_post(url, {"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]})
    connections = await asyncio.gather(*(raw_connect(url) for _ in range(concurrency)))
    start = time.perf_counter()
    out: list[tuple[float, float]] = []

    async def client(reader, writer) -> None:
        while (now := time.perf_counter()) < start + seconds:
            writer.write(request)
            status, _body, _keep = await raw_response(reader)
            if status == 200:
                out.append((now, time.perf_counter() - now))
        writer.close()

    await asyncio.gather(*(client(r, w) for r, w in connections))
    return [latency for sent, latency in out if sent >= start + 1.0]


def _overlaps(span: tuple[int, int], events: list, slow_ns: int = 0) -> list:
    return [e for e in events if e[0] < span[1] and e[1] > span[0] and e[1] - e[0] >= slow_ns]


def analyse(hooks: dict, windows: dict[str, tuple[int, int]], client: dict[str, list[float]]) -> dict:
    out = {}
    for name, (low, high) in windows.items():
        requests = [r for r in hooks["requests"] if low <= r[0] < high]
        served = [(r[1] - r[0]) / 1e6 for r in requests]  # ms: head read -> last byte written
        p50, p99 = percentile(served, 0.5), percentile(served, 0.99)
        tail = [r for r in requests if (r[1] - r[0]) / 1e6 >= p99]
        # the process's CPU over a request's span (every task's, not this request's alone): a
        # span long for want of CPU time in the process was spent waiting, not computing
        busy = [r[3] / max(r[1] - r[0], 1) for r in requests]
        tail_busy = [r[3] / max(r[1] - r[0], 1) for r in tail]
        tail_cpu_ms = [r[3] / 1e6 for r in tail]
        causes = {"collector pass": 0, "collector pass, gen 2": 0, "ledger commit > 0.2 ms": 0,
                  "log write > 0.2 ms": 0, "none of them": 0}
        for r in tail:
            span = (r[0], r[1])
            gc_passes = _overlaps(span, hooks["passes"])
            found = False
            if gc_passes:
                causes["collector pass"] += 1
                causes["collector pass, gen 2"] += any(p[2] == 2 for p in gc_passes)
                found = True
            if _overlaps(span, hooks["commits"], SLOW_NS):
                causes["ledger commit > 0.2 ms"] += 1
                found = True
            if _overlaps(span, hooks["emits"], SLOW_NS):
                causes["log write > 0.2 ms"] += 1
                found = True
            causes["none of them"] += not found
        passes = [p for p in hooks["passes"] if low <= p[0] < high]
        commits = [(c[1] - c[0]) / 1e3 for c in hooks["commits"] if low <= c[0] < high]
        emits = [(e[1] - e[0]) / 1e3 for e in hooks["emits"] if low <= e[0] < high]
        latencies = [x * 1e3 for x in client[name]]
        out[name] = {
            "requests": len(requests),
            "client_p50_ms": percentile(latencies, 0.5), "client_p99_ms": percentile(latencies, 0.99),
            "server_p50_ms": p50, "server_p99_ms": p99, "server_max_ms": max(served),
            "tail_requests": len(tail), "tail_causes": causes,
            "process_cpu_share_of_span_p50_all_tail": [percentile(busy, 0.5), percentile(tail_busy, 0.5)],
            "process_cpu_ms_in_span_p50_all_tail": [percentile([r[3] / 1e6 for r in requests], 0.5),
                                                    percentile(tail_cpu_ms, 0.5)],
            "collector_passes": {g: sum(1 for p in passes if p[2] == g) for g in (0, 1, 2)},
            "collector_pass_us_p50_max": [statistics.median([(p[1] - p[0]) / 1e3 for p in passes] or [0]),
                                          max([(p[1] - p[0]) / 1e3 for p in passes] or [0])],
            "ledger_commit_us_p50_p99_max": [percentile(commits, 0.5), percentile(commits, 0.99), max(commits)],
            "log_write_us_p50_p99_max": [percentile(emits, 0.5), percentile(emits, 0.99), max(emits)],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--out")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    gateway = None
    log = Path(tmp.name) / "gateway.log"
    try:
        upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        config = Path(tmp.name) / "probe.toml"
        config.write_text(f'active = "bench.openai"\n[ledger]\npath = "{tmp.name}/ledger.sqlite3"\n'
                          f'[providers."bench.openai"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                          'api_key = "bench-key"\n')
        log, hooks_out = Path(tmp.name) / "gateway.log", Path(tmp.name) / "hooks.json"
        with log.open("w") as sink:
            gateway = subprocess.Popen(
                [sys.executable, "-c", HOOKS, "serve", "--config", str(config), "--port", "0",
                 "--log-level", "info"], stderr=sink, env={**os.environ, "TAIL_PROBE_OUT": str(hooks_out)})
        url = listening_logged(gateway, log, "the gateway") + "/v1/chat/completions"
        asyncio.run(_level(url, 1, 1.0))  # warm: connections, caches
        windows, client = {}, {}
        loads = []
        for level in (int(x) for x in args.levels.split(",")):
            name = f"concurrency {level}"
            loads.append(os.getloadavg()[0])
            low = time.perf_counter_ns() + 1_000_000_000  # (the hooks' clock is the same monotonic one)
            client[name] = asyncio.run(_level(url, level, args.seconds + 1.0))
            windows[name] = (low, time.perf_counter_ns())
        gateway.send_signal(2)
        gateway.wait(30)
        result = {"load_average": [min(loads), max(loads)],
                  "levels": analyse(json.loads(hooks_out.read_text()), windows, client)}
    except BaseException:
        if log.exists():
            print(log.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        for proc in (gateway, up):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
