"""The gateway's own path per non-streamed request, in process and without HTTP (never part of
`make test`): the ASGI app called directly, as the server calls it, on the sim family.

bench/gateway_cpu.py measures the whole gateway process (server, h11, sockets, three processes
on two cores); this measures what is left once the framing is gone: the request's parse, the
plan and the turn's machines, the driver's scopes, the exchange, metrics, the console's turn
view and the ledger row. At a few hundred µs a request, a lever worth 10 µs shows here and is
lost in the noise there. `--base DIR` names a checkout of the code before a lever (its package
directory, e.g. a `git worktree add --detach` of the commit before): the two trees are measured
alternately, each in child processes of its own, and the figure is the median of the pairs.
`--profile` prints a cProfile of this tree grouped by module (its µs are inflated by the
profiler: read them as shares).

    python bench/probes/gateway_path.py [--base DIR [--after DIR]] [--pairs 7] [--n 2000] [--no-ledger]
    python bench/probes/gateway_path.py --profile [--no-ledger]

A lever worth a few µs is within the noise of a loaded machine; its instruction count is not:
run a child under `valgrind --tool=cachegrind --cache-sim=no` with `--n 50` and `--n 350` (a
tree's package first on PYTHONPATH, as `--base` does) and divide the difference of their
`I refs` by the difference of requests, 900 (ROUNDS x 300).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: common.py

from common import alternate, tree_arguments  # noqa: E402

BODY = json.dumps({"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]}).encode()
ROUNDS = 3  # per child: the least CPU of these (machine noise only adds)
HEADERS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
           (b"content-length", str(len(BODY)).encode()), (b"authorization", b"Bearer bench-key")]


def _gateway(tmp: str, ledger: bool):
    from relayline.adapters import Relay
    from relayline.adapters.gateway import Gateway

    text = f'active = "sim"\n[ledger]\npath = "{tmp}/ledger.sqlite3"\n[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n'
    relay = Relay.from_toml(text, env={})
    return Gateway.from_relay_config(relay, env={}) if ledger else Gateway(relay)


def _here() -> bool:
    return True


async def raw_post(app, hangups: list) -> int:
    """One chat request through the ASGI app, as the server makes it: the body already here
    (one message), the hang-up and body extensions offered (http11.py's)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": HEADERS, "client": ("127.0.0.1", 50000),
             "server": ("127.0.0.1", 8080), "extensions": {"relayline.hangup": hangups.append, "relayline.body_here": _here}}
    given = [{"type": "http.request", "body": BODY, "more_body": False}]
    status = []

    async def receive() -> dict:
        if given:
            return given.pop()
        import trio

        await trio.sleep_forever()  # (the server's receive after the body: waits for a hang-up)
        raise AssertionError

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    hangups.clear()
    return status[0]


def child(n: int, ledger: bool) -> dict:
    """CPU µs per request, the least of ROUNDS rounds of n requests one after another. (One after
    another: on the sim family a request never yields to trio's scheduler, so tasks in process
    would not interleave; turns in flight together are bench/gateway_trees.py's, over sockets.)"""
    import trio

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        gateway = _gateway(tmp, ledger)

        async def main() -> None:
            hangups: list = []
            for _ in range(300):  # warm: caches, the ledger's pages
                assert await raw_post(gateway, hangups) == 200
            for _ in range(ROUNDS):
                start = time.process_time()
                for _ in range(n):
                    assert await raw_post(gateway, hangups) == 200
                used = (time.process_time() - start) / n * 1e6
                out["us"] = min(out.get("us", math.inf), used)

        trio.run(main)
        if gateway.ledger is not None:
            gateway.ledger.close()
    return out


def profile(n: int, ledger: bool) -> None:
    import cProfile
    import pstats
    from collections import Counter

    import trio

    with tempfile.TemporaryDirectory() as tmp:
        gateway = _gateway(tmp, ledger)
        profiler = cProfile.Profile()

        async def main() -> None:
            for _ in range(300):
                await raw_post(gateway, [])
            profiler.enable()
            for _ in range(n):
                await raw_post(gateway, [])
            profiler.disable()

        trio.run(main)
    stats = pstats.Stats(profiler)
    groups: Counter = Counter()
    for (path, _line, name), (_cc, _nc, own, _cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if "site-packages/" in path:
            key = path.split("site-packages/")[1].split("/")[0]
        elif path == "~":
            key = f"(built-in) {name}"
        elif "/relayline/" in path or "/machines/" in path or "/adapters/" in path:
            key = path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1]
        else:
            key = f"(stdlib) {path.rsplit('/', 1)[-1]}"
        groups[key] += own
    total = sum(groups.values())
    print(f"{total / n * 1e6:.0f} µs a request under cProfile (self time, grouped)")
    for key, own in groups.most_common(30):
        print(f"  {own / n * 1e6:7.1f} µs {own / total:6.1%}  {key}")
    stats.sort_stats("tottime").print_stats(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_arguments(parser, pairs=7)
    parser.add_argument("--n", type=int, default=2000, help="requests per round (ROUNDS rounds per child)")
    parser.add_argument("--no-ledger", action="store_true", help="no ledger row (the gateway without [ledger])")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.n, not args.no_ledger)))
        return 0
    if args.profile:
        profile(args.n, not args.no_ledger)
        return 0
    sides = alternate(__file__, args, ["--n", str(args.n)] + (["--no-ledger"] if args.no_ledger else []),
                      timeout_s=600)
    values = {side: statistics.median(r["us"] for r in runs) for side, runs in sides.items()}
    print(f"CPU µs per request, the ASGI app in process ({'without' if args.no_ledger else 'with'} the ledger row), "
          f"medians of {args.pairs} children; load average {os.getloadavg()[0]:.1f}")
    print("  " + "   ".join(f"{side} {value:.1f}" for side, value in values.items()), end="")
    if args.base:
        ratio = statistics.median(a["us"] / b["us"] for a, b in zip(sides["after"], sides["before"], strict=True))
        print(f"   after/before {ratio:.3f} (median of the pairs' ratios)", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
