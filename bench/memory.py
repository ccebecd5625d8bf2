"""Gateway memory under the largest replies (`make bench`; never part of `make test`).

The fault review found the gateway's memory growing with the response and staying grown. This measures
the gateway's resident set (its own `relayline serve` process) before, at the peak of, and after:

- a 32 MiB non-streamed reply (accepted: just under `[limits] max_response_bytes`, the default);
- a 100 MiB non-streamed reply (refused as `too_large` once 32 MiB were read);
- a 32 MiB stream (its text just under the limit, in 64 KiB frames).

Beside it, in the same run, the baseline: the same replies read straight from the same upstream by
a plain httpx client in a process of its own (the non-streamed body parsed with json, the stream's
text accumulated, as an application would). The upstream is a raw asyncio server in a third
process. Peak RSS is the kernel's high-water mark (VmHWM), reset before each request through
/proc/PID/clear_refs; "after" is VmRSS once the answer ended and a small request went through.
Meanwhile a neighbour client (its own process) sends small requests one after another through
the same gateway to an upstream of their own (a route): its slowest one says how long a large
answer held the gateway's event loop, beside its slowest with no large answer in flight.

Run: python bench/memory.py  (writes bench/results/memory-<date>.json)
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
from common import listening, stop

MIB = 1024 * 1024
LIMIT = 32 * MIB  # [limits] max_response_bytes, the default
CASES = {  # model name -> (bytes of text, streamed)
    "accepted-32mib": (LIMIT - 4096, False),
    "refused-100mib": (100 * MIB, False),
    "stream-32mib": (LIMIT - 4096, True),
}
# no declared length: the gateway must read up to the limit before it can refuse (a declared
# length above the limit is refused before a byte is read, which would measure nothing)
CHUNKED = {"refused-100mib"}
FRAME = 64 * 1024
ROUNDS = 3
MESSAGES = [{"role": "user", "content": "hi"}]


# -- the upstream (its own process) ------------------------------------------------------------


def _body(model: str) -> bytes:
    size, stream = CASES.get(model, (16, False))
    if not stream:
        return json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": model,
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * size},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 10, "completion_tokens": size // 4}}).encode()

    def chunk(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    text = chunk({"choices": [{"index": 0, "delta": {"content": "x" * FRAME}, "finish_reason": None}]})
    parts = [chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})]
    parts += [text] * (size // FRAME)
    parts += [chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
              chunk({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": size // 4}}),
              b"data: [DONE]\n\n"]
    return b"".join(parts)


class Upstream(asyncio.Protocol):
    bodies: dict[str, bytes] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        length = int(re.search(rb"content-length:\s*(\d+)", self.buffer[:head_end].lower()).group(1))
        if len(self.buffer) < head_end + 4 + length:
            return
        body, self.buffer = self.buffer[head_end + 4:head_end + 4 + length], self.buffer[head_end + 4 + length:]
        model = json.loads(body).get("model", "")
        if model not in self.bodies:
            self.bodies[model] = _body(model)
        payload = self.bodies[model]
        ctype = b"text/event-stream" if CASES.get(model, (0, False))[1] else b"application/json"
        head = b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype
        if model in CHUNKED:
            self.transport.write(head + b"\r\ntransfer-encoding: chunked\r\n\r\n")
            for at in range(0, len(payload), FRAME):
                piece = payload[at:at + FRAME]
                self.transport.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.transport.write(b"0\r\n\r\n")
        else:
            self.transport.write(head + b"\r\ncontent-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)


async def serve_upstream() -> None:
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", 0)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


# -- RSS of a process ------------------------------------------------------------------------------


def status_kib(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int | str) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def read_case(client: httpx.Client, url: str, model: str, *, parse: bool) -> str:
    """One request for `model`; the answer read as an application would (parse=True) or only
    drained (the gateway's client: its own memory is not what is measured)."""
    stream = CASES[model][1]
    with client.stream("POST", url, json={"model": model, "messages": MESSAGES, "stream": stream}) as response:
        if stream:
            text = []
            for line in response.iter_lines():
                if parse and line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        text.append(choice["delta"].get("content") or "")
            return f"{response.status_code} {sum(map(len, text))} chars" if parse else \
                f"{response.status_code} {response.num_bytes_downloaded} bytes"
        if parse:
            body = response.read()
            obj = json.loads(body)
            del body
            return f"{response.status_code} {len(obj['choices'][0]['message']['content'])} chars"
        size = sum(len(chunk) for chunk in response.iter_raw())
        return f"{response.status_code} {size} bytes"


# -- the direct client (its own process) --------------------------------------------------------


def direct(url: str, model: str) -> None:
    """Read one case straight from the upstream, ROUNDS times; print this process's RSS as JSON
    (one process per case: an allocator that kept an earlier case's heap would hide the next)."""
    rounds = []
    with httpx.Client(timeout=120) as client:
        client.post(url, json={"model": "small", "messages": MESSAGES}).read()
        for _ in range(ROUNDS):
            gc.collect()
            before = status_kib("self", "VmRSS")
            reset_peak("self")
            answer = read_case(client, url, model, parse=True)
            gc.collect()
            rounds.append({"before_kib": before, "peak_kib": status_kib("self", "VmHWM"),
                           "after_kib": status_kib("self", "VmRSS"), "answer": answer})
    print(json.dumps(rounds), flush=True)


# -- the run ---------------------------------------------------------------------------------------


def start_gateway(upstream: str, neighbours: str, tmp: str) -> tuple[subprocess.Popen, str]:
    config = Path(tmp) / "memory.toml"
    config.write_text(textwrap.dedent(f"""
        active = "bench.upstream"
        [timeouts]
        headers_s = 120
        idle_s = 120
        [reliability]
        provider_retries = 0
        [providers."bench.upstream"]
        family = "openai"
        base_url = "{upstream}/v1"
        api_key = "bench-key"
        [providers."bench.neighbours"]
        family = "openai"
        base_url = "{neighbours}/v1"
        api_key = "bench-key"
        [[routes]]
        hint = "small"
        provider = "bench.neighbours"
        model = "small"
        """))
    gw = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config),
                           "--port", "0", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    return gw, listening(gw)


