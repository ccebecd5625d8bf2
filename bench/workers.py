"""`relayline serve --workers 2` against one worker, at concurrency 16 (`make bench`; never part of
`make test`).

The client (raw asyncio, bench/load.py's), the upstream (bench/upstream.py) and the gateway's
workers share this machine's cores. Per run: requests/s, and the CPU each process spent per
request (from /proc), with the connections each worker held, so that a worker left idle shows.
From the CPU per request the ceiling follows: with C cores, no configuration serves more than
C / (the CPU of all processes per request) requests/s, and one worker no more than 1 / (its own
CPU per request). Then the same with the processes pinned (taskset's affinity): the client and
the upstream on one core, the gateway's workers on the other, so that one worker and two
compete for the same single core: what `--workers` gives when there is no core to scale onto.

Per request, the workers' wake-ups (voluntary context switches) and preemptions (involuntary
ones) are counted too: on a loaded machine each wake-up waits for a core, and two workers each
doing half the work wake up more often per request than one busy worker that finds several
requests ready at each wake-up.

Two references beside them: two separate gateways (one worker each, their own ledger files and
ports, 8 of the 16 clients each: no SO_REUSEPORT split and no shared SQLite file) and one gateway
with 8 clients (what half the clients cost a worker alone); and the cores themselves: a Python
loop alone on one core against one on each core at once, the work per CPU-second of each (below
1.0 would mean the two cores slow each other, as SMT siblings or a busy host would).

Run: python bench/workers.py [--seconds S] [--rounds N]; a lever's before and after, `--workers 2`
alternated between two trees: python bench/workers.py --base DIR [--pairs N] [--out FILE]
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import closed_loop, cpu_s, own_cpu_s  # noqa: E402


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in out]


def _sockets(pid: int) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of all of a process's threads: its wake-ups,
    and the times the kernel took the CPU from it while it could run."""
    voluntary = involuntary = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                voluntary += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                involuntary += int(line.split()[1])
    return voluntary, involuntary


def _pin(pid: int, cores: set[int]) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cores)


def _start(config: Path, workers: int, env: dict | None = None) -> tuple[subprocess.Popen, str, list[int]]:
    args = [sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config), "--port", "0",
            "--log-level", "warning"] + (["--workers", str(workers)] if workers > 1 else [])
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    line = ""
    deadline = time.monotonic() + 30
    while "listening on" not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
    url = re.search(r"http://[\d.]+:\d+", line).group(0) + "/v1/chat/completions"
    pids = [proc.pid]
    if workers > 1:
        while len(pids := _children(proc.pid)) < workers and time.monotonic() < deadline:
            time.sleep(0.05)
    return proc, url, pids


def _median_row(rows: list[dict]) -> dict:
    """Rounds of one configuration as one row: each figure's median (per worker for the lists)."""
    out = {}
    for key, value in rows[0].items():
        if isinstance(value, list):
            out[key] = [statistics.median(row[key][i] for row in rows) for i in range(len(value))]
        elif isinstance(value, dict):
            out[key] = {name: statistics.median(row[key].get(name, 0) for row in rows) for name in value}
        else:
            out[key] = statistics.median(row[key] for row in rows)
    return out | {"rps_each": [row["rps"] for row in rows]}


