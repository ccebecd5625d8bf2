"""The gateway's listener takes a burst of connections in one pass of the scheduler, where trio's
SocketListener takes one per pass (so under load a burst of new clients waited behind the
established ones). Counted in scheduler passes, never in time."""

from __future__ import annotations

import socket

import pytest
import trio

from relayline.adapters.gateway.listen import BatchListener

BURST = 60


def listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(BURST * 2)
    return sock


async def passes_to_accept(make_listener) -> tuple[int, list[bytes]]:
    """Scheduler passes between the first and the last of BURST accepted connections (connected
    before the server starts), and what each handler read from its client."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    clients = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(BURST)]
    for i, client in enumerate(clients):
        await client.send_all(b"%02d" % i)
    passes = 0
    got: list[bytes] = []
    all_in = trio.Event()

    async def handler(stream: trio.SocketStream) -> None:
        got.append(await stream.receive_some(2))
        if len(got) == BURST:
            all_in.set()
        await stream.aclose()

    async def ticker() -> None:
        nonlocal passes
        while True:
            passes += 1
            await trio.lowlevel.checkpoint()  # once per pass: every runnable task runs once a pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await nursery.start(trio.serve_listeners, handler, [make_listener(sock)])
        start = passes
        with trio.fail_after(10):
            await all_in.wait()
        taken = passes - start
        nursery.cancel_scope.cancel()
    for client in clients:
        await client.aclose()
    return taken, got


async def test_a_burst_is_accepted_in_a_few_passes():
    taken, got = await passes_to_accept(BatchListener)
    assert sorted(got) == [b"%02d" % i for i in range(BURST)]
    assert taken <= 6, taken


async def test_trio_socket_listener_takes_one_connection_per_pass():
    # the reason for BatchListener: the same burst through trio's own listener
    taken, got = await passes_to_accept(lambda sock: trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    assert len(got) == BURST and taken >= BURST


async def test_closing_closes_the_connections_taken_but_not_handed_out():
    sock = listening_socket()
    listener = BatchListener(sock)
    clients = [await trio.open_tcp_stream("127.0.0.1", sock.getsockname()[1]) for _ in range(3)]
    first = await listener.accept()  # takes all three, hands out one
    await listener.aclose()
    await first.aclose()
    for client in clients:
        with trio.fail_after(5):
            assert await client.receive_some(10) == b""  # closed by the server side
    assert sock.fileno() == -1
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()
