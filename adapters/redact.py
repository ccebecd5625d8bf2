"""Keeps configured secrets out of log records, ours and our HTTP stack's.

relayline's own log lines never format a key. But httpcore logs response headers at DEBUG, and
a provider may echo a key back (in an error header, a URL, a body): once an embedder turns DEBUG
on, that would reach their logs. Every Relay registers its credentials here, and a filter on
the loggers of relayline and its HTTP stack rewrites any record that contains one. Filters run
only for records that are emitted, so this costs nothing at the default log levels.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

# filters do not inherit: each logger that emits records needs its own
LOGGERS = ("relayline", "httpx", "httpcore", "httpcore.connection", "httpcore.http11", "httpcore.http2",
           "httpcore.proxy", "hpack", "relayline.gateway",
           "relayline.access")
MASK = "***"


class SecretFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.secrets: frozenset[str] = frozenset()

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self.secrets  # (one read: `protect` replaces the set, never changes it)
        if secrets:
            message = record.getMessage()
            if any(secret in message for secret in secrets):
                for secret in secrets:
                    message = message.replace(secret, MASK)
                record.msg, record.args = message, ()
            fields = getattr(record, "fields", None)
            if fields:  # structured fields (the access line) are masked the same way
                record.fields = {k: _mask(v, secrets) for k, v in fields.items()}
        return True


def _mask(value, secrets: frozenset[str]):
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, MASK)
    return value


_filter = SecretFilter()
_protecting = threading.Lock()
_installed = False


def protect(secrets: Iterable[str]) -> None:
    """Redact these values from every record of relayline's and its HTTP stack's loggers."""
    global _installed
    # a new set, not the old one changed: a reload builds its Relay (and protects its keys) in a
    # worker thread while the event loop's records are filtered
    new = {s for s in secrets if s}
    with _protecting:
        _filter.secrets = _filter.secrets | new
    if not _installed:
        for name in LOGGERS:
            logging.getLogger(name).addFilter(_filter)
        _installed = True


def redact(text: str) -> str:
    """`text` with every protected secret masked (for the few provider words a client is shown)."""
    for secret in _filter.secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
