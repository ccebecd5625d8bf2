"""The embedder's API: `Relay`, `Reply` and `StreamTurn`, from trio, asyncio or plain threads.

    relay = Relay.from_file("relayline.toml")
    reply = await relay.complete(messages, model="hint:fast")      # trio or asyncio
    reply = relay.complete_sync(messages, model="hint:fast")       # synchronous code
    async with relay.stream(messages) as turn:                     # `with relay.stream_sync(...)`
        async for event in turn: ...
    turn.outcome

A Relay owns the router (config materialised once), the health store its turns consult (pass
one to several relays to share breakers and cooldowns), and the protocol adapters. Every turn,
library or gateway or simulator, runs through the relay's `Turns` (turns.py; `turns_of(relay)`
from outside, kept off the embedder's surface) in a trio run: the caller's own under trio,
relayline's runtime thread (adapters/hosts.py) under asyncio or from synchronous code; a
streamed one is read through its `StreamTurn` (stream_turn.py).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs

from relayline.machines import wire
from relayline.machines.config import Config, parse_config
from relayline.machines.effort import RouteSelection
from relayline.machines.families import FAMILIES
from relayline.machines.health import HealthStore, InMemoryHealth
from relayline.machines.ledger import LedgerRow, Usage
from relayline.machines.plan import Plan, build_router, plan_turn
from relayline.machines.turn import TurnResult

from .codecs import responses as responses_codec
from .codecs.embeddings import parse_request as parse_embeddings
from .codecs.openai_chat import KNOWN
from .configfile import load_config_file
from .hosts import (
    host,
    require_sync_host,
    run_from_thread,
    run_in_host,
)
from .providers.base import ProviderClient
from .providers.pool import Pools
from .redact import protect
from .stream_turn import StreamTurn
from .turns import Turns, raise_for, response_object, wire_request

log = logging.getLogger("relayline")

P = ParamSpec("P")
T = TypeVar("T")

def open_health(config: Config) -> HealthStore:
    """The health store a config names: in memory (each process alone), or Redis (a fleet)."""
    if config.health.store == "memory":
        # a probe is leased for as long as its turn may live: no turn that died holds it longer
        return InMemoryHealth(config.breaker, config.timeouts.total_s)
    from .stores.health import RedisHealth

    return RedisHealth(config.health, config.breaker)


# the request parameters `complete` and `stream` take by name: those the canonical request holds,
# translated for each entry's family; a provider's own fields travel in `extra_body`, by name
PARAMETERS = frozenset(KNOWN - {"model", "messages", "stream", "stream_options", "n", "tools"})
# what `extra_body` may not set: each has its own argument
_ARGUMENTS = frozenset({"model", "messages", "stream", "tools"})


def check_parameters(call: str, params: Mapping[str, Any],
                     extra_body: Mapping[str, Any] | None) -> None:
    """A misspelled keyword is the caller's mistake, not a field for the provider: TypeError
    naming it (and the parameter it is closest to), as for any Python call."""
    for name in params:
        if name not in PARAMETERS:
            close = difflib.get_close_matches(name, sorted(PARAMETERS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}{hint} "
                            f"(a provider's own fields go in extra_body={{{name!r}: ...}})")
    if extra_body is None:
        return
    if not isinstance(extra_body, Mapping):
        raise TypeError(f"{call}(): extra_body must be a mapping of field names to values")
    taken = sorted(_ARGUMENTS & set(extra_body))
    if taken:
        raise TypeError(f"{call}(): extra_body may not set {', '.join(taken)}: pass each as its "
                        "own argument")


def check_parameters_as(call: str, method: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """`method`'s keyword check under the name the caller used (`complete_sync` runs `complete`):
    the TypeError names the method called, as Python's own would."""
    named = {
        name
        for name, p in inspect.signature(method).parameters.items()
        if p.kind is not p.VAR_KEYWORD
    }
    check_parameters(call, {k: v for k, v in kwargs.items() if k not in named},
                     kwargs.get("extra_body"))


