"""A relay's turns: each planned on the relay's router, run by the driver (driver.py), and its
result observed (the fallback record, the turn's log line, the relay's observers). `Relay`
keeps them out of its public surface; `turns_of(relay)` (relay.py) reaches them: the library's
`complete`, `embed` and `stream`, the simulator and the gateway all run their turns here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from relayline.machines import dropping, wire
from relayline.machines.config import Config
from relayline.machines.errors import StreamInterruptedAfterOutput, TurnError
from relayline.machines.health import HealthStore
from relayline.machines.plan import HINT_PREFIX, Plan, Router, model_offered
from relayline.machines.turn import Turn, TurnResult

from .codecs import responses_answers, shape
from .codecs.openai_chat import parse_request as parse_openai
from .driver import TurnRun
from .logs import event
from .providers.base import ProviderClient
from .sinks import DISCARD, Sink

log = logging.getLogger("relayline")

# model names warned about per relay before the record starts over (callers may send any name)
MAX_NOTED_MODELS = 1024


class TurnHost(Protocol):
    """What a relay's turns read of it: its config and router, the health store its turns
    consult, each family's client, the plan a turn gets, and where a result is recorded."""

    config: Config
    router: Router
    health: HealthStore
    clients: dict[str, ProviderClient]
    fallback_record: dict[str, str]
    observers: list[Callable[[TurnResult], None]]

    def plan(self, *, model: str | None = None, text: str = "", operator_model: str | None = None,
             gateway: bool = False) -> Plan: ...


class Turns:
    """The turns of one relay."""

    def __init__(self, relay: TurnHost) -> None:
        self.relay = relay
        self.factory: Callable[..., Turn] = Turn  # tests plug faulty machines in here
        self._noted_models: set[str] = set()  # the model names warned about

    async def run(
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
        library and the simulator (the gateway runs `new_run`'s run itself, one coroutine frame
        fewer for each stream it holds). Cancellation is recorded on the result and re-raised.
        `run_hook` sees the run before it starts (the result survives a cancellation)."""
        run = self.new_run(messages, model=model, tools=tools, params=params,
                           operator_model=operator_model,
                            stream=stream, on_draft=on_draft)
        if run_hook is not None:
            run_hook(run)
        try:
            return await run.run(sink)
        finally:
            if run.result is not None:
                self.observe(run.result)

    def new_run(
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
        """A turn planned and ready to run (`TurnRun.run`); its result goes to `observe`."""
        relay = self.relay
        config = relay.config
        request = wire_request(messages, tools, params)
        shape.check_model(model)  # it reaches headers, logs and the ledger: printable and bounded
        if model is not None and (not gateway or config.gateway.unknown_models == "default"):
            self._note_model(model, gateway)
        # the turn's text is read only by effort routing (a plan without it is kept: `Router.plans`)
        text = request.turn_text if config.effort_routing is not None else ""
        plan = relay.plan(model=model, text=text, operator_model=operator_model, gateway=gateway)
        # an entry that cannot honour the request is skipped, not sent; with drop_unsupported_params
        # only content it cannot take keeps it from serving (the fields are dropped for it)
        drop = config.gateway.drop_unsupported_params
        unfit = {}
        for entry in plan.entries:
            provider = entry.provider
            fields = dropping.refused(request, provider.family, provider.capabilities, drop)
            if fields:
                unfit[entry.profile] = fields
        if unfit:
            plan = attrs.evolve(plan, unfit=unfit)
        if request.embedding is not None:
            plan = same_model(plan)
        turn = self.factory(plan, config, relay.health, stream=stream, tools=bool(request.tools),
                                  prompt_chars=lambda: request.prompt_chars)
        return TurnRun(turn, relay.clients, request, on_draft=on_draft)

    def _note_model(self, model: str, gateway: bool) -> None:
        """A warning, once per name, for a model the default domain serves though it does not
        name what it offers (a typo served by another model), and, in the library, for a route
        hint's bare name, which selects the route in the gateway only."""
        if model in self._noted_models:
            return
        if not gateway and model in self.relay.router.domains:
            event(log, logging.WARNING, "model_names_route_hint", model=model,
                  served_by="the default domain",
                  route_with=HINT_PREFIX + model)
        elif not model_offered(self.relay.router, model):
            event(log, logging.WARNING, "unknown_model", model=model,
                  served_by="the default domain",
                  why="no route hint, catalog model or model of the default domain has this name")
        else:
            return
        if len(self._noted_models) >= MAX_NOTED_MODELS:
            self._noted_models.clear()  # memory stays bounded whatever names callers send
        self._noted_models.add(model)

    def observe(self, result: TurnResult) -> None:
        """A turn's result, once it ended: the fallback record, the turn's log line, the
        relay's observers."""
        relay = self.relay
        if result.outcome == "ok" and result.served is not None:
            domain = result.requested.split("/", 1)[0]
            if result.fallback:
                relay.fallback_record[domain] = result.served.label
            else:
                relay.fallback_record.pop(domain, None)  # a later primary success clears the record
        # (its arguments are not read at the gateway's usual level)
        if log.isEnabledFor(logging.INFO):
            # an answer partly served by another entry names it (absent otherwise)
            partial = {"partial_from": result.partial_from.label} if result.partial_from else {}
            event(log, logging.INFO, "turn", outcome=result.outcome, error=result.error,
                  requested=result.requested,
                  served=result.served.label if result.served else None,
                  attempts=len(result.attempts),
                  cost_usd=round(result.cost_usd, 8), **partial)
        for observer in relay.observers:
            observer(result)


def wire_request(messages: Sequence[Mapping[str, Any]] | wire.Request,
                 tools: Sequence[Mapping[str, Any]] = (),
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


def same_model(plan: Plan) -> Plan:
    """The plan's entries that serve its first entry's model: vectors from two models are not
    interchangeable, so an embeddings turn falls back only to another profile, key or region of
    the same model (a catalog model's channels all serve it)."""
    if plan.catalog is not None or not plan.entries:
        return plan
    model = plan.entries[0].model
    return attrs.evolve(plan, entries=tuple(e for e in plan.entries if e.model == model))


def raise_for(result: TurnResult) -> None:
    """The exception an embedder catches for a turn that did not answer."""
    if result.outcome == "ok":
        return
    if result.outcome == "interrupted":
        raise StreamInterruptedAfterOutput(result.message or "interrupted",
                                           attempts=result.attempts,
                                           partial_text=result.partial_text or "")
    raise TurnError(result.message or result.error or "failed", reason=result.error or "exhausted",
                    attempts=result.attempts, partial_text=result.partial_text)


def response_object(result: TurnResult, request: wire.Request | None) -> dict[str, Any]:
    """An answer as the Responses API's `response` object: its output items (reasoning with
    the token that carries its signature back, the message, each function_call with its
    call_id; the provider's own items when a profile that speaks the Responses API served it),
    `status` and `incomplete_details`, `usage`, and the request's own fields echoed. Its `id` is
    the provider's when that provider keeps answers, else a new one."""
    return responses_answers.response_object(responses_answers.new_id("resp"), result, None,
                                             request)
