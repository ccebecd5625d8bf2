"""A client that reads slowly, through the real gateway over loopback HTTP ("the
provider is blamed for the client").

The gateway runs under hypercorn as `relayline serve` does; the client is a raw socket with a
small receive buffer that reads a few KB/s, then stops reading for several times `idle_s`, then
reads the rest. The provider streams 2 MiB as fast as TCP lets it. The pipeline between them is
bounded (the client's receive buffer, the gateway's send buffer, the stream's 256 KiB pending
write buffer, the gateway's and the upstream's socket buffers), so the slow reader must hold the
upstream back. The kernel would let loopback buffers grow to megabytes; they are capped here to
what a real path to a provider holds, so that the pause shows within seconds.

What must hold: the upstream's writes pause for longer than `idle_s` and the provider's idle
deadline still never fires; the attempt is `ok` (not interrupted), the breaker is untouched, the
ledger row is the accepted answer, and the client receives every byte of the stream.
"""

from __future__ import annotations

import json
import socket

import h11
import trio

from helpers import serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

IDLE_S = 0.4
FRAME_TEXT = 16 * 1024
FRAMES = 128  # 2 MiB of text: far beyond everything the pipeline can buffer
SOCKET_BUFFER = 64 * 1024  # the upstream's send buffer and the gateway's receive buffer from it
CLIENT_BUFFER = 4096


def chunk(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def frames() -> tuple[bytes, ...]:
    text = [chunk({"choices": [{"index": 0, "delta": {"content": f"{i:05d}" + "x" * (FRAME_TEXT - 5)},
                                "finish_reason": None}]}) for i in range(FRAMES)]
    return (chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
            *text,
            chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": FRAMES}}),
            b"data: [DONE]\n\n")


class TimedStream(trio.abc.HalfCloseableStream):
    """The upstream's side of its connection, noting when each write was taken by the kernel."""

    def __init__(self, stream: trio.SocketStream, writes: list[float]) -> None:
        self.stream = stream
        self.writes = writes

    async def send_all(self, data) -> None:
        await self.stream.send_all(data)
        self.writes.append(trio.current_time())

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class BoundedUpstream(LoopbackServer):
    """A loopback provider whose socket send buffer is bounded, and whose writes are timed."""

    def __init__(self, handler) -> None:
        super().__init__(handler)
        self.writes: list[float] = []

    async def _serve(self, stream: trio.SocketStream) -> None:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        await super()._serve(TimedStream(stream, self.writes))


async def slow_client(url: str, body: dict, log: list[tuple[str, float]]) -> tuple[int, bytes]:
    """POST `body` and read the answer: 1 KiB every 0.25 s for a second (4 KB/s), then nothing
    for 4 x idle_s, then the rest as it comes. Returns the status and the decoded body."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_BUFFER)  # before connect: the window
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    raw = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=[
        ("host", f"{host}:{port}"), ("content-type", "application/json"), ("content-length", str(len(raw)))])))
    await stream.send_all(conn.send(h11.Data(data=raw)) + conn.send(h11.EndOfMessage()))
    status, received = 0, bytearray()
    started = trio.current_time()
    stalled = False
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            elapsed = trio.current_time() - started
            if elapsed < 1.0:
                await trio.sleep(0.25)
                data = await stream.receive_some(1024)
            else:
                if not stalled:
                    stalled = True
                    log.append(("stall", trio.current_time()))
                    await trio.sleep(4 * IDLE_S)
                    log.append(("resume", trio.current_time()))
                data = await stream.receive_some(65536)
            conn.receive_data(data)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            received += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            break
    await stream.aclose()
    return status, bytes(received)


async def test_a_slow_reader_pauses_the_upstream_and_the_provider_is_not_blamed(monkeypatch):
    from httpcore._backends.trio import TrioBackend

    connect = TrioBackend.connect_tcp

    async def bounded_connect(self, *args, socket_options=None, **kwargs):
        options = [*(socket_options or ()), (socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)]
        return await connect(self, *args, socket_options=options, **kwargs)

    monkeypatch.setattr(TrioBackend, "connect_tcp", bounded_connect)
    upstream = BoundedUpstream(lambda seen: Reply(headers=(("content-type", "text/event-stream"),),
                                                  pieces=frames()))
    config = {"active": "primary",
              "providers": {"primary": {"family": "openai", "base_url": "", "model": "m-primary",
                                        "api_key": "slow-reader-key",  # registered for redaction: distinct
                                        "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}},
              "breaker": {"failure_threshold": 1},
              "reliability": {"provider_retries": 0},
              "timeouts": {"headers_s": 5, "idle_s": IDLE_S, "first_token_s": 5, "total_s": 60}}
    log: list[tuple[str, float]] = []
    results = []
    async with trio.open_nursery() as nursery:
        await upstream.start(nursery)
        config["providers"]["primary"]["base_url"] = f"{upstream.url}/v1"
        relay = Relay(structure_config(config), env={})
        relay.observers.append(results.append)
        gateway = Gateway(relay)
        url = await serve_in_process(nursery, gateway)
        with trio.fail_after(30):
            status, body = await slow_client(url, {"model": "m-primary", "stream": True,
                                                        "messages": [{"role": "user", "content": "hi"}]}, log)
        await relay.aclose()
        nursery.cancel_scope.cancel()

    # the client received the whole stream, in order, and its clean end
    assert status == 200
    events = [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e).get("choices", []))
    assert len(text) == FRAMES * FRAME_TEXT
    assert [text[i * FRAME_TEXT:i * FRAME_TEXT + 5] for i in range(FRAMES)] == [f"{i:05d}" for i in range(FRAMES)]

    # the upstream was held back by the reader: its writes paused for several idle_s (from the
    # slow reading into the stall), and it could finish only once the reader resumed
    (_, stall), (_, resume) = log
    gaps = [(b - a, a) for a, b in zip(upstream.writes, upstream.writes[1:], strict=False)]
    longest, since = max(gaps)
    assert longest > 4 * IDLE_S and since < stall and since + longest >= resume, (gaps, stall, resume)
    assert upstream.writes[-1] > resume

    # and the provider was not blamed: one ok attempt, billed as the answer, breaker untouched
    (result,) = results
    assert result.outcome == "ok"
    assert [(a.provider, a.outcome) for a in result.attempts] == [("primary", "ok")]
    assert [(r.provider, r.accepted, r.output_tokens) for r in result.ledger] == [("primary", True, FRAMES)]
    breaker = relay.health.breaker("primary")
    assert breaker.state == "closed" and not breaker.failures and breaker.transitions == 0