def run(seconds: float = 4.0, rounds: int = 3) -> dict:
    """The unpinned configurations `rounds` times, alternated (the order turned every round, each
    one started afresh); a row is the median of its rounds, and a scaling the median of the
    rounds' own ratios (each taken a few seconds apart, as the machine's load drifts)."""
    cores = sorted(os.sched_getaffinity(0))
    tmp = tempfile.TemporaryDirectory()
    upstream = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    port = upstream.stdout.readline().split()[1]
    config = Path(tmp.name) / "workers.toml"
    config.write_text(f'active = "u"\n[ledger]\npath = "{tmp.name}/ledger.sqlite3"\n[providers.u]\n'
                      f'family = "openai"\nbase_url = "http://127.0.0.1:{port}/v1"\napi_key = "bench-key"\n')
    separate_configs = []
    for i in (1, 2):
        own = Path(tmp.name) / f"separate{i}.toml"
        own.write_text(config.read_text().replace("ledger.sqlite3", f"ledger-{i}.sqlite3"))
        separate_configs.append(own)
    # (name, [(config, workers, clients)]): the two references with nothing shared are two separate
    # gateways, each its own ledger file and port and 8 of the 16 clients (no SO_REUSEPORT split,
    # no shared SQLite file), and one gateway with 8 clients (what half the clients cost alone)
    configurations = [("1 worker", [(config, 1, 16)]), ("2 workers", [(config, 2, 16)]),
                      ("2 separate gateways", [(own, 1, 8) for own in separate_configs]),
                      ("1 worker, 8 clients", [(separate_configs[0], 1, 8)])]
    out: dict = {"cores": len(cores), "load_average_at_start": os.getloadavg()[0], "runs": {}, "rounds": []}
    try:
        for round_ in range(rounds):
            this_round = {}
            for name, gateways in (configurations if round_ % 2 == 0 else configurations[::-1]):
                started = [_start(own, workers) for own, workers, _ in gateways]
                try:
                    targets = [(url, clients) for (_, url, _), (_, _, clients) in zip(started, gateways, strict=True)]
                    pids = [pid for _, _, own_pids in started for pid in own_pids]
                    this_round[name] = asyncio.run(_measure(targets, pids, upstream.pid, seconds))
                finally:
                    for proc, _, _ in started:
                        proc.terminate()
                        proc.wait(30)
            out["rounds"].append(this_round)
        for name, _ in configurations:
            out["runs"][name] = _median_row([r[name] for r in out["rounds"]])
        if len(cores) >= 2:
            for workers in (1, 2):
                os.sched_setaffinity(0, {cores[0]})
                _pin(upstream.pid, {cores[0]})
                proc, url, pids = _start(config, workers)
                for pid in pids:
                    _pin(pid, {cores[1]})
                try:
                    out["runs"][f"{workers} worker{'s' if workers > 1 else ''}, pinned"] = \
                        asyncio.run(_measure([(url, 16)], pids, upstream.pid, seconds))
                finally:
                    proc.terminate()
                    proc.wait(30)
                    os.sched_setaffinity(0, set(cores))
                    _pin(upstream.pid, set(cores))
    finally:
        upstream.terminate()
        upstream.wait(10)
        tmp.cleanup()
    if len(cores) >= 2:
        out["cores_scaling"] = cores_scaling(cores)
    out["load_average_at_end"] = os.getloadavg()[0]
    runs = out["runs"]

    def ratio(name: str) -> float:
        return statistics.median(r[name]["rps"] / r["1 worker"]["rps"] for r in out["rounds"])

    one, two = runs["1 worker"], runs["2 workers"]
    out["scaling"] = ratio("2 workers")
    out["scaling_separate"] = ratio("2 separate gateways")
    # the most each configuration could serve on these cores at the CPU per request measured
    out["ceiling_one_worker_rps"] = 1e3 / one["worker_cpu_ms_per_request"][0]
    out["ceiling_all_cores_rps"] = len(cores) * 1e3 / two["all_cpu_ms_per_request"]
    out["ceiling_scaling"] = out["ceiling_all_cores_rps"] / out["ceiling_one_worker_rps"]
    # ...and were two workers to spend one worker's CPU per request (theirs at 8 clients each is
    # more: "1 worker, 8 clients"), with the client's and the upstream's as measured
    out["ceiling_scaling_at_one_workers_cpu"] = len(cores) * 1e3 / one["all_cpu_ms_per_request"] / \
        out["ceiling_one_worker_rps"]
    if "1 worker, pinned" in runs and "2 workers, pinned" in runs:
        out["scaling_pinned"] = runs["2 workers, pinned"]["rps"] / runs["1 worker, pinned"]["rps"]
    return out


