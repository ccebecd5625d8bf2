"""`relayline simulate`: scenarios on virtual time through the real core and the real driver.

A scenario (docs/scenario-files.md) is a config, scripted sim upstreams and requests with
expectations. Everything runs under trio's MockClock with autojump, so backoffs, Retry-After waits,
cooldowns, breaker windows and timeouts take no real time, and the same scenario always gives the
same trace.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from relayline.machines.config import structure_config
from relayline.machines.errors import ConfigError
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult
from relayline.machines.wire import finish_reason

from ..codecs.common import TO_OPENAI
from ..driver import TurnRun
from ..providers.sim import SimUpstream, scripts_of
from ..relay import Relay, turns_of
from .server import SimHTTPServer, wire_to

REQUEST_KEYS = {"at", "model", "stream", "tools", "text", "cancel_after", "cancel_at",
                "operator_model",
                "concurrent", "expect"}
EXPECT_KEYS = {
    "attempts", "skipped", "outcome", "error", "served", "text", "partial_text", "events_text",
    "notice_contains", "no_notice", "ledger", "cost_usd", "warnings_contain", "init_error_contains",
    "keys", "attempt_at", "finish",
}
SCENARIO_KEYS = {"name", "config", "replies", "requests"}
SIM_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


class ScenarioError(Exception):
    """A scenario file is malformed (not a failed expectation)."""


@attrs.frozen
class Scenario:
    name: str
    source: str
    config: dict[str, Any]
    replies: tuple[dict[str, Any], ...]
    requests: tuple[dict[str, Any], ...]


def load_scenario(path: str | os.PathLike[str]) -> Scenario:
    source = str(path)
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    unknown = set(raw) - SCENARIO_KEYS
    if unknown:
        raise ScenarioError(f"{source}: unknown keys {sorted(unknown)}")
    for i, request in enumerate(raw.get("requests", [])):
        bad = set(request) - REQUEST_KEYS
        if bad:
            raise ScenarioError(f"{source}: requests[{i}]: unknown keys {sorted(bad)}")
        bad = set(request.get("expect", {})) - EXPECT_KEYS
        if bad:
            raise ScenarioError(f"{source}: requests[{i}].expect: unknown keys {sorted(bad)}")
    try:
        scripts_of(raw.get("replies", []))
    except ValueError as exc:
        raise ScenarioError(f"{source}: {exc}") from None
    return Scenario(raw.get("name", Path(path).stem), source, raw.get("config", {}),
                    tuple(raw.get("replies", [])), tuple(raw.get("requests", [])))


# ---------------------------------------------------------------------------------------------
# running


def _trace(result: TurnResult, events: list[Event], origin: float) -> dict[str, Any]:
    return {
        "requested": result.requested,
        "attempts": [{**a.as_json(), "at": round(a.at - origin, 6)} for a in result.attempts],
        "skipped": [
            {"provider": s.profile, "model": s.model, "reason": s.reason} for s in result.skipped
        ],
        "outcome": result.outcome,
        "error": result.error,
        "served": result.served.label if result.served else None,
        "text": result.text if result.outcome == "ok" else None,
        # OpenAI's words (docs/trace.md), e.g. an Anthropic stop_sequence reads "stop"
        "finish": TO_OPENAI[finish_reason(result.finish_reason, len(result.tool_calls))]
        if result.outcome == "ok"
        else None,
        "partial_text": result.partial_text,
        "events": [str(e) for e in events],
        "notice": result.notice,
        "ledger": [r.as_json() for r in result.ledger],
        "cost_usd": result.cost_usd,
    }


@attrs.frozen
class _Collector:
    """A scenario request's consumer: keeps the visible events, and cancels the turn after
    `cancel_after` of them. It never waits (`may_block`: the turn's idle deadline holds)."""

    events: list[Event]
    cancel_after: int | None
    consumer: trio.CancelScope
    may_block = False

    async def __call__(self, event: Event, /) -> None:
        if event.visible:
            self.events.append(event)
            if self.cancel_after is not None and len(self.events) >= self.cancel_after:
                self.consumer.cancel()


async def _run_request(relay: Relay, request: Mapping[str, Any], origin: float) -> dict[str, Any]:
    events: list[Event] = []
    runs: list[TurnRun] = []
    cancel_after = request.get("cancel_after")
    cancel_at = request.get("cancel_at")
    with trio.CancelScope() as consumer:

        sink = _Collector(events, cancel_after, consumer)

        async def cancel_later(delay: float) -> None:
            await trio.sleep(delay)
            consumer.cancel()

        async with trio.open_nursery() as nursery:
            if cancel_at is not None:
                nursery.start_soon(cancel_later, float(cancel_at))
            await turns_of(relay).run(
                [{"role": "user", "content": request.get("text", "hi")}],
                model=request.get("model"),
                tools=(SIM_TOOL,) if request.get("tools") else (),
                operator_model=request.get("operator_model"),
                stream=bool(request.get("stream", False)),
                sink=sink,
                run_hook=runs.append,
            )
            nursery.cancel_scope.cancel()
    result = runs[0].result
    assert result is not None  # (a run's result is set however the run ends)
    return _trace(result, events, origin)


def run_scenario(scenario: Scenario, *, on_done: Callable[[Relay, float], None] | None = None,
                 http: str | None = None) -> dict[str, Any]:
    """The scenario's trace (docs/trace.md), plus `init_error` when the config fails.
    `on_done(relay, now)` sees the relay after the last request (its health, on virtual time).
    With `http="openai"` or `"anthropic"`, sim profiles are served over real loopback HTTP in
    that protocol's shape instead of in process."""
    trace: dict[str, Any] = {"scenario": scenario.name, "warnings": [], "requests": []}

    async def main() -> None:
        origin = trio.current_time()
        async with trio.open_nursery() as nursery:
            config = scenario.config
            if http is not None:
                server = await SimHTTPServer(list(scenario.replies)).start(nursery)
                config = wire_to(config, server, lambda alias: http)
            try:
                relay = Relay(structure_config(config), env=os.environ,
                              clients=SimUpstream.from_replies(scenario.replies).clients())
            except ConfigError as exc:
                trace["init_error"] = str(exc)
                nursery.cancel_scope.cancel()
                return
            async with relay:
                trace["warnings"] = [str(w) for w in relay.router.warnings]
                done: list[dict[str, Any] | None] = [None] * len(scenario.requests)

                async def run(i: int, request: Mapping[str, Any]) -> None:
                    done[i] = await _run_request(relay, request, origin)

                # a concurrent request runs on while the next ones start: its result can arrive
                # late, after another turn changed the profile's health
                async with trio.open_nursery() as requests:
                    for i, request in enumerate(scenario.requests):
                        if "at" in request:
                            await trio.sleep_until(origin + float(request["at"]))
                        if request.get("concurrent"):
                            requests.start_soon(run, i, request)
                        else:
                            await run(i, request)
                trace["requests"] = done
                if on_done is not None:
                    on_done(relay, trio.current_time())
            nursery.cancel_scope.cancel()

    # over real sockets the virtual clock may only jump once the loopback has been idle a while
    threshold = 0 if http is None else 0.2
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=threshold))
    return trace


