"""A small HTTP/1.1 server for loopback upstreams (trio + h11, no framework).

It stands in for providers in tests, the demo and benchmarks, so it must be exact rather than
featureful: each request is answered by an async `handler(request) -> Reply` whose body pieces
are written one chunk each (a test decides where the bytes split), may pause between pieces,
and may end cleanly or drop the connection mid-response. It binds 127.0.0.1 only.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Self

import attrs
import h11
import trio


@attrs.frozen
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    connection: int = 0  # which accepted connection carried it (1, 2, ...): reuse is countable
    raw: bytes = attrs.field(default=b"", eq=False, repr=False)  # the body's bytes, as received


@attrs.frozen
class Reply:
    status: int = 200
    headers: tuple[tuple[str, str], ...] = (("content-type", "text/event-stream"),)
    pieces: tuple[bytes | float, ...] = ()  # a float is a pause, in seconds, between pieces
    end: bool = True  # False: drop the connection after the pieces, mid-response
    delay: float = 0.0  # before the headers (math.inf: never answer)
    refuse: bool = False  # close the connection before any response byte


class LoopbackServer:
    def __init__(self, handler: Callable[[Seen], Reply | Awaitable[Reply]]) -> None:
        self.handler = handler
        self.seen: list[Seen] = []
        self.port = 0
        self.accepted = 0
        self.closed = 0  # connections ended, by either side

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(partial(trio.serve_tcp, self._serve, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        self.accepted += 1
        number = self.accepted
        try:
            while True:
                request, body = await self._read(conn, stream)
                if request is None:
                    return
                headers = {k.decode().lower(): v.decode() for k, v in request.headers}
                seen = Seen(request.method.decode(), request.target.decode(), headers,
                            json.loads(body) if body else None, number, bytes(body))
                self.seen.append(seen)
                reply = self.handler(seen)
                if inspect.isawaitable(reply):
                    reply = await reply
                if reply.delay:
                    await trio.sleep(reply.delay)
                if reply.refuse:
                    return
                out_headers = [*reply.headers, ("transfer-encoding", "chunked")]
                head = h11.Response(status_code=reply.status, headers=out_headers)
                await stream.send_all(conn.send(head))
                for piece in reply.pieces:
                    if isinstance(piece, float | int):
                        await trio.sleep(piece)
                    elif piece:
                        await stream.send_all(conn.send(h11.Data(data=piece)))
                if not reply.end:
                    return
                await stream.send_all(conn.send(h11.EndOfMessage()))
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            self.closed += 1
            await stream.aclose()

    async def _read(self, conn: h11.Connection, stream: trio.SocketStream
                    ) -> tuple[h11.Request | None, bytes]:
        request, body = None, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data and request is None:
                    return None, b""
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""


def sse_events(text: bytes) -> list[bytes]:
    """A transcript split into its events (each ending with its blank line)."""
    parts = text.replace(b"\r\n", b"\n").split(b"\n\n")
    return [p + b"\n\n" for p in parts if p.strip()]


class BackgroundTrio:
    """A trio run on a daemon thread that serves until the `with` block ends."""

    def __init__(self, name: str) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced to the caller by __enter__
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await self._serve(nursery)
            self._ready.set()
            await self._stop.wait()
            await self._close()
            nursery.cancel_scope.cancel()

    async def _serve(self, nursery: trio.Nursery) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        pass

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"{self._thread.name} did not start within 30 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)


class BackgroundLoopback(BackgroundTrio):
    """A LoopbackServer answering with `handler` on a trio loop of its own, for blocking callers
    (the SDKs, tests and benches that are not trio)."""

    def __init__(self, handler: Callable[[Seen], Reply | Awaitable[Reply]],
                 name: str = "relayline-upstream") -> None:
        super().__init__(name)
        self.server = LoopbackServer(handler)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def seen(self) -> list[Seen]:
        """Every request the server has read, in order; a caller may clear it between checks."""
        return self.server.seen

    async def _serve(self, nursery: trio.Nursery) -> None:
        await self.server.start(nursery)
