"""One Relay, three hosts: the same library scenarios under trio, asyncio and synchronous code
give the same trace (events received, what was raised, the turn's result, the upstream calls).

Real time with short waits (the asyncio and sync hosts run turns in relayline's runtime thread,
which has no virtual clock); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
import trio

from helpers import sim_toml
from relayline.adapters import (
    InMemoryHealth,
    Relay,
    StreamInterruptedAfterOutput,
    TurnError,
    parse_config,
)
from relayline.adapters.providers.sim import SimUpstream

TWO = sim_toml("m1", "m2", reliability={"provider_retries": 0})
HI = [{"role": "user", "content": "hi"}]
SLOW = 0.5  # an upstream pause no scenario waits out: the cancellations land inside it
SOON = 0.05

# name -> (scripts, action); actions: complete | stream | leave_after_2 | host_cancel | host_cancel_stream
SCENARIOS = {
    "complete": ({"sim.a": [{"text": "hello", "reasoning": "hmm"}]}, "complete"),
    "complete fails": ({"sim.a": [{"status": 400, "error": "context_length_exceeded"}]}, "complete"),
    "complete falls back": ({"sim.a": [{"status": 503}], "sim.b": [{"text": "from b"}]}, "complete"),
    "stream": ({"sim.a": [{"text": "hello there", "reasoning": "hmm"}]}, "stream"),
    "stream falls back before commit": (
        {"sim.a": [{"frames": [{"role": True}, {"error": "overloaded_error"}]}], "sim.b": [{"text": "from b"}]},
        "stream"),
    "stream interrupted after commit": (
        {"sim.a": [{"frames": [{"role": True}, {"text": "partial"}, {"error": "overloaded_error"}]}]}, "stream"),
    "stream left early": (
        {"sim.a": [{"frames": [{"role": True}, {"text": "one"}, {"text": " two"}, {"wait": SLOW},
                               {"text": " three"}, {"done": True}]}]}, "leave_after_2"),
    "host cancels complete": ({"sim.a": [{"delay": SLOW, "text": "late"}]}, "host_cancel"),
    "host cancels stream": (
        {"sim.a": [{"frames": [{"role": True}, {"text": "one"}, {"wait": SLOW}, {"text": " two"}, {"done": True}]}]},
        "host_cancel_stream"),
}


def new_relay(scripts):
    sim = SimUpstream.from_replies([{"provider": p, "script": s} for p, s in scripts.items()])
    relay = Relay.from_toml(TWO, env={}, clients=sim.clients())
    results = []
    relay.observers.append(results.append)
    return relay, results


def trace(relay, results, received, raised):
    (result,) = results
    return {
        "received": received,
        "raised": None if raised is None else (type(raised).__name__, getattr(raised, "reason", None)),
        "outcome": result.outcome,
        "error": result.error,
        "text": result.text,
        "partial_text": result.partial_text,
        "served": result.served.label if result.served else None,
        "attempts": [(a.provider, a.mode, a.outcome) for a in result.attempts],
        "calls": [(c.provider, c.mode) for c in relay.clients["sim"].upstream.calls],
    }


async def async_scenario(scripts, action, within):
    """The scenario through the async API; `within(fn, seconds)` awaits fn() and cancels it,
    in the host's own way, after `seconds`."""
    relay, results = new_relay(scripts)
    received, raised = [], None

    async def stream(leave_after=None):
        async with relay.stream(HI) as turn:
            async for event in turn:
                received.append((event.kind, event.value))
                if len(received) == leave_after:
                    break

    try:
        if action == "complete":
            reply = await relay.complete(HI)
            received.append(("reply", reply.text))
        elif action == "stream":
            await stream()
        elif action == "leave_after_2":
            await stream(leave_after=2)
        elif action == "host_cancel":
            await within(lambda: relay.complete(HI), SOON)
        elif action == "host_cancel_stream":
            await within(stream, SLOW / 2)
    except TurnError as exc:
        raised = exc
    await relay.aclose()
    return trace(relay, results, received, raised)


async def trio_within(fn, seconds):
    with trio.move_on_after(seconds):
        await fn()


async def asyncio_within(fn, seconds):
    try:
        await asyncio.wait_for(fn(), seconds)
    except TimeoutError:
        pass


