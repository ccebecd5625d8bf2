"""The library stream's hand-off under trio: the events of one upstream read cross to the consumer
in one wake-up, and the guarantees of the unbuffered channel it replaced still hold (what a
consumer that leaves early received is exactly the turn's partial text; a slow consumer holds the
turn back within a bound and is not taken for a stalled provider).

A real loopback upstream writes each piece in one write, so the frames of a piece arrive in one
read; a pause between pieces lands the consumer's decisions inside it.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from relayline.adapters import Relay
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.adapters.stream_turn import _Batches

PAUSE = 0.3
HI = [{"role": "user", "content": "hi"}]


def chunk(delta: dict, finish=None) -> bytes:
    body = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def texts(*words: str) -> bytes:
    return b"".join(chunk({"content": word}) for word in words)


ROLE = chunk({"role": "assistant", "content": ""})
END = chunk({}, "stop") + b"data: [DONE]\n\n"


def relay_for(url: str, idle_s: float = 2.0) -> Relay:
    return Relay.from_toml(f"""
active = "up"
[reliability]
provider_retries = 0
[timeouts]
idle_s = {idle_s}
[providers.up]
family = "openai"
base_url = "{url}/v1"
model = "m"
api_key = "sk-handoff-test-key"
""", env={})


async def served(pieces, consume):
    """Run `consume(turn)` inside `relay.stream` against an upstream writing `pieces`."""
    async with trio.open_nursery() as nursery:
        server = LoopbackServer(lambda seen: Reply(pieces=tuple(pieces)))
        await server.start(nursery)
        async with relay_for(server.url) as relay:
            with trio.fail_after(10):
                async with relay.stream(HI) as turn:
                    await consume(turn)
        nursery.cancel_scope.cancel()
    return turn, server


async def test_the_events_of_one_read_are_handed_out_without_a_checkpoint_each():
    received = []

    async def consume(turn):
        # the first event is handed over alone (the first byte does not wait for the rest of its
        # read); then the rest of the read comes in one wake-up
        for _ in range(2):
            received.append((await turn.__anext__()).value)
        with trio.testing.assert_no_checkpoints():
            for _ in range(4):
                received.append((await turn.__anext__()).value)
        received.extend([e.value async for e in turn])

    turn, _ = await served([ROLE + texts("a", "b", "c", "d", "e", "f"), PAUSE, texts("g") + END], consume)
    assert received == ["a", "b", "c", "d", "e", "f", "g"]
    assert turn.outcome == "ok" and turn.result.text == "abcdefg"


async def test_the_first_event_reaches_the_consumer_before_the_rest_of_its_read_is_decoded():
    seen_then = []

    async def consume(turn):
        await turn.__anext__()
        seen_then.append(len(turn._run.turn.forwarded))

    await served([ROLE + texts(*"abcdefgh") + END], consume)
    assert seen_then == [1]


async def test_leaving_in_the_middle_of_a_read_keeps_exactly_what_was_received_as_the_partial():
    async def consume(turn):
        async for event in turn:
            if event.value == "b":
                break

    turn, server = await served([ROLE + texts("a", "b", "c", "d"), PAUSE, texts("e") + END], consume)
    assert turn.outcome == "cancelled" and turn.partial_text == "ab"
    assert len(server.seen) == 1  # never a retry


async def test_a_consumer_that_leaves_before_the_end_cancels_even_when_the_whole_stream_came_in_one_read():
    async def consume(turn):
        async for event in turn:
            assert event.value == "a"
            break

    turn, _ = await served([ROLE + texts("a", "b", "c") + END], consume)
    assert turn.outcome == "cancelled" and turn.partial_text == "a"


async def test_cancel_in_the_middle_of_a_read_ends_the_iteration_at_once():
    received = []

    async def consume(turn):
        async for event in turn:
            received.append(event.value)
            if event.value == "b":
                turn.cancel()

    turn, _ = await served([ROLE + texts("a", "b", "c", "d"), PAUSE, texts("e") + END], consume)
    assert received == ["a", "b"] and turn.outcome == "cancelled" and turn.partial_text == "ab"


async def test_a_slow_consumer_holds_the_turn_back_within_the_bound_and_is_not_a_stalled_provider():
    words = [f" w{i}" for i in range(3 * _Batches.MAX_AHEAD)]
    ahead = []

    async def consume(turn):
        first = await turn.__anext__()
        await trio.sleep(1.0)  # longer than idle_s: the provider is not blamed for the consumer
        ahead.append(len(turn._batches.pending) + len(turn._batches.batch) - turn._batches.at)
        rest = [e.value async for e in turn]
        assert [first.value, *rest] == words

    async with trio.open_nursery() as nursery:
        server = LoopbackServer(lambda seen: Reply(pieces=(ROLE + texts(*words) + END,)))
        await server.start(nursery)
        async with relay_for(server.url, idle_s=0.3) as relay:
            with trio.fail_after(10):
                async with relay.stream(HI) as turn:
                    await consume(turn)
        nursery.cancel_scope.cancel()
    assert turn.outcome == "ok" and 0 < ahead[0] <= _Batches.MAX_AHEAD


def test_withdrawing_events_that_were_not_the_last_returned_is_refused():

    from relayline.machines.stream import Event
    from relayline.machines.vocab import EventKind

    relay = relay_for("http://127.0.0.1:9")
    plan = relay.plan()
    from relayline.machines.turn import Turn

    turn = Turn(plan, relay.config, relay.health, stream=True)
    turn.forwarded.extend(["a", "b"])
    with pytest.raises(ValueError):
        turn.withdraw([Event(EventKind.TEXT, "a")])
    turn.withdraw([Event(EventKind.TEXT, "b"), Event(EventKind.REASONING, "r")])
    assert turn.forwarded == ["a"]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
async def test_a_first_read_decoded_in_two_steps_gives_the_events_of_one_step(newline):
    """providers/http.py decodes the first FIRST_PIECE bytes of a burst before the rest: a split
    inside a multi-byte character, or between the CR and the LF of a line end, changes nothing."""
    from relayline.adapters.providers.http import FIRST_PIECE

    for cut in ("😀".encode(), newline.encode()):
        words = [f"é{i}😀" for i in range(80)]
        body = texts(*words).replace(b"\n", newline.encode()) + END
        at = (ROLE + chunk({"content": "p"}) + body).index(cut, FIRST_PIECE - 300)
        pad = FIRST_PIECE - len(cut) // 2 - at  # moves that occurrence of `cut` across the cut
        whole = ROLE + chunk({"content": "p" * (1 + pad)}) + body
        assert whole[FIRST_PIECE - len(cut) // 2:][:len(cut)] == cut
        received: list[str] = []

        async def consume(turn, received=received):
            received.extend([e.value async for e in turn])

        turn, _ = await served([whole], consume)
        assert turn.outcome == "ok" and received == ["p" * (1 + pad), *words]
