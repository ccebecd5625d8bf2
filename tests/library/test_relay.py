"""The embedder's API (docs/library.md), on virtual time with sim upstreams."""

import logging

import pytest
import trio

from helpers import finalized_async_generators, sim_toml
from relayline.adapters import Relay
from relayline.adapters.providers.sim import SimUpstream
from relayline.machines import wire
from relayline.machines.errors import RelaylineError, StreamInterruptedAfterOutput, TurnError

A = {"model": "m1", "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}
TABLES = {"reliability": {"provider_retries": 1}, "notices": {"model_fallback_notice": "detailed"}}
TWO = sim_toml(A, "m2", **TABLES)
HI = [{"role": "user", "content": "hi"}]


def relay_with(scripts, text=TWO, **kwargs):
    sim = SimUpstream.from_replies([{"provider": p, "script": s} for p, s in scripts.items()])
    return Relay.from_toml(text, env={}, clients=sim.clients(), **kwargs)


async def test_complete_returns_attribution_notice_and_ledger(autojump_clock):
    relay = relay_with({"sim.a": [{"status": 503}], "sim.b": [{"text": "from b", "usage": [100, 50]}]})
    reply = await relay.complete(HI)
    assert (reply.text, reply.requested, reply.served, reply.fallback) == ("from b", "sim.a/m1", "sim.b/m2", True)
    assert "sim.a/m1" in reply.notice and "sim.b/m2" in reply.notice
    assert reply.outbound_text == f"from b\n\n{reply.notice}"
    assert [r.accepted for r in reply.ledger] == [True] and reply.cost_usd == 0.0
    assert relay.fallback_record == {"sim.a": "sim.b/m2"}


async def test_a_later_primary_success_clears_the_fallback_record(autojump_clock):
    relay = relay_with({"sim.a": [{"status": 503}, {"status": 503}, {"text": "primary"}]})
    await relay.complete(HI)
    assert relay.fallback_record
    reply = await relay.complete(HI)
    assert reply.served == "sim.a/m1" and reply.notice is None and not relay.fallback_record


async def test_failure_raises_a_typed_error_with_reason(autojump_clock):
    relay = relay_with({"sim.a": [{"status": 400, "error": "context_length_exceeded"}]})
    with pytest.raises(TurnError) as info:
        await relay.complete(HI)
    assert info.value.reason == "context_window" and isinstance(info.value, RelaylineError)
    assert len(info.value.attempts) == 1


async def test_the_aggregated_error_is_bounded_and_names_each_attempt(autojump_clock):
    text = sim_toml({"model": "m", "fallback_models": [f"f{i}" for i in range(30)]})
    relay = relay_with({"sim.a": [{"status": 503, "error": "upstream body with sk-should-not-appear"}]}, text)
    with pytest.raises(TurnError) as info:
        await relay.complete(HI)
    message = str(info.value)
    assert info.value.reason == "exhausted" and len(info.value.attempts) == 93
    assert len(message) <= 2000 and "... and 77 more" in message
    assert "#1 sim.a/m try 1/3 retryable (HTTP 503)" in message
    assert "sk-should-not-appear" not in message and "upstream body" not in message


async def test_stream_yields_immutable_events_and_the_outcome(autojump_clock):
    relay = relay_with({"sim.a": [{"text": "hello there", "reasoning": "hmm"}]})
    drafts = []
    async with relay.stream(HI, on_draft=drafts.append) as turn:
        events = [(e.kind, e.value) async for e in turn]
    assert events == [("reasoning", "hmm"), ("text", "hello"), ("text", " there")]
    assert turn.outcome == "ok" and turn.served == "sim.a/m1" and turn.partial_text is None
    assert drafts == ["hello", "hello there"] and [r.accepted for r in turn.ledger] == [True]


async def test_leaving_the_block_early_cancels_and_keeps_exactly_what_was_received(autojump_clock):
    relay = relay_with({"sim.a": [{"frames": [{"role": True}, {"text": "one"}, {"text": " two"}, {"wait": 5},
                                              {"text": " three"}, {"done": True}]}]})
    async with relay.stream(HI) as turn:
        async for event in turn:
            if event.value == " two":
                break
    assert turn.outcome == "cancelled" and turn.partial_text == "one two"
    assert [a.outcome for a in turn.result.attempts] == ["cancelled"]
    assert len(relay.clients["sim"].upstream.calls) == 1  # cancellation never causes a provider call


async def test_outer_cancellation_of_complete_is_recorded_and_never_retried(autojump_clock):
    relay = relay_with({"sim.a": [{"delay": 10, "text": "late"}]})
    seen = []
    relay.observers.append(seen.append)
    with trio.move_on_after(1):
        await relay.complete(HI)
    assert [r.outcome for r in seen] == ["cancelled"] and len(relay.clients["sim"].upstream.calls) == 1


async def test_interruption_after_output_raises_at_the_end_of_the_stream_and_is_not_replayed(autojump_clock):
    relay = relay_with({"sim.a": [{"frames": [{"role": True}, {"text": "partial"}, {"error": "overloaded_error"}]}]})
    received = []
    with pytest.raises(StreamInterruptedAfterOutput) as info:
        async with relay.stream(HI) as turn:
            async for event in turn:
                received.append(event.value)
    assert (turn.outcome, turn.partial_text, received) == ("interrupted", "partial", ["partial"])
    assert info.value.partial_text == "partial" and info.value.reason == "interrupted"
    assert len(relay.clients["sim"].upstream.calls) == 1


async def test_a_stream_that_never_answered_raises_turn_error(autojump_clock):
    relay = relay_with({"sim.a": [{"status": 400, "error": "context_length_exceeded"}]})
    with pytest.raises(TurnError) as info:
        async with relay.stream(HI) as turn:
            async for _ in turn:
                raise AssertionError("no event was expected")
    assert info.value.reason == "context_window" and turn.outcome == "error"


async def test_an_exception_in_the_block_propagates_as_it_was_and_cancels_the_turn(autojump_clock):
    relay = relay_with({"sim.a": [{"frames": [{"role": True}, {"text": "one"}, {"wait": 5}, {"done": True}]}]})
    with pytest.raises(KeyError):
        async with relay.stream(HI) as turn:
            async for _ in turn:
                raise KeyError("the consumer's own")
    assert turn.outcome == "cancelled" and len(relay.clients["sim"].upstream.calls) == 1


async def test_secrets_never_reach_logs_errors_or_results(autojump_clock, caplog):
    text = sim_toml({**A, "api_key_env": "RELAYLINE_TEST_KEY"}, "m2", **TABLES)
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"status": 401, "error": "bad key sk-live-xyz"}]},
                                    {"provider": "sim.b", "script": [{"status": 503}]}])
    caplog.set_level(logging.DEBUG)
    relay = Relay.from_toml(text, env={"RELAYLINE_TEST_KEY": "sk-live-xyz"}, clients=sim.clients())
    with pytest.raises(TurnError) as info:
        await relay.complete(HI)
    exposed = caplog.text + str(info.value) + repr(info.value.attempts) + repr(relay.router) + repr(relay.plan())
    assert "sk-live-xyz" not in exposed


