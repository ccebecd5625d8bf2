"""The gateway's HTTP/1.1 server: llhttp (httptools) on trio, one task per connection, nothing in
between.

hypercorn's trio worker put several hand-offs and its own event plumbing between the socket and
the app, and cost more per request than the whole turn (bench/run.py, "server floor"). This
server keeps what the gateway relied on hypercorn for, and more (tests/test_http11.py, and
tests/test_http11_attack.py with docs/http-server.md for the attacks):

- a request head must be complete within `keep_alive_s`, which is also how long an idle
  keep-alive connection is kept (one bound, closed without an answer, as hypercorn and nginx do;
  one watchdog task for all connections, `_watch_heads`, not a timer per request);
- a head still arriving beyond `max_header_bytes` is a 431, a malformed request a 400 (llhttp's
  verdict), and the connection is closed after either;
- keep-alive, HTTP/1.0 and `connection: close` follow h11's rules (HTTP/1.0 is never kept alive);
  pipelined requests are answered one at
  a time, in order, and what a client sends ahead while a request runs is buffered only up to
  `READ_AHEAD` bytes;
- a client that goes away is an `http.disconnect` from `receive()` (the gateway cancels the turn);
  a write to it is dropped, never an exception in the app. Where epoll is, an app may instead
  ask to be called when the client hangs up (`scope["extensions"]["relayline.hangup"]`, see
  `_Hangups`), and keep no task waiting in `receive()`;
- an app may ask whether a request's whole body has arrived (`relayline.body_here`: then the
  next `receive()` answers all of it at once), and bound only a body still arriving in time
  (the gateway's `body_timeout_s` timer is set only then);
- `Expect: 100-continue` is answered when the app first reads the body;
- what could desynchronise this server from a proxy in front of it is refused and the connection
  closed: a request with both Content-Length and Transfer-Encoding (400, RFC 9112 6.3), an HTTP
  version other than 1.x (505); llhttp, strict, refuses the rest (conflicting or repeated
  lengths, a transfer coding other than chunked, malformed chunks), and `_Reader` what llhttp
  would read and h11 refused (a missing or repeated Host, an Upgrade or CONNECT with a body);
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
import re
import select
import socket
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote

import httptools
import trio

from .. import sockets
from .listen import BatchListener

log = logging.getLogger("relayline.gateway")

READ_SIZE = 64 * 1024
READ_AHEAD = 64 * 1024  # input buffered beyond the request in progress (a pipelining client)
LINGER_S, LINGER_BYTES = 0.5, 64 * 1024  # reading past a closed request before the socket closes
BACKLOG = 2048  # bursts of new connections must queue, not be refused
SHED_ON_EMFILE = 32  # connections waiting for a head closed when accept() runs out of descriptors (as nginx)
HEAD_CHECK_S = 1.0  # the head watchdog looks at least this often (and 4 times per keep_alive_s)...
HEAD_CHECK_LEAST_S = 0.01  # ...but never more often than this (a tiny keep_alive_s is no busy loop)
SEND_TIMEOUT_S = 60.0  # nginx's send_timeout: how long a write may make no progress
SEND_CHECKS = 4  # the watchdog looks this many times per SEND_TIMEOUT_S
WRITE_PIECE = 64 * 1024  # the unit of progress the watchdog sees: a slow reader of a large body is not cut
# a body trickled in small pieces: each read costs the same whatever its size, so after a few
# small ones the next read of the body waits a moment first, and gets what arrived meanwhile in
# one piece; the reads a body can cost are bounded by its arrival time, not its piece count
SMALL_BODY_READ = 16 * 1024
SMALL_BODY_READS_FREE = 16
BODY_GATHER_S = 0.01

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


class _Watched:
    """A connection's entry in the hang-up set: the request's call-back while one runs."""

    __slots__ = ("owner", "callback", "hung_up")

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self.callback: Callable[[], None] | None = None
        self.hung_up = False  # the event came (it comes once: EPOLLONESHOT)


class _Hangups:
    """Calls back the requests whose client hung up while their app runs, with no task per
    request: their sockets are in an epoll set of the server's own, one-shot for EPOLLRDHUP (the
    peer closed its side, whatever it sent before it: a pipelined request does not hide it), and
    one task waits for that set to be readable. The gateway's task per turn blocked in
    `receive()` cost ~55 µs of CPU per request (its spawn, its cancellation at the turn's end:
    bench/gateway_cpu.py). A connection's socket joins the set at its first watched request and
    leaves it when the connection ends (`forget`, before its socket closes): two epoll_ctl calls
    a connection, not two a request (bench/glue_counts.py); between requests it has no call-back,
    and a hang-up heard then is told to the next request at once, as a new registration would
    have told it. Linux only (epoll); without it the extension is absent and an app waits in
    `receive()`."""

    AVAILABLE = hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP")

    def __init__(self) -> None:
        self.epoll = select.epoll()
        # fd -> the entry of the connection that registered it. A socket closed while it is in
        # the set leaves it (the kernel's doing) and its number may be reused at once: an entry
        # is removed only by the connection that made it
        self.callbacks: dict[int, _Watched] = {}

    def watch(self, fd: int, owner: object, callback: Callable[[], None]) -> None:
        if self.epoll.closed:  # the server is ending: every request is being cancelled anyway
            callback()
            return
        entry = self.callbacks.get(fd)
        if entry is None or entry.owner is not owner:
            if entry is not None:  # a closed socket's stale entry
                self._unregister(fd)
            entry = self.callbacks[fd] = _Watched(owner)
            self.epoll.register(fd, select.EPOLLRDHUP | select.EPOLLONESHOT)  # (HUP and ERR always count)
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


class Server:
    def __init__(self, app: App, *, keep_alive_s: float, max_header_bytes: int, graceful_s: float,
                 error_body: ErrorBody = _plain_error, send_timeout_s: float = SEND_TIMEOUT_S,
                 on_connections: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.on_connections = on_connections  # told the number of open connections whenever it changes
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
            nursery.start_soon(self._watch_heads)
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

    async def _watch_heads(self) -> None:
        """Close the connections that have waited `keep_alive_s` for a request head (idle, or a
        head still arriving), within a further min(HEAD_CHECK_S, keep_alive_s / 4). One task
        for all of them: a timer (a cancel scope with a deadline) around each request's wait
        for its head cost more than the server's whole read of that head (bench/glue_counts.py);
        a connection only notes when its wait began."""
        every = max(min(HEAD_CHECK_S, self.keep_alive_s / 4), HEAD_CHECK_LEAST_S)
        while True:
            await trio.sleep(every)
            too_old = trio.current_time() - self.keep_alive_s
            for connection in [c for c in self.connections if c.waiting_since is not None and c.waiting_since <= too_old]:
                connection.drain()

    async def _watch_sends(self) -> None:
        """Close the connections whose write has made no progress for `send_timeout_s` (cut
        within a further send_timeout_s / SEND_CHECKS). One task for all of them: a timeout
        around each write cost a third of the write itself, and a stream writes once a frame."""
        while True:
            await trio.sleep(self.send_timeout_s / SEND_CHECKS)
            for connection in [c for c in self.connections if c.stalled()]:
                log.warning("http_send_timeout client_read_nothing_for_s=%g", self.send_timeout_s)
                # an app watching for a hang-up hears it now: once the socket is closed its number
                # may be taken by a new connection before the write that fails says it
                connection._hung_up()
                await trio.aclose_forcefully(connection.stream)  # its write raises ClosedResourceError

    def shed_waiting(self) -> None:
        """Close the SHED_ON_EMFILE connections that have waited longest for a request head."""
        waiting = [(since, connection) for connection in self.connections
                   if (since := connection.waiting_since) is not None]
        waiting.sort(key=lambda pair: pair[0])
        for _, connection in waiting[:SHED_ON_EMFILE]:
            connection.drain()
        log.warning("http_out_of_file_descriptors connections=%d closed_waiting=%d", len(self.connections),
                    min(len(waiting), SHED_ON_EMFILE))

    async def _connection(self, stream: trio.SocketStream) -> None:
        connection = _Connection(self, stream)
        self.connections.add(connection)
        if self.on_connections is not None:
            self.on_connections(len(self.connections))
        try:
            await connection.run()
            await connection.linger()
        except Exception:
            log.exception("http_connection_error")
        finally:
            self.connections.discard(connection)
            if self.on_connections is not None:
                self.on_connections(len(self.connections))
            if self.draining and not self.connections:
                self._none_left.set()
            connection.forget_hangups()
            await trio.aclose_forcefully(stream)
class _Close(Exception):
    """The connection ends here (the peer left, or a protocol error was answered)."""


class _Fault:
    """A request this server cannot read: its status and relayline's words for it (llhttp's
    reasons are fixed strings: a fault never quotes the request's bytes, which may hold a key)."""

    __slots__ = ("status", "message")

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class _Head:
    __slots__ = ("method", "target", "version", "headers", "keep_alive")

    def __init__(self, method: bytes, target: bytes, version: str, headers: list, keep_alive: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive


_ONLY_CHUNKED = _Fault(501, "malformed HTTP request: only Transfer-Encoding: chunked is supported")
_END = object()  # a request's body ended (llhttp's on_message_complete)
_IDLE, _IN_HEAD, _IN_BODY = 0, 1, 2
_TRANSFER_CODINGS = ("Invalid `Transfer-Encoding` header value", "Request has invalid `Transfer-Encoding`")
_BLANK_LINE = re.compile(rb"\n\r?\n").search
_FOLD = re.compile(rb"\r?\n[ \t]+").sub
_BARE_LF = re.compile(rb"(?<!\r)\n").sub


def _fault_of(exc: Exception) -> _Fault:
    reason = str(exc)
    if reason == "Transfer-Encoding can't be present with Content-Length":
        # which of the two frames the body is the classic smuggling question: a proxy in front
        # may have answered it differently, so neither is trusted (RFC 9112 6.3)
        return _Fault(400, "malformed HTTP request: both Content-Length and Transfer-Encoding")
    if reason == "Content-Length overflow":  # (h11 read any length: the app refused it as too large)
        return _Fault(413, "request body larger than this server reads (a Content-Length beyond 64 bits)")
    if reason in _TRANSFER_CODINGS:
        return _ONLY_CHUNKED
    if reason == "Pause on PRI/Upgrade":  # HTTP/2's preface
        return _Fault(505, "HTTP/2.0 is not supported: this server speaks HTTP/1.1")
    if "header" in reason.lower() and "Content-Length" not in reason:
        return _Fault(400, "malformed HTTP request: illegal header line")
    return _Fault(400, f"malformed HTTP request: {reason[:1].lower()}{reason[1:]}")


class _Reader:
    """The request side of a connection: llhttp (httptools' HttpRequestParser, strict, in C)
    calls these `on_*` methods while it reads, and what they see becomes events in order: a
    `_Head`, body bytes, `_END`, or a `_Fault` after which nothing more is read. h11 (the parser
    before) did this in Python; what h11 did that llhttp does not is done here:

    - a head (or a chunk header, or a trailer) still arriving beyond `limit` bytes is a fault
      (431, or 400 in a body): llhttp has no size limit of its own;
    - a head with bare LF line ends or an obs-fold line (which h11 read, RFC 9112 2.2 and 5.2,
      and llhttp refuses) is read again, once, unfolded and with CRLF line ends, when it began
      at the start of a read (always, but for a pipelined one);
    - an Upgrade (or CONNECT) request is an ordinary request: its answer is never a 101, and the
      bytes after it are the next request (one with a body is refused: llhttp does not frame it);
    - HTTP versions are read leniently (HTTP/1.2 is HTTP/1.1, as h11 took it; the server
      answers any other than 1.x with a 505)."""

    __slots__ = ("parser", "events", "taken", "limit", "state", "url", "headers", "coding", "progress", "stalled", "dead",
                 "head_pieces", "refeed", "reread")

    def __init__(self, limit: int) -> None:
        # llhttp's parser only while a request is being read: between requests (an idle
        # keep-alive connection, a request whose answer is streaming) it is not kept (1 KiB with
        # its callbacks' bound methods), and the next request's head gets a new one (about 1 µs)
        self.parser: httptools.HttpRequestParser | None = None
        # a list and the index of the next event to take, not a deque: an idle connection keeps
        # 56 bytes for it, not a deque's 770
        self.events: list = []
        self.taken = 0
        self.limit = limit
        self.state = _IDLE
        self.url: bytes | None = b""
        self.headers: list[tuple[bytes, bytes]] | None = []
        self.coding: bytes | None = None  # the head's Transfer-Encoding (b"," when it came twice)
        self.progress = False  # a feed got something done (a head, body bytes, a chunk)
        self.stalled = 0  # bytes fed since the last progress
        self.dead = False  # a fault was queued: nothing more is read
        self.head_pieces: list[bytes] | None = None  # the head being read, when it began at a read's start
        self.refeed: bytes | None = None  # a bare-LF or folded head kept whole until its end, to be read again
        self.reread = False  # that head is being read again (a second fault in it is final)

    def _parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(lenient_version=True)
        return parser

    # -- llhttp's callbacks (they run inside feed_data) -----------------------------------------

    def on_message_begin(self) -> None:
        self.state = _IN_HEAD
        self.url = b""
        self.headers = []
        self.coding = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state == _IN_HEAD:  # (not a chunked body's trailer: the app is not told those, as with h11)
            name = name.lower()
            if name == b"transfer-encoding":
                self.coding = b"," if self.coding is not None else value
            self.headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self.state = _IN_BODY
        self.progress = True
        self.head_pieces = None
        coding = self.coding
        if coding is not None and coding.strip(b" \t").lower() != b"chunked":
            # llhttp frames `gzip, chunked` by its last coding and would hand the app the body
            # still gzip-coded: only chunked alone is read (as h11 did)
            raise _Refused(_ONLY_CHUNKED)
        if parser.should_upgrade() and any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers):
            raise _Refused(_Fault(400, "malformed HTTP request: an Upgrade or CONNECT request with a body is not supported"))
        version = parser.get_http_version()
        self.events.append(_Head(parser.get_method(), self.url, version, self.headers,
                                 parser.should_keep_alive() and version != "1.0"))
        self.headers = self.url = None  # the request's from here on: an idle connection keeps neither

    def on_body(self, data: bytes) -> None:
        self.progress = True
        self.events.append(data)

    def on_chunk_header(self) -> None:
        self.progress = True

    def on_chunk_complete(self) -> None:
        self.progress = True

    def on_message_complete(self) -> None:
        self.state = _IDLE
        self.progress = True
        self.head_pieces = None  # a head begun after this, in the same read, did not begin at its start
        self.events.append(_END)

    # -- taking events ---------------------------------------------------------------------------

    def pending(self) -> bool:
        return self.taken < len(self.events)

    def peek(self):
        return self.events[self.taken]

    def take(self):
        """The next event (`pending()` says there is one); the list empties once all are taken."""
        events = self.events
        event = events[self.taken]
        self.taken += 1
        if self.taken == len(events):
            events.clear()
            self.taken = 0
        return event

    # -- feeding ---------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Parse what was read (b"": nothing; the caller handles the end)."""
        if self.dead or not data:
            return
        if self.refeed is not None:
            self._refeed(data)
            return
        if self.state == _IDLE:
            self.head_pieces = [data]
        elif self.head_pieces is not None:
            self.head_pieces.append(data)
        self.progress = False
        parser = self.parser
        if parser is None:
            parser = self.parser = self._parser()
        try:
            while True:
                try:
                    parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as upgrade:  # the request ended: what follows is the next
                    data = data[upgrade.args[0]:]
        except httptools.HttpParserError as exc:
            refused = exc.__context__  # (what a callback raised)
            if type(refused) is _Refused:
                self._fail(refused.fault)
                return
            pieces = self.head_pieces
            if self.state == _IN_HEAD and pieces is not None and not self.reread:
                raw = b"".join(pieces)
                if b"\n " in raw or b"\n\t" in raw or _BARE_LF(b"", raw, count=1) != raw:
                    self.refeed, self.head_pieces = raw, None  # (read again whole, once its end is here)
                    self._refeed(b"")
                    return
            self._fail(_fault_of(exc))
            return
        if self.state == _IDLE and not self.dead:  # (every request read ended: the next gets a new parser)
            self.parser = None
        if self.progress:
            self.stalled = 0
            return
        self.stalled += len(data)
        if self.stalled > self.limit:
            if self.state == _IN_BODY:  # a chunk header (or a trailer) that does not end
                self._fail(_Fault(400, f"malformed HTTP request: a chunk header larger than {self.limit} bytes"))
            else:
                self._fail(_Fault(431, f"request headers larger than {self.limit} bytes"))

    def _refeed(self, data: bytes) -> None:
        """A head h11 would have read and llhttp does not (bare LF line ends, obs-fold), kept whole
        until its blank line and then read by a new parser, unfolded and with CRLF line ends."""
        # what was kept already had no blank line: only its end is scanned again (a head sent a
        # byte at a time is scanned once, not once a byte); the first call scans the whole head
        start = max(len(self.refeed) - 2, 0) if data else 0
        raw = self.refeed + data
        end = _BLANK_LINE(raw, start)
        if end is None:
            self.refeed = raw
            if len(raw) > self.limit:
                self._fail(_Fault(431, f"request headers larger than {self.limit} bytes"))
            return
        self.refeed = None
        # a fold continues a header line, never the request line (a space-led first header line
        # stays: llhttp refuses it, as h11 did)
        head = raw[:end.start()]
        if head[-1:] == b"\r":  # (one: the line end's; a bare CR before it stays, and is refused)
            head = head[:-1]
        line, lf, rest = head.partition(b"\n")
        head = _BARE_LF(b"\r\n", line + lf + _FOLD(b" ", rest))
        self.parser = self._parser()
        self.state = _IDLE
        self.reread = True
        try:
            self.feed(head + b"\r\n\r\n" + raw[end.end():])
        finally:
            self.reread = False

    def _fail(self, fault: _Fault) -> None:
        self.dead = True
        self.head_pieces = None
        self.events.append(fault)


