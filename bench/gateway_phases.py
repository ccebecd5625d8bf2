"""Where the gateway's CPU per non-streamed request goes, phase by phase, in µs of a real process.

bench/proxy_floor.py puts the gateway beside a zero-logic proxy on the same server and upstream
client (the trio floor): what the gateway costs beyond it is its own logic. This bench says which
logic. The gateway serves in this process (the same server and app as `relayline serve`, its
collector tuned, its SQLite ledger on) in front of bench/upstream.py; one raw asyncio client
(bench/load.py's) sends requests one after another from its own process. The synchronous steps
of the path are wrapped with a clock (perf_counter_ns, about 0.1 µs a wrapper): each row is that
step's time per request, as it runs in a serving process, caches cold from the step before (a
step measured in a loop of its own, as bench/gateway_path.py does, comes out about half of
this). A second run without the wrappers gives the process's own CPU per request; what the rows
do not cover is the server's loop, trio's scheduler and sockets, and the await glue between
them (the trio floor's part: proxy_floor.py measures that apart).

Run: python bench/gateway_phases.py [--seconds 5] [--out FILE] [--base DIR [--after DIR] [--pairs 3]]

With `--base` (a checkout of the code before a lever, as bench/common.py's `tree_env` takes it)
the two trees are measured alternately in one run, the order turned each pair, and each row is
the median of its pairs: a lever's before and after per step, under the same machine load.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import child_in_tree, gateway_server, stop, tree_arguments  # noqa: E402

spent: collections.Counter = collections.Counter()
calls: collections.Counter = collections.Counter()


def _clocked(name: str, fn):
    @functools.wraps(fn)
    def clocked(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter_ns() - start
            calls[name] += 1

    return clocked


def _wrap_phases() -> None:
    """Each synchronous step of a non-streamed request, by the name its row gets."""
    from relayline.adapters import jsoncodec, otel
    from relayline.adapters.codecs import dialects
    from relayline.adapters.gateway import app, console, http11, metrics
    from relayline.adapters.providers import http, openai, upstream
    from relayline.adapters.relay import Relay
    from relayline.adapters.stores import ledger
    from relayline.machines import turn

    # the gateway's own JSON calls, apart from the upstream answer's (read in its decode row)
    app.jsoncodec = types.SimpleNamespace(**vars(jsoncodec))
    steps = [
        (http11._Reader, "feed", "server: request read by llhttp"),
        (app, "request_id", "gateway: request id"),
        (app.jsoncodec, "loads", "request body: JSON read"),
        (dialects.OPENAI, "parse", "request parse into wire.Request"),
        (Relay, "plan", "routing: the plan"),
        (turn.Turn, "__init__", "turn machine: made"),
        (turn.Turn, "start", "turn machine: start (walk, first call)"),
        (openai.OpenAIProtocol, "build", "upstream request: built"),
        (upstream, "render", "upstream request: rendered"),
        (upstream.Connection, "_feed", "upstream answer read by llhttp"),
        (http, "decode_completion", "upstream answer: decoded (its JSON read included)"),
        (turn.Turn, "on_completion", "turn machine: on_completion (records, result)"),
        (Relay, "_observe", "relay: turn observed (fallback record, log)"),
        (metrics.Metrics, "turn", "metrics: turn"),
        (console.Console, "observe", "console: turn observed"),
        (otel.Tracing, "turn", "tracing: turn (off: the check)"),
        (app.Gateway, "_note_breakers", "health: breaker transitions"),
        (ledger, "ledger_rows", "ledger: rows made"),
        (ledger.LedgerStore, "_insert", "ledger: SQLite insert, committed"),
        (dialects.OpenAIDialect, "completion", "answer: built"),
        (app.Gateway, "_relayline_field", "answer: relayline field"),
        (app.Gateway, "_attribution", "answer: attribution headers"),
        (app, "dropped_header", "answer: dropped-parameters header"),
        (app.jsoncodec, "dumps", "answer: JSON written"),
        (http11, "_render_head", "server: answer head rendered"),
        (app.Gateway, "_account", "gateway: access line and request metrics"),
    ]
    for owner, attr, name in steps:
        if hasattr(owner, attr):  # (a tree before or after a lever may not have every step)
            setattr(owner, attr, _clocked(name, getattr(owner, attr)))


def serve_and_measure(seconds: float, wrapped: bool) -> dict:
    from relayline.adapters.gateway.http11 import listening_sockets
    from relayline.adapters.gateway.serving import tune_collector

    if wrapped:
        _wrap_phases()
    upstream = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{upstream.stdout.readline().split()[1]}"
        with tempfile.TemporaryDirectory() as tmp:
            server = gateway_server(base, tmp)
            tune_collector()
            sockets = listening_sockets("127.0.0.1", 0)
            url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}/v1/chat/completions"
            out: dict = {}

            async def main() -> None:
                async with trio.open_nursery() as nursery:
                    await nursery.start(server.run, sockets, trio.Event())
                    # warm for a second, then the measured window (bench/load.py's closed loop)
                    client = (f"import asyncio, json, sys; sys.path.insert(0, {str(HERE)!r}); from common import closed_loop; "
                              f"asyncio.run(closed_loop({url!r}, 1, 1.0)); "
                              f"print(json.dumps(asyncio.run(closed_loop({url!r}, 1, {seconds + 1.0}))))")
                    proc = await trio.lowlevel.open_process([sys.executable, "-c", client], stdout=subprocess.PIPE)
                    await trio.sleep(1.8)
                    spent.clear()
                    calls.clear()
                    cpu, wall = time.process_time(), time.perf_counter()
                    await trio.sleep(seconds)
                    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    steps, counts = dict(spent), dict(calls)
                    answer = await proc.stdout.receive_some(1 << 20)
                    await proc.wait()
                    row = json.loads(answer.decode().strip().splitlines()[-1])
                    requests = row["rps"] * wall  # the client's steady rate over this window
                    out.update(rps=row["rps"], errors=row["errors"], cpu_us_per_request=cpu / requests * 1e6,
                               steps={name: {"us": ns / requests / 1e3, "calls": counts[name] / requests}
                                      for name, ns in sorted(steps.items(), key=lambda kv: -kv[1])})
                    nursery.cancel_scope.cancel()

            trio.run(main)
            return out
    finally:
        stop([upstream])


def _measure(tree: str | None, seconds: float) -> dict:
    """One tree's two children: bare (the process's CPU per request) and wrapped (its steps)."""
    runs = {}
    for kind in ("bare", "wrapped"):  # each in a process of its own: the wrappers stay out of the bare run
        args = ["--child", kind, "--seconds", str(seconds)]
        runs[kind] = child_in_tree(__file__, tree, args[1:], timeout_s=120 + 4 * seconds)
    bare, wrapped = runs["bare"], runs["wrapped"]
    return {"cpu_us_per_request": bare["cpu_us_per_request"], "cpu_us_per_request_wrapped": wrapped["cpu_us_per_request"],
            "rps": bare["rps"], "errors": bare["errors"] + wrapped["errors"], "steps": wrapped["steps"],
            "steps_total_us": sum(step["us"] for step in wrapped["steps"].values())}


def _median(values: list[float]) -> float:
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _trees(args: argparse.Namespace) -> dict:
    """{side: [one _measure a pair]}, the sides alternated and the order turned each pair."""
    sides: dict[str, list[dict]] = {"before": [], "after": []}
    for pair in range(args.pairs):
        for side in (("before", "after") if pair % 2 == 0 else ("after", "before")):
            sides[side].append(_measure(args.base if side == "before" else args.after, args.seconds))
    out = {}
    for side, runs in sides.items():
        names = dict.fromkeys(name for run in runs for name in run["steps"])
        out[side] = {"cpu_us_per_request": _median([run["cpu_us_per_request"] for run in runs]),
                     "rps": _median([run["rps"] for run in runs]), "errors": sum(run["errors"] for run in runs),
                     "steps": {name: {"us": _median([run["steps"].get(name, {"us": 0.0})["us"] for run in runs])}
                               for name in names},
                     "runs": runs}
        out[side]["steps_total_us"] = sum(step["us"] for step in out[side]["steps"].values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", help="write the figures here (JSON)")
    tree_arguments(parser, pairs=3)
    parser.add_argument("child_kind", nargs="?", choices=("bare", "wrapped"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(serve_and_measure(args.seconds, args.child_kind == "wrapped")))
        return 0
    if args.base:
        load = os.getloadavg()[0]
        out = _trees(args)
        out["load_average"] = [load, os.getloadavg()[0]]
        before, after = out["before"], out["after"]
        print(f"the gateway's CPU per non-streamed request, concurrency 1, medians of {args.pairs} alternated pairs "
              f"(load average {load:.1f}-{out['load_average'][1]:.1f}): before {before['cpu_us_per_request']:.0f} µs, "
              f"after {after['cpu_us_per_request']:.0f} µs")
        print(f"  {'before':>9} {'after':>9}")
        for name in dict.fromkeys([*before["steps"], *after["steps"]]):
            print(f"  {before['steps'].get(name, {'us': 0})['us']:7.1f} µs {after['steps'].get(name, {'us': 0})['us']:7.1f} µs  {name}")
        print(f"  {before['steps_total_us']:7.1f} µs {after['steps_total_us']:7.1f} µs  the steps above")
    else:
        out = _measure(None, args.seconds)
        out["load_average"] = os.getloadavg()[0]
        print(f"the gateway's CPU per non-streamed request, concurrency 1: {out['cpu_us_per_request']:.0f} µs "
              f"({out['rps']:.0f} req/s; wrapped {out['cpu_us_per_request_wrapped']:.0f} µs; load average "
              f"{out['load_average']:.1f})")
        for name, step in out["steps"].items():
            print(f"  {step['us']:7.1f} µs  {step['calls']:4.1f}x  {name}")
        print(f"  {out['steps_total_us']:7.1f} µs  the steps above; the rest is the server's loop, trio, sockets and the glue")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
