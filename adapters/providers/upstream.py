"""The upstream HTTP/1.1 client: llhttp (httptools) over trio streams, one exchange at a time per
connection.

Why not httpx on this path: the gateway process spent 1.76 ms of its 3.39 ms CPU per
non-streamed request in the upstream call through httpx and httpcore (py-spy: a request object
model built and copied per call, the head and the body written in two sends, h11 under three
layers of wrappers). A provider call is narrow: a POST with a body of known length, an answer
framed by content-length, chunked or the connection's close, maybe gzip. This client does just
that: the head and the body go out in one send, the response head's framing is read once (its
other fields only when asked for), and body bytes come as they arrive. Connections are pooled
per profile by providers/pool.py. The request's head is rendered by the HTTP/1 rules the
gateway's server shares (codecs/http1.py), and a compressed body is read by
codecs/content_coding.py.

The response is parsed by llhttp, Node's parser in C, through httptools: h11 (pure Python) cost
about a third of this client's CPU per exchange. llhttp runs strict (no leniency is switched on);
what it reads but h11 refused is refused here too (a version other than 1.x, a transfer coding
other than chunked alone, a status below 100, a 101 nobody asked for, a head, a trailer or a chunk
line still arriving beyond MAX_HEAD_BYTES). Where llhttp is stricter
than h11 (an obs-folded or bare-LF head line, one Content-Length given twice), the answer is
malformed: providers send neither.

What can go wrong on the wire (refused, reset, closed early, a TLS failure, malformed HTTP, an
undecodable body) is an `UpstreamError` whose message is relayline's own, never the peer's bytes.
"""

from __future__ import annotations

import functools
import ipaddress
import select
import socket
import ssl
import zlib

import httptools
import httpx
import trio

from .. import sockets
from ..codecs.content_coding import BodyDecoder, decoder
from ..codecs.http1 import Origin, UpstreamRequest, render
from .base import AttemptClockLike

CONNECT_S = 30.0  # opening a connection (and its TLS handshake); the driver's scopes bound the rest
READ_BYTES = 65536
MAX_HEAD_BYTES = 100 * 1024  # a response head larger than this is malformed (httpcore's bound)
# a compressed body is inflated at most this much per step: no zip bomb in one read
INFLATE_PIECE = 1 << 20

_poll = getattr(select, "poll", None)
# what breaks a connection: the exchange on it fails, the connection is closed, never reused
TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class UpstreamError(Exception):
    """The connection failed, was lost, or the peer broke HTTP/1.1 (the message says which, in
    relayline's words). The exchange is over and its connection is closed, never reused."""


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """The CA trust httpx used: certifi's bundle, or SSL_CERT_FILE / SSL_CERT_DIR when set (built
    once: reading the bundle is slow, and its result large)."""
    context = httpx.create_ssl_context()
    context.set_alpn_protocols(["http/1.1"])
    return context


@functools.lru_cache(maxsize=512)
def address_family(host: str) -> int | None:
    """The socket family of an IP literal host; None for a name, which is resolved per connect."""
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


async def open_tcp(host: str, port: int) -> trio.SocketStream:
    """A TCP stream to the origin. An IP literal (a local model server, a sidecar) is one
    connect() on one socket: trio.open_tcp_stream's resolution and happy-eyeballs nursery cost
    CPU on every connection, paid by every turn of a burst that finds no idle connection. A
    name goes through open_tcp_stream: its addresses, tried in turn, are what that is for."""
    family = address_family(host)
    if family is None:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


# a head reaches this client as one string, its status line and field lines each ending in CRLF
# (llhttp parsed them, without a callback a field: httptools' bridge into Python cost about 4,500
# instructions a field whatever the callback did, and a provider's answer has twenty-odd). A
# field's line is found by its name's, lowercase, after the CRLF that ends the line before: no
# value holds a CR or LF (llhttp refused them)
_CONTENT_LENGTH = "\r\ncontent-length:"
_CONTENT_ENCODING = "\r\ncontent-encoding:"
_TRANSFER_ENCODING = "\r\ntransfer-encoding:"


def _field(fields: str, at: int, line: str) -> str | None:
    """The value of the field whose `line` start (`_CONTENT_LENGTH`...) is `at` in `fields`."""
    if at < 0:
        return None
    at += len(line)
    return fields[at:fields.index("\r", at)].strip(" \t")


def head_fields(fields: str) -> dict[str, str]:
    """Every field of a head (`fields`: its status line and field lines, each ending in CRLF) by
    lowercase name, without the whitespace around its value, the last of a name's lines winning."""
    headers = {}
    for line in fields.split("\r\n")[1:-1]:
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip(" \t")
    return headers