# ---------------------------------------------------------------------------------------------
# checking


def _attempt_label(a: dict[str, Any], with_mode: bool) -> str:
    label = f"{a['provider']}/{a['model']} {a['outcome']}"
    return f"{label} {a['mode']}" if with_mode else label


def check_request(expect: Mapping[str, Any], actual: dict[str, Any] | None,
                  trace: dict[str, Any]) -> list[tuple[str, object, object]]:
    """The failing keys of one request: (key, expected, actual)."""
    failures: list[tuple[str, object, object]] = []

    def differs(key: str, want: object, got: object) -> None:
        if want != got:
            failures.append((key, want, got))

    if "init_error_contains" in expect:
        err = trace.get("init_error")
        if err is None or expect["init_error_contains"] not in err:
            failures.append(("init_error_contains", expect["init_error_contains"], err))
    if "warnings_contain" in expect:
        missing = [
            w for w in expect["warnings_contain"] if not any(w in got for got in trace["warnings"])
        ]
        if missing:
            failures.append(("warnings_contain", missing, trace["warnings"]))
    request_keys = set(expect) - {"init_error_contains", "warnings_contain"}
    if not request_keys:
        return failures
    if actual is None:
        failures.append(("init_error", None, trace.get("init_error")))
        return failures
    if "attempts" in expect:
        got = [
            _attempt_label(a, len(w.split()) > 2)
            for w, a in zip(expect["attempts"], actual["attempts"], strict=False)
        ]
        got += [_attempt_label(a, False) for a in actual["attempts"][len(got):]]
        differs("attempts", list(expect["attempts"]), got)
    if "skipped" in expect:
        differs("skipped", list(expect["skipped"]),
                [f"{s['provider']}/{s['model']} {s['reason']}" for s in actual["skipped"]])
    for key in ("outcome", "error", "text", "finish"):
        if key in expect:
            differs(key, expect[key], actual[key])
    if "served" in expect:
        differs("served", expect["served"], actual["served"] or "none")
    if "partial_text" in expect:
        differs("partial_text", expect["partial_text"],
                actual["partial_text"] if actual["partial_text"] is not None else "none")
    if "events_text" in expect:
        differs("events_text", expect["events_text"],
                "".join(e[len("text:"):] for e in actual["events"] if e.startswith("text:")))
    if "notice_contains" in expect:
        wanted = expect["notice_contains"]
        wanted = [wanted] if isinstance(wanted, str) else list(wanted)
        notice = actual["notice"] or ""
        if not all(w in notice for w in wanted):
            failures.append(("notice_contains", wanted, actual["notice"]))
    if expect.get("no_notice"):
        differs("no_notice", None, actual["notice"])
    if "ledger" in expect:
        differs(
            "ledger",
            list(expect["ledger"]),
            [
                f"{r['provider']}/{r['model']} {'accepted' if r['accepted'] else 'rejected'}"
                for r in actual["ledger"]
            ],
        )
    if "cost_usd" in expect and abs(float(expect["cost_usd"]) - actual["cost_usd"]) > 1e-9:
        failures.append(("cost_usd", expect["cost_usd"], actual["cost_usd"]))
    if "keys" in expect:
        # TOML has no null: "null" (or "none") stands for an attempt without a pool key
        want = [None if k in ("null", "none") else k for k in expect["keys"]]
        differs("keys", want, [a["key"] for a in actual["attempts"]])
    if "attempt_at" in expect:
        got_at: list[float] = [a["at"] for a in actual["attempts"]]
        want_at = [float(x) for x in expect["attempt_at"]]
        if len(got_at) != len(want_at) or any(
                abs(w - g) > 0.05 for w, g in zip(want_at, got_at, strict=False)):
            failures.append(("attempt_at", want_at, got_at))
    return failures


