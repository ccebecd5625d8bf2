"""The HTTP server floor: one trivial ASGI app (a 200 with a small JSON body) served by
hypercorn's trio worker and by the gateway's own server (adapters/gateway/http11.py), each in
its own process, beside the raw asyncio upstream (bench/upstream.py) as the machine's floor.
Requests at concurrency 1 from one httpx client, interleaved rounds; p50/p99 and CPU per request
of the serving process. hypercorn comes with the bench extra; without it its row is skipped.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio
from common import stop

HERE = Path(__file__).resolve().parent

APP = r"""
import sys, trio
async def app(scope, receive, send):
    if scope["type"] != "http":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"ok":true}'})

async def main(kind):
    if kind == "hypercorn":
        from hypercorn.config import Config
        from hypercorn.trio import serve
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(lambda task_status: serve(app, config, task_status=task_status))
            print("ready", binds[0].rsplit(":", 1)[1], flush=True)
    else:
        from relayline.adapters.gateway.http11 import Server, listening_sockets
        sockets = listening_sockets("127.0.0.1", 0)
        server = Server(app, keep_alive_s=5, max_header_bytes=16384, graceful_s=1)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, sockets, trio.Event())
            print("ready", sockets[0].getsockname()[1], flush=True)

trio.run(main, sys.argv[1])
"""


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(rounds: int = 3, n: int = 300) -> dict:
    kinds = ["asyncio upstream", "relayline http11"]
    if importlib.util.find_spec("hypercorn") is not None:
        kinds.append("hypercorn trio")
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        for kind in kinds:
            if kind == "asyncio upstream":
                command = [sys.executable, str(HERE / "upstream.py"), "0"]
            else:
                command = [sys.executable, "-c", APP, kind.split()[0] if kind.startswith("hyper") else "http11"]
            procs[kind] = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
            urls[kind] = f"http://127.0.0.1:{procs[kind].stdout.readline().split()[1]}/v1/chat/completions"
        samples: dict[str, list[float]] = {kind: [] for kind in kinds}
        cpu: dict[str, float] = dict.fromkeys(kinds, 0.0)

        async def main() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                body = {"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]}
                for kind in kinds:
                    for _ in range(50):
                        (await client.post(urls[kind], json=body)).read()
                for _ in range(rounds):
                    for kind in kinds:
                        before = cpu_s(procs[kind].pid)
                        for _ in range(n):
                            start = time.perf_counter()
                            response = await client.post(urls[kind], json=body)
                            response.read()
                            samples[kind].append(time.perf_counter() - start)
                        cpu[kind] += cpu_s(procs[kind].pid) - before

        trio.run(main)
    finally:
        stop(procs.values())
    out = {}
    for kind in kinds:
        values = sorted(samples[kind])
        out[kind] = {"p50_ms": statistics.median(values) * 1e3, "p99_ms": values[int(0.99 * len(values))] * 1e3,
                     "server_cpu_ms_per_request": cpu[kind] / len(values) * 1e3}
    out["load_average"] = os.getloadavg()[0]
    return out


def report(floor: dict) -> None:
    print(f"\nHTTP server floor: a trivial ASGI app, concurrency 1 (load average {floor['load_average']:.1f})")
    for kind, row in floor.items():
        if kind != "load_average":
            print(f"  {kind:<18} p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms  "
                  f"server CPU {row['server_cpu_ms_per_request']:.3f} ms/request")


if __name__ == "__main__":
    report(run())