class _Malformed(Exception):
    """The peer broke HTTP/1.1 in a way the parser's callbacks, not llhttp, noticed."""


class Connection:
    """One upstream connection: a trio stream and the state of the exchange on it, read by
    llhttp (httptools' HttpResponseParser, whose callbacks are this object's `on_*` methods).
    The pool's seams (connect, write, read, close) are its methods."""

    __slots__ = ("origin", "stream", "idle_since", "_fd", "_parser", "_status", "_fields",
                 "_length", "_encoding", "_pieces",
                 "_stalled", "_unread", "_head_from", "_head_done", "_done", "_keep_alive",
                 "_chunked", "_after", "_eof",
                 "_framed", "_fault")

    def __init__(self, origin: Origin, stream: trio.abc.Stream, fd: int) -> None:
        self.origin = origin
        self.stream = stream
        self.idle_since = 0.0
        self._fd = fd
        self._parser = httptools.HttpResponseParser(self)
        self._eof = False  # the peer closed its side
        self._after = False  # bytes arrived after the answer's end (the connection is not reused)
        self._begin_exchange()

    def _begin_exchange(self) -> None:
        self._status = 0
        self._fields = ""  # the final head's lines (`head_fields`)
        self._length: str | None = None  # its Content-Length
        self._encoding: str | None = None  # its Content-Encoding
        self._pieces: list[bytes] = []  # body bytes parsed and not yet taken
        # read since the head began or the body last gave bytes (a head, trailer or chunk line that
        # never ends)
        self._stalled = 0
        # the bytes read while the head is not done: its block is taken from them
        self._unread: bytes | bytearray = b""
        self._head_from = 0  # where in them the next head begins (after an informational one)
        self._head_done = False  # the final (non-1xx) head was read
        self._done = False  # the answer ended as framed
        self._keep_alive = False
        self._chunked = False
        # False: the answer's body ends with the connection (no length, not chunked)
        self._framed = True
        # the body broke HTTP/1.1 after the bytes in _pieces (raised once they are taken)
        self._fault = False

    # -- llhttp's callbacks (they run inside feed_data) ------------------------------------------

    def on_message_begin(self) -> None:
        if self._done:
            # an answer nobody asked for, in the same read: llhttp would parse it on, and its
            # status, head and body would become this exchange's. Parsing stops here, and the
            # connection is not reused
            self._after = True
            raise _Malformed("bytes after the answer")

    def on_status(self, reason: bytes) -> None:
        # (llhttp takes any byte in a reason phrase; h11 refused a NUL, as RFC 9112 4 does)
        if b"\0" in reason:
            raise _Malformed("a NUL in the status line")

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        # (llhttp reads any three digits, and would wait for a head after this one)
        if status < 100:
            raise _Malformed("not a status code")
        # the head, whole in the bytes read: llhttp has checked its lines (a token name, a value
        # without CR, LF or NUL, no obs-fold, one Content-Length, not both framings)
        unread = self._unread
        begin = self._head_from
        versioned = unread.startswith(b"HTTP/1.", begin)  # (llhttp has read the version's digits)
        # another version, or empty lines before the status line (llhttp skips them)
        if not versioned:
            begin = unread.find(b"HTTP/", begin)
            versioned = unread.startswith(b"HTTP/1.", begin)
        end = unread.find(b"\r\n\r\n", begin)
        self._head_from = end + 4
        if status < 200:  # an informational head: the real one follows (llhttp ends this message)
            return
        if not versioned:
            raise _Malformed("not HTTP/1.x")
        if end - begin > MAX_HEAD_BYTES:  # (one that arrived whole in a read or two)
            raise _Malformed("a head too large")
        self._unread = b""
        # only the framing is read here, every field only when asked for (`Response.headers`)
        self._fields = fields = unread[begin:end + 2].decode("latin-1")
        lowered = fields.lower()
        self._length = length = _field(fields, lowered.rfind(_CONTENT_LENGTH), _CONTENT_LENGTH)
        self._encoding = _field(fields, lowered.rfind(_CONTENT_ENCODING), _CONTENT_ENCODING)
        at = lowered.find(_TRANSFER_ENCODING)
        chunked = at >= 0
        if chunked:
            # llhttp would read another coding to the close, and frames by the last of two lines
            if (_field(fields, at, _TRANSFER_ENCODING) or "").lower() != "chunked" or \
                    lowered.find(_TRANSFER_ENCODING, at + len(_TRANSFER_ENCODING)) >= 0:
                raise _Malformed("a transfer coding other than chunked")
            self._chunked = True
        self._status = status
        self._head_done = True
        self._keep_alive = parser.should_keep_alive()  # (llhttp forgets it once the message ends)
        self._framed = chunked or length is not None or status in (204, 304)

    def on_body(self, data: bytes) -> None:
        self._pieces.append(data)

    def on_message_complete(self) -> None:
        if self._head_done:
            if self._chunked and self._keep_alive and not self._parser.should_keep_alive():
                # a trailer said Transfer-Encoding or Connection, which llhttp takes as the
                # connection's end after the head judged it reusable: framing and the connection's
                # management are never a trailer's (RFC 9110 6.5.1; h11 refused framing there)
                raise _Malformed("framing in a trailer")
            self._done = True

    # -- reading ---------------------------------------------------------------------------------

    def _feed(self, data: bytes | bytearray) -> None:
        """Parse what was read; an error is the exchange's UpstreamError (relayline's words)."""
        parsed = len(self._pieces)
        if not self._head_done:  # (the head's block is read from these: on_headers_complete)
            if not self._unread:
                self._unread = data  # (nearly always the head's only read: kept, not copied)
            else:  # (grown in place: a head trickled in small reads is not copied again each read)
                if type(self._unread) is bytes:
                    self._unread = bytearray(self._unread)
                self._unread += data
        try:
            self._parser.feed_data(data)
        # (a 101 is an upgrade)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, _Malformed):
            if self._done:  # what follows a whole answer only means the connection is not reused
                self._after = True
                return
            # the head (and the body before the fault) stand: the reader hears it there
            if self._head_done:
                self._fault = True
                return
            raise UpstreamError("malformed HTTP response head") from None
        if self._head_done and (self._done or len(self._pieces) != parsed):
            self._stalled = 0
            return
        # llhttp has no size limit: a head, a trailer (which it keeps whole in memory) or a chunk
        # line still arriving beyond MAX_HEAD_BYTES is malformed, as h11 held them
        self._stalled += len(data)
        if self._stalled > MAX_HEAD_BYTES:
            if not self._head_done:
                raise UpstreamError("malformed HTTP response head")
            self._fault = True

    @classmethod
    async def connect(cls, origin: Origin, ssl_context: ssl.SSLContext | None) -> Connection:
        try:
            with trio.fail_after(CONNECT_S):
                tcp = await open_tcp(origin.host, origin.port)
                if origin.scheme != "https":
                    return cls(origin, tcp, tcp.socket.fileno())
                tls = trio.SSLStream(tcp, ssl_context or default_ssl_context(),
                                     server_hostname=origin.host,
                                     https_compatible=True)
                try:
                    await tls.do_handshake()
                except TRANSPORT_ERRORS:
                    await trio.aclose_forcefully(tcp)
                    raise UpstreamError(
                        "TLS handshake failed (the certificate or the protocol)"
                    ) from None
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
                return cls(origin, tls, tcp.socket.fileno())
        except trio.TooSlowError:
            raise UpstreamError(f"connecting took longer than {CONNECT_S:g}s") from None
        except TRANSPORT_ERRORS:
            raise UpstreamError("could not connect") from None

    async def write(self, data: bytes) -> None:
        await sockets.send_all(self.stream, data)  # (one exchange at a time: no other writer)

    async def read(self, first: bool = False) -> bytes | bytearray:
        """`first`: the first read of an answer to a request just written, whose bytes are seldom
        here yet: no read is tried before the wait (sockets.py)."""
        if first:
            return await sockets.receive_after_wait(self.stream, READ_BYTES)
        return await self.stream.receive_some(READ_BYTES)

    async def _receive(self, lost: str, first: bool = False) -> bytes | bytearray:
        """The next bytes read (b"" once the peer closed: `_eof`); a transport error is `lost`."""
        try:
            data = await self.read(first)
        except TRANSPORT_ERRORS:
            raise UpstreamError(lost) from None
        if not data:
            self._eof = True
        return data

    async def aclose(self) -> None:
        # never waits on the peer: a TLS close_notify to a stalled upstream would hang the close
        await trio.aclose_forcefully(self.stream)

    def idle_and_open(self) -> bool:
        """An idle connection is readable only when its peer closed it (or broke the protocol
        by writing unasked): either way it must not carry the next request. Over TLS, what the
        peer wrote may already be off the socket, read with the answer's last record and not yet
        decrypted (trio's incoming buffer): a stale answer there would be the next request's."""
        stream = self.stream
        if type(stream) is trio.SSLStream and (stream.pending() or stream._incoming.pending):
            return False
        if _poll is None:  # Windows
            return not select.select([self._fd], [], [], 0)[0]
        poller = _poll()
        poller.register(self._fd, select.POLLIN)
        return not poller.poll(0)

    async def exchange(self, request: UpstreamRequest, clock: AttemptClockLike | None) -> Response:
        """Send the request in one write and read the response head. `clock` (the driver's
        attempt clock, or None) hears when the request was written and when the head arrived."""
        rendered = render(request)
        self._begin_exchange()
        try:
            await self.write(rendered)
        except TRANSPORT_ERRORS:
            raise UpstreamError("connection lost while sending the request") from None
        if clock is not None:
            clock.sent()
        first = True
        while not self._head_done:
            data = await self._receive("connection lost before the response", first)
            first = False
            if not data:
                raise UpstreamError("connection closed before the response")
            self._feed(data)
        if clock is not None and not self._done:
            # an answer that came whole with its head (a short one, nearly every non-streamed
            # answer) is read to its end with no await: the body's idle deadline could never
            # fire, and the attempt's deadline is moved once (read()) where it was moved three
            # times (headers, received, read: bench/proxy_floor.py --instructions)
            clock.headers()
        return Response(self, self._status, self._fields, self._length, self._encoding)

    async def body_bytes(self) -> bytes | None:
        """The body bytes parsed so far (read more if there are none yet): None once it ended."""
        while not self._pieces:
            if self._done:
                return None
            if self._fault:
                raise UpstreamError("malformed HTTP response body")
            data = await self._receive("connection lost while reading the response")
            if not data:
                if not self._framed:  # the close is this body's end
                    self._done = True
                    continue
                raise UpstreamError("connection lost while reading the response")
            self._feed(data)
        pieces = self._pieces
        self._pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly on both sides with nothing after it; if so the
        connection is ready for the next one."""
        return (
            self._done and self._keep_alive and self._framed and not self._after and not self._eof
        )


class Response:
    """A response head and its body, read on demand: `async for piece in response` yields the
    decoded body bytes (b"" never), and `complete` says the body ended as framed. Its fields are
    read from the head's lines when `headers` is first asked for (to classify an error): an
    answer's success needs only its framing, `content_length` and its content coding."""

    __slots__ = ("connection", "status", "content_length", "complete", "_fields", "_headers",
                 "_inflate", "_tail")

    def __init__(self, connection: Connection, status: int, fields: str, content_length: str | None,
                 content_encoding: str | None) -> None:
        self.connection = connection
        self.status = status
        self.content_length = content_length
        self.complete = False
        self._fields = fields
        self._headers: dict[str, str] | None = None
        self._tail = b""
        self._inflate: BodyDecoder | None = (
            None if content_encoding is None else decoder(content_encoding))

    @property
    def headers(self) -> dict[str, str]:
        """Every field of the head by lowercase name (the last of a name's lines winning)."""
        if self._headers is None:
            self._headers = head_fields(self._fields)
        return self._headers

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        piece = await self.receive()
        if not piece:
            raise StopAsyncIteration
        return piece

    async def receive(self) -> bytes:
        """The next piece of the body; b"" once it ended."""
        if self.complete:
            return b""
        inflate = self._inflate
        # what a compressed piece still holds beyond the last step
        while inflate is not None and self._tail:
            piece = self._inflated(inflate, self._tail)
            if piece:  # (a step may yield nothing: a member's trailer, the next one's header)
                return piece
        while True:
            data = await self.connection.body_bytes()
            if data is None:
                if inflate is not None:
                    rest, self._inflate = self._flush(inflate), None
                    if rest:
                        self.complete = True
                        return rest
                self.complete = True
                return b""
            if inflate is None:
                return data
            piece = self._inflated(inflate, data)
            if piece:
                return piece

    def _inflated(self, decoder: BodyDecoder, data: bytes) -> bytes:
        try:
            piece = decoder.decompress(data, INFLATE_PIECE)
        except zlib.error:
            raise UpstreamError("a compressed body that does not decode") from None
        self._tail = decoder.unconsumed_tail
        return piece

    def _flush(self, decoder: BodyDecoder) -> bytes:
        try:
            rest = decoder.flush()
        except zlib.error:
            raise UpstreamError("a compressed body that does not decode") from None
        if not decoder.eof:  # the HTTP body ended whole, the compressed stream in it did not
            raise UpstreamError("a compressed body that ends before its end (cut short)")
        return rest
