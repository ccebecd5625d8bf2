"""A write the kernel takes whole costs no pass of trio's scheduler; a read that must wait tries
no read first.

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

trio's `receive_some` first tries the read, and only when the kernel has nothing (EAGAIN, a
BlockingIOError raised and caught) waits for the socket and reads again. Where the bytes are
seldom there yet, the answer to a request just written (the provider's head) or the next request
of a client still reading this answer, that first try is a syscall and an exception for nothing,
twice a request (bench/probes/glue_counts.py counts the recvfrom calls). `receive_after_wait`
waits first: the same checkpoint (the wait parks; a cancelled task reads nothing), the same
errors in trio's words. Where the bytes were there after all (the peer the write woke may run
first), the wait returns in the next pass of the loop, as trio's read would have yielded one
after reading them (bench/probes/glue_counts.py at 16 clients: no worse).

`tls_bytes_buffered` says whether a TLS stream still holds bytes read off its socket: an idle
upstream connection that does must not carry the next request.
"""

from __future__ import annotations

import errno
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


async def receive_after_wait(stream: trio.abc.ReceiveStream, max_bytes: int) -> bytes | bytearray:
    """Up to `max_bytes` from the stream, b"" at its end: trio's `receive_some`, waiting before
    the first read (see above). Only one task may read a stream at a time, as with trio's."""
    if type(stream) is not trio.SocketStream:
        return await stream.receive_some(max_bytes)
    sock = stream.socket
    while True:
        if sock.fileno() < 0:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("this socket was already closed")
        await trio.lowlevel.wait_readable(sock)  # (closed while it waits: ClosedResourceError)
        try:
            # fileno() read now, with no await before the read (as in send_all)
            return os.read(sock.fileno(), max_bytes)
        except BlockingIOError:
            # (readable, then read by nobody else: rare, e.g. a checksum the kernel dropped)
            continue
        except OSError as exc:
            if exc.errno == errno.EBADF:
                raise trio.ClosedResourceError("this socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
