"""Pieces for the fleet tests: an OpenAI-compatible loopback upstream whose behaviour a test
changes while gateways run, with its own request log, and `relayline serve` processes.

The upstream serves every profile under its own path prefix (base_url = URL/ALIAS/v1); a test
sets `upstream.mode[ALIAS]` to "ok", 503, 429 (with `retry_after`), and a delay or a number of
streamed frames with pauses between them. `upstream.log` is what reached it: one (alias, model,
stream) per request, the count the ledger is checked against.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import trio

from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen

JSON = (("content-type", "application/json"),)
SSE = (("content-type", "text/event-stream"),)


def _chunk(delta: dict, finish=None, model="m") -> bytes:
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


class Upstream(BackgroundLoopback):
    def __init__(self) -> None:
        self.mode: dict[str, dict] = {}
        self.log: list[tuple[str, str, bool]] = []
        self._lock = threading.Lock()
        super().__init__(self._handle)

    def base_url(self, alias: str) -> str:
        return f"{self.url}/{alias}/v1"

    def set(self, alias: str, **mode) -> None:
        self.mode[alias] = mode

    def count(self, alias: str) -> int:
        with self._lock:
            return sum(1 for a, _, _ in self.log if a == alias)

    async def _handle(self, seen: Seen) -> Reply:
        alias = seen.path.strip("/").split("/", 1)[0]
        body = seen.body or {}
        stream = bool(body.get("stream"))
        with self._lock:
            self.log.append((alias, body.get("model", ""), stream))
        mode = self.mode.get(alias, {})
        if mode.get("delay"):
            await trio.sleep(mode["delay"])
        status = mode.get("status", 200)
        if status != 200:
            headers = JSON + ((("retry-after", str(mode["retry_after"])),) if "retry_after" in mode else ())
            error = {"error": {"message": "upstream says no", "type": "server_error" if status >= 500 else
                               "rate_limit_error", "code": None}}
            return Reply(status=status, headers=headers, pieces=(json.dumps(error).encode(),))
        text = mode.get("text", f"from {alias}")
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        if not stream:
            reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": "stop"}], "usage": usage}
            return Reply(headers=JSON, pieces=(json.dumps(reply).encode(),))
        frames = mode.get("frames", 3)
        pause = float(mode.get("pause", 0.0))
        pieces: list[bytes | float] = [_chunk({"role": "assistant", "content": ""})]
        for i in range(frames):
            pieces.append(_chunk({"content": f"{text} {i}. "}))
            if pause:
                pieces.append(pause)
        pieces.append(_chunk({}, "stop"))
        pieces.append(f"data: {json.dumps({'id': 'c', 'object': 'chat.completion.chunk', 'created': 0, 'model': 'm', 'choices': [], 'usage': usage})}\n\n".encode())
        pieces.append(b"data: [DONE]\n\n")
        return Reply(headers=SSE, pieces=tuple(pieces))


def fleet_config(upstream: Upstream, *, chain=("a", "b"), extra: str = "") -> str:
    """Two (or more) openai-family profiles on the upstream, each falling back to the next."""
    lines = [f'active = "{chain[0]}"', extra]
    for i, alias in enumerate(chain):
        fallbacks = json.dumps(list(chain[i + 1:i + 2]))
        lines += [f'[providers."{alias}"]', 'family = "openai"', f'base_url = "{upstream.base_url(alias)}"',
                  'api_key = "sk-fleet-test"', f'model = "model-{alias}"', f"fallbacks = {fallbacks}",
                  "price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }"]
    return "\n".join(lines) + "\n"


class ServeProcess:
    """`relayline serve` in its own process, on an ephemeral port; stderr kept for assertions."""

    LISTENING = re.compile(r"listening on (http://\S+?)(?:,|\s|$)")

    def __init__(self, config: Path, *args: str, env: dict | None = None) -> None:
        self.stderr_path = config.parent / f"serve-{time.monotonic_ns()}.log"
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config), "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=self._stderr, env={**os.environ, **(env or {})})
        self.url = self._wait_listening(30)

    def _wait_listening(self, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            match = self.LISTENING.search(self.stderr)
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: {self.stderr}")
            time.sleep(0.05)
        raise RuntimeError(f"serve did not listen within {seconds} s: {self.stderr}")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._stderr.close()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
