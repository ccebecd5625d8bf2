"""Keeps configured secrets out of log records, ours and our HTTP stack's.

relayline's own log lines never format a key. But httpcore logs response headers at DEBUG, and
a provider may echo a key back (in an error header, a URL, a body): once an embedder turns DEBUG
on, that would reach their logs. Every Relay registers its credentials here, and a filter on
the loggers of relayline and its HTTP stack rewrites any record that contains one. Filters run
only for records that are emitted, so this costs nothing at the default log levels.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable

import attrs

# filters do not inherit: each logger that emits records needs its own
LOGGERS = ("relayline", "httpx", "httpcore", "httpcore.connection", "httpcore.http11",
           "httpcore.http2", "httpcore.proxy", "hpack", "relayline.gateway", "relayline.access")
MASK = "***"
# a secret at least this long is masked wherever it appears; a shorter one (a test key such as
# "x", a placeholder) only where it stands as a whole token, since masking it inside every word
# that contains it would garble every line ("relayline" with a key "e") and tell a reader the key
SHORT_SECRET_CHARS = 16
# what a whole token is not next to: the characters keys are made of
_TOKEN_EDGE = "A-Za-z0-9_\\-"
# between a record's field texts when they are searched together: outside _TOKEN_EDGE, so a
# short secret next to it still stands as a whole token, as at a text's own end
_FIELD_BREAK = "\n"


@attrs.frozen
class Secrets:
    """The protected values, as one value: `protect` replaces it, never changes it."""

    anywhere: frozenset[str] = frozenset()  # masked wherever they appear
    words: frozenset[str] = frozenset()  # short ones, masked as whole tokens only
    pattern: re.Pattern[str] | None = None  # the short ones' whole-token pattern

    def with_(self, secrets: Iterable[str]) -> Secrets:
        new = {s for s in secrets if s}
        anywhere = self.anywhere | {s for s in new if len(s) >= SHORT_SECRET_CHARS}
        words = self.words | {s for s in new if len(s) < SHORT_SECRET_CHARS}
        pattern = self.pattern
        if words != self.words:
            alternatives = "|".join(re.escape(s) for s in sorted(words, key=len, reverse=True))
            pattern = re.compile(f"(?<![{_TOKEN_EDGE}])(?:{alternatives})(?![{_TOKEN_EDGE}])")
        return Secrets(frozenset(anywhere), frozenset(words), pattern)

    def mask(self, text: str) -> str:
        for secret in self.anywhere:
            if secret in text:
                text = text.replace(secret, MASK)
        pattern = self.pattern
        return pattern.sub(MASK, text) if pattern is not None and self._word_in(text) else text

    def found_in(self, text: str) -> bool:
        """Whether `mask` would change `text`: a search, no copy made."""
        for secret in self.anywhere:
            if secret in text:
                return True
        pattern = self.pattern
        return pattern is not None and self._word_in(text) and pattern.search(text) is not None

    def _word_in(self, text: str) -> bool:
        """Whether a short secret is in `text` at all, whole token or not: the whole-token
        pattern is tried only then. A substring search skips ahead by the secret's length; the
        pattern, led by its lookbehind, stops at every character of the text."""
        for word in self.words:
            if word in text:
                return True
        return False


class SecretFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.secrets = Secrets()

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self.secrets  # (one read: `protect` replaces the value, never changes it)
        if secrets.anywhere or secrets.words:
            message = record.getMessage()
            masked = secrets.mask(message)
            if masked != message:
                record.msg, record.args = masked, ()
            fields = getattr(record, "fields", None)
            # structured fields (the access line) are masked the same way, each apart, when
            # their texts joined hold a secret: every secret in a field is in them joined (and a
            # whole token stays one, _FIELD_BREAK), and a find across two fields only costs the
            # masking. Most records hold none, and masking each of the access line's dozen texts
            # cost a scan and a copy apiece
            if fields and secrets.found_in(_FIELD_BREAK.join(
                    [v for v in fields.values() if isinstance(v, str)])):
                record.fields = {k: secrets.mask(v) if isinstance(v, str) else v
                                 for k, v in fields.items()}
        return True


_filter = SecretFilter()
_protecting = threading.Lock()
_installed = False


def protect(secrets: Iterable[str]) -> None:
    """Redact these values from every record of relayline's and its HTTP stack's loggers."""
    global _installed
    # a new value, not the old one changed: a reload builds its Relay (and protects its keys) in
    # a worker thread while the event loop's records are filtered
    with _protecting:
        _filter.secrets = _filter.secrets.with_(secrets)
    if not _installed:
        for name in LOGGERS:
            logging.getLogger(name).addFilter(_filter)
        _installed = True


def redact(text: str) -> str:
    """`text` with every protected secret masked (for the few provider words a client is shown)."""
    return _filter.secrets.mask(text)
