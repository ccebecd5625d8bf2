"""What the gateway's path does per request beyond the trio floor: counts, not times.

bench/proxy_floor.py's trio floor (the gateway's own server and upstream client, an app that only
forwards) and the gateway (`relayline serve`'s server and app, its SQLite ledger on) each serve,
in this process, requests one after another from a client process (proxy_floor.py's raw socket
client) in front of bench/upstream.py. Per request, over a window of `--requests`:

- trio's scheduler (an Instrument): task steps, tasks spawned, scheduler passes (each an
  epoll_wait, `before_io_wait`), tasks woken (`task_scheduled`);
- calls by name (cProfile's call counts, exact whatever the load): cancel scopes entered,
  deadlines set, checkpoints, parks (`wait_task_rescheduled`), epoll registrations, sockets'
  sends and receives, contextvars copies and runs, Python and C calls in all;
- syscalls by kind (`--syscalls`: perf's syscall tracepoints over two runs `--requests` apart, so
  that start-up and shutdown cancel out);
- instructions (`--instructions`: cachegrind, the same two runs' difference), and CPU
  (`--cpu ROUNDS`: the process's, the targets alternated round by round, with the CPU of its
  socket writes apart: on loopback a write carries the kernel's whole send and the peer's wake).

Run: python bench/probes/glue_counts.py [--requests 400] [--clients 1] [--syscalls] [--cpu ROUNDS]
         [--instructions] [--sim] [--base DIR [--after DIR]] [--out FILE]
(`--base DIR`: the gateway of that tree's package too, as a lever's before; `--sim`: the gateway
on the sim family, bench/gateway_trees.py's, instead of the floor and the upstream call)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import trio

BENCH = Path(__file__).resolve().parent.parent  # bench/: common.py, upstream.py, the standing benches
sys.path.insert(0, str(BENCH))

from common import stop, tree_env  # noqa: E402
from proxy_floor import CLIENT, trio_server, tune_floor_collector  # noqa: E402

# `clients` connections at once, each sending its share of the requests back to back (load.py's
# raw asyncio client)
CLIENTS = f"""
import asyncio, sys
sys.path.insert(0, {str(BENCH)!r})
from common import MESSAGES, raw_connect, raw_post, raw_response
port, n, c = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
url = f"http://127.0.0.1:{{port}}/v1/chat/completions"
request = raw_post(url, {{"model": "frames-1", "messages": MESSAGES}})
async def client():
    reader, writer = await raw_connect(url)
    for _ in range(n // c):
        writer.write(request)
        status, _, _ = await raw_response(reader)
        assert status == 200, status
    writer.close()
async def main():
    await asyncio.gather(*(client() for _ in range(c)))
asyncio.run(main())
"""

# the calls counted by name: a row, and a pattern over cProfile's "file:function" for each call
# (a C function's file is "~", its name as "<method 'send' of '_socket.socket' objects>")
CALLS = [
    ("cancel scopes entered", r"_core/_run\.py:__enter__$"),
    ("cancel scope deadline set", r"_core/_run\.py:deadline$"),
    ("timeouts made (move_on_*/fail_*)", r"trio/_timeouts\.py:(move_on|fail)_"),
    ("checkpoints (trio.lowlevel.checkpoint)", r"_core/_run\.py:checkpoint$"),
    ("cancel checks (checkpoint_if_cancelled)", r"_core/_run\.py:checkpoint_if_cancelled$"),
    ("parks (wait_task_rescheduled)", r"_core/_traps\.py:wait_task_rescheduled$"),
    ("waits for a socket (wait_readable/writable)", r"_core/_io_epoll\.py:_epoll_wait$"),
    ("tasks rescheduled (reschedule)", r"_core/_run\.py:reschedule$"),
    ("trio.current_time", r"_core/_generated_run\.py:current_time$"),
    ("trio.current_task", r"_core/_run\.py:current_task$"),
    ("epoll register / modify / unregister", r"^~:<method '(register|modify|unregister)' of 'select\.epoll"),
    ("socket recv", r"^~:<method 'recv(_into)?' of '_socket"),
    ("socket send / os.write", r"^~:(<method 'send' of '_socket|<built-in method posix\.write>)"),
    ("contextvars: Context.run", r"^~:<method 'run' of '_contextvars\.Context"),
    ("contextvars: copy_context / Context.copy", r"^~:<(built-in method _contextvars\.copy_context|method 'copy' of '_contextvars)"),
    ("ContextVar.set / reset", r"^~:<method '(set|reset)' of '_contextvars\.ContextVar"),
    ("clock reads (perf_counter / monotonic / time)", r"^~:<built-in method time\.(perf_counter|monotonic|time)"),
    ("generator-based context managers (contextlib)", r"contextlib\.py:helper$"),
]


class Scheduler(trio.abc.Instrument):
    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.on = False

    def before_task_step(self, task) -> None:
        if self.on:
            self.counts["task steps"] += 1

    def task_spawned(self, task) -> None:
        if self.on:
            self.counts["tasks spawned"] += 1
            self.counts[f"  spawned: {task.name.rpartition('.')[2]}"] += 1

    def task_scheduled(self, task) -> None:
        if self.on:
            self.counts["tasks woken (task_scheduled)"] += 1

    def before_io_wait(self, timeout) -> None:
        if self.on:
            self.counts["scheduler passes (epoll_wait)"] += 1
            if timeout > 0:
                self.counts["  passes that may block (a timeout)"] += 1


def _by_name(stats: pstats.Stats, requests: int) -> tuple[dict, dict]:
    """The CALLS rows, and the most called functions, per request."""
    patterns = [(row, re.compile(pattern)) for row, pattern in CALLS]
    rows: collections.Counter = collections.Counter()
    everything: collections.Counter = collections.Counter()
    for (path, _line, name), (_primitive, total, _tt, _ct, _callers) in stats.stats.items():
        where = f"{path.rpartition('/site-packages/')[2] or path}:{name}"
        everything[where] += total
        for row, pattern in patterns:
            if pattern.search(where):
                rows[row] += total
    top = {k: v / requests for k, v in everything.most_common(80)}
    out = {row: rows[row] / requests for row, _ in CALLS}
    out["function calls in all (Python and C)"] = sum(everything.values()) / requests
    return out, top


def _sim_server(tmp: str):
    """The gateway as bench/gateway_trees.py serves it: the sim family (no upstream call)."""
    from relayline.adapters.configfile import load_config_file
    from relayline.adapters.gateway import Gateway
    from relayline.adapters.gateway.http11 import Server
    from relayline.adapters.gateway.serving import _error_body
    from relayline.adapters.relay import Relay

    config = Path(tmp) / "sim.toml"
    config.write_text(f'active = "sim"\n[ledger]\npath = "{tmp}/sim.sqlite3"\n'
                      '[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n')
    gateway = Gateway.from_relay_config(Relay(load_config_file(str(config))))
    settings = gateway.settings
    return Server(gateway, keep_alive_s=settings.keep_alive_s, max_header_bytes=settings.max_header_bytes,
                  graceful_s=1, error_body=_error_body)


def serve_counted(kind: str, upstream: str, requests: int, mode: str, clients: int = 1) -> dict:
    """Serve a warm-up client, then `requests` of another: with the counters on ("count"), with
    nothing added ("bare", for perf and cachegrind), or with the process's CPU time taken
    ("cpu": its socket writes' own CPU too, the kernel's loopback send inside them)."""
    import time

    writes = [0]
    if mode == "cpu":
        from relayline.adapters import sockets

        write = os.write

        def timed(fd: int, data) -> int:
            start = time.thread_time_ns()
            try:
                return write(fd, data)
            finally:
                writes[0] += time.thread_time_ns() - start

        sockets.os = types.SimpleNamespace(**{**vars(os), "write": timed})

    from relayline.adapters.gateway.http11 import listening_sockets

    scheduler = Scheduler()
    out: dict = {}

    async def main(tmp: str) -> None:
        server = _sim_server(tmp) if kind == "sim" else trio_server(kind, upstream, tmp)
        tune_floor_collector()
        sockets = listening_sockets("127.0.0.1", 0)
        port = str(sockets[0].getsockname()[1])
        # proxy_floor's one client: port, model, turns of history before the prompt, then the count
        one = [sys.executable, "-c", CLIENT, port, "frames-1", "0"]
        client = one if clients == 1 else [sys.executable, "-c", CLIENTS, port]
        more = [] if clients == 1 else [str(clients)]
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run, sockets, trio.Event())
            await trio.run_process(client + ["50"] + more)
            profiler = cProfile.Profile() if mode == "count" else None
            proc = await trio.lowlevel.open_process(client + [str(requests)] + more)
            scheduler.on = True
            cpu = time.process_time()
            if profiler is not None:
                profiler.enable()
            await proc.wait()
            if profiler is not None:
                profiler.disable()
            cpu = time.process_time() - cpu
            scheduler.on = False
            nursery.cancel_scope.cancel()
            out["cpu_us_per_request"] = cpu / requests * 1e6
            if mode == "cpu":
                out["write_cpu_us_per_request"] = writes[0] / requests / 1e3
            if mode == "count":
                out["scheduler"] = {k: v / requests for k, v in sorted(scheduler.counts.items())}
                out["calls"], out["top"] = _by_name(pstats.Stats(profiler), requests)
                if os.environ.get("GLUE_COUNTS_DUMP"):  # the whole profile, for pstats
                    profiler.dump_stats(os.environ["GLUE_COUNTS_DUMP"])

    with tempfile.TemporaryDirectory() as tmp:
        trio.run(main, tmp, instruments=[scheduler] if mode == "count" else [])
    return out


SYSCALLS = ("epoll_wait", "epoll_ctl", "recvfrom", "sendto", "write", "read", "pwrite64", "pread64", "fcntl",
            "poll", "getrandom", "futex", "fdatasync")


def syscalls(kind: str, upstream: str, tree: str | None, requests: int, clients: int) -> dict:
    """Syscalls per request by kind: perf's syscall tracepoints over the serving process (and
    the client it starts, the same for every target) at two request counts; unlike strace, they
    do not slow each syscall down and change which reads find their data already there."""
    events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
    tables = []
    for n in (requests // 4, requests):
        done = subprocess.run(["perf", "stat", "-x", ",", "-e", events, sys.executable, __file__, "--child", kind,
                               upstream, str(n), "--mode", "bare", "--clients", str(clients)],
                              env=tree_env(tree), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        table = {}
        for line in done.stderr.splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[2].startswith("syscalls:sys_enter_") and fields[0].isdigit():
                table[fields[2].removeprefix("syscalls:sys_enter_")] = int(fields[0])
        tables.append(table)
    span = requests - requests // 4
    rows = {name: (tables[1].get(name, 0) - tables[0].get(name, 0)) / span for name in SYSCALLS}
    return {k: round(v, 3) for k, v in rows.items()}


def instructions(kind: str, upstream: str, tree: str | None, requests: int, clients: int) -> float:
    """Instructions per request of the serving process (cachegrind) from two runs `requests`
    apart: start-up, the warm-up and shutdown cancel out."""
    refs = []
    for n in (requests // 4, requests):
        done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                               sys.executable, __file__, "--child", kind, upstream, str(n), "--mode", "bare",
                               "--clients", str(clients)], env=tree_env(tree), capture_output=True, text=True,
                              timeout=3600)
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(done.stderr[-2000:])
        refs.append(int(found.group(1).replace(",", "")))
    return (refs[1] - refs[0]) / (requests - requests // 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--syscalls", action="store_true", help="syscalls per request too (strace -c -f)")
    parser.add_argument("--base", help="the gateway of this tree's package too (a lever's before)")
    parser.add_argument("--after", help="with --base: the tree after the lever (default: this one)")
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="count", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=1, help="connections at once (default 1)")
    parser.add_argument("--sim", action="store_true",
                        help="the gateway on the sim family alone (bench/gateway_trees.py's), no trio floor")
    parser.add_argument("--instructions", action="store_true",
                        help="instructions per request of each target too (cachegrind; slow)")
    parser.add_argument("--cpu", type=int, default=0, metavar="ROUNDS",
                        help="CPU per request too: this many alternated rounds of each target, nothing added")
    args = parser.parse_args()
    if args.child:
        kind, upstream, n = args.child
        print(json.dumps(serve_counted(kind, upstream, int(n), args.mode, args.clients)))
        return 0
    upstream_proc = subprocess.Popen([sys.executable, str(BENCH / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    out: dict = {"requests": args.requests, "load_average": os.getloadavg()[0], "targets": {}}
    try:
        upstream = f"http://127.0.0.1:{upstream_proc.stdout.readline().split()[1]}"
        gateway = "sim" if args.sim else "gateway"
        targets = [] if args.sim else [("trio floor", "trio", None)]
        if args.base:
            targets.append((f"{gateway} (--base)", gateway, args.base))
        targets.append((gateway, gateway, args.after))
        for label, kind, tree in targets:
            done = subprocess.run([sys.executable, __file__, "--child", kind, upstream, str(args.requests),
                                   "--clients", str(args.clients)],
                                  env=tree_env(tree), capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{label}: {done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            if args.syscalls:
                row["syscalls"] = syscalls(kind, upstream, tree, args.requests, args.clients)
            if args.instructions:
                row["cpu"] = {"instructions a request (cachegrind)":
                              instructions(kind, upstream, tree, args.requests, args.clients)}
            out["targets"][label] = row
        for round_ in range(args.cpu):
            for label, kind, tree in (targets if round_ % 2 == 0 else targets[::-1]):
                done = subprocess.run([sys.executable, __file__, "--child", kind, upstream, str(args.requests * 5),
                                       "--mode", "cpu", "--clients", str(args.clients)], env=tree_env(tree), capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise SystemExit(f"{label}: {done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                out["targets"][label].setdefault("cpu_rounds", []).append(row["cpu_us_per_request"])
                out["targets"][label].setdefault("write_cpu_rounds", []).append(row["write_cpu_us_per_request"])
        for row in out["targets"].values():
            if "cpu_rounds" in row:
                row.setdefault("cpu", {})["CPU µs a request (median of the rounds)"] = statistics.median(row["cpu_rounds"])
                row["cpu"]["  of it in os.write (the kernel's loopback send)"] = statistics.median(row["write_cpu_rounds"])
    finally:
        stop([upstream_proc])
    labels = list(out["targets"])
    print(f"per request ({args.requests} requests, {args.clients} client(s) at once, load average {out['load_average']:.1f}): "
          + " | ".join(labels))
    for section in ("cpu", "scheduler", "calls", "syscalls"):
        keys = sorted({k for t in out["targets"].values() for k in t.get(section, {})},
                      key=lambda k: -max(t.get(section, {}).get(k, 0) for t in out["targets"].values()))
        if section == "calls":
            keys = [row for row, _ in CALLS] + ["function calls in all (Python and C)"]
        for key in keys:
            values = " | ".join(f"{t.get(section, {}).get(key, 0):8.2f}" for t in out["targets"].values())
            print(f"  {section:<9} {key[:64]:<64} {values}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
