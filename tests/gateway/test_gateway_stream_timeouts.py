"""Each deadline fires through the gateway where it fires in the library.

The gateway's stream is the driver's sink with a `waiting()` the upstream adapter awaits before
each read (what the last read rendered is written then, the provider's idle deadline lifted
while it is): the deadlines must not move with it. Each case runs one streamed turn both ways
against the same loopback upstreams: in the library (a sink with no `waiting`), and through the
real gateway server with a client reading the whole answer. The attempts and the outcome must be
the same, and the gateway's client must see the stream end as the outcome says. The non-streamed
cases check the same of the upstream client's read of a whole answer (its deadline is moved once
when the answer came with its head).
"""

from __future__ import annotations

import json
import math

import h11
import pytest
import trio

from helpers import loopback_config, serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.relay import turns_of
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

HI = [{"role": "user", "content": "hi"}]
SSE = (("content-type", "text/event-stream"),)


def chunk(delta: dict, finish: str | None = None) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish}]})}\n\n".encode()


ROLE = chunk({"role": "assistant", "content": ""})
ANSWER = (ROLE, chunk({"content": "from the backup"}), chunk({}, "stop"), b"data: [DONE]\n\n")


def backup_reply(seen) -> Reply:
    """The backup answers in the mode it is asked (a recovery after a failed stream is a
    non-streamed call: stream.recovery (docs/configuration.md))."""
    if seen.body.get("stream"):
        return Reply(headers=SSE, pieces=ANSWER)
    return Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(
        {"choices": [{"index": 0, "message": {"role": "assistant", "content": "from the backup"},
                      "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}).encode(),))

CASES = {
    # no head within headers_s: the backup answers
    "headers_s": (Reply(delay=math.inf), {"headers_s": 0.3}),
    # a head and a role frame, then nothing decisive within first_token_s: the backup answers
    "first_token_s": (Reply(headers=SSE, pieces=(ROLE, 5.0)), {"first_token_s": 0.3, "idle_s": 2}),
    # empty frames that keep the connection alive but never decide: first_token_s still fires
    "first_token_s_with_keepalives": (Reply(headers=SSE, pieces=(ROLE,) + (0.1, chunk({"content": ""})) * 40),
                                      {"first_token_s": 0.5, "idle_s": 0.3}),
    # text, then the provider stalls past idle_s: interrupted after output, never replayed
    "idle_s": (Reply(headers=SSE, pieces=(ROLE, chunk({"content": "half "}), 5.0)), {"idle_s": 0.3}),
    # text forever, each gap well inside idle_s: total_s ends it
    "total_s": (Reply(headers=SSE, pieces=(ROLE,) + (0.05, chunk({"content": "la "})) * 400),
                {"idle_s": 0.3, "total_s": 1.0}),
}


async def library_turn(cfg, stream: bool = True) -> object:
    async with Relay(structure_config(cfg), env={}) as relay:
        with trio.fail_after(10):
            return await turns_of(relay).run(HI, stream=stream)


def story(result) -> tuple:
    return result.outcome, result.error, [(a.provider, a.outcome) for a in result.attempts]


async def gateway_turn(cfg, path: str, stream: bool = True) -> tuple[object, bytes]:
    results = []
    relay = Relay(structure_config(cfg), env={})
    relay.observers.append(results.append)
    async with trio.open_nursery() as nursery:
        url = await serve_in_process(nursery, Gateway(relay))
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": "m-primary", "stream": stream, "max_tokens": 64, "messages": HI}).encode()
        client = await trio.open_tcp_stream(host, int(port))
        conn = h11.Connection(h11.CLIENT)
        await client.send_all(conn.send(h11.Request(method="POST", target=path, headers=[
            ("host", "x"), ("content-type", "application/json"), ("content-length", str(len(body)))]))
            + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        received = b""
        with trio.fail_after(10):
            while (event := conn.next_event()) is not h11.PAUSED and type(event) is not h11.EndOfMessage:
                if event is h11.NEED_DATA:
                    conn.receive_data(await client.receive_some(65536))
                elif type(event) is h11.Response:
                    received += b"%d " % event.status_code
                elif type(event) is h11.Data:
                    received += event.data
        await client.aclose()
        await relay.aclose()
        nursery.cancel_scope.cancel()
    (result,) = results
    return result, received


async def both_ways(reply: Reply, timeouts: dict, path: str, stream: bool):
    """One turn in the library and one through the gateway at once (the case's waits overlap),
    each against its own primary answering `reply` and a backup that answers: (alone, (through,
    the bytes the gateway's client received))."""
    async with trio.open_nursery() as nursery:
        primary = LoopbackServer(lambda seen: reply)
        backup = LoopbackServer(backup_reply)
        await primary.start(nursery)
        await backup.start(nursery)
        cfg = loopback_config(primary.url, backup.url, reliability={"provider_retries": 0},
                              timeouts={"headers_s": 2, "idle_s": 2, "total_s": 5, **timeouts})
        both: dict = {}

        async def side(name, turn, *args) -> None:
            both[name] = await turn(cfg, *args)

        async with trio.open_nursery() as sides:
            sides.start_soon(side, "alone", library_turn, stream)
            sides.start_soon(side, "through", gateway_turn, path, stream)
        nursery.cancel_scope.cancel()
    return both["alone"], both["through"]


# each dialect's stream: its clean end, and its error event
DIALECTS = {"/v1/chat/completions": (b"data: [DONE]\n\n", b'data: {"error"'),
            "/v1/messages": (b"event: message_stop\n", b"event: error\n")}


@pytest.mark.parametrize("path", DIALECTS)
@pytest.mark.parametrize("case", CASES)
async def test_a_stream_deadline_fires_through_the_gateway_as_in_the_library(case, path):
    reply, timeouts = CASES[case]
    alone, (through, received) = await both_ways(reply, timeouts, path, True)
    assert story(through) == story(alone), received[:1000]
    end, error = DIALECTS[path]
    last = received[received.rstrip(b"\n").rfind(b"\n\n") + 2:]
    if alone.outcome == "ok":
        assert received.startswith(b"200 ") and b"from the backup" in received and last.startswith(end), last
    elif alone.outcome == "interrupted":  # after output: the stream's own error event ends it
        assert received.startswith(b"200 ") and (b"half " in received or b"la " in received)
        assert last.startswith(error), last
    else:  # nothing was shown: a real status
        assert not received.startswith(b"200 ") and b'"error"' in received


JSON = (("content-type", "application/json"),)
WHOLE = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"},
                                 "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

NOT_STREAMED = {
    # no head within headers_s: the backup answers
    "headers_s": (Reply(delay=math.inf), {"headers_s": 0.3}),
    # a head, then the body stalls past idle_s: a stalled body, the backup answers
    "idle_s": (Reply(headers=JSON, pieces=(WHOLE[:20].encode(), 5.0, WHOLE[20:].encode())), {"idle_s": 0.3}),
    # a body that trickles, each gap inside idle_s: total_s ends the turn
    "total_s": (Reply(headers=JSON, pieces=tuple(p for c in WHOLE for p in (0.1, c.encode()))),
                {"idle_s": 0.3, "total_s": 1.0}),
}


@pytest.mark.parametrize("case", NOT_STREAMED)
async def test_a_non_streamed_deadline_fires_through_the_gateway_as_in_the_library(case):
    reply, timeouts = NOT_STREAMED[case]
    alone, (through, received) = await both_ways(reply, timeouts, "/v1/chat/completions", False)
    assert story(through) == story(alone), received[:1000]
    if alone.outcome == "ok":
        assert received.startswith(b"200 ") and json.loads(received[4:])["choices"][0]["message"]["content"] == \
            "from the backup"
    else:
        assert not received.startswith(b"200 ") and json.loads(received[4:])["error"]
