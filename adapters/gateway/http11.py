"""The gateway's HTTP/1.1 server: h11 on trio, one task per connection, nothing in between.

hypercorn's trio worker put several hand-offs and its own event plumbing between the socket and
the app, and cost more per request than the whole turn (bench/run.py, "server floor"). This
server keeps what the gateway relied on hypercorn for, and more (tests/test_http11.py, and
tests/test_http11_attack.py with docs/http-server.md for the attacks):

- a request head must be complete within `keep_alive_s`, which is also how long an idle
  keep-alive connection is kept (one timer, closed without an answer, as hypercorn and nginx do);
- a head still arriving beyond `max_header_bytes` is a 431, a malformed request a 400 (h11's
  verdict), and the connection is closed after either;
- keep-alive, HTTP/1.0 and `connection: close` follow h11; pipelined requests are answered one at
  a time, in order, and what a client sends ahead while a request runs is buffered only up to
  `READ_AHEAD` bytes;
- a client that goes away is an `http.disconnect` from `receive()` (the gateway cancels the turn);
  a write to it is dropped, never an exception in the app. Where epoll is, an app may instead
  ask to be called when the client hangs up (`scope["extensions"]["relayline.hangup"]`, see
  `_Hangups`), and keep no task waiting in `receive()`;
- `Expect: 100-continue` is answered when the app first reads the body;
- what could desynchronise this server from a proxy in front of it is refused and the connection
  closed: a request with both Content-Length and Transfer-Encoding (400, RFC 9112 6.3), an HTTP
  version other than 1.x (505); h11 refuses the rest (conflicting lengths, a transfer coding
  other than chunked, malformed chunks: h11 >= 0.16, whose chunk parsing is strict);
- out of file descriptors, the connections that have waited longest for a request head are
  closed to make room for new clients (`_Listener`);
- a write that makes no progress for `send_timeout_s` ends the connection (a client that stops
  reading holds neither a turn nor its buffers for ever: nginx's send_timeout);
- the drain: on `stop`, no new connection is accepted, idle ones are closed, requests in flight
  finish (their answers say `connection: close`), and after `graceful_s` what is left is
  cancelled.

A body in one message gets a content-length (one write, no chunked framing); a streamed body is
chunked. The ASGI surface is the subset the gateway uses: `http` scopes, no lifespan.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import h11
import trio

from .listen import BatchListener

log = logging.getLogger("relayline.gateway")

READ_SIZE = 64 * 1024
READ_AHEAD = 64 * 1024  # input buffered beyond the request in progress (a pipelining client)
LINGER_S, LINGER_BYTES = 0.5, 64 * 1024  # reading past a closed request before the socket closes
BACKLOG = 2048  # bursts of new connections must queue, not be refused
SHED_ON_EMFILE = 32  # connections waiting for a head closed when accept() runs out of descriptors (as nginx)
SEND_TIMEOUT_S = 60.0  # nginx's send_timeout: how long a write may make no progress
SEND_CHECKS = 4  # the watchdog looks this many times per SEND_TIMEOUT_S
WRITE_PIECE = 64 * 1024  # the unit of progress the watchdog sees: a slow reader of a large body is not cut

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
App = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]


def _plain_error(status: int, message: str) -> bytes:
    return message.encode()


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


_date = _Date()


def listening_sockets(host: str, port: int, fd: int | None = None) -> list[socket.socket]:
    """The listening socket, made before anything runs: a port in use is a plain OSError. `fd` is
    a socket the supervisor of `serve --workers` already listens on."""
    if fd is not None:
        sock = socket.socket(fileno=fd)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
    sock.listen(BACKLOG)
    return [sock]


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Listener(trio.abc.Listener[trio.SocketStream]):
    """accept() that, out of file descriptors, makes room: the connections that have waited
    longest for a request head (idle keep-alive ones, slow heads) are closed, so a new client is
    served rather than queued behind them until `keep_alive_s` (nginx reuses idle connections
    so). trio.serve_listeners logs the error and retries 0.1 s later: never a busy loop."""

    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.inner = BatchListener(sock)
        self.server = server

    async def accept(self) -> trio.SocketStream:
        try:
            return await self.inner.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.server.shed_waiting()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Hangups:
    """Calls back the requests whose client hung up while their app runs, with no task per
    request: their sockets are in an epoll set of the server's own, one-shot for EPOLLRDHUP (the
    peer closed its side, whatever it sent before it: a pipelined request does not hide it), and
    one task waits for that set to be readable. The gateway's task per turn blocked in
    `receive()` cost ~55 µs of CPU per request (its spawn, its cancellation at the turn's end:
    bench/gateway_cpu.py); a registration costs two epoll_ctl calls. Linux only (epoll); without
    it the extension is absent and an app waits in `receive()`."""

    AVAILABLE = hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP")

    def __init__(self) -> None:
        self.epoll = select.epoll()
        # fd -> (the connection that registered it, its call-back). A socket closed while it is
        # in the set leaves it (the kernel's doing) and its number may be reused at once: an
        # entry is removed only by the connection that made it
        self.callbacks: dict[int, tuple[object, Callable[[], None]]] = {}

    def watch(self, fd: int, owner: object, callback: Callable[[], None]) -> None:
        if self.epoll.closed:  # the server is ending: every request is being cancelled anyway
            callback()
            return
        if self.callbacks.pop(fd, None) is not None:  # a closed socket's stale entry
            self._unregister(fd)
        self.epoll.register(fd, select.EPOLLRDHUP | select.EPOLLONESHOT)  # (HUP and ERR always count)
        self.callbacks[fd] = (owner, callback)

    def unwatch(self, fd: int, owner: object) -> Callable[[], None] | None:
        """Stop watching; the call-back that was waiting, if the owner's entry still was."""
        entry = self.callbacks.get(fd)
        if entry is not None and entry[0] is owner:
            del self.callbacks[fd]
            self._unregister(fd)
            return entry[1]
        return None

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
                    entry = self.callbacks.pop(fd, None)
                    if entry is not None:
                        self._unregister(fd)
                        entry[1]()
        finally:
            self.epoll.close()


