"""A write the kernel takes whole costs no pass of trio's scheduler.

trio's `SocketStream.send_all` ends every write with a schedule point, a whole pass of the run
loop (its epoll_wait included), even when the kernel took every byte at once: the usual case for
a request or an answer of a few KiB. The two writes of a non-streamed request (the request to the
provider, the answer to the client) were two of the four passes a request cost the gateway, and
of the four a zero-logic proxy on the same server costs (bench/proxy_floor.py). Here the bytes
are offered to the socket first, after the same cancellation check (a cancelled task sends
nothing, as with send_all); what the kernel did not take, or any error, goes through send_all,
which waits for room and says what went wrong in trio's words. Each of the two writes is followed
by a read that waits (the provider's answer, the client's next request): the task still yields.

Only for a stream no other task writes to at the same time (send_all's conflict check is not
made on the first offer), and only for a plain TCP stream: TLS goes through send_all.
"""

from __future__ import annotations

import os

import trio


async def send_all(stream: trio.abc.SendStream, data: bytes | bytearray | memoryview) -> None:
    if type(stream) is not trio.SocketStream:
        await stream.send_all(data)
        return
    await trio.lowlevel.checkpoint_if_cancelled()
    # fileno() read now, with no await before the write: a closed stream's is -1 (EBADF below),
    # never a number the descriptor table gave to another socket since
    try:
        sent = os.write(stream.socket.fileno(), data)
    except OSError:  # (would block, reset, closed...: send_all waits, or raises trio's error)
        sent = 0
    if sent < len(data):
        await stream.send_all(memoryview(data)[sent:])