@attrs.frozen
class ScenarioReport:
    scenario: Scenario
    trace: dict[str, Any]
    failures: tuple[tuple[int, str, object, object], ...]  # (request index, key, expected, actual)

    @property
    def ok(self) -> bool:
        return not self.failures


def check_scenario(scenario: Scenario, *, http: str | None = None) -> ScenarioReport:
    trace = run_scenario(scenario, http=http)
    failures = []
    for i, request in enumerate(scenario.requests):
        actual = trace["requests"][i] if i < len(trace["requests"]) else None
        for key, want, got in check_request(request.get("expect", {}), actual, trace):
            failures.append((i, key, want, got))
    return ScenarioReport(scenario, trace, tuple(failures))


def main(paths: list[str], *, as_json: bool = False, http: str | None = None,
         out: Callable[[str], object] = print) -> int:
    if as_json:
        traces = [run_scenario(load_scenario(p), http=http) for p in paths]
        out(json.dumps(traces[0] if len(traces) == 1 else traces, indent=2))
        return 0
    passed = failed = 0
    for path in paths:
        try:
            report = check_scenario(load_scenario(path), http=http)
        except ScenarioError as exc:
            out(f"ERROR {exc}")
            failed += 1
            continue
        if report.ok:
            passed += 1
            out(f"PASS {path}: {report.scenario.name}")
            continue
        failed += 1
        out(f"FAIL {path}: {report.scenario.name}")
        for i, key, want, got in report.failures:
            out(f"  requests[{i}] {key}:\n    expected {json.dumps(want)}\n    actual   "
                f"{json.dumps(got)}")
    out(f"{passed} of {passed + failed} scenarios pass")
    return 0 if failed == 0 else 1
