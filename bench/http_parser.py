"""The HTTP/1.1 parser lever: llhttp (httptools) in place of h11, before and after in
one run (`python bench/http_parser.py --base DIR`; never part of `make test`).

The parser has no switch: the before is a checkout of the code before the lever (`--base`, its
package directory, e.g. a `git worktree add --detach` of the commit before), loaded by the same
path trick as bench/frames.py. In one run, alternated: for each tree, a gateway serving the sim
family (an in-process upstream: the server side alone) and a gateway in front of the raw asyncio
upstream (bench/upstream.py, its own process: both sides), and a child that runs the upstream
client alone against that upstream. Figures per tree: the gateways' CPU per request at
concurrency 1 (from /proc, summed over many requests) and their added p50/p99 over the direct
call of the same round, requests/s and CPU per request at 16 clients (bench/load.py's raw
asyncio client, so the client is not what is measured), and the client's own CPU per exchange.

    python bench/http_parser.py --base /tmp/base-tree [--rounds 12] [--n 200] [--out FILE]
    python bench/http_parser.py --micro   # in process: h11 as the code before used it, beside llhttp
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    closed_loop,
    cpu_s,
    listening,
    percentile,
    sequential,  # noqa: E402
    stop,
    tree_env,
)

SIDES = ("before", "after")


def _gateway(tree: str | None, config: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config),
                             "--port", "0", "--log-level", "warning"], stderr=subprocess.PIPE, text=True,
                            env=tree_env(tree))
    return proc, listening(proc, "a gateway") + "/v1/chat/completions"


def client_child(upstream: str, n: int) -> dict:
    """The upstream client alone: n exchanges one after another, CPU per exchange."""
    import trio

    from relayline.adapters.providers import upstream as module
    from relayline.adapters.providers.pool import ProfilePool
    from relayline.adapters.providers.upstream import UpstreamRequest

    body = json.dumps({"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = UpstreamRequest(f"{upstream}/v1/chat/completions",
                              {"content-type": "application/json", "authorization": "Bearer bench"}, body)

    async def main() -> float:
        pool = ProfilePool()
        for _ in range(100):  # warm: the connection, caches
            async with pool.exchange(request) as response:
                async for _ in response:
                    pass
        start = time.process_time()
        for _ in range(n):
            async with pool.exchange(request) as response:
                async for _ in response:
                    pass
        spent = time.process_time() - start
        await pool.aclose()
        return spent

    return {"client_cpu_us": trio.run(main) / n * 1e6, "module": module.__file__}


def _client(tree: str | None, upstream: str, n: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", upstream, "--n", str(n)], env=tree_env(tree),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"client child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(trees: dict[str, str | None], rounds: int, n: int, seconds: float) -> dict:
    tmp = tempfile.TemporaryDirectory()
    up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0", "5"], stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen] = [up]
    upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
    variants = [(side, kind) for side in SIDES for kind in ("sim", "http")]
    gateways: dict = {}
    samples: dict = {v: {"latency": [], "cpu1": [], "c16": []} for v in variants}
    direct: list[float] = []
    clients: dict = {side: [] for side in SIDES}
    try:
        for i, (side, kind) in enumerate(variants):
            config = Path(tmp.name) / f"g{i}.toml"
            provider = ('[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n' if kind == "sim" else
                        f'[providers.up]\nfamily = "openai"\nbase_url = "{upstream}/v1"\napi_key = "bench-key"\n')
            config.write_text(f'active = "{"sim" if kind == "sim" else "up"}"\n[ledger]\n'
                              f'path = "{tmp.name}/g{i}.sqlite3"\n{provider}')
            proc, url = _gateway(trees[side], config)
            procs.append(proc)
            gateways[(side, kind)] = (proc, url)

        async def main() -> None:
            for _, url in gateways.values():
                await sequential(url, 300)  # warm: imports, caches, the ledger's pages
            await sequential(f"{upstream}/v1/chat/completions", 300)
            for round_ in range(rounds):
                order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
                direct.extend(await sequential(f"{upstream}/v1/chat/completions", n))
                for variant in order:
                    proc, url = gateways[variant]
                    before = cpu_s(proc.pid)
                    samples[variant]["latency"] += await sequential(url, n)
                    samples[variant]["cpu1"].append((cpu_s(proc.pid) - before) / n * 1e3)
            for _ in range(3):
                for variant in variants:
                    proc, url = gateways[variant]
                    before = cpu_s(proc.pid)
                    row = await closed_loop(url, 16, seconds)
                    row["cpu_ms"] = (cpu_s(proc.pid) - before) / max(row["requests"], 1) * 1e3
                    samples[variant]["c16"].append(row)

        asyncio.run(main())
        for _ in range(3):
            for side in SIDES:
                clients[side].append(_client(trees[side], upstream, 2000))
    finally:
        stop(procs)
        tmp.cleanup()
    direct_p50, direct_p99 = statistics.median(direct), percentile(direct, 0.99)
    out: dict = {"load_average": os.getloadavg(), "rounds": rounds, "n": n, "direct_p50_ms": direct_p50 * 1e3,
                 "variants": {}, "client": {}}
    for (side, kind), got in samples.items():
        out["variants"][f"{side} {kind}"] = {
            "cpu_ms_c1": statistics.median(got["cpu1"]),
            "added_p50_ms": (statistics.median(got["latency"]) - direct_p50) * 1e3,
            "added_p99_ms": (percentile(got["latency"], 0.99) - direct_p99) * 1e3,
            "rps_c16": statistics.median(r["rps"] for r in got["c16"]),
            "cpu_ms_c16": statistics.median(r["cpu_ms"] for r in got["c16"]),
            "errors_c16": sum(r["errors"] for r in got["c16"]),
        }
    for side in SIDES:
        out["client"][side] = {"client_cpu_us": statistics.median(r["client_cpu_us"] for r in clients[side]),
                               "module": clients[side][0]["module"]}
    return out


# -- in process: the parser alone, per request, on each side ------------------------------------

REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8080\r\naccept-encoding: gzip, deflate\r\n"
           b"connection: keep-alive\r\naccept: application/json\r\ncontent-type: application/json\r\n"
           b"user-agent: OpenAI/Python 1.99.0\r\nx-stainless-lang: python\r\nx-stainless-package-version: 1.99.0\r\n"
           b"x-stainless-os: Linux\r\nx-stainless-arch: x64\r\nx-stainless-runtime: CPython\r\n"
           b"authorization: Bearer sk-bench\r\ncontent-length: 62\r\n\r\n"
           b'{"model":"sim-1","messages":[{"role":"user","content":"hi"}]}\n')
ANSWER_HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
                  (b"date", b"Mon, 30 Nov 2026 12:00:00 GMT")]
ANSWER_BODY = b'{"id":"chatcmpl-x","object":"chat.completion","model":"m","choices":[{"index":0,' \
              b'"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],' \
              b'"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}'
RESPONSE = (b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 12:00:00 GMT\r\nserver: uvicorn\r\n"
            b"content-type: application/json\r\nopenai-processing-ms: 312\r\nx-request-id: req_0123456789\r\n"
            b"x-ratelimit-remaining-requests: 9999\r\nx-ratelimit-remaining-tokens: 199999\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(ANSWER_BODY), ANSWER_BODY))


def _h11_server(h11, conn) -> bytes:
    conn.receive_data(REQUEST)
    request = conn.next_event()
    list(request.headers)
    body = conn.next_event().data
    conn.next_event()  # EndOfMessage
    headers = [*ANSWER_HEADERS, (b"content-length", b"%d" % len(ANSWER_BODY))]
    out = conn.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
    out += conn.send(h11.Data(data=ANSWER_BODY)) + conn.send(h11.EndOfMessage())
    conn.start_next_cycle()
    return body


def _llhttp_server(http11, reader) -> bytes:
    reader.feed(REQUEST)
    reader.take()  # the head
    body = reader.take()
    reader.take()  # _END
    headers = [*ANSWER_HEADERS, (b"content-length", b"%d" % len(ANSWER_BODY))]
    http11._render_head(200, headers) + ANSWER_BODY
    return body


def _h11_client(h11, conn) -> tuple:
    # as the client before: the head rendered by relayline, h11 told of a request with its framing
    conn.send(h11.Request(method=b"POST", target=b"/", headers=((b"host", b"-"), (b"content-length", b"62"))))
    conn.send_with_data_passthrough(h11.Data(data=b"x" * 62))
    conn.send(h11.EndOfMessage())
    conn.receive_data(RESPONSE)
    response = conn.next_event()
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in response.headers}
    body = conn.next_event().data
    conn.next_event()  # EndOfMessage
    conn.start_next_cycle()
    return headers, body


def _llhttp_client(connection) -> tuple:
    from relayline.adapters.providers import upstream

    connection._begin_exchange()
    connection._feed(RESPONSE)
    pieces = connection._pieces
    connection._pieces = []
    assert connection.reusable()
    return upstream.head_fields(connection._fields), pieces[0] if len(pieces) == 1 else b"".join(pieces)


def micro(rounds: int = 7, n: int = 20000) -> dict:
    """Each side's parsing and rendering of one exchange, h11 as the code before used it beside
    llhttp as the code now does, interleaved in this process (CPU time, median of rounds)."""
    import h11

    from relayline.adapters.gateway import http11
    from relayline.adapters.providers import upstream

    server_h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=16384)
    reader = http11._Reader(16384)
    client_h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=upstream.MAX_HEAD_BYTES)
    connection = upstream.Connection(upstream.Origin("http", "127.0.0.1", 80), None, -1)
    calls = {"server, h11": lambda: _h11_server(h11, server_h11),
             "server, llhttp": lambda: _llhttp_server(http11, reader),
             "client, h11": lambda: _h11_client(h11, client_h11),
             "client, llhttp": lambda: _llhttp_client(connection)}
    samples: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.process_time()
            for _ in range(n):
                call()
            samples[name].append((time.process_time() - start) / n * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--n", type=int, default=200, help="requests per round per gateway")
    parser.add_argument("--seconds", type=float, default=1.5, help="the steady window at 16 clients")
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--micro", action="store_true", help="only the in-process figures (this tree)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(client_child(args.child, args.n)))
        return 0
    if args.micro:
        for name, us in micro().items():
            print(f"{name:<16} {us:6.2f} µs CPU per exchange")
        return 0
    if not args.base:
        parser.error("--base DIR is needed: the tree before the lever")
    result = run({"before": args.base, "after": args.after}, args.rounds, args.n, args.seconds)
    print(f"load average {result['load_average'][0]:.1f}; direct p50 {result['direct_p50_ms']:.2f} ms")
    print(f"{'':<22}{'CPU c1 ms':>10}{'+p50 ms':>9}{'+p99 ms':>9}{'req/s c16':>11}{'CPU c16 ms':>11}")
    for name, row in result["variants"].items():
        print(f"{name:<22}{row['cpu_ms_c1']:>10.3f}{row['added_p50_ms']:>9.2f}{row['added_p99_ms']:>9.2f}"
              f"{row['rps_c16']:>11.0f}{row['cpu_ms_c16']:>11.3f}")
    for side, row in result["client"].items():
        print(f"upstream client alone, {side}: {row['client_cpu_us']:.1f} µs CPU per exchange ({row['module']})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
