"""The embedder's API: `Relay`, `Reply` and `StreamTurn`, from trio, asyncio or plain threads.

    relay = Relay.from_file("relayline.toml")
    reply = await relay.complete(messages, model="hint:fast")      # trio or asyncio
    reply = relay.complete_sync(messages, model="hint:fast")       # synchronous code
    async with relay.stream(messages) as turn:                     # `with relay.stream_sync(...)`
        async for event in turn: ...
    turn.outcome

A Relay owns the router (config materialised once), the health store its turns consult (pass
one to several relays to share breakers and cooldowns), and the protocol adapters. Every turn,
library or gateway or simulator, runs through `_run_turn` in a trio run: the caller's own under
trio, relayline's runtime thread (adapters/hosts.py) under asyncio or from synchronous code.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import importlib
import inspect
import logging
import os
import queue
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs
import trio

from relayline.machines import wire
from relayline.machines.config import Config, parse_config
from relayline.machines.effort import RouteSelection
from relayline.machines.errors import StreamInterruptedAfterOutput, TurnError
from relayline.machines.families import FAMILIES
from relayline.machines.health import HealthStore, InMemoryHealth
from relayline.machines.ledger import LedgerRow, Usage
from relayline.machines.plan import HINT_PREFIX, Plan, build_router, model_offered, plan_turn
from relayline.machines.stream import Event
from relayline.machines.turn import Turn, TurnResult

from .codecs import responses as responses_codec
from .codecs import responses_answers, shape
from .codecs.embeddings import parse_request as parse_embeddings
from .codecs.openai_chat import KNOWN
from .codecs.openai_chat import parse_request as parse_openai
from .configfile import load_config_file
from .driver import DISCARD, Sink, TurnRun
from .hosts import (
    Handoff,
    Outcome,
    Runtime,
    host,
    require_sync_host,
    run_from_thread,
    run_in_host,
    settler,
    unwind,
)
from .logs import event
from .providers.base import ProviderClient
from .providers.pool import Pools
from .redact import protect

log = logging.getLogger("relayline")

# model names warned about per relay before the record starts over (callers may send any name)
MAX_NOTED_MODELS = 1024

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


def check_parameters(call: str, params: Mapping[str, Any], extra_body: Mapping[str, Any] | None) -> None:
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
        raise TypeError(f"{call}(): extra_body may not set {', '.join(taken)}: pass each as its own argument")


def check_parameters_as(call: str, method: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """`method`'s keyword check under the name the caller used (`complete_sync` runs `complete`):
    the TypeError names the method called, as Python's own would."""
    named = {name for name, p in inspect.signature(method).parameters.items() if p.kind is not p.VAR_KEYWORD}
    check_parameters(call, {k: v for k, v in kwargs.items() if k not in named}, kwargs.get("extra_body"))


def wire_request(messages: Sequence[Mapping[str, Any]] | wire.Request, tools: Sequence[Mapping[str, Any]] = (),
                 params: Mapping[str, Any] | None = None,
                 extra_body: Mapping[str, Any] | None = None) -> wire.Request:
    """The canonical request for OpenAI-style chat messages, tools, request parameters
    (temperature, max_tokens, stop, tool_choice, response_format, reasoning_effort...) and a
    provider's own fields (`extra_body`, sent to entries of the openai family; an entry of
    another family cannot honour them and is skipped), or a `wire.Request` as given. A
    parameter of the wrong shape raises WireError naming it."""
    if isinstance(messages, wire.Request):
        if params or extra_body:  # a Request carries its own: these would be dropped unread
            given = ", ".join([*(params or {}), *(["extra_body"] if extra_body else [])])
            raise TypeError(f"{given}: a wire.Request carries its own parameters; set them on it")
        return messages
    body = {**(extra_body or {}), **(params or {}), "messages": list(messages)}
    if tools:
        body["tools"] = list(tools)
    return parse_openai(body, passthrough=False)


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
        raise TypeError(f"responses_request(): {', '.join(taken)} is the call's: pass model= to complete() or "
                        "stream(), and call stream() for a streamed turn")
    return responses_codec.parse_request(dict(body))


