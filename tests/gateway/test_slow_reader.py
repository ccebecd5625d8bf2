"""Clients that hold a stream up, through the real gateway over loopback HTTP: the provider is
never blamed for the client, and the turn's budget still bounds it. Real loopback servers on both
sides; the client is a raw socket with a small receive buffer.

A client that reads slowly: it reads a few KB/s, then stops reading for several times `idle_s`,
then reads the rest. The provider streams 2 MiB as fast as TCP lets it. The pipeline between them
is bounded (the client's receive buffer, the gateway's send buffer, the stream's 256 KiB pending
write buffer, the gateway's and the upstream's socket buffers), so the slow reader must hold the
upstream back. The kernel would let loopback buffers grow to megabytes; they are capped here to
what a real path to a provider holds, so that the pause shows within seconds. What must hold: the
upstream's writes pause for longer than `idle_s` and the provider's idle deadline still never
fires; the attempt is `ok` (not interrupted), the breaker is untouched, the ledger row is the
accepted answer, and the client receives every byte of the stream.

A client that stops reading: a gateway stream writes to its client in the turn's own task, so
the stalled write holds the next upstream read. The provider's idle deadline is lifted meanwhile
(as above), but `timeouts.total_s` bounds the whole turn, "streams included": a turn stuck behind
a stalled reader still ends when its budget runs out, the upstream connection is closed, and the
ledger is written, long before the server's send watchdog (60 s) cuts the client.
"""

from __future__ import annotations

import json
import socket

import h11
import trio

from helpers import loopback_config, serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway, stream_wire
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

IDLE_S = 0.4
FRAME_TEXT = 16 * 1024
FRAMES = 128  # 2 MiB of text: far beyond everything the pipeline can buffer
ENDLESS_FRAMES = 1024  # 16 MiB: far beyond every buffer between the provider and a client that stopped
SOCKET_BUFFER = 64 * 1024  # the upstream's send buffer and the gateway's receive buffer from it
CLIENT_BUFFER = 4096
TOTAL_S = 1.0
GRACE_S = 0.5
BODY = {"model": "m-primary", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def chunk(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_frame(text: str) -> bytes:
    return chunk({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})


def frames() -> tuple[bytes, ...]:
    text = [text_frame(f"{i:05d}" + "x" * (FRAME_TEXT - 5)) for i in range(FRAMES)]
    return (chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
            *text,
            chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": FRAMES}}),
            b"data: [DONE]\n\n")


def endless_frames() -> tuple[bytes, ...]:
    return tuple(text_frame("x" * FRAME_TEXT) for _ in range(ENDLESS_FRAMES))


async def post_through_a_small_window(url: str, body: dict) -> tuple[trio.SocketStream, h11.Connection]:
    """POST `body` as a streamed chat request from a socket whose receive buffer is
    CLIENT_BUFFER (set before connect: the window the gateway sees)."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_BUFFER)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    raw = json.dumps(body).encode()
    conn = h11.Connection(h11.CLIENT)
    await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=[
        ("host", f"{host}:{port}"), ("content-type", "application/json"), ("content-length", str(len(raw)))]))
        + conn.send(h11.Data(data=raw)) + conn.send(h11.EndOfMessage()))
    return stream, conn


# -- a client that reads slowly ---------------------------------------------------------------------


async def gateway_before(nursery: trio.Nursery, upstream: LoopbackServer, observer, api_key: str,
                         **timeouts) -> tuple[Relay, str]:
    """`upstream` started as the one profile (`primary`, no retries, these timeouts) of a gateway
    served in process: the gateway's relay, whose turn results go to `observer`, and its URL."""
    await upstream.start(nursery)
    config = loopback_config(upstream.url, reliability={"provider_retries": 0}, timeouts=timeouts)
    config["providers"]["primary"]["api_key"] = api_key  # registered for redaction: distinct
    relay = Relay(structure_config(config), env={})
    relay.observers.append(observer)
    return relay, await serve_in_process(nursery, Gateway(relay))


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
    stream, conn = await post_through_a_small_window(url, body)
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
    log: list[tuple[str, float]] = []
    results = []
    async with trio.open_nursery() as nursery:
        relay, url = await gateway_before(nursery, upstream, results.append, "slow-reader-key",
                                          headers_s=5, idle_s=IDLE_S, first_token_s=5, total_s=60)
        with trio.fail_after(30):
            status, body = await slow_client(url, BODY, log)
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


# -- a client that stops reading -------------------------------------------------------------------


async def stalled_client(url: str) -> tuple[trio.SocketStream, h11.Connection]:
    """POST a streamed request, read until the response head arrived, then stop reading."""
    stream, conn = await post_through_a_small_window(url, BODY)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(1024))
        elif isinstance(event, h11.Response):
            assert event.status_code == 200
            return stream, conn


async def read_the_rest(stream: trio.SocketStream, conn: h11.Connection) -> tuple[bytes, str]:
    """What the client reads once it resumes, to the connection's end: the body bytes, and how
    the answer ended ("end", or h11's word for a body cut short)."""
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return bytes(body), str(exc)
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Data):
            body += event.data
        else:
            return bytes(body), "end"


async def test_total_s_ends_a_turn_held_by_a_client_that_stopped_reading(monkeypatch):
    monkeypatch.setattr(stream_wire, "SEND_GRACE_S", GRACE_S)  # the write the budget found waiting: its grace
    upstream = LoopbackServer(lambda seen: Reply(pieces=endless_frames()))
    results = []
    ended = trio.Event()

    def observe(result) -> None:
        results.append(result)
        ended.set()

    async with trio.open_nursery() as nursery:
        relay, url = await gateway_before(nursery, upstream, observe, "k-stall",
                                          headers_s=5, idle_s=0.3, total_s=TOTAL_S)
        client, conn = await stalled_client(url)
        started = trio.current_time()
        # the turn's budget runs out while its write waits for the client: it ends then (a few
        # tenths of a second of slack), not when the send watchdog gives up on the client
        with trio.move_on_after(TOTAL_S + GRACE_S + 1.5):
            await ended.wait()
        took = trio.current_time() - started
        with trio.move_on_after(2.0):
            while upstream.closed < upstream.accepted:
                await trio.sleep(0.02)
        upstream_open = upstream.accepted - upstream.closed
        with trio.fail_after(5):
            body, end = await read_the_rest(client, conn)
        await client.aclose()
        await relay.aclose()
        nursery.cancel_scope.cancel()

    assert results, f"the turn was still running {took:.1f} s after the client stopped reading (total_s {TOTAL_S})"
    (result,) = results
    assert result.outcome != "ok" and took < TOTAL_S + GRACE_S + 1.5
    assert upstream_open == 0  # the provider's connection was closed with the turn
    assert [r.provider for r in result.ledger] == ["primary"]  # and what it streamed is accounted
    # the write the grace cut ended the connection: the client sees an answer cut short, never
    # the error event's bytes inside a frame the cut write had begun (a garbled stream)
    events = body.split(b"\n\n")
    assert all(json.loads(event.removeprefix(b"data: ")) for event in events[:-1])
    assert events[-1].startswith(b"data: {") and end.startswith("peer closed connection"), (events[-1][-200:], end)
