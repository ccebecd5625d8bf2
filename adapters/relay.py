"""The embedder's API: `Relay`, `Reply` and `StreamTurn`.

    relay = Relay.from_file("relayline.toml")
    reply = await relay.complete(messages, model="hint:fast")
    async with relay.stream(messages) as turn:
        async for event in turn: ...
    turn.outcome

A Relay owns the router (config materialised once), the health store shared by its turns, and
the protocol adapters. Every turn, library or gateway or simulator, runs through `run_turn`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import trio

from relayline.machines.config import Config, parse_config
from relayline.machines.effort import RouteSelection
from relayline.machines.errors import StreamInterruptedAfterOutput, TurnError
from relayline.machines.families import FAMILIES
from relayline.machines.health import HealthStore, InMemoryHealth
from relayline.machines.ledger import LedgerRow
from relayline.machines.plan import Plan, build_router, plan_turn
from relayline.machines.stream import Event
from relayline.machines.turn import Turn, TurnResult

from .driver import Sink, TurnRun, _discard
from .providers.base import ProviderClient
from .providers.http import new_client
from .redact import protect

if TYPE_CHECKING:
    import httpx

    from .sim.provider import SimUpstream

log = logging.getLogger("relayline")


def turn_text(messages: Sequence[Mapping]) -> str:
    """The user's turn text: the last user message's text content."""
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content", "")
            if isinstance(content, str):
                return content
            return " ".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return ""


@attrs.frozen
class Reply:
    text: str
    tool_calls: tuple[str, ...]
    reasoning: str
    requested: str
    served: str
    notice: str | None
    fallback: bool
    ledger: tuple[LedgerRow, ...]
    cost_usd: float
    result: TurnResult = attrs.field(repr=False)

    @property
    def outbound_text(self) -> str:
        """What a user sees: the reply, then the notice. History keeps `text` alone."""
        return f"{self.text}\n\n{self.notice}" if self.notice else self.text


def raise_for(result: TurnResult) -> None:
    if result.outcome == "ok":
        return
    if result.outcome == "interrupted":
        raise StreamInterruptedAfterOutput(result.message or "interrupted", attempts=result.attempts,
                                           partial_text=result.partial_text or "")
    raise TurnError(result.message or result.error or "failed", reason=result.error or "exhausted",
                    attempts=result.attempts, partial_text=result.partial_text)


class Relay:
    def __init__(
        self,
        config: Config,
        *,
        env: Mapping[str, str] | None = None,
        health: HealthStore | None = None,
        clients: Mapping[str, ProviderClient] | None = None,
        sim: SimUpstream | None = None,
    ) -> None:
        self.config = config
        self.router = build_router(config, os.environ if env is None else env)
        protect(key.reveal() for keys in self.router.keys.values() for key in keys)
        protect(d.root_keys[0].reveal() for d in self.router.domains.values() if d.root_keys)
        for warning in self.router.warnings:
            log.warning("config_warning code=%s path=%s", warning.code, warning.path)
        self.health = health if health is not None else InMemoryHealth(config.breaker)
        self.sim = sim  # the scripted upstreams of the sim family (scenarios, tests)
        self._http: httpx.AsyncClient | None = None
        self.clients: dict[str, ProviderClient] = dict(clients or {})
        for name in sorted({p.family for p in config.providers.values()} & set(FAMILIES) - set(self.clients)):
            module, _, factory = FAMILIES[name].adapter.partition(":")
            self.clients[name] = getattr(importlib.import_module(module), factory)(self)
        self.selection = RouteSelection()
        self.fallback_record: dict[str, str] = {}  # domain -> served label while a fallback serves
        self.observers: list[Callable[[TurnResult], None]] = []
        self.turn_factory: Callable[..., Turn] = Turn  # tests plug faulty machines in here

    def http_client(self) -> httpx.AsyncClient:
        """One pooled HTTP client for every profile: connections are reused across turns."""
        if self._http is None:
            self._http = new_client()
        return self._http

    async def aclose(self) -> None:
        """Close pooled connections. `async with Relay(...) as relay:` does it for you."""
        if self._http is not None:
            await self._http.aclose()

    async def __aenter__(self) -> Relay:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    @classmethod
    def from_toml(cls, text: str, **kwargs) -> Relay:
        return cls(parse_config(text), **kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> Relay:
        return cls.from_toml(Path(path).read_text(encoding="utf-8"), **kwargs)

    # -- routing ownership --------------------------------------------------------------------

    def select(self, model: str) -> None:
        """An explicit operator selection for this relay's scope; "auto" restores effort routing."""
        self.selection = self.selection.select(model)

    def model_switch(self, model: str) -> None:
        """A model-emitted switch: changes the active model, not who owns the route."""
        self.selection = self.selection.model_switch(model)

    def plan(self, *, model: str | None = None, text: str = "", operator_model: str | None = None,
             gateway: bool = False) -> Plan:
        plan = plan_turn(self.router, model=model, text=text, operator_model=operator_model,
                         selection=self.selection, gateway=gateway)
        if plan.effort is not None:
            log.info("effort_decision level=%s hint=%s score=%d", plan.effort.level, plan.effort.hint, plan.effort.score)
        return plan

    # -- turns --------------------------------------------------------------------------------

    async def run_turn(
        self,
        messages: Sequence[Mapping],
        *,
        model: str | None = None,
        tools: Sequence[Mapping] = (),
        operator_model: str | None = None,
        stream: bool = False,
        sink: Sink = _discard,
        on_draft: Callable[[str], None] | None = None,
        gateway: bool = False,
        run_hook: Callable[[TurnRun], None] | None = None,
    ) -> TurnResult:
        """Run one turn to its result. Cancellation is recorded on the result and re-raised."""
        plan = self.plan(model=model, text=turn_text(messages), operator_model=operator_model, gateway=gateway)
        turn = self.turn_factory(plan, self.config, self.health, stream=stream, tools=bool(tools))
        run = TurnRun(turn, self.clients, tuple(messages), tools=tuple(tools), on_draft=on_draft)
        if run_hook is not None:
            run_hook(run)
        try:
            return await run.run(sink)
        finally:
            if run.result is not None:
                self._observe(run.result)

    def _observe(self, result: TurnResult) -> None:
        if result.outcome == "ok":
            domain = result.requested.split("/", 1)[0]
            if result.fallback:
                self.fallback_record[domain] = result.served.label
            else:
                self.fallback_record.pop(domain, None)  # a later primary success clears the record
        log.info("turn outcome=%s error=%s requested=%s served=%s attempts=%d cost_usd=%.8f",
                 result.outcome, result.error, result.requested,
                 result.served.label if result.served else "none", len(result.attempts), result.cost_usd)
        for observer in self.observers:
            observer(result)

    async def complete(self, messages: Sequence[Mapping], *, model: str | None = None,
                       tools: Sequence[Mapping] = (), operator_model: str | None = None) -> Reply:
        """One non-streaming turn. Raises TurnError (with a reason class) when no answer came."""
        result = await self.run_turn(messages, model=model, tools=tools, operator_model=operator_model)
        raise_for(result)
        return Reply(
            text=result.text or "",
            tool_calls=result.tool_calls,
            reasoning=result.reasoning,
            requested=result.requested,
            served=result.served.label,
            notice=result.notice,
            fallback=result.fallback,
            ledger=result.ledger,
            cost_usd=result.cost_usd,
            result=result,
        )

    def stream(self, messages: Sequence[Mapping], *, model: str | None = None, tools: Sequence[Mapping] = (),
               operator_model: str | None = None, on_draft: Callable[[str], None] | None = None) -> StreamTurn:
        return StreamTurn(self, messages, model=model, tools=tools, operator_model=operator_model, on_draft=on_draft)


