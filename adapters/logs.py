"""Log records as operators read them: `text` (key=value) or `json` (one object per line).

relayline's own lines are events with fields: the access line, turns, fallbacks, breaker
transitions, reloads and drains carry theirs as a dict (`event`, or `extra={"fields": ...}`),
which both formats render as fields; a few rarer lines still write `event key=value` text. Neither
format adds anything a record did not carry: prompt text and keys never reach a record in the
first place, and redact.py masks configured secrets in every record that is emitted.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import TextIO

LEVELS = ("debug", "info", "warning", "error")


_second: tuple[int, str] = (-1, "")  # the last second stamped and its text: most lines share one


def _stamp(record: logging.LogRecord) -> str:
    global _second
    second, known = int(record.created), _second  # (one read: another thread may stamp meanwhile)
    if second != known[0]:
        known = _second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{known[1]}.{int(record.msecs):03d}Z"


_QUOTED = re.compile(r'[ "=\\]')  # a text value with one of these is written as a JSON string


def _text_value(value: object) -> str:
    # (an access line has about 15 fields: a number's text never needs quotes, and one regex
    # pass over a string replaces four scans of it)
    if value is None:
        return "null"
    if type(value) is int or type(value) is float:
        return str(value)
    text = str(value)
    plain = text and text.isprintable() and _QUOTED.search(text) is None
    return text if plain else json.dumps(text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = (f"ts={_stamp(record)} level={record.levelname.lower()} logger={record.name} "
                f"{record.getMessage()}")
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


def event(logger: logging.Logger, level: int, name: str, /, **fields: object) -> None:
    """One event with its fields: `name key=value ...` in text, and in JSON one object whose
    fields are JSON values (a missing one is null), as the access line is. The record is made
    only when its level is logged."""
    if logger.isEnabledFor(level):
        logger.log(level, name, extra={"fields": fields})


def configure(level: str = "warning", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Route every record at `level` and above to stderr (or `stream`) in the chosen format.

    Neither format writes a record's source line, thread or process, so a process configured
    here does not gather them: logging's own switches for that (its "Optimization" advice)
    spare each record a walk up the stack for its caller and the lookups of its thread's and
    process's names, and a gateway writes two records a request at info level."""
    logging._srcfile = None  # (its documented switch: no caller lookup)
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
