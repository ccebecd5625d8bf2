"""A listener that takes every connection waiting in the backlog at once.

trio's SocketListener accepts one connection per pass of the scheduler (each accept ends with a
checkpoint). Under load a pass runs every ready task once, so a burst of new clients queues in
the kernel's backlog behind the established ones: with 1,000 clients connecting at once to a
busy gateway, a third of them had no answer after 60 s while the first ones were served again
and again. This listener drains the backlog (bounded) whenever the socket is readable and hands
the streams out without a checkpoint between them, so `trio.serve_listeners` starts a whole
burst's handlers in one pass, and every client then gets its share of the loop.
"""

from __future__ import annotations

import errno
import socket
from collections import deque

import trio

# per wakeup: bounds the pass, and leaves the rest of a burst to sibling workers (--workers)
MAX_BATCH = 64
# the peer gave up between SYN and accept, or the like: that connection is gone, the next one is not
GONE = {errno.ECONNABORTED, errno.EPERM, errno.EPROTO, errno.ENETDOWN, errno.ENOPROTOOPT,
        errno.EHOSTDOWN,
        errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH}


class BatchListener(trio.abc.Listener[trio.SocketStream]):
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.socket = sock
        self._ready: deque[trio.SocketStream] = deque()

    async def accept(self) -> trio.SocketStream:
        if self._ready:
            # no checkpoint: the caller spawns the rest of this batch's handlers in the same pass
            return self._ready.popleft()
        while True:
            if self.socket.fileno() == -1:
                raise trio.ClosedResourceError("the listener was closed")
            await trio.lowlevel.wait_readable(self.socket)
            self._take()
            if self._ready:
                return self._ready.popleft()

    def _take(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                conn, _ = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in GONE:
                    continue
                if self._ready:  # hand out what was taken; the error comes back on the next accept
                    return
                raise  # EMFILE and the like: trio.serve_listeners logs, waits and retries
            self._ready.append(trio.SocketStream(trio.socket.from_stdlib_socket(conn)))

    async def aclose(self) -> None:
        trio.lowlevel.notify_closing(self.socket)
        self.socket.close()
        while self._ready:  # taken from the backlog, never handed to a handler
            await self._ready.popleft().aclose()
        await trio.lowlevel.checkpoint()
