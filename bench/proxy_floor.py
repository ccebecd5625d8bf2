"""The proxy floor: what any Python proxy costs, beside what the gateway costs, in one run.

The throughput target (the gateway at >= 60% of the direct call's requests/s, closed-loop
httpx clients at concurrency 1 and 16, bench/run.py's rows) says nothing about how close a proxy
written in Python can come. This bench measures it: the same httpx clients (peers.py's
`httpx_throughput`), the same upstream process (bench/upstream.py), the targets alternated in each
round:

    direct         the clients straight to the upstream
    trio floor     a zero-logic HTTP/1.1 proxy on trio: the gateway's own server (http11.py) with
                   an ASGI app that reads the body and forwards it through the gateway's own
                   upstream client (providers/pool.py, upstream.py), answering with the upstream's
                   status, content type and body. No routing, no turn, no ledger, no attribution
    asyncio floor  the same zero-logic proxy on asyncio protocols with the same parser (llhttp
                   through httptools) on both sides, one upstream connection per client
                   connection: the language's floor, no framework
    gateway        `relayline serve` with its ledger (SQLite), in front of the same upstream

Each target is its own process; per row: requests/s (median of the rounds), its share of
direct, and CPU per request of the client (this process), the proxy and the upstream (/proc).
The floors' collectors are tuned like the gateway's (serving.py's `tune_collector`), so a
difference is the path, not the collector.

Run: python bench/proxy_floor.py [--rounds 5] [--requests 1600] [--out FILE]
     python bench/proxy_floor.py --shared-client [--rounds 3]  (run.py's throughput rows with one
     httpx client for all rows, as they were measured, beside a client per row, as they are now)
     python bench/proxy_floor.py --instructions [--base DIR [--after DIR]] [--no-floor] [--provider-head]
            [--history N]  (instructions a request under cachegrind: no load moves them)
(the proxies alone: python bench/proxy_floor.py --serve trio|asyncio UPSTREAM_URL)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import cpu_s, gateway_server, httpx_throughput, row_client, row_throughput, stop  # noqa: E402
from peers import Processes  # noqa: E402

TARGETS = ("direct", "trio floor", "asyncio floor", "gateway")
JSON = b"application/json"


def tune_floor_collector() -> None:
    from relayline.adapters.gateway.serving import tune_collector

    tune_collector()


# -- the zero-logic proxy on trio: the gateway's own server and upstream client -----------------------


def _trio_floor_app(upstream: str):
    from relayline.adapters.providers.pool import ProfilePool
    from relayline.adapters.providers.upstream import UpstreamRequest

    url = f"{upstream}/v1/chat/completions"
    pool = ProfilePool()
    headers = {"content-type": "application/json", "authorization": "Bearer bench-key"}

    async def app(scope, receive, send) -> None:
        pieces = []
        while True:
            message = await receive()
            pieces.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        async with pool.exchange(UpstreamRequest(url, headers, b"".join(pieces))) as response:
            body = b"".join([piece async for piece in response])
        await send({"type": "http.response.start", "status": response.status,
                    "headers": [(b"content-type", response.headers.get("content-type", "").encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


def trio_server(kind: str, upstream: str, tmp: str):
    """The server of the trio floor, or of the gateway as `relayline serve` makes it (its ledger in `tmp`)."""
    from relayline.adapters.gateway.http11 import Server

    if kind == "trio":
        return Server(_trio_floor_app(upstream), keep_alive_s=30, max_header_bytes=16384, graceful_s=1)
    return gateway_server(upstream, tmp)


def serve_trio(upstream: str) -> None:
    from relayline.adapters.gateway.http11 import listening_sockets

    async def main() -> None:
        sockets = listening_sockets("127.0.0.1", 0)
        server = trio_server("trio", upstream, "")
        tune_floor_collector()
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, sockets, trio.Event())
            print("ready", sockets[0].getsockname()[1], flush=True)

    trio.run(main)


# -- the same proxy on asyncio: protocols and llhttp, nothing else ---------------------------------


def serve_asyncio(upstream: str) -> None:
    import httptools

    host, port = upstream.split("//")[1].split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            "authorization: Bearer bench-key\r\ncontent-length: ").encode()

    class Upstream(asyncio.Protocol):
        """One upstream connection, one exchange at a time: `answer` is set with (status, type, body)."""

        def connection_made(self, transport) -> None:
            self.transport = transport
            self.parser = httptools.HttpResponseParser(self)
            self.answer: asyncio.Future | None = None

        def on_message_begin(self) -> None:
            self.type = b""
            self.body: list[bytes] = []

        def on_header(self, name: bytes, value: bytes) -> None:
            if name.lower() == b"content-type":
                self.type = value

        def on_body(self, data: bytes) -> None:
            self.body.append(data)

        def on_message_complete(self) -> None:
            self.answer.set_result((self.parser.get_status_code(), self.type, b"".join(self.body)))

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def connection_lost(self, exc) -> None:
            if self.answer is not None and not self.answer.done():
                self.answer.set_exception(ConnectionError("upstream closed"))

        async def exchange(self, body: bytes) -> tuple[int, bytes, bytes]:
            self.answer = asyncio.get_running_loop().create_future()
            self.transport.write(head + b"%d\r\n\r\n" % len(body) + body)
            return await self.answer

    class Client(asyncio.Protocol):
        """One client connection: its requests in order, each forwarded on its own upstream connection."""

        def connection_made(self, transport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.upstream: Upstream | None = None
            self.requests: asyncio.Queue = asyncio.Queue()
            self.task = asyncio.get_running_loop().create_task(self.serve())

        def on_message_begin(self) -> None:
            self.body: list[bytes] = []

        def on_body(self, data: bytes) -> None:
            self.body.append(data)

        def on_message_complete(self) -> None:
            self.requests.put_nowait((b"".join(self.body), self.parser.should_keep_alive()))

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self.task.cancel()
            if self.upstream is not None:
                self.upstream.transport.close()

        async def serve(self) -> None:
            loop = asyncio.get_running_loop()
            while True:
                body, keep_alive = await self.requests.get()
                if self.upstream is None or self.upstream.transport.is_closing():
                    self.upstream = (await loop.create_connection(Upstream, host, int(port)))[1]
                status, kind, answer = await self.upstream.exchange(body)
                self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                                     % (status, kind, len(answer), answer))
                if not keep_alive:
                    self.transport.close()
                    return

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", 0, backlog=2048)
        tune_floor_collector()
        print("ready", server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    asyncio.run(main())


# -- the run ----------------------------------------------------------------------------------------


def _start_floor(kind: str, upstream: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, upstream], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        stop([proc])
        raise RuntimeError(f"the {kind} floor did not start")
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def run(rounds: int, requests: int, levels: tuple[int, ...] = (1, 16)) -> dict:
    with Processes() as procs:
        floors = {kind: _start_floor(kind, procs.upstream) for kind in ("trio", "asyncio")}
        procs.procs += [proc for proc, _ in floors.values()]
        urls = {"direct": procs.upstream, "trio floor": floors["trio"][1], "asyncio floor": floors["asyncio"][1],
                "gateway": procs.gateway}
        pids = {"direct": None, "trio floor": floors["trio"][0].pid, "asyncio floor": floors["asyncio"][0].pid,
                "gateway": procs.gateway_pid}
        upstream_pid = procs.procs[0].pid
        rps: dict = {t: {c: [] for c in levels} for t in TARGETS}
        cpu: dict = {t: {c: {"client": [], "proxy": [], "upstream": []} for c in levels} for t in TARGETS}
        loads = []

        async def measure(target: str, c: int) -> None:
            # a client of its own for each row (peers.row_client says why)
            url = f"{urls[target]}/v1/chat/completions"
            async with row_client(url, c) as client:
                pid = pids[target]
                proxy_before = cpu_s(pid) if pid else 0.0
                upstream_before = cpu_s(upstream_pid)
                client_cpu: list[float] = []
                total = requests if c > 1 else requests // 4
                rps[target][c].append(await httpx_throughput(client, url, c, total, client_cpu))
                done = total // c * c
                row = cpu[target][c]
                row["client"].append(client_cpu[0])
                row["proxy"].append((cpu_s(pid) - proxy_before) / done * 1e3 if pid else 0.0)
                row["upstream"].append((cpu_s(upstream_pid) - upstream_before) / done * 1e3)

        async def main() -> None:
            for target in TARGETS:  # warm: imports, caches, the ledger's pages
                await measure(target, 16)
            for target in TARGETS:
                rps[target][16].clear()
                for values in cpu[target][16].values():
                    values.clear()
            for round_ in range(rounds):
                loads.append(os.getloadavg()[0])
                for target in (TARGETS if round_ % 2 == 0 else TARGETS[::-1]):
                    for c in levels:
                        await measure(target, c)

        trio.run(main)
    out: dict = {"load_average": [min(loads), max(loads)], "rounds": rounds, "requests": requests, "rows": {}}
    for target in TARGETS:
        for c in levels:
            share = [a / b for a, b in zip(rps[target][c], rps["direct"][c], strict=True)]
            out["rows"].setdefault(str(c), {})[target] = {
                "rps": statistics.median(rps[target][c]),
                "share_of_direct": statistics.median(share),
                "cpu_ms_per_request": {who: statistics.median(v) for who, v in cpu[target][c].items()},
            }
    return out


def shared_client(rounds: int) -> dict:
    """run.py's throughput rows measured both ways in one run: one httpx client for every row
    (c1 rows first, as run.py measured them before peers.row_client) and a client per row."""
    body = {"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]}
    out: dict = {}
    with Processes() as procs:
        urls = {"direct": f"{procs.upstream}/v1/chat/completions", "gateway": f"{procs.gateway}/v1/chat/completions"}

        def note(how: str, c: int, name: str, rps: float, cpu: list[float]) -> None:
            out.setdefault(how, {}).setdefault(str(c), {}).setdefault(name, []).append(
                {"rps": rps, "client_cpu_ms": cpu[0]})

        async def main() -> None:
            for _ in range(rounds):
                limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
                async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                    for url in urls.values():
                        for _ in range(50):
                            await client.post(url, json=body)
                    for c in (1, 16):
                        for name, url in urls.items():
                            cpu: list[float] = []
                            note("one client for all rows", c, name,
                                 await httpx_throughput(client, url, c, 300 if c == 1 else 512, cpu), cpu)
                for c in (1, 16):
                    for name, url in urls.items():
                        cpu = []
                        note("a client per row", c, name, await row_throughput(url, c, 300 if c == 1 else 512, cpu), cpu)

        trio.run(main)
    for rows in out.values():
        for by_name in rows.values():
            for name, runs in by_name.items():
                by_name[name] = {key: statistics.median(r[key] for r in runs) for key in ("rps", "client_cpu_ms")}
            by_name["share_of_direct"] = by_name["gateway"]["rps"] / by_name["direct"]["rps"]
    out["load_average"] = os.getloadavg()[0]
    return out


# -- instructions per request (valgrind's cachegrind): figures no load moves -------------------------

CLIENT = """
import json, socket, sys
port, model, history, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
turns = [{"role": ("user", "assistant")[i % 2], "content": "a turn of the conversation so far, number %d, "
          "with about as much text in it as a short chat message has, give or take a few words" % i}
         for i in range(history)]
