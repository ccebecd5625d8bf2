"""A loopback OpenAI-compatible upstream for benchmarks: raw asyncio, pre-rendered replies.

It must not be the bottleneck, so it does almost nothing: HTTP/1.1 keep-alive, a request read
by Content-Length, and a reply chosen by the requested model name:

    "frames-N"  N content frames (a stream when the request asks for one; else one JSON body)
    "headed-N"  the same, under the head OpenAI's API sends (23 fields: ids, rate limits, its
                CDN's cookies), where "frames-N" has a content type and a length alone
    "hold-N"    a stream that sends its role frame and N text frames, then waits `hold` seconds
                before finishing (the memory benchmark keeps streams in flight with it)
    GET /stats  {"connections": accepted so far}: the load benchmark counts connections opened

A POST to a path ending /messages gets Anthropic's shape instead (non-streamed "frames-N" only):
the long-history benchmark sends the same conversation to an `anthropic` profile.

Run: python bench/upstream.py PORT [HOLD_SECONDS]; it prints "ready PORT" when listening.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys

MODEL = re.compile(rb'"model"\s*:\s*"(frames|hold|headed)-(\d+)"')
# what OpenAI's API sends besides a content type and a length (a real answer's head)
PROVIDER_FIELDS = (
    b"date: Mon, 30 Nov 2026 22:00:00 GMT\r\nconnection: keep-alive\r\naccess-control-expose-headers: X-Request-ID\r\n"
    b"openai-organization: org-abc\r\nopenai-processing-ms: 312\r\nopenai-project: proj_abc\r\n"
    b"openai-version: 2020-10-01\r\nx-envoy-upstream-service-time: 318\r\nx-ratelimit-limit-requests: 10000\r\n"
    b"x-ratelimit-limit-tokens: 30000000\r\nx-ratelimit-remaining-requests: 9999\r\n"
    b"x-ratelimit-remaining-tokens: 29999990\r\nx-ratelimit-reset-requests: 6ms\r\nx-ratelimit-reset-tokens: 0s\r\n"
    b"x-request-id: req_0123456789abcdef\r\nstrict-transport-security: max-age=31536000\r\n"
    b"cf-cache-status: DYNAMIC\r\nset-cookie: __cf_bm=abc; path=/; HttpOnly\r\nset-cookie: _cfuvid=def; path=/\r\n"
    b"x-content-type-options: nosniff\r\nserver: cloudflare\r\ncf-ray: 8f0000000000-AMS\r\n")
STREAM = re.compile(rb'"stream"\s*:\s*true')


def _chunk(delta: dict, finish=None) -> bytes:
    body = json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "bench",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}, separators=(",", ":"))
    return f"data: {body}\n\n".encode()


USAGE = b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench","choices":[],"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}\n\n'
_cache: dict[tuple[str, int, bool], bytes] = {}


def body_for(kind: str, n: int, stream: bool) -> bytes:
    key = (kind, n, stream)
    if key not in _cache:
        if stream:
            parts = [_chunk({"role": "assistant", "content": ""})]
            parts += [_chunk({"content": f" w{i}"}) for i in range(n)]
            parts += [_chunk({}, "stop"), USAGE, b"data: [DONE]\n\n"]
            _cache[key] = b"".join(parts)
        else:
            text = "".join(f" w{i}" for i in range(n))
            _cache[key] = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "bench",
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                   "finish_reason": "stop"}],
                                      "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}}).encode()
    return _cache[key]


def anthropic_body_for(n: int) -> bytes:
    key = ("anthropic", n, False)
    if key not in _cache:
        text = "".join(f" w{i}" for i in range(n))
        _cache[key] = json.dumps({"id": "msg_bench", "type": "message", "role": "assistant", "model": "bench",
                                  "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                                  "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": n}}).encode()
    return _cache[key]


class Upstream(asyncio.Protocol):
    hold = 5.0
    accepted = 0

    def connection_made(self, transport):
        Upstream.accepted += 1
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].lower()
            match = re.search(rb"content-length:\s*(\d+)", head)
            length = int(match.group(1)) if match else 0
            if len(self.buffer) < head_end + 4 + length:
                return
            body = self.buffer[head_end + 4: head_end + 4 + length]
            self.buffer = self.buffer[head_end + 4 + length:]
            if head.startswith(b"get /stats"):
                stats = json.dumps({"connections": Upstream.accepted}).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                     + str(len(stats)).encode() + b"\r\n\r\n" + stats)
                continue
            if head.startswith(b"post /v1/messages"):
                self.answer_anthropic(body)
            else:
                self.answer(body)

    def answer_anthropic(self, body: bytes) -> None:
        found = MODEL.search(body)
        payload = anthropic_body_for(int(found.group(2)) if found else 1)
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    def answer(self, body: bytes) -> None:
        found = MODEL.search(body)
        kind, n = (found.group(1).decode(), int(found.group(2))) if found else ("frames", 1)
        stream = bool(STREAM.search(body))
        if kind == "hold" and stream:
            asyncio.get_running_loop().create_task(self.held(n))
            return
        payload = body_for("frames" if kind == "headed" else kind, n, stream)
        ctype = b"text/event-stream" if stream else b"application/json"
        self.transport.write(b"HTTP/1.1 200 OK\r\n" + (PROVIDER_FIELDS if kind == "headed" else b"") + b"content-type: "
                             + ctype + b"\r\ncontent-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    async def held(self, n: int) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

        def chunked(data: bytes) -> bytes:
            return f"{len(data):x}\r\n".encode() + data + b"\r\n"

        self.transport.write(chunked(_chunk({"role": "assistant", "content": ""})))
        for i in range(n):
            self.transport.write(chunked(_chunk({"content": f" w{i}"})))
        await asyncio.sleep(self.hold)
        if not self.transport.is_closing():
            self.transport.write(chunked(_chunk({}, "stop") + USAGE + b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port, backlog=2048)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    Upstream.hold = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