def responses_request(body: Mapping[str, Any]) -> wire.Request:
    """A Responses API request body as the request of a turn: `input` (a string or items:
    messages, function_call, function_call_output, reasoning), `instructions`, `tools`,
    `tool_choice`, `max_output_tokens`, `temperature`, `top_p`, `text.format`, `reasoning`,
    `metadata`... read as the gateway's `/v1/responses` reads them, and served the same way:
    an openai profile with `capabilities.responses` is sent the body as given, every other entry
    a translation. The model and streaming are the call's (`complete(..., model=...)`,
    `stream(...)`), so `model` and `stream` in the body are a TypeError. A field of the wrong
    shape raises WireError naming it."""
    taken = sorted({"model", "stream"} & set(body))
    if taken:
        raise TypeError(f"responses_request(): {', '.join(taken)} is the call's: pass model= to "
                        "complete() or "
                        "stream(), and call stream() for a streamed turn")
    return responses_codec.parse_request(dict(body))


@attrs.frozen
class Embeddings:
    """An embeddings answer: one vector per input, in order (a list of floats, or base64 text
    when asked), and who served it."""

    vectors: tuple[list[float] | str, ...]
    served: str
    requested: str
    fallback: bool
    input_tokens: int
    cost_usd: float
    ledger: tuple[LedgerRow, ...] = ()

    @classmethod
    def of(cls, result: TurnResult) -> Embeddings:
        assert result.served is not None  # an accepted answer always has a server
        items = sorted(result.vectors, key=lambda v: v.get("index", 0))
        return cls(vectors=tuple(v["embedding"] for v in items), served=result.served.label,
                   requested=result.requested, fallback=result.fallback,
                   input_tokens=(result.usage or Usage()).input_tokens, cost_usd=result.cost_usd,
                   ledger=result.ledger)


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
    # canonical: stop, stop_sequence, length, tool_calls, content_filter, pause_turn
    finish_reason: str = wire.STOP
    tool_call_ids: tuple[str, ...] = ()  # as the provider sent them ("" where it sent none)
    tool_arguments: tuple[str, ...] = ()  # JSON text, aligned with tool_calls
    usage: Usage = Usage()  # input, output, cache read/write and reasoning tokens of the answer
    request: wire.Request | None = attrs.field(default=None, repr=False, eq=False)  # what was asked

    @classmethod
    def of(cls, result: TurnResult, request: wire.Request | None = None) -> Reply:
        assert result.served is not None  # an accepted answer always has a server
        return cls(text=result.text or "", tool_calls=result.tool_calls, reasoning=result.reasoning,
                   requested=result.requested, served=result.served.label, notice=result.notice,
                   fallback=result.fallback, ledger=result.ledger, cost_usd=result.cost_usd,
                   result=result,
                   finish_reason=wire.finish_reason(result.finish_reason, len(result.tool_calls)),
                   tool_call_ids=result.tool_ids, tool_arguments=result.tool_arguments,
                   usage=result.usage or Usage(), request=request)

    def response(self) -> dict[str, Any]:
        """This answer as the Responses API's `response` object, as the gateway's `/v1/responses`
        renders it (see `response_object`)."""
        return response_object(self.result, self.request)

    @property
    def outbound_text(self) -> str:
        """What a user sees: the reply, then the notice. History keeps `text` alone."""
        return f"{self.text}\n\n{self.notice}" if self.notice else self.text


