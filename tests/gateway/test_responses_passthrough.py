"""A Responses client served by a profile that speaks the Responses API itself (passthrough):
the official openai SDK in front of the real gateway, a loopback upstream that answers as
OpenAI's Responses API does, with a built-in web search. The client sees the provider's own
response id, so `previous_response_id` on its next turn reaches the provider that stored the
answer; and a streamed answer, re-rendered behind the commit gate, keeps the built-in tool's
item whole and the answer's citations instead of losing them."""

from __future__ import annotations

import json

import openai

from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.loopback import BackgroundLoopback, Reply, Seen
from relayline.adapters.sim.recorder import JSON, SSE

UPSTREAM_ID = "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b"
SEARCH = {"id": "ws_67ccd2bf17f0819081ff3bb2cf6508e6", "type": "web_search_call", "status": "completed",
          "action": {"type": "search", "query": "positive news today"}}
CITATION = {"type": "url_citation", "start_index": 0, "end_index": 9, "url": "https://example.com/news",
            "title": "Good news"}
MESSAGE = {"id": "msg_67ccd2bf17f0819081ff3bb2cf6508e7", "type": "message", "status": "completed", "role": "assistant",
           "content": [{"type": "output_text", "text": "Good news: a lot happened.", "annotations": [CITATION]}]}
USAGE = {"input_tokens": 328, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 356,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 684}


def _response(status: str, output: list[dict], previous: str | None) -> dict:
    return {"id": UPSTREAM_ID, "object": "response", "created_at": 1741476542, "status": status, "model": "gpt-4.1",
            "output": output, "store": True, "previous_response_id": previous, "usage": USAGE if output else None}


def _stream(previous: str | None) -> tuple[bytes, ...]:
    """The event stream of a web search, then the cited answer, as OpenAI's Responses API sends it."""
    text = MESSAGE["content"][0]["text"]
    opened = MESSAGE | {"status": "in_progress", "content": []}
    events = [
        {"type": "response.created", "response": _response("in_progress", [], previous)},
        {"type": "response.in_progress", "response": _response("in_progress", [], previous)},
        {"type": "response.output_item.added", "output_index": 0, "item": SEARCH | {"status": "in_progress"}},
        {"type": "response.web_search_call.in_progress", "output_index": 0, "item_id": SEARCH["id"]},
        {"type": "response.web_search_call.searching", "output_index": 0, "item_id": SEARCH["id"]},
        {"type": "response.web_search_call.completed", "output_index": 0, "item_id": SEARCH["id"]},
        {"type": "response.output_item.done", "output_index": 0, "item": SEARCH},
        {"type": "response.output_item.added", "output_index": 1, "item": opened},
        {"type": "response.content_part.added", "item_id": MESSAGE["id"], "output_index": 1, "content_index": 0,
         "part": {"type": "output_text", "text": "", "annotations": []}},
        {"type": "response.output_text.delta", "item_id": MESSAGE["id"], "output_index": 1, "content_index": 0,
         "delta": text},
        {"type": "response.output_text.done", "item_id": MESSAGE["id"], "output_index": 1, "content_index": 0,
         "text": text},
        {"type": "response.output_item.done", "output_index": 1, "item": MESSAGE},
        {"type": "response.completed", "response": _response("completed", [SEARCH, MESSAGE], previous)},
    ]
    return tuple(f"event: {e['type']}\ndata: {json.dumps(e | {'sequence_number': n})}\n\n".encode()
                 for n, e in enumerate(events))


class StoringUpstream(BackgroundLoopback):
    """Answers every request as one stored response would be: its id, and the id it continued."""

    def __init__(self) -> None:
        super().__init__(self._answer)

    def _answer(self, seen: Seen) -> Reply:
        body = seen.body or {}
        previous = body.get("previous_response_id")
        if body.get("stream"):
            return Reply(headers=SSE, pieces=_stream(previous))
        return Reply(headers=JSON, pieces=(json.dumps(_response("completed", [SEARCH, MESSAGE], previous)).encode(),))


def _config(up: StoringUpstream) -> dict:
    return {"active": "openai.native", "reliability": {"provider_retries": 0},
            "providers": {"openai.native": {"family": "openai", "base_url": f"{up.url}/v1", "api_key": "sk-native",
                                            "model": "gpt-4.1", "capabilities": {"responses": True}}}}


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_a_stored_answer_keeps_the_providers_id_for_the_next_turn():
    with StoringUpstream() as up, BackgroundGateway(_config(up)) as gw:
        first = _client(gw).responses.create(model="gpt-4.1", input="good news today?", tools=[{"type": "web_search"}],
                                             store=True)
        second = _client(gw).responses.create(model="gpt-4.1", input="and tomorrow?", previous_response_id=first.id,
                                              store=True)
    assert first.id == UPSTREAM_ID and first.store is True
    assert up.seen[1].body["previous_response_id"] == UPSTREAM_ID  # the provider knows what it is asked for
    assert second.previous_response_id == UPSTREAM_ID
    search, message = first.output
    assert search.type == "web_search_call" and message.content[0].annotations[0].url == CITATION["url"]
    assert first.model_extra["relayline"]["served"] == "openai.native/gpt-4.1"


def test_a_passthrough_stream_keeps_the_providers_id_and_its_built_in_tool_items():
    with StoringUpstream() as up, BackgroundGateway(_config(up)) as gw:
        with _client(gw).responses.stream(model="gpt-4.1", input="good news today?", tools=[{"type": "web_search"}],
                                          store=True) as stream:
            events = list(stream)
            final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.id == UPSTREAM_ID
    assert final.id == UPSTREAM_ID and final.status == "completed"
    # the search, whole, as its own item before the answer that cites it
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in added] == [i.type for i in done] == ["web_search_call", "message"]
    assert done[0].id == SEARCH["id"] and done[0].action.query == "positive news today"
    assert [i.type for i in final.output] == ["web_search_call", "message"]
    assert final.output_text == MESSAGE["content"][0]["text"]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    assert final.usage.input_tokens == 328 and final.usage.output_tokens == 356
    # the answer's citation, as the provider gave it once the message was done
    cited = [e for e in events if e.type == "response.output_text.annotation.added"]
    assert [e.annotation.url for e in cited] == [CITATION["url"]]
    assert done[1].content[0].annotations[0].url == CITATION["url"]
    assert final.output[1].content[0].annotations[0].title == CITATION["title"]
