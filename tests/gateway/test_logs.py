"""The text log format's values and timestamps, written the quick way, as the plain rule writes
them (an access line at `--log-level info` is formatted on every request)."""

from __future__ import annotations

import json
import logging
import time

from hypothesis import given
from hypothesis import strategies as st

from relayline.adapters import logs


def _text_value_by_rule(value) -> str:
    """The rule: `null` for None, else the value's text, as a JSON string when it is empty,
    unprintable or holds a space, a quote, an equals sign or a backslash."""
    text = "null" if value is None else str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\\')) or not text.isprintable() else text


def _stamp_by_rule(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(), st.text(alphabet=' "=\\\n\t\x00\u2028abc'))


@given(VALUES)
def test_a_text_value_is_written_as_the_rule_writes_it(value):
    assert logs._text_value(value) == _text_value_by_rule(value)


@given(st.lists(st.floats(min_value=0, max_value=4e9, allow_nan=False), min_size=1, max_size=20))
def test_a_timestamp_is_written_as_the_rule_writes_it_whatever_second_came_before(times):
    for created in sorted(times) + times:  # (the same second again, the next, and back in time)
        record = logging.LogRecord("relayline", logging.INFO, "f", 1, "m", (), None)
        record.created, record.msecs = created, int((created - int(created)) * 1000)
        assert logs._stamp(record) == _stamp_by_rule(record)


def test_an_access_line_reads_as_before():
    record = logging.LogRecord("relayline.access", logging.INFO, "f", 1, "access", (), None)
    record.created, record.msecs = 1_764_500_000.25, 250
    record.fields = {"path": "/v1/chat/completions", "status": 200, "latency_ms": 1.5, "client": None,
                     "served": "a b", "note": 'say "hi"', "empty": ""}
    assert logs.TextFormatter().format(record) == (
        'ts=2025-11-30T10:53:20.250Z level=info logger=relayline.access access path=/v1/chat/completions '
        'status=200 latency_ms=1.5 client=null served="a b" note="say \\"hi\\"" empty=""')
