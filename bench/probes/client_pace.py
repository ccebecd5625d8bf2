"""The gateway's CPU a small request by the client's pace (never part of `make test`).

bench/peers.py (its httpx client) and bench/agent_history.py (a raw asyncio client) measure the
same one-message request through the same default configuration (info logging to a file, the
SQLite ledger) and put the gateway's CPU a request apart by half. This probe sends that request
through one gateway (`relayline serve`, the loopback upstream of bench/upstream.py) from clients
that differ in one thing each, rounds alternated so that machine noise hits them alike, and reads
the gateway's CPU from /proc (every thread's) around each:

- the raw client, back to back: the next request is written as the answer is read;
- the raw client idle for `--gap` ms between requests (asleep, no CPU of its own), and busy for
  it (spinning: a client of that cost on the same cores), in the same bytes;
- the raw client with httpx's request headers (accept, accept-encoding, connection, user-agent);
- httpx's AsyncClient, as bench/peers.py sends it (its own CPU a request said too).

    python bench/probes/client_pace.py [--requests 400] [--rounds 5] [--gap 1.0] [--out FILE]
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
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from common import back_to_back, listening_logged, raw_post, stop, threads_cpu_s  # noqa: E402

BODY = {"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]}
HTTPX_HEADERS = b"accept: */*\r\naccept-encoding: gzip, deflate\r\nconnection: keep-alive\r\nuser-agent: python-httpx"


async def _raw(url: str, n: int, *, idle_s: float = 0.0, busy_s: float = 0.0, headers: bytes = b"") -> None:
    request = raw_post(url, BODY)
    if headers:
        request = request.replace(b"\r\n\r\n", b"\r\n" + headers + b"\r\n\r\n", 1)

    def pause() -> None:
        if idle_s:
            time.sleep(idle_s)  # (the loop held too: nothing of this process runs meanwhile)
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass

    await back_to_back(url, request, n, pause)


async def _httpx(url: str, n: int) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(n):
            response = await client.post(url, json=BODY)
            response.read()
            if response.status_code != 200:
                raise SystemExit(f"HTTP {response.status_code}: {response.text[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests a client sends a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gap", type=float, default=1.0, help="ms between requests of the paced clients")
    parser.add_argument("--out")
    args = parser.parse_args()
    gap, n = args.gap / 1e3, args.requests
    tmp = tempfile.TemporaryDirectory()
    procs: list[subprocess.Popen] = []
    try:
        up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
        procs.append(up)
        upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        config = Path(tmp.name) / "pace.toml"
        config.write_text(f'active = "bench.openai"\n[ledger]\npath = "{tmp.name}/ledger.sqlite3"\n'
                          f'[providers."bench.openai"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                          'api_key = "bench-key"\n')
        log = Path(tmp.name) / "gateway.log"
        with log.open("w") as sink:
            gateway = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config",
                                        str(config), "--port", "0"], stderr=sink)
        procs.append(gateway)
        url = listening_logged(gateway, log) + "/v1/chat/completions"
        clients = {
            "raw, back to back": lambda: asyncio.run(_raw(url, n)),
            f"raw, idle {args.gap:g} ms between": lambda: asyncio.run(_raw(url, n, idle_s=gap)),
            f"raw, busy {args.gap:g} ms between": lambda: asyncio.run(_raw(url, n, busy_s=gap)),
            "raw, httpx's headers": lambda: asyncio.run(_raw(url, n, headers=HTTPX_HEADERS)),
            "httpx AsyncClient (bench/peers.py)": lambda: asyncio.run(_httpx(url, n)),
        }
        for send in clients.values():  # warm: connections, caches
            send()
        gateway_ms: dict[str, list[float]] = {name: [] for name in clients}
        client_ms: dict[str, list[float]] = {name: [] for name in clients}
        wall_ms: dict[str, list[float]] = {name: [] for name in clients}
        load = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for name, send in clients.items():
                before, own, start = threads_cpu_s(gateway.pid), time.process_time(), time.perf_counter()
                send()
                wall_ms[name].append((time.perf_counter() - start) / n * 1e3)
                client_ms[name].append((time.process_time() - own) / n * 1e3)
                gateway_ms[name].append((threads_cpu_s(gateway.pid) - before) / n * 1e3)
        load.append(os.getloadavg()[0])
    finally:
        stop(procs)
        tmp.cleanup()
    rows = {name: {"gateway_cpu_ms_a_request_median": round(statistics.median(gateway_ms[name]), 3),
                   "gateway_cpu_ms_a_request_min": round(min(gateway_ms[name]), 3),
                   "client_cpu_ms_a_request": round(statistics.median(client_ms[name]), 3),
                   "ms_a_request": round(statistics.median(wall_ms[name]), 3)} for name in clients}
    result = {"load_average": load, "requests": n, "rounds": args.rounds, "clients": rows}
    for name, row in rows.items():
        print(f"{name:38} gateway CPU {row['gateway_cpu_ms_a_request_median']:.3f} ms a request "
              f"(min {row['gateway_cpu_ms_a_request_min']:.3f}), the client's {row['client_cpu_ms_a_request']:.3f} ms, "
              f"{row['ms_a_request']:.3f} ms apart")
    print(f"load average {load[0]:.1f} .. {load[1]:.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
