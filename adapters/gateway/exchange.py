"""One HTTP request as the gateway answers it: the `Exchange` around ASGI `send`, the request
id it echoes, and the plain answers every route writes through it (`respond`, `respond_json`)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from relayline.machines.turn import TurnResult

from .. import jsoncodec
from ..codecs.dialects import ANTHROPIC, OPENAI
from ..relay import Relay
from .auth import Caller
from .http11 import Message, Receive, Send

if TYPE_CHECKING:
    from .limits import Admitted

REQUEST_ID_SHAPE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Exchange:
    """One HTTP request as the access line and the metrics see it: a wrapper around ASGI `send`
    that notes the status and the first body byte, and echoes the request id. An answer sent
    before the request's body was read (401, 503 shed, 413, 408) says `connection: close`: the
    server will not serve that body, so the client must not reuse the connection. It first drains
    a small body, bounded in bytes and time: a socket closed with unread input is reset, and the
    reset can destroy the answer before the client has read it."""

    DRAIN_BYTES = 64 * 1024
    DRAIN_S = 0.5

    __slots__ = ("send", "dialect", "method", "path", "request_id", "started", "status",
                 "first_byte", "result", "client",
                 "drained", "turn", "unread_body", "receive", "sent", "declared_length", "hangup",
                 "body_here", "relay", "turn_started", "turn_ended", "query", "caller", "admission")

    def __init__(self, send: Send, method: str, path: str, request_id: str,
                 headers: dict[bytes, bytes], receive: Receive | None = None,
                 query: bytes = b"") -> None:
        self.send = send
        self.query = query  # the URL's query, shown in the access line
        # the server checked its shape
        length = headers.get(b"content-length", b"0").partition(b",")[0].strip()
        self.declared_length = int(length) if length.isdigit() else 0
        self.unread_body = self.declared_length > 0 or b"transfer-encoding" in headers
        # a client waiting for 100-continue has sent no body: an early answer reads none of it
        self.receive = None if headers.get(b"expect", b"").lower() == b"100-continue" else receive
        # every answer on the Anthropic route speaks Anthropic, errors included (docs/wire.md)
        # and GET /v1/models answers an Anthropic client (it sends anthropic-version) in Anthropic's
        # list shape
        self.dialect = ANTHROPIC if path.startswith("/v1/messages") or (
            path == "/v1/models" and b"anthropic-version" in headers) else OPENAI
        self.method = method
        self.path = path
        self.request_id = request_id
        self.started = trio.current_time()
        self.status: int | None = None
        self.first_byte: float | None = None
        self.sent = 0  # response body bytes
        self.result: TurnResult | None = None
        # the relay the turn ran on and the turn's start and end (trio's clock): what is observed
        # of it once the answer is out (bookkeeping.py)
        self.relay: Relay | None = None
        self.turn_started = self.turn_ended = 0.0
        self.client = ""
        self.caller: Caller | None = None  # who the client key says the caller is
        # the turn's admission against its key's and team's limits (limits.py)
        self.admission: Admitted | None = None
        self.drained = False
        self.turn: str | None = None
        # the server's call-back when the client hangs up (http11/), where it offers one
        self.hangup: Callable[[Callable[[], None]], None] | None = None
        # the server's word that the whole request body has arrived (http11/), where it offers it
        self.body_here: Callable[[], bool] | None = None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = [*message.get("headers", ()), (b"x-request-id", self.request_id.encode())]
            if self.admission is not None:  # the key's remaining limits, on every admitted answer
                headers += self.admission.headers()
            if self.unread_body and self.status != 408:
                await self._drain()
            if self.unread_body and not any(k == b"connection" for k, _ in headers):
                headers.append((b"connection", b"close"))
            message = {**message, "headers": headers}
        elif body := message.get("body"):
            self.sent += len(body)
            if self.first_byte is None:
                self.first_byte = trio.current_time()
        await self.send(message)

    async def _drain(self) -> None:
        """Read and discard what is left of a small request body, bounded in bytes and time."""
        if self.receive is None:
            return
        seen = 0
        with trio.move_on_after(self.DRAIN_S):
            while seen <= self.DRAIN_BYTES:
                message = await self.receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body"):
                    return


def request_id(headers: dict[bytes, bytes]) -> str:
    """The client's x-request-id when it is a plain token, else a new one: it is echoed, logged
    and sent upstream, so nothing a client sends reaches a log or a header unchecked."""
    given = headers.get(b"x-request-id")
    if given is not None:  # (most clients send none: no decode and no match for them)
        text = given.decode("latin-1")
        if REQUEST_ID_SHAPE.match(text):
            return text
    return os.urandom(16).hex()


async def respond(send: Send, status: int, body: bytes, *, content_type: str = "application/json",
                  headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """A whole answer in two ASGI messages: its head, then its body."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def respond_json(send: Send, status: int, obj: object,
                       headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await respond(send, status, jsoncodec.dumps(obj), headers=headers)