async def _measure(targets: list[tuple[str, int]], pids: list[int], upstream_pid: int, seconds: float) -> dict:
    """Closed loops on every (url, clients) of `targets` at once; per request, the CPU and the
    context switches of `pids` (the workers, or separate gateways), the upstream and the client."""
    for url, clients in targets:
        await closed_loop(url, clients, 1.0)  # warm: connections to the upstream, caches
    before = {pid: cpu_s(pid) for pid in pids}
    switches = {pid: _switches(pid) for pid in pids}
    upstream_before, client_before = cpu_s(upstream_pid), own_cpu_s()
    counting = _count_syscalls(pids) if shutil.which("perf") else None
    start = time.perf_counter()
    rows = await asyncio.gather(*(closed_loop(url, clients, seconds) for url, clients in targets))
    elapsed = time.perf_counter() - start
    n = max(sum(row["requests"] for row in rows), 1)
    syscalls = _syscalls_counted(counting, n) if counting is not None else {}
    workers = [(cpu_s(pid) - before[pid]) / n * 1e3 for pid in pids]
    woken = [(_switches(pid)[0] - switches[pid][0]) / n for pid in pids]
    preempted = [(_switches(pid)[1] - switches[pid][1]) / n for pid in pids]
    upstream = (cpu_s(upstream_pid) - upstream_before) / n * 1e3
    client = (own_cpu_s() - client_before) / n * 1e3
    return {"rps": sum(row["rps"] for row in rows), "p50_ms": max(row["p50_ms"] for row in rows),
            "p99_ms": max(row["p99_ms"] for row in rows), "errors": sum(row["errors"] for row in rows),
            "worker_cpu_ms_per_request": workers, "worker_busy_share": [w * n / 1e3 / elapsed for w in workers],
            "worker_sockets": [_sockets(pid) for pid in pids], "worker_wakeups_per_request": woken,
            "worker_preemptions_per_request": preempted, "upstream_cpu_ms_per_request": upstream,
            "client_cpu_ms_per_request": client, "all_cpu_ms_per_request": sum(workers) + upstream + client,
            "worker_syscalls_per_request": syscalls}


# what the workers ask of the kernel, where perf can count its syscall tracepoints: a sleep in the
# event loop's thread (SQLite's busy handler when another worker holds the ledger's write lock),
# the ledger's locks, writes and re-reads, and the wake-ups
SYSCALLS = ("clock_nanosleep", "fcntl", "pwrite64", "pread64", "epoll_wait")


