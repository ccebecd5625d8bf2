"""One client connection: its requests read in turn, each handed to the app as an ASGI `http`
scope with its `receive` and `send`; the answers are framed and written by its answer side
(answer.py: `AnswerWriter`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import unquote

import trio

from ... import sockets
from ...codecs.http1 import render_response_head
from .answer import AnswerHost, AnswerWriter, Message, date_header
from .hangups import Hangups
from .reader import END, IDLE, Event, Fault, Head, Reader

log = logging.getLogger("relayline.gateway")

READ_SIZE = 64 * 1024
READ_AHEAD = 64 * 1024  # input buffered beyond the request in progress (a pipelining client)
LINGER_S, LINGER_BYTES = 0.5, 64 * 1024  # reading past a closed request before the socket closes
# a body trickled in small pieces: each read costs the same whatever its size, so after a few
# small ones the next read of the body waits a moment first, and gets what arrived meanwhile in
# one piece; the reads a body can cost are bounded by its arrival time, not its piece count
SMALL_BODY_READ = 16 * 1024
SMALL_BODY_READS_FREE = 16
BODY_GATHER_S = 0.01


# the ASGI surface the app is called with: a scope and its messages (answer.py's `Message`) are
# dicts whose values the ASGI spec types by key (a boundary, as JSON is)
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class ConnectionHost(AnswerHost, Protocol):
    """What a connection reads of its server: the app, the body of the server's own refusals,
    whether it drains, its hang-up watch (None: none here), and the bound of a request head."""

    app: App
    error_body: Callable[[int, str], bytes]
    draining: bool
    hangups: Hangups | None
    max_header_bytes: int


class _Close(Exception):
    """The connection ends here (the peer left, or a protocol error was answered)."""


class Connection(AnswerWriter):
    __slots__ = ("reader", "waiting_since", "client", "local", "extensions", "request_done",
                 "expect_continue", "read_ahead", "small_body_reads")

    server: ConnectionHost

    def __init__(self, server: ConnectionHost, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.reader = Reader(server.max_header_bytes)
        # when its wait for a request head began (while it waits)
        self.waiting_since: float | None = None
        sock = stream.socket
        self.client: tuple[str, int] | None
        self.local: tuple[str, int] | None
        try:
            peer, here = sock.getpeername(), sock.getsockname()
            self.client, self.local = (peer[0], peer[1]), (here[0], here[1])
        except OSError:
            self.client = self.local = None
        self.gone = False
        self.sent_head = False
        self.pending_head = None  # (status, headers)
        self.method = ""
        self.response_done = False
        self.request_done = False  # the request's body was read to its end
        self.keep_alive = True
        self.expect_continue = False
        # the answer's: "length", "chunked", or "close" (an HTTP/1.0 client's stream)
        self.framing = ""
        self.remaining = 0  # bytes of a declared content-length still to write
        # bytes read past the request in progress (a pipelining client), bounded
        self.read_ahead = 0
        self.small_body_reads = 0  # small pieces of the request's body read in a row
        self.writing = False
        self.writes = self.writes_seen = self.checks_stalled = 0
        self.hangup_fd = None  # the socket's number when its hang-up is watched
        self.extensions: dict[str, Callable[..., object]] = {
            "relayline.body_here": self._body_here}
        if server.hangups is not None:
            self.extensions["relayline.hangup"] = self._watch_hangup

    def _watch_hangup(self, callback: Callable[[], None]) -> None:
        """The app's `relayline.hangup` extension: `callback` runs (once, in the server's own
        task) if the client hangs up before this request ends."""
        fd = self.stream.socket.fileno()
        hangups = self.server.hangups
        if hangups is None or self.gone or fd < 0:  # (offered only where there is a watch)
            callback()
            return
        hangups.watch(fd, self, callback)
        self.hangup_fd = fd  # (watched until the connection ends: forget_hangups)

    def drain(self) -> None:
        """The server is draining (or out of descriptors, or its head took `keep_alive_s`): a
        connection waiting for a request head closes now, without an answer. The read waiting
        for the head ends at once (trio's notify_closing: ClosedResourceError), as a timer's
        cancellation did, and no other is made (`gone`); the socket stays open for `linger`,
        which says EOF and reads what the client still sends before the close (closing it here
        could reset the connection and destroy the last answer before the client read it)."""
        if self.waiting_since is not None:
            self.waiting_since = None
            self.gone = True
            trio.lowlevel.notify_closing(self.stream.socket)

    async def run(self) -> None:
        reader = self.reader
        try:
            while True:
                if (
                    self.server.draining
                    and not reader.pending()
                    and reader.state == IDLE
                    and reader.refeed is None
                ):
                    return  # the drain closes a connection between two requests
                # the wait for a head is bounded by the server's head watchdog
                # (`Server._watch_heads`)
                self.waiting_since = trio.current_time()
                try:
                    event = await self._next_event()
                finally:  # (however the wait ends: a connection that lingers waits for no head)
                    closed, self.waiting_since = self.waiting_since is None, None
                if closed or type(event) is not Head:
                    # idle, or a head too slow (closed without an answer), or the client left
                    return
                await self._request(event)
                self._finish_reading()
                if (
                    self.gone
                    or not self.response_done
                    or not self.request_done
                    or not self.keep_alive
                ):
                    return
        except _Close:
            return

    async def linger(self) -> None:
        """Closing a socket with unread input resets the connection, and the reset can destroy an
        answer the client has not read yet: after an answer, say EOF first and drop what the
        client still sends until it closes too (bounded in bytes and time), as nginx does."""
        if not self.sent_head:
            return  # (a client that left: the EOF or the reset below ends this at once)
        with trio.move_on_after(LINGER_S):
            try:
                await self.stream.send_eof()
                seen = 0
                while seen <= LINGER_BYTES:
                    data = await self.stream.receive_some(READ_SIZE)
                    if not data:
                        return
                    seen += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return

    # -- reading --------------------------------------------------------------------------------

    def _finish_reading(self) -> None:
        """The end of a request the app did not read to its end (a GET: its `END`), when it is
        already here; a body still to come (or a fault in it) leaves the request unfinished."""
        reader = self.reader
        while not self.request_done and reader.pending():
            event = reader.peek()
            if type(event) is Fault or type(event) is Head:
                return
            reader.take()
            if event is END:
                self.request_done = True

    async def _read(self) -> bytes | bytearray:
        try:
            if self.waiting_since is not None:
                # a head: the client sends it once it has read the last answer, so it is seldom
                # here yet (sockets.py)
                return await sockets.receive_after_wait(self.stream, READ_SIZE)
            return await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _next_event(self) -> Event | None:
        """The next request event; None when the client left. A fault is answered here and ends
        the connection."""
        if not await self._fill():
            return None
        event = self.reader.take()
        if type(event) is Fault:
            await self._reject(event.status, event.message)
            raise _Close
        return event

    async def _fill(self) -> bool:
        """Read until the reader has an event; False when the client left (`gone`)."""
        reader = self.reader
        while not reader.pending():
            if self.gone:  # (drained while it waited: drain())
                return False
            data = await self._read()
            if not data:
                self.gone = True
                return False
            reader.feed(data)
        return True

    async def _reject(self, status: int, message: str) -> None:
        """An error answer from the server itself, before any app saw the request; the caller
        closes the connection after it."""
        # (an answer is under way: it cannot be replaced)
        if self.sent_head and not self.response_done:
            return
        # no app saw it: no access line
        log.info("http_refused status=%d reason=%r", status, message)
        body = self.server.error_body(status, message)
        self.sent_head = True  # linger: a reset must not destroy this answer (the input is unread)
        await self._write(render_response_head(status, [(b"content-type", b"application/json"),
                                                (b"content-length", b"%d" % len(body)),
                                                (b"connection", b"close"),
                                                (b"date", date_header())]) + body)

    # -- one request ----------------------------------------------------------------------------

    async def _request(self, request: Head) -> None:
        version = request.version
        if version[:2] != "1.":
            await self._reject(505, f"HTTP/{version} is not supported: this server speaks HTTP/1.1")
            raise _Close
        headers = request.headers
        hosts = 0
        self.expect_continue = False
        for name, value in headers:
            if name == b"host":
                hosts += 1
            elif name == b"expect" and value.lower() == b"100-continue" and version != "1.0":
                self.expect_continue = True
        if hosts > 1 or (hosts == 0 and version != "1.0"):  # RFC 9112 3.2, as h11 refused them
            await self._reject(
                400,
                "malformed HTTP request: "
                + ("more than one Host header" if hosts else "no Host header"),
            )
            raise _Close
        target = request.target
        if b"#" in target:
            # a fragment is the client's own and never sent (RFC 9110 4.2.4); one that comes is
            # no part of a path or query: refused, and not echoed (fragments carry tokens)
            await self._reject(400, "malformed HTTP request: the target has a fragment (#...), "
                               "which a client never sends; remove it")
            raise _Close
        if target[:1] != b"/" and b"://" in target[:8]:
            # absolute-form (RFC 9112 3.2.2: a server must accept it): the path is what follows
            # the authority
            authority_and_path = target.partition(b"://")[2]
            slash = authority_and_path.find(b"/")
            target = authority_and_path[slash:] if slash >= 0 else b"/"
        path, _, query = target.partition(b"?")
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if version == "1.0" else "1.1", "method": request.method.decode(),
            "scheme": "http", "path": unquote(path.decode("ascii")), "raw_path": path,
            "query_string": query,
            "root_path": "", "headers": headers, "client": self.client, "server": self.local,
            "extensions": self.extensions,
        }
        self.method = scope["method"]
        self.keep_alive = request.keep_alive
        self.sent_head = False
        self.pending_head = None
        self.response_done = False
        self.request_done = False
        self.read_ahead = 0
        self.small_body_reads = 0
        where = scope["path"]
        app = self.server.app(scope, self._receive, self._send)
        # the request's head is the app's from here on: this frame lives as long as the answer (a
        # stream's whole life) and keeps none of it
        del scope, request, headers
        try:
            await app
        except Exception:
            log.exception("http_app_error path=%s", where[:200])
            if not self.sent_head and not self.gone:  # (a start message still held is replaced)
                body = self.server.error_body(500, "internal error in the gateway (logged)")
                await self._send({"type": "http.response.start", "status": 500,
                                  "headers": [(b"content-type", b"application/json"),
                                              (b"connection", b"close")]})
                await self._send({"type": "http.response.body", "body": body})
            raise _Close from None
        finally:
            hangups = self.server.hangups
            # the request is over: a hang-up from now on is the connection's
            if self.hangup_fd is not None and hangups is not None:
                hangups.unwatch(self.hangup_fd, self)
        if not self.response_done and not self.gone:
            raise _Close  # the app ended without finishing its answer: nothing else can follow

    def _body_here(self) -> bool:
        """The app's `relayline.body_here` extension: True when the request's whole body has
        arrived, so that the next receive() answers all of it without waiting (an app that
        bounds a body's arrival in time needs no timer for it)."""
        if self.request_done:
            return False
        reader = self.reader
        for event in reader.events[reader.taken:]:  # (those not yet taken)
            if event is END:
                return True
            if type(event) is not bytes:
                return False
        return False

    async def _receive(self) -> Message:
        if self.gone or self.response_done:
            return {"type": "http.disconnect"}
        reader = self.reader
        if not self.request_done:
            if self.expect_continue:
                self.expect_continue = False
                if not reader.pending():  # (a client that sent its body anyway is not asked for it)
                    await self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if self.small_body_reads > SMALL_BODY_READS_FREE and not reader.pending():
                await trio.sleep(BODY_GATHER_S)
            if not await self._fill():
                return {"type": "http.disconnect"}
            # what is here of the body in one message (h11 gave its pieces and its end one by one)
            pieces = []
            while reader.pending():
                event = reader.peek()
                if event is END:
                    reader.take()
                    self.request_done = True
                    break
                if type(event) is not bytes:
                    break
                reader.take()
                pieces.append(event)
            # a fault in the body: answered, and the connection ends
            if not pieces and not self.request_done:
                fault = reader.take()
                assert type(fault) is Fault  # (neither body bytes nor its end)
                await self._reject(fault.status, fault.message)
                self.gone = True
                return {"type": "http.disconnect"}
            body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            self.small_body_reads = self.small_body_reads + 1 if len(body) < SMALL_BODY_READ else 0
            return {"type": "http.request", "body": body, "more_body": not self.request_done}
        # the body was read: wait for the client to leave, keeping what it sends ahead (bounded)
        while not self.gone:
            if self.read_ahead > READ_AHEAD:
                await trio.sleep_forever()  # read no more until this request is answered
            # (after a fault in what was sent ahead, reading goes on, unparsed: its end is the
            # client's leaving)
            data = await self._read()
            if not data:
                self.gone = True
            self.read_ahead += len(data)
            reader.feed(data)
        return {"type": "http.disconnect"}
