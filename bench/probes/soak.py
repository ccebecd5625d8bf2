"""A bounded soak of `relayline serve` under provider faults: does anything grow, leak or lie?

One gateway process (two openai-family profiles, `a` falling back to `b`, short timeouts and a
small response limit, a pool of keys) in front of a loopback upstream that answers `a` with a
fixed cycle of faults: 503s; 429s whose Retry-After is negative, an HTTP date long past, huge,
fractional, NaN, infinite or junk; a 200 carrying an error body; HTML where JSON belongs; junk
JSON; a connection reset mid-body; streams cut before their end, with malformed frames, with a
frame past `limits.max_response_bytes`, or stalled after their head; and plain answers. `b`
answers. Clients (trio, httpx) send non-streamed and streamed turns at a fixed concurrency, and
every seventh stream is hung up after its first bytes.

Every CHECK_EVERY requests the gateway's resident set (VmRSS), open descriptors and threads are
read from /proc; at the end the figures after the warm-up are compared with the last (growth),
every status is counted against /metrics' request counter, and the log, /metrics, /admin/health
and every answer are searched for the keys. Bounded: at most --requests requests and --max-s
seconds. Loopback only. Never part of `make test`.

Run: python bench/probes/soak.py [--requests 20000] [--concurrency 16]  (writes bench/results/soak-<date>.json)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import trio

BENCH = Path(__file__).resolve().parent.parent  # bench/: common.py, upstream.py, the standing benches
sys.path.insert(0, str(BENCH))

from common import listening, stop  # noqa: E402

from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen  # noqa: E402

KEYS = ("sk-soak-a-7f3e9c1d2b", "sk-soak-a-second-44aa91", "sk-soak-b-0c8d2e6f")
JSON = (("content-type", "application/json"),)
SSE = (("content-type", "text/event-stream"),)
CHECK_EVERY = 2000
RETRY_AFTERS = ("-5", "Wed, 21 Oct 2015 07:28:00 GMT", "1e9", "0.25", "nan", "inf", "soon", "999999999999")


def _chunk(text: str | None, finish: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def _answer(text: str) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 10, "completion_tokens": 5}}).encode()


def _ok(stream: bool, text: str) -> Reply:
    if not stream:
        return Reply(headers=JSON, pieces=(_answer(text),))
    return Reply(headers=SSE, pieces=(_chunk(""), _chunk(text), _chunk(" more"), _chunk(None, "stop"),
                                      b"data: [DONE]\n\n"))


def _error(status: int, retry_after: str | None = None) -> Reply:
    headers = JSON + ((("retry-after", retry_after),) if retry_after is not None else ())
    # a provider that echoes the key it was sent (some do, in 401s): it must go no further
    body = {"error": {"message": f"no (key {KEYS[0]})", "type": "server_error", "code": None}}
    return Reply(status=status, headers=headers, pieces=(json.dumps(body).encode(),))


def faults(stream: bool, turn: int, limit: int) -> list[Reply]:
    """The cycle `a` answers from: each fault, each followed by an answer."""
    cycle = [_error(503), *(_error(429, value) for value in RETRY_AFTERS),
             Reply(headers=JSON, pieces=(b'{"error": {"message": "overloaded", "type": "server_error"}}',)),
             Reply(headers=(("content-type", "text/html"),), pieces=(b"<html>bad gateway</html>",)),
             Reply(headers=JSON, pieces=(b'{"choices": [',)),
             Reply(headers=JSON, pieces=(_answer("cut")[:20],), end=False)]
    if stream:
        cycle += [Reply(headers=SSE, pieces=(_chunk(""), _chunk("cut after output")), end=False),
                  Reply(headers=SSE, pieces=(_chunk(""), b"data: {not json\n\n", b"data: [DONE]\n\n")),
                  Reply(headers=SSE, pieces=(_chunk(""), _chunk("x" * (limit + 1)), b"data: [DONE]\n\n")),
                  Reply(headers=SSE, pieces=(_chunk(""), 1.5, _chunk("late"), b"data: [DONE]\n\n")),
                  Reply(headers=SSE, pieces=(b": keep-alive\n\n",) * 3, end=False)]
    else:
        cycle.append(Reply(headers=JSON, pieces=(b" ", 1.5, _answer("late")[1:])))
    # an answer after each fault: the breaker opens now and then (a fault of several turns in a
    # row), not for good, so that most turns meet their fault
    return [reply for fault in cycle for reply in (fault, _ok(stream, f"a{turn}"))]


class Upstream(BackgroundLoopback):
    """The loopback upstream in a thread of its own (its memory is not the gateway's)."""

    def __init__(self, limit: int, clean: bool = False) -> None:
        super().__init__(self._handle)
        self.limit = limit
        self.clean = clean
        self.count = {"a": 0, "b": 0}

    def _handle(self, seen: Seen) -> Reply:
        self.server.seen.clear()  # (the server keeps every request it saw: not here)
        alias = seen.path.strip("/").split("/", 1)[0]
        stream = bool((seen.body or {}).get("stream"))
        n = self.count[alias]
        self.count[alias] = n + 1
        if alias == "b" or self.clean:
            return _ok(stream, "from b")
        cycle = faults(stream, n, self.limit)
        return cycle[n % len(cycle)]


def config_text(upstream: Upstream, ledger: Path, limit: int) -> str:
    return f"""active = "a"
[reliability]
provider_retries = 1
backoff_ms = 50
backoff_max_ms = 200
rate_limit_cooldown_default_s = 0.2
rate_limit_cooldown_max_s = 0.5
retry_after_wait_max_s = 0.3
[breaker]
failure_threshold = 5
window_s = 1
open_s = 0.5
[timeouts]
headers_s = 1
idle_s = 1
total_s = 5
gate_commit_s = 2
[limits]
max_response_bytes = {limit}
[ledger]
path = "{ledger}"
[providers.a]
family = "openai"
base_url = "{upstream.url}/a/v1"
api_keys = ["{KEYS[0]}", "{KEYS[1]}"]
model = "model-a"
fallbacks = ["b"]
price = {{ input_per_mtok = 1.0, output_per_mtok = 2.0 }}
[providers.b]
family = "openai"
base_url = "{upstream.url}/b/v1"
api_key = "{KEYS[2]}"
model = "model-b"
price = {{ input_per_mtok = 1.0, output_per_mtok = 2.0 }}
"""


def process_figures(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}


async def drive(url: str, pid: int, requests: int, concurrency: int, max_s: float, clean: bool) -> dict:
    statuses: dict[str, int] = {}
    answers_with_a_key = 0
    hung_up = 0
    checks: list[dict] = []
    sent = 0
    started = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal answers_with_a_key, hung_up
            stream = i % 2 == 1
            body = {"model": "model-a", "messages": [{"role": "user", "content": f"turn {i}"}], "stream": stream}
            try:
                if stream:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        status = str(response.status_code)
                        seen = b""
                        async for piece in response.aiter_raw():
                            seen += piece
                            if i % 7 == 1 and not clean:  # the client goes away after its first bytes
                                hung_up += 1
                                status = "hung_up"
                                break
                else:
                    response = await client.post("/v1/chat/completions", json=body)
                    status, seen = str(response.status_code), response.content
            except httpx.HTTPError as exc:
                status, seen = type(exc).__name__, b""
            statuses[status] = statuses.get(status, 0) + 1
            if any(key.encode() in seen for key in KEYS):
                answers_with_a_key += 1

        done = 0

        async def worker(lane: int) -> None:
            nonlocal sent, done
            while sent < requests and time.monotonic() - started < max_s:
                i = sent
                sent += 1
                await one(i)
                done += 1
                if done % CHECK_EVERY == 0:
                    checks.append({"requests": done, "at_s": round(time.monotonic() - started, 1),
                                   **process_figures(pid)})

        async with trio.open_nursery() as nursery:
            for lane in range(concurrency):
                nursery.start_soon(worker, lane)
        await trio.sleep(1.0)  # (the bookkeeping after the last answers)
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/admin/health")).text
    return {"sent": sent, "seconds": round(time.monotonic() - started, 1), "statuses": statuses,
            "hung_up": hung_up, "answers_with_a_key": answers_with_a_key, "checks": checks,
            "metrics": metrics, "health": health}


def chat_requests_in_metrics(metrics: str) -> int:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith('relayline_http_requests_total{route="/v1/chat/completions"'):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-s", type=float, default=900.0)
    parser.add_argument("--limit", type=int, default=65536, help="limits.max_response_bytes")
    parser.add_argument("--clean", action="store_true", help="no faults: the baseline the growth is read against")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="relayline-soak-"))
    log_path = work / "gateway.log"
    with Upstream(args.limit, args.clean) as upstream:
        config = work / "soak.toml"
        config.write_text(config_text(upstream, work / "ledger.sqlite3", args.limit))
        proc = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config),
                                 "--port", "0", "--log-level", "info", "--log-format", "json"],
                                stderr=subprocess.PIPE, text=True)
        try:
            url = listening(proc)
            # the rest of its stderr to a file, read by a thread (a pipe left unread would block it)
            sink = threading.Thread(target=lambda: log_path.write_text("".join(proc.stderr)), daemon=True)
            sink.start()
            start = process_figures(proc.pid)
            result = trio.run(drive, url, proc.pid, args.requests, args.concurrency, args.max_s, args.clean)
            end = process_figures(proc.pid)
        finally:
            stop([proc])
        sink.join(10)
    log = log_path.read_text()
    leaked = {where: sum(text.count(key) for key in KEYS)
              for where, text in (("log", log), ("metrics", result["metrics"]), ("health", result["health"]))}
    checks = result.pop("checks")
    warm = checks[0] if checks else start
    answered = sum(n for status, n in result["statuses"].items() if status.isdigit() or status == "hung_up")
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average": os.getloadavg(),
        "requests": result["sent"], "seconds": result["seconds"], "concurrency": args.concurrency,
        "statuses": result["statuses"], "upstream_calls": upstream.count,
        "start": start, "checks": checks, "end": end,
        "rss_growth_after_warmup_kib": end["rss_kib"] - warm["rss_kib"],
        "fds_growth_after_warmup": end["fds"] - warm["fds"],
        "metrics_chat_requests": chat_requests_in_metrics(result["metrics"]),
        "client_saw_requests": answered,
        "keys_found": {**leaked, "answers": result["answers_with_a_key"]},
        "tracebacks_in_log": log.count("Traceback"),
        "log_bytes": len(log),
    }
    out = Path(args.out) if args.out else BENCH / "results" / f"soak-{dt.date.today().isoformat()}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