def _blocking(method: Callable[Concatenate[Relay, P], Awaitable[T]],
              name: str) -> Callable[Concatenate[Relay, P], T]:
    """An async Relay method as a blocking one for synchronous code (scripts, thread-based
    servers), run in the runtime; safe from many threads at once. It takes exactly what the
    async method takes, so a parameter added there flows through."""

    @functools.wraps(method)
    def blocking(self: Relay, /, *args: P.args, **kwargs: P.kwargs) -> T:
        require_sync_host(f"Relay.{name}")
        check_parameters_as(name, method, kwargs)
        return run_from_thread(partial(method, self, *args, **kwargs))

    blocking.__name__ = blocking.__qualname__ = name
    blocking.__doc__ = (
        f"`{method.__name__}` for synchronous code: blocks this thread until it returns."
    )
    return blocking


def _renamed(method: Callable[Concatenate[Relay, P], T],
             name: str) -> Callable[Concatenate[Relay, P], T]:
    """`method` under another name, its keyword mistakes named as the caller wrote the call."""

    @functools.wraps(method)
    def renamed(self: Relay, /, *args: P.args, **kwargs: P.kwargs) -> T:
        check_parameters_as(name, method, kwargs)
        return method(self, *args, **kwargs)

    renamed.__name__ = renamed.__qualname__ = name
    return renamed


