"""Side-by-side HTTP benchmarks in one run, against one loopback upstream process:

    direct    httpx straight to the upstream: the physical limit of this machine
    gateway   the relayline gateway (`relayline serve`, its own process) in front of it
    library   `Relay.complete` / `Relay.stream` in process, OpenAI adapter over HTTP
    litellm   LiteLLM's Router in front of it (its own process, asyncio; skipped if absent)

Rounds interleave the methods so that machine noise hits them alike; every figure is reported
with the direct figure of the same run beside it. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import trio

HERE = Path(__file__).resolve().parent
MESSAGES = [{"role": "user", "content": "hi"}]


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Processes:
    """The upstream and the gateway, each in its own process, stopped on exit."""

    def __init__(self, hold_s: float = 5.0, log_args: tuple[str, ...] = ("--log-level", "warning")) -> None:
        self.hold_s = hold_s
        # the gateway's stderr is read only up to "listening on": access lines (info) would fill
        # the pipe, and logging is measured on its own (bench/ops.py)
        self.log_args = log_args
        self.procs: list[subprocess.Popen] = []
        self.tmp = tempfile.TemporaryDirectory()

    def __enter__(self) -> Processes:
        up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0", str(self.hold_s)],
                              stdout=subprocess.PIPE, text=True)
        self.procs.append(up)
        self.upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        config = Path(self.tmp.name) / "bench.toml"
        config.write_text(textwrap.dedent(f"""
            active = "bench.upstream"
            [ledger]
            path = "{self.tmp.name}/ledger.sqlite3"
            [providers."bench.upstream"]
            family = "openai"
            base_url = "{self.upstream}/v1"
            api_key = "bench-key"
            """))
        self.config_text = config.read_text()
        gw = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config),
                               "--port", "0", *self.log_args], stderr=subprocess.PIPE, text=True)
        self.procs.append(gw)
        self.gateway_pid = gw.pid
        deadline = time.monotonic() + 30
        line = ""
        while time.monotonic() < deadline and "listening on" not in line:
            line = gw.stderr.readline()
        self.gateway = re.search(r"http://[\d.]+:\d+", line).group(0)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.tmp.cleanup()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- trio-side measurements ----------------------------------------------------------------------


async def _timed_posts(client: httpx.AsyncClient, url: str, n: int, model: str = "frames-1") -> list[float]:
    out = []
    body = {"model": model, "messages": MESSAGES}
    for _ in range(n):
        start = time.perf_counter()
        response = await client.post(url, json=body)
        response.read()
        assert response.status_code == 200, response.text
        out.append(time.perf_counter() - start)
    return out


async def _library_calls(relay, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await relay.complete(MESSAGES, model="frames-1")
        out.append(time.perf_counter() - start)
    return out


async def _throughput(client: httpx.AsyncClient, url: str, concurrency: int, total: int) -> float:
    body = {"model": "frames-1", "messages": MESSAGES}
    per_worker = total // concurrency

    async def worker():
        for _ in range(per_worker):
            response = await client.post(url, json=body)
            assert response.status_code == 200

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    return per_worker * concurrency / (time.perf_counter() - start)


async def _stream_timing(client: httpx.AsyncClient, url: str, frames: int) -> tuple[float, float]:
    """(time to first content byte, total time) for one streamed request."""
    start = time.perf_counter()
    first = None
    seen = 0
    async with client.stream("POST", url, json={"model": f"frames-{frames}", "messages": MESSAGES, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if '"content":" w' in line:
                seen += 1
                if first is None:
                    first = time.perf_counter() - start
        if seen != frames:
            raise AssertionError(f"{seen} of {frames} frames; last line {line[:300]!r}")
    return first, time.perf_counter() - start


async def _library_stream_timing(relay, frames: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    seen = 0
    async with relay.stream(MESSAGES, model=f"frames-{frames}") as turn:
        async for _event in turn:
            seen += 1
            if first is None:
                first = time.perf_counter() - start
    assert seen == frames and turn.outcome == "ok", (seen, turn.outcome)
    return first, time.perf_counter() - start


async def _held_streams(client: httpx.AsyncClient, url: str, count: int) -> tuple[int, int]:
    """Open `count` concurrent streams that stay in flight; returns (ok, errors)."""
    ok = errors = 0

    async def one():
        nonlocal ok, errors
        try:
            async with client.stream("POST", url, json={"model": "hold-2", "messages": MESSAGES, "stream": True},
                                     timeout=60) as r:
                text = "".join([line async for line in r.aiter_lines()])
            ok += "[DONE]" in text
            errors += "[DONE]" not in text
        except httpx.HTTPError:
            errors += 1

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return ok, errors


def run_trio_side(procs: Processes, *, rounds: int, n: int) -> dict:
    from relayline.adapters import Relay

    results: dict = {"latency": {"direct": [], "gateway": [], "library": []}}

    async def main():
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client, \
                Relay.from_toml(procs.config_text, env={}) as relay:
            direct_url = f"{procs.upstream}/v1/chat/completions"
            gateway_url = f"{procs.gateway}/v1/chat/completions"
            await _timed_posts(client, direct_url, 50)  # warm up connections and caches
            await _timed_posts(client, gateway_url, 50)
            await _library_calls(relay, 50)
            for _ in range(rounds):
                results["latency"]["direct"] += await _timed_posts(client, direct_url, n)
                results["latency"]["gateway"] += await _timed_posts(client, gateway_url, n)
                results["latency"]["library"] += await _library_calls(relay, n)
            results["throughput"] = {}
            for concurrency in (1, 16, 64):
                total = 64 * 8 if concurrency > 1 else 300
                results["throughput"][concurrency] = {
                    "direct": await _throughput(client, direct_url, concurrency, total),
                    "gateway": await _throughput(client, gateway_url, concurrency, total),
                }
            stream = {"direct": [], "gateway": [], "library": []}
            for _ in range(rounds * 5):
                stream["direct"].append(await _stream_timing(client, direct_url, 200))
                stream["gateway"].append(await _stream_timing(client, gateway_url, 200))
                stream["library"].append(await _library_stream_timing(relay, 200))
            results["stream"] = stream
            before = rss_kib(procs.gateway_pid)
            async with trio.open_nursery() as nursery:
                peak = [before]

                async def sample():
                    while True:
                        peak[0] = max(peak[0], rss_kib(procs.gateway_pid))
                        await trio.sleep(0.05)

                nursery.start_soon(sample)
                ok, errors = await _held_streams(client, gateway_url, 1000)
                nursery.cancel_scope.cancel()
            results["held"] = {"streams": 1000, "ok": ok, "errors": errors, "gateway_rss_before_kib": before,
                               "gateway_rss_peak_kib": peak[0]}

    trio.run(main)
    return results


# -- LiteLLM, in its own process (asyncio) --------------------------------------------------------

LITELLM_SCRIPT = r"""
import asyncio, json, os, sys, time
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import httpx, litellm
litellm.telemetry = False
litellm.suppress_debug_info = True
upstream, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
router = litellm.Router(model_list=[{"model_name": "bench", "litellm_params": {
    "model": "openai/frames-1", "api_base": upstream + "/v1", "api_key": "bench-key"}}], num_retries=0)
