"""The gateway's streamed response (app.py's _StreamWire, written by the turn's own task, its held
headers committed by the gateway's gate timer): the held headers go out after
`timeouts.gate_commit_s` when nothing decisive came (a slow model is not an error), frames then go
out as they come, and the turn's end loses no byte. On virtual time, against the scripted sim
upstream."""

from __future__ import annotations

import json

import trio

from helpers import asgi_post
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.providers.sim import SimUpstream

CONFIG = """
active = "sim.a"
[timeouts]
gate_commit_s = {gate}
[providers."sim.a"]
family = "sim"
model = "m1"
"""
BODY = json.dumps({"model": "m1", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()


async def streamed(frames, gate: float) -> list[tuple[float, dict]]:
    sim = SimUpstream.from_replies([{"provider": "sim.a", "script": [{"frames": frames}]}])
    relay = Relay.from_toml(CONFIG.format(gate=gate), env={}, clients=sim.clients())
    started = trio.current_time()
    sent: list[tuple[float, dict]] = []
    await asgi_post(Gateway(relay), "/v1/chat/completions", BODY,
                    on_send=lambda message: sent.append((trio.current_time() - started, message)))
    return sent


def content(message: dict) -> bytes:
    return message.get("body", b"")


async def test_a_slow_model_gets_its_headers_and_role_frame_at_gate_commit_s(autojump_clock):
    sent = await streamed([{"role": True}, {"wait": 5}, {"text": "late"}, {"done": True}], gate=1)
    head_at = next(at for at, message in sent if message["type"] == "http.response.start")
    role_at = next(at for at, message in sent if b'"role":"assistant"' in content(message))
    text_at = next(at for at, message in sent if b'"late"' in content(message))
    assert 1 <= head_at < 1.1 and 1 <= role_at < 1.1 and text_at >= 5
    assert sent[0][1]["status"] == 200 and b"data: [DONE]" in content(sent[-1][1])


async def test_a_stream_that_commits_before_gate_commit_s_is_not_held_to_it(autojump_clock):
    sent = await streamed([{"role": True}, {"text": "soon"}, {"wait": 3}, {"text": " then"}, {"done": True}], gate=30)
    text_at = next(at for at, message in sent if b'"soon"' in content(message))
    body = b"".join(content(message) for _, message in sent)
    assert text_at < 0.1 and body.count(b"data: ") == body.count(b"\n\n") and b'" then"' in body
    assert b"data: [DONE]" in content(sent[-1][1]) and not any(message.get("more_body") for _, message in sent[-1:])


async def test_without_a_gate_timer_the_headers_wait_for_the_first_decisive_frame(autojump_clock):
    sent = await streamed([{"role": True}, {"wait": 5}, {"text": "late"}, {"done": True}], gate=0)
    head_at = next(at for at, message in sent if message["type"] == "http.response.start")
    assert head_at >= 5
