"""The answer side of a connection: an ASGI app's `send` messages framed (a declared length, the
whole body's, chunked, or the connection's close) and written to the socket in pieces the send
watchdog sees progress in, and a client found gone told to the hang-up watch. Its own module
because the answer has its own state and rules (RFC 9112 6.1-6.3) apart from reading requests:
`Connection` (connection.py) reads and hands requests to the app, and answers through this."""

from __future__ import annotations

import logging
import time
from email.utils import formatdate
from typing import Any, Protocol

import trio

from ... import sockets
from ...codecs.http1 import render_response_head
from .hangups import Hangups

log = logging.getLogger("relayline.gateway")

SEND_CHECKS = 4  # the watchdog looks this many times per SEND_TIMEOUT_S
# the unit of progress the watchdog sees: a slow reader of a large body is not cut
WRITE_PIECE = 64 * 1024

# an ASGI message (the app's `send` and `receive`): a dict whose values the ASGI spec types by
# key (a boundary, as JSON is)
Message = dict[str, Any]


class _Date:
    """The Date header, formatted at most once a second."""

    def __init__(self) -> None:
        self.second = 0
        self.value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second, self.value = now, formatdate(now, usegmt=True).encode()
        return self.value


date_header = _Date()


class AnswerHost(Protocol):
    """What an answer reads of its server: whether it drains, its hang-up watch (None: none)."""

    draining: bool
    hangups: Hangups | None


# what `_head` reads
_FRAMING_NAMES = frozenset({b"content-length", b"connection", b"transfer-encoding"})


