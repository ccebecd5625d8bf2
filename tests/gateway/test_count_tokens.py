"""Token counting (`POST /v1/messages/count_tokens`): the official anthropic SDK's
`messages.count_tokens` against the real gateway, forwarded to anthropic profiles on a loopback
upstream that counts as Anthropic's API does; a failover among anthropic entries, a 404 in
Anthropic's shape when the chain has none, and never a ledger row."""

from __future__ import annotations

import json

import anthropic
import pytest

from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import JSON
from relayline.adapters.stores.ledger import LedgerStore

MESSAGES = [{"role": "user", "content": "how many tokens is this?"}]


class CountingUpstream(BackgroundLoopback):
    """/down/... answers 529 (overloaded); elsewhere the count is the characters of the body's
    messages, so a test can tell which body was counted."""

    def __init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, seen: Seen) -> Reply:
        if seen.path.startswith("/down/"):
            return Reply(status=529, headers=JSON, pieces=(
                b'{"type": "error", "error": {"type": "overloaded_error", "message": "overloaded"}}',))
        count = len(json.dumps((seen.body or {}).get("messages")))
        return Reply(headers=JSON, pieces=(json.dumps({"input_tokens": count}).encode(),))


def anthropic_profile(up: CountingUpstream, where: str, **extra) -> dict:
    return {"family": "anthropic", "base_url": f"{up.url}/{where}", "api_key": f"sk-count-{where}",
            "model": "claude-count", "price": {"input_per_mtok": 3.0}, **extra}


def client(gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=20)


def test_the_count_comes_from_the_next_anthropic_entry_and_is_never_billed(tmp_path):
    path = tmp_path / "ledger.sqlite3"
    with CountingUpstream() as up:
        config = {"active": "anthropic.first", "reliability": {"provider_retries": 1, "backoff_ms": 10},
                  "providers": {"anthropic.first": anthropic_profile(up, "down", fallbacks=["openai.chat",
                                                                                          "anthropic.second"]),
                                "openai.chat": {"family": "openai", "base_url": f"{up.url}/chat/v1",
                                                "api_key": "sk-chat", "model": "gpt-chat"},
                                "anthropic.second": anthropic_profile(up, "second")}}
        with BackgroundGateway(config, ledger_path=str(path)) as gw:
            raw = client(gw).messages.with_raw_response.count_tokens(
                model="claude-count", messages=MESSAGES, system="be brief",
                tools=[{"name": "f", "input_schema": {"type": "object"}}],
                extra_headers={"anthropic-beta": "token-counting-2024-11-01"})
    counted = raw.parse()
    assert counted.input_tokens == len(json.dumps(MESSAGES))
    # the first entry's retry, then the next anthropic entry; the openai entry cannot count
    assert [s.path for s in up.seen] == ["/down/v1/messages/count_tokens"] * 2 + ["/second/v1/messages/count_tokens"]
    sent = up.seen[-1]
    assert sent.body == {"model": "claude-count", "messages": MESSAGES, "system": "be brief",
                         "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    assert sent.headers["anthropic-beta"] == "token-counting-2024-11-01" and sent.headers["x-api-key"] == "sk-count-second"
    assert raw.headers["x-relayline-served"] == "anthropic.second/claude-count"
    assert "openai.chat/gpt-chat unsupported (count_tokens)" in counted.model_extra["relayline"]["skipped"]
    assert LedgerStore(path).rows() == []


@pytest.mark.parametrize("drop", [False, True], ids=["skip", "drop_unsupported_params"])
def test_with_no_anthropic_entry_it_is_a_404_in_anthropics_shape(drop):
    with CountingUpstream() as up:
        config = {"active": "openai.chat", "gateway": {"drop_unsupported_params": drop}, "providers": {"openai.chat": {
            "family": "openai", "base_url": f"{up.url}/chat/v1", "api_key": "sk-chat", "model": "gpt-chat"}}}
        with BackgroundGateway(config) as gw, pytest.raises(anthropic.NotFoundError) as info:
            client(gw).messages.count_tokens(model="gpt-chat", messages=MESSAGES)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    assert "anthropic" in info.value.body["error"]["message"] and up.seen == []


def test_a_body_without_messages_is_an_anthropic_400():
    with CountingUpstream() as up, BackgroundGateway({"active": "anthropic.a", "providers": {
            "anthropic.a": anthropic_profile(up, "a")}}) as gw, pytest.raises(anthropic.BadRequestError) as info:
        client(gw).messages.count_tokens(model="claude-count", messages=[])
    assert info.value.body["error"]["type"] == "invalid_request_error" and up.seen == []
