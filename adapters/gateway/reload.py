"""Live reload: the configuration file loaded again while the gateway serves (SIGHUP, or
POST /admin/reload with an admin key).

The new file is validated whole first (TOML, every key, credentials and the fallback graph, as
`relayline check` does); a bad file changes nothing and the answer lists its problems with their
key paths. A good one becomes a new Relay that new turns use, while turns in flight finish on
the one they started with (each holds its own). Health is kept: the health store (memory or
Redis) passes to the new Relay, with the breaker settings of the new file, and forgets only the
profiles the new file no longer has. [health] and [ledger] name connections that live as long
as the process: a reload that changes them is refused (restart to change them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import attrs
import trio

from relayline.machines.config import Config, structure_config
from relayline.machines.errors import ConfigError

from ..relay import Relay

log = logging.getLogger("relayline.gateway")


@attrs.frozen
class ReloadReport:
    ok: bool
    problems: tuple[str, ...] = ()
    profiles: tuple[str, ...] = ()

    def as_json(self) -> dict:
        if self.ok:
            return {"reloaded": True, "profiles": list(self.profiles)}
        return {"reloaded": False, "problems": list(self.problems)}


def load_file(path: str | os.PathLike) -> Config:
    import tomllib

    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{path}: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from None
    return structure_config(raw)


class Reloader:
    """Reloads one gateway from one file. Reloads run one at a time."""

    def __init__(self, gateway, path: str | os.PathLike, env: Mapping[str, str] | None = None) -> None:
        self.gateway = gateway
        self.path = str(path)
        self.env = os.environ if env is None else env
        self._lock = trio.Lock()
        self.reloads = 0

    async def reload(self) -> ReloadReport:
        async with self._lock:
            report = await self._reload()
        if report.ok:
            self.reloads += 1
            log.warning("config_reloaded path=%s profiles=%d", self.path, len(report.profiles))
        else:
            log.warning("config_reload_rejected path=%s problems=%s", self.path, "; ".join(report.problems))
        return report

    async def _reload(self) -> ReloadReport:
        old: Relay = self.gateway.relay
        try:
            config = load_file(self.path)
            fixed = [name for name in ("health", "ledger") if getattr(config, name) != getattr(old.config, name)]
            if fixed:
                raise ConfigError([f"{name}: changed; it names a connection kept for the process's life "
                                   "(restart to change it)" for name in fixed])
            relay = Relay(config, env=self.env, health=old.health, sim=old.sim)
        except ConfigError as exc:
            return ReloadReport(False, tuple(exc.problems))
        relay.selection = old.selection
        relay.fallback_record.update(old.fallback_record)
        try:
            await self.gateway.swap(relay, self.env)  # checks the gateway's keys first
        except ConfigError as exc:
            await relay.aclose()
            return ReloadReport(False, tuple(exc.problems))
        reconfigure = getattr(relay.health, "reconfigure", None)  # an embedder's own store may not
        if reconfigure is not None:
            reconfigure(config.breaker, config.providers)
        return ReloadReport(True, profiles=tuple(sorted(config.providers)))
