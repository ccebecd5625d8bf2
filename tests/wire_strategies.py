"""Hypothesis strategies for the canonical request (machines/wire.py), shared by the property
tests of the codecs: parts, tool calls and messages each dialect can write."""

from __future__ import annotations

import json

import attrs
from hypothesis import strategies as st

from relayline.machines import wire

words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
base64_text = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", min_size=1, max_size=16)
part_extra = st.lists(st.sampled_from(["cache_control", "content.image_url.detail", "title", "citations"]),
                     max_size=2, unique=True).map(tuple)
text_parts = st.builds(wire.Part, st.just(wire.TEXT), words, extra=part_extra)
parts_by_url = st.builds(wire.Part, st.sampled_from([wire.IMAGE, wire.DOCUMENT]),
                         url=words.map("https://x/{}".format), extra=part_extra)
parts_by_data = st.builds(wire.Part, st.sampled_from([wire.IMAGE, wire.DOCUMENT]), data=base64_text,
                          media_type=st.sampled_from(["image/png", "application/pdf"]), extra=part_extra)
parts = st.lists(st.one_of(text_parts, text_parts, parts_by_url, parts_by_data), max_size=3).map(tuple)
arguments = st.one_of(st.dictionaries(words, words | st.integers(), max_size=2).map(json.dumps),
                      st.sampled_from(['{"city": "Par', "[1, 2]", ""]))
tool_calls = st.lists(st.builds(wire.ToolCall, words, words, arguments), max_size=2).map(tuple)
messages = st.one_of(
    st.builds(wire.Message, st.just(wire.SYSTEM), st.lists(text_parts, min_size=1, max_size=2).map(tuple)),
    st.builds(wire.Message, st.just(wire.USER), parts),
    st.builds(wire.Message, st.just(wire.ASSISTANT), st.lists(text_parts, max_size=2).map(tuple), tool_calls),
    st.builds(wire.Message, st.just(wire.TOOL), parts, tool_call_id=words, is_error=st.booleans()),
)


@st.composite
def canonical_requests(draw) -> wire.Request:
    """A canonical request as either dialect can write it."""
    request = draw(st.builds(
        wire.Request, st.lists(messages, min_size=1, max_size=5).map(tuple),
        top_k=st.none() | st.just(5), source=st.sampled_from(["openai", "anthropic"]),
        tools=st.lists(st.builds(wire.Tool, words), max_size=1).map(tuple),
        response_format=st.none() | st.just(wire.ResponseFormat("json_object")),
        reasoning=st.none() | st.just(wire.Reasoning(effort="high")),
        extra=st.dictionaries(st.sampled_from(["seed", "metadata.x", "cache_control", "x"]), st.none() | st.just(1),
                              max_size=2),
    ))
    return attrs.evolve(request, messages=tuple(expressible(m, request.source) for m in request.messages))


def expressible(message: wire.Message, dialect: str) -> wire.Message:
    """The message as `dialect` can write it: an OpenAI body has no document by URL (an image
    stands in), an Anthropic one no tool call arguments but a JSON object."""
    if dialect == "openai":
        return attrs.evolve(message, content=tuple(attrs.evolve(p, type=wire.IMAGE) if p.type == wire.DOCUMENT and
                                                   p.url is not None else p for p in message.content))
    return attrs.evolve(message, tool_calls=tuple(c if wire.json_object(c.arguments) is not None and c.arguments
                                                  else attrs.evolve(c, arguments="{}") for c in message.tool_calls))
