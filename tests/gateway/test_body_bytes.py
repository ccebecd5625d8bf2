"""The bytes of a same-dialect client's body reach its provider as the client wrote them (its
whitespace, key order and escapes), with only the members the gateway appends (`stream`,
`stream_options`, Anthropic's default `max_tokens`) written before its closing brace; a body
whose member changed (the entry's model is another name), one `json` had to read, or one sent
across families is written anew as before. Raw sockets to a real gateway, the recording
loopback upstream behind it (the bytes it received)."""

from __future__ import annotations

import json

import orjson
import pytest

from helpers import raw_post, recording_gateway
from relayline.adapters import jsoncodec

PROVIDERS = {"openai.chat": {"model": "gpt-x"}, "anthropic.msg": {"model": "claude-y"},
             "openai.resp": {"model": "gpt-r", "capabilities": {"responses": True}}}
HINTS = {"gpt-x": "openai.chat", "claude-y": "anthropic.msg", "gpt-r": "openai.resp",
         "oa-hint": "openai.chat", "an-hint": "anthropic.msg", "resp-hint": "openai.resp"}


@pytest.fixture(scope="module")
def gw():
    with recording_gateway(PROVIDERS, HINTS) as gateway:
        yield gateway


@pytest.fixture
def upstream(gw):
    gw.upstream.seen.clear()
    return gw.upstream


def _post(gw, path: str, body: bytes) -> None:
    answer = raw_post(gw.url, path, body, [("authorization", "Bearer gw-key")])
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


# a client's own writing: spaces and newlines, an escaped non-ASCII character and slash, its
# own key order, a member relayline does not know
CHAT = (b' {\n  "messages" : [ {"role":"user", "content":"caf\\u00e9 \\/ \\"q\\""} ],\n'
        b'  "seed": 7, "model": "%s" %s}\n')
MESSAGES = (b'{ "max_tokens": 32, "messages": [{"role": "user", "content": "caf\\u00e9"}], '
            b'"metadata": {"user_id": "u\\/1"}, "model": "%s" %s}')
RESPONSES = b'{ "input": "caf\\u00e9 \\/", "store": false, "model": "%s" %s}'


@pytest.mark.parametrize(("path", "template", "model", "appended"), [
    ("/v1/chat/completions", CHAT, b"gpt-x", b',"stream":false}'),
    ("/v1/chat/completions", CHAT, b"gpt-x", None),
    ("/v1/messages", MESSAGES, b"claude-y", b',"stream":false}'),
    ("/v1/messages", MESSAGES, b"claude-y", None),
    ("/v1/responses", RESPONSES, b"gpt-r", b',"stream":false}'),
    ("/v1/responses", RESPONSES, b"gpt-r", None),
], ids=["chat", "chat-stream-set", "messages", "messages-stream-set", "responses", "responses-stream-set"])
def test_an_unchanged_body_reaches_its_provider_as_the_client_s_bytes(gw, upstream, path, template, model,
                                                                        appended):
    body = template % (model, b"" if appended else b', "stream" : false ')
    _post(gw, path, body)
    (seen,) = upstream.seen
    if appended is None:
        assert seen.raw == body  # byte for byte
    else:
        assert seen.raw == body.rstrip()[:-1] + appended


def test_a_stream_s_usage_request_is_appended_to_the_client_s_bytes(gw, upstream):
    body = CHAT % (b"gpt-x", b', "stream": true')
    _post(gw, "/v1/chat/completions", body)
    (seen,) = upstream.seen
    assert seen.raw == body.rstrip()[:-1] + b',"stream_options":{"include_usage":true}}'


@pytest.mark.parametrize(("path", "template", "model"), [
    ("/v1/chat/completions", CHAT, b"oa-hint"), ("/v1/messages", MESSAGES, b"an-hint"),
    ("/v1/responses", RESPONSES, b"resp-hint")])
def test_a_body_whose_model_changed_is_written_anew(gw, upstream, path, template, model):
    body = template % (model, b', "stream": false')
    _post(gw, path, body)
    (seen,) = upstream.seen
    assert seen.raw == jsoncodec.dumps(seen.body)  # today's compact writing
    assert seen.raw != body and seen.body["model"] != model.decode()


def test_a_body_json_read_is_written_anew(gw, upstream):
    # an integer beyond 64 bits is read by `json` (orjson would make it a float): not forwarded
    # as bytes, though it reaches the provider exact
    body = CHAT % (b"gpt-x", b', "stream": false, "user_id_hash": 123456789012345678901234')
    _post(gw, "/v1/chat/completions", body)
    (seen,) = upstream.seen
    assert seen.raw == jsoncodec.dumps(seen.body)
    assert json.loads(seen.raw)["user_id_hash"] == 123456789012345678901234


def test_a_body_sent_across_families_is_translated_as_before(gw, upstream):
    body = (CHAT % (b"claude-y", b"")).replace(b'"seed": 7, ', b"")  # (no anthropic entry takes a seed)
    _post(gw, "/v1/chat/completions", body)
    (seen,) = upstream.seen
    assert seen.path == "/v1/messages" and seen.raw == jsoncodec.dumps(orjson.loads(seen.raw))


def test_a_body_relayline_takes_its_own_fields_from_is_written_anew(gw, upstream):
    # the signature relayline gave an earlier answer is not the chat completions server's: the
    # body kept for it is another object than the one read, and the read bytes are not sent
    body = (b'{"model": "gpt-x", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
            b'"content": "b", "reasoning_content": "r", "reasoning_signature": "sig"}, {"role": "user", "content": "c"}]}')
    _post(gw, "/v1/chat/completions", body)
    (seen,) = upstream.seen
    assert seen.raw == jsoncodec.dumps(seen.body)
    assert seen.body["messages"][1] == {"role": "assistant", "content": "b", "reasoning_content": "r"}
