"""Side-by-side HTTP benchmarks in one run, against one loopback upstream process:

    direct    httpx straight to the upstream: the physical limit of this machine
    gateway   the relayline gateway (`relayline serve`, its own process) in front of it
    library   `Relay.complete` / `Relay.stream` in process, OpenAI adapter over HTTP
    litellm   LiteLLM's Router in front of it (its own process, asyncio; skipped if absent)
    portkey   Portkey's gateway (`@portkey-ai/gateway` from npm, Node) in front of it, its own
              process, told where the upstream is by its headers (skipped without a Portkey
              install: PORTKEY_GATEWAY_DIR names its package directory)

`python bench/peers.py [--base DIR]` runs the side-by-side table alone (`run_side_by_side`):
the gateway, Portkey and LiteLLM beside direct, and with `--base` the gateway of another tree
(a checkout before a lever) in the same rounds.

Rounds interleave the methods so that machine noise hits them alike; every figure is reported
with the direct figure of the same run beside it. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import trio
from common import (
    MESSAGES,
    cpu_s,
    library_stream_timing,
    listening,
    listening_logged,
    percentile,
    row_throughput,
    rss_kib,
    stop,
    stream_timing,
    timed_posts,
)

HERE = Path(__file__).resolve().parent


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
        self.config_path = config
        self.gateway, self.gateway_pid = self.start_gateway()
        return self

    def start_gateway(self, *extra: str, config: Path | None = None, env: dict | None = None) -> tuple[str, int]:
        """Another `relayline serve` (e.g. `--workers 2`, another config, another tree's `env`):
        its URL and pid."""
        command = [sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config or self.config_path),
                   "--port", "0", *self.log_args, *extra]
        if self.log_args[-1] in ("info", "debug"):  # two lines a request: to a file, not a pipe
            log = Path(self.tmp.name) / f"gateway-{len(self.procs)}.log"
            with log.open("w") as sink:
                gw = subprocess.Popen(command, stderr=sink, env=env)
            self.procs.append(gw)
            return listening_logged(gw, log), gw.pid
        gw = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.procs.append(gw)
        url = listening(gw)
        return url, gw.pid

    def __exit__(self, *exc) -> None:
        stop(self.procs)
        self.tmp.cleanup()


# -- trio-side measurements ----------------------------------------------------------------------


async def _library_calls(relay, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await relay.complete(MESSAGES, model="frames-1")
        out.append(time.perf_counter() - start)
    return out


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


def run_trio_side(procs: Processes, *, rounds: int, n: int, throughput_rounds: int = 5) -> dict:
    from relayline.adapters import Relay

    # the gateway's own CPU while it served each kind of request: what it costs whatever the load
    results: dict = {"latency": {"direct": [], "gateway": [], "library": []},
                     "gateway_cpu_s": {"latency": 0.0, "in_process_upstream": 0.0, "stream_1": 0.0, "stream_200": 0.0}}

    async def main():
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client, \
                Relay.from_toml(procs.config_text, env={}) as relay:
            direct_url = f"{procs.upstream}/v1/chat/completions"
            gateway_url = f"{procs.gateway}/v1/chat/completions"
            # started first: its workers are up and warm long before it is measured
            workers_url = f"{procs.start_gateway('--workers', '2')[0]}/v1/chat/completions"
            # the same gateway with an in-process upstream: what the upstream HTTP call costs it
            sim_config = Path(procs.tmp.name) / "sim.toml"
            sim_config.write_text(f'active = "sim"\n[ledger]\npath = "{procs.tmp.name}/sim.sqlite3"\n'
                                  '[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n')
            sim_url, sim_pid = procs.start_gateway(config=sim_config)
            sim_url += "/v1/chat/completions"
            await timed_posts(client, direct_url, 50)  # warm up connections and caches
            await timed_posts(client, gateway_url, 50)
            await _library_calls(relay, 50)
            await timed_posts(client, sim_url, 50)
            for _ in range(rounds):
                before = cpu_s(sim_pid)
                await timed_posts(client, sim_url, n)
                results["gateway_cpu_s"]["in_process_upstream"] += cpu_s(sim_pid) - before
                results["latency"]["direct"] += await timed_posts(client, direct_url, n)
                before = cpu_s(procs.gateway_pid)
                results["latency"]["gateway"] += await timed_posts(client, gateway_url, n)
                results["gateway_cpu_s"]["latency"] += cpu_s(procs.gateway_pid) - before
                results["latency"]["library"] += await _library_calls(relay, n)
            results["throughput"] = {}
            results["throughput_rounds"] = {}
            results["throughput_client_cpu_ms"] = {}
            await timed_posts(client, workers_url, 50)
            urls = {"direct": direct_url, "gateway": gateway_url, "gateway_2_workers": workers_url}
            for concurrency in (1, 16, 64):
                total = 64 * 8 if concurrency > 1 else 300
                # one round of each is a fraction of a second, and the machine moves a round's figure by
                # 20-40%: medians of alternated rounds, the order turned each round, as bench/load.py does
                rps: dict[str, list[float]] = {name: [] for name in urls}
                cpu: dict[str, list[float]] = {"direct": [], "gateway": []}
                for turn in range(throughput_rounds if concurrency < 64 else min(3, throughput_rounds)):
                    for name in (list(urls) if turn % 2 == 0 else list(urls)[::-1]):
                        rps[name].append(await row_throughput(urls[name], concurrency, total, cpu.get(name)))
                results["throughput"][concurrency] = {k: statistics.median(v) for k, v in rps.items()}
                results["throughput_rounds"][concurrency] = rps
                results["throughput_client_cpu_ms"][concurrency] = {k: statistics.median(v) for k, v in cpu.items()}
            # 200-frame and 1-frame streams: the difference is what the 199 more frames cost
            stream: dict = {f"{name}_{frames}": [] for name in ("direct", "gateway", "library") for frames in (1, 200)}
            for _ in range(rounds * 10):
                for frames in (1, 200):
                    stream[f"direct_{frames}"].append(await stream_timing(client, direct_url, frames))
                    before = cpu_s(procs.gateway_pid)
                    stream[f"gateway_{frames}"].append(await stream_timing(client, gateway_url, frames))
                    results["gateway_cpu_s"][f"stream_{frames}"] += cpu_s(procs.gateway_pid) - before
                    stream[f"library_{frames}"].append(await library_stream_timing(relay, frames))
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
stream_router = litellm.Router(model_list=[{"model_name": f"bench-{n}", "litellm_params": {
    "model": f"openai/frames-{n}", "api_base": upstream + "/v1", "api_key": "bench-key"}} for n in (1, 200)],
    num_retries=0)
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
        async def direct_stream(frames):
            t = time.perf_counter()
            first = None
            async with client.stream("POST", upstream + "/v1/chat/completions", json={
                    "model": f"frames-{frames}", "messages": messages, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if first is None and '"content":" w' in line:
                        first = time.perf_counter() - t
            return first, time.perf_counter() - t
        async def lite_stream(frames):
            t = time.perf_counter()
            first = None
            seen = 0
            response = await stream_router.acompletion(model=f"bench-{frames}", messages=messages, stream=True)
            async for chunk in response:
                if chunk.choices and chunk.choices[0].delta.content:
                    seen += 1
                    if first is None:
                        first = time.perf_counter() - t
            assert seen == frames, seen
            return first, time.perf_counter() - t
        out["stream"] = {f"{name}_{frames}": [] for name in ("direct", "litellm") for frames in (1, 200)}
        for frames in (1, 200):
            await direct_stream(frames); await lite_stream(frames)
        for _ in range(rounds * 5):
            for frames in (1, 200):
                out["stream"][f"direct_{frames}"].append(await direct_stream(frames))
                out["stream"][f"litellm_{frames}"].append(await lite_stream(frames))
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


def raw_throughput(procs: Processes, rounds: int = 3, seconds: float = 2.0) -> dict:
    """The throughput rows measured again with bench/load.py's raw asyncio client (0.04 ms of
    CPU a request direct, where the httpx client spends about 1 ms): the same two targets, direct
    and the gateway alternated, each round; per concurrency the medians of requests/s and of the
    client's CPU per request. With httpx the client shares the two cores with what it measures,
    and direct at 16 clients is bound by its own client."""
    import asyncio

    from common import closed_loop

    urls = {"direct": f"{procs.upstream}/v1/chat/completions", "gateway": f"{procs.gateway}/v1/chat/completions"}

    async def main() -> dict:
        out: dict = {}
        for concurrency in (1, 16):
            runs: dict[str, list[dict]] = {name: [] for name in urls}
            for _ in range(rounds):
                for name, url in urls.items():
                    runs[name].append(await closed_loop(url, concurrency, seconds))
            out[str(concurrency)] = {name: {
                "rps": statistics.median(r["rps"] for r in rows),
                "client_cpu_ms_per_request": statistics.median(r["client_cpu_ms_per_request"] for r in rows)}
                for name, rows in runs.items()}
        return out

    return asyncio.run(main())


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


def stream_row(runs: dict, name: str, base: str) -> dict:
    """First byte and per frame for `name`, beside `base` of the same run. Per frame is the slope
    between the 1-frame and the 200-frame stream, so no fixed per-request cost hides in it."""
    def med(key: str, i: int) -> float:
        return statistics.median(x[i] for x in runs[key])

    ttfb, total, one = med(f"{name}_200", 0), med(f"{name}_200", 1), med(f"{name}_1", 1)
    base_ttfb, base_total, base_one = med(f"{base}_200", 0), med(f"{base}_200", 1), med(f"{base}_1", 1)
    return {"ttfb_ms": ttfb * 1e3, "total_ms": total * 1e3, "one_frame_total_ms": one * 1e3,
            "first_byte_added_ms": (ttfb - base_ttfb) * 1e3, "per_frame_us": (total - one) / 199 * 1e6,
            "per_frame_added_us": ((total - one) - (base_total - base_one)) / 199 * 1e6}


def summarise(trio_side: dict, lite: dict | None) -> dict:
    lat = trio_side["latency"]
    direct_p50, direct_p99 = statistics.median(lat["direct"]), percentile(lat["direct"], 0.99)
    summary = {"latency_ms": {}, "throughput_rps": {}, "stream": {}, "held": trio_side["held"]}
    for name in ("direct", "gateway", "library"):
        p50, p99 = statistics.median(lat[name]), percentile(lat[name], 0.99)
        summary["latency_ms"][name] = {"p50": p50 * 1e3, "p99": p99 * 1e3,
                                       "added_p50": (p50 - direct_p50) * 1e3, "added_p99": (p99 - direct_p99) * 1e3,
                                       "ratio_p50": p50 / direct_p50}
    for c, row in trio_side["throughput"].items():
        summary["throughput_rps"][str(c)] = dict(row)
    summary["throughput_client_cpu_ms"] = {str(c): row for c, row in trio_side["throughput_client_cpu_ms"].items()}
    summary["throughput_rounds_rps"] = {str(c): row for c, row in trio_side["throughput_rounds"].items()}
    if "throughput_raw" in trio_side:
        summary["throughput_raw"] = trio_side["throughput_raw"]
    for name in ("direct", "gateway", "library"):
        summary["stream"][name] = stream_row(trio_side["stream"], name, "direct")
    cpu, runs = trio_side["gateway_cpu_s"], len(trio_side["stream"]["gateway_200"])
    summary["gateway_cpu"] = {"ms_per_request": cpu["latency"] / len(lat["gateway"]) * 1e3,
                              "ms_per_request_in_process_upstream": cpu["in_process_upstream"] / len(lat["gateway"]) * 1e3,
                              "us_per_frame": (cpu["stream_200"] - cpu["stream_1"]) / runs / 199 * 1e6}
    h = trio_side["held"]
    h["gateway_kib_per_stream"] = (h["gateway_rss_peak_kib"] - h["gateway_rss_before_kib"]) / h["streams"]
    if lite is not None:
        lp50 = statistics.median(lite["litellm"])
        dp50 = statistics.median(lite["direct"])
        summary["latency_ms"]["litellm"] = {"p50": lp50 * 1e3, "p99": percentile(lite["litellm"], 0.99) * 1e3,
                                            "added_p50": (lp50 - dp50) * 1e3,
                                            "added_p99": (percentile(lite["litellm"], 0.99) - percentile(lite["direct"], 0.99)) * 1e3,
                                            "ratio_p50": lp50 / dp50, "direct_p50_same_loop": dp50 * 1e3}
        for c, row in lite["throughput"].items():
            summary["throughput_rps"].setdefault(c, {})["litellm"] = row["litellm"]
            summary["throughput_rps"][c]["direct_asyncio"] = row["direct"]
        if "stream" in lite:
            summary["stream"]["litellm"] = stream_row(lite["stream"], "litellm", "direct")
    summary["targets"] = targets(summary)
    return summary


def targets(summary: dict) -> list[dict]:
    """The performance targets this run measures, each with its figure, LiteLLM's where it has one,
    and whether it holds."""
    lat, rps, stream = summary["latency_ms"], summary["throughput_rps"], summary["stream"]
    lite_lat, lite_stream = lat.get("litellm"), stream.get("litellm")
    rows = []

    def row(name: str, value: float, limit: float, unit: str, lite_value: float | None = None, *,
            at_least: bool = False) -> None:
        holds = value >= limit if at_least else value <= limit
        rows.append({"target": name, "value": value, "limit": limit, "unit": unit, "at_least": at_least,
                     "holds": holds, "litellm": lite_value})

    row("gateway added latency p50 (non-streaming, concurrency 1)", lat["gateway"]["added_p50"], 1.0, "ms",
        lite_lat and lite_lat["added_p50"])
    row("gateway added latency p99 (non-streaming, concurrency 1)", lat["gateway"]["added_p99"], 3.0, "ms",
        lite_lat and lite_lat["added_p99"])
    for name in ("gateway", "library"):
        row(f"{name} stream: first byte added", stream[name]["first_byte_added_ms"], 1.0, "ms",
            lite_stream and lite_stream["first_byte_added_ms"])
        row(f"{name} stream: added per frame, end to end", stream[name]["per_frame_added_us"], 10.0, "µs",
            lite_stream and lite_stream["per_frame_added_us"])
    for c in ("1", "16"):
        share = rps[c]["gateway"] / rps[c]["direct"] * 100
        lite_share = rps[c]["litellm"] / rps[c]["direct_asyncio"] * 100 if "litellm" in rps[c] else None
        row(f"throughput at concurrency {c}, one worker, share of direct", share, 60.0, "%", lite_share,
            at_least=True)
    for c, raw in summary.get("throughput_raw", {}).items():
        # the same target, measured with a client that does not share the cores with what it measures
        row(f"throughput at concurrency {c}, one worker, share of direct (raw asyncio clients, bench/load.py's)",
            raw["gateway"]["rps"] / raw["direct"]["rps"] * 100, 60.0, "%", at_least=True)
    scaling = rps["16"]["gateway_2_workers"] / rps["16"]["gateway"]
    row("throughput with --workers 2 over 1 worker, concurrency 16 (near-linear: 1.6x)", scaling, 1.6, "x",
        at_least=True)
    held = summary["held"]
    row(f"memory per in-flight stream, {held['streams']} concurrent through the gateway",
        held["gateway_kib_per_stream"], 32.0, "KiB")
    row(f"{held['streams']} concurrent streams, errors", held["errors"], 0, "errors")
    return rows


# -- side by side: the gateway, Portkey and LiteLLM in one run --------------------------------------


def portkey_dir() -> Path | None:
    """Portkey's package directory (`npm install @portkey-ai/gateway@1.15.2` with
    `"overrides": {"@hono/node-server": "1.13.5"}`: later node-servers stop its streams), or None."""
    where = os.environ.get("PORTKEY_GATEWAY_DIR")
    return Path(where) if where and (Path(where) / "build" / "start-server.js").exists() else None


def start_portkey(procs: Processes, where: Path) -> tuple[str, int]:
    import socket

    with socket.socket() as probe:  # a free port: Portkey takes one on its command line
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(["node", "build/start-server.js", f"--port={port}", "--headless"], cwd=where,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.procs.append(proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return f"http://127.0.0.1:{port}", proc.pid
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("Portkey did not listen within 30 s")


def run_side_by_side(procs: Processes, *, rounds: int, n: int, base: str | None = None,
                     throughput_rounds: int = 3) -> dict:
    """Per system (the gateway; the gateway of tree `base`; Portkey), beside direct in the same
    rounds: latency at concurrency 1, each process's CPU a request, first byte and per frame of
    200-frame streams, requests/s at 16 clients, RSS at the end."""
    from common import threads_cpu_s, tree_env

    systems: dict[str, dict] = {"gateway": {"url": procs.gateway, "pid": procs.gateway_pid, "headers": {}}}
    if base:
        url, pid = procs.start_gateway(env=tree_env(base))
        systems["gateway_before"] = {"url": url, "pid": pid, "headers": {}}
    where = portkey_dir()
    if where is not None:
        url, pid = start_portkey(procs, where)
        systems["portkey"] = {"url": url, "pid": pid, "headers": {
            "x-portkey-provider": "openai", "x-portkey-custom-host": f"{procs.upstream}/v1",
            "authorization": "Bearer bench-key"}}
    names = ["direct", *systems]
    urls = {"direct": f"{procs.upstream}/v1/chat/completions",
            **{name: f"{s['url']}/v1/chat/completions" for name, s in systems.items()}}
    headers = {"direct": {}, **{name: s["headers"] for name, s in systems.items()}}
    out: dict = {"latency": {name: [] for name in names}, "cpu_s": {name: 0.0 for name in systems},
                 "stream": {f"{name}_{frames}": [] for name in names for frames in (1, 200)},
                 "stream_cpu_s": {f"{name}_{frames}": 0.0 for name in systems for frames in (1, 200)},
                 "throughput_16": {name: [] for name in names}}

    async def main() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        clients = {name: httpx.AsyncClient(limits=limits, timeout=60, headers=headers[name]) for name in names}
        try:
            for name in names:
                await timed_posts(clients[name], urls[name], 100)  # warm
                await stream_timing(clients[name], urls[name], 200)
            for round_ in range(rounds):
                for name in (names if round_ % 2 == 0 else names[::-1]):
                    pid = systems[name]["pid"] if name in systems else None
                    before = threads_cpu_s(pid) if pid else 0.0
                    out["latency"][name] += await timed_posts(clients[name], urls[name], n)
                    if pid:
                        out["cpu_s"][name] += threads_cpu_s(pid) - before
                for _ in range(5):
                    for name in (names if round_ % 2 == 0 else names[::-1]):
                        pid = systems[name]["pid"] if name in systems else None
                        for frames in (1, 200):
                            before = threads_cpu_s(pid) if pid else 0.0
                            out["stream"][f"{name}_{frames}"].append(
                                await stream_timing(clients[name], urls[name], frames))
                            if pid:
                                out["stream_cpu_s"][f"{name}_{frames}"] += threads_cpu_s(pid) - before
            for round_ in range(throughput_rounds):
                for name in (names if round_ % 2 == 0 else names[::-1]):
                    out["throughput_16"][name].append(await row_throughput(urls[name], 16, 16 * 32,
                                                                           headers=headers[name]))
        finally:
            for client in clients.values():
                await client.aclose()

    trio.run(main)
    out["rss_kib"] = {name: rss_kib(s["pid"]) for name, s in systems.items()}
    out["requests_c1"] = rounds * n
    out["streams_each"] = rounds * 5
    return out


def side_by_side_rows(run: dict, lite: dict | None) -> list[dict]:
    """One row per system: added p50 and p99 at concurrency 1 (minus direct's in the same
    rounds), requests/s at 16 clients, its process's CPU a request, first byte and per frame
    added over direct, RSS after."""
    lat, rows = run["latency"], []
    d50, d99 = statistics.median(lat["direct"]), percentile(lat["direct"], 0.99)
    for name in (n for n in lat if n != "direct"):
        stream = stream_row(run["stream"], name, "direct")
        frames = run["stream_cpu_s"]
        rows.append({
            "system": name, "added_p50_ms": (statistics.median(lat[name]) - d50) * 1e3,
            "added_p99_ms": (percentile(lat[name], 0.99) - d99) * 1e3,
            "p99_over_p50": percentile(lat[name], 0.99) / statistics.median(lat[name]),
            "rps_16": statistics.median(run["throughput_16"][name]),
            "direct_rps_16": statistics.median(run["throughput_16"]["direct"]),
            "cpu_ms_per_request": run["cpu_s"][name] / run["requests_c1"] * 1e3,
            "first_byte_added_ms": stream["first_byte_added_ms"], "per_frame_added_us": stream["per_frame_added_us"],
            "cpu_us_per_frame": (frames[f"{name}_200"] - frames[f"{name}_1"]) / run["streams_each"] / 199 * 1e6,
            "rss_after_mib": run["rss_kib"][name] / 1024})
    if lite is not None:
        stream = stream_row(lite["stream"], "litellm", "direct")
        l50, l99 = statistics.median(lite["litellm"]), percentile(lite["litellm"], 0.99)
        rows.append({"system": "litellm (Router, in process)", "added_p50_ms": (l50 - statistics.median(lite["direct"])) * 1e3,
                     "added_p99_ms": (l99 - percentile(lite["direct"], 0.99)) * 1e3, "p99_over_p50": l99 / l50,
                     "rps_16": lite["throughput"]["16"]["litellm"], "direct_rps_16": lite["throughput"]["16"]["direct"],
                     "cpu_ms_per_request": None, "first_byte_added_ms": stream["first_byte_added_ms"],
                     "per_frame_added_us": stream["per_frame_added_us"], "cpu_us_per_frame": None, "rss_after_mib": None})
    return rows


def print_side_by_side(rows: list[dict]) -> None:
    def fmt(value, spec: str, unit: str) -> str:
        return "n/a" if value is None else f"{format(value, spec)} {unit}"

    print("\n| system | added p50, c1 | added p99, c1 | p99/p50 | req/s, c16 (direct) | CPU a request | "
          "first byte added | added per frame | CPU per frame | RSS after |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['system']} | {r['added_p50_ms']:.2f} ms | {r['added_p99_ms']:.2f} ms | {r['p99_over_p50']:.1f} | "
              f"{r['rps_16']:,.0f} ({r['direct_rps_16']:,.0f}) | {fmt(r['cpu_ms_per_request'], '.2f', 'ms')} | "
              f"{r['first_byte_added_ms']:.2f} ms | {r['per_frame_added_us']:.1f} µs | "
              f"{fmt(r['cpu_us_per_frame'], '.1f', 'µs')} | {fmt(r['rss_after_mib'], '.0f', 'MiB')} |")


def main() -> None:
    import argparse
    import datetime as dt

    parser = argparse.ArgumentParser(description="the gateway beside Portkey and LiteLLM, one run")
    parser.add_argument("--base", help="also the gateway of this tree (its package directory), same rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="requests a round at concurrency 1")
    parser.add_argument("--default-config", action="store_true",
                        help="the gateways at info logging (the default) rather than warning")
    parser.add_argument("--out", help="write the results here")
    args = parser.parse_args()
    result = {"date": dt.date.today().isoformat(), "load_average_before": os.getloadavg()}
    log_args = ("--log-level", "info") if args.default_config else ("--log-level", "warning")
    with Processes(hold_s=2.0, log_args=log_args) as procs:
        run = run_side_by_side(procs, rounds=args.rounds, n=args.requests, base=args.base)
        lite = run_litellm(procs.upstream, rounds=args.rounds, n=args.requests // 3)
    result["load_average_after"] = os.getloadavg()
    result["run"] = run
    result["rows"] = side_by_side_rows(run, lite)
    print_side_by_side(result["rows"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
