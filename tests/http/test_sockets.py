"""adapters/sockets.py: a write the kernel takes whole goes out with no pass of trio's scheduler;
anything else (a write larger than the socket's room, a cancelled task, a closed or reset
connection) behaves as trio's own send_all, on real loopback TCP connections."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from relayline.adapters import sockets


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listeners[0].accept()
    await listeners[0].aclose()
    return client, server


class _Steps(trio.abc.Instrument):
    def __init__(self, task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task) -> None:
        if task is self.task:
            self.steps += 1


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    data = b""
    with trio.fail_after(10):
        while len(data) < n:
            piece = await stream.receive_some(65536)
            assert piece, "the connection ended early"
            data += piece
    return data


async def test_a_write_the_kernel_takes_whole_needs_no_scheduler_pass():
    client, server = await _pair()
    steps = _Steps(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        await sockets.send_all(client, b"x" * 4096)
        at_once = steps.steps
        await client.send_all(b"y" * 4096)  # trio's own: a schedule point after the write
        through_trio = steps.steps - at_once
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert at_once == 0 and through_trio == 1
    assert await _receive_exactly(server, 8192) == b"x" * 4096 + b"y" * 4096
    await client.aclose()
    await server.aclose()


async def test_what_the_kernel_does_not_take_at_once_goes_out_whole_and_in_order():
    client, server = await _pair()
    client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # room for a fraction of it
    payload = bytes(range(256)) * 16384  # 4 MiB
    received = b""

    async def read() -> None:
        nonlocal received
        received = await _receive_exactly(server, len(payload))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await sockets.send_all(client, payload)
    assert received == payload
    await client.aclose()
    await server.aclose()


async def test_a_cancelled_task_sends_nothing():
    client, server = await _pair()
    with trio.CancelScope() as scope:
        scope.cancel()
        await sockets.send_all(client, b"never")
    assert scope.cancelled_caught
    await sockets.send_all(client, b"after")
    assert await _receive_exactly(server, 5) == b"after"
    await client.aclose()
    await server.aclose()


async def test_a_closed_stream_raises_trios_closed_error():
    client, server = await _pair()
    await client.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await sockets.send_all(client, b"late")
    await server.aclose()


async def test_a_connection_the_peer_reset_raises_trios_broken_error():
    client, server = await _pair()
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await server.aclose()  # closed with a reset
    with pytest.raises(trio.BrokenResourceError):
        with trio.fail_after(10):
            for _ in range(100):  # the first write may be taken before the reset is seen
                await sockets.send_all(client, b"z" * 1024)
                await trio.sleep(0.01)
    await client.aclose()


async def test_a_stream_that_is_not_plain_tcp_goes_through_its_own_send_all():
    left, right = trio.testing.memory_stream_pair()
    await sockets.send_all(left, b"memory")
    assert await right.receive_some(100) == b"memory"


# -- receive_after_wait: a read that waits before it tries ------------------------------------------


async def test_a_read_that_must_wait_reads_once_what_arrives(monkeypatch):
    client, server = await _pair()
    reads: list[int] = []
    read = sockets.os.read

    def counted(fd: int, n: int) -> bytes:
        reads.append(fd)
        return read(fd, n)

    monkeypatch.setattr(sockets.os, "read", counted)
    async with trio.open_nursery() as nursery:
        async def later() -> None:
            await trio.sleep(0.05)
            await client.send_all(b"the answer")

        nursery.start_soon(later)
        with trio.fail_after(10):
            assert await sockets.receive_after_wait(server, 65536) == b"the answer"
    assert len(reads) == 1  # no read before the wait (trio's receive_some tries one, then waits)
    await client.send_all(b"already here")
    await trio.sleep(0.05)
    with trio.fail_after(10):
        assert await sockets.receive_after_wait(server, 65536) == b"already here"
    await client.aclose()
    with trio.fail_after(10):
        assert await sockets.receive_after_wait(server, 65536) == b""  # the peer's end
    await server.aclose()


async def test_a_read_that_must_wait_fails_as_trios_would():
    client, server = await _pair()
    await client.send_all(b"kept")
    with trio.CancelScope() as scope:  # a cancelled task reads nothing: the bytes stay for the next read
        scope.cancel()
        await sockets.receive_after_wait(server, 65536)
    assert scope.cancelled_caught
    with trio.fail_after(10):
        assert await sockets.receive_after_wait(server, 65536) == b"kept"

    async with trio.open_nursery() as nursery:  # closed while it waits
        async def close_soon() -> None:
            await trio.sleep(0.05)
            server.socket.close()

        nursery.start_soon(close_soon)
        with pytest.raises(trio.ClosedResourceError):
            await sockets.receive_after_wait(server, 65536)
    with pytest.raises(trio.ClosedResourceError):  # already closed
        await sockets.receive_after_wait(server, 65536)
    await client.aclose()

    client, server = await _pair()
    client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await client.aclose()  # closed with a reset
    with pytest.raises(trio.BrokenResourceError), trio.fail_after(10):
        await sockets.receive_after_wait(server, 65536)
    await server.aclose()
    left, right = trio.testing.memory_stream_pair()  # not plain TCP: its own receive_some
    await left.send_all(b"memory")
    assert await sockets.receive_after_wait(right, 100) == b"memory"