class Server:
    def __init__(self, app: App, *, keep_alive_s: float, max_header_bytes: int, graceful_s: float,
                 error_body: ErrorBody = _plain_error, send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self.app = app
        self.keep_alive_s = keep_alive_s
        self.send_timeout_s = send_timeout_s
        self.max_header_bytes = max_header_bytes
        self.graceful_s = graceful_s
        self.error_body = error_body
        self.draining = False
        self.connections: set[_Connection] = set()
        self._none_left = trio.Event()
        self.hangups: _Hangups | None = None

    async def run(self, sockets: list[socket.socket], stop: trio.Event, *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until `stop`, then drain (see the module's docstring)."""
        listeners = [_Listener(sock, self) for sock in sockets]  # a burst is taken in one pass, not one a pass
        async with trio.open_nursery() as nursery:
            accepting = trio.CancelScope()

            async def accept() -> None:
                with accepting:
                    await trio.serve_listeners(self._connection, listeners, handler_nursery=nursery)

            if _Hangups.AVAILABLE:
                self.hangups = _Hangups()
                nursery.start_soon(self.hangups.run)
            nursery.start_soon(accept)
            nursery.start_soon(self._watch_sends)
            task_status.started([url_of(sock) for sock in sockets])
            await stop.wait()
            self.draining = True
            accepting.cancel()
            for listener in listeners:
                await listener.aclose()
            for connection in list(self.connections):
                connection.drain()
            with trio.move_on_after(self.graceful_s):
                if self.connections:
                    await self._none_left.wait()
            nursery.cancel_scope.cancel()

    async def _watch_sends(self) -> None:
        """Close the connections whose write has made no progress for `send_timeout_s` (cut
        within a further send_timeout_s / SEND_CHECKS). One task for all of them: a timeout
        around each write cost a third of the write itself, and a stream writes once a frame."""
        while True:
            await trio.sleep(self.send_timeout_s / SEND_CHECKS)
            for connection in [c for c in self.connections if c.stalled()]:
                log.warning("http_send_timeout client_read_nothing_for_s=%g", self.send_timeout_s)
                await trio.aclose_forcefully(connection.stream)  # its write raises ClosedResourceError

    def shed_waiting(self) -> None:
        """Close the SHED_ON_EMFILE connections that have waited longest for a request head."""
        waiting = [(scope.deadline, connection) for connection in self.connections
                   if (scope := connection.head_scope) is not None and not scope.cancel_called]
        waiting.sort(key=lambda pair: pair[0])
        for _, connection in waiting[:SHED_ON_EMFILE]:
            connection.drain()
        log.warning("http_out_of_file_descriptors connections=%d closed_waiting=%d", len(self.connections),
                    min(len(waiting), SHED_ON_EMFILE))

    async def _connection(self, stream: trio.SocketStream) -> None:
        connection = _Connection(self, stream)
        self.connections.add(connection)
        try:
            await connection.run()
            await connection.linger()
        except Exception:
            log.exception("http_connection_error")
        finally:
            self.connections.discard(connection)
            if self.draining and not self.connections:
                self._none_left.set()
            await trio.aclose_forcefully(stream)


def _fault(exc: h11.RemoteProtocolError) -> str:
    """h11's message without the bytes it quotes (a header line may hold a key)."""
    message = str(exc)
    quoted = [i for i in (message.find("bytearray("), message.find("b'"), message.find('b"')) if i >= 0]
    return message[:min(quoted)].rstrip(": ") if quoted else message


class _Close(Exception):
    """The connection ends here (the peer left, or a protocol error was answered)."""


class _Connection:
    __slots__ = ("server", "stream", "h11", "head_scope", "client", "local", "gone", "sent_head", "pending_head",
                 "method", "response_done", "writing", "writes", "writes_seen", "checks_stalled", "hangup_fd",
                 "extensions")

    def __init__(self, server: Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.max_header_bytes)
        self.head_scope: trio.CancelScope | None = None
        sock = stream.socket
        try:
            self.client = tuple(sock.getpeername()[:2])
            self.local = tuple(sock.getsockname()[:2])
        except OSError:
            self.client = self.local = None
        self.gone = False
        self.sent_head = False
        self.pending_head: tuple[int, list[tuple[bytes, bytes]]] | None = None  # (status, headers)
        self.method = ""
        self.response_done = False
        self.writing = False
        self.writes = self.writes_seen = self.checks_stalled = 0
        self.hangup_fd: int | None = None  # the socket's number when its hang-up is watched
        self.extensions = {"relayline.hangup": self._watch_hangup} if server.hangups is not None else {}

    def _watch_hangup(self, callback: Callable[[], None]) -> None:
        """The app's `relayline.hangup` extension: `callback` runs (once, in the server's own
        task) if the client hangs up before this request ends."""
        fd = self.stream.socket.fileno()
        if self.gone or fd < 0:
            callback()
            return
        self.server.hangups.watch(fd, self, callback)
        self.hangup_fd = fd

    def stalled(self) -> bool:
        """The watchdog's look: True when a write has been stuck for SEND_CHECKS looks."""
        if not self.writing or self.writes != self.writes_seen:
            self.writes_seen, self.checks_stalled = self.writes, 0
            return False
        self.checks_stalled += 1
        return self.checks_stalled >= SEND_CHECKS

    def drain(self) -> None:
        """The server is draining (or out of descriptors): a connection waiting for a request
        head closes now."""
        if self.head_scope is not None:
            self.head_scope.cancel()

    async def run(self) -> None:
        try:
            while True:
                if self.server.draining and self.h11.their_state is h11.IDLE and not self.h11.trailing_data[0]:
                    return  # the drain closes a connection between two requests
                with trio.move_on_after(self.server.keep_alive_s) as scope:
                    self.head_scope = scope
                    event = await self._next_event()
                self.head_scope = None
                if scope.cancelled_caught or not isinstance(event, h11.Request):
                    return  # idle, or a head too slow (closed without an answer), or the client left
                await self._request(event)
                self._finish_reading()
                if self.gone or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    return
                self.h11.start_next_cycle()
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
        """The end of a request the app did not read to its end (a GET: its EndOfMessage), when
        it is already here; a body still to come leaves the request unfinished (closed)."""
        try:
            while self.h11.their_state is h11.SEND_BODY:
                if self.h11.next_event() in (h11.NEED_DATA, h11.PAUSED):
                    return
        except h11.RemoteProtocolError:
            return

    async def _read(self) -> bytes:
        try:
            return await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _next_event(self):
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                await self._refuse(exc)
                raise _Close from None
            if event is h11.NEED_DATA:
                data = await self._read()
                if not data:
                    self.gone = True
                self.h11.receive_data(data)
                continue
            return event

    async def _refuse(self, exc: h11.RemoteProtocolError) -> None:
        """A request h11 cannot read: its status (400, or 431 for a head beyond the limit)."""
        status, message = exc.error_status_hint, f"malformed HTTP request: {_fault(exc)}"
        if status == 431 and self.h11.our_state is h11.SEND_RESPONSE:  # the head was read: a chunk header
            status, message = 400, f"malformed HTTP request: a chunk header larger than {self.server.max_header_bytes} bytes"
        elif status == 431:
            message = f"request headers larger than {self.server.max_header_bytes} bytes"
        await self._reject(status, message)

    async def _reject(self, status: int, message: str) -> None:
        """An error answer from the server itself, before any app saw the request; the caller
        closes the connection after it."""
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        log.info("http_refused status=%d reason=%r", status, message)  # no app saw it: no access line
        body = self.server.error_body(status, message)
        try:
            data = self.h11.send(h11.Response(status_code=status, reason=REASONS.get(status, b""), headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"), (b"date", _date())]))
            data += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        self.sent_head = True  # linger: a reset must not destroy this answer (the input is unread)
        await self._write(data)

    # -- one request ----------------------------------------------------------------------------

    async def _request(self, request: h11.Request) -> None:
        if not request.http_version.startswith(b"1."):
            await self._reject(505, f"HTTP/{request.http_version.decode()} is not supported: this server speaks HTTP/1.1")
            raise _Close
        headers = list(request.headers)  # (iterating h11's Headers costs several times a list's)
        if any(name == b"transfer-encoding" for name, _ in headers) and \
                any(name == b"content-length" for name, _ in headers):
            # which of the two frames the body is the classic smuggling question: a proxy in front
            # may have answered it differently, so neither is trusted
            await self._reject(400, "malformed HTTP request: both Content-Length and Transfer-Encoding")
            raise _Close
        target = request.target
        if target[:1] != b"/" and b"://" in target[:8]:
            # absolute-form (RFC 9112 3.2.2: a server must accept it): the path is what follows
            # the authority
            authority_and_path = target.partition(b"://")[2]
            slash = authority_and_path.find(b"/")
            target = authority_and_path[slash:] if slash >= 0 else b"/"
        path, _, query = target.partition(b"?")
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if request.http_version == b"1.0" else "1.1", "method": request.method.decode(),
            "scheme": "http", "path": unquote(path.decode("ascii")), "raw_path": path, "query_string": query,
            "root_path": "", "headers": headers, "client": self.client, "server": self.local,
            "extensions": self.extensions,
        }
        self.method = scope["method"]
        self.sent_head = False
        self.pending_head = None
        self.response_done = False
        try:
            await self.server.app(scope, self._receive, self._send)
        except Exception:
            log.exception("http_app_error path=%s", scope["path"][:200])
            if not self.sent_head and not self.gone:  # (a start message still held is replaced)
                body = self.server.error_body(500, "internal error in the gateway (logged)")
                await self._send({"type": "http.response.start", "status": 500,
                                  "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
                await self._send({"type": "http.response.body", "body": body})
            raise _Close from None
        finally:
            if self.hangup_fd is not None:  # the request is over: a hang-up from now on is the connection's
                self.server.hangups.unwatch(self.hangup_fd, self)
                self.hangup_fd = None
        if not self.response_done and not self.gone:
            raise _Close  # the app ended without finishing its answer: nothing else can follow

    async def _receive(self) -> dict:
        if self.gone or self.response_done:
            return {"type": "http.disconnect"}
        if self.h11.their_state is h11.SEND_BODY:
            if self.h11.they_are_waiting_for_100_continue:
                await self._write(self.h11.send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
            try:
                event = await self._next_event()
            except _Close:
                self.gone = True
                return {"type": "http.disconnect"}
            if isinstance(event, h11.Data):
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            if isinstance(event, h11.EndOfMessage):
                return {"type": "http.request", "body": b"", "more_body": False}
            self.gone = True  # ConnectionClosed mid-body
            return {"type": "http.disconnect"}
        # the body was read: wait for the client to leave, keeping what it sends ahead (bounded)
        while not self.gone:
            if len(self.h11.trailing_data[0]) > READ_AHEAD:
                await trio.sleep_forever()  # read no more until this request is answered
            data = await self._read()
            if not data:
                self.gone = True
            self.h11.receive_data(data)
        return {"type": "http.disconnect"}

    # -- writing --------------------------------------------------------------------------------

    async def _write(self, data: bytes) -> None:
        if self.gone or not data:
            return
        self.writing = True
        try:
            if len(data) <= WRITE_PIECE:
                self.writes += 1
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
            self._hung_up()  # before the close yields: its fd number may be taken and watched again
            await trio.aclose_forcefully(self.stream)
        finally:
            self.writing = False

    def _hung_up(self) -> None:
        """A write found the client gone (or the send watchdog cut it): an app watching for a
        hang-up hears it here, because the socket is closed next, and a closed socket leaves the
        epoll set without an event (a reset the write saw first would be lost to it too)."""
        fd, self.hangup_fd = self.hangup_fd, None
        if fd is not None:
            callback = self.server.hangups.unwatch(fd, self)
            if callback is not None:
                callback()

    async def _send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers") or ())
            if self.server.draining and not any(k.lower() == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            headers.append((b"date", _date()))
            # the head is built once its body is known: a whole body adds its length first (one
            # h11.Response, whose header check is a third of h11's cost for a small answer)
            self.pending_head = (message["status"], headers)
            return
        if kind != "http.response.body" or self.response_done or self.gone:
            return  # (gone: the client left, or the server already refused its request's body)
        body = message.get("body") or b""
        more = message.get("more_body", False)
        data = b""
        head = None
        if self.pending_head is not None:
            status, headers = self.pending_head
            self.pending_head = None
            if not more and not any(k.lower() == b"content-length" for k, _ in headers):
                # the whole body is here: framed by its length (one write, no chunks)
                headers.append((b"content-length", str(len(body)).encode()))
            # an app's malformed header raises here, into the app, as from its start message
            head = h11.Response(status_code=status, headers=headers, reason=REASONS.get(status, b""))
        try:
            if head is not None:
                data = self.h11.send(head)
                self.sent_head = True
            if body and self.method != "HEAD":
                data += self.h11.send(h11.Data(data=body))
            if not more:
                data += self.h11.send(h11.EndOfMessage())
                self.response_done = True
        except h11.LocalProtocolError:
            log.exception("http_send_refused")
            self.gone = True
            return
        await self._write(data)
