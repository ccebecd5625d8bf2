"""Live reload: the configuration file loaded again while the gateway serves (SIGHUP, or
POST /admin/reload with an admin key).

The new file is validated whole first (TOML, every key, credentials and the fallback graph, as
`relayline check` does); a bad file changes nothing and the answer lists its problems with their
key paths. Whatever is wrong with the file (not UTF-8, nested beyond what the parser recurses,
too large, a directory, gone, unreadable) is such a problem, never an exception: one raised
here would end the process, and with SIGHUP passed to every worker of a fleet, all of them at
once. Reading, parsing and validating the file and building its Relay run in a worker thread:
a large file took seconds of the event loop, every stream in flight stood still meanwhile and
the breakers of healthy profiles opened on the silence.

A good file becomes a new Relay that new turns use, while turns in flight finish on the one
they started with (each holds its own). Health is kept: the health store (memory or Redis)
passes to the new Relay, with the breaker settings of the new file, and forgets only the
profiles the new file no longer has, and the key cursor and sitting-out keys of a profile whose
key pool changed (they name keys by their place in the pool). [health] and [ledger] name connections
that live as long as the process: a reload that changes them is refused (restart to change them). A
reload never turns authentication off: a file without client keys, while the running gateway has
them, is refused (restart to run without them).

In a fleet (`--workers N`) each worker has its own Reloader, and a POST /admin/reload reaches
the one worker its connection landed on: that worker reloads, answers, and then asks its
supervisor to reload the fleet as a SIGHUP to the supervisor does (`fleet`), so that no worker
serves on the old file. A SIGHUP that comes while a process is still starting is kept
(`EarlyReloads`) and reloaded once the gateway listens for SIGHUP: ignored, a worker started
again as the fleet reloaded would have served the file's previous version.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any, Protocol

import attrs
import trio

from relayline.machines.config import Config
from relayline.machines.errors import ConfigError

from ..configfile import load_config_file
from ..logs import event
from ..relay import Relay
from .auth import Access, bind_refusal, load_access

log = logging.getLogger("relayline.gateway")


def pools_changed(old: Relay, new: Relay) -> list[str]:
    """The profiles kept across a reload whose credentials changed (added, removed, reordered):
    their health names keys by place, so it no longer names the same keys."""
    before, after = old.router.keys, new.router.keys
    return [
        profile for profile, keys in after.items() if profile in before and before[profile] != keys
    ]


@attrs.frozen
class ReloadReport:
    ok: bool
    problems: tuple[str, ...] = ()
    profiles: tuple[str, ...] = ()
    stopping: bool = False  # refused because the gateway is draining, not for the file's sake

    def as_json(self) -> dict[str, Any]:
        if self.ok:
            return {"reloaded": True, "profiles": list(self.profiles)}
        return {"reloaded": False, "problems": list(self.problems)}


def accept_reload(running: Config, running_access: Access, config: Config, env: Mapping[str, str],
                  host: str | None = None) -> Access:
    """The access `config` gives, when a gateway running `running` (listening on `host`, when
    known) may take it; else ConfigError naming why not."""
    fixed = [name for name in ("health", "ledger")
             if getattr(config, name) != getattr(running, name)]
    if fixed:
        raise ConfigError([f"{name}: changed; it names a connection kept for the process's life "
                           "(restart to change it)" for name in fixed])
    access = load_access(config, env)  # a key variable now unset fails the reload, not the gateway
    if running_access.clients and not access.clients:
        raise ConfigError(["gateway.api_keys_env: the running gateway requires client keys and "
                           "this file "
                           "names none; a reload never turns authentication off (restart to do "
                           "that)"])
    if host is not None and bind_refusal(config, host) is not None:
        # (an open gateway, auth = "none", reloaded to the default "keys" without naming any: the
        # file means loopback only, which serve enforces where it binds; a reload cannot rebind)
        raise ConfigError(["gateway.api_keys_env: this file names no client keys, so the gateway "
                           "would answer on "
                           f"loopback only, and it listens on {host}; name client keys (or keep "
                           "auth = \"none\")"])
    return access


class EarlyReloads:
    """SIGHUPs that come before the gateway listens for them: noted, not lost. A worker inherits
    SIGHUP blocked from its supervisor (workers.py), so one sent between its start and `hold`
    waits in the kernel and is noted here once unblocked."""

    def __init__(self) -> None:
        self.asked = False

    def hold(self) -> EarlyReloads:
        signal.signal(signal.SIGHUP, self._note)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        return self

    def _note(self, _signum: int, _frame: FrameType | None) -> None:
        self.asked = True

    def close(self) -> None:
        """Once the gateway stopped: a SIGHUP reloads nothing now. Ignored, not noted, because
        Python gives every signal it handled its default action back as it exits, and a SIGHUP
        then (a reload sent beside a stop) ended the process as hung up, not with its exit
        status."""
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def take(self) -> bool:
        """Whether a SIGHUP came since the last take."""
        asked, self.asked = self.asked, False
        return asked


def ask_supervisor_to_reload(supervisor: int) -> None:
    """A SIGHUP to the fleet's supervisor, unless this worker outlived it (the pid may be
    another process's by now)."""
    if os.getppid() == supervisor:
        os.kill(supervisor, signal.SIGHUP)