def _count_syscalls(pids: list[int]) -> subprocess.Popen:
    events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
    return subprocess.Popen(["perf", "stat", "-x", ",", "-e", events, "-p", ",".join(map(str, pids))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _syscalls_counted(counting: subprocess.Popen, requests: int) -> dict:
    counting.send_signal(signal.SIGINT)
    _, err = counting.communicate(timeout=30)
    out = {}
    for line in err.splitlines():  # "count,,syscalls:sys_enter_NAME,..." (not counted: no figure)
        fields = line.split(",")
        if len(fields) > 2 and fields[0].isdigit() and "sys_enter_" in fields[2]:
            out[fields[2].split("sys_enter_")[1]] = int(fields[0]) / requests
    return out


def _python_work(n: int = 20_000) -> int:
    # shaped like the gateway's own work: small dicts and lists, JSON, bytes, calls
    total = 0
    for i in range(n):
        total += len(json.dumps({"model": "m", "i": i, "messages": [{"role": "user", "content": "hi"}]}).encode())
    return total


def _python_loop(core: int, seconds: float, results) -> None:
    os.sched_setaffinity(0, {core})
    _python_work(2_000)
    cpu, start, done = time.thread_time(), time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        _python_work()
        done += 1
    results.put(done / (time.thread_time() - cpu))


def cores_scaling(cores: list[int], seconds: float = 2.0, rounds: int = 3) -> dict:
    """What two cores give two processes that share nothing: a Python loop alone on one core,
    then one on each core at once, alternated; the work done per CPU-second of each (1.0: the
    cores do not slow each other, as SMT siblings or a host's contention would)."""
    import multiprocessing

    results = multiprocessing.get_context("fork").Queue()
    alone, paired = [], []
    for _ in range(rounds):
        for together in (cores[:1], cores[:2]):
            procs = [multiprocessing.get_context("fork").Process(target=_python_loop, args=(core, seconds, results))
                     for core in together]
            for proc in procs:
                proc.start()
            rates = [results.get(timeout=seconds + 60) for _ in procs]
            for proc in procs:
                proc.join()
            (alone if len(together) == 1 else paired).extend(rates)
    return {"alone_per_cpu_s": statistics.median(alone), "paired_per_cpu_s": statistics.median(paired),
            "paired_over_alone": statistics.median(paired) / statistics.median(alone)}


def report(result: dict) -> None:
    print(f"\n--workers at concurrency 16 ({result['cores']} cores; load average {result['load_average_at_start']:.1f} "
          f"-> {result['load_average_at_end']:.1f})")
    for name, row in result["runs"].items():
        workers = ", ".join(f"{cpu:.2f} ms ({busy:.0%} busy, {sockets} sockets)" for cpu, busy, sockets in zip(
            row["worker_cpu_ms_per_request"], row["worker_busy_share"], row["worker_sockets"], strict=True))
        print(f"  {name:<20} {row['rps']:>6.0f} req/s  p50 {row['p50_ms']} ms  errors {row['errors']}  worker CPU per "
              f"request {workers}; upstream {row['upstream_cpu_ms_per_request']:.2f} ms, client "
              f"{row['client_cpu_ms_per_request']:.2f} ms; all {row['all_cpu_ms_per_request']:.2f} ms; per request, "
              f"worker wake-ups {sum(row['worker_wakeups_per_request']):.2f}, preemptions "
              f"{sum(row['worker_preemptions_per_request']):.2f}"
              + "".join(f", {name} {count:.3f}" for name, count in row.get("worker_syscalls_per_request", {}).items()))
    if "scaling" in result:
        print(f"  2 workers over 1: {result['scaling']:.2f}x; the ceiling at this CPU per request: one worker "
              f"{result['ceiling_one_worker_rps']:.0f} req/s, all cores {result['ceiling_all_cores_rps']:.0f} req/s "
              f"({result['ceiling_scaling']:.2f}x)")
    if "scaling_separate" in result:
        print(f"  2 separate gateways (own ledger files and ports, 8 clients each) over 1 worker: "
              f"{result['scaling_separate']:.2f}x; were two workers to spend one worker's CPU per request: "
              f"{result['ceiling_scaling_at_one_workers_cpu']:.2f}x")
    if "cores_scaling" in result:
        print(f"  the cores themselves: a Python loop's work per CPU-second, one on each core over one alone: "
              f"{result['cores_scaling']['paired_over_alone']:.2f}")
    if "scaling_pinned" in result:
        print(f"  pinned (client and upstream on one core, the workers on the other): 2 workers over 1: "
              f"{result['scaling_pinned']:.2f}x")


def compare_trees(base: str, pairs: int = 4, seconds: float = 5.0) -> dict:
    """`--workers 2` at 16 clients on `base`'s package and on this tree's, alternated (a lever's
    before and after: the figures above per side, each run its own ledger file)."""
    from common import tree_env

    tmp = tempfile.TemporaryDirectory()
    upstream = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    port = upstream.stdout.readline().split()[1]
    envs = {"before": tree_env(base), "after": tree_env(None)}
    sides: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for pair in range(pairs):
            for side in (("before", "after") if pair % 2 == 0 else ("after", "before")):
                config = Path(tmp.name) / f"{side}{pair}.toml"
                config.write_text(f'active = "u"\n[ledger]\npath = "{tmp.name}/{side}{pair}.sqlite3"\n'
                                  f'[providers.u]\nfamily = "openai"\nbase_url = "http://127.0.0.1:{port}/v1"\n'
                                  'api_key = "bench-key"\n')
                proc, url, pids = _start(config, 2, envs[side])
                try:
                    sides[side].append(asyncio.run(_measure([(url, 16)], pids, upstream.pid, seconds))
                                       | {"load_average": os.getloadavg()[0]})
                finally:
                    proc.terminate()
                    proc.wait(30)
    finally:
        upstream.terminate()
        upstream.wait(10)
        tmp.cleanup()
    return {side: {"runs": rows, **_median_row(rows)} for side, rows in sides.items()}


if __name__ == "__main__":
    seconds = float(sys.argv[sys.argv.index("--seconds") + 1]) if "--seconds" in sys.argv else 4.0
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 3
    if "--base" in sys.argv:  # python bench/workers.py --base DIR [--pairs N] [--out FILE]
        pairs = int(sys.argv[sys.argv.index("--pairs") + 1]) if "--pairs" in sys.argv else 4
        compared = compare_trees(sys.argv[sys.argv.index("--base") + 1], pairs, seconds)
        for side, row in compared.items():
            print(f"  {side:6} {row['rps']:>6.0f} req/s (each {row['rps_each']}), workers' CPU per request "
                  f"{sum(row['worker_cpu_ms_per_request']):.3f} ms"
                  + "".join(f", {name} {count:.4f}" for name, count in row["worker_syscalls_per_request"].items()))
        if "--out" in sys.argv:
            Path(sys.argv[sys.argv.index("--out") + 1]).write_text(json.dumps(compared, indent=1) + "\n")
    else:
        report(run(seconds, rounds))
