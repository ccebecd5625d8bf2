"""Where a streamed request's time to its first content line goes in the gateway (`python
bench/first_byte.py`; never part of `make test`).

The gateway runs in this process (its own HTTP/1.1 server, the OpenAI adapter) in front of the
loopback upstream (bench/upstream.py, its own process), and a raw-socket client in this process
asks for 200-frame streams on one keep-alive connection. Each seam of the path is stamped the
first time it is reached: wall time, and this thread's CPU time (the client's few µs included),
so a seam that waited for a core shows as wall time without CPU. The client shares the process:
what follows the first event's write is the client's turn, not the gateway's (bench/frames.py
measures the first byte end to end, from another process).
"""

from __future__ import annotations

import inspect
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

from relayline.adapters import Relay, driver
from relayline.adapters import relay as relay_module
from relayline.adapters.gateway import app, http11
from relayline.adapters.gateway.serving import serve
from relayline.adapters.providers import pool, upstream
from relayline.machines import turn
from relayline.machines.config import structure_config

HERE = Path(__file__).resolve().parent
BODY = json.dumps({"model": "frames-200", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
SEAMS = [  # (class, method, label, stamped after the call returns)
    (http11._Connection, "raw_post", "request head parsed", False),
    (app.Gateway, "_chat", "routed, authorised, admitted", False),
    (relay_module.Relay, "_run_turn", "body read and parsed", False),
    (driver.TurnRun, "raw_post", "planned, turn started, call built", False),
    (pool.ProfilePool, "_take", "upstream connection taken from the pool", True),
    (upstream.Connection, "write", "request rendered", False),
    (driver.AttemptClock, "sent", "request written upstream", False),
    (driver.AttemptClock, "headers", "upstream response head read", False),
    (turn.Turn, "stream_frame", "first frame decoded (SSE, JSON, parse)", False),
    (app._StreamWire, "event", "first event to the wire (then rendered, written)", False),
]
stamps: dict[str, tuple[float, float]] = {}


def _stamped(cls, name: str, label: str, after: bool) -> None:
    original = getattr(cls, name)

    def stamp() -> None:
        if label not in stamps:
            stamps[label] = (time.perf_counter(), time.thread_time())

    if inspect.iscoroutinefunction(original):
        async def wrapper(*args, **kwargs):
            if not after:
                stamp()
            result = await original(*args, **kwargs)
            if after:
                stamp()
            return result
    else:
        def wrapper(*args, **kwargs):
            stamp()
            return original(*args, **kwargs)
    setattr(cls, name, wrapper)


async def trace(port: int, streams: int, warm: int) -> list[dict[str, tuple[float, float]]]:
    relay = Relay(structure_config({"active": "u", "providers": {"u": {
        "family": "openai", "base_url": f"http://127.0.0.1:{port}/v1", "model": "frames-200", "api_key": "bench-key"}}}),
        env={})
    rows = []
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve(app.Gateway(relay), port=0, task_status=task_status))
        client = await trio.open_tcp_stream("127.0.0.1", int(binds[0].rsplit(":", 1)[1]))
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n" % len(BODY)) + BODY
        for i in range(warm + streams):
            stamps.clear()
            start = (time.perf_counter(), time.thread_time())
            await client.send_all(request)
            seen = b""
            first = None
            with trio.fail_after(10):
                while not seen.endswith(b"0\r\n\r\n"):
                    seen += await client.receive_some(65536)
                    if first is None and b'"content":" w' in seen:
                        first = (time.perf_counter(), time.thread_time())
            if i >= warm:
                rows.append({label: (at[0] - start[0], at[1] - start[1]) for label, at in
                             [*stamps.items(), ("the client has the first content line", first)]})
        nursery.cancel_scope.cancel()
    return rows


def main() -> int:
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    for cls, name, label, after in SEAMS:
        _stamped(cls, name, label, after)
    up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(up.stdout.readline().split()[1])
        rows = trio.run(trace, port, streams, 20)
    finally:
        up.terminate()
        up.wait(10)
    print(f"medians of {len(rows)} 200-frame streams; ms from the request's first byte sent")
    print(f"{'seam':<52} {'wall':>8} {'(+)':>8} {'cpu':>8} {'(+)':>8}")
    last = (0.0, 0.0)
    for label in [label for _, _, label, _ in SEAMS] + ["the client has the first content line"]:
        wall = statistics.median(row[label][0] for row in rows) * 1e3
        cpu = statistics.median(row[label][1] for row in rows) * 1e3
        print(f"{label:<52} {wall:>8.3f} {wall - last[0]:>+8.3f} {cpu:>8.3f} {cpu - last[1]:>+8.3f}")
        last = (wall, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
