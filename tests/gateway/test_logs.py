"""The text log format's values and timestamps, written the quick way, as the plain rule writes
them (an access line at `--log-level info` is formatted on every request)."""

from __future__ import annotations

import json
import logging
import re
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


def _masked_by_rule(text: str, long: list[str], short: list[str]) -> str:
    """The rule: a long secret masked wherever it is, then a short one where it stands as a whole
    token (no key character, [A-Za-z0-9_-], next to it)."""
    for secret in long:
        text = text.replace(secret, "***")
    if short:
        words = "|".join(re.escape(s) for s in sorted(short, key=len, reverse=True))
        text = re.sub(f"(?<![A-Za-z0-9_\\-])(?:{words})(?![A-Za-z0-9_\\-])", "***", text)
    return text


SECRET_TEXT = st.text(alphabet="ab-\n =", max_size=40)


@given(st.lists(st.text(alphabet="ab-\n", min_size=1, max_size=20), max_size=3),
       st.dictionaries(st.sampled_from("uvwxyz"), st.one_of(SECRET_TEXT, st.integers(), st.none()), max_size=6),
       SECRET_TEXT)
def test_a_records_message_and_fields_are_masked_as_the_rule_masks_them(secrets, fields, message):
    from relayline.adapters.redact import SHORT_SECRET_CHARS, SecretFilter, Secrets

    long = [s for s in set(secrets) if len(s) >= SHORT_SECRET_CHARS]
    short = [s for s in set(secrets) if len(s) < SHORT_SECRET_CHARS]
    masking = SecretFilter()
    masking.secrets = Secrets().with_(secrets)
    record = logging.LogRecord("relayline.access", logging.INFO, "f", 1, "%s", (message,), None)
    record.fields = dict(fields)
    assert masking.filter(record)
    assert record.getMessage() == _masked_by_rule(message, long, short)
    assert record.fields == {k: _masked_by_rule(v, long, short) if isinstance(v, str) else v
                             for k, v in fields.items()}