body = json.dumps({"model": model, "messages": [*turns, {"role": "user", "content": "hi"}]}).encode()
request = (b"POST /v1/chat/completions HTTP/1.1\\r\\nhost: bench\\r\\ncontent-type: application/json\\r\\n"
           b"authorization: Bearer bench-key\\r\\ncontent-length: %d\\r\\n\\r\\n%s" % (len(body), body))
sock = socket.create_connection(("127.0.0.1", port), timeout=60)
for _ in range(n):
    sock.sendall(request)
    data = b""
    while b"\\r\\n\\r\\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\\r\\n\\r\\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(next(line.split(b":")[1] for line in head.lower().split(b"\\r\\n") if line.startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
"""


def serve_counted(kind: str, upstream: str, model: str, history: int, n: int) -> None:
    """Serve `n` requests of a client process (one after another), then return: run under
    cachegrind, the process's instructions; two `n` apart, their difference is per request."""
    import tempfile

    from relayline.adapters.gateway.http11 import listening_sockets

    async def main(tmp: str) -> None:
        server = trio_server(kind, upstream, tmp)
        tune_floor_collector()
        sockets = listening_sockets("127.0.0.1", 0)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, sockets, trio.Event())
            await trio.run_process([sys.executable, "-c", CLIENT, str(sockets[0].getsockname()[1]), model,
                                    str(history), str(n)])
            nursery.cancel_scope.cancel()

    with tempfile.TemporaryDirectory() as tmp:
        trio.run(main, tmp)


