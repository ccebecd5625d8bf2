"""The gateway's own CPU per non-streamed request, apart from the upstream call, each issue-17
lever measured alone (`make bench` runs it from bench/run.py; never part of `make test`).

The gateway serves the sim family (an in-process upstream: no HTTP call), so what is measured is
the gateway's own path: the request read and parse, the plan and the turn, the answer rendered
and written, the ledger row, metrics and the access bookkeeping. One gateway process runs the
code as it is; beside it, one more per lever, with that lever switched back to its former code
by a launcher before it serves (LEVERS below). Rounds interleave the processes so that machine
noise hits them alike. Per process: CPU per request (from /proc, summed over many requests),
p50/p99 at concurrency 1, and requests/s and CPU per request at concurrency 16. The client is
raw asyncio (bench/load.py's), so it is not what is measured.

Run: python bench/gateway_cpu.py [--quick]
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import closed_loop, cpu_s, listening, percentile, sequential, stop  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]


# -- the levers: each function puts one lever back to its former code (in the launched process) --


def _ledger_checkpoint_in_the_loop() -> None:
    from relayline.adapters.stores import ledger

    init = ledger.LedgerStore.__init__

    def former(self, path) -> None:
        init(self, path)
        self._conn.execute("PRAGMA wal_autocheckpoint=1000")  # SQLite's default: the write that crosses it
        self._checkpoint_every = 0

    ledger.LedgerStore.__init__ = former


def _ledger_id_autoincrement() -> None:
    from relayline.adapters.stores import ledger

    ledger.SCHEMA = ledger.SCHEMA.replace("PRIMARY KEY,", "PRIMARY KEY AUTOINCREMENT,")
    ledger.LedgerStore._rebuild = lambda self: None  # the former schema is kept, not migrated


def _collector_untuned() -> None:
    from relayline.adapters.gateway import serving

    serving.tune_collector = lambda: None  # Python's thresholds (700, 10, 10), nothing frozen


def _young_threshold_fixed() -> None:
    from relayline.adapters.gateway import serving

    serving.follow_connections = lambda count: None  # the young threshold stays 50,000 at any count


def _connect_resolved() -> None:
    from relayline.adapters.providers import upstream

    upstream.address_family = lambda host: None  # every host through trio.open_tcp_stream


def _two_response_heads() -> None:
    import h11

    from relayline.adapters.gateway.http11.connection import Connection

    send = Connection._send

    async def former(self, message: dict) -> None:
        if message["type"] == "http.response.start":  # the head it built at once, then again with its length
            h11.Response(status_code=message["status"], headers=list(message.get("headers") or ()), reason=b"OK")
        await send(self, message)

    Connection._send = former


def _uuid_ids() -> None:
    import uuid

    from relayline.adapters.codecs import dialects
    from relayline.adapters.gateway import app

    given = app.request_id

    def request_id(headers):
        return given(headers) if b"x-request-id" in headers else uuid.uuid4().hex

    app.request_id = request_id
    dialects.OpenAIDialect.new_id = staticmethod(lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")


def _hang_up_task_per_turn() -> None:
    from relayline.adapters.gateway.http11.hangups import Hangups

    Hangups.AVAILABLE = False  # no extension: the gateway's task per turn waits in receive()


def _a_commit_per_turn() -> None:
    from relayline.adapters.stores import ledger

    async def former(self, turn_id, result, *, client: str = "") -> int:
        return self.write(turn_id, result, client=client)

    ledger.LedgerStore.record = former


def _all_of_them() -> None:
    for lever in LEVERS.values():
        if lever is not _all_of_them:
            lever()


LEVERS = {
    "nothing (a control: the same code)": lambda: None,
    "hang-ups told by the server": _hang_up_task_per_turn,
    "ledger checkpoint in a thread": _ledger_checkpoint_in_the_loop,
    "ledger id without AUTOINCREMENT": _ledger_id_autoincrement,
    "the collector tuned (startup frozen, rarer passes)": _collector_untuned,
    "the young threshold follows the connections": _young_threshold_fixed,
    "an IP literal connected directly": _connect_resolved,
    "one response head per answer": _two_response_heads,
    "ids from os.urandom": _uuid_ids,
    "turns finishing together share a commit": _a_commit_per_turn,
    "all of them": _all_of_them,
}

LAUNCH = r"""
import sys
sys.path.insert(0, sys.argv[1])
import gateway_cpu
if sys.argv[2] != "-":
    gateway_cpu.LEVERS[sys.argv[2]]()
