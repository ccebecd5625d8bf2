"""The gate timer and a turn that already ended.

A stream's gate_commit_s is served by the gateway's one gate timer. Once the turn's run ended,
the gate must hold no more: what the response is (a real error status for a stream that showed
nothing, or the stream's end) is the turn's result's to decide, even when accounting for the
turn (the ledger's commit) takes past gate_commit_s. On virtual time, against the sim upstream.
"""

from __future__ import annotations

import json

import pytest
import trio

from helpers import asgi_post
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.providers.sim import SimUpstream
from relayline.adapters.relay import turns_of

CONFIG = """
active = "sim.a"
[reliability]
provider_retries = 0
[timeouts]
gate_commit_s = 1
[providers."sim.a"]
family = "sim"
model = "m1"
price = { input_per_mtok = 1.0, output_per_mtok = 2.0 }
"""
BODY = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()


class SlowLedger:
    """A ledger whose commit takes half a second (a busy disk, a remote database)."""

    def __init__(self) -> None:
        self.rows = 0

    async def record(self, turn_id: str, result, *, client: str = "", key: str = "", team: str = "") -> int:
        await trio.sleep(0.5)
        self.rows += len(result.ledger)
        return len(result.ledger)


async def test_a_stream_that_failed_before_gate_commit_s_keeps_its_error_status_while_its_ledger_commits(
        autojump_clock):
    # an empty answer (billed: it reported usage), and its non-streamed retry, end the turn at
    # 0.8 s, before the gate's 1 s;
    # its ledger row commits until 1.4 s
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [
        {"frames": [{"role": True}, {"wait": 0.4}, {"done": True}]}]}])
    ledger = SlowLedger()
    gateway = Gateway(Relay.from_toml(CONFIG, env={}, clients=sim.clients()), ledger=ledger)
    status, _, body = await asgi_post(gateway, "/v1/chat/completions", BODY)
    assert ledger.rows >= 1
    assert status != 200 and json.loads(body)["error"], (status, body[:300])


async def test_a_streams_ledger_rows_are_committed_before_its_last_bytes_are_sent(autojump_clock):
    # the gate committed the stream first (the model was slow), then a slow ledger commit: the
    # stream's end still waits for the rows
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [
        {"frames": [{"role": True}, {"wait": 1.5}, {"text": "late"}, {"done": True}]}]}])
    ledger = SlowLedger()
    rows_at_end = []

    def on_send(message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            rows_at_end.append(ledger.rows)

    gateway = Gateway(Relay.from_toml(CONFIG, env={}, clients=sim.clients()), ledger=ledger)
    status, _, body = await asgi_post(gateway, "/v1/chat/completions", BODY, on_send=on_send)
    assert status == 200 and b'"late"' in body and body.endswith(b"data: [DONE]\n\n")
    assert rows_at_end == [1]


@pytest.mark.parametrize("gate_s", [0.5, 30])
async def test_a_drain_answers_a_held_stream_503_and_one_the_gate_committed_with_its_error_event(gate_s, autojump_clock):
    # the model is silent after its role frame: at 2 s the drain (0.5 s) cuts the turn; with a
    # gate of 0.5 s the stream was committed by then (200, then the shutdown's error event), with
    # 30 s it is still held (a real 503, nothing shown)
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [
        {"frames": [{"role": True}, {"wait": 60}, {"text": "never"}, {"done": True}]}]}])
    gateway = Gateway(Relay.from_toml(CONFIG.replace("gate_commit_s = 1", f"gate_commit_s = {gate_s}"), env={},
                                      clients=sim.clients()))
    answers = []

    async def post() -> None:
        answers.append(await asgi_post(gateway, "/v1/chat/completions", BODY, bound=30))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post)
        await trio.sleep(2)
        await gateway.drain(0.5)
    ((status, _, body),) = answers
    if gate_s < 2:
        assert status == 200 and b'"role":"assistant"' in body
        assert b'"shutting_down"' in body.rsplit(b"data: ", 1)[1] and b"never" not in body
    else:
        assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert not gateway.chat.gates.held and not gateway.turns.cancellers


@pytest.mark.parametrize("fails", ["planning", "admitting"])
async def test_a_stream_whose_run_could_not_be_made_or_started_leaves_no_gate_held(fails, monkeypatch, autojump_clock):
    # relayline's own bug where a turn's run is made (the plan) or where it is admitted: the
    # client gets a 500 and nothing after it; the gate timer holds no stream and never writes
    # a commit of its own (a held gate would write a 200 head after the 500, at gate_commit_s)
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"frames": [{"text": "x"}, {"done": True}]}]}])
    relay = Relay.from_toml(CONFIG, env={}, clients=sim.clients())
    gateway = Gateway(relay)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(*((turns_of(relay), "new_run") if fails == "planning" else (gateway.turns, "admit")), broken)
    starts = []
    status, _, body = await asgi_post(gateway, "/v1/chat/completions", BODY,
                                      on_send=lambda m: starts.append(m.get("status")))
    await trio.sleep(3)  # past gate_commit_s
    assert status == 500 and json.loads(body)["error"]
    assert [s for s in starts if s is not None] == [500]
    assert not gateway.chat.gates.held and not gateway.chat.gates.queued and not gateway.turns.cancellers
