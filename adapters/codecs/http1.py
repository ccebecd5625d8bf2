"""HTTP/1.1 heads as both sides of relayline write them: the gateway's server its answers
(`render_response_head`), the upstream client its requests to a provider (`UpstreamRequest`,
`render`, a profile's `FixedHead`), under one set of rules. Pure: no socket, no event loop.

A header name is RFC 9110's token; a value never holds a CR, LF or NUL (as h11 checked them),
and a request's value sent upstream neither starts nor ends with a space or a tab."""

from __future__ import annotations

import functools
import re
import urllib.parse
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version

import attrs

from .content_coding import ACCEPT_ENCODING

TOKEN = r"[-!#$%&'*+.^_`|~0-9A-Za-z]+"  # RFC 9110's token: a header name
is_token = re.compile(TOKEN).fullmatch  # (a name as text: the upstream client's)
is_token_bytes = re.compile(TOKEN.encode()).fullmatch  # (a name as bytes: the server's)
unsafe_request_value = re.compile(r"[\r\n\0]|^[ \t]|[ \t]$").search

REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
try:
    USER_AGENT = f"relayline/{version('relayline')}"
except PackageNotFoundError:  # a source tree that was never installed
    USER_AGENT = "relayline"

# the header names found tokens: an app's answers use a few dozen names, each checked once (the
# check over every line, a regex walking each byte of the head, was most of a head's render)
_TOKEN_NAMES: set[bytes] = set()
# an app that makes up names does not grow this without bound: the rest are checked each time
TOKEN_NAMES_MOST = 512


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


# -- a request to a provider ------------------------------------------------------------------


@attrs.frozen
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@functools.lru_cache(maxsize=512)
def split_url(url: str) -> tuple[Origin, str, str]:
    """A URL's origin, its Host header and its request target (cached: a profile has one)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("credentials in a provider's base_url are not sent: put them in its "
                         "api_key or headers")
    default = 443 if scheme == "https" else 80
    port = parts.port or default
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    host_header = host if port == default else f"{host}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(scheme, parts.hostname, port), host_header, target


_DEFAULT_HEADERS = (("accept", "*/*"), ("accept-encoding", ACCEPT_ENCODING),
                    ("user-agent", USER_AGENT))
_DEFAULT_LINES = "".join(f"{k}: {v}\r\n" for k, v in _DEFAULT_HEADERS)
_DEFAULTS = frozenset({"host", *dict(_DEFAULT_HEADERS)})
_FRAMING = frozenset({"content-length", "transfer-encoding"})  # this client's to write


@attrs.frozen(eq=False)
class FixedHead:
    """What every request of one profile (its URL, its own headers and key, the client headers
    that travel with it) has in common: its headers (lowercase names) and their lines, with the
    request line, the Host and the defaults, rendered and checked once (`fixed_head`). A request
    built on it (`UpstreamRequest.fixed`) has only what it adds checked and rendered: its
    x-request-id. `lines` is None when these headers cannot be sent: `render` then refuses them
    as it refuses any, naming the header."""

    url: str
    headers: dict[str, str] = attrs.field(repr=False)  # (the key's header is one: never in a repr)
    lines: str | None = attrs.field(repr=False)


@attrs.frozen
class UpstreamRequest:
    """A POST to a provider: what a protocol's `build()` returns. Header names are lowercase.
    `fixed`, when given, holds `url` and the lines of those of `headers` it has (`FixedHead`)."""

    url: str
    # the key's header is one of them: a repr (a traceback's locals, a debug line) names them only
    headers: dict[str, str] = attrs.field(repr=lambda headers: f"<{', '.join(headers)}>")
    body: bytes
    fixed: FixedHead | None = attrs.field(default=None, eq=False, repr=False)


def lowercase(headers: dict[str, str]) -> dict[str, str]:
    """Header names folded, so that a profile's `Authorization` and ours are one header."""
    return {name.lower(): value for name, value in headers.items()}


def fixed_head(url: str, headers: dict[str, str]) -> FixedHead:
    """The head a profile's requests share (`FixedHead`), its lines rendered and checked here."""
    headers = lowercase(headers)
    try:
        lines: str | None = _head_lines(url, headers)
    except ValueError:
        lines = None  # (refused where each request is rendered, as without a fixed head)
    return FixedHead(url, headers, lines)


def render(request: UpstreamRequest) -> bytes:
    """The request's head and body as one buffer (one send).

    The head is written here rather than by an HTTP library: h11 re-validated and re-encoded
    every header of every request (a large share of the client's CPU per request, cProfile),
    where these checks are one regex each, and a request built on its profile's `FixedHead`
    has only the headers it adds checked."""
    fixed = request.fixed
    lines = None
    if fixed is not None and fixed.lines is not None and request.url is fixed.url:
        lines = _added_to(fixed, request.headers)
    if lines is None:
        lines = _head_lines(request.url, request.headers)
    body = request.body
    return f"{lines}content-length: {len(body)}\r\n\r\n".encode("latin-1") + body


def _head_lines(url: str, given: dict[str, str]) -> str:
    """The request line and the header lines, each header checked (ValueError names one that
    cannot be sent)."""
    _, host, target = split_url(url)
    lines = [f"POST {target} HTTP/1.1\r\nhost: {host}\r\n"]
    if given.keys() & _DEFAULTS:  # a profile's own headers win over these defaults
        lines = [f"POST {target} HTTP/1.1\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in _DEFAULT_HEADERS if k not in given]
    else:
        lines.append(_DEFAULT_LINES)
    for name, value in given.items():
        if not is_token(name) or unsafe_request_value(value) or name in _FRAMING:
            raise ValueError(f"header {name!r} cannot be sent upstream (an illegal name or value, "
                             "or framing)")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


def _added_to(fixed: FixedHead, given: dict[str, str]) -> str | None:
    """The fixed head's lines and those of the headers `given` adds to it; None when `given`
    is not the fixed headers and additions (one of them replaced or missing, or an addition that
    is a default's or cannot be sent): the general path renders it, or refuses it."""
    static, lines = fixed.headers, fixed.lines
    if lines is None:
        return None
    added = []
    kept = 0
    for name, value in given.items():
        if static.get(name) is value:  # (the very string the fixed lines were rendered from)
            kept += 1
        elif (
            name in _DEFAULTS
            or not is_token(name)
            or unsafe_request_value(value)
            or name in _FRAMING
        ):
            return None
        else:
            added.append(f"{name}: {value}\r\n")
    if kept != len(static):  # (one was replaced, or is missing)
        return None
    return lines + "".join(added) if added else lines
