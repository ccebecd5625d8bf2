"""The SSE decoder: the format's corner cases, strictness, and any split of the bytes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relayline.adapters.sse import SSEDecoder, SSEEvent, SSEProtocolError


def decode(data: bytes, **kwargs):
    d = SSEDecoder(**kwargs)
    events = d.feed(data)
    return events, d.close()


def test_lf_crlf_and_cr_line_endings_are_the_same():
    for eol in (b"\n", b"\r\n", b"\r"):
        events, clean = decode(b"event: a" + eol + b"data: x" + eol + eol)
        assert events == [SSEEvent("x", "a")] and clean


def test_multi_line_data_is_joined_with_newlines():
    events, _ = decode(b"data: one\ndata:two\ndata:  three\n\n")
    assert events[0].data == "one\ntwo\n three"


def test_comments_are_keep_alives():
    events, _ = decode(b": ping\n\ndata: x\n\n")
    assert events == [SSEEvent("x")]
    events, _ = decode(b": ping\n\n", comments=True)
    assert events == [SSEEvent("ping", "comment", None, True)]


def test_id_and_unknown_fields():
    events, _ = decode(b"id: 7\nretry: 100\nfoo: bar\ndata: x\n\n")
    assert events == [SSEEvent("x", "message", "7")]


def test_a_trailing_partial_event_is_not_clean():
    events, clean = decode(b"data: x\n\ndata: partial")
    assert [e.data for e in events] == ["x"] and not clean
    _, clean = decode(b"data: x\n")
    assert not clean


def test_invalid_utf8_is_a_protocol_error():
    with pytest.raises(SSEProtocolError, match="UTF-8"):
        SSEDecoder().feed(b"data: \xff\xfe\n\n")


def test_oversized_events_are_refused_even_without_a_newline():
    d = SSEDecoder(max_event_bytes=64)
    with pytest.raises(SSEProtocolError, match="larger than 64"):
        d.feed(b"data: " + b"x" * 100)
    d = SSEDecoder(max_event_bytes=64)
    with pytest.raises(SSEProtocolError):
        for _ in range(10):
            d.feed(b"data: " + b"y" * 10 + b"\n")


STREAM = (
    b"event: message_start\r\ndata: {\"a\": \"\xc3\xa9t\xc3\xa9\"}\r\n\r\n"
    b": keep-alive\n\n"
    b"data: line one\ndata: line two\n\n"
    b"event: ping\rdata: {}\r\r"
    b"data: [DONE]\n\n"
)


@pytest.mark.property
@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_any_split_gives_the_same_events(cuts):
    whole, clean = decode(STREAM)
    d = SSEDecoder()
    got = []
    points = sorted(set(cuts))
    for a, b in zip([0, *points], [*points, len(STREAM)], strict=True):
        got.extend(d.feed(STREAM[a:b]))
    assert got == whole and d.close() == clean
    assert [e.event for e in got] == ["message_start", "message", "ping", "message"]


@pytest.mark.fuzz
@given(data=st.binary(max_size=512), cuts=st.lists(st.integers(0, 512), max_size=8))
def test_arbitrary_bytes_never_crash_and_stay_bounded(data, cuts):
    d = SSEDecoder(max_event_bytes=256)
    points = sorted({c for c in cuts if c <= len(data)})
    try:
        for a, b in zip([0, *points], [*points, len(data)], strict=True):
            for event in d.feed(data[a:b]):
                assert isinstance(event.data, str)
            assert len(d._buffer) <= 256 + len(data)
    except SSEProtocolError:
        pass
    d.close()
