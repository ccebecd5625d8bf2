"""What more than one bench uses, in one place (a bench script imports this, never another
script's helpers).

The processes a bench starts: a gateway is ready once it logs where it listens, and every
process is stopped at the end, killed if it does not go within ten seconds (a bench never leaves
a server behind). The measurements: CPU seconds of a process, percentiles, and the clients that
drive a gateway, raw HTTP/1.1 over asyncio streams (a client that costs next to nothing per
request) and httpx under trio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import trio


def listening(proc: subprocess.Popen, name: str = "the gateway", timeout_s: float = 30.0) -> str:
    """The base URL `relayline serve` logged it listens on (its stderr, a text pipe)."""
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and "listening on" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
    found = re.search(r"http://[\d.]+:\d+", line)
    if found is None:
        raise RuntimeError(f"{name} did not say where it listens within {timeout_s:.0f} s")
    return found.group(0)


def listening_logged(proc: subprocess.Popen, log: Path, name: str = "the gateway", timeout_s: float = 30.0) -> str:
    """`listening` for a gateway whose stderr goes to the file `log`: a gateway at info level
    writes two lines a request, and a pipe would need a reader in the measuring process (a
    thread there competes with its client for the interpreter)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text() if log.exists() else "")
        if found:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not say where it listens within {timeout_s:.0f} s")


def stop(procs: Iterable[subprocess.Popen]) -> None:
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tree_env(tree: str | None) -> dict:
    """The environment that runs `tree`'s relayline package (None: this tree's): its package is
    linked into a path entry that comes before this tree's editable install. This is how a bench
    measures two checkouts alternated in one run."""
    env = dict(os.environ)
    if tree is not None:
        link = Path(tempfile.mkdtemp(prefix="relayline-tree-"))
        (link / "relayline").symlink_to(Path(tree).resolve())
        env["PYTHONPATH"] = str(link)
    return env


def child_in_tree(script: str, tree: str | None, args: list[str], timeout_s: float = 900) -> dict:
    """`script --child *args` run on `tree`'s package; the JSON of its last line of output."""
    done = subprocess.run([sys.executable, script, "--child", *args], env=tree_env(tree), capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_run_instructions(args: list[str], env: dict, counts: tuple[int, int], label: str) -> float:
    """Instructions per unit of work of `python *args n`, a script that does `n` units: from
    cachegrind's counts of two runs `counts` units apart, so that their start-up cancels out."""
    refs = []
    for n in counts:
        done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                               sys.executable, *args, str(n)], env=env, capture_output=True, text=True, timeout=1800)
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"{label}: {done.stderr[-2000:]}")
        refs.append(int(found.group(1).replace(",", "")))
    return (refs[1] - refs[0]) / (counts[1] - counts[0])


def tree_arguments(parser: argparse.ArgumentParser, pairs: int = 3) -> None:
    """The options of a bench that measures two trees alternated (`alternate`)."""
    parser.add_argument("--base", help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one; the base again: a control)")
    parser.add_argument("--pairs", type=int, default=pairs, help="before/after pairs, alternated")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def alternate(script: str, args: argparse.Namespace, child_args: list[str], timeout_s: float = 900) -> dict:
    """{"before": [...], "after": [...]} (only "after" without --base): one child a side a pair,
    the order turned each pair so neither side always runs on the cooler or warmer machine."""
    sides: dict[str, list[dict]] = {"before": [], "after": []} if args.base else {"after": []}
    for pair in range(args.pairs):
        for side in (list(sides) if pair % 2 == 0 else list(sides)[::-1]):
            tree = args.base if side == "before" else args.after
            sides[side].append(child_in_tree(script, tree, child_args, timeout_s))
    return sides