class AnswerWriter:
    """The answer side of one connection (its state is set by `Connection.__init__` and reset
    for each request by `Connection._request`)."""

    __slots__ = ("server", "stream", "gone", "sent_head", "pending_head", "method",
                 "response_done", "writing", "writes", "writes_seen", "checks_stalled",
                 "hangup_fd", "keep_alive", "framing", "remaining")

    server: AnswerHost
    stream: trio.SocketStream
    gone: bool  # the client left (or the answer was cut): nothing more is written
    sent_head: bool
    pending_head: tuple[int, list[tuple[bytes, bytes]]] | None  # (status, headers)
    method: str
    response_done: bool
    writing: bool
    writes: int
    writes_seen: int
    checks_stalled: int
    hangup_fd: int | None  # the socket's number when its hang-up is watched
    keep_alive: bool
    framing: str  # the answer's: "length", "chunked", "close" (an HTTP/1.0 client's stream)
    remaining: int  # bytes of a declared content-length still to write

    def stalled(self) -> bool:
        """The watchdog's look: True when a write has been stuck for SEND_CHECKS looks."""
        if not self.writing or self.writes != self.writes_seen:
            self.writes_seen, self.checks_stalled = self.writes, 0
            return False
        self.checks_stalled += 1
        return self.checks_stalled >= SEND_CHECKS


    async def _write(self, data: bytes) -> None:
        if self.gone or not data:
            return
        # a write offered to the socket at once (sockets.py) only when no other is under way: it
        # skips send_all's check that two tasks never write at the same time
        at_once = not self.writing
        self.writing = True
        try:
            if len(data) <= WRITE_PIECE:
                self.writes += 1
                if at_once:
                    await sockets.send_all(self.stream, data)
                else:
                    await self.stream.send_all(data)
            else:
                view = memoryview(data)
                for start in range(0, len(data), WRITE_PIECE):
                    self.writes += 1  # progress, as the watchdog sees it
                    await self.stream.send_all(view[start:start + WRITE_PIECE])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # the client left (or stopped reading: _watch_sends): later writes are dropped and
            # receive() says disconnect; closing the stream wakes a receive() waiting on it
            self.gone = True
            self.hung_up()  # before the close yields: its fd number may be taken and watched again
            await trio.aclose_forcefully(self.stream)
        except trio.Cancelled:
            # a write cut short (the app's grace for a slow client ran out) may have sent part of
            # a chunk: nothing may follow it on this connection (an error event written next
            # would land inside the cut chunk), so the answer ends here, cut, and the connection
            # closes once the app returns
            self.gone = True
            raise
        finally:
            self.writing = False

    def hung_up(self) -> None:
        """A write found the client gone (or the send watchdog cut it): an app watching for a
        hang-up hears it here, because the socket is closed next, and a closed socket leaves the
        epoll set without an event (a reset the write saw first would be lost to it too)."""
        fd, self.hangup_fd = self.hangup_fd, None
        hangups = self.server.hangups
        if fd is not None and hangups is not None:
            callback = hangups.unwatch(fd, self)
            hangups.forget(fd, self)
            if callback is not None:
                callback()

    def forget_hangups(self) -> None:
        """The connection ends: its socket leaves the hang-up set before it closes."""
        fd, self.hangup_fd = self.hangup_fd, None
        hangups = self.server.hangups
        if fd is not None and hangups is not None:
            hangups.forget(fd, self)

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes,
              more: bool) -> bytes:
        """The answer's head and its framing (RFC 9112 6.1-6.3): a declared length, else the whole
        body's length, else chunked while the connection stays open. A stream to a client that
        asked for `connection: close`, or to an HTTP/1.0 client (which may not be sent chunked,
        6.1), is framed by the connection's close instead (6.3, its last case: a response with
        neither length nor chunked ends with the connection): legal, and its SSE has its own end."""
        declared = None
        for name, value in headers:
            lowered = name.lower()
            if lowered not in _FRAMING_NAMES:  # (nearly every header: one look-up, not three tests)
                continue
            if lowered == b"content-length":
                declared = int(value)
            elif lowered == b"connection":
                if b"close" in value.lower():
                    self.keep_alive = False
            else:
                raise ValueError("an app's transfer-encoding: the server frames the answer itself")
        bodiless = status < 200 or status in (204, 304)
        if bodiless:
            self.framing, self.remaining = "length", 0
        elif declared is not None:
            self.framing, self.remaining = "length", declared
        elif not more:
            # the whole body is here: framed by its length (one write, no chunks)
            headers.append((b"content-length", str(len(body)).encode()))
            self.framing, self.remaining = "length", len(body)
        # (an HTTP/1.0 client is never kept alive: its stream ends with the close)
        elif self.keep_alive:
            headers.append((b"transfer-encoding", b"chunked"))
            self.framing = "chunked"
        else:
            self.framing = "close"
        if not self.keep_alive and not any(name.lower() == b"connection" for name, _ in headers):
            headers.append((b"connection", b"close"))
        if self.method == "HEAD" or bodiless:
            self.remaining = 0
            self.framing = "none"
        return render_response_head(status, headers)

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers") or ())
            if self.server.draining and not any(k.lower() == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            headers.append((b"date", date_header()))
            # the head is built once its body is known: a whole body adds its length first (one
            # render and one header check)
            self.pending_head = (message["status"], headers)
            return
        if kind != "http.response.body" or self.response_done or self.gone:
            return  # (gone: the client left, or the server already refused its request's body)
        body = message.get("body") or b""
        more = message.get("more_body", False)
        data = b""
        if self.pending_head is not None:
            status, headers = self.pending_head
            self.pending_head = None
            # an app's malformed header raises here, into the app, as from its start message
            data = self._head(status, headers, body, more)
            self.sent_head = True
        framing = self.framing
        if body and framing != "none":
            if framing == "chunked":
                data += b"%x\r\n%s\r\n" % (len(body), body)
            elif framing == "length":
                self.remaining -= len(body)
                data += body
            else:
                data += body
        if not more:
            if framing == "chunked":
                data += b"0\r\n\r\n"
            elif framing == "close":
                self.keep_alive = False
            self.response_done = True
        if self.remaining < 0 or (self.response_done and framing == "length" and self.remaining):
            # what the answer declared and what it sent differ: the client could not frame it
            log.error("http_send_refused declared_length_off_by=%d", -self.remaining)
            self.gone = True
            return
        await self._write(data)