class Relay:
    def __init__(
        self,
        config: Config,
        *,
        env: Mapping[str, str] | None = None,
        health: HealthStore | None = None,
        clients: Mapping[str, ProviderClient] | None = None,
    ) -> None:
        self.config = config
        self.router = build_router(config, os.environ if env is None else env)
        protect(key.reveal() for keys in self.router.keys.values() for key in keys)
        protect(d.root_keys[0].reveal() for d in self.router.domains.values() if d.root_keys)
        for warning in self.router.warnings:
            log.warning("config_warning code=%s path=%s", warning.code, warning.path)
        self.health: HealthStore = health if health is not None else open_health(config)
        self._http: Pools | None = None
        # a family's client as given (a scenario's scripted upstreams), else from its factory
        self.clients: dict[str, ProviderClient] = dict(clients or {})
        for name in sorted(
            {p.family for p in config.providers.values()} & set(FAMILIES) - set(self.clients)
        ):
            module, _, factory = FAMILIES[name].adapter.partition(":")
            make = getattr(importlib.import_module(module), factory)
            self.clients[name] = make(self.http_pools())
        self.selection = RouteSelection()
        self.fallback_record: dict[str, str] = {}  # domain -> served label while a fallback serves
        self.observers: list[Callable[[TurnResult], None]] = []
        # each turn planned, run and observed; reached by the gateway, the simulator and the
        # tests through `turns_of`, never as part of the embedder's Relay
        self._turns = Turns(self)

    async def _close(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    def http_pools(self) -> Pools:
        """The upstream connection pools, one per profile, reused across turns: a profile needs at
        most one connection per turn in flight, so `[gateway] max_in_flight` bounds each pool."""
        if self._http is None:
            self._http = Pools(self.config.gateway.max_in_flight)
        return self._http

    def kept_clients(self) -> dict[str, ProviderClient]:
        """The clients the relay that replaces this one on a reload keeps: those of the families
        served in process, whose state (a scenario's scripts and the calls they saw) outlives the
        file. An HTTP family's client is built again, on the new relay's pools."""
        return {name: client for name, client in self.clients.items()
                if name in FAMILIES and FAMILIES[name].wire is None}

    async def aclose(self) -> None:
        """Close pooled connections. `async with Relay(...) as relay:` does it for you."""
        await run_in_host(self._close)

    async def __aenter__(self) -> Relay:
        # a shared health store ([health] store = redis://) stays connected for the block (trio
        # hosts and the gateway; elsewhere it serves on local health and says so once)
        self._exit = contextlib.AsyncExitStack()
        connected = getattr(self.health, "connected", None)
        if connected is not None and host() == "trio":
            await self._exit.enter_async_context(connected())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self._exit.aclose()
        finally:
            await self.aclose()

    @classmethod
    def from_toml(cls, text: str, **kwargs: Any) -> Relay:
        return cls(parse_config(text), **kwargs)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> Relay:
        """A relay from a config file; ConfigError naming the file when it cannot be read."""
        return cls(load_config_file(path), **kwargs)

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
            log.info("effort_decision level=%s hint=%s score=%d", plan.effort.level,
                     plan.effort.hint, plan.effort.score)
        return plan

    # -- turns --------------------------------------------------------------------------------

    async def complete(self, /, messages: Sequence[Mapping[str, Any]] | wire.Request, *,
                       model: str | None = None,
                       tools: Sequence[Mapping[str, Any]] = (), operator_model: str | None = None,
                       extra_body: Mapping[str, Any] | None = None, **params: Any) -> Reply:
        """One non-streaming turn, from trio or asyncio. `params` are chat completions request
        parameters (temperature, max_tokens, stop, tool_choice, response_format, reasoning_effort,
        user...), translated for each entry's family as the gateway does; any other keyword is a
        TypeError. `extra_body` carries a provider's own fields (seed, logprobs...) as the openai
        SDK's does. Raises TurnError (its `reason` an ErrorReason) when no answer came."""
        check_parameters("complete", params, extra_body)
        # a bad parameter raises here, in the caller
        request = wire_request(messages, tools, params, extra_body)
        result = await run_in_host(partial(self._turns.run, request, model=model,
                                           operator_model=operator_model))
        raise_for(result)
        return Reply.of(result, request)

    async def embed(self, /, input: str | Sequence[str] | Sequence[Sequence[int]], *,
                    model: str | None = None,  # noqa: A002
                    dimensions: int | None = None, encoding_format: str | None = None,
                    user: str | None = None) -> Embeddings:
        """Embeddings for `input` (a string, strings, or token arrays), from trio or asyncio:
        routed as a turn is (retries, cooldowns, breakers, key pools, the ledger), falling back
        only to entries that serve the same model. Raises TurnError when no vectors came."""
        body = {
            "input": input
            if isinstance(input, str)
            else [i if isinstance(i, str | int) else list(i) for i in input],
            "dimensions": dimensions,
            "encoding_format": encoding_format,
            "user": user,
        }
        request = parse_embeddings(body)  # a bad parameter raises here, in the caller
        result = await run_in_host(partial(self._turns.run, request, model=model))
        raise_for(result)
        return Embeddings.of(result)

    embed_sync = _blocking(embed, "embed_sync")

    def stream(self, /, messages: Sequence[Mapping[str, Any]] | wire.Request, *,
               model: str | None = None,
               tools: Sequence[Mapping[str, Any]] = (), operator_model: str | None = None,
               on_draft: Callable[[str], None] | None = None,
               extra_body: Mapping[str, Any] | None = None,
               **params: Any) -> StreamTurn:
        """One streamed turn: `async with` from trio or asyncio, `with` from synchronous code.
        `params` and `extra_body` as for `complete`. Events carry tool call ids (`event.ref`);
        after the block, `finish_reason` and `usage` as on a Reply."""
        check_parameters("stream", params, extra_body)
        request = wire_request(messages, tools, params, extra_body)
        return StreamTurn(partial(self._turns.run, request, model=model,
                                  operator_model=operator_model,
                                  on_draft=on_draft, stream=True), request)

    # -- synchronous hosts ----------------------------------------------------------------------

    complete_sync = _blocking(complete, "complete_sync")

    # `with relay.stream_sync(...) as turn: for event in turn:` reads as what it is
    stream_sync = _renamed(stream, "stream_sync")

    def close(self) -> None:
        """`aclose` for synchronous code; `with Relay(...) as relay:` does it for you."""
        require_sync_host("Relay.close")
        run_from_thread(self._close)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def turns_of(relay: Relay) -> Turns:
    """The relay's turns, as the gateway, the simulator and the tests run them: a seam in process
    (a planned run, an observed result) that the embedder's `Relay` does not offer."""
    return relay._turns