class Neighbour:
    """Another client, in a process of its own, sending small requests one after another
    through the gateway to an upstream of their own while a large answer is in flight: its
    slowest request shows how long the large answer held the gateway's event loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.slowest_ms = 0.0

    def __enter__(self) -> Neighbour:
        self.proc = subprocess.Popen([sys.executable, __file__, "neighbour", self.url], stdout=subprocess.PIPE,
                                     text=True)
        self.proc.stdout.readline()  # "ready": its first request went through
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.slowest_ms = json.loads(self.proc.stdout.readline())["slowest_ms"]
        self.proc.wait(30)


def neighbour(url: str) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    latencies = []
    with httpx.Client(timeout=120) as client:
        client.post(url, json={"model": "small", "messages": MESSAGES}).read()
        print("ready", flush=True)
        while not stop:
            started = time.perf_counter()
            client.post(url, json={"model": "small", "messages": MESSAGES}).read()
            latencies.append(time.perf_counter() - started)
    print(json.dumps({"slowest_ms": round(max(latencies, default=0.0) * 1000, 1)}), flush=True)


def through_gateway(gateway: str, pid: int) -> dict:
    url = f"{gateway}/v1/chat/completions"
    out = {}
    with httpx.Client(timeout=120) as client:
        client.post(url, json={"model": "small", "messages": MESSAGES}).read()
        baseline = status_kib(pid, "VmRSS")
        with Neighbour(url) as alone:
            time.sleep(1.0)
        for model in CASES:
            rounds = []
            for _ in range(ROUNDS):
                before = status_kib(pid, "VmRSS")
                reset_peak(pid)
                with Neighbour(url) as neighbour:
                    answer = read_case(client, url, model, parse=False)
                client.post(url, json={"model": "small", "messages": MESSAGES}).read()
                time.sleep(0.2)
                rounds.append({"before_kib": before, "peak_kib": status_kib(pid, "VmHWM"),
                               "after_kib": status_kib(pid, "VmRSS"), "answer": answer,
                               "neighbour_slowest_ms": neighbour.slowest_ms})
            out[model] = rounds
    out["baseline_kib"] = baseline
    out["neighbour_alone_slowest_ms"] = alone.slowest_ms
    return out


def summary(rounds: list[dict], baseline: int) -> dict:
    slowest = [r["neighbour_slowest_ms"] for r in rounds if "neighbour_slowest_ms" in r]
    return {"baseline_mib": round(baseline / 1024, 1), **({"neighbour_slowest_ms": max(slowest)} if slowest else {}),
            "peak_mib": round(max(r["peak_kib"] for r in rounds) / 1024, 1),
            "after_mib": round(rounds[-1]["after_kib"] / 1024, 1),
            "after_over_baseline_mib": round((rounds[-1]["after_kib"] - baseline) / 1024, 1),
            "answer": rounds[-1]["answer"]}


def main() -> int:
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in ("large answers", "the neighbour's"):  # each upstream in a process of its own
            up = subprocess.Popen([sys.executable, __file__, "upstream"], stdout=subprocess.PIPE, text=True)
            procs.append(up)
            urls.append(f"http://127.0.0.1:{up.stdout.readline().split()[1]}")
        upstream, neighbours = urls
        with tempfile.TemporaryDirectory() as tmp:
            gw, gateway = start_gateway(upstream, neighbours, tmp)
            procs.append(gw)
            gateway_rounds = through_gateway(gateway, gw.pid)
            direct_rounds = {model: json.loads(subprocess.run(
                [sys.executable, __file__, "direct", f"{upstream}/v1/chat/completions", model],
                capture_output=True, text=True, check=True).stdout) for model in CASES}
    finally:
        stop(procs)
    load = os.getloadavg()[0]
    results = {"when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "load_average_1m": round(load, 2),
               "limit_bytes": LIMIT, "rounds": ROUNDS, "cases": {}}
    print(f"\nmemory (RSS, MiB; {ROUNDS} rounds each, peak over the rounds, after = after the last; "
          f"load average {load:.1f})")
    print(f"{'reply':<16} {'gateway base':>12} {'peak':>7} {'after':>7}   {'direct httpx base':>17} {'peak':>7} "
          f"{'after':>7}   {'neighbour slowest':>17}   answer via the gateway")
    for model in CASES:
        g = summary(gateway_rounds[model], gateway_rounds["baseline_kib"])
        d = summary(direct_rounds[model], direct_rounds[model][0]["before_kib"])
        results["cases"][model] = {"gateway": g, "direct": d, "gateway_rounds": gateway_rounds[model],
                                   "direct_rounds": direct_rounds[model]}
        print(f"{model:<16} {g['baseline_mib']:>12.1f} {g['peak_mib']:>7.1f} {g['after_mib']:>7.1f}   "
              f"{d['baseline_mib']:>17.1f} {d['peak_mib']:>7.1f} {d['after_mib']:>7.1f}   "
              f"{g['neighbour_slowest_ms']:>14.1f} ms   {g['answer']}")
    results["neighbour_alone_slowest_ms"] = gateway_rounds["neighbour_alone_slowest_ms"]
    print(f"(neighbour: another client's slowest small request while the answer was in flight; alone, "
          f"with no large answer, its slowest was {gateway_rounds['neighbour_alone_slowest_ms']:.1f} ms)")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"memory-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["upstream"]:
        asyncio.run(serve_upstream())
    elif sys.argv[1:2] == ["neighbour"]:
        neighbour(sys.argv[2])
    elif sys.argv[1:2] == ["direct"]:
        direct(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
