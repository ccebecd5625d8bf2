"""Where the gateway's own tail comes from: each request's time in the server, from its head read
to its last byte written, beside what ran in the process meanwhile (never part of `make test`).

A client's p99 on a shared 2-core machine is mostly the scheduler's: the direct call to the
upstream has a p99 many times its p50 too. This probe separates the two. It starts `relayline
serve` (the default configuration: info logging to a file, the SQLite ledger) with a few hooks
put in from outside, in its own process: the server's connection notes the time a request's head
was read and the time its last byte was written, Python's collector notes each pass (its
generation and duration), and the ledger's commit, the access log's write and the thread CPU of
the process are timed. Each request's span also carries the process's CPU time in it (every task's): a tail request
whose span holds no more CPU than a median one's waited, for the CPU or for the upstream. The
raw asyncio client of bench/load.py then sends one-message requests
at concurrency 1 and 16 through it to the loopback upstream (bench/upstream.py). For each level:
the client's p50/p99, the server's p50/p99, and of the requests above the server's p99, how many
overlapped a collector pass, a slow ledger commit or a slow log write, and how many had none of
them (the scheduler's, or the loop's own).

CPU time in a span is moved by the machine: the same work runs slower while another process
shares the core, its caches or its memory bandwidth. So each request's span also carries the event
loop's thread's CPU apart from the process's (the rest is its other threads': the ledger's
checkpointer), and three options say what the tail requests ran:

- `--calls` counts the Python calls in each request's span (a profile hook in the loop's
  thread: slower, but a count, which load does not move) and names the functions of the
  requests that called other than a reference request did: periodic work in Python (a watchdog,
  a cache rebuilt) shows there, whatever the machine does.
- `--perf` samples the gateway with perf (CLOCK_MONOTONIC stamps, the hooks' clock) through the
  first level and adds up the samples inside the tail requests' spans beside those inside the
  middle ones' (p40 to p60), per request: by thread, by kind (the interpreter, SQLite, a page
  fault, a file write, a socket, the kernel's softirqs...) and by leaf symbol. perf names no
  Python function (3.11 has no perf map), only native and kernel ones.
- `--sample HZ` samples the loop thread's Python stack on SIGPROF instead; the kernel's
  process CPU timers tick at its HZ (docs/performance-history.md says at what rate here), so it takes many requests to say much.

    python bench/probes/tail_sources.py [--seconds 10] [--levels 1,16] [--out FILE] [--hooks FILE]
                                        [--calls] [--perf] [--sample HZ]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from common import listening_logged, percentile, raw_connect, raw_post, raw_response  # noqa: E402

# put into the gateway's process before `relayline serve` starts: every hook appends to a list,
# and the lists are written out as JSON when the process exits (SIGINT drains it)
HOOKS = textwrap.dedent("""
    import atexit, gc, json, logging, os, sys, time
    from relayline.adapters.gateway.http11 import connection
    from relayline.adapters.stores import ledger
    clock = time.perf_counter_ns
    requests, passes, commits, emits = [], [], [], []
    original_request, original_write = connection.Connection._request, connection.Connection._write

    last_write = {}  # (the connection has slots: its last write's time is kept here, by id)

    # --calls: the Python functions each request's span called in the loop thread, counted (a
    # profile hook: deterministic, unlike CPU time): kept as the difference from a reference
    # request's counts, so that what a tail request did beyond the usual is named
    calling = os.environ.get("TAIL_PROBE_CALLS") == "1"
    calls = {"now": {}, "reference": None}
    call_diffs = []

    def profile(frame, event, arg):
        if event == "call":
            now = calls["now"]
            code = frame.f_code
            now[code] = now.get(code, 0) + 1

    if calling:
        sys.setprofile(profile)

    async def _request(self, head):
        start, cpu, loop_cpu = clock(), time.process_time_ns(), time.thread_time_ns()
        last_write[id(self)] = (start, cpu, loop_cpu)
        if calling:
            calls["now"] = {}
        try:
            await original_request(self, head)
        finally:
            written, written_cpu, written_loop = last_write.pop(id(self), (start, cpu, loop_cpu))
            requests.append((start, written, clock(), written_cpu - cpu, written_loop - loop_cpu))
            if calling:
                now, calls["now"] = calls["now"], {}
                if calls["reference"] is None and len(requests) == 50:
                    calls["reference"] = now
                reference = calls["reference"] or {}
                diff = {code: n - reference.get(code, 0) for code, n in now.items() if n != reference.get(code, 0)}
                diff.update({code: -n for code, n in reference.items() if code not in now})
                call_diffs.append((start, sum(now.values()), diff))

    async def _write(self, data):
        await original_write(self, data)
        last_write[id(self)] = (clock(), time.process_time_ns(), time.thread_time_ns())

    connection.Connection._request, connection.Connection._write = _request, _write
    started = {}

    def collector(phase, info):
        if phase == "start":
            started["at"] = clock()
        elif "at" in started:
            passes.append((started.pop("at"), clock(), info["generation"]))

    gc.callbacks.append(collector)
    original_insert = ledger.LedgerStore._insert_locked

    def _insert_locked(self, rows):
        start, cpu = clock(), time.thread_time_ns()
        try:
            return original_insert(self, rows)
        finally:
            commits.append((start, clock(), time.thread_time_ns() - cpu, len(rows)))

    ledger.LedgerStore._insert_locked = _insert_locked
    original_emit = logging.StreamHandler.emit

    def emit(self, record):
        start = clock()
        try:
            return original_emit(self, record)
        finally:
            emits.append((start, clock()))

    logging.StreamHandler.emit = emit

    # --sample: the Python stack the loop thread ran, stamped, every 1/hz s of the process's CPU
    # (SIGPROF: its handler runs in the main thread, the event loop's, at the next bytecode)
    samples = []
    hz = int(os.environ.get("TAIL_PROBE_SAMPLE_HZ", "0"))
    if hz:
        import signal

        def sample(signum, frame):
            codes = []
            while frame is not None and len(codes) < 48:
                codes.append(frame.f_code)
                frame = frame.f_back
            samples.append((clock(), codes))

        signal.signal(signal.SIGPROF, sample)
        signal.siginterrupt(signal.SIGPROF, False)
        signal.setitimer(signal.ITIMER_PROF, 1 / hz, 1 / hz)

    def dump():
        if hz:
            signal.setitimer(signal.ITIMER_PROF, 0, 0)
        names = {}
        def name(code):
            if code not in names:
                names[code] = code.co_filename.rsplit("/site-packages/", 1)[-1].rsplit("/relayline/", 1)[-1] + ":" + code.co_qualname
            return names[code]
        stacks = [(t, [name(c) for c in codes]) for t, codes in samples]
        diffs = [(t, total, {name(c): n for c, n in diff.items()}) for t, total, diff in call_diffs]
        with open(os.environ["TAIL_PROBE_OUT"], "w") as sink:
            json.dump({"requests": requests, "passes": passes, "commits": commits, "emits": emits,
                       "samples": stacks, "calls": diffs,
                       "calls_reference": {name(c): n for c, n in (calls["reference"] or {}).items()}}, sink)

    atexit.register(dump)
    from relayline.adapters.cli import main
    sys.exit(main(sys.argv[1:]))
