"""The provider stream readers of every family (OpenAI chat, Anthropic messages, OpenAI's
Responses) against the transcripts in tests/transcripts/ with one field of one event given a
value of the wrong JSON type: whatever the provider sent, a reader either reads it or fails
with a ProviderFailure (a classified `malformed` failure the walk fails over), never another
exception, which the driver would carry up as relayline's own internal error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayline.adapters.codecs.anthropic_messages_replies import AnthropicStreamParser
from relayline.adapters.codecs.common import ProviderFailure
from relayline.adapters.codecs.openai_chat_replies import OpenAIStreamParser
from relayline.adapters.codecs.responses_replies import ResponsesStreamParser
from relayline.adapters.sse import SSEDecoder, SSEEvent

TRANSCRIPTS = Path(__file__).resolve().parents[1] / "transcripts"
READERS = {"openai": OpenAIStreamParser, "anthropic": AnthropicStreamParser, "responses": ResponsesStreamParser}
STREAMS = sorted(p.name for p in TRANSCRIPTS.glob("*.sse"))
# a value of every JSON type, and the edges of each: whatever a field should hold, most are wrong
WRONG = [None, True, False, 0, -1, 1.5, 10**30, "", "x", [], [0], ["x"], {}, {"type": "x"}, {"index": 0}]


def events(name: str) -> list[SSEEvent]:
    return SSEDecoder().feed((TRANSCRIPTS / name).read_bytes())


def paths(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value: each key of each object, each item of each list."""
    found = [at] if at else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*at, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += paths(item, (*at, i))
    return found


def replaced(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, new)}
    return [replaced(item, rest, new) if i == head else item for i, item in enumerate(value)]


def read_all(reader: Any, stream: list[SSEEvent]) -> None:
    """The events fed as the transport feeds them, up to the reader's end."""
    for event in stream:
        reader.feed(event)
        if reader.done:
            return


def test_every_transcript_is_read_to_its_end_as_recorded():
    # (the fuzz below starts from streams read as sent; two recorded an error, which is theirs)
    for name in STREAMS:
        reader = READERS[name.split("_")[0]]()
        if name in ("anthropic_overloaded.sse", "openai_midstream_error.sse"):
            with pytest.raises(ProviderFailure):
                read_all(reader, events(name))
        else:
            read_all(reader, events(name))
            assert reader.done or reader.complete_at_eof(), name


def read_as_classified(name: str, stream: list[SSEEvent]) -> None:
    try:
        read_all(READERS[name.split("_")[0]](), stream)
    except ProviderFailure:
        pass  # classified: the walk fails over


@pytest.mark.parametrize("name", STREAMS)
def test_every_field_of_every_event_of_the_wrong_json_type_is_a_provider_failure_never_an_internal_error(name):
    # every event, every field in it, every wrong value: about ten thousand streams in all, read
    # in about a second, so none is left to chance
    recorded = events(name)
    for at, event in enumerate(recorded):
        if not event.data.startswith("{"):
            continue
        body = json.loads(event.data)
        for path in paths(body):
            for new in WRONG:
                stream = list(recorded)
                stream[at] = SSEEvent(json.dumps(replaced(body, path, new)), event.event)
                read_as_classified(name, stream)


@given(data=st.data())
def test_several_fields_of_the_wrong_json_type_together_are_a_provider_failure_never_an_internal_error(data):
    name = data.draw(st.sampled_from(STREAMS), label="transcript")
    stream = events(name)
    objects = [i for i, e in enumerate(stream) if e.data.startswith("{")]
    for _ in range(data.draw(st.integers(2, 4), label="fields")):
        at = data.draw(st.sampled_from(objects), label="event")
        body = json.loads(stream[at].data)
        path = data.draw(st.sampled_from(paths(body)), label="field")
        stream[at] = SSEEvent(json.dumps(replaced(body, path, data.draw(st.sampled_from(WRONG)))), stream[at].event)
    read_as_classified(name, stream)
