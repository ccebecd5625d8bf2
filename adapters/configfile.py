"""Reading a config file: what `check`, `plan`, `serve`, a live reload and the supervisor of a
fleet all read, read one way.

Every way a file can be unusable is a ConfigError naming the path, never another exception: a
reload runs this while the gateway serves, and anything else raised there would end the process
(and, in a fleet, every worker at once). The file is opened without blocking and read only when
it is a regular file (a FIFO would hold the reader for ever, a device never end) of at most
MAX_CONFIG_BYTES; a file that changed while it was read (rewritten in place) is read again.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

from relayline.machines.config import Config, parse_toml, structure_config
from relayline.machines.errors import ConfigError

# far beyond a config's size (a thousand profiles are well under 1 MiB), well below what would
# exhaust memory while parsed (a TOML document takes about ten times its size as Python objects)
MAX_CONFIG_BYTES = 32 * 1024 * 1024
# reads of a file that changed while read before it is refused: a writer that finishes between
# two reads is waited out, one that keeps rewriting it is not waited on for ever
READ_ATTEMPTS = 5
REREAD_PAUSE_S = 0.05


def read_config_bytes(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes, or ConfigError (missing, unreadable, not a regular file, too large,
    rewritten in place while read). A file rewritten in place rather than renamed over can be
    read half written, and a cut TOML file is often still valid (a table or a fallback gone),
    so a read the file's size or modification time moved under is read again, up to
    READ_ATTEMPTS times, and then refused."""
    for attempt in range(READ_ATTEMPTS):
        if attempt:
            time.sleep(REREAD_PAUSE_S)  # (a reload reads in a worker thread, off the event loop)
        data, steady = _read_once(path)
        if steady:
            if len(data) > MAX_CONFIG_BYTES:
                megabytes = MAX_CONFIG_BYTES // (1024 * 1024)
                raise ConfigError([f"{os.fspath(path)}: larger than {megabytes} MiB, "
                                   "more than any config needs"])
            return data
    raise ConfigError([f"{os.fspath(path)}: changed while it was read ({READ_ATTEMPTS} times); "
                       "write the new file beside it and rename it over this one"])


def _read_once(path: str | os.PathLike[str]) -> tuple[bytes, bool]:
    """The file's bytes, and whether it held still while read: the same size and modification
    time before and after, and as many bytes read as it had."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError([f"{os.fspath(path)}: {exc.strerror}"]) from None
    try:
        before = os.fstat(fd)
        if stat.S_ISDIR(before.st_mode):
            raise ConfigError([f"{os.fspath(path)}: is a directory, not a config file"])
        if not stat.S_ISREG(before.st_mode):
            raise ConfigError([f"{os.fspath(path)}: not a regular file"])
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
        after = os.fstat(fd)
    except OSError as exc:
        raise ConfigError([f"{os.fspath(path)}: {exc.strerror}"]) from None
    finally:
        os.close(fd)
    steady = ((before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns)
              and (len(data) == after.st_size or len(data) > MAX_CONFIG_BYTES))
    return data, steady


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file as plain TOML data. A scenario file's `[config]` table is read as the config
    (operators copy them around)."""
    return config_document(read_config_bytes(path), os.fspath(path))


def config_document(data: bytes, path: str) -> dict[str, Any]:
    """A config file's bytes (read from `path`) as plain TOML data; ConfigError when they are
    not."""
    try:
        # utf-8-sig: a byte order mark (Windows editors write one) is read past, not an error
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                           f"{exc.start}); save it as UTF-8"]) from None
    raw = parse_toml(text, path)
    if "config" in raw and "active" not in raw:
        raw = raw["config"]
    return raw


def load_config_file(path: str | os.PathLike[str]) -> Config:
    """The file's Config, or ConfigError listing every problem with its key path."""
    return structure_config(read_config_file(path))