messages = [{"role": "user", "content": "hi"}]

async def main():
    out = {"direct": [], "litellm": []}
    async with httpx.AsyncClient(timeout=60) as client:
        async def direct():
            t = time.perf_counter()
            r = await client.post(upstream + "/v1/chat/completions", json={"model": "frames-1", "messages": messages})
            assert r.status_code == 200
            return time.perf_counter() - t
        async def lite():
            t = time.perf_counter()
            await router.acompletion(model="bench", messages=messages)
            return time.perf_counter() - t
        for _ in range(50):
            await direct(); await lite()
        for _ in range(rounds):
            out["direct"] += [await direct() for _ in range(n)]
            out["litellm"] += [await lite() for _ in range(n)]
        out["throughput"] = {}
        for c in (1, 16, 64):
            total = 300 if c == 1 else 512
            per = total // c
            async def worker(fn):
                for _ in range(per):
                    await fn()
            for name, fn in (("direct", direct), ("litellm", lite)):
                t = time.perf_counter()
                await asyncio.gather(*(worker(fn) for _ in range(c)))
                out["throughput"].setdefault(str(c), {})[name] = per * c / (time.perf_counter() - t)
    print(json.dumps(out))

asyncio.run(main())
"""


def run_litellm(upstream: str, *, rounds: int, n: int) -> dict | None:
    import importlib.util

    if importlib.util.find_spec("litellm") is None:
        return None
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    out = subprocess.run([sys.executable, "-c", LITELLM_SCRIPT, upstream, str(rounds), str(n)],
                         capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        print(f"litellm run failed: {out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(trio_side: dict, lite: dict | None) -> dict:
    lat = trio_side["latency"]
    direct_p50, direct_p99 = statistics.median(lat["direct"]), _percentile(lat["direct"], 0.99)
    summary = {"latency_ms": {}, "throughput_rps": {}, "stream": {}, "held": trio_side["held"]}
    for name in ("direct", "gateway", "library"):
        p50, p99 = statistics.median(lat[name]), _percentile(lat[name], 0.99)
        summary["latency_ms"][name] = {"p50": p50 * 1e3, "p99": p99 * 1e3,
                                       "added_p50": (p50 - direct_p50) * 1e3, "added_p99": (p99 - direct_p99) * 1e3,
                                       "ratio_p50": p50 / direct_p50}
    for c, row in trio_side["throughput"].items():
        summary["throughput_rps"][str(c)] = dict(row)
    s = trio_side["stream"]
    for name in ("direct", "gateway", "library"):
        ttfb = statistics.median(x[0] for x in s[name])
        total = statistics.median(x[1] for x in s[name])
        summary["stream"][name] = {"ttfb_ms": ttfb * 1e3, "total_ms": total * 1e3}
    d = summary["stream"]["direct"]
    for name in ("gateway", "library"):
        summary["stream"][name]["per_frame_added_us"] = (summary["stream"][name]["total_ms"] - d["total_ms"]) * 1e3 / 200
    h = trio_side["held"]
    h["gateway_kib_per_stream"] = (h["gateway_rss_peak_kib"] - h["gateway_rss_before_kib"]) / h["streams"]
    if lite is not None:
        lp50 = statistics.median(lite["litellm"])
        dp50 = statistics.median(lite["direct"])
        summary["latency_ms"]["litellm"] = {"p50": lp50 * 1e3, "p99": _percentile(lite["litellm"], 0.99) * 1e3,
                                            "added_p50": (lp50 - dp50) * 1e3,
                                            "added_p99": (_percentile(lite["litellm"], 0.99) - _percentile(lite["direct"], 0.99)) * 1e3,
                                            "ratio_p50": lp50 / dp50, "direct_p50_same_loop": dp50 * 1e3}
        for c, row in lite["throughput"].items():
            summary["throughput_rps"].setdefault(c, {})["litellm"] = row["litellm"]
            summary["throughput_rps"][c]["direct_asyncio"] = row["direct"]
    return summary
