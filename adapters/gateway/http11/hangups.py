"""The hang-up watch: the requests whose client hung up while their app runs are called back,
with no task per request."""

from __future__ import annotations

import select
from collections.abc import Callable

import trio


class Watched:
    """A connection's entry in the hang-up set: the request's call-back while one runs."""

    __slots__ = ("owner", "callback", "hung_up")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.callback: Callable[[], None] | None = None
        self.hung_up = False  # the event came (it comes once: EPOLLONESHOT)


class Hangups:
    """Calls back the requests whose client hung up while their app runs, with no task per
    request: their sockets are in an epoll set of the server's own, one-shot for EPOLLRDHUP (the
    peer closed its side, whatever it sent before it: a pipelined request does not hide it), and
    one task waits for that set to be readable. The gateway's task per turn blocked in
    `receive()` cost CPU on every request (its spawn, its cancellation at the turn's end:
    bench/gateway_cpu.py). A connection's socket joins the set at its first watched request and
    leaves it when the connection ends (`forget`, before its socket closes): two epoll_ctl calls
    a connection, not two a request (bench/probes/glue_counts.py); between requests it has no
    call-back, and a hang-up heard then is told to the next request at once, as a new registration
    would have told it. Linux only (epoll); without it the extension is absent and an app waits in
    `receive()`."""

    AVAILABLE = hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP")

    def __init__(self) -> None:
        self.epoll = select.epoll()
        # fd -> the entry of the connection that registered it. A socket closed while it is in
        # the set leaves it (the kernel's doing) and its number may be reused at once: an entry
        # is removed only by the connection that made it
        self.callbacks: dict[int, Watched] = {}

    def watch(self, fd: int, owner: object, callback: Callable[[], None]) -> None:
        if self.epoll.closed:  # the server is ending: every request is being cancelled anyway
            callback()
            return
        entry = self.callbacks.get(fd)
        if entry is None or entry.owner is not owner:
            if entry is not None:  # a closed socket's stale entry
                self._unregister(fd)
            entry = self.callbacks[fd] = Watched(owner)
            # (HUP and ERR always count)
            self.epoll.register(fd, select.EPOLLRDHUP | select.EPOLLONESHOT)
        if entry.hung_up:
            callback()
        else:
            entry.callback = callback

    def unwatch(self, fd: int, owner: object) -> Callable[[], None] | None:
        """The request is over: the call-back that was waiting, if the owner's entry still had
        one. The socket stays in the set for the connection's next request."""
        entry = self.callbacks.get(fd)
        if entry is not None and entry.owner is owner:
            callback, entry.callback = entry.callback, None
            return callback
        return None

    def forget(self, fd: int, owner: object) -> None:
        """The connection ends (its socket is closed next): its entry and registration go."""
        entry = self.callbacks.get(fd)
        if entry is not None and entry.owner is owner:
            del self.callbacks[fd]
            self._unregister(fd)  # (a one-shot that fired is still in the set, disarmed)

    def _unregister(self, fd: int) -> None:
        if not self.epoll.closed:
            try:
                self.epoll.unregister(fd)
            except OSError:
                pass  # its socket was closed (and the number not reused by a watched one)

    async def run(self) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(self.epoll.fileno())
                for fd, _events in self.epoll.poll(0):
                    entry = self.callbacks.get(fd)
                    if entry is not None and not entry.hung_up:
                        entry.hung_up = True
                        callback, entry.callback = entry.callback, None
                        if callback is not None:
                            callback()
        finally:
            self.epoll.close()

