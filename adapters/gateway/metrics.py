"""The gateway's Prometheus metrics, exposed with prometheus-client, one registry per gateway.

Counters and histograms are plain numbers updated as requests and turns end, and become
Prometheus families only when scraped: prometheus-client's own Counter takes a lock and walks its
value classes on every `inc` (ten a request, a tenth of the gateway's own path per request), and a
scrape is rare. The live state (breaker state, cooldown left, turns in flight) is read at scrape
time too, so a gauge is never stale. Label sets are bounded: `provider` is a configured profile
alias, `model` a model the config names (anything else, an unpinned entry forwarding whatever a
client asked for, is "other"), `route` one of the gateway's routes, `outcome` the turn machine's
vocabulary, `key` and `team` a configured `[[gateway.keys]]` name and its team (a request by a key
of the flat `api_keys_env` list carries none).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from relayline.machines.config import Config
from relayline.machines.turn import TurnResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a probing breaker is half-open with its one probe in flight (specs/breaker.toml): 1 too
BREAKER_STATES = {"closed": 0, "half_open": 1, "probing": 1, "open": 2}
OTHER = "other"


def configured_models(config: Config) -> frozenset[str]:
    models = {r.model for r in config.routes} | {c.model for c in config.catalog}
    if config.model:
        models.add(config.model)
    for p in config.providers.values():
        models.update(m for m in (p.model, *p.fallback_models, *p.models.values()) if m)
    return frozenset(models)


def named_keys(config: Config) -> dict[str, str]:
    """The configured key names and their teams: the only values the key labels take."""
    return {key.name: key.team or "" for key in config.gateway.keys}


class _Counter:
    """A counter family's values by label values, in order of first use."""

    __slots__ = ("name", "doc", "labels", "values")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, values: tuple[str, ...] = (), amount: float = 1.0) -> None:
        counts = self.values
        counts[values] = counts.get(values, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, value in self.values.items():
            family.add_metric(values, value)
        return family


class _Histogram:
    """A histogram family: per label values, the count in each bucket (not cumulative: one add
    an observation; cumulated when scraped) and the sum."""

    __slots__ = ("name", "doc", "labels", "bounds", "values")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...],
                 bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        self.values: dict[tuple[str, ...], list[float]] = {}  # [per bucket..., +Inf, sum]

    def observe(self, values: tuple[str, ...], amount: float) -> None:
        counts = self.values.get(values)
        if counts is None:
            counts = self.values[values] = [0.0] * (len(self.bounds) + 2)
        counts[bisect_left(self.bounds, amount)] += 1  # a bucket's bound is inclusive (le)
        counts[-1] += amount

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for values, counts in self.values.items():
            buckets, total = [], 0.0
            for bound, count in zip((*(floatToGoString(b) for b in self.bounds), "+Inf"), counts,
                                    strict=False):
                total += count
                buckets.append((bound, total))
            family.add_metric(values, buckets, counts[-1])
        return family


