"""A stream's deadlines when the client, not the provider, holds it up.

A gateway stream writes to its client in the turn's own task; a client that stops reading holds
that write, and with it the next upstream read. The provider's idle deadline is lifted meanwhile
(test_slow_reader.py), but `timeouts.total_s` bounds the whole turn, "streams included": a turn
stuck behind a stalled reader still ends when its budget runs out, the upstream connection is
closed, and the ledger is written, long before the server's send watchdog (60 s) cuts the client.

Real loopback servers on both sides; the client is a raw socket that stops reading.
"""

from __future__ import annotations

import json
import socket

import h11
import trio

from helpers import serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway, stream_wire
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

TOTAL_S = 1.0
GRACE_S = 0.5
FRAME_TEXT = 16 * 1024
FRAMES = 1024  # 16 MiB: far beyond every buffer between the provider and a client that stopped


def chunk(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def endless_frames() -> tuple[bytes, ...]:
    return tuple(chunk({"choices": [{"index": 0, "delta": {"content": "x" * FRAME_TEXT}, "finish_reason": None}]})
                 for _ in range(FRAMES))


async def stalled_client(url: str) -> tuple[trio.SocketStream, h11.Connection]:
    """POST a streamed request, read until the response head arrived, then stop reading."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    raw = json.dumps({"model": "m-primary", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    conn = h11.Connection(h11.CLIENT)
    await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=[
        ("host", f"{host}:{port}"), ("content-type", "application/json"), ("content-length", str(len(raw)))]))
        + conn.send(h11.Data(data=raw)) + conn.send(h11.EndOfMessage()))
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
    config = {"active": "primary",
              "providers": {"primary": {"family": "openai", "base_url": "", "model": "m-primary", "api_key": "k-stall",
                                        "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}},
              "reliability": {"provider_retries": 0},
              "timeouts": {"headers_s": 5, "idle_s": 0.3, "total_s": TOTAL_S}}
    results = []
    ended = trio.Event()

    def observe(result) -> None:
        results.append(result)
        ended.set()

    async with trio.open_nursery() as nursery:
        await upstream.start(nursery)
        config["providers"]["primary"]["base_url"] = f"{upstream.url}/v1"
        relay = Relay(structure_config(config), env={})
        relay.observers.append(observe)
        gateway = Gateway(relay)
        url = await serve_in_process(nursery, gateway)
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