async def test_operator_selection_scopes(autojump_clock):
    text = sim_toml(A, "m2", **TABLES, routes=[{"hint": "b", "provider": "sim.b", "model": "m2"}])
    relay = relay_with({}, text)
    relay.select("hint:b")
    assert (await relay.complete(HI)).served == "sim.b/m2"
    relay.select("auto")
    assert (await relay.complete(HI)).served == "sim.a/m1"


async def test_a_continuation_carries_exactly_the_forwarded_text(autojump_clock):
    text = sim_toml(A, {"model": "m2", "capabilities": {"prefill": True}}, **TABLES,
                    stream={"continue_after_interrupt": True})
    relay = relay_with({"sim.a": [{"frames": [{"role": True}, {"text": "Hello "}, {"text": "wor"},
                                              {"error": "overloaded_error"}]}],
                        "sim.b": [{"text": "ld."}]}, text)
    sent = []
    sim_client = relay.clients["sim"]

    class Recording:
        async def complete(self, request):
            return await sim_client.complete(request)

        def stream(self, request):
            sent.append(request.request.messages)
            return sim_client.stream(request)

    relay.clients["sim"] = Recording()
    async with relay.stream(HI) as turn:
        received = "".join([e.value async for e in turn])
    assert received == "Hello world." and turn.outcome == "ok" and turn.served == "sim.b/m2"
    assert sent[1][-1] == wire.Message("assistant", (wire.Part("text", "Hello wor"),)) and sent[1][:-1] == sent[0]


async def test_turn_cancel_stops_the_stream_and_keeps_the_partial(autojump_clock):
    relay = relay_with({"sim.a": [{"frames": [{"role": True}, {"text": "kept"}, {"wait": 5}, {"text": " lost"},
                                              {"done": True}]}]})
    async with relay.stream(HI) as turn:
        async for event in turn:
            assert event.value == "kept"
            turn.cancel()
    assert turn.outcome == "cancelled" and turn.partial_text == "kept"


def test_clients_come_from_the_family_registry():
    """The library builds one client per family its profiles use, from machines/families.py: the
    library and the gateway never import the scripted sim family."""
    import subprocess
    import sys

    from relayline.machines.families import FAMILIES

    code = ("import sys, relayline.adapters.relay, relayline.adapters.gateway.app; "
            "print(sorted(m for m in sys.modules if m.startswith('relayline.adapters.sim')"
            " or m == 'relayline.adapters.providers.sim'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    relay = Relay.from_toml(sim_toml("m"), env={})
    assert set(relay.clients) == {"sim"} and relay.clients["sim"].upstream.calls == []
    assert {f.wire for f in FAMILIES.values()} == {"openai", "anthropic", None}


async def test_a_sim_stream_that_ended_leaves_no_frames_for_trios_finalizer():
    """A stream read to its completion signal leaves the family's frames at their last yield:
    the family closes them as the stream exits, so none is handed to trio's finalizer (which
    fails once the run has ended: "run() has exited")."""
    with finalized_async_generators() as finalized:
        relay = relay_with({"sim.a": [{"text": "one"}, {"text": "two"}]})
        texts = []
        for _ in range(2):
            async with relay.stream(HI) as turn:
                texts.append("".join([e.value async for e in turn if e.kind == "text"]))
    assert texts == ["one", "two"]
    assert "SimClient._frames" not in finalized