class Metrics:
    def __init__(self, config: Config, routes: frozenset[str],
                 live: Callable[[], dict[str, Any]]) -> None:
        self.providers = frozenset(config.providers)
        self.models = configured_models(config)
        self.routes = routes
        self.registry = CollectorRegistry(auto_describe=True)
        self._live = live
        self.requests = _Counter("relayline_http_requests",
                                 "HTTP requests answered, by route and status.",
                                 ("route", "status"))
        self.turns = _Counter("relayline_turns", "Turns by outcome.", ("outcome",))
        self.attempts = _Counter("relayline_attempts",
                                 "Provider attempts by profile, model and outcome.",
                                 ("provider", "model", "outcome"))
        self.fallbacks = _Counter("relayline_fallbacks", "Turns answered by a fallback entry.")
        self.tokens = _Counter("relayline_tokens",
                               "Billed tokens by profile, model and direction (input, output).",
                               ("provider", "model", "direction"))
        self.cost = _Counter("relayline_cost_usd",
                             "Billed cost in USD by profile and model (the ledger's rows).",
                             ("provider", "model"))
        self.turn_seconds = _Histogram("relayline_turn_seconds",
                                       "Turn latency by the serving profile and model.",
                                       ("provider", "model"), LATENCY_BUCKETS)
        self.ttft = _Histogram("relayline_time_to_first_token_seconds",
                               "From the request to the first byte of the answer, by the serving "
                               "profile and model.",
                               ("provider", "model"), TTFT_BUCKETS)
        self.keys = named_keys(config)
        self.key_requests = _Counter("relayline_key_requests",
                                     "Chat requests of a named key by the admission's "
                                     "decision (admitted, rate_limited, budget_exceeded, "
                                     "forbidden).",
                                     ("key", "team", "decision"))
        self.key_tokens = _Counter("relayline_key_tokens",
                                   "Billed tokens (input and output) of a named key.",
                                   ("key", "team"))
        self.key_cost = _Counter("relayline_key_cost_usd",
                                 "Billed cost in USD of a named key (the ledger's rows).",
                                 ("key", "team"))
        self.registry.register(_Families(self))
        self.registry.register(_LiveCollector(self))

    def route(self, path: str) -> str:
        return path if path in self.routes else OTHER

    def _labels(self, provider: str | None, model: str | None) -> tuple[str, str]:
        return (provider if provider in self.providers else "none" if provider is None else OTHER,
                model if model in self.models else "none" if model is None else OTHER)

    def _caller(self, name: str) -> tuple[str, str] | None:
        """A configured key's labels (its team as configured now); None for any other name."""
        team = self.keys.get(name)
        return None if team is None else (name, team)

    def key_decision(self, name: str, decision: str) -> None:
        labels = self._caller(name)
        if labels is not None:
            self.key_requests.inc((*labels, decision))

    def key_turn(self, name: str, result: TurnResult) -> None:
        labels = self._caller(name)
        if labels is not None:
            self.key_tokens.inc(labels,
                                sum(r.input_tokens + r.output_tokens for r in result.ledger))
            self.key_cost.inc(labels, result.cost_usd)

    def request(self, path: str, status: int) -> None:
        self.requests.inc((self.route(path), str(status)))

    def first_token(self, provider: str | None, model: str | None, seconds: float) -> None:
        self.ttft.observe(self._labels(provider, model), seconds)

    def turn(self, result: TurnResult, seconds: float) -> None:
        self.turns.inc((result.outcome,))
        if result.fallback:
            self.fallbacks.inc()
        for attempt in result.attempts:
            self.attempts.inc((*self._labels(attempt.provider, attempt.model), attempt.outcome))
        for row in result.ledger:
            provider, model = self._labels(row.provider, row.model)
            self.tokens.inc((provider, model, "input"), row.input_tokens)
            self.tokens.inc((provider, model, "output"), row.output_tokens)
            self.cost.inc((provider, model), row.cost_usd)
        served = result.served
        self.turn_seconds.observe(
            self._labels(served.profile if served else None, served.model if served else None),
            seconds,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    """The counters and histograms, as Prometheus families at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        for kept in (m.requests, m.turns, m.attempts, m.fallbacks, m.tokens, m.cost, m.turn_seconds,
                     m.ttft,
                     m.key_requests, m.key_tokens, m.key_cost):
            yield kept.family()


class _LiveCollector:
    """Gauges read from the running gateway at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the live state exists only inside the gateway's trio loop

    def collect(self) -> Iterator[Metric]:
        live = self.metrics._live()
        state = GaugeMetricFamily("relayline_breaker_state",
                                  "Breaker state by profile: 0 closed, 1 half-open (probing or "
                                  "not), 2 open.",
                                  labels=["provider"])
        cooldown = GaugeMetricFamily("relayline_cooldown_seconds",
                                     "Rate-limit cooldown left by profile (0: none).",
                                     labels=["provider"])
        transitions = CounterMetricFamily("relayline_breaker_transitions",
                                          "Breaker state changes by profile.",
                                          labels=["provider"])
        for alias, profile in sorted(live["profiles"].items()):
            state.add_metric([alias], BREAKER_STATES[profile["breaker"]])
            cooldown.add_metric([alias], profile["cooldown_s"])
            transitions.add_metric([alias], profile["transitions"])
        in_flight = GaugeMetricFamily("relayline_in_flight",
                                      "Turns in flight (admitted, not yet answered).",
                                      value=live["in_flight"])
        remaining = GaugeMetricFamily("relayline_limit_remaining",
                                      "What the latest admission left of a named key's "
                                      "or team's limit (requests, tokens, budget_usd), by scope "
                                      "(key, team) and name.",
                                      labels=["scope", "name", "limit"])
        spend = GaugeMetricFamily("relayline_budget_spend_usd",
                                  "A named key's or team's spend in its budget period, "
                                  "as the latest admission or settlement found it.",
                                  labels=["scope", "name"])
        for item in live.get("limits", ()):
            for limit, field in (("requests", "requests_left"), ("tokens", "tokens_left"),
                                 ("budget_usd", "budget_left_usd")):
                if item[field] is not None:
                    remaining.add_metric([item["scope"], item["name"], limit], item[field])
            if item["spend_usd"] is not None and item["budget_usd"] is not None:
                spend.add_metric([item["scope"], item["name"]], item["spend_usd"])
        yield from (state, cooldown, transitions, in_flight, remaining, spend)
