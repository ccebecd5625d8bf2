"""The request side of a connection: llhttp's callbacks turned into events in order (a `Head`,
body bytes, `END`, or a `Fault` after which nothing more is read), with the rules h11 kept that
llhttp does not."""

from __future__ import annotations

import re

import httptools


class Fault:
    """A request this server cannot read: its status and relayline's words for it (llhttp's
    reasons are fixed strings: a fault never quotes the request's bytes, which may hold a key)."""

    __slots__ = ("status", "message")

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class Head:
    __slots__ = ("method", "target", "version", "headers", "keep_alive")

    def __init__(self, method: bytes, target: bytes, version: str,
                 headers: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive


ONLY_CHUNKED = Fault(501, "malformed HTTP request: only Transfer-Encoding: chunked is supported")


class _End:
    """A request's body ended (llhttp's on_message_complete): `END`, the one instance."""

    __slots__ = ()


END = _End()
# what a reader hands its connection, in order: a head, body bytes, the end, or a fault
Event = Head | bytes | _End | Fault
IDLE, IN_HEAD, IN_BODY = 0, 1, 2
_TRANSFER_CODINGS = ("Invalid `Transfer-Encoding` header value",
                     "Request has invalid `Transfer-Encoding`")
_BLANK_LINE = re.compile(rb"\n\r?\n").search
_FOLD = re.compile(rb"\r?\n[ \t]+").sub
_BARE_LF = re.compile(rb"(?<!\r)\n").sub


def fault_of(exc: Exception) -> Fault:
    reason = str(exc)
    if reason == "Transfer-Encoding can't be present with Content-Length":
        # which of the two frames the body is the classic smuggling question: a proxy in front
        # may have answered it differently, so neither is trusted (RFC 9112 6.3)
        return Fault(400, "malformed HTTP request: both Content-Length and Transfer-Encoding")
    # (h11 read any length: the app refused it as too large)
    if reason == "Content-Length overflow":
        return Fault(413,
                     "request body larger than this server reads (a Content-Length beyond 64 bits)")
    if reason in _TRANSFER_CODINGS:
        return ONLY_CHUNKED
    if reason == "Pause on PRI/Upgrade":  # HTTP/2's preface
        return Fault(505, "HTTP/2.0 is not supported: this server speaks HTTP/1.1")
    if "header" in reason.lower() and "Content-Length" not in reason:
        return Fault(400, "malformed HTTP request: illegal header line")
    return Fault(400, f"malformed HTTP request: {reason[:1].lower()}{reason[1:]}")


class Reader:
    """The request side of a connection: llhttp (httptools' HttpRequestParser, strict, in C)
    calls these `on_*` methods while it reads, and what they see becomes events in order: a
    `Head`, body bytes, `END`, or a `Fault` after which nothing more is read. h11 (the parser
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

    __slots__ = ("parser", "events", "taken", "limit", "state", "url", "headers", "coding",
                 "progress", "stalled", "dead",
                 "head_pieces", "refeed", "reread")

    def __init__(self, limit: int) -> None:
        # llhttp's parser only while a request is being read: between requests (an idle
        # keep-alive connection, a request whose answer is streaming) it is not kept (with its
        # callbacks' bound methods it would be most of an idle connection's memory), and the next
        # request's head gets a new one (cheap next to reading that head)
        self.parser: httptools.HttpRequestParser | None = None
        # a list and the index of the next event to take, not a deque: an idle connection keeps
        # an empty list, a fraction of an empty deque's size
        self.events: list[Event] = []
        self.taken = 0
        self.limit = limit
        self.state = IDLE
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] | None = []
        self.coding: bytes | None = None  # the head's Transfer-Encoding (b"," when it came twice)
        self.progress = False  # a feed got something done (a head, body bytes, a chunk)
        self.stalled = 0  # bytes fed since the last progress
        self.dead = False  # a fault was queued: nothing more is read
        # the head being read, when it began at a read's start
        self.head_pieces: list[bytes | bytearray] | None = None
        # a bare-LF or folded head kept whole until its end, to be read again
        self.refeed: bytes | None = None
        self.reread = False  # that head is being read again (a second fault in it is final)

    def _parser(self) -> httptools.HttpRequestParser:
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(lenient_version=True)
        return parser

    # -- llhttp's callbacks (they run inside feed_data) -----------------------------------------

    def on_message_begin(self) -> None:
        self.state = IN_HEAD
        self.url = b""
        self.headers = []
        self.coding = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        # (not a chunked body's trailer: the app is not told those, as with h11)
        if self.state == IN_HEAD and headers is not None:
            name = name.lower()
            if name == b"transfer-encoding":
                self.coding = b"," if self.coding is not None else value
            headers.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        parser, headers = self.parser, self.headers
        assert parser is not None and headers is not None  # (llhttp calls this while it reads)
        self.state = IN_BODY
        self.progress = True
        self.head_pieces = None
        coding = self.coding
        if coding is not None and coding.strip(b" \t").lower() != b"chunked":
            # llhttp frames `gzip, chunked` by its last coding and would hand the app the body
            # still gzip-coded: only chunked alone is read (as h11 did)
            raise Refused(ONLY_CHUNKED)
        if parser.should_upgrade() and any(n in (b"content-length", b"transfer-encoding")
                                           for n, _ in headers):
            raise Refused(Fault(400, "malformed HTTP request: an Upgrade or CONNECT request with a"
                                     " body is not supported"))
        version = parser.get_http_version()
        self.events.append(Head(parser.get_method(), self.url, version, headers,
                                 parser.should_keep_alive() and version != "1.0"))
        # the request's from here on: an idle connection keeps neither
        self.headers, self.url = None, b""

    def on_body(self, data: bytes) -> None:
        self.progress = True
        self.events.append(data)

    def on_chunk_header(self) -> None:
        self.progress = True

    def on_chunk_complete(self) -> None:
        self.progress = True

    def on_message_complete(self) -> None:
        self.state = IDLE
        self.progress = True
        # a head begun after this, in the same read, did not begin at its start
        self.head_pieces = None
        self.events.append(END)

    # -- taking events ---------------------------------------------------------------------------

    def pending(self) -> bool:
        return self.taken < len(self.events)

    def peek(self) -> Event:
        return self.events[self.taken]

    def take(self) -> Event:
        """The next event (`pending()` says there is one); the list empties once all are taken."""
        events = self.events
        event = events[self.taken]
        self.taken += 1
        if self.taken == len(events):
            events.clear()
            self.taken = 0
        return event

    # -- feeding ---------------------------------------------------------------------------------

    def feed(self, data: bytes | bytearray) -> None:
        """Parse what was read (b"": nothing; the caller handles the end)."""
        if self.dead or not data:
            return
        if self.refeed is not None:
            self._refeed(data)
            return
        if self.state == IDLE:
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
                # the request ended: what follows is the next
                except httptools.HttpParserUpgrade as upgrade:
                    data = data[upgrade.args[0]:]
        except httptools.HttpParserError as exc:
            refused = exc.__context__  # (what a callback raised)
            if type(refused) is Refused:
                self._fail(refused.fault)
                return
            pieces = self.head_pieces
            if self.state == IN_HEAD and pieces is not None and not self.reread:
                raw = b"".join(pieces)
                if b"\n " in raw or b"\n\t" in raw or _BARE_LF(b"", raw, count=1) != raw:
                    # (read again whole, once its end is here)
                    self.refeed, self.head_pieces = raw, None
                    self._refeed(b"")
                    return
            self._fail(fault_of(exc))
            return
        # (every request read ended: the next gets a new parser)
        if self.state == IDLE and not self.dead:
            self.parser = None
        if self.progress:
            self.stalled = 0
            return
        self.stalled += len(data)
        if self.stalled > self.limit:
            if self.state == IN_BODY:  # a chunk header (or a trailer) that does not end
                self._fail(Fault(400,
                                 f"malformed HTTP request: a chunk header larger than {self.limit} "
                                 "bytes"))
            else:
                self._fail(Fault(431, f"request headers larger than {self.limit} bytes"))

    def _refeed(self, data: bytes | bytearray) -> None:
        """A head h11 would have read and llhttp does not (bare LF line ends, obs-fold), kept whole
        until its blank line and then read by a new parser, unfolded and with CRLF line ends."""
        # what was kept already had no blank line: only its end is scanned again (a head sent a
        # byte at a time is scanned once, not once a byte); the first call scans the whole head
        kept = self.refeed or b""
        start = max(len(kept) - 2, 0) if data else 0
        raw = kept + data
        end = _BLANK_LINE(raw, start)
        if end is None:
            self.refeed = raw
            if len(raw) > self.limit:
                self._fail(Fault(431, f"request headers larger than {self.limit} bytes"))
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
        self.state = IDLE
        self.reread = True
        try:
            self.feed(head + b"\r\n\r\n" + raw[end.end():])
        finally:
            self.reread = False

    def _fail(self, fault: Fault) -> None:
        self.dead = True
        self.head_pieces = None
        self.events.append(fault)


class Refused(Exception):
    """A fault found in a callback of llhttp's: raised through feed_data, which reports it."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault

