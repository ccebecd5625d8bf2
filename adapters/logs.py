"""Log records as operators read them: `text` (key=value) or `json` (one object per line).

relayline's own lines are `event key=value ...` messages; the gateway's access line carries
its fields as a dict (`extra={"fields": ...}`), which both formats render as fields. Neither
format adds anything a record did not carry: prompt text and keys never reach a record in the
first place, and redact.py masks configured secrets in every record that is emitted.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = ("debug", "info", "warning", "error")


def _stamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _text_value(value) -> str:
    text = "null" if value is None else str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\\')) or not text.isprintable() else text


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"ts={_stamp(record)} level={record.levelname.lower()} logger={record.name} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": _stamp(record), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        obj.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def configure(level: str = "warning", fmt: str = "text", stream=None) -> None:
    """Route every record at `level` and above to stderr (or `stream`) in the chosen format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
