"""Keeps configured secrets out of log records, ours and our HTTP stack's.

relayline's own log lines never format a key. But httpcore logs response headers at DEBUG, and
a provider may echo a key back (in an error header, a URL, a body): once an embedder turns DEBUG
on, that would reach their logs. Every Relay registers its credentials here, and a filter on
the loggers of relayline and its HTTP stack rewrites any record that contains one. Filters run
only for records that are emitted, so this costs nothing at the default log levels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

# filters do not inherit: each logger that emits records needs its own
LOGGERS = ("relayline", "httpx", "httpcore", "httpcore.connection", "httpcore.http11", "httpcore.http2",
           "httpcore.proxy", "hpack", "relayline.gateway",
           "relayline.access")
MASK = "***"


class SecretFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            message = record.getMessage()
            if any(secret in message for secret in self.secrets):
                for secret in self.secrets:
                    message = message.replace(secret, MASK)
                record.msg, record.args = message, ()
            fields = getattr(record, "fields", None)
            if fields:  # structured fields (the access line) are masked the same way
                record.fields = {k: self._mask(v) for k, v in fields.items()}
        return True

    def _mask(self, value):
        if isinstance(value, str):
            for secret in self.secrets:
                value = value.replace(secret, MASK)
        return value


_filter = SecretFilter()
_installed = False


def protect(secrets: Iterable[str]) -> None:
    """Redact these values from every record of relayline's and its HTTP stack's loggers."""
    global _installed
    _filter.secrets.update(s for s in secrets if s)
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