def instructions(trees: dict[str, str | None], counts: tuple[int, int] = (20, 220), floor: bool = True,
                 model: str = "frames-1", history: int = 0) -> dict:
    """Instructions per request of the trio floor and of the gateway (each tree in `trees`),
    from cachegrind's count of two runs `counts` requests apart (their start-up cancels out).
    `model` "headed-1": the upstream answers under a real provider's head (bench/upstream.py);
    `history`: the request carries that many earlier turns (about 160 bytes each) before its own."""
    from common import per_run_instructions, tree_env

    out: dict = {}
    with Processes() as procs:
        runs = [("trio floor", "trio", None)] if floor else []
        runs += [(f"gateway {name}", "gateway", tree) for name, tree in trees.items()]
        for label, kind, tree in runs:
            out[label] = per_run_instructions([__file__, "--count", kind, procs.upstream, model, str(history)],
                                              tree_env(tree), counts, label)
            print(f"  {label:<24} {out[label]:12,.0f} instructions a request", flush=True)
    return out


def report(out: dict) -> None:
    low, high = out["load_average"]
    print(f"the proxy floor: httpx closed-loop clients, medians of {out['rounds']} alternated rounds "
          f"(load average {low:.1f}-{high:.1f})")
    print(f"  {'concurrency':<12} {'target':<14} {'req/s':>7} {'share':>7}   CPU ms a request: "
          f"{'client':>7} {'proxy':>7} {'upstream':>8}")
    for c, rows in out["rows"].items():
        for target, row in rows.items():
            cpu = row["cpu_ms_per_request"]
            print(f"  {c:<12} {target:<14} {row['rps']:7.0f} {row['share_of_direct'] * 100:6.1f}%   "
                  f"{'':18}{cpu['client']:7.3f} {cpu['proxy']:7.3f} {cpu['upstream']:8.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1600, help="per row per round at concurrency 16 (a quarter at 1)")
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--shared-client", action="store_true",
                        help="compare run.py's rows with one httpx client for all rows and with one per row")
    parser.add_argument("--instructions", action="store_true",
                        help="instructions per request (cachegrind) of the trio floor and the gateway")
    parser.add_argument("--base", help="with --instructions: the gateway of this tree's package too (a lever's before)")
    parser.add_argument("--after", help="with --base: the tree after the lever (default: this one)")
    parser.add_argument("--no-floor", action="store_true", help="with --instructions: the gateway's trees alone")
    parser.add_argument("--provider-head", action="store_true",
                        help="with --instructions: the upstream answers under OpenAI's 23-field head, not two fields")
    parser.add_argument("--history", type=int, default=0,
                        help="with --instructions: earlier turns in each request's body (about 160 bytes each)")
    parser.add_argument("--count", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "UPSTREAM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, upstream = args.serve
        (serve_trio if kind == "trio" else serve_asyncio)(upstream)
        return 0
    if args.count:
        kind, upstream, model, history, n = args.count
        serve_counted(kind, upstream, model, int(history), int(n))
        return 0
    if args.instructions:
        trees = {"before (--base)": args.base, "after": args.after} if args.base else {"(this tree)": None}
        out = instructions(trees, floor=not args.no_floor, model="headed-1" if args.provider_head else "frames-1",
                           history=args.history)
    elif args.shared_client:
        out = shared_client(args.rounds)
        for how, rows in out.items():
            if how == "load_average":
                continue
            for c, row in rows.items():
                print(f"{how:<24} c{c:<3} direct {row['direct']['rps']:6.0f} req/s, gateway {row['gateway']['rps']:6.0f} "
                      f"({row['share_of_direct'] * 100:.1f}%); client CPU ms a request: direct "
                      f"{row['direct']['client_cpu_ms']:.3f}, gateway {row['gateway']['client_cpu_ms']:.3f}")
        print(f"load average {out['load_average']:.1f}")
    else:
        out = run(args.rounds, args.requests)
        report(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