class StreamTurn:
    """A streamed turn. Iterating yields immutable events only (text, reasoning, tool calls);
    leaving the block early cancels the turn (never a retry). After the block: `outcome`,
    `partial_text`, `served`, `ledger`, `notice`, `result`."""

    def __init__(self, relay: Relay, messages, **kwargs) -> None:
        self._relay = relay
        self._messages = messages
        self._kwargs = kwargs
        self._run: TurnRun | None = None
        self._scope = trio.CancelScope()

    async def __aenter__(self) -> StreamTurn:
        self._send, self._receive = trio.open_memory_channel[Event](0)  # unbuffered: forwarded == received
        self._nursery_manager = trio.open_nursery()
        nursery = await self._nursery_manager.__aenter__()
        nursery.start_soon(self._produce)
        return self

    async def _produce(self) -> None:
        async with self._send:
            with self._scope:
                await self._relay.run_turn(self._messages, stream=True, sink=self._sink,
                                           run_hook=self._attach, **self._kwargs)

    def _attach(self, run: TurnRun) -> None:
        self._run = run

    async def _sink(self, event: Event) -> None:
        if event.visible:
            await self._send.send(event)

    def cancel(self) -> None:
        self._scope.cancel()

    def __aiter__(self) -> StreamTurn:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    async def __aexit__(self, *exc_info) -> bool | None:
        self._scope.cancel()  # a no-op when the turn already finished
        try:
            return await self._nursery_manager.__aexit__(*exc_info)
        finally:
            self._receive.close()

    # -- after the block ------------------------------------------------------------------------

    @property
    def result(self) -> TurnResult | None:
        """Set however the turn ended: a cancelled turn's outcome is recorded before it unwinds."""
        return self._run.result if self._run else None

    @property
    def outcome(self) -> str | None:
        return self.result.outcome if self.result else None

    @property
    def partial_text(self) -> str | None:
        return self.result.partial_text if self.result else None

    @property
    def served(self) -> str | None:
        return self.result.served.label if self.result and self.result.served else None

    @property
    def ledger(self) -> tuple[LedgerRow, ...]:
        return self.result.ledger if self.result else ()

    @property
    def notice(self) -> str | None:
        return self.result.notice if self.result else None
