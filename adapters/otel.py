"""OpenTelemetry spans for turns and their attempts, when `relayline[otel]` is installed.

One span per turn (`chat REQUESTED`) and one child per provider attempt (`chat MODEL`), with
the GenAI semantic conventions' attributes (gen_ai.operation.name, gen_ai.provider.name,
gen_ai.request.model, gen_ai.response.model, gen_ai.usage.*, error.type) and relayline's own
(relayline.profile, relayline.outcome, relayline.cost_usd, ...). Spans are written when the
turn ends, from its attempt records: an attempt's span runs from the end of the one before it
(or the turn's start) to its own end, backoff waits included. Never an attribute with prompt or
completion text, never a key. Without the opentelemetry API installed this is a no-op; without
an SDK configured, the API's own no-op tracer makes it nearly free.
"""

from __future__ import annotations

import time

import trio

from relayline.machines.turn import TurnResult

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider
    from opentelemetry.util.types import AttributeValue
except ImportError:  # the otel extra is not installed
    trace = None  # type: ignore[assignment]  # (None stands for the missing API: checked before each use)

INSTRUMENTATION = "relayline"


class Tracing:
    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self.tracer = trace.get_tracer(INSTRUMENTATION,
                                       tracer_provider=tracer_provider) if trace else None
        # (get_tracer_provider, above or here, has loaded a provider OTEL_PYTHON_TRACER_PROVIDER
        # names)
        self._on = tracer_provider is not None or (trace is not None and _global_provider_set())

    def _recording(self) -> bool:
        # with the API alone (no SDK set up, before or since) every span is a no-op: the
        # attributes of a turn, costly to build, are not built for it. A global provider,
        # once set, is set for good (the API refuses a second): only its absence is asked again
        if self._on:
            return True
        if self.tracer is None or _unset():
            return False
        self._on = _global_provider_set()
        return self._on

    def turn(self, result: TurnResult, *, started: float, ended: float,
             clock_now: float | None = None,
             request_id: str | None = None, families: dict[str, str] | None = None) -> None:
        """Record a finished turn. `started`, `ended` and the attempts' times are on the clock
        whose current reading is `clock_now` (None: trio's, read now): they are placed on the
        wall clock here. (Read here, not by the caller: with tracing off nothing reads it.)"""
        if not self._recording():
            return
        tracer = self.tracer
        assert tracer is not None  # (a recording tracing has one)
        if clock_now is None:
            clock_now = trio.current_time()
        offset_ns = time.time_ns() - int(clock_now * 1e9)

        def wall(t: float) -> int:
            return offset_ns + int(t * 1e9)

        families = families or {}
        served = result.served
        model = result.requested.split("/", 1)[-1]
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model,
            "relayline.requested": result.requested,
            "relayline.outcome": result.outcome,
            "relayline.attempts": len(result.attempts),
            "relayline.fallback": result.fallback,
            "relayline.cost_usd": result.cost_usd,
            "gen_ai.usage.input_tokens": sum(r.input_tokens for r in result.ledger),
            "gen_ai.usage.output_tokens": sum(r.output_tokens for r in result.ledger),
        }
        if served is not None:
            attributes |= {"gen_ai.response.model": served.model, "relayline.served": served.label,
                           "gen_ai.provider.name": families.get(served.profile, "unknown")}
        if result.partial_from is not None:  # nothing accepted: whose output the client saw
            attributes["relayline.partial_from"] = result.partial_from.label
        if request_id:
            attributes["relayline.request_id"] = request_id
        span = tracer.start_span(f"chat {model}", kind=SpanKind.INTERNAL,
                                      start_time=wall(started), attributes=attributes)
        if result.outcome != "ok":
            span.set_attribute("error.type", result.error or result.outcome)
            span.set_status(Status(StatusCode.ERROR, result.error or result.outcome))
        context = trace.set_span_in_context(span)
        rows = list(result.ledger)
        begin = started
        for attempt in result.attempts:
            usage = next((r for r in rows if (r.provider, r.model, r.outcome) ==
                          (attempt.provider, attempt.model, attempt.outcome)), None)
            if usage is not None:
                rows.remove(usage)
            child: dict[str, AttributeValue] = {
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": families.get(attempt.provider, "unknown"),
                "gen_ai.request.model": attempt.model,
                "relayline.profile": attempt.provider,
                "relayline.mode": attempt.mode,
                "relayline.outcome": attempt.outcome,
                "relayline.try": attempt.try_number,
            }
            if usage is not None:
                child |= {"gen_ai.usage.input_tokens": usage.input_tokens,
                          "gen_ai.usage.output_tokens": usage.output_tokens,
                          "relayline.cost_usd": usage.cost_usd}
            end = max(attempt.at, begin)
            attempt_span = tracer.start_span(f"chat {attempt.model}", context=context,
                                             kind=SpanKind.CLIENT,
                                                  start_time=wall(begin), attributes=child)
            if attempt.outcome != "ok":
                attempt_span.set_attribute("error.type", attempt.outcome)
                attempt_span.set_status(Status(StatusCode.ERROR, attempt.outcome))
            attempt_span.end(end_time=wall(end))
            begin = end
        span.end(end_time=wall(max(ended, begin)))


def _global_provider_set() -> bool:
    return not isinstance(trace.get_tracer_provider(),
                          (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _unset() -> bool:
    """No global provider set up, by the API's own global: get_tracer_provider() answers the same
    but reads os.environ first, on every turn (a provider OTEL_PYTHON_TRACER_PROVIDER names was
    loaded when the Tracing was made). Where a later API has no such global: False, and the
    public call decides."""
    return getattr(trace, "_TRACER_PROVIDER", False) is None
