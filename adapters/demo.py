"""`relayline demo` / `make demo`: the storyline of adapters/demo.toml on the built-in sim
upstreams, on virtual time, printed as an operator would read it. No credentials, no network.

The storyline: a healthy primary; an outage retried and served by the backup (with a notice);
the breaker opening while the backup is rate limited and cools down; both skipped before
anything is sent; a stream failing before output, recovered out of the consumer's sight; a
stream cut after output, ending as a clean interruption; the primary probed and back.
"""

from __future__ import annotations

from importlib import resources

from .simulate import check_request, load_scenario, run_scenario


def _attempts(request: dict) -> str:
    parts = [f"{a['provider']}/{a['model']} {a['outcome']}" + (" (stream)" if a["mode"] == "stream" else "")
             for a in request["attempts"]]
    return " -> ".join(parts) or "-"


def builtin_relay():
    """`relayline serve` with no --config: the demo profiles on in-process sim upstreams."""
    from relayline.machines.config import structure_config

    from .relay import Relay

    scenario = load_scenario(str(resources.files("relayline.adapters").joinpath("demo.toml")))
    return Relay(structure_config(scenario.config), env={})


def main(out=print, simulated: bool = True) -> int:
    path = resources.files("relayline.adapters").joinpath("demo.toml")
    scenario = load_scenario(str(path))
    health_view: list[str] = []

    def capture(relay, now: float) -> None:
        for alias in sorted(relay.config.providers):
            breaker = relay.health.breaker(alias)
            breaker.refresh(now)
            cooling = relay.health.cooldown_until(alias) - now
            cooldown = f"{cooling:.0f}s left" if cooling > 0 else "none"
            health_view.append(
                f"  {alias:<20} breaker={breaker.state:<9} recent_failures={len(breaker.failures)} cooldown={cooldown}"
            )

    trace = run_scenario(scenario, on_done=capture)
    out(f"relayline {scenario.name}")
    out("(sim upstreams on virtual time: backoffs, cooldowns and breaker windows take no real time)\n")
    failures = 0
    for i, (request, actual) in enumerate(zip(scenario.requests, trace["requests"], strict=True), start=1):
        out(f"{i}. t={request.get('at', 0):>4.0f}s {'stream' if request.get('stream') else 'complete'}: {request.get('text')}")
        out(f"   requested: {actual['requested']}")
        out(f"   attempts:  {_attempts(actual)}")
        if actual["skipped"]:
            out("   skipped:   " + ", ".join(f"{s['provider']} ({s['reason']})" for s in actual["skipped"]))
        served = actual["served"] or "none"
        out(f"   outcome:   {actual['outcome']}" + (f" ({actual['error']})" if actual["error"] else "") + f", served by {served}")
        if actual["text"]:
            out(f"   answer:    {actual['text']!r}")
        if actual["partial_text"]:
            out(f"   partial:   {actual['partial_text']!r} (persisted; the request is not replayed)")
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
    out(f"\ntotal cost ${total:.6f}; the gateway version of this demo (`relayline serve`) is issue 7.")
    return 1 if failures else 0
