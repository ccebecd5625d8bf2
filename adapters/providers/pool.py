"""Upstream connection pools: one per provider profile, each sharded into small httpx clients.

Why shards: httpcore 1.0.9 (the newest 1.x, which httpx 0.28 requires) re-examines every
connection of a pool for every idle one on each request and each response close, which is
quadratic in the pool's size. At 1,000 concurrent turns on one pool that scan was 92.6% of the
gateway's CPU, and a pool holding more connections than `max_keepalive_connections` closed idle
connections that the next turn then had to re-open (13,035 connections for 36,536 requests).
Small shards keep each scan short, keep every connection they open alive (their keep-alive
bound equals their size), and httpx stays the client API: a shard is an ordinary AsyncClient.

Why per profile: one profile's burst must not evict another profile's warm connections, and a
profile's connections are its own to count and to bound.

Sizing: a turn holds at most one upstream connection at a time, so a profile never needs more
connections than turns in flight. `[gateway] max_in_flight` (when set) bounds each profile's
pool; otherwise the pool grows with demand (the process's file-descriptor limit is the bound),
because a cap below the turns in flight only moves the queue from the gateway into the pool.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import trio

SHARD_CONNECTIONS = 8  # httpcore's scan is quadratic in this: at 8, ~64 checks per pool event
KEEPALIVE_S = 30.0  # an idle connection is closed after this (providers drop theirs at ~60 s)


def new_client(connections: int = SHARD_CONNECTIONS, verify: ssl.SSLContext | bool = True,
               keepalive_s: float = KEEPALIVE_S) -> httpx.AsyncClient:
    # timeouts are the driver's cancel scopes (headers_s, first_token_s, idle_s, total_s); httpx's
    # own are a backstop so that a socket can never hang a worker forever
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                          keepalive_expiry=keepalive_s)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0), verify=verify,
                             follow_redirects=False)


@attrs.define(eq=False)
class _Shard:
    client: httpx.AsyncClient
    size: int  # its max_connections
    busy: int = 0  # requests holding one of its connections (response not yet closed)
    used: float = 0.0  # when a request last took it (trio.current_time)


class ProfilePool:
    """One profile's connections. A request takes the shard that most recently had a free slot
    (a stack of shards with room: O(1), and the warm connections of a quiet profile are the ones
    reused); a new shard opens only when every shard is full.

    httpcore closes an expired connection only when its own pool is next used, and the stack
    leaves the shards a burst opened unused afterwards: so once per keep-alive period the shards
    no request took for that long are closed (after 5,000 streams, 5,000 sockets and their
    memory would otherwise stay until exit)."""

    def __init__(self, max_connections: int | None = None, verify: ssl.SSLContext | bool = True,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.unopened = max_connections if max_connections else math.inf  # connections no shard holds yet
        self.verify = verify
        self.keepalive_s = keepalive_s
        self.shards: list[_Shard] = []
        self.roomy: list[_Shard] = []  # shards with a free slot, the most recently freed last
        self.swept = 0.0

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
            if self.unopened <= 0:  # at the bound: httpcore queues the request in the least busy shard
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
        cold = [shard for shard in self.shards if shard.busy == 0 and now - shard.used > self.keepalive_s]
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


class Pools:
    """Every profile's pool, opened on first use; one TLS context shared by all of them (building
    one reads the CA bundle: tens of milliseconds and a few hundred KiB each)."""

    def __init__(self, max_connections: int | None = None) -> None:
        self.max_connections = max_connections or None
        self.verify = httpx.create_ssl_context()
        self.profiles: dict[str, ProfilePool] = {}

    def profile(self, name: str) -> ProfilePool:
        pool = self.profiles.get(name)
        if pool is None:
            pool = self.profiles[name] = ProfilePool(self.max_connections, self.verify)
        return pool

    async def aclose(self) -> None:
        for pool in self.profiles.values():
            await pool.aclose()
        self.profiles.clear()
