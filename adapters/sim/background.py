"""Loopback servers on a background thread, for the demo, the SDK tests, the examples and the
benchmarks: the official SDKs (and the example apps) are ordinary blocking clients or other
event loops, so the servers get a trio loop of their own and the caller keeps its thread.

    with BackgroundGateway(config_dict, replies) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="...")
    with BackgroundUpstreams(replies) as up:
        Relay(structure_config(up.wire(config_dict)))   # sim profiles now speak HTTP to `up`
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from relayline.machines.config import structure_config

from ..gateway import Gateway, serve
from ..gateway.auth import Access, KeyRing, load_access
from ..relay import Relay
from ..stores.ledger import LedgerStore
from .loopback import BackgroundTrio
from .server import SimHTTPServer, shape_by_alias, wire_to


class BackgroundUpstreams(BackgroundTrio):
    """Scripted sim upstreams over loopback HTTP (SimHTTPServer), for code that is not trio."""

    def __init__(self, replies: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__("relayline-upstreams")
        self.sim = SimHTTPServer(list(replies))

    async def _serve(self, nursery: trio.Nursery) -> None:
        await self.sim.start(nursery)

    def wire(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`config` with every sim profile pointed at these upstreams (anthropic.* profiles in
        the Anthropic shape, the others in the OpenAI one)."""
        return wire_to(config, self.sim, shape_by_alias)


class BackgroundGateway(BackgroundTrio):
    def __init__(self, config: Mapping[str, Any], replies: Sequence[Mapping[str, Any]] = (), *,
                 api_keys: set[str] | None = None, admin_keys: set[str] | None = None,
                 ledger_path: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        super().__init__("relayline-gateway")
        self.config = config
        self.replies = list(replies)
        self.access = Access(KeyRing.of(api_keys or ()), KeyRing.of(admin_keys or ()))
        self.ledger_path = ledger_path
        self.env = env or {}
        self.url = ""
        self.gateway: Gateway | None = None
        self.sim: SimHTTPServer | None = None
        self._relay: Relay | None = None

    async def _serve(self, nursery: trio.Nursery) -> None:
        self.sim = await SimHTTPServer(self.replies).start(nursery)
        config = structure_config(wire_to(self.config, self.sim, shape_by_alias))
        self._relay = Relay(config, env=self.env)
        ledger = LedgerStore(self.ledger_path) if self.ledger_path else None
        named = load_access(self._relay.config, self.env).clients  # the config's [[gateway.keys]]
        access = Access(KeyRing(self.access.clients.digests + named.digests), self.access.admins)
        gateway = self.gateway = Gateway(self._relay, access=access, ledger=ledger)
        binds = await nursery.start(
            lambda task_status: serve(gateway, port=0, task_status=task_status))
        self.url = binds[0]

    async def _close(self) -> None:
        if self._relay is not None:
            await self._relay.aclose()