from relayline.adapters.cli import main
sys.exit(main(sys.argv[3:]))
"""


def start_with_lever(lever: str, config: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(HERE), lever, "serve", "--config", str(config),
                             "--port", "0", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    return proc, listening(proc, f"the gateway ({lever})") + "/v1/chat/completions"


def run(rounds: int = 20, n: int = 250, c16_rounds: int = 3, seconds: float = 1.5) -> dict:
    """Interleaved rounds; per variant the median over rounds of its CPU per request, and of its
    ratio to the code as it is in the same round (the figure that survives a loaded machine)."""
    variants = ["-", *LEVERS]
    tmp = tempfile.TemporaryDirectory()
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    latency: dict[str, list[float]] = {v: [] for v in variants}
    cpu1: dict[str, list[float]] = {v: [] for v in variants}  # ms per request, per round
    c16: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for i, variant in enumerate(variants):
            config = Path(tmp.name) / f"g{i}.toml"
            config.write_text(f'active = "sim"\n[ledger]\npath = "{tmp.name}/g{i}.sqlite3"\n'
                              '[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n')
            procs[variant], urls[variant] = start_with_lever(variant, config)

        async def main() -> None:
            for variant in variants:
                await sequential(urls[variant], 300)  # warm: imports, caches, the ledger's pages
            for round_ in range(rounds):
                # each round in another order: no variant always follows the same one
                for variant in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
                    before = cpu_s(procs[variant].pid)
                    latency[variant] += await sequential(urls[variant], n)
                    cpu1[variant].append((cpu_s(procs[variant].pid) - before) / n * 1e3)
            for _ in range(c16_rounds):
                for variant in variants:
                    before = cpu_s(procs[variant].pid)
                    row = await closed_loop(urls[variant], 16, seconds)
                    row["gateway_cpu_ms_per_request"] = (cpu_s(procs[variant].pid) - before) / row["requests"] * 1e3
                    c16[variant].append(row)

        asyncio.run(main())
    finally:
        stop(procs.values())
        tmp.cleanup()
    out: dict = {"load_average": os.getloadavg()[0], "requests_c1": rounds * n, "variants": {}}
    for variant in variants:
        values = latency[variant]
        out["variants"]["as is" if variant == "-" else f"without {variant}"] = {
            "p50_ms": statistics.median(values) * 1e3, "p99_ms": percentile(values, 0.99) * 1e3,
            "max_ms": max(values) * 1e3,
            "cpu_ms_per_request_c1": statistics.median(cpu1[variant]),
            "cpu_over_as_is_c1": statistics.median(a / b for a, b in zip(cpu1[variant], cpu1["-"], strict=True)),
            "rps_c16": statistics.median(r["rps"] for r in c16[variant]),
            "cpu_ms_per_request_c16": statistics.median(r["gateway_cpu_ms_per_request"] for r in c16[variant]),
            "errors_c16": sum(r["errors"] for r in c16[variant]),
        }
    return out


def micro(rounds: int = 6, n: int = 2000) -> dict:
    """The same levers in process, where a few µs are not lost in the noise of three processes
    on two cores: each with and without, interleaved, in this process."""
    import uuid

    import h11

    from relayline.adapters.stores import ledger
    from relayline.machines.ledger import LedgerRow
    from relayline.machines.turn import TurnResult

    row = LedgerRow(provider="sim", model="frames-1", mode="complete", outcome="ok", accepted=True, input_tokens=10,
                    output_tokens=3, cost_usd=0.0001)
    result = TurnResult(outcome="ok", error=None, message=None, requested="sim", served=None, text="hi",
                        reasoning="", tool_calls=(), partial_text=None, notice=None, fallback=False, attempts=(),
                        skipped=(), ledger=(row,))
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {"a thread": ledger.LedgerStore(f"{tmp}/thread.sqlite3"),
                  "the loop": ledger.LedgerStore(f"{tmp}/loop.sqlite3")}
        stores["the loop"]._conn.execute("PRAGMA wal_autocheckpoint=1000")
        stores["the loop"]._checkpoint_every = 0
        with sqlite3.connect(f"{tmp}/autoincrement.sqlite3") as former:  # the schema before the rowid id
            former.executescript(ledger.SCHEMA.replace("PRIMARY KEY,", "PRIMARY KEY AUTOINCREMENT,"))
        former.close()
        rebuild, ledger.LedgerStore._rebuild = ledger.LedgerStore._rebuild, lambda self: None
        try:
            stores["a thread, id with AUTOINCREMENT"] = ledger.LedgerStore(f"{tmp}/autoincrement.sqlite3")
        finally:
            ledger.LedgerStore._rebuild = rebuild
        walls: dict[str, list[float]] = {k: [] for k in stores}
        cpus: dict[str, list[float]] = {k: [] for k in stores}
        for _ in range(rounds):
            for kind, store in stores.items():
                cpu = time.process_time()
                for _ in range(n):
                    start = time.perf_counter()
                    store.write("chatcmpl-0123456789abcdef01234567", result)
                    walls[kind].append(time.perf_counter() - start)
                cpus[kind].append((time.process_time() - cpu) / n * 1e6)
        for kind, store in stores.items():
            store.close()
            out[f"ledger write, checkpoint in {kind}"] = {
                "cpu_us": statistics.median(cpus[kind]), "wall_p50_us": percentile(walls[kind], 0.5) * 1e6,
                "wall_p999_us": percentile(walls[kind], 0.999) * 1e6, "wall_max_us": max(walls[kind]) * 1e6}

    headers = [(b"content-type", b"application/json"), (b"x-relayline-requested", b"sim"),
               (b"x-relayline-served", b"sim/frames-1"), (b"x-relayline-attempts", b"1"),
               (b"x-relayline-fallback", b"false"), (b"x-relayline-cost-usd", b"0.00000000"),
               (b"x-request-id", b"0123456789abcdef0123456789abcdef")]
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: 2\r\n\r\n{}")
    body = b"x" * 400

    def answer(heads: int) -> None:
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(request)
        conn.next_event(), conn.next_event()
        head = [*headers, (b"date", b"Mon, 30 Nov 2026 10:00:00 GMT")]
        if heads == 2:
            h11.Response(status_code=200, headers=head, reason=b"OK")
        conn.send(h11.Response(status_code=200, headers=[*head, (b"content-length", b"400")], reason=b"OK"))
        conn.send(h11.Data(data=body))
        conn.send(h11.EndOfMessage())

    def per_call_us(fn) -> float:
        samples = []
        for _ in range(rounds):
            start = time.process_time()
            for _ in range(n):
                fn()
            samples.append((time.process_time() - start) / n * 1e6)
        return statistics.median(samples)

    out.update(_hang_up_watch(rounds, n))
    out["h11 request and answer, one response head"] = {"cpu_us": per_call_us(lambda: answer(1))}
    out["h11 request and answer, two response heads"] = {"cpu_us": per_call_us(lambda: answer(2))}
    out["two ids (request, turn) from os.urandom"] = {
        "cpu_us": per_call_us(lambda: (os.urandom(16).hex(), f"chatcmpl-{os.urandom(12).hex()}"))}
    out["two ids from uuid4"] = {"cpu_us": per_call_us(lambda: (uuid.uuid4().hex, f"chatcmpl-{uuid.uuid4().hex[:24]}"))}
    return out


def _hang_up_watch(rounds: int, n: int) -> dict:
    """A turn's watch for its client hanging up, on a real socket: a task blocked in a read,
    cancelled at the turn's end, against the server's epoll set (http11/hangups.py)."""
    import trio

    from relayline.adapters.gateway.http11.hangups import Hangups

    out: dict = {}

    async def main() -> None:
        sock, _peer = trio.socket.socketpair()
        stream = trio.SocketStream(sock)
        hangups = Hangups()

        async def watcher() -> None:
            await stream.receive_some(65536)

        async def task_per_turn() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watcher)
                await trio.lowlevel.checkpoint()  # (the turn: at least one)
                nursery.cancel_scope.cancel()

        async def server_set() -> None:
            with trio.CancelScope() as scope:
                hangups.watch(sock.fileno(), scope, scope.cancel)
                await trio.lowlevel.checkpoint()
                hangups.unwatch(sock.fileno(), scope)

        for name, fn in (("a task per turn waiting in receive()", task_per_turn),
                         ("the server's epoll set (relayline.hangup)", server_set)):
            samples = []
            for _ in range(rounds):
                start = time.process_time()
                for _ in range(n):
                    await fn()
                samples.append((time.process_time() - start) / n * 1e6)
            out[f"hang-up watch: {name}"] = {"cpu_us": statistics.median(samples)}
        hangups.epoll.close()

    trio.run(main)
    return out


def report_micro(result: dict) -> None:
    print("\nthe same levers in process (median µs of CPU; a ledger write's wall time in the loop too)")
    for name, row in result.items():
        extra = "".join(f"  {k.replace('_us', '')} {v:,.0f} µs" for k, v in row.items() if k != "cpu_us")
        print(f"  {name:<58} {row['cpu_us']:7.1f} µs{extra}")


def report(result: dict) -> None:
    print(f"\nthe gateway's own path (in-process upstream), each lever off in turn "
          f"(load average {result['load_average']:.1f}, {result['requests_c1']} requests at c1 each)")
    print(f"  {'variant':<40} {'p50':>8} {'p99':>8} {'max':>8} {'CPU/req c1':>11} {'x as is':>8} {'req/s c16':>10} "
          f"{'CPU/req c16':>12}")
    for name, row in result["variants"].items():
        print(f"  {name:<40} {row['p50_ms']:>6.3f}ms {row['p99_ms']:>6.3f}ms {row['max_ms']:>6.1f}ms "
              f"{row['cpu_ms_per_request_c1']:>9.3f}ms {row['cpu_over_as_is_c1']:>8.3f} {row['rps_c16']:>10.0f} "
              f"{row['cpu_ms_per_request_c16']:>10.3f}ms")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    report_micro(micro())
    report(run(rounds=4 if quick else 20, n=200 if quick else 250, c16_rounds=1 if quick else 3))
