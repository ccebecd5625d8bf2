"""The upstream HTTP/1.1 client: h11 over trio streams, one exchange at a time per connection.

Why not httpx on this path: the gateway process spent 1.76 ms of its 3.39 ms CPU per
non-streamed request in the upstream call through httpx and httpcore (py-spy: a request object
model built and copied per call, the head and the body written in two sends, h11 under three
layers of wrappers). A provider call is narrow: a POST with a body of known length, an answer
framed by content-length, chunked or the connection's close, maybe gzip. This client does just
that: the head and the body go out in one send, the response head is read once into a dict, and
body bytes come from h11 as they arrive. Connections are pooled per profile by providers/pool.py.

What can go wrong on the wire (refused, reset, closed early, a TLS failure, malformed HTTP, an
undecodable body) is an `UpstreamError` whose message is relayline's own, never the peer's bytes.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import select
import socket
import ssl
import urllib.parse
import zlib
from importlib.metadata import PackageNotFoundError, version

import attrs
import h11
import httpx
import trio

CONNECT_S = 30.0  # opening a connection (and its TLS handshake); the driver's scopes bound the rest
READ_BYTES = 65536
MAX_HEAD_BYTES = 100 * 1024  # a response head larger than this is malformed (httpcore's bound)
INFLATE_PIECE = 1 << 20  # a compressed body is inflated at most this much per step: no zip bomb in one read
ACCEPT_ENCODING = "gzip, deflate"  # what the body decoder below reads
try:
    USER_AGENT = f"relayline/{version('relayline')}"
except PackageNotFoundError:  # a source tree that was never installed
    USER_AGENT = "relayline"

_poll = getattr(select, "poll", None)
# what breaks a connection: the exchange on it fails, the connection is closed, never reused
TRANSPORT_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class UpstreamError(Exception):
    """The connection failed, was lost, or the peer broke HTTP/1.1 (the message says which, in
    relayline's words). The exchange is over and its connection is closed, never reused."""


class UnsupportedEncoding(Exception):
    """A content-encoding this client did not advertise and cannot read."""


@attrs.frozen
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """The CA trust httpx used: certifi's bundle, or SSL_CERT_FILE / SSL_CERT_DIR when set (built
    once: reading the bundle takes tens of milliseconds and a few hundred KiB)."""
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
    ~200 µs of CPU a connection, paid by every turn of a burst that finds no idle connection. A
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


@functools.lru_cache(maxsize=512)
def split_url(url: str) -> tuple[Origin, str, str]:
    """A URL's origin, its Host header and its request target (cached: a profile has one)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("credentials in a provider's base_url are not sent: put them in its api_key or headers")
    default = 443 if scheme == "https" else 80
    port = parts.port or default
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    host_header = host if port == default else f"{host}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(scheme, parts.hostname, port), host_header, target


_DEFAULT_HEADERS = (("accept", "*/*"), ("accept-encoding", ACCEPT_ENCODING), ("user-agent", USER_AGENT))
_DEFAULT_LINES = "".join(f"{k}: {v}\r\n" for k, v in _DEFAULT_HEADERS)
_DEFAULTS = frozenset({"host", *dict(_DEFAULT_HEADERS)})
_FRAMING = frozenset({"content-length", "transfer-encoding"})  # this client's to write


@attrs.frozen
class UpstreamRequest:
    """A POST to a provider: what a protocol's `build()` returns. Header names are lowercase."""

    url: str
    headers: dict[str, str]
    body: bytes


def lowercase(headers: dict[str, str]) -> dict[str, str]:
    """Header names folded, so that a profile's `Authorization` and ours are one header."""
    return {name.lower(): value for name, value in headers.items()}


# RFC 9110's token for a name; a value may hold anything but CR, LF and NUL (h11's own rules)
_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+").fullmatch
_UNSAFE_VALUE = re.compile(r"[\r\n\0]|^[ \t]|[ \t]$").search


def render(request: UpstreamRequest, conn: h11.Connection) -> bytes:
    """The request's head and body as one buffer, with h11 told it was sent.

    The head is written here rather than by h11: h11 re-validates and re-encodes every header
    of every request (about a third of the client's CPU per request, cProfile), where these
    checks are one regex each. h11 still sees a request event with the same framing (its
    Content-Length), so it reads the response as it would have."""
    _, host, target = split_url(request.url)
    given = request.headers
    lines = [f"POST {target} HTTP/1.1\r\nhost: {host}\r\n"]
    if given.keys() & _DEFAULTS:  # a profile's own headers win over these defaults
        lines = [f"POST {target} HTTP/1.1\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in _DEFAULT_HEADERS if k not in given]
    else:
        lines.append(_DEFAULT_LINES)
    for name, value in given.items():
        if not _NAME(name) or _UNSAFE_VALUE(value) or name in _FRAMING:
            raise ValueError(f"header {name!r} cannot be sent upstream (an illegal name or value, or framing)")
        lines.append(f"{name}: {value}\r\n")
    body = request.body
    lines.append(f"content-length: {len(body)}\r\n\r\n")
    head = "".join(lines).encode("latin-1")
    conn.send(h11.Request(method=b"POST", target=b"/", headers=((b"host", b"-"), (b"content-length", b"%d" % len(body)))))
    conn.send_with_data_passthrough(h11.Data(data=body))
    conn.send(h11.EndOfMessage())
    return head + body


class Connection:
    """One upstream connection: a trio stream and the h11 state of the exchange on it. The
    pool's seams (connect, write, read, close) are its methods."""

    __slots__ = ("origin", "stream", "h11", "idle_since", "_fd")

    def __init__(self, origin: Origin, stream: trio.abc.Stream, fd: int) -> None:
        self.origin = origin
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.idle_since = 0.0
        self._fd = fd

    @classmethod
    async def connect(cls, origin: Origin, ssl_context: ssl.SSLContext | None) -> Connection:
        try:
            with trio.fail_after(CONNECT_S):
                tcp = await open_tcp(origin.host, origin.port)
                if origin.scheme != "https":
                    return cls(origin, tcp, tcp.socket.fileno())
                tls = trio.SSLStream(tcp, ssl_context or default_ssl_context(), server_hostname=origin.host,
                                     https_compatible=True)
                try:
                    await tls.do_handshake()
                except TRANSPORT_ERRORS:
                    await trio.aclose_forcefully(tcp)
                    raise UpstreamError("TLS handshake failed (the certificate or the protocol)") from None
                except BaseException:
                    await trio.aclose_forcefully(tcp)
                    raise
                return cls(origin, tls, tcp.socket.fileno())
        except trio.TooSlowError:
            raise UpstreamError(f"connecting took longer than {CONNECT_S:g}s") from None
        except TRANSPORT_ERRORS:
            raise UpstreamError("could not connect") from None

    async def write(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def read(self) -> bytes:
        return await self.stream.receive_some(READ_BYTES)

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

    async def exchange(self, request: UpstreamRequest, clock) -> Response:
        """Send the request in one write and read the response head. `clock` (the driver's
        attempt clock, or None) hears when the request was written and when the head arrived."""
        data = render(request, self.h11)
        try:
            await self.write(data)
        except TRANSPORT_ERRORS:
            raise UpstreamError("connection lost while sending the request") from None
        if clock is not None:
            clock.sent()
        conn = self.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                if conn.trailing_data[1]:  # the peer closed before a whole head
                    raise UpstreamError("connection closed before the response") from None
                raise UpstreamError("malformed HTTP response head") from None
            if event is h11.NEED_DATA:
                try:
                    data = await self.read()
                except TRANSPORT_ERRORS:
                    raise UpstreamError("connection lost before the response") from None
                conn.receive_data(data)
            elif type(event) is h11.Response:
                break
            elif type(event) is h11.ConnectionClosed:
                raise UpstreamError("connection closed before the response")
            # an informational (1xx) head: the real one follows
        if clock is not None:
            clock.headers()
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        return Response(self, event.status_code, headers)

    def reusable(self) -> bool:
        """Whether the exchange ended cleanly on both sides with nothing after it; if so the
        connection is ready for the next one."""
        conn = self.h11
        data, closed = conn.trailing_data  # (a body framed by the close leaves h11 DONE, closed)
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE or data or closed:
            return False
        conn.start_next_cycle()
        return True


class Response:
    """A response head and its body, read on demand: `async for piece in response` yields the
    decoded body bytes (b"" never), and `complete` says the body ended as framed."""

    __slots__ = ("connection", "status", "headers", "complete", "_inflate", "_tail")

    def __init__(self, connection: Connection, status: int, headers: dict[str, str]) -> None:
        self.connection = connection
        self.status = status
        self.headers = headers
        self.complete = False
        self._tail = b""
        coding = headers.get("content-encoding")
        self._inflate = None if coding is None else _decoder(coding)

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        piece = await self.receive()
        if not piece:
            raise StopAsyncIteration
        return piece

    async def receive(self) -> bytes:
        """The next piece of the body; b"" once it ended."""
        if self.complete:  # (h11 would say PAUSED from here on)
            return b""
        inflate = self._inflate
        while self._tail:  # what a compressed piece still holds beyond the last step
            piece = self._inflated(self._tail)
            if piece:  # (a step may yield nothing: a member's trailer, the next one's header)
                return piece
        conn = self.connection.h11
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                if conn.their_state is h11.ERROR and conn.trailing_data[1]:  # the peer closed mid-body
                    raise UpstreamError("connection lost while reading the response") from None
                raise UpstreamError("malformed HTTP response body") from None
            if type(event) is h11.Data:
                if inflate is None:
                    return event.data  # type: ignore[return-value]
                piece = self._inflated(event.data)
                if piece:
                    return piece
            elif event is h11.NEED_DATA:
                try:
                    data = await self.connection.read()
                except TRANSPORT_ERRORS:
                    raise UpstreamError("connection lost while reading the response") from None
                conn.receive_data(data)
            elif type(event) is h11.EndOfMessage:
                if inflate is not None:
                    rest, self._inflate = self._flush(), None
                    if rest:
                        self.complete = True
                        return rest
                self.complete = True
                return b""
            elif type(event) is h11.ConnectionClosed:  # (h11 reports a cut body as an error first)
                raise UpstreamError("connection lost while reading the response")

    def _inflated(self, data: bytes) -> bytes:
        decoder = self._inflate
        try:
            piece = decoder.decompress(data, INFLATE_PIECE)
        except zlib.error:
            raise UpstreamError("a compressed body that does not decode") from None
        self._tail = decoder.unconsumed_tail
        return piece

    def _flush(self) -> bytes:
        decoder = self._inflate
        try:
            rest = decoder.flush()
        except zlib.error:
            raise UpstreamError("a compressed body that does not decode") from None
        if not decoder.eof:  # the HTTP body ended whole, the compressed stream in it did not
            raise UpstreamError("a compressed body that ends before its end (cut short)")
        return rest


class _Unsupported:
    __slots__ = ("coding",)
    unconsumed_tail = b""
    eof = True

    def __init__(self, coding: str) -> None:
        self.coding = coding

    def decompress(self, data: bytes, limit: int) -> bytes:
        raise UnsupportedEncoding(self.coding)

    def flush(self) -> bytes:
        raise UnsupportedEncoding(self.coding)


class _Inflater:
    """A compressed body, in bounded steps (`unconsumed_tail`: what the last step left). Its end
    is the compressed stream's own (`eof`): an HTTP body that ends before it was cut short, and
    bytes after it are refused, never dropped unread (zlib keeps them aside as unused_data)."""

    __slots__ = ("_obj", "unconsumed_tail", "_fed")

    def __init__(self) -> None:
        self._obj = self._new()
        self.unconsumed_tail = b""
        self._fed = False  # an empty body is whole (a 204 or an error page may say an encoding)

    def _new(self):
        raise NotImplementedError

    def decompress(self, data: bytes, limit: int) -> bytes:
        if self._obj.eof:
            data = self._after_end(data)
            if not data:
                self.unconsumed_tail = b""
                return b""
        obj = self._obj
        self._fed = True
        piece = obj.decompress(data, limit)
        self.unconsumed_tail = obj.unused_data if obj.eof else obj.unconsumed_tail
        return piece

    def _after_end(self, data: bytes) -> bytes:
        """`data` follows the end: what of it is read next (by a new `_obj`), or b"" for nothing."""
        raise zlib.error("data after the end of the compressed body")

    @property
    def eof(self) -> bool:
        return self._obj.eof or not self._fed

    def flush(self) -> bytes:
        return self._obj.flush()


class _Gzip(_Inflater):
    """gzip, member after member (RFC 1952: a file may hold several; NUL padding may follow, as
    Python's gzip reads it)."""

    __slots__ = ()

    def _new(self):
        return zlib.decompressobj(zlib.MAX_WBITS | 16)

    def _after_end(self, data: bytes) -> bytes:
        data = data.lstrip(b"\0")
        if data:
            self._obj = self._new()  # the next member (its own header is checked: junk does not decode)
        return data


class _Deflate(_Inflater):
    """deflate with its zlib wrapper, as RFC 9110 says, or raw, as some servers send it (and
    httpx reads it): decided before any output, never after (a wrapped body corrupt midway
    does not decode; it is not read again as raw from there)."""

    __slots__ = ("_undecided",)

    def __init__(self) -> None:
        super().__init__()
        self._undecided: bytes | None = b""  # what was fed before the first output (or None)

    def _new(self):
        return zlib.decompressobj()

    def decompress(self, data: bytes, limit: int) -> bytes:
        seen = self._undecided
        try:
            piece = super().decompress(data, limit)
        except zlib.error:
            if seen is None:
                raise
            self._undecided = None
            self._obj = zlib.decompressobj(-zlib.MAX_WBITS)
            return super().decompress(seen + data, limit)  # from its first byte, however it was split
        if seen is not None:
            self._undecided = None if piece else seen + data
        return piece


def _decoder(coding: str):
    codings = [c.strip().lower() for c in coding.split(",") if c.strip().lower() not in ("", "identity")]
    if not codings:
        return None
    if codings == ["gzip"] or codings == ["x-gzip"]:
        return _Gzip()
    if codings == ["deflate"]:
        return _Deflate()
    return _Unsupported(", ".join(codings))
