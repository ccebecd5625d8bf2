"""A response body's content coding read in bounded steps: gzip (member after member) and
deflate (with its zlib wrapper or raw), what the upstream client advertises in
`ACCEPT_ENCODING`; any other coding is `UnsupportedEncoding`. Pure: zlib, no I/O."""

from __future__ import annotations

import zlib
from typing import Protocol

ACCEPT_ENCODING = "gzip, deflate"  # what `decoder` reads


class UnsupportedEncoding(Exception):
    """A content-encoding this client did not advertise and cannot read."""


class BodyDecoder(Protocol):
    """A coded body read in bounded steps: what `decoder` gives the upstream client."""

    @property
    def unconsumed_tail(self) -> bytes: ...

    @property
    def eof(self) -> bool: ...

    def decompress(self, data: bytes, limit: int) -> bytes: ...

    def flush(self) -> bytes: ...


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

    def _new(self) -> zlib._Decompress:
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

    def _new(self) -> zlib._Decompress:
        return zlib.decompressobj(zlib.MAX_WBITS | 16)

    def _after_end(self, data: bytes) -> bytes:
        data = data.lstrip(b"\0")
        if data:
            # the next member (its own header is checked: junk does not decode)
            self._obj = self._new()
        return data


class _Deflate(_Inflater):
    """deflate with its zlib wrapper, as RFC 9110 says, or raw, as some servers send it (and
    httpx reads it): decided before any output, never after (a wrapped body corrupt midway
    does not decode; it is not read again as raw from there)."""

    __slots__ = ("_undecided",)

    def __init__(self) -> None:
        super().__init__()
        self._undecided: bytes | None = b""  # what was fed before the first output (or None)

    def _new(self) -> zlib._Decompress:
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
            # from its first byte, however it was split
            return super().decompress(seen + data, limit)
        if seen is not None:
            self._undecided = None if piece else seen + data
        return piece


def decoder(coding: str) -> BodyDecoder | None:
    """The decoder of a content-encoding header's codings, or None for identity."""
    codings = [c.strip().lower() for c in coding.split(",")
               if c.strip().lower() not in ("", "identity")]
    if not codings:
        return None
    if codings == ["gzip"] or codings == ["x-gzip"]:
        return _Gzip()
    if codings == ["deflate"]:
        return _Deflate()
    return _Unsupported(", ".join(codings))
