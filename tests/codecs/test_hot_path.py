"""The per-frame and per-request fast paths only change the speed: each is checked against the
general path it short-cuts, on generated input (the JSON codec against the standard library,
the text-chunk reader against the general chunk walk, slotted stream chunks against whole
rendered chunks, the LF-only SSE split against the general line splitter, a text chunk read once
against the checked read, an answer head's kept names and counted values against the regex over
its lines, an upstream request on its profile's fixed head against the general render)."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from relayline.adapters import jsoncodec
from relayline.adapters.codecs import http1, openai_chat_replies
from relayline.adapters.codecs.anthropic_messages_answers import AnthropicStream
from relayline.adapters.codecs.anthropic_messages_replies import AnthropicStreamParser
from relayline.adapters.codecs.openai_chat_answers import OpenAIStream
from relayline.adapters.codecs.openai_chat_replies import OpenAIStreamParser
from relayline.adapters.providers.base import ProviderFailure
from relayline.adapters.sse import SSEDecoder, SSEEvent
from relayline.machines.stream import Event

EDGES = [b"NaN", b"[Infinity, -Infinity]", b"123456789012345678901234567890", b'"\\ud800"', b'{"a": "\\udfff x"}',
         b"[" * 1500 + b"]" * 1500, b'{"a": 1, "a": 2}', b"\xef\xbb\xbf{}", b'"\\ud83d\\ude00"', b"1e400", b"-0",
         '{"é": "ü"}'.encode("utf-16"), b"", b"{", b"[1,]", b"tru", b"\xff"]


def outcome(fn, data):
    try:
        value = fn(data)
    except RecursionError:
        return "RecursionError"
    except ValueError:
        return "ValueError"
    return repr(value) if not isinstance(value, float) or not math.isnan(value) else "nan"


@pytest.mark.parametrize("data", EDGES)
def test_the_codec_accepts_and_refuses_exactly_what_the_standard_library_does(data):
    assert outcome(jsoncodec.loads, data) == outcome(json.loads, data)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=20))
def test_what_the_codec_writes_reads_back_as_the_same_value(value):
    assert json.loads(jsoncodec.dumps(value)) == value
    assert jsoncodec.loads(json.dumps(value)) == value


def test_a_lone_surrogate_is_still_written_and_a_non_finite_number_is_null():
    assert json.loads(jsoncodec.dumps({"t": "a\ud800b"})) == {"t": "a\ud800b"}
    assert jsoncodec.dumps([math.inf, math.nan]) == b"[null,null]"  # json's NaN is not JSON


def _sendable(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_PIECES = st.lists(st.sampled_from(["a", "é", "\ud800", "\udfff", "\U0001f600", "1" * 19, "\\"]), max_size=6).map("".join)


@given(st.recursive(_PIECES | st.integers(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_PIECES, inner, max_size=3),
                    max_leaves=12))
@example(["x" * 5000, "\ud800"])
@example({"id": 10**20, "t": "\udc00"})
@example("\ud800\udfff")
def test_a_body_is_sendable_exactly_when_no_string_in_it_is_a_lone_surrogate(value):
    # orjson refuses a lone surrogate escape, so a body it read is not searched for one again;
    # `json` reads one written as raw bytes too (not UTF-8, but it decodes with surrogatepass)
    raws = [json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")]
    for raw in raws:
        document, sendable, _ = jsoncodec.loads_read(raw)
        assert document == json.loads(raw)
        assert sendable is _sendable(document)  # (an escaped surrogate pair reads as one character)


# -- the OpenAI text chunk ------------------------------------------------------------------------

deltas = st.dictionaries(st.sampled_from(["content", "role", "refusal", "reasoning_content", "tool_calls"]),
                         st.none() | st.text(max_size=5) | st.integers(), max_size=3)
chunks = st.fixed_dictionaries({}, optional={
    "choices": st.lists(st.fixed_dictionaries({}, optional={
        "delta": deltas | st.text(max_size=3), "finish_reason": st.none() | st.sampled_from(["stop", "length"]),
        "index": st.just(0)}) | st.integers(), max_size=2) | st.none() | st.text(max_size=2),
    "usage": st.none() | st.just({"prompt_tokens": 1, "completion_tokens": 2}),
    "error": st.none() | st.just("") | st.just({"message": "boom"}),
    "id": st.text(max_size=3)})
# the shape the shortcut takes, and that shape with one thing changed
PERTURB = [
    lambda c: None, lambda c: c["choices"][0].update(finish_reason="stop"),
    lambda c: c["choices"][0]["delta"].update(role="assistant"), lambda c: c["choices"][0]["delta"].update(refusal=None),
    lambda c: c["choices"][0]["delta"].update(content=""), lambda c: c["choices"][0]["delta"].update(content=None),
    lambda c: c["choices"][0]["delta"].update(content=5), lambda c: c.update(usage={"completion_tokens": 1}),
    lambda c: c.update(usage=None), lambda c: c.update(error="boom"), lambda c: c["choices"].append(c["choices"][0]),
    lambda c: c["choices"].clear(), lambda c: c["choices"][0].pop("delta"), lambda c: c["choices"][0].update(delta="x"),
    lambda c: c.update(choices=c["choices"][0]), lambda c: c["choices"][0]["delta"].update(reasoning_content="r"),
]


def _perturbed(text: str, change) -> dict:
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    change(chunk)
    return chunk


near_text = st.builds(_perturbed, st.text(min_size=1, max_size=4), st.sampled_from(PERTURB))


def read(obj, *, shortcut: bool):
    saved = openai_chat_replies._only_text
    if not shortcut:
        openai_chat_replies._only_text = lambda obj: None  # the general walk alone
    try:
        return OpenAIStreamParser().feed(SSEEvent(json.dumps(obj)))
    except ProviderFailure as exc:
        return ("failure", exc.failure.kind, exc.failure.detail)
    finally:
        openai_chat_replies._only_text = saved


@pytest.mark.parametrize("change", PERTURB)
@pytest.mark.parametrize("text", ["x", " wörd \\n"])
def test_the_text_chunk_shortcut_takes_only_what_the_general_walk_reads_as_one_text_frame(change, text):
    obj = _perturbed(text, change)
    assert read(obj, shortcut=True) == read(obj, shortcut=False)


@given(near_text | chunks)
def test_the_text_chunk_shortcut_reads_every_chunk_as_the_general_walk_does(obj):
    assert read(obj, shortcut=True) == read(obj, shortcut=False)


# -- a text chunk read once (jsoncodec.loads_shape) ------------------------------------------------

LONG = 123456789012345678901234567890  # orjson would read it as a float; `loads` reads it exactly


def _long(chunk: str) -> str:
    return chunk.replace("@", str(LONG))


def _checked(data):
    try:
        return jsoncodec.loads(data)
    except ValueError:
        return None


def feed(parser, data: str, *, one_read: bool):
    """The frames `parser` makes of one event, its chunk read once or by the checked read (as before)."""
    saved = jsoncodec.loads_shape
    if not one_read:
        jsoncodec.loads_shape = _checked
    try:
        return parser().feed(SSEEvent(data, "content_block_delta"))
    except ProviderFailure as exc:
        return ("failure", exc.failure.kind, exc.failure.detail)
    finally:
        jsoncodec.loads_shape = saved


@pytest.mark.parametrize("data", [
    _long('{"id":"c","created":@,"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}'),
    _long('{"choices":[{"index":@,"delta":{"content":"x"},"finish_reason":null}]}'),
    _long('{"choices":[{"index":0,"delta":{"content":@},"finish_reason":null}]}'),
    _long('{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}],"usage":{"prompt_tokens":@}}'),
    _long('{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":@}]}'),
    '{"choices":[{"index":0,"delta":{"content":"\\ud800"},"finish_reason":null}]}',
    '{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":NaN}]}',
    '{"choices":[{"index":0,"delta":{"content":"x"}}]',
    '[1]',
])
def test_an_openai_chunk_read_once_makes_the_frames_of_the_checked_read(data):
    assert feed(OpenAIStreamParser, data, one_read=True) == feed(OpenAIStreamParser, data, one_read=False)


@pytest.mark.parametrize("data", [
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}',
    _long('{"type":"content_block_delta","index":@,"delta":{"type":"text_delta","text":"hi"}}'),
    _long('{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":@}}'),
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta"}}',
    '{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"t"}}',
    '{"type":"content_block_delta","index":0,"delta":"x"}',
    '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\\ud800"}}',
    '{"index":0,"delta":{"type":"text_delta","text":"hi"}}',
])
def test_an_anthropic_delta_read_once_makes_the_frames_of_the_checked_read(data):
    assert feed(AnthropicStreamParser, data, one_read=True) == feed(AnthropicStreamParser, data, one_read=False)


def test_a_piece_of_an_earlier_tool_call_is_rendered_to_that_call():
    """Calls opened together, then their arguments (the ref names the earlier call's place): each
    dialect puts the piece where its SDK gathers that call's arguments."""
    events = [Event("tool", "first", "call_1"), Event("tool", "second", "call_2"), Event("tool_args", '{"x": 1}', "0"),
              Event("tool_args", '{"y": 2}')]
    openai, anthropic = OpenAIStream("chatcmpl-1", False), AnthropicStream("msg_1")
    openai.opening("m")
    anthropic.opening("m")
    chunks = [json.loads(openai.event(e).removeprefix(b"data: ")) for e in events]
    assert [c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in chunks] == [0, 1, 0, 1]
    deltas = [json.loads(line.removeprefix(b"data: ")) for e in events for line in anthropic.event(e).splitlines()
              if line.startswith(b"data: ") and b"input_json_delta" in line]
    assert [(d["index"], d["delta"]["partial_json"]) for d in deltas] == [(0, '{"x": 1}'), (1, '{"y": 2}')]


# -- slotted stream chunks ------------------------------------------------------------------------

@given(st.lists(st.tuples(st.sampled_from(["text", "reasoning"]), st.text(max_size=12)), min_size=1, max_size=6),
       st.text(max_size=8))
def test_a_slotted_chunk_is_the_whole_chunk_rendered(steps, model):
    openai = OpenAIStream("chatcmpl-1", False)
    openai.opening(model)
    anthropic = AnthropicStream("msg_1")
    anthropic.opening(model)
    for kind, value in steps:
        field = OpenAIStream.DELTAS[kind]
        whole = openai._chunk({field: value})
        slotted = openai.event(Event(kind, value))
        assert json.loads(slotted.removeprefix(b"data: ")) == json.loads(whole.removeprefix(b"data: "))
        if not any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            assert slotted == whole
        before = anthropic.index, anthropic.block
        out = anthropic.event(Event(kind, value))
        delta_type, key = ("text_delta", "text") if kind == "text" else ("thinking_delta", "thinking")
        last = out.split(b"event: ")[-1]
        assert last.startswith(b"content_block_delta\ndata: ")
        assert json.loads(last.split(b"data: ", 1)[1]) == {
            "type": "content_block_delta", "index": anthropic.index, "delta": {"type": delta_type, key: value}}
        assert anthropic.index == before[0] + (before[1] != kind)


# -- the LF-only SSE split ------------------------------------------------------------------------

lines = st.lists(st.sampled_from(["data: x", "data:{\"a\":1}", "event: e", ": ping", "id: 3", "", "data:  two",
                                  "retry: 5", "data: ü"]), max_size=12)


@given(lines, st.integers(min_value=1, max_value=7))
def test_lf_lines_decode_as_crlf_lines_do(items, step):
    def events(eol: bytes) -> tuple[list[SSEEvent], bool]:
        raw = b"".join(line.encode() + eol for line in items)
        decoder = SSEDecoder(comments=True)
        out = []
        for i in range(0, len(raw), step):
            out += decoder.feed(raw[i:i + step])
        return out, decoder.close()

    assert events(b"\n") == events(b"\r\n") == events(b"\r")


@pytest.mark.parametrize("data", [
    '{"a":1}', _long('{"a":@}'), _long('{"a":[@,"@"]}'), '{"a":NaN}', "null", "[1,2]", '"\\ud800"', "{", "",
    '{"a":1e400}', '{"a":1,"a":2}',
])
def test_a_document_read_after_its_shape_is_what_the_checked_read_makes(data):
    def outcome(read):
        try:
            return ("value", repr(read()))
        except ValueError:
            return ("refused",)

    assert outcome(lambda: jsoncodec.loads_after_shape(data, jsoncodec.loads_shape(data))) == \
        outcome(lambda: jsoncodec.loads(data))


# the answer head's check as it was written before the names were kept and the values counted:
# one regex over all the lines, and the lines counted (each name a token on its own, too)
_HEAD_LINES = re.compile(rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+: [^\r\n\0]*\r\n)*").fullmatch
_TOKEN_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+").fullmatch


def _head_by_regex(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = b"".join([name + b": " + value + b"\r\n" for name, value in headers])
    if _HEAD_LINES(lines) is None or lines.count(b"\n") != len(headers) or \
            not all(_TOKEN_NAME(name) for name, _ in headers):
        raise ValueError("refused")
    return b"HTTP/1.1 %d %s\r\n%s\r\n" % (status, http1.REASONS.get(status, b""), lines)


_names = st.sampled_from([b"content-type", b"x-relayline-served", b"date", b"X-Up", b"a!#$%&'*+.^_`|~9"]) | \
    st.sampled_from([b"a b", b"a:b", b"", b"x\r\ny", b"\xff", b"x-\x7f", b"a\0"]) | st.binary(max_size=6)
_values = st.sampled_from([b"", b"application/json", b"true", b" v ", b"\t", b"\xff\xfe", b"a: b"]) | \
    st.sampled_from([b"x\r\ny: z", b"v\r", b"v\n", b"v\0", b"\r\n", b"\n\r"]) | st.binary(max_size=6)


@given(st.sampled_from([200, 204, 400, 431, 599, 999]),
       st.lists(st.tuples(_names, _values), max_size=8))
@example(200, [(b"a", b"v\0")])
@example(200, [(b"a", b"v\r"), (b"b", b"\n")])
@example(200, [(b"a", b"x\r\nb: y")])
@example(200, [(b"a b", b"v")])
@example(200, [])
def test_an_answer_head_is_rendered_and_refused_as_the_regex_over_its_lines_did(status, headers):
    def outcome(render):
        try:
            return render(status, list(headers))
        except ValueError:
            return "refused"

    assert outcome(http1.render_response_head) == outcome(_head_by_regex)
    assert outcome(http1.render_response_head) == outcome(_head_by_regex)  # (a name kept as a token on the first)


_upstream_names = st.sampled_from(["content-type", "authorization", "x-team", "X-Team", "user-agent", "accept", "host",
                                   "x-request-id", "openai-beta", "content-length", "a b", "a\nb", "", "é"])
_upstream_values = st.sampled_from(["application/json", "Bearer sk-1", "core", "", " padded", "x\r\ny: z", "\0",
                                    "ü", "€", "1"]) | st.text(max_size=6)


@given(st.dictionaries(_upstream_names, _upstream_values, max_size=5),
       st.dictionaries(_upstream_names, _upstream_values, max_size=3),
       st.sampled_from(["http://127.0.0.1:9/v1/chat/completions", "https://api.example.com/v1/messages?beta=true",
                        "ftp://nowhere/x"]),
       st.sets(_upstream_names, max_size=2))
@example({"content-type": "application/json", "x-request-id": "profile's"}, {"x-request-id": "the request's"},
         "http://127.0.0.1:9/v1/chat/completions", set())
@example({"X-Team": "a", "x-team": "b"}, {}, "http://127.0.0.1:9/v1/chat/completions", set())
@example({"x-team": "a", "accept": "b"}, {}, "http://127.0.0.1:9/v1/chat/completions", {"accept"})
def test_a_request_on_its_profiles_fixed_head_is_rendered_and_refused_as_the_general_render(profile, added, url, removed):
    """The fixed head (a profile's headers rendered and checked once) changes nothing a request
    sends or is refused for: whatever a request adds, replaces or removes after it was built."""
    def outcome(fixed):
        headers = http1.lowercase(profile)
        headers.update(added)
        for name in removed:
            headers.pop(name, None)
        try:
            return http1.render(http1.UpstreamRequest(url, headers, b'{"a":1}', fixed))
        except (ValueError, UnicodeEncodeError) as exc:
            return type(exc).__name__, str(exc)

    fixed = http1.fixed_head(url, profile)
    assert outcome(fixed) == outcome(None)


def test_a_profiles_requests_share_one_fixed_head_per_key_and_forwarded_headers():
    from relayline.adapters.providers.base import CallRequest
    from relayline.adapters.relay import Relay
    from relayline.machines import wire
    from relayline.machines.config import parse_config

    relay = Relay(parse_config('active = "p"\n[providers.p]\nfamily = "openai"\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n'
                               'api_keys = ["k1", "k2"]\nheaders = { X-Team = "core" }\n'), env={})
    protocol = relay.clients["openai"].protocol
    entry = relay.plan(model=None, gateway=True).entries[0]

    def built(key_index: int, forwarded=()):
        request = wire.Request(messages=(wire.Message(wire.USER, (wire.Part(wire.TEXT, "hi"),)),), source="openai",
                               passthrough=wire.Passthrough({"messages": [{"role": "user", "content": "hi"}]}, forwarded))
        return protocol.build(CallRequest(entry, entry.model, request, entry.keys[key_index], key_index))

    first, again, other_key = built(0), built(0), built(1)
    beta = built(0, (("openai-beta", "assistants=v2"),))
    assert first.fixed is again.fixed and first.headers is not again.headers  # (each request's own dict)
    assert other_key.fixed is not first.fixed and other_key.headers["authorization"] == "Bearer k2"
    assert first.headers == {"content-type": "application/json", "x-team": "core", "authorization": "Bearer k1"}
    assert beta.headers["openai-beta"] == "assistants=v2" and beta.fixed is not first.fixed
    for shown in (repr(first.fixed), repr(other_key.fixed), repr(first), repr(other_key)):
        assert "k1" not in shown and "k2" not in shown  # (neither a kept head nor a request shows its key)
    assert "authorization" in repr(first)  # (the names are there)
    for request in (first, other_key, beta):
        general = http1.UpstreamRequest(request.url, request.headers, request.body)
        assert http1.render(request) == http1.render(general)


# -- the long-number check before orjson (jsoncodec._no_long_number) --------------------------------

_RUN_OF_19 = re.compile(r"[0-9]{19}")


@pytest.mark.parametrize("kind", [str, bytes, bytearray])
def test_a_run_of_19_digits_is_found_at_every_offset_and_a_shorter_one_never(kind):
    # (every 6th character is looked at first: a run of 19 covers three of them wherever it starts)
    for offset in range(30):
        for length in range(9, 22):
            for filler in ("x", "é", " "):
                text = filler * offset + "7" * length + filler * 11
                data = text if kind is str else kind(text.encode())
                assert jsoncodec._no_long_number(data) is (length < 19), (offset, length, filler)


@given(st.lists(st.one_of(st.text("0123456789", min_size=1, max_size=25), st.text("ab\"é,:{}[] ", min_size=1, max_size=12)),
                max_size=12))
def test_the_long_number_check_is_a_search_for_19_digits(pieces):
    text = "".join(pieces)
    expected = _RUN_OF_19.search(text) is None
    assert jsoncodec._no_long_number(text) is expected
    assert jsoncodec._no_long_number(text.encode()) is expected