""")

SLOW_NS = 200_000  # a commit or a log write above this is named as a cause
PERF_HZ = 10_000  # perf's samples a second of CPU: one per 100 µs
# what a sample was doing, by any frame of its stack (native and kernel: perf names no Python
# function); the first that matches names it
KINDS = (("sqlite", ("sqlite3", "pysqlite")), ("page fault", ("exc_page_fault",)),
         ("mmap/munmap/brk/madvise", ("mmap", "munmap", "brk", "madvise")),
         ("fsync", ("fsync",)), ("file write", ("vfs_write", "ksys_write")),
         ("socket send", ("tcp_sendmsg", "sock_sendmsg")), ("socket receive", ("tcp_recvmsg",
                                                                                "sock_recvmsg")),
         ("epoll", ("epoll",)), ("futex", ("futex",)), ("collector", ("gc_collect",)),
         ("allocator", ("PyObject_Malloc", "PyObject_Free", "_int_malloc", "_int_free", "malloc",
                        "free")),
         ("interpreter", ("libpython",)))


async def _level(url: str, concurrency: int, seconds: float) -> list[float]:
    """Closed-loop clients for `seconds`: each request's latency (s), the first second dropped."""
    request = raw_post(url, {"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]})
    connections = await asyncio.gather(*(raw_connect(url) for _ in range(concurrency)))
    start = time.perf_counter()
    out: list[tuple[float, float]] = []

    async def client(reader, writer) -> None:
        while (now := time.perf_counter()) < start + seconds:
            writer.write(request)
            status, _body, _keep = await raw_response(reader)
            if status == 200:
                out.append((now, time.perf_counter() - now))
        writer.close()

    await asyncio.gather(*(client(r, w) for r, w in connections))
    return [latency for sent, latency in out if sent >= start + 1.0]


def _overlaps(span: tuple[int, int], events: list, slow_ns: int = 0) -> list:
    return [e for e in events if e[0] < span[1] and e[1] > span[0] and e[1] - e[0] >= slow_ns]


def python_profile(samples: list, requests: list, hz: int) -> dict:
    """The loop thread's Python samples (--sample) in the spans of the tail requests beside those
    of the middle ones, per request in ms of the process's CPU: by the function running (leaf)
    and by every function on the stack (inclusive), those the tail has most more of first."""
    served = sorted((r[1] - r[0], i) for i, r in enumerate(requests))
    n = len(served)
    groups = {"tail": [requests[i] for _, i in served[int(n * 0.99):]],
              "middle": [requests[i] for _, i in served[int(n * 0.4):int(n * 0.6)]]}
    samples = sorted(samples, key=lambda sample: sample[0])
    times = [sample[0] for sample in samples]
    ms = 1e3 / hz
    tallies: dict[str, dict[str, dict[str, float]]] = {}
    for name, group in groups.items():
        tally: dict[str, dict[str, float]] = {"leaf": {}, "inclusive": {}}
        for r in group:
            for t in range(bisect.bisect_left(times, r[0]), bisect.bisect_right(times, r[1])):
                stack = samples[t][1]
                keys = {"leaf": [stack[0] if stack else "?"], "inclusive": set(stack)}
                for table, names in keys.items():
                    for key in names:
                        tally[table][key] = tally[table].get(key, 0.0) + ms / len(group)
        tallies[name] = tally
    out: dict = {"requests": {name: len(group) for name, group in groups.items()},
                 "ms_per_request_sampled_tail_middle": [round(sum(tallies[g]["leaf"].values()), 3)
                                                        for g in ("tail", "middle")]}
    for table in ("leaf", "inclusive"):
        keys = set(tallies["tail"][table]) | set(tallies["middle"][table])
        rows = sorted(((tallies["tail"][table].get(k, 0.0), tallies["middle"][table].get(k, 0.0), k)
                       for k in keys), key=lambda row: row[1] - row[0])
        out[f"ms_per_request_by_{table}_tail_middle"] = {k: [round(t, 3), round(m, 3)] for t, m, k in rows[:25]}
    return out


def _perf_samples(path: Path) -> list[tuple[int, int, list[str]]]:
    """perf's samples: (thread id, CLOCK_MONOTONIC ns, its stack leaf first as "symbol (dso)")."""
    text = subprocess.run(["perf", "script", "-i", str(path), "-F", "tid,time,ip,sym,dso", "--ns"],
                          capture_output=True, text=True, check=True).stdout
    out: list[tuple[int, int, list[str]]] = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        tid, at = lines[0].split()[:2]
        seconds, _, fraction = at.rstrip(":").partition(".")
        frames = [line.strip().split(None, 1)[1] if " " in line.strip() else line.strip() for line in lines[1:]]
        out.append((int(tid), int(seconds) * 1_000_000_000 + int(fraction.ljust(9, "0")), frames))
    return out


def _kind(frames: list[str]) -> str:
    for name, marks in KINDS:
        if any(mark in frame for frame in frames for mark in marks):
            return name
    return "other"


def perf_profile(samples: list[tuple[int, int, list[str]]], requests: list, loop_tid: int) -> dict:
    """perf's samples in the spans of the tail requests (at or above the server's p99) beside
    those in the spans of the middle ones (p40 to p60): per request, in ms of CPU (a sample is
    1 / PERF_HZ s), by thread, by kind (KINDS), and the leaf symbols the tail has most more of."""
    served = sorted((r[1] - r[0], i) for i, r in enumerate(requests))
    n = len(served)
    groups = {"tail": [requests[i] for _, i in served[int(n * 0.99):]],
              "middle": [requests[i] for _, i in served[int(n * 0.4):int(n * 0.6)]]}
    samples.sort(key=lambda sample: sample[1])
    times = [sample[1] for sample in samples]
    ms = 1e3 / PERF_HZ
    tallies: dict[str, dict[str, dict[str, float]]] = {}
    for name, group in groups.items():
        tally: dict[str, dict[str, float]] = {"thread": {}, "kind": {}, "leaf": {}}
        for r in group:
            for t in range(bisect.bisect_left(times, r[0]), bisect.bisect_right(times, r[1])):
                tid, _at, frames = samples[t]
                for table, key in (("thread", "loop" if tid == loop_tid else "other threads"),
                                   ("kind", _kind(frames)), ("leaf", frames[0] if frames else "?")):
                    tally[table][key] = tally[table].get(key, 0.0) + ms / len(group)
        tallies[name] = tally
    out: dict = {"requests": {name: len(group) for name, group in groups.items()}}
    for table in ("thread", "kind", "leaf"):
        keys = set(tallies["tail"][table]) | set(tallies["middle"][table])
        rows = sorted(((tallies["tail"][table].get(k, 0.0), tallies["middle"][table].get(k, 0.0), k)
                       for k in keys), key=lambda row: row[1] - row[0])
        out[f"ms_per_request_by_{table}_tail_middle"] = {k: [round(t, 3), round(m, 3)]
                                                         for t, m, k in rows[:15 if table == "leaf" else None]}
    return out


def _slow_commits(commits: list) -> list[float]:
    slow = [c for c in commits if c[1] - c[0] >= SLOW_NS]
    if not slow:
        return [0, 0, 0, 0]
    return [len(slow), percentile([c[3] for c in slow], 0.5), percentile([c[2] / 1e3 for c in slow], 0.5),
            percentile([(c[1] - c[0]) / 1e3 for c in slow], 0.5)]


def analyse(hooks: dict, windows: dict[str, tuple[int, int]], client: dict[str, list[float]]) -> dict:
    out = {}
    for name, (low, high) in windows.items():
        requests = [r for r in hooks["requests"] if low <= r[0] < high]
        served = [(r[1] - r[0]) / 1e6 for r in requests]  # ms: head read -> last byte written
        p50, p99 = percentile(served, 0.5), percentile(served, 0.99)
        tail = [r for r in requests if (r[1] - r[0]) / 1e6 >= p99]
        # the process's CPU over a request's span (every task's, not this request's alone): a
        # span long for want of CPU time in the process was spent waiting, not computing
        busy = [r[3] / max(r[1] - r[0], 1) for r in requests]
        tail_busy = [r[3] / max(r[1] - r[0], 1) for r in tail]
        tail_cpu_ms = [r[3] / 1e6 for r in tail]
        causes = {"collector pass": 0, "collector pass, gen 2": 0, "ledger commit > 0.2 ms": 0,
                  "log write > 0.2 ms": 0, "none of them": 0}
        for r in tail:
            span = (r[0], r[1])
            gc_passes = _overlaps(span, hooks["passes"])
            found = False
            if gc_passes:
                causes["collector pass"] += 1
                causes["collector pass, gen 2"] += any(p[2] == 2 for p in gc_passes)
                found = True
            if _overlaps(span, hooks["commits"], SLOW_NS):
                causes["ledger commit > 0.2 ms"] += 1
                found = True
            if _overlaps(span, hooks["emits"], SLOW_NS):
                causes["log write > 0.2 ms"] += 1
                found = True
            causes["none of them"] += not found
        passes = [p for p in hooks["passes"] if low <= p[0] < high]
        commits = [(c[1] - c[0]) / 1e3 for c in hooks["commits"] if low <= c[0] < high]
        emits = [(e[1] - e[0]) / 1e3 for e in hooks["emits"] if low <= e[0] < high]
        latencies = [x * 1e3 for x in client[name]]
        out[name] = {
            "requests": len(requests),
            "client_p50_ms": percentile(latencies, 0.5), "client_p99_ms": percentile(latencies, 0.99),
            "server_p50_ms": p50, "server_p99_ms": p99, "server_max_ms": max(served),
            "tail_requests": len(tail), "tail_causes": causes,
            "process_cpu_share_of_span_p50_all_tail": [percentile(busy, 0.5), percentile(tail_busy, 0.5)],
            "process_cpu_ms_in_span_p50_all_tail": [percentile([r[3] / 1e6 for r in requests], 0.5),
                                                    percentile(tail_cpu_ms, 0.5)],
            # the event loop's thread alone: the rest of the process's is its other threads'
            "loop_thread_cpu_ms_in_span_p50_all_tail": [percentile([r[4] / 1e6 for r in requests], 0.5),
                                                        percentile([r[4] / 1e6 for r in tail], 0.5)],
            "collector_passes": {g: sum(1 for p in passes if p[2] == g) for g in (0, 1, 2)},
            "collector_pass_us_p50_max": [statistics.median([(p[1] - p[0]) / 1e3 for p in passes] or [0]),
                                          max([(p[1] - p[0]) / 1e3 for p in passes] or [0])],
            "ledger_commit_us_p50_p99_max": [percentile(commits, 0.5), percentile(commits, 0.99), max(commits)],
            # the commits above SLOW_NS: how many, their rows and their own thread's CPU (a slow
            # commit short of CPU waited in the kernel: a write behind the file system's journal)
            "slow_commits_count_rows_p50_cpu_us_p50_wall_us_p50": _slow_commits(
                [c for c in hooks["commits"] if low <= c[0] < high]),
            "log_write_us_p50_p99_max": [percentile(emits, 0.5), percentile(emits, 0.99), max(emits)],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--out")
    parser.add_argument("--perf", action="store_true",
                        help="also sample the gateway with perf (CLOCK_MONOTONIC stamps) through the first "
                             "level: what its tail requests' spans ran, native and kernel, beside the middle's")
    parser.add_argument("--hooks", help="also keep the hooks' raw record (every request's span and CPU) here")
    parser.add_argument("--calls", action="store_true",
                        help="also count the Python calls in each request's span (a profile hook: slower, "
                             "but a count, which the machine's load does not move): what the requests that "
                             "called more than the usual called")
    parser.add_argument("--sample", type=int, default=0, metavar="HZ",
                        help="also sample the loop thread's Python stack HZ times a second of CPU (SIGPROF): "
                             "what the first level's tail requests ran, beside the middle's")
    args = parser.parse_args()
    tmp = tempfile.TemporaryDirectory()
    up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    gateway = None
    log = Path(tmp.name) / "gateway.log"
    try:
        upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        config = Path(tmp.name) / "probe.toml"
        config.write_text(f'active = "bench.openai"\n[ledger]\npath = "{tmp.name}/ledger.sqlite3"\n'
                          f'[providers."bench.openai"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                          'api_key = "bench-key"\n')
        log, hooks_out = Path(tmp.name) / "gateway.log", Path(tmp.name) / "hooks.json"
        with log.open("w") as sink:
            gateway = subprocess.Popen(
                [sys.executable, "-c", HOOKS, "serve", "--config", str(config), "--port", "0",
                 "--log-level", "info"], stderr=sink,
                env={**os.environ, "TAIL_PROBE_OUT": str(hooks_out), "TAIL_PROBE_SAMPLE_HZ": str(args.sample),
                     "TAIL_PROBE_CALLS": "1" if args.calls else "0"})
        url = listening_logged(gateway, log, "the gateway") + "/v1/chat/completions"
        asyncio.run(_level(url, 1, 1.0))  # warm: connections, caches
        windows, client = {}, {}
        loads = []
        perf_data = Path(tmp.name) / "perf.data"
        for index, level in enumerate(int(x) for x in args.levels.split(",")):
            name = f"concurrency {level}"
            loads.append(os.getloadavg()[0])
            perf = None
            if args.perf and index == 0:
                perf = subprocess.Popen(["perf", "record", "-k", "CLOCK_MONOTONIC", "-F", str(PERF_HZ), "-g",
                                         "-p", str(gateway.pid), "-o", str(perf_data)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)  # (perf attached)
            low = time.perf_counter_ns() + 1_000_000_000  # (the hooks' clock is the same monotonic one)
            client[name] = asyncio.run(_level(url, level, args.seconds + 1.0))
            windows[name] = (low, time.perf_counter_ns())
            if perf is not None:
                perf.send_signal(2)
                perf.wait(60)
        gateway.send_signal(2)
        gateway.wait(30)
        hooks = json.loads(hooks_out.read_text())
        if args.hooks:
            Path(args.hooks).write_text(json.dumps({**hooks, "windows": windows}))
        result = {"load_average": [min(loads), max(loads)], "levels": analyse(hooks, windows, client)}
        if args.sample:
            first = next(iter(windows))
            low, high = windows[first]
            result["python"] = {first: python_profile(hooks["samples"],
                                                      [r for r in hooks["requests"] if low <= r[0] < high],
                                                      args.sample)}
        if args.perf:
            first = next(iter(windows))
            low, high = windows[first]
            result["perf"] = {first: perf_profile(_perf_samples(perf_data),
                                                  [r for r in hooks["requests"] if low <= r[0] < high],
                                                  gateway.pid)}
    except BaseException:
        if log.exists():
            print(log.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        for proc in (gateway, up):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
