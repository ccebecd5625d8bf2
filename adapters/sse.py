"""A strict, incremental Server-Sent Events decoder (the WHATWG event-stream format).

Bytes go in as the network delivers them, split anywhere (inside a line, inside a CRLF, inside
a multi-byte character); complete events come out. What a provider stream needs beyond the
common line splitters, and why this is hand-written:

- strictness: a line that is not valid UTF-8, or an event larger than `max_event_bytes`, is a
  `SSEProtocolError`, never a crash and never unbounded memory;
- completion: `close()` reports whether the stream ended cleanly between events, so a protocol
  parser can tell "done" from "cut";
- speed: one `bytes.find` per line, no per-byte Python loop.

Comments (`: keep-alive`) are returned as events only when asked (`comments=True`), since a
gate treats them as preamble. `id` and `retry` fields are parsed and kept; unknown fields are
ignored, as the format requires.
"""

from __future__ import annotations

import attrs

DEFAULT_MAX_EVENT_BYTES = 1 << 20  # 1 MiB: far above any real frame, far below trouble


class SSEProtocolError(Exception):
    """The byte stream is not a valid event stream (encoding, size)."""


@attrs.frozen(slots=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None
    comment: bool = False


class SSEDecoder:
    __slots__ = ("_buffer", "_data", "_event", "_id", "_pending_bytes", "_max", "_comments",
                 "_skip_lf")

    def __init__(self, *, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
                 comments: bool = False) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._pending_bytes = 0
        self._max = max_event_bytes
        self._comments = comments
        self._skip_lf = False  # the last chunk ended in CR: a leading LF belongs to that CRLF

    @property
    def between_events(self) -> bool:
        """No partial line and no partial event is pending."""
        return not self._buffer and not self._data and not self._event and self._pending_bytes == 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[SSEEvent] = []
        if b"\r" not in buffer:
            # every provider ends its lines with LF: one split in C instead of a find per line
            lines = buffer.split(b"\n")
            self._buffer = lines.pop()
            for raw in lines:
                self._line(raw, events)
        else:
            self._buffer = self._split(buffer, events)
        if len(self._buffer) + self._pending_bytes > self._max:
            raise SSEProtocolError(f"event larger than {self._max} bytes")
        return events

    def _split(self, buffer: bytes, events: list[SSEEvent]) -> bytes:
        """Lines ended by CR, LF or CRLF (a CR at the very end may be half of a CRLF)."""
        start = 0
        n = len(buffer)
        while start < n:
            lf = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start, lf if lf != -1 else n)
            if cr != -1:
                end, nxt = cr, cr + 1
                if nxt < n and buffer[nxt] == 0x0A:
                    nxt += 1
                elif nxt == n:
                    self._skip_lf = True
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            self._line(buffer[start:end], events)
            start = nxt
        return buffer[start:]

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        if not raw:
            if self._data or self._event:
                events.append(SSEEvent("\n".join(self._data), self._event or "message", self._id))
            self._data, self._event, self._pending_bytes = [], "", 0
            return
        self._pending_bytes += len(raw) + 1
        if self._pending_bytes > self._max:
            raise SSEProtocolError(f"event larger than {self._max} bytes")
        if raw[:6] == b"data: ":  # nearly every line: decoded without the general field split
            try:
                self._data.append(raw[6:].decode("utf-8"))
            except UnicodeDecodeError:
                raise SSEProtocolError("a line is not valid UTF-8") from None
            return
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SSEProtocolError("a line is not valid UTF-8") from None
        if line[0] == ":":
            if self._comments:
                events.append(SSEEvent(line[1:].lstrip(" "), "comment", None, True))
            self._pending_bytes -= len(raw) + 1
            return
        field, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\x00" not in value:
                self._id = value
        # "retry" and unknown fields: nothing for a provider stream to act on

    def close(self) -> bool:
        """End of input. True when it ended cleanly between events; a trailing partial event
        is discarded (the format says so) and reported as False."""
        clean = self.between_events
        self._buffer, self._data, self._event, self._pending_bytes = b"", [], "", 0
        return clean
