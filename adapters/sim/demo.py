"""`relayline demo` / `make demo`: the storyline an operator would want to see, with no
credentials and no network beyond loopback.

By default it starts loopback sim upstreams (an Anthropic-shaped primary, OpenAI-shaped backup
and spare) with scripted faults and the real gateway in front of them, then drives the storyline
with the official openai SDK, in real time (about ten seconds): a healthy primary; an outage
retried and served by the backup (with a notice); the breaker opening while the backup is rate
limited and cools down; both skipped before anything is sent; a stream failing before output,
recovered out of the client's sight; a stream cut after output, surfacing as an error in the SDK;
the primary probed and back. `--simulated` runs adapters/sim/demo.toml in process on virtual time.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from .simulate import check_request, load_scenario, run_scenario

if TYPE_CHECKING:
    from ..relay import Relay

# where the storyline is written: print, or a test's collector
Out = Callable[[str], object]


def _attempts(request: dict[str, Any]) -> str:
    parts = [
        f"{a['provider']}/{a['model']} {a['outcome']}"
        + (" (stream)" if a["mode"] == "stream" else "")
        for a in request["attempts"]
    ]
    return " -> ".join(parts) or "-"


def builtin_relay() -> Relay:
    """`relayline serve` with no --config: the demo profiles on in-process sim upstreams."""
    from relayline.machines.config import structure_config

    from ..relay import Relay

    scenario = load_scenario(str(resources.files("relayline.adapters.sim").joinpath("demo.toml")))
    return Relay(structure_config(scenario.config), env={})


def main(out: Out = print, simulated: bool = False) -> int:
    if not simulated:
        try:
            import openai  # noqa: F401 - the gateway storyline needs the official SDK
        except ImportError:
            out("the openai SDK is not installed (pip install openai, to drive a real gateway with "
                "it): "
                "running the storyline in process on virtual time\n")
        else:
            return gateway_main(out)
    return simulated_main(out)


def simulated_main(out: Out = print) -> int:
    path = resources.files("relayline.adapters.sim").joinpath("demo.toml")
    scenario = load_scenario(str(path))
    health_view: list[str] = []

    def capture(relay: Relay, now: float) -> None:
        for alias in sorted(relay.config.providers):
            breaker = relay.health.breaker(alias)
            breaker.refresh(now)
            cooling = relay.health.cooldown_until(alias) - now
            cooldown = f"{cooling:.0f}s left" if cooling > 0 else "none"
            health_view.append(
                f"  {alias:<20} breaker={breaker.state:<9} recent_failures={len(breaker.failures)} "
                f"cooldown={cooldown}"
            )

    trace = run_scenario(scenario, on_done=capture)
    out(scenario.name)
    out("(sim upstreams on virtual time: backoffs, cooldowns and breaker windows take no real "
        "time)\n")
    failures = 0
    for i, (request, actual) in enumerate(zip(scenario.requests, trace["requests"], strict=True),
                                          start=1):
        out(f"{i}. t={request.get('at', 0):>4.0f}s "
            f"{'stream' if request.get('stream') else 'complete'}: {request.get('text')}")
        out(f"   requested: {actual['requested']}")
        out(f"   attempts:  {_attempts(actual)}")
        if actual["skipped"]:
            out(
                "   skipped:   "
                + ", ".join(f"{s['provider']} ({s['reason']})" for s in actual["skipped"])
            )
        served = actual["served"] or "none"
        out(
            f"   outcome:   {actual['outcome']}"
            + (f" ({actual['error']})" if actual["error"] else "")
            + f", served by {served}"
        )
        if actual["text"]:
            out(f"   answer:    {actual['text']!r}")
        if actual["partial_text"]:
            out(
                f"   partial:   {actual['partial_text']!r} (persisted; the request is not replayed)"
            )
        if actual["notice"]:
            out(f"   notice:    {actual['notice']}")
        out(f"   cost:      ${actual['cost_usd']:.6f} over {len(actual['ledger'])} ledger rows")
        bad = check_request(request.get("expect", {}), actual, trace)
        for key, want, got in bad:
            out(f"   UNEXPECTED {key}: expected {want!r}, got {got!r}")
        failures += bool(bad)
        out("")
    out("health after the storyline:")
    for line in health_view:
        out(line)
    total = sum(r["cost_usd"] for r in trace["requests"])
    out(f"\ntotal cost ${total:.6f} (the same storyline through the gateway: `relayline demo`)")
    return 1 if failures else 0


# -- the gateway storyline ---------------------------------------------------------------------

GATEWAY_CONFIG: dict[str, Any] = {
    "active": "anthropic.primary",
    "reliability": {"provider_retries": 1, "backoff_ms": 100},
    "breaker": {"failure_threshold": 2, "open_s": 4},
    "notices": {"model_fallback_notice": "detailed"},
    "providers": {
        "anthropic.primary": {
            "family": "sim",
            "model": "claude-sonnet-4",
            "fallbacks": ["openai.backup", "openrouter.spare"],
            "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0},
        },
        "openai.backup": {
            "family": "sim",
            "model": "gpt-4o-mini",
            "price": {"input_per_mtok": 0.15, "output_per_mtok": 0.6},
        },
        "openrouter.spare": {
            "family": "sim",
            "model": "llama-3.3-70b",
            "price": {"input_per_mtok": 0.6, "output_per_mtok": 0.8},
        },
    },
}
GATEWAY_REPLIES: list[dict[str, Any]] = [
    {
        "provider": "anthropic.primary",
        "script": [
            {"text": "Hello from the primary."},
            {"status": 503},
            {"status": 503},
            {"status": 503},
            {"text": "The primary is back."},
        ],
    },
    {
        "provider": "openai.backup",
        "script": [
            {"text": "The backup answers while the primary is down."},
            {"status": 429, "retry_after": 2},
            {"frames": [{"role": True}, {"ping": True}, {"error": "overloaded_error"}]},
            {
                "frames": [
                    {"role": True},
                    {"text": "Streaming a long"},
                    {"text": " answer"},
                    {"error": "overloaded_error"},
                ]
            },
        ],
    },
    {"provider": "openrouter.spare", "script": [{"text": "The spare answers."}]},
]
# (pause before, stream?, what it shows)
STORY = [
    (0.0, False, "a healthy primary"),
    (0.0, False, "the primary goes down: retried, then the backup serves"),
    (0.0, False, "still down: the breaker opens; the backup is rate limited and cools down"),
    (0.0, False, "the open breaker and the cooldown are skipped before anything is sent"),
    (2.2, True, "a stream fails before any output: recovered without the client seeing it"),
    (0.0, True, "a stream is cut after output: the SDK sees an error, never a replay"),
    (4.2, False, "open_s has passed: one probe, and the primary is back"),
]


def gateway_main(out: Out = print) -> int:
    import tempfile
    import time

    import httpx
    import openai
    from openai.types.chat import ChatCompletionMessageParam

    from ..stores.ledger import LedgerStore
    from .background import BackgroundGateway

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    seen = {"fallback": 0, "breaker_skip": 0, "interrupted": 0}
    with tempfile.TemporaryDirectory() as tmp, \
            BackgroundGateway(GATEWAY_CONFIG, GATEWAY_REPLIES,
                              ledger_path=f"{tmp}/ledger.sqlite3") as gw:
        assert gw.sim is not None  # (started with the gateway)
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="demo", max_retries=0, timeout=30)
        out(f"relayline demo: gateway at {gw.url}, sim upstreams at 127.0.0.1:{gw.sim.port}, "
            "client: openai SDK\n")
        for n, (pause, stream, story) in enumerate(STORY, start=1):
            time.sleep(pause)
            out(f"{n}. {'stream' if stream else 'complete'}: {story}")
            extra: dict[str, Any] = {}
            text, error = "", None
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="claude-sonnet-4", messages=messages, stream=stream
                )
                headers = raw.headers
                parsed = raw.parse()
                if isinstance(parsed, openai.Stream):
                    try:
                        for chunk in parsed:
                            if chunk.choices:
                                text += chunk.choices[0].delta.content or ""
                            extra = (chunk.model_extra or {}).get("relayline") or extra
                    except openai.APIError as exc:
                        error = f"stream error from the gateway: {exc.message}"
                else:
                    text = parsed.choices[0].message.content or ""
                    extra = (parsed.model_extra or {})["relayline"]
            except openai.APIStatusError as exc:
                headers, error = exc.response.headers, f"HTTP {exc.status_code}: {exc.message}"
            out(f"   requested: {headers.get('x-relayline-requested', '?')}")
            if extra.get("attempts"):
                out(f"   attempts:  {' -> '.join(extra['attempts'])}")
            if extra.get("skipped"):
                out(f"   skipped:   {', '.join(extra['skipped'])} (nothing sent)")
                seen["breaker_skip"] += sum("breaker" in s for s in extra["skipped"])
            out(f"   served:    {extra.get('served') or headers.get('x-relayline-served', 'none')}")
            if text:
                out(f"   {'partial:' if error else 'answer: '}   {text!r}")
            if error:
                out(f"   error:     {error}")
                seen["interrupted"] += stream and bool(text)
            if extra.get("notice"):
                out(f"   notice:    {extra['notice']}")
            if extra.get("cost_usd") is not None:
                out(f"   cost:      ${extra['cost_usd']:.6f}")
            seen["fallback"] += bool(extra.get("fallback"))
            out("")
        health = httpx.get(f"{gw.url}/admin/health").json()
        ledger = LedgerStore(f"{tmp}/ledger.sqlite3").report()
    out("health (GET /admin/health):")
    for alias, h in health["profiles"].items():
        rate = "n/a" if h["success_rate"] is None else f"{h['success_rate']:.0%}"
        out(f"  {alias:<20} breaker={h['breaker']:<9} cooldown={h['cooldown_s']:>4.1f}s "
            f"attempts={h['attempts_in_window']:<2} success={rate}")
    out("\nledger (SQLite, per profile and model):")
    for row in ledger:
        out(f"  {row['provider']:<20} {row['model']:<16} accepted={row['accepted']} "
            f"rejected={row['rejected']} "
            f"cost=${row['accepted_cost_usd'] + row['rejected_cost_usd']:.6f}")
    ok = seen["fallback"] > 0 and seen["breaker_skip"] > 0 and seen["interrupted"] > 0
    out(f"\nshown: {seen['fallback']} fallbacks, {seen['breaker_skip']} breaker skips, "
        f"{seen['interrupted']} interruption{'s' if seen['interrupted'] != 1 else ''}")
    return 0 if ok else 1
