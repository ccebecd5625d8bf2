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
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import _connect, _cpu_s, _percentile, _request, _response, closed_loop  # noqa: E402

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


LEVERS = {
    "ledger checkpoint in a thread": _ledger_checkpoint_in_the_loop,
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


def _start(lever: str, config: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(HERE), lever, "serve", "--config", str(config),
                             "--port", "0", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    line = ""
    while time.monotonic() < deadline and "listening on" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the gateway ({lever}) exited with {proc.returncode}")
    return proc, re.search(r"http://[\d.]+:\d+", line).group(0) + "/v1/chat/completions"


async def _sequential(url: str, n: int) -> list[float]:
    """n requests one after another on one keep-alive connection: each one's latency."""
    request = _request(url, {"model": "frames-1", "messages": MESSAGES})
    reader, writer = await _connect(url)
    out = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            writer.write(request)
            status, _body, _keep = await _response(reader)
            out.append(time.perf_counter() - start)
            assert status == 200, status
    finally:
        writer.close()
    return out


def run(rounds: int = 5, n: int = 400, seconds: float = 2.0) -> dict:
    variants = ["-", *LEVERS]
    tmp = tempfile.TemporaryDirectory()
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    latency: dict[str, list[float]] = {v: [] for v in variants}
    cpu1: dict[str, float] = dict.fromkeys(variants, 0.0)
    c16: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for i, variant in enumerate(variants):
            config = Path(tmp.name) / f"g{i}.toml"
            config.write_text(f'active = "sim"\n[ledger]\npath = "{tmp.name}/g{i}.sqlite3"\n'
                              '[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n')
            procs[variant], urls[variant] = _start(variant, config)

        async def main() -> None:
            for variant in variants:
                await _sequential(urls[variant], 300)  # warm: imports, caches, the ledger's pages
            for _ in range(rounds):
                for variant in variants:
                    before = _cpu_s(procs[variant].pid)
                    latency[variant] += await _sequential(urls[variant], n)
                    cpu1[variant] += _cpu_s(procs[variant].pid) - before
                for variant in variants:
                    before = _cpu_s(procs[variant].pid)
                    row = await closed_loop(urls[variant], 16, seconds)
                    row["gateway_cpu_ms_per_request"] = (_cpu_s(procs[variant].pid) - before) / row["requests"] * 1e3
                    c16[variant].append(row)

        asyncio.run(main())
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    out: dict = {"load_average": os.getloadavg()[0], "requests_c1": rounds * n, "variants": {}}
    for variant in variants:
        values = latency[variant]
        out["variants"]["as is" if variant == "-" else f"without {variant}"] = {
            "p50_ms": statistics.median(values) * 1e3, "p99_ms": _percentile(values, 0.99) * 1e3,
            "cpu_ms_per_request_c1": cpu1[variant] / len(values) * 1e3,
            "rps_c16": statistics.median(r["rps"] for r in c16[variant]),
            "cpu_ms_per_request_c16": statistics.median(r["gateway_cpu_ms_per_request"] for r in c16[variant]),
            "errors_c16": sum(r["errors"] for r in c16[variant]),
        }
    return out


def report(result: dict) -> None:
    print(f"\nthe gateway's own path (in-process upstream), each lever off in turn "
          f"(load average {result['load_average']:.1f}, {result['requests_c1']} requests at c1 each)")
    print(f"  {'variant':<44} {'p50':>8} {'p99':>8} {'CPU/req c1':>11} {'req/s c16':>10} {'CPU/req c16':>12}")
    for name, row in result["variants"].items():
        print(f"  {name:<44} {row['p50_ms']:>6.3f}ms {row['p99_ms']:>6.3f}ms {row['cpu_ms_per_request_c1']:>9.3f}ms "
              f"{row['rps_c16']:>10.0f} {row['cpu_ms_per_request_c16']:>10.3f}ms")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    report(run(rounds=2 if quick else 5, n=200 if quick else 400, seconds=1.0 if quick else 2.0))
