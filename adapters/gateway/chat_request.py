"""A chat request read off the wire: its body (bounded in bytes and time), its JSON, the client
headers some entry may be sent, and the dialect's parse into the canonical request. Whatever is
wrong with it is the client's to hear, as a 4xx in its route's dialect."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

import trio

from relayline.machines import wire
from relayline.machines.plan import model_offered

from .. import jsoncodec
from ..providers.base import TRAVELLING
from .auth import CREDENTIAL_HEADERS, Access, credential_header
from .exchange import Exchange, respond
from .http11 import Receive, Scope

if TYPE_CHECKING:
    from relayline.machines.config import Config
    from relayline.machines.config import Gateway as GatewaySettings

    from ..codecs.dialects import Dialect
    from ..relay import Relay



class Reading(Protocol):
    """What reading a chat request needs of the gateway as it is now (a reload swaps each): its
    settings, the relay (which models are on offer), the access (whether client keys are on),
    and the header names some entry may be sent (`travelling_headers`)."""

    settings: GatewaySettings
    relay: Relay
    access: Access
    travelling: frozenset[bytes]


def travelling_headers(config: Config) -> frozenset[bytes]:
    """The client request header names some entry may be sent (providers/base.py): the families'
    own and every profile's `forward_headers`. Only these are decoded for a chat request."""
    named = {name.lower() for p in config.providers.values() for name in p.forward_headers}
    return frozenset(name.encode("latin-1") for name in TRAVELLING | named)


async def read_body(settings: GatewaySettings, receive: Receive, send: Exchange,
                    dialect: Dialect) -> bytes | None:
    """The whole request body, or None once it was answered: 413 past `max_body_bytes`, 408
    when it is slower than `body_timeout_s`, nothing when the client went away."""
    max_body = settings.max_body_bytes
    if send.declared_length > max_body:  # refused before a byte of it is read (or 100-continue'd)
        await respond(send, 413, dialect.http_error(
            413, f"request body larger than {max_body} bytes", "request_too_large"),
            headers=[(b"connection", b"close")])
        return None
    # the server may say the whole body is here (a small one comes with its head): then
    # receive() answers all of it without waiting, and no timer is needed
    here = send.body_here is not None and send.body_here()
    body = bytearray()  # (appended in place: `bytes +=` copies all that came before, each piece)
    with contextlib.nullcontext() if here else trio.move_on_after(settings.body_timeout_s):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > max_body:
                await respond(send, 413, dialect.http_error(
                    413, f"request body larger than {max_body} bytes", "request_too_large"),
                    headers=[(b"connection", b"close")])
                return None
            if not message.get("more_body"):
                send.unread_body = False
                return bytes(body)
    await respond(
        send,
        408,
        dialect.http_error(
            408,
            f"the request body did not arrive within {settings.body_timeout_s:g} s",
            "request_timeout",
        ),
        headers=[(b"connection", b"close")],
    )
    return None


async def read_request(now: Reading, dialect: Dialect, scope: Scope, receive: Receive,
                       send: Exchange) -> wire.Request | None:
    """The request a chat body asks for, or None once it was answered (a 4xx). Its own frame:
    the decoded headers are needed only here, and a stream's turn would otherwise keep them
    alive for the stream's whole life; the raw body lives on only in the passthrough's
    `wire.ReadBytes`, until the first upstream request is built."""
    raw = await read_body(now.settings, receive, send, dialect)
    if raw is None:
        return None
    try:
        body, encodable, exact = jsoncodec.loads_read(raw)
    except (ValueError, RecursionError):
        body, encodable, exact = wire.WireError("", "the body is not valid JSON"), True, False
    try:
        if isinstance(body, wire.WireError):
            raise body
        # only the headers some entry may be sent are decoded (`travelling_headers`; ASGI's
        # names are lowercase), never the one that carried the client's gateway key: a profile
        # naming `authorization` in forward_headers passes on a client's own provider key, not
        # the gateway's
        travelling = now.travelling
        if now.access.clients and not travelling.isdisjoint(CREDENTIAL_HEADERS):
            travelling = travelling - {credential_header(dict(scope.get("headers") or ()))}
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers") or ()
                   if k in travelling]
        query = scope.get("query_string")
        # the body goes on as the bytes it was read from wherever it goes on unchanged
        # (providers/base.py `body_bytes`): bytes only orjson read, strict JSON that reads back
        # as the body
        read = wire.ReadBytes(body, raw) if exact else None
        request = dialect.parse(body, headers, query.decode("latin-1") if query else "", read)
    except wire.WireError as error:
        await respond(send, *dialect.bad_request(error))
        return None
    except RecursionError:
        await respond(send,
                      *dialect.bad_request(wire.WireError("", "the body is nested too deeply")))
        return None
    if not encodable:
        await respond(send, *dialect.bad_request(wire.WireError(
            "",
            "the body contains a lone UTF-16 surrogate escape (such as \\ud800), which cannot be "
            "sent as UTF-8")))
        return None
    if request.model is None:
        await respond(send, *dialect.bad_request(wire.WireError(
            "model", "is required: name one of the models GET /v1/models lists")))
        return None
    if now.settings.unknown_models == "reject" and not model_offered(
        now.relay.router, request.model
    ):
        await respond(send, 404, dialect.http_error(
            404,
            f"the model {request.model!r} does not exist here: GET /v1/models lists the models on "
            "offer",
            "model_not_found"))
        return None
    return request
