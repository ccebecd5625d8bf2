"""Named keys' limits: what admission adds to a request, and what a fleet admits.

- hot path: one chat request through the gateway in process (ASGI, a loopback upstream), by a
  named key without limits and by one with rpm, tpm and a budget, counted in memory and in a
  private loopback redis-server, in the same run;
- fleet: `relayline serve --workers 3` and `--workers 1` on one redis-server, clients hammering
  one key past its rpm and tpm for `--seconds`, the admitted requests and tokens in each minute
  and in the busiest 60 s (by the upstream's own clock) against the limits; then Redis killed
  mid-run under each `limits_on_store_error`.

Run alone: `python bench/limits.py [--seconds 120] [--only hot|fleet]`. Needs redis-server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fleet import ServeProcess, Upstream, fleet_config  # noqa: E402

from helpers import asgi_post  # noqa: E402
from relayline.adapters.gateway import Gateway  # noqa: E402
from relayline.adapters.gateway.auth import load_access  # noqa: E402
from relayline.adapters.relay import Relay  # noqa: E402
from relayline.machines.config import parse_config  # noqa: E402
from services import RedisServer  # noqa: E402

KEY, FREE = "sk-bench-limited", "sk-bench-free"
BODY = {"model": "model-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
RAW = json.dumps(BODY).encode()


# -- hot path -------------------------------------------------------------------------------------


def hot_config(upstream_url: str, store: str) -> str:
    return f"""
active = "a"
[health]
store = "{store}"
key_prefix = "bench:{time.monotonic_ns()}:"
[providers.a]
family = "openai"
base_url = "{upstream_url}/a/v1"
api_key = "sk-up"
model = "model-a"
[[gateway.keys]]
name = "free"
key_env = "FREE"
[[gateway.keys]]
name = "limited"
key_env = "LIMITED"
team = "t"
rpm = 100000000
tpm = 1000000000
budget_usd = 1000000.0
[[gateway.teams]]
name = "t"
rpm = 100000000
"""


async def _timed(gateway: Gateway, key: str, n: int) -> list[float]:
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {key}".encode())]
    out = []
    for _ in range(n):
        started = time.perf_counter()
        status, _, _ = await asgi_post(gateway, "/v1/chat/completions", RAW, headers)
        out.append(time.perf_counter() - started)
        assert status == 200, status
    return out


async def _hot(upstream_url: str, store: str, n: int) -> dict:
    config = parse_config(hot_config(upstream_url, store))
    relay = Relay(config, env={})
    env = {"FREE": FREE, "LIMITED": KEY}
    async with relay:
        gateway = Gateway(relay, access=load_access(config, env))
        await _timed(gateway, FREE, 50)  # warm: connections, caches
        await _timed(gateway, KEY, 50)
        free, limited = [], []
        for _ in range(5):  # interleaved rounds: drift on a shared machine hits both alike
            free += await _timed(gateway, FREE, n // 5)
            limited += await _timed(gateway, KEY, n // 5)
    return {"free_us": statistics.median(free) * 1e6, "limited_us": statistics.median(limited) * 1e6,
            "added_us": (statistics.median(limited) - statistics.median(free)) * 1e6, "requests": n}


def hot_path(n: int) -> dict:
    results = {}
    with Upstream() as up:
        results["memory"] = trio.run(_hot, up.url, "memory", n)
        redis = RedisServer()
        redis.start()
        try:
            results["redis"] = trio.run(_hot, up.url, redis.url, n)
        finally:
            redis.stop()
    return results


# -- the fleet ------------------------------------------------------------------------------------


class StampedUpstream(Upstream):
    """The fleet test's upstream, noting when each request arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    async def _handle(self, seen):
        self.times.append(time.monotonic())
        return await super()._handle(seen)


