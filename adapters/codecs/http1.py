"""HTTP/1.1's rules for a message head, as both sides of relayline write one: the gateway's
server its answers (`render_response_head`), the upstream client its requests (`is_token`,
`unsafe_request_value`). Pure: no socket, no event loop.

A header name is RFC 9110's token; a value never holds a CR, LF or NUL (as h11 checked them),
and a request's value sent upstream neither starts nor ends with a space or a tab."""

from __future__ import annotations

import re
from http import HTTPStatus

TOKEN = r"[-!#$%&'*+.^_`|~0-9A-Za-z]+"  # RFC 9110's token: a header name
is_token = re.compile(TOKEN).fullmatch  # (a name as text: the upstream client's)
is_token_bytes = re.compile(TOKEN.encode()).fullmatch  # (a name as bytes: the server's)
unsafe_request_value = re.compile(r"[\r\n\0]|^[ \t]|[ \t]$").search

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}

# the header names found tokens: an app's answers use a few dozen names, each checked once (the
# check over every line, a regex walking each byte of the head, was most of a head's render)
_TOKEN_NAMES: set[bytes] = set()
TOKEN_NAMES_MOST = 512  # an app that makes up names does not grow this without bound: the rest are checked each time


def render_response_head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """A response head, its header lines checked as h11 checked them (a token for each name, no
    CR, LF or NUL in a value); an app's bad header raises here. A value's CR, LF or NUL is found
    by counting them over all the lines at once: the lines are joined by CR LF, and a name (a
    token) and the ": " have none, so any more of either, or a NUL at all, is a value's. The
    lines are joined in C (`map`), not a Python expression a header."""
    names = _TOKEN_NAMES
    for name, _ in headers:  # (a pair each: anything else raises here, before the join reads it)
        if type(name) is not bytes or name not in names:  # (a bytearray is checked, never kept)
            if is_token_bytes(name) is None:
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