class _Refused(Exception):
    """A fault found in a callback of llhttp's: raised through feed_data, which reports it."""

    def __init__(self, fault: _Fault) -> None:
        self.fault = fault


_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+").fullmatch
# the header names found tokens: an app's answers use a few dozen names, each checked once (the
# check over every line, a regex walking each byte of the head, was most of a head's render)
_TOKEN_NAMES: set[bytes] = set()
TOKEN_NAMES_MOST = 512  # an app that makes up names does not grow this without bound: the rest are checked each time

_FRAMING_NAMES = frozenset({b"content-length", b"connection", b"transfer-encoding"})  # what `_head` reads


def _render_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A response head, its header lines checked as h11 checked them (a token for each name, no
    CR, LF or NUL in a value); an app's bad header raises here. A value's CR, LF or NUL is found
    by counting them over all the lines at once: the lines are joined by CR LF, and a name (a
    token) and the ": " have none, so any more of either, or a NUL at all, is a value's. The
    lines are joined in C (`map`), not a Python expression a header."""
    names = _TOKEN_NAMES
    for name, _ in headers:  # (a pair each: anything else raises here, before the join reads it)
        if type(name) is not bytes or name not in names:  # (a bytearray is checked, never kept)
            if _TOKEN(name) is None:
                raise ValueError("an illegal response header name")
            if type(name) is bytes and len(names) < TOKEN_NAMES_MOST:
                names.add(name)
    if not headers:
        return b"HTTP/1.1 %d %s\r\n\r\n" % (status, REASONS.get(status, b""))
    lines = b"\r\n".join(map(b": ".join, headers))
    ends = len(headers) - 1
    if lines.count(b"\n") != ends or lines.count(b"\r") != ends or b"\0" in lines:
        raise ValueError("an illegal response header value (a CR, LF or NUL in it)")
    return b"HTTP/1.1 %d %s\r\n%s\r\n\r\n" % (status, REASONS.get(status, b""), lines)


class _Connection:
    __slots__ = ("server", "stream", "reader", "waiting_since", "client", "local", "gone", "sent_head", "pending_head",
                 "method", "response_done", "writing", "writes", "writes_seen", "checks_stalled", "hangup_fd",
                 "extensions", "keep_alive", "request_done", "expect_continue", "framing", "remaining", "read_ahead",
                 "small_body_reads")

    def __init__(self, server: Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.reader = _Reader(server.max_header_bytes)
        self.waiting_since: float | None = None  # when its wait for a request head began (while it waits)
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
        self.request_done = False  # the request's body was read to its end
        self.keep_alive = True
        self.expect_continue = False
        self.framing = ""  # the answer's: "length", "chunked", or "close" (an HTTP/1.0 client's stream)
        self.remaining = 0  # bytes of a declared content-length still to write
        self.read_ahead = 0  # bytes read past the request in progress (a pipelining client), bounded
        self.small_body_reads = 0  # small pieces of the request's body read in a row
        self.writing = False
        self.writes = self.writes_seen = self.checks_stalled = 0
        self.hangup_fd: int | None = None  # the socket's number when its hang-up is watched
        self.extensions = {"relayline.body_here": self._body_here}
        if server.hangups is not None:
            self.extensions["relayline.hangup"] = self._watch_hangup

    def _watch_hangup(self, callback: Callable[[], None]) -> None:
        """The app's `relayline.hangup` extension: `callback` runs (once, in the server's own
        task) if the client hangs up before this request ends."""
        fd = self.stream.socket.fileno()
        if self.gone or fd < 0:
            callback()
            return
        self.server.hangups.watch(fd, self, callback)
        self.hangup_fd = fd  # (watched until the connection ends: forget_hangups)

    def stalled(self) -> bool:
        """The watchdog's look: True when a write has been stuck for SEND_CHECKS looks."""
        if not self.writing or self.writes != self.writes_seen:
            self.writes_seen, self.checks_stalled = self.writes, 0
            return False
        self.checks_stalled += 1
        return self.checks_stalled >= SEND_CHECKS

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
                if self.server.draining and not reader.pending() and reader.state == _IDLE and reader.refeed is None:
                    return  # the drain closes a connection between two requests
                # the wait for a head is bounded by the server's head watchdog (_watch_heads)
                self.waiting_since = trio.current_time()
                try:
                    event = await self._next_event()
                finally:  # (however the wait ends: a connection that lingers waits for no head)
                    closed, self.waiting_since = self.waiting_since is None, None
                if closed or type(event) is not _Head:
                    return  # idle, or a head too slow (closed without an answer), or the client left
                await self._request(event)
                self._finish_reading()
                if self.gone or not self.response_done or not self.request_done or not self.keep_alive:
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
        """The end of a request the app did not read to its end (a GET: its `_END`), when it is
        already here; a body still to come (or a fault in it) leaves the request unfinished."""
        reader = self.reader
        while not self.request_done and reader.pending():
            event = reader.peek()
            if type(event) is _Fault or type(event) is _Head:
                return
            reader.take()
            if event is _END:
                self.request_done = True

    async def _read(self) -> bytes:
        try:
            if self.waiting_since is not None:
                # a head: the client sends it once it has read the last answer, so it is seldom
                # here yet (sockets.py)
                return await sockets.receive_after_wait(self.stream, READ_SIZE)
            return await self.stream.receive_some(READ_SIZE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _next_event(self):
        """The next request event; None when the client left. A fault is answered here and ends
        the connection."""
        if not await self._fill():
            return None
        event = self.reader.take()
        if type(event) is _Fault:
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
        if self.sent_head and not self.response_done:  # (an answer is under way: it cannot be replaced)
            return
        log.info("http_refused status=%d reason=%r", status, message)  # no app saw it: no access line
        body = self.server.error_body(status, message)
        self.sent_head = True  # linger: a reset must not destroy this answer (the input is unread)
        await self._write(_render_head(status, [(b"content-type", b"application/json"),
                                                (b"content-length", b"%d" % len(body)),
                                                (b"connection", b"close"), (b"date", _date())]) + body)

    # -- one request ----------------------------------------------------------------------------

    async def _request(self, request: _Head) -> None:
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
            await self._reject(400, "malformed HTTP request: " + ("more than one Host header" if hosts else "no Host header"))
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
            "http_version": "1.0" if version == "1.0" else "1.1", "method": request.method.decode(),
            "scheme": "http", "path": unquote(path.decode("ascii")), "raw_path": path, "query_string": query,
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
                                  "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
                await self._send({"type": "http.response.body", "body": body})
            raise _Close from None
        finally:
            if self.hangup_fd is not None:  # the request is over: a hang-up from now on is the connection's
                self.server.hangups.unwatch(self.hangup_fd, self)
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
            if event is _END:
                return True
            if type(event) is not bytes:
                return False
        return False

    async def _receive(self) -> dict:
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
                if event is _END:
                    reader.take()
                    self.request_done = True
                    break
                if type(event) is not bytes:
                    break
                pieces.append(reader.take())
            if not pieces and not self.request_done:  # a fault in the body: answered, and the connection ends
                fault = reader.take()
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
            # (after a fault in what was sent ahead, reading goes on, unparsed: its end is the client's leaving)
            data = await self._read()
            if not data:
                self.gone = True
            self.read_ahead += len(data)
            reader.feed(data)
        return {"type": "http.disconnect"}

    # -- writing --------------------------------------------------------------------------------

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
            self._hung_up()  # before the close yields: its fd number may be taken and watched again
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

    def _hung_up(self) -> None:
        """A write found the client gone (or the send watchdog cut it): an app watching for a
        hang-up hears it here, because the socket is closed next, and a closed socket leaves the
        epoll set without an event (a reset the write saw first would be lost to it too)."""
        fd, self.hangup_fd = self.hangup_fd, None
        if fd is not None:
            hangups = self.server.hangups
            callback = hangups.unwatch(fd, self)
            hangups.forget(fd, self)
            if callback is not None:
                callback()

    def forget_hangups(self) -> None:
        """The connection ends: its socket leaves the hang-up set before it closes."""
        fd, self.hangup_fd = self.hangup_fd, None
        if fd is not None:
            self.server.hangups.forget(fd, self)

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, more: bool) -> bytes:
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
        elif self.keep_alive:  # (an HTTP/1.0 client is never kept alive: its stream ends with the close)
            headers.append((b"transfer-encoding", b"chunked"))
            self.framing = "chunked"
        else:
            self.framing = "close"
        if not self.keep_alive and not any(name.lower() == b"connection" for name, _ in headers):
            headers.append((b"connection", b"close"))
        if self.method == "HEAD" or bodiless:
            self.remaining = 0
            self.framing = "none"
        return _render_head(status, headers)

    async def _send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers") or ())
            if self.server.draining and not any(k.lower() == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            headers.append((b"date", _date()))
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
