"""The httpx path of a profile's pool: for profiles behind a proxy the environment names (httpx
honours HTTP(S)_PROXY, ALL_PROXY and NO_PROXY; the lean client in upstream.py does not speak
CONNECT), and for every profile under RELAYLINE_UPSTREAM_CLIENT=httpx (an operator's way back,
and the benchmarks' baseline). It is the pool relayline had before its own client, unchanged.

Why shards: httpcore 1.0.9 (the newest 1.x, which httpx 0.28 requires) re-examines every
connection of a pool for every idle one on each request and each response close, which is
quadratic in the pool's size: at 1,000 concurrent turns on one pool that scan was 92.6% of the
gateway's CPU, and 5,000 streams on one client spin the process for minutes. Small shards keep
each scan short and keep every connection they open alive (their keep-alive bound equals their
size). A request takes the shard that most recently had a free slot (a stack: O(1), warm
connections first); a new shard opens only when every shard is full. httpcore closes an expired
connection only when its own pool is next used, so once per keep-alive period the shards no
request took for that long are closed.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import trio

from ..codecs.http1 import UpstreamRequest
from .base import AttemptClockLike
from .upstream import UpstreamError

SHARD_CONNECTIONS = 8  # httpcore's scan is quadratic in this: at 8, ~64 checks per pool event


def new_client(connections: int, verify: ssl.SSLContext | bool,
               keepalive_s: float) -> httpx.AsyncClient:
    # timeouts are the driver's cancel scopes (headers_s, first_token_s, idle_s, total_s); httpx's
    # own are a backstop so that a socket can never hang a worker forever. trust_env: proxies
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                          keepalive_expiry=keepalive_s)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0),
                             verify=verify,
                             follow_redirects=False, trust_env=True)


@attrs.define(eq=False)
class _Shard:
    client: httpx.AsyncClient
    size: int  # its max_connections
    busy: int = 0  # requests holding one of its connections (response not yet closed)
    used: float = 0.0  # when a request last took it (trio.current_time)


class HttpxPool:
    """One profile's httpx clients, sharded (see the module's docstring)."""

    def __init__(self, max_connections: int | None, verify: ssl.SSLContext | bool,
                 keepalive_s: float) -> None:
        # connections no shard holds yet
        self.unopened = max_connections if max_connections else math.inf
        self.verify = verify
        self.keepalive_s = keepalive_s
        self.shards: list[_Shard] = []
        self.roomy: list[_Shard] = []  # shards with a free slot, the most recently freed last
        self.swept = 0.0

    @asynccontextmanager
    async def exchange(self, request: UpstreamRequest, clock: AttemptClockLike | None
                       ) -> AsyncIterator[HttpxResponse]:
        """As ProfilePool.exchange: the response once its head arrived, closed on exit."""
        async with self.lease() as client:
            http_request = client.build_request("POST", request.url, content=request.body,
                                                headers=request.headers)
            if clock is not None:
                async def trace(event: str, info: dict[str, Any]) -> None:
                    if event.endswith(".send_request_body.complete"):
                        clock.sent()

                http_request.extensions["trace"] = trace
            try:
                response = await client.send(http_request, stream=True)
            except httpx.TransportError:
                raise UpstreamError("could not connect, or no response (httpx)") from None
            if clock is not None:
                clock.headers()
            try:
                yield HttpxResponse(response)
            finally:
                await response.aclose()  # unread bytes (a refused body) close the connection

    @asynccontextmanager
    async def lease(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client to send one request on; hold the lease until the response is closed."""
        now = trio.current_time()
        if now - self.swept > self.keepalive_s:
            await self._sweep(now)
        shard = self._acquire()
        shard.used = now
        try:
            yield shard.client
        finally:
            shard.busy -= 1
            if shard.busy == shard.size - 1:
                self.roomy.append(shard)

    def _acquire(self) -> _Shard:
        if not self.roomy:
            # at the bound: httpcore queues the request in the least busy shard
            if self.unopened <= 0:
                shard = min(self.shards, key=lambda s: s.busy)
                shard.busy += 1
                return shard
            size = int(min(SHARD_CONNECTIONS, self.unopened))
            self.unopened -= size
            shard = _Shard(new_client(size, self.verify, self.keepalive_s), size)
            self.shards.append(shard)
            self.roomy.append(shard)
        shard = self.roomy[-1]
        shard.busy += 1
        if shard.busy == shard.size:
            self.roomy.pop()
        return shard

    async def _sweep(self, now: float) -> None:
        self.swept = now
        cold = [
            shard
            for shard in self.shards
            if shard.busy == 0 and now - shard.used > self.keepalive_s
        ]
        if not cold:
            return
        for shard in cold:
            self.shards.remove(shard)
            self.roomy.remove(shard)  # idle, so it has room, so it is on the stack
            self.unopened += shard.size
        with trio.CancelScope(shield=True):  # closing idle sockets does not wait on the network
            for shard in cold:
                await shard.client.aclose()

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.client.aclose()
        self.shards.clear()
        self.roomy.clear()


class HttpxResponse:
    """An httpx response with upstream.Response's surface (status, headers, decoded body pieces,
    `complete`), so the provider code has one path."""

    __slots__ = ("raw", "status", "headers", "content_length", "complete")

    def __init__(self, raw: httpx.Response) -> None:
        self.raw = raw
        self.status = raw.status_code
        self.headers = raw.headers
        self.content_length = raw.headers.get("content-length")
        self.complete = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self.raw.aiter_bytes():
                yield piece
        except httpx.TransportError:
            raise UpstreamError("connection lost while reading the response") from None
        self.complete = True