def fleet_toml(upstream, redis_url: str, tmp: Path, mode: str, rpm: int, tpm: int) -> Path:
    extra = f"""
[health]
store = "{redis_url}"
key_prefix = "benchfleet:{time.monotonic_ns()}:"
[ledger]
path = "{tmp / f'ledger-{time.monotonic_ns()}.sqlite3'}"
[gateway]
limits_on_store_error = "{mode}"
[[gateway.keys]]
name = "hammered"
key_env = "BENCH_KEY"
rpm = {rpm}
tpm = {tpm}
"""
    path = tmp / f"limits-{time.monotonic_ns()}.toml"
    path.write_text(fleet_config(upstream, chain=("a",), extra=extra))
    return path


def hammer(url: str, seconds: float, stop: threading.Event | None = None, clients: int = 12) -> dict:
    """`clients` threads, each on new connections now and then (spread over the workers), for
    `seconds`: the statuses counted."""
    counts: dict[int, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def run(_):
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            with httpx.Client(timeout=30) as client:
                for _ in range(20):
                    if time.monotonic() >= deadline:
                        break
                    try:
                        status = client.post(f"{url}/v1/chat/completions", json=BODY,
                                             headers={"authorization": f"Bearer {KEY}"}).status_code
                    except httpx.HTTPError:
                        status = 0
                    with lock:
                        counts[status] = counts.get(status, 0) + 1
                    if status == 429:
                        time.sleep(0.05)  # a client that backs off a little, as SDKs do

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(run, range(clients)))
    return counts


def windows(times: list[float], start: float, tokens_each: int) -> dict:
    """Admitted requests per minute since `start`, and the most in any sliding 60 s."""
    times = sorted(times)
    minutes: dict[int, int] = {}
    for t in times:
        minutes[int((t - start) // 60)] = minutes.get(int((t - start) // 60), 0) + 1
    busiest, j = 0, 0
    for i, t in enumerate(times):
        while times[j] <= t - 60:
            j += 1
        busiest = max(busiest, i - j + 1)
    return {"per_minute": [minutes.get(m, 0) for m in range(max(minutes) + 1)] if minutes else [],
            "busiest_60s_requests": busiest, "busiest_60s_tokens": busiest * tokens_each}


def fleet(seconds: float, rpm: int, tpm: int) -> dict:
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="relayline-bench-limits-"))
    redis = RedisServer()
    redis.start()
    out: dict = {"rpm": rpm, "tpm": tpm, "estimate_tokens": 12, "billed_tokens": 15, "seconds": seconds}
    try:
        for workers in (3, 1):
            with StampedUpstream() as up:
                path = fleet_toml(up, redis.url, tmp, "local", rpm, tpm)
                with ServeProcess(path, "--workers", str(workers), env={"BENCH_KEY": KEY}) as gw:
                    start = time.monotonic()
                    counts = hammer(gw.url, seconds)
                out[f"workers_{workers}"] = {"statuses": counts, **windows(up.times, start, 15)}
        for mode in ("local", "closed", "open"):
            with StampedUpstream() as up:
                path = fleet_toml(up, redis.url, tmp, mode, rpm, tpm)
                with ServeProcess(path, "--workers", "3", env={"BENCH_KEY": KEY}) as gw:
                    before = hammer(gw.url, seconds / 4)
                    redis.kill()
                    after = hammer(gw.url, seconds / 4)
                    redis.start()
                    log = gw.stderr
                out[f"redis_killed_{mode}"] = {"before": before, "after": after,
                                               "outage_lines": log.count("limits_store_unreachable")}
    finally:
        redis.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--only", choices=["hot", "fleet"])
    parser.add_argument("--rpm", type=int, default=300)
    parser.add_argument("--tpm", type=int, default=3000)
    args = parser.parse_args()
    if RedisServer.unavailable():
        print(json.dumps({"skipped": RedisServer.unavailable()}))
        return
    results = {}
    if args.only in (None, "hot"):
        results["hot_path"] = hot_path(args.requests)
    if args.only in (None, "fleet"):
        results["fleet"] = fleet(args.seconds, args.rpm, args.tpm)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