@pytest.fixture(autouse=True)
def sigint_raises_keyboard_interrupt():
    """Python's own SIGINT handler for these tests: a process started in the background by a
    shell without job control (`cmd &` in a script, as a CI runner may) inherits SIGINT ignored,
    and Python then installs no handler, so the host's interrupt would never arrive."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def interrupt_main_after(seconds):
    """SIGINT to this (main) thread: a blocked synchronous call sees KeyboardInterrupt."""
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def sync_scenario(scripts, action):
    relay, results = new_relay(scripts)
    received, raised = [], None

    def stream(leave_after=None):
        with relay.stream_sync(HI) as turn:
            for event in turn:
                received.append((event.kind, event.value))
                if len(received) == leave_after:
                    break

    with relay:
        try:
            if action == "complete":
                received.append(("reply", relay.complete_sync(HI).text))
            elif action == "stream":
                stream()
            elif action == "leave_after_2":
                stream(leave_after=2)
            elif action in ("host_cancel", "host_cancel_stream"):
                timer = interrupt_main_after(SOON if action == "host_cancel" else SLOW / 2)
                with pytest.raises(KeyboardInterrupt):
                    relay.complete_sync(HI) if action == "host_cancel" else stream()
                timer.join()
        except TurnError as exc:
            raised = exc
    return trace(relay, results, received, raised)


EXPECTED = {
    "complete": {"received": [("reply", "hello")], "outcome": "ok", "calls": [("sim.a", "complete")]},
    "complete fails": {"raised": ("TurnError", "context_window"), "outcome": "error"},
    "complete falls back": {"received": [("reply", "from b")], "served": "sim.b/m2",
                            "calls": [("sim.a", "complete"), ("sim.b", "complete")]},
    "stream": {"received": [("reasoning", "hmm"), ("text", "hello"), ("text", " there")], "outcome": "ok"},
    "stream falls back before commit": {"received": [("text", "from b")], "served": "sim.b/m2",
                                        "calls": [("sim.a", "stream"), ("sim.b", "complete")]},
    "stream interrupted after commit": {"received": [("text", "partial")], "partial_text": "partial",
                                        "raised": ("StreamInterruptedAfterOutput", "interrupted"),
                                        "outcome": "interrupted", "calls": [("sim.a", "stream")]},
    "stream left early": {"received": [("text", "one"), ("text", " two")], "outcome": "cancelled",
                          "partial_text": "one two", "calls": [("sim.a", "stream")]},
    "host cancels complete": {"received": [], "outcome": "cancelled", "calls": [("sim.a", "complete")]},
    "host cancels stream": {"received": [("text", "one")], "outcome": "cancelled", "partial_text": "one",
                            "calls": [("sim.a", "stream")]},
}


@pytest.fixture(scope="module")
def trio_traces():
    return {name: trio.run(async_scenario, *scenario, trio_within) for name, scenario in SCENARIOS.items()}


@pytest.mark.parametrize("name", SCENARIOS)
def test_trio_trace_is_the_expected_story(trio_traces, name):
    got = trio_traces[name]
    for key, value in EXPECTED[name].items():
        if value is not None:
            assert got[key] == value, key
    assert got["outcome"] != "cancelled" or len(got["calls"]) == 1  # a cancelled turn is never retried


@pytest.mark.parametrize("name", SCENARIOS)
def test_asyncio_host_gives_the_trio_trace(trio_traces, name):
    assert asyncio.run(async_scenario(*SCENARIOS[name], asyncio_within)) == trio_traces[name]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
@pytest.mark.parametrize("name", SCENARIOS)
def test_sync_host_gives_the_trio_trace(trio_traces, name):
    assert sync_scenario(*SCENARIOS[name]) == trio_traces[name]


def test_stream_interruption_is_raised_to_every_host_with_the_partial_text(trio_traces):
    assert trio_traces["stream interrupted after commit"]["raised"][0] == StreamInterruptedAfterOutput.__name__


def test_complete_sync_from_many_threads_at_once_shares_one_relay():
    relay, results = new_relay({"sim.a": [{"delay": SOON, "text": "hi"}]})
    replies: list[str] = []

    def worker():
        for _ in range(5):
            replies.append(relay.complete_sync(HI).text)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert replies == ["hi"] * 40 and [r.outcome for r in results] == ["ok"] * 40
    assert len(relay.clients["sim"].upstream.calls) == 40


def test_blocking_calls_refuse_to_stall_an_event_loop():
    relay, _ = new_relay({})

    async def inside():
        with pytest.raises(RuntimeError, match="await relay.complete"):
            relay.complete_sync(HI)
        with pytest.raises(RuntimeError, match="async with relay.stream"):
            with relay.stream_sync(HI):
                pass

    asyncio.run(inside())
    trio.run(inside)


def test_an_exception_in_the_block_propagates_as_it_was_under_asyncio():
    async def scenario():
        relay, results = new_relay({"sim.a": [{"frames": [{"role": True}, {"text": "one"}, {"wait": SLOW},
                                                          {"done": True}]}]})
        with pytest.raises(KeyError):
            async with relay.stream(HI) as turn:
                async for _ in turn:
                    raise KeyError("the consumer's own")
        return turn.outcome, [r.outcome for r in results], len(relay.clients["sim"].upstream.calls)

    assert asyncio.run(scenario()) == ("cancelled", ["cancelled"], 1)


@pytest.mark.parametrize("shared", [True, False])
def test_relays_built_per_request_keep_breakers_only_through_a_shared_health_store(shared):
    """The FastAPI pattern of one Relay per request: a shared health store keeps what earlier
    requests learned (sim.a's breaker opened after 2 failures), a relay of its own forgets it."""
    config = parse_config(sim_toml("m1", "m2", reliability={"provider_retries": 0},
                                   breaker={"failure_threshold": 2, "open_s": 60}))
    health = InMemoryHealth(config.breaker)
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"status": 503}]}])

    async def request():
        async with Relay(config, env={}, clients=sim.clients(), health=health if shared else None) as relay:
            return (await relay.complete(HI)).served

    async def service():
        return [await request() for _ in range(5)]

    assert asyncio.run(service()) == ["sim.b/m2"] * 5
    tried_a = sum(1 for c in sim.calls if c.provider == "sim.a")
    assert tried_a == (2 if shared else 5)