class _Pending:
    """A reload asked for and not begun: the calls that come meanwhile share its report (a burst
    of SIGHUPs reads the file once, not once each)."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.report = ReloadReport(False, ("the reload was cancelled: the gateway is stopping",),
                                   stopping=True)


# a gateway draining finishes its turns on the config they started with and then exits: a reload
# then would swap the config under them for nothing (the next process reads the file anyway)
DRAINING = ReloadReport(False, ("the gateway is draining (stopping): it reloads nothing now; the "
                                "process started next reads the file",), stopping=True)


class ReloadHost(Protocol):
    """What a reload reads and swaps of the gateway: the relay and access it serves now."""

    relay: Relay
    access: Access
    draining: bool

    async def swap(self, relay: Relay, access: Access) -> None: ...


class Reloader:
    """Reloads one gateway from one file. Reloads run one at a time."""

    def __init__(self, gateway: ReloadHost, path: str | os.PathLike[str],
                 env: Mapping[str, str] | None = None) -> None:
        self.gateway = gateway
        self.path = str(path)
        self.env = os.environ if env is None else env
        self._lock = trio.Lock()
        self._pending: _Pending | None = None
        self.reloads = 0
        self.host: str | None = None  # the address the gateway listens on, when known
        # in a worker of a fleet: asks the supervisor to reload every worker (an admin reload)
        self.fleet: Callable[[], None] | None = None

    async def reload(self) -> ReloadReport:
        """The file read again; its report. Never raises (but Cancelled)."""
        if self.gateway.draining:
            event(log, logging.WARNING, "config_reload_refused", path=self.path, reason="draining")
            return DRAINING
        pending = self._pending
        if pending is not None:
            await pending.done.wait()
            return pending.report
        pending = self._pending = _Pending()
        try:
            async with self._lock:
                self._pending = None  # begun: a later call reads the file again
                pending.report = await self._reload()
        finally:
            if self._pending is pending:
                self._pending = None
            pending.done.set()
        report = pending.report
        if report is DRAINING:
            event(log, logging.WARNING, "config_reload_refused", path=self.path, reason="draining")
        elif report.ok:
            self.reloads += 1
            event(log, logging.WARNING, "config_reloaded", path=self.path,
                  profiles=len(report.profiles))
        else:
            event(log, logging.WARNING, "config_reload_rejected", path=self.path,
                  problems="; ".join(report.problems))
        return report

    def _prepare(self, old: Relay, running: Access) -> tuple[Relay, Access]:
        """In a worker thread: the file read, checked against the running gateway, and its Relay."""
        config = load_config_file(self.path)
        access = accept_reload(old.config, running, config, self.env, self.host)
        return Relay(config, env=self.env, health=old.health, clients=old.kept_clients()), access

    async def _reload(self) -> ReloadReport:
        old: Relay = self.gateway.relay
        try:
            relay, access = await trio.to_thread.run_sync(self._prepare, old, self.gateway.access,
                                                           abandon_on_cancel=True)
        except ConfigError as exc:
            return ReloadReport(False, tuple(exc.problems))
        except Exception:
            # relayline's own bug, not the file's: the reload is refused and the gateway serves on
            log.exception("config_reload_error path=%s", self.path)
            return ReloadReport(False,
                                ("the file could not be loaded: an internal error (logged)",))
        if self.gateway.draining:  # (the drain began while the file was read)
            await relay.aclose()
            return DRAINING
        relay.selection = old.selection
        relay.fallback_record.update(old.fallback_record)
        await self.gateway.swap(relay, access)
        reconfigure = getattr(relay.health, "reconfigure", None)  # an embedder's own store may not
        if reconfigure is not None:
            reconfigure(relay.config.breaker, relay.config.providers, pools_changed(old, relay))
        return ReloadReport(True, profiles=tuple(sorted(relay.config.providers)))