def gateway_server(upstream: str, tmp: str):
    """The gateway's HTTP/1.1 server as `relayline serve` makes it, in this process, in front of
    the upstream at base URL `upstream` (an openai-family profile; the ledger in `tmp`)."""
    from relayline.adapters.configfile import load_config_file
    from relayline.adapters.gateway import Gateway
    from relayline.adapters.gateway.http11 import Server
    from relayline.adapters.gateway.serving import _error_body
    from relayline.adapters.relay import Relay

    config = Path(tmp) / "bench.toml"
    config.write_text(f'active = "bench.upstream"\n[ledger]\npath = "{tmp}/ledger.sqlite3"\n'
                      f'[providers."bench.upstream"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                      'api_key = "bench-key"\n')
    gateway = Gateway.from_relay_config(Relay(load_config_file(str(config))))
    settings = gateway.settings
    return Server(gateway, keep_alive_s=settings.keep_alive_s, max_header_bytes=settings.max_header_bytes,
                  graceful_s=1, error_body=_error_body)


# -- measurements -------------------------------------------------------------------------------


MESSAGES = [{"role": "user", "content": "hi"}]


REQUEST_TIMEOUT_S = 60.0


def per_call_us(fn, n: int, repeats: int = 5) -> float:
    """Median over `repeats` runs of the mean time per call, in microseconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (10 ms ticks: sum many requests)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_cpu_s(pid: int) -> float:
    """The CPU seconds a process's live threads have run, to the nanosecond (the scheduler's
    own count, /proc/PID/task/*/schedstat): `cpu_s` without its 10 ms ticks, for a few
    requests at a time. A thread that already ended is not counted."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # (ended between the listing and the read)
    return total / 1e9


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- raw HTTP/1.1 over asyncio streams: a client that costs next to nothing per request ----------


def raw_post(url: str, body: dict) -> bytes:
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    return (f"POST {parts.path} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer bench-key\r\ncontent-length: {len(payload)}\r\n\r\n").encode() + payload


async def raw_connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    for attempt in range(20):  # a burst of connects may overflow the backlog: retry, bounded
        try:
            return await asyncio.open_connection(parts.hostname, parts.port, limit=1 << 20)
        except OSError:
            if attempt == 19:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))
    raise AssertionError("unreachable")


async def raw_response(reader: asyncio.StreamReader, watch: bytes = b"", seen=None) -> tuple[int, bytes, bool]:
    """(status, body, connection kept alive) of one HTTP/1.1 response; `seen` is called once
    when `watch` first appears in a chunked body (a stream's first content frame)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    keep = b"connection: close" not in lower
    if b"transfer-encoding: chunked" in lower:
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, bytes(body), keep
            body += chunk[:-2]
            if seen is not None and watch in chunk:
                seen()
                seen = None
    start = lower.find(b"content-length:")
    length = int(lower[start + 15: lower.find(b"\r\n", start)]) if start >= 0 else 0
    return status, await reader.readexactly(length), keep


async def back_to_back(url: str, request: bytes, n: int, between=None) -> None:
    """`request` (raw HTTP/1.1 bytes) sent n times one after another on one keep-alive
    connection, `between()` called after each answer; any answer but a 200 ends the run,
    naming it."""
    reader, writer = await raw_connect(url)
    try:
        for _ in range(n):
            writer.write(request)
            status, answer, _keep = await raw_response(reader)
            if status != 200:
                raise SystemExit(f"{url}: HTTP {status}: {answer[:500]!r}")
            if between is not None:
                between()
    finally:
        writer.close()


async def sequential(url: str, n: int) -> list[float]:
    """n requests one after another on one keep-alive connection: each one's latency."""
    request = raw_post(url, {"model": "frames-1", "messages": MESSAGES})
    reader, writer = await raw_connect(url)
    out = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            writer.write(request)
            status, _body, _keep = await raw_response(reader)
            out.append(time.perf_counter() - start)
            assert status == 200, status
    finally:
        writer.close()
    return out


async def closed_loop(url: str, concurrency: int, seconds: float, model: str = "frames-1",
                      pids: dict[str, int] | None = None) -> dict:
    """`concurrency` clients, each on its own connection, sending requests back to back.

    The first wave arrives as one burst: at c clients and r req/s its latencies spread from 0 to
    c/r however fair the server is. So the steady state is measured apart: once every client has
    had an answer, a window of `seconds` starts; throughput counts the answers inside it and the
    latencies are those of the requests sent inside it. Errors count over the whole run, burst
    included, and the burst's own latencies are reported beside. For each of `pids` (name: pid),
    its CPU per answer inside the window (`window_cpu_ms_per_request`) and its CPU from the first
    connect to the window's start (`burst_cpu_s`: the accepts, a burst's upstream connects)."""
    request = raw_post(url, {"model": model, "messages": MESSAGES})
    pids = pids or {}
    at_first = {name: cpu_s(pid) for name, pid in pids.items()}
    sent: list[tuple[float, float]] = []  # (sent, answered) of every 200
    errors: dict[str, int] = {}
    connections = await asyncio.gather(*(raw_connect(url) for _ in range(concurrency)))
    answered_once = 0
    steady = asyncio.Event()
    window = [math.inf, math.inf]  # the measured window: [start, end)

    async def client(index: int) -> None:
        nonlocal answered_once
        reader, writer = connections[index]
        first = True
        while (now := time.perf_counter()) < window[1]:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    writer.write(request)
                    status, body, keep = await raw_response(reader)
                if status != 200:
                    errors[f"http {status}"] = errors.get(f"http {status}", 0) + 1
                else:
                    sent.append((now, time.perf_counter()))
                if not keep:
                    writer.close()
                    reader, writer = await raw_connect(url)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                writer.close()
                reader, writer = await raw_connect(url)
            if first:
                first = False
                answered_once += 1
                if answered_once == concurrency:
                    steady.set()
        writer.close()

    cpu = own_cpu_s()
    start = time.perf_counter()
    clients = asyncio.gather(*(client(i) for i in range(concurrency)))
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            await steady.wait()
    except TimeoutError:
        pass  # no steady state within the bound: the window starts now, the burst's stragglers in it
    window[:] = [time.perf_counter(), time.perf_counter() + seconds]
    at_start = {name: cpu_s(pid) for name, pid in pids.items()}
    await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
    at_end = {name: cpu_s(pid) for name, pid in pids.items()}
    await clients
    elapsed = time.perf_counter() - start
    burst = [done - at for at, done in sent if at < start + 0.05]
    latencies = [done - at for at, done in sent if at >= window[0]]
    answers = sum(1 for _, done in sent if window[0] <= done < window[1])

    def ms(values: list[float], q: float) -> float | None:
        return round(percentile(values, q) * 1e3, 2) if values else None

    return {
        "concurrency": concurrency, "requests": len(sent), "seconds": round(elapsed, 2),
        "warmup_s": round(window[0] - start, 2), "rps": round(answers / seconds, 1),
        "p50_ms": ms(latencies, 0.5), "p99_ms": ms(latencies, 0.99), "max_ms": ms(latencies, 1.0),
        "burst_p50_ms": ms(burst, 0.5), "burst_p99_ms": ms(burst, 0.99),
        "errors": sum(errors.values()), "error_kinds": errors,
        "client_cpu_ms_per_request": round((own_cpu_s() - cpu) / max(len(sent), 1) * 1e3, 3),
        "window_cpu_ms_per_request": {name: round((at_end[name] - at_start[name]) / max(answers, 1) * 1e3, 3)
                                      for name in pids},
        "burst_cpu_s": {name: round(at_start[name] - at_first[name], 2) for name in pids},
        # the share of one core each process had inside the window: a gateway below 1.0 with no
        # idle wait was held off its core by the machine's other processes
        "window_busy_share": {name: round((at_end[name] - at_start[name]) / seconds, 2) for name in pids},
    }


# -- httpx clients under trio -------------------------------------------------------------------


async def timed_posts(client: httpx.AsyncClient, url: str, n: int, model: str = "frames-1") -> list[float]:
    out = []
    body = {"model": model, "messages": MESSAGES}
    for _ in range(n):
        start = time.perf_counter()
        response = await client.post(url, json=body)
        response.read()
        assert response.status_code == 200, response.text
        out.append(time.perf_counter() - start)
    return out


async def httpx_throughput(client: httpx.AsyncClient, url: str, concurrency: int, total: int,
                      client_cpu: list[float] | None = None) -> float:
    """Requests/s of `concurrency` closed-loop httpx clients; this process's CPU per request (ms)
    is appended to `client_cpu`: the httpx client's own share of the two cores."""
    body = {"model": "frames-1", "messages": MESSAGES}
    per_worker = total // concurrency
    cpu = time.process_time()

    async def worker():
        for _ in range(per_worker):
            response = await client.post(url, json=body)
            assert response.status_code == 200

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    elapsed = time.perf_counter() - start
    if client_cpu is not None:
        client_cpu.append((time.process_time() - cpu) / (per_worker * concurrency) * 1e3)
    return per_worker * concurrency / elapsed


@asynccontextmanager
async def row_client(url: str, concurrency: int, headers: dict | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client of a throughput row's own, its `concurrency` connections to `url` open.
    One client shared by the rows is not the same client for each: httpcore scans every
    connection of its pool on each request, so a row measured after another inherits that row's
    idle connections (at 16 clients through the gateway, measured after the direct row, 1.45 ms
    of the client's CPU a request where a client of its own spends 1.12: the floor rows in
    docs/performance.md)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60, headers=headers) as client:
        await httpx_throughput(client, url, concurrency, 4 * concurrency)
        yield client


async def row_throughput(url: str, concurrency: int, total: int, client_cpu: list[float] | None = None,
                         headers: dict | None = None) -> float:
    """`headers`: sent with every request (a peer gateway told where the upstream is)."""
    async with row_client(url, concurrency, headers) as client:
        return await httpx_throughput(client, url, concurrency, total, client_cpu)


async def stream_timing(client: httpx.AsyncClient, url: str, frames: int) -> tuple[float, float]:
    """(time to first content byte, total time) for one streamed request."""
    start = time.perf_counter()
    first = None
    seen = 0
    async with client.stream("POST", url, json={"model": f"frames-{frames}", "messages": MESSAGES, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if '"content":" w' in line:
                seen += 1
                if first is None:
                    first = time.perf_counter() - start
        if seen != frames:
            raise AssertionError(f"{seen} of {frames} frames; last line {line[:300]!r}")
    return first, time.perf_counter() - start


async def library_stream_timing(relay, frames: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    seen = 0
    async with relay.stream(MESSAGES, model=f"frames-{frames}") as turn:
        async for _event in turn:
            seen += 1
            if first is None:
                first = time.perf_counter() - start
    assert seen == frames and turn.outcome == "ok", (seen, turn.outcome)
    return first, time.perf_counter() - start