def same_model(plan: Plan) -> Plan:
    """The plan's entries that serve its first entry's model: vectors from two models are not
    interchangeable, so an embeddings turn falls back only to another profile, key or region of
    the same model (a catalog model's channels all serve it)."""
    if plan.catalog is not None or not plan.entries:
        return plan
    model = plan.entries[0].model
    return attrs.evolve(plan, entries=tuple(e for e in plan.entries if e.model == model))


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
                   input_tokens=(result.usage or Usage()).input_tokens, cost_usd=result.cost_usd, ledger=result.ledger)


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
    finish_reason: str = wire.STOP  # canonical: stop, stop_sequence, length, tool_calls, content_filter, pause_turn
    tool_call_ids: tuple[str, ...] = ()  # as the provider sent them ("" where it sent none)
    tool_arguments: tuple[str, ...] = ()  # JSON text, aligned with tool_calls
    usage: Usage = Usage()  # input, output, cache read/write and reasoning tokens of the answer
    request: wire.Request | None = attrs.field(default=None, repr=False, eq=False)  # what was asked

    @classmethod
    def of(cls, result: TurnResult, request: wire.Request | None = None) -> Reply:
        assert result.served is not None  # an accepted answer always has a server
        return cls(text=result.text or "", tool_calls=result.tool_calls, reasoning=result.reasoning,
                   requested=result.requested, served=result.served.label, notice=result.notice,
                   fallback=result.fallback, ledger=result.ledger, cost_usd=result.cost_usd, result=result,
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


def response_object(result: TurnResult, request: wire.Request | None) -> dict[str, Any]:
    """An answer as the Responses API's `response` object: its output items (reasoning with
    the token that carries its signature back, the message, each function_call with its
    call_id; the provider's own items when a profile that speaks the Responses API served it),
    `status` and `incomplete_details`, `usage`, and the request's own fields echoed. Its `id` is
    the provider's when that provider keeps answers, else a new one."""
    return responses_answers.response_object(responses_answers.new_id("resp"), result, None, request)


def raise_for(result: TurnResult) -> None:
    """The exception an embedder catches for a turn that did not answer."""
    if result.outcome == "ok":
        return
    if result.outcome == "interrupted":
        raise StreamInterruptedAfterOutput(result.message or "interrupted", attempts=result.attempts,
                                           partial_text=result.partial_text or "")
    raise TurnError(result.message or result.error or "failed", reason=result.error or "exhausted",
                    attempts=result.attempts, partial_text=result.partial_text)


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
    blocking.__doc__ = f"`{method.__name__}` for synchronous code: blocks this thread until it returns."
    return blocking


def _renamed(method: Callable[Concatenate[Relay, P], T], name: str) -> Callable[Concatenate[Relay, P], T]:
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
        for name in sorted({p.family for p in config.providers.values()} & set(FAMILIES) - set(self.clients)):
            module, _, factory = FAMILIES[name].adapter.partition(":")
            self.clients[name] = getattr(importlib.import_module(module), factory)(self.http_pools())
        self.selection = RouteSelection()
        self.fallback_record: dict[str, str] = {}  # domain -> served label while a fallback serves
        self.observers: list[Callable[[TurnResult], None]] = []
        self._turn_factory: Callable[..., Turn] = Turn  # tests plug faulty machines in here
        self._noted_models: set[str] = set()  # the model names warned about (`_note_model`)

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
            log.info("effort_decision level=%s hint=%s score=%d", plan.effort.level, plan.effort.hint, plan.effort.score)
        return plan

    # -- turns --------------------------------------------------------------------------------

    async def _run_turn(
        self,
        messages: Sequence[Mapping[str, Any]] | wire.Request,
        *,
        model: str | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        params: Mapping[str, Any] | None = None,
        operator_model: str | None = None,
        stream: bool = False,
        on_draft: Callable[[str], None] | None = None,
        sink: Sink = DISCARD,
        run_hook: Callable[[TurnRun], None] | None = None,
    ) -> TurnResult:
        """Run one turn to its result, in the current trio run: the one entry point for the
        library and the simulator (the gateway runs `_new_run`'s run itself, one coroutine frame
        fewer for each stream it holds). Cancellation is recorded on the result and re-raised.
        `run_hook` sees the run before it starts (the result survives a cancellation)."""
        run = self._new_run(messages, model=model, tools=tools, params=params, operator_model=operator_model,
                            stream=stream, on_draft=on_draft)
        if run_hook is not None:
            run_hook(run)
        try:
            return await run.run(sink)
        finally:
            if run.result is not None:
                self._observe(run.result)

    def _new_run(
        self,
        messages: Sequence[Mapping[str, Any]] | wire.Request,
        *,
        model: str | None = None,
        tools: Sequence[Mapping[str, Any]] = (),
        params: Mapping[str, Any] | None = None,
        operator_model: str | None = None,
        stream: bool = False,
        on_draft: Callable[[str], None] | None = None,
        gateway: bool = False,
    ) -> TurnRun:
        """A turn planned and ready to run (`TurnRun.run`); its result goes to `_observe`."""
        request = wire_request(messages, tools, params)
        shape.check_model(model)  # it reaches headers, logs and the ledger: printable and bounded
        if model is not None and (not gateway or self.config.gateway.unknown_models == "default"):
            self._note_model(model, gateway)
        # the turn's text is read only by effort routing (a plan without it is kept: `Router.plans`)
        text = request.turn_text if self.config.effort_routing is not None else ""
        plan = self.plan(model=model, text=text, operator_model=operator_model, gateway=gateway)
        # an entry that cannot honour the request is skipped, not sent; with drop_unsupported_params
        # only content it cannot take keeps it from serving (the fields are dropped for it)
        drop = self.config.gateway.drop_unsupported_params
        unfit = {}
        for entry in plan.entries:
            fields = wire.refused(request, entry.provider.family, entry.provider.capabilities, drop)
            if fields:
                unfit[entry.profile] = fields
        if unfit:
            plan = attrs.evolve(plan, unfit=unfit)
        if request.embedding is not None:
            plan = same_model(plan)
        turn = self._turn_factory(plan, self.config, self.health, stream=stream, tools=bool(request.tools),
                                  prompt_chars=lambda: request.prompt_chars)
        return TurnRun(turn, self.clients, request, on_draft=on_draft)

    def _note_model(self, model: str, gateway: bool) -> None:
        """A warning, once per name, for a model the default domain serves though it does not
        name what it offers (a typo served by another model), and, in the library, for a route
        hint's bare name, which selects the route in the gateway only."""
        if model in self._noted_models:
            return
        if not gateway and model in self.router.domains:
            event(log, logging.WARNING, "model_names_route_hint", model=model, served_by="the default domain",
                  route_with=HINT_PREFIX + model)
        elif not model_offered(self.router, model):
            event(log, logging.WARNING, "unknown_model", model=model, served_by="the default domain",
                  why="no route hint, catalog model or model of the default domain has this name")
        else:
            return
        if len(self._noted_models) >= MAX_NOTED_MODELS:
            self._noted_models.clear()  # memory stays bounded whatever names callers send
        self._noted_models.add(model)

    def _observe(self, result: TurnResult) -> None:
        if result.outcome == "ok" and result.served is not None:
            domain = result.requested.split("/", 1)[0]
            if result.fallback:
                self.fallback_record[domain] = result.served.label
            else:
                self.fallback_record.pop(domain, None)  # a later primary success clears the record
        if log.isEnabledFor(logging.INFO):  # (its arguments are not read at the gateway's usual level)
            # an answer partly served by another entry names it (absent otherwise)
            partial = {"partial_from": result.partial_from.label} if result.partial_from else {}
            event(log, logging.INFO, "turn", outcome=result.outcome, error=result.error, requested=result.requested,
                  served=result.served.label if result.served else None, attempts=len(result.attempts),
                  cost_usd=round(result.cost_usd, 8), **partial)
        for observer in self.observers:
            observer(result)

    async def complete(self, /, messages: Sequence[Mapping[str, Any]] | wire.Request, *, model: str | None = None,
                       tools: Sequence[Mapping[str, Any]] = (), operator_model: str | None = None,
                       extra_body: Mapping[str, Any] | None = None, **params: Any) -> Reply:
        """One non-streaming turn, from trio or asyncio. `params` are chat completions request
        parameters (temperature, max_tokens, stop, tool_choice, response_format, reasoning_effort,
        user...), translated for each entry's family as the gateway does; any other keyword is a
        TypeError. `extra_body` carries a provider's own fields (seed, logprobs...) as the openai
        SDK's does. Raises TurnError (its `reason` an ErrorReason) when no answer came."""
        check_parameters("complete", params, extra_body)
        request = wire_request(messages, tools, params, extra_body)  # a bad parameter raises here, in the caller
        result = await run_in_host(partial(self._run_turn, request, model=model, operator_model=operator_model))
        raise_for(result)
        return Reply.of(result, request)

    async def embed(self, /, input: str | Sequence[str] | Sequence[Sequence[int]], *, model: str | None = None,  # noqa: A002
                    dimensions: int | None = None, encoding_format: str | None = None,
                    user: str | None = None) -> Embeddings:
        """Embeddings for `input` (a string, strings, or token arrays), from trio or asyncio:
        routed as a turn is (retries, cooldowns, breakers, key pools, the ledger), falling back
        only to entries that serve the same model. Raises TurnError when no vectors came."""
        body = {"input": input if isinstance(input, str) else [i if isinstance(i, str | int) else list(i) for i in input],
                "dimensions": dimensions, "encoding_format": encoding_format, "user": user}
        request = parse_embeddings(body)  # a bad parameter raises here, in the caller
        result = await run_in_host(partial(self._run_turn, request, model=model))
        raise_for(result)
        return Embeddings.of(result)

    embed_sync = _blocking(embed, "embed_sync")

    def stream(self, /, messages: Sequence[Mapping[str, Any]] | wire.Request, *, model: str | None = None,
               tools: Sequence[Mapping[str, Any]] = (), operator_model: str | None = None,
               on_draft: Callable[[str], None] | None = None, extra_body: Mapping[str, Any] | None = None,
               **params: Any) -> StreamTurn:
        """One streamed turn: `async with` from trio or asyncio, `with` from synchronous code.
        `params` and `extra_body` as for `complete`. Events carry tool call ids (`event.ref`);
        after the block, `finish_reason` and `usage` as on a Reply."""
        check_parameters("stream", params, extra_body)
        request = wire_request(messages, tools, params, extra_body)
        return StreamTurn(self, partial(self._run_turn, request, model=model, operator_model=operator_model,
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


class _Batches:
    """How a streamed turn's events reach a consumer in the same trio run: the turn puts each
    event without a checkpoint, and the consumer takes whatever gathered in one wake-up (the
    frames of one upstream read, since the turn runs until its next read), then hands them out
    one per iteration with no trio call. An unbuffered channel cost two scheduler passes an
    event (bench/run.py's hand-off row).

    What the unbuffered channel guaranteed still holds. The turn decides how its stream ended
    only once the consumer took every event (`drained`), so a consumer that leaves early still
    cancels it; events it never took are withdrawn from what the turn counts as forwarded
    (`partial_text` is exactly what the consumer received); and the turn runs at most MAX_AHEAD
    events ahead of the consumer (beyond it, it waits, its idle deadline lifted: a slow
    consumer is not a stalled provider)."""

    MAX_AHEAD = 256

    __slots__ = ("run", "pending", "batch", "at", "closed", "left", "first", "_consumer", "_producer", "_want")

    def __init__(self) -> None:
        self.run: TurnRun | None = None
        self.pending: list[Event] = []  # put, not taken yet
        self.batch: list[Event] = []  # taken, handed out from `at`
        self.at = 0
        self.closed = False  # the turn ended: nothing more comes
        self.left = False  # the consumer left (or cancelled): nothing more goes to it
        self.first = True  # no event was put yet
        self._consumer: trio.Event | None = None  # set for a consumer waiting for a batch
        self._producer: trio.Event | None = None  # set for a turn waiting for the consumer
        self._want = 0  # ... until this many events are left untaken

    # -- the turn's side: the driver's sink ----------------------------------------------------------

    may_block = False  # bounded: when the turn must wait, it says so (consumer_paused)

    async def __call__(self, event: Event) -> None:
        if not event.visible:
            return
        if self.left:
            # the cancellation has not reached the turn yet (its read had completed): the event
            # it produced meanwhile is not the consumer's
            self._withdraw([event])
            return
        self.pending.append(event)
        if self._consumer is not None:
            self._consumer.set()
            self._consumer = None
        if self.first or len(self.pending) >= self.MAX_AHEAD:
            # the first event goes to the consumer at once, not after the rest of its read was
            # decoded (the first byte); later ones wait only for room, and then until half of
            # it is free (not woken again for each event taken)
            untaken = 0 if self.first else self.MAX_AHEAD // 2
            self.first = False
            assert self.run is not None
            with self.run.consumer_paused():
                await self._until(untaken)

    async def drained(self) -> None:
        """Every event put so far was handed to the consumer (or it left: then the turn is
        cancelled here, whether or not it had to wait)."""
        await self._until(0)
        await trio.lowlevel.checkpoint_if_cancelled()

    def _untaken(self) -> int:
        return len(self.pending) + len(self.batch) - self.at

    async def _until(self, untaken: int) -> None:
        while self._untaken() > untaken:
            self._want = untaken
            self._producer = trio.Event()
            await self._producer.wait()

    def close(self) -> None:
        self.closed = True
        if self._consumer is not None:
            self._consumer.set()

    # -- the consumer's side ------------------------------------------------------------------------

    async def take(self) -> Event | None:
        """The next event, or None once the turn ended and every event was taken."""
        if self.at == len(self.batch):
            while not self.pending:
                if self.closed or self.left:
                    return None
                self._consumer = trio.Event()
                await self._consumer.wait()
            self.batch, self.pending = self.pending, self.batch
            self.pending.clear()
            self.at = 0
        event = self.batch[self.at]
        self.at += 1
        if self._producer is not None and self._untaken() <= self._want:
            self._producer.set()
            self._producer = None
        return event

    def leave(self) -> None:
        """The consumer leaves: what it did not take is withdrawn from the turn."""
        self.left = True
        untaken = self.batch[self.at:] + self.pending
        self.batch, self.pending, self.at = [], [], 0
        self._withdraw(untaken)  # (a turn waiting for the consumer is woken by the cancellation that follows)

    def _withdraw(self, events: list[Event]) -> None:
        run = self.run
        if events and run is not None and run.result is None:  # a settled turn's record is final
            run.turn.withdraw(events)


class StreamTurn:
    """A streamed turn. Iterating yields immutable events only (text, reasoning, tool calls).

    The iteration ends cleanly when the turn succeeded, or when the consumer cancelled it
    (`cancel()`); otherwise it raises: `StreamInterruptedAfterOutput` when the stream failed
    after output (never replayed; what was forwarded is in `partial_text`), `TurnError` when no
    answer came. Leaving the block early cancels the turn (never a retry); so does cancelling
    the host's task. After the block: `outcome`, `partial_text`, `served`, `ledger`, `notice`,
    `result`.
    """

    def __init__(self, relay: Relay, run_turn: Callable[..., Awaitable[TurnResult]],
                 request: wire.Request | None = None) -> None:
        self._relay = relay
        self._run_turn = run_turn
        self._request = request
        self._run: TurnRun | None = None
        self._scope = trio.CancelScope()
        self._host = ""

    # -- the producer, in a trio run (the host's own, or the runtime's) ---------------------------

    async def _produce(self, sink: Sink) -> None:
        try:
            with self._scope:
                await self._run_turn(sink=sink, run_hook=self._attach)
        finally:
            if self._host == "trio":
                self._batches.close()
            else:
                self._handoff.close()

    def _attach(self, run: TurnRun) -> None:
        self._run = run
        if self._host == "trio":
            self._batches.run = run

    def cancel(self) -> None:
        """Cancel the turn from the consuming code: the iteration ends, never a retry."""
        if self._host == "trio":
            self._batches.leave()
            self._scope.cancel()
        elif self._host:
            Runtime.get().call_soon(self._scope.cancel)

    def _end(self) -> None:
        """The producer finished: a turn that did not answer raises, unless it was cancelled
        (by the consumer: any other cancellation reaches the host as its own exception)."""
        if self.result is not None and self.result.outcome != "cancelled":
            raise_for(self.result)

    # -- trio and asyncio hosts -----------------------------------------------------------------

    async def __aenter__(self) -> StreamTurn:
        self._host = host()
        if self._host == "trio":
            self._batches = _Batches()
            self._nursery_manager = trio.open_nursery()
            nursery = await self._nursery_manager.__aenter__()
            nursery.start_soon(self._produce, self._batches)
        elif self._host == "asyncio":
            self._handoff = Handoff()
            self._done: asyncio.Future[Outcome[None]] = asyncio.get_running_loop().create_future()
            Runtime.get().start(partial(self._produce, self._visible(self._handoff.send)), settler(self._done))
        else:
            raise RuntimeError(f"relayline runs under trio or asyncio, not {self._host}")
        return self

    def __aiter__(self) -> StreamTurn:
        return self

    async def __anext__(self) -> Event:
        if self._host == "trio":
            taken = await self._batches.take()
            if taken is not None:
                return taken
        else:
            item: asyncio.Future[Event | None] = asyncio.get_running_loop().create_future()
            Runtime.get().call_soon(self._handoff.demand, settler(item))
            event = await item
            if event is not None:
                return event
        self._end()
        raise StopAsyncIteration

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._host == "trio":
            self.cancel()  # a no-op when the turn already finished
            try:
                await self._nursery_manager.__aexit__(exc_type, exc, tb)
            except BaseExceptionGroup as group:
                if exc is None or group.exceptions != (exc,):
                    raise
                # the block's own exception, wrapped by the nursery: it propagates as it was
        else:
            self.cancel()  # a no-op when the turn already finished
            await unwind(self._done)
            if exc is None:
                self._done.result().unwrap()

    # -- synchronous hosts ------------------------------------------------------------------------

    def __enter__(self) -> StreamTurn:
        require_sync_host("Relay.stream_sync")
        self._host = "sync"
        self._handoff = Handoff()
        self._finished: queue.SimpleQueue[Outcome[None]] = queue.SimpleQueue()
        Runtime.get().start(partial(self._produce, self._visible(self._handoff.send)), self._finished.put)
        return self

    @staticmethod
    def _visible(send: Callable[[Event], Awaitable[None]]) -> Sink:
        async def sink(event: Event) -> None:
            if event.visible:
                await send(event)

        return sink

    def __iter__(self) -> StreamTurn:
        return self

    def __next__(self) -> Event:
        box: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        Runtime.get().call_soon(self._handoff.demand, box.put)
        event = box.get()
        if event is not None:
            return event
        self._end()
        raise StopIteration

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cancel()
        outcome = self._finished.get()
        if exc is None:
            outcome.unwrap()

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

    @property
    def finish_reason(self) -> str | None:
        result = self.result
        return wire.finish_reason(result.finish_reason, len(result.tool_calls)) if result and result.outcome == "ok" else None

    @property
    def usage(self) -> Usage | None:
        return self.result.usage if self.result else None

    def response(self) -> dict[str, Any]:
        """After the block, the answer as the Responses API's `response` object (as
        `Reply.response()`), once the turn succeeded."""
        result = self.result
        if result is None or result.outcome != "ok":
            raise RuntimeError("response(): the turn has no answer (it has not ended, or did not succeed)")
        return response_object(result, self._request)
