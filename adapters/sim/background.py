"""A gateway and its loopback sim upstreams on a background thread, for the demo, the SDK tests
and the benchmarks: the official SDKs are ordinary blocking clients, so the server gets a trio
loop of its own and the caller keeps the main thread.

    with BackgroundGateway(config_dict, replies) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="...")
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import trio

from relayline.machines.config import structure_config

from ..gateway import Gateway, serve
from ..gateway.auth import Access, KeyRing
from ..relay import Relay
from ..stores.ledger import LedgerStore
from .server import SimHTTPServer, shape_by_alias, wire_to


class BackgroundGateway:
    def __init__(self, config: Mapping, replies: Sequence[Mapping] = (), *, api_keys: set[str] | None = None,
                 admin_keys: set[str] | None = None, ledger_path: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.replies = list(replies)
        self.access = Access(KeyRing.of(api_keys or ()), KeyRing.of(admin_keys or ()))
        self.ledger_path = ledger_path
        self.env = env or {}
        self.url = ""
        self.gateway: Gateway | None = None
        self.sim: SimHTTPServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="relayline-gateway", daemon=True)

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
            self.sim = await SimHTTPServer(self.replies).start(nursery)
            relay = Relay(structure_config(wire_to(self.config, self.sim, shape_by_alias)), env=self.env)
            ledger = LedgerStore(self.ledger_path) if self.ledger_path else None
            self.gateway = Gateway(relay, access=self.access, ledger=ledger)
            binds = await nursery.start(lambda task_status: serve(self.gateway, port=0, task_status=task_status))
            self.url = binds[0]
            self._ready.set()
            await self._stop.wait()
            await relay.aclose()
            nursery.cancel_scope.cancel()

    def __enter__(self) -> BackgroundGateway:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the gateway did not start within 30 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc_info) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)


class BackgroundSim:
    """Only the loopback sim upstreams, on a background thread: for a gateway run as its own
    process (`relayline serve`), as an operator runs it."""

    def __init__(self, replies: Sequence[Mapping] = ()) -> None:
        self.replies = list(replies)
        self.sim: SimHTTPServer | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=lambda: trio.run(self._main), name="relayline-sim", daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.sim = await SimHTTPServer(self.replies).start(nursery)
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def wire(self, config: Mapping) -> dict:
        """`config` with its sim profiles pointed at these upstreams."""
        return wire_to(config, self.sim, shape_by_alias)

    def __enter__(self) -> BackgroundSim:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the sim upstreams did not start within 30 s")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(30)
