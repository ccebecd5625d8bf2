"""The gateway's Prometheus metrics, with prometheus-client, one registry per gateway.

Counters and histograms are updated as requests and turns end; the live state (breaker state,
cooldown left, turns in flight) is read at scrape time by a collector, so a gauge is never stale.
Label sets are bounded: `provider` is a configured profile alias, `model` a model the config
names (anything else, an unpinned entry forwarding whatever a client asked for, is "other"),
`route` one of the gateway's routes, `outcome` the turn machine's vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from relayline.machines.config import Config
from relayline.machines.turn import TurnResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
OTHER = "other"


def configured_models(config: Config) -> frozenset[str]:
    models = {r.model for r in config.routes} | {c.model for c in config.catalog}
    if config.model:
        models.add(config.model)
    for p in config.providers.values():
        models.update(m for m in (p.model, *p.fallback_models, *p.models.values()) if m)
    return frozenset(models)


class Metrics:
    def __init__(self, config: Config, routes: frozenset[str], live: Callable[[], dict]) -> None:
        self.providers = frozenset(config.providers)
        self.models = configured_models(config)
        self.routes = routes
        self.registry = CollectorRegistry(auto_describe=True)
        self._live = live
        r = self.registry
        self.requests = Counter("relayline_http_requests", "HTTP requests answered, by route and status.",
                                ["route", "status"], registry=r)
        self.turns = Counter("relayline_turns", "Turns by outcome.", ["outcome"], registry=r)
        self.attempts = Counter("relayline_attempts", "Provider attempts by profile, model and outcome.",
                                ["provider", "model", "outcome"], registry=r)
        self.fallbacks = Counter("relayline_fallbacks", "Turns answered by a fallback entry.", registry=r)
        self.tokens = Counter("relayline_tokens", "Billed tokens by profile, model and direction (input, output).",
                              ["provider", "model", "direction"], registry=r)
        self.cost = Counter("relayline_cost_usd", "Billed cost in USD by profile and model (the ledger's rows).",
                            ["provider", "model"], registry=r)
        self.turn_seconds = Histogram("relayline_turn_seconds", "Turn latency by the serving profile and model.",
                                      ["provider", "model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("relayline_time_to_first_token_seconds",
                              "From the request to the first byte of the answer, by the serving profile and model.",
                              ["provider", "model"], buckets=TTFT_BUCKETS, registry=r)
        r.register(_LiveCollector(self))
        # labels() validates and locks on every call; the label sets are bounded (see above)
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *values: str):
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[(metric, values)] = metric.labels(*values)
        return child

    def route(self, path: str) -> str:
        return path if path in self.routes else OTHER

    def _labels(self, provider: str | None, model: str | None) -> tuple[str, str]:
        return (provider if provider in self.providers else "none" if provider is None else OTHER,
                model if model in self.models else "none" if model is None else OTHER)

    def request(self, path: str, status: int) -> None:
        self._child(self.requests, self.route(path), str(status)).inc()

    def first_token(self, provider: str | None, model: str | None, seconds: float) -> None:
        self._child(self.ttft, *self._labels(provider, model)).observe(seconds)

    def turn(self, result: TurnResult, seconds: float) -> None:
        self._child(self.turns, result.outcome).inc()
        if result.fallback:
            self.fallbacks.inc()
        for attempt in result.attempts:
            self._child(self.attempts, *self._labels(attempt.provider, attempt.model), attempt.outcome).inc()
        for row in result.ledger:
            provider, model = self._labels(row.provider, row.model)
            self._child(self.tokens, provider, model, "input").inc(row.input_tokens)
            self._child(self.tokens, provider, model, "output").inc(row.output_tokens)
            self._child(self.cost, provider, model).inc(row.cost_usd)
        served = result.served
        self._child(self.turn_seconds, *self._labels(served.profile if served else None,
                                                     served.model if served else None)).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """Gauges read from the running gateway at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []  # collected lazily: the live state exists only inside the gateway's trio loop

    def collect(self):
        live = self.metrics._live()
        state = GaugeMetricFamily("relayline_breaker_state", "Breaker state by profile: 0 closed, 1 half-open, 2 open.",
                                  labels=["provider"])
        cooldown = GaugeMetricFamily("relayline_cooldown_seconds", "Rate-limit cooldown left by profile (0: none).",
                                     labels=["provider"])
        transitions = CounterMetricFamily("relayline_breaker_transitions", "Breaker state changes by profile.",
                                          labels=["provider"])
        for alias, profile in sorted(live["profiles"].items()):
            state.add_metric([alias], BREAKER_STATES.get(profile["breaker"], -1))
            cooldown.add_metric([alias], profile["cooldown_s"])
            transitions.add_metric([alias], profile["transitions"])
        in_flight = GaugeMetricFamily("relayline_in_flight", "Turns in flight (admitted, not yet answered).",
                                      value=live["in_flight"])
        yield from (state, cooldown, transitions, in_flight)
