"""JSON on the hot path: orjson, with the standard library's behaviour at the edges.

Every request body, upstream reply and stream chunk is decoded once and every answer and chunk
encoded once; orjson does both several times faster than `json` (bench/run.py, "wire" and the
per-frame figures). Where orjson reads differently from `json` (NaN and Infinity, an integer
beyond 64 bits, which it would read as a float, a lone UTF-16 surrogate escape, nesting deeper
than 1024, another encoding than UTF-8) the document is read by `json`, so what was accepted,
refused and reported before stays so. Written output is compact UTF-8 (not ASCII-escaped), a
string with a lone surrogate is written by `json`, and a non-finite number is written as null:
`json`'s bare NaN is not JSON, and strict readers (JSON.parse) refuse the whole document."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import orjson

# orjson reads an integer beyond 64 bits as a float (a seed or an id would silently change):
# a run of 19 digits anywhere sends the document to `json`, which keeps it exact. Found by
# mapping every digit to "0" and looking for 19 of them: two C passes (a regex is 10x slower).
# Every 6th character is looked at first: a run of 19 digits covers three consecutive ones of
# them, so a document whose sample has no three digits side by side has no long number, and
# only one that has (a run of 13 digits or more: a timestamp in ms, an id) is looked at whole.
# Three, not two: source code and logs in an agent's tool results are full of digit pairs a
# ninth apart, and with two each such body was translated whole
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19
_STRIDE = 6  # (19 >= 3 * 6 + 1: a run of 19 covers three multiples of 6)
_SAMPLE_RUN = b"0" * 3
# a JSON escape of a UTF-16 surrogate, or a surrogate's own three bytes (not UTF-8, but `json`
# reads them: it decodes a body with surrogatepass)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


_SAMPLED_FROM = 4096  # (below it the sample's own slice costs more than it saves: a stream frame)


def _no_long_number(data: bytes | bytearray | str) -> bool:
    """No run of 19 digits: no integer orjson would read differently from `json` (as a float)."""
    if len(data) > _SAMPLED_FROM:
        sample = data[::_STRIDE]
        if isinstance(sample, str):  # (a character that is not a digit encodes to no digit byte)
            sample = sample.encode("utf-8", "surrogatepass")
        if _SAMPLE_RUN not in sample.translate(_DIGITS_AS_ZERO):
            return True
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return _LONG_RUN not in raw.translate(_DIGITS_AS_ZERO)


def loads(data: bytes | bytearray | str) -> Any:
    """Raises ValueError (or RecursionError) exactly where `json.loads` does."""
    if _no_long_number(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def loads_read(data: bytes) -> tuple[Any, bool, bool]:
    """`loads(data)`; whether every string in it can be sent as UTF-8 (JSON can escape a lone
    UTF-16 surrogate, "\\ud800", that no UTF-8 request to a provider can carry: orjson refuses
    such an escape, so a document it read has none and is not searched again; one `json` read
    is); and whether orjson read it: then `data` is strict UTF-8 JSON with no NaN, Infinity,
    lone surrogate or integer beyond 64 bits, and reads back, by orjson or any strict reader, as
    the document (`dumps_appended` may send it as it is)."""
    if _no_long_number(data):
        try:
            return orjson.loads(data), True, True
        except orjson.JSONDecodeError:
            pass
    document = json.loads(data)
    return document, not _lone_surrogate(data, document), False


def _lone_surrogate(data: bytes, document: Any) -> bool:
    if not _SURROGATE_ESCAPE.search(data):
        return False
    try:
        json.dumps(document, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def loads_after_shape(data: bytes | str, shaped: Any) -> Any:
    """`loads(data)` for a caller that already has `loads_shape(data)`: orjson's reading is
    kept wherever `loads` would have kept it, so the document is not read twice."""
    if shaped is not None and _no_long_number(data):
        return shaped
    return json.loads(data)


def loads_shape(data: bytes | str) -> Any:
    """orjson's reading of `data`, without `loads`'s check for long digit runs (None where
    orjson refuses it), for a caller that takes from the result only strings, None and the
    shape of containers, and reads the document again with `loads` for anything else. The one
    document orjson accepts but reads differently from `json` has an integer beyond 64 bits
    (read as a float): no string, None or shape changes with it. A stream's text chunk is read
    so: the check cost about as much as orjson's read of the chunk itself."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: a lone surrogate, a huge integer, a foreign type
        return json.dumps(obj, separators=(",", ":")).encode()


def dumps_kept(obj: Any) -> bytes:
    """`dumps` for bytes that stay alive a while (an upstream request body, kept for its whole
    exchange: a stream's life). orjson's result keeps the buffer it was written into, 4 KiB at
    least and about 12 times a 10 KB document (tracemalloc), so it is copied to its own size:
    4 KiB of every in-flight stream's memory was that buffer."""
    return bytes(memoryview(dumps(obj)))


_WHITESPACE = b" \t\n\r"
_CLOSE = ord("}")


def dumps_appended(data: bytes, read: Mapping[str, Any], obj: Mapping[str, Any]) -> bytes | None:
    """`obj` written as `data`, the bytes orjson read as `read` (`loads_read`), when `obj` is
    `read` with members appended at its end, every other member kept in its place with a value
    the same object or one written alike (`1` and `true`, `1` and `1.0` are not alike): `data`
    itself, or its bytes with the appended members before its closing brace. None for any other
    `obj` (a member changed, moved or removed). The client's bytes already read as the document,
    so a long body is not written a second time."""
    if len(obj) < len(read):
        return None
    written = iter(obj.items())
    # (zip takes from `read` first: the appended members are left in `written`)
    for (name, value), (new_name, new_value) in zip(read.items(), written, strict=False):
        if name != new_name or not (value is new_value or _alike(value, new_value)):
            return None
    appended = dict(written)
    if not appended:
        return data
    end = len(data)
    while end and data[end - 1] in _WHITESPACE:
        end -= 1
    if not end or data[end - 1] != _CLOSE:
        return None
    members = dumps(appended)  # b'{"stream":true}': its members and the closing brace follow
    # (one copy of the client's bytes: a slice of them would be a second)
    return b"".join((memoryview(data)[:end - 1], b"," if read else b"", members[1:]))


def _alike(value: Any, other: Any) -> bool:
    """Written the same by orjson: equal as JSON, with the same types and member order."""
    if type(value) is str and type(other) is str:  # (the entry's model: the name asked for)
        return value == other
    try:
        return orjson.dumps(value) == orjson.dumps(other)
    except TypeError:
        return False
