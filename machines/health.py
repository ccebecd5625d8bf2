"""Per-profile health that outlives a turn: rate-limit cooldowns, circuit breakers, key cursors.

Health is keyed by profile alias (all entries of a profile share it). Time always comes in as a
number (seconds on the caller's monotonic clock), so the same code runs on trio's real clock, on
its MockClock in `relayline simulate`, and under Hypothesis.

`HealthStore` is the small interface a shared store (for several gateway workers) implements;
`InMemoryHealth` is the default.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import attrs

from .config import Breaker as BreakerConfig
from .engine import Lifecycle, Spec, bind_entry_actions, load_spec
from .vocab import BreakerState, BreakerTrigger

# a turn lives at most timeouts.total_s (its default): no probe outlives its turn by more
DEFAULT_PROBE_LEASE_S = 600.0
# a state name as its BreakerState: a lookup, where BreakerState(name) goes through Enum's
# __call__, and a breaker's state is read several times a turn (docs/performance.md)
_STATES = {state.value: state for state in BreakerState}
# (fired by every answered turn)
_SUCCESS, _FAILURE = BreakerTrigger.SUCCESS, BreakerTrigger.FAILURE
# the triggers time fires (`refresh`), and those that take a probe (`claim`)
_TIMED: dict[str, str] = {BreakerTrigger.COOL_OFF: "open_until",
                          BreakerTrigger.LEASE_EXPIRED: "lease_until"}
_CLAIMS = (BreakerTrigger.PROBE, BreakerTrigger.FORCE_PROBE)
_NEVER = -math.inf  # a profile never cooled down


@attrs.frozen
class BreakerShape:
    """What the breaker's questions read of its spec, derived once per spec: a mutated spec
    changes them, so no shortcut answers from what the code assumed the spec says."""

    skipping: frozenset[str]  # states tagged skipped: a turn skips the profile
    # states that neither time nor a claim can leave, and that skip nothing: every healthy
    # profile's (closed) is answered without `refresh` (in `blocks`, `claim` and `success`)
    quiet: frozenset[str]
    # state -> (timed trigger, the deadline it waits for)
    timed: dict[str, tuple[tuple[str, str], ...]]
    entry: dict[str, tuple[Callable[[Breaker], None], ...]]

    @classmethod
    def of(cls, spec: Spec) -> BreakerShape:
        try:
            return spec.derived[cls]  # type: ignore[no-any-return]
        except KeyError:
            pass
        timed = {state: tuple((t, _TIMED[t]) for t in moves if t in _TIMED)
                 for state, moves in spec.moves.items()}
        skipping = spec.tagged("skipped")
        quiet = frozenset(state for state, moves in spec.moves.items()
                          if state not in skipping and not timed[state]
                          and not set(moves) & set(_CLAIMS))
        # a state that time leaves must set its deadline on entry
        entry = bind_entry_actions(spec, ENTRY_ACTIONS, required=[s for s, t in timed.items() if t])
        shape = spec.derived[cls] = cls(skipping, quiet, timed, entry)
        return shape


class Breaker:
    """One profile's breaker, executing specs/breaker.toml: its states' entry actions set the
    deadlines and forget the failures (`ENTRY_ACTIONS`). Failures are timestamps inside
    window_s; `open_until` is when an open breaker turns half-open; `lease_until` is when a
    held probe is taken back from a turn that never gave its verdict (it crashed, or hung)."""

    __slots__ = ("config", "life", "shape", "failures", "open_until", "lease_s", "lease_until",
                 "transitions", "now")

    def __init__(self, config: BreakerConfig, probe_lease_s: float = DEFAULT_PROBE_LEASE_S) -> None:
        self.config = config
        self.life: Lifecycle = load_spec("breaker").start(history_limit=16)
        self.shape = BreakerShape.of(self.life.spec)
        self.failures: deque[float] = deque()
        self.open_until = 0.0
        self.lease_s = probe_lease_s
        self.lease_until = 0.0
        self.transitions = 0  # state changes, for metrics
        self.now = 0.0  # the time of the event being fired (the entry actions read it)

    @property
    def state(self) -> BreakerState:
        return _STATES[self.life.state]

    @property
    def threshold_reached(self) -> bool:
        return len(self.failures) >= self.config.failure_threshold

    def refresh(self, now: float) -> BreakerState:
        for trigger, deadline in self.shape.timed[self.life.state]:
            if now >= getattr(self, deadline):
                self._fire(trigger, now)
                break
        return _STATES[self.life.state]

    def _fire(self, trigger: str, now: float) -> None:
        before = self.life.state
        self.now = now
        self.life.step(trigger, self, self.shape.entry)
        if self.life.state != before:
            self.transitions += 1

    # -- entry actions (specs/breaker.toml [entry_actions]) -----------------------------------

    def forget_failures(self) -> None:
        self.failures.clear()

    def open_for_open_s(self) -> None:
        self.open_until = self.now + self.config.open_s
        self.failures.clear()

    def lease_probe(self) -> None:
        self.lease_until = self.now + self.lease_s

    # -- the questions and verdicts of a turn -------------------------------------------------

    def blocks(self, now: float) -> bool:
        """True when a turn must skip this profile before sending anything."""
        if not self.config.enabled or self.life.state in self.shape.quiet:
            return False
        return self.refresh(now) in self.shape.skipping

    def claim(self, now: float, *, force: bool = False) -> bool:
        """Before an attempt: take the half-open probe (or, forced, probe an open breaker).
        Returns True when this caller now holds the probe."""
        if not self.config.enabled or self.life.state in self.shape.quiet:
            return False
        moves = self.life.spec.moves[self.refresh(now)]
        if BreakerTrigger.PROBE in moves:
            self._fire(BreakerTrigger.PROBE, now)
        elif force and BreakerTrigger.FORCE_PROBE in moves:
            self._fire(BreakerTrigger.FORCE_PROBE, now)
        else:
            return False
        return True

    def failure(self, now: float) -> None:
        window_start = now - self.config.window_s
        while self.failures and self.failures[0] <= window_start:
            self.failures.popleft()
        self.failures.append(now)
        self.refresh(now)
        self._fire(_FAILURE, now)

    def success(self, now: float) -> None:
        if self.life.state not in self.shape.quiet:
            self.refresh(now)
        self._fire(_SUCCESS, now)

    def release(self) -> None:
        if BreakerTrigger.RELEASE in self.life.spec.moves[self.life.state]:
            self._fire(BreakerTrigger.RELEASE, self.now)

    def adopt(self, state: str, failures: Iterable[float], open_until: float) -> None:
        """Take a shared store's view as this breaker's own. The store decided it atomically
        for every worker of a fleet, so it replaces the local lifecycle's state rather than
        stepping it (there is no local event to fire for another worker's decision)."""
        if state not in self.life.spec.states:
            raise ValueError(f"breaker: no state {state!r}")
        if state != self.life.state:
            self.life.state = state
            self.life.record(state)
            self.transitions += 1
            if state == "probing":
                self.lease_until = math.inf  # another worker's probe: its lease is the store's
        self.failures = deque(failures)
        self.open_until = open_until


# the entry actions specs/breaker.toml may name, checked against it when a breaker binds it
ENTRY_ACTIONS: dict[str, Callable[[Breaker], None]] = {
    "forget_failures": Breaker.forget_failures,
    "open_for_open_s": Breaker.open_for_open_s,
    "lease_probe": Breaker.lease_probe,
}


class HealthStore(Protocol):
    def cooldown_until(self, profile: str) -> float: ...
    def set_cooldown(self, profile: str, until: float) -> None: ...
    def clear_cooldown(self, profile: str) -> None: ...
    def breaker(self, profile: str) -> Breaker: ...
    def key_cursor(self, profile: str) -> int: ...
    def set_key_cursor(self, profile: str, index: int) -> None: ...
    def key_cooldown_until(self, profile: str, index: int) -> float: ...
    def set_key_cooldown(self, profile: str, index: int, until: float) -> None: ...


class InMemoryHealth:
    def __init__(self, config: BreakerConfig, probe_lease_s: float = DEFAULT_PROBE_LEASE_S) -> None:
        self.breaker_config = config
        self.probe_lease_s = probe_lease_s
        self._cooldowns: dict[str, float] = {}
        self._breakers: dict[str, Breaker] = {}
        self._keys: dict[str, int] = {}
        # a pool key that drew a 401 or 403 sits out until then: profile -> {key index: until}
        self._key_cooldowns: dict[str, dict[int, float]] = {}

    def cooldown_until(self, profile: str) -> float:
        return self._cooldowns.get(profile, _NEVER)

    def set_cooldown(self, profile: str, until: float) -> None:
        self._cooldowns[profile] = max(until, self._cooldowns.get(profile, _NEVER))

    def clear_cooldown(self, profile: str) -> None:
        self._cooldowns.pop(profile, None)

    def breaker(self, profile: str) -> Breaker:
        try:
            return self._breakers[profile]
        except KeyError:
            b = self._breakers[profile] = Breaker(self.breaker_config, self.probe_lease_s)
            return b

    def key_cursor(self, profile: str) -> int:
        return self._keys.get(profile, 0)

    def set_key_cursor(self, profile: str, index: int) -> None:
        self._keys[profile] = index

    def key_cooldown_until(self, profile: str, index: int) -> float:
        keys = self._key_cooldowns.get(profile)
        return _NEVER if keys is None else keys.get(index, _NEVER)

    def set_key_cooldown(self, profile: str, index: int, until: float) -> None:
        keys = self._key_cooldowns.setdefault(profile, {})
        keys[index] = max(until, keys.get(index, _NEVER))

    def forget_keys(self, profile: str) -> None:
        """The profile's key cursor and sitting-out keys, forgotten: they name keys by their
        place in the pool, which a reload that changed the pool gives to other keys."""
        self._keys.pop(profile, None)
        self._key_cooldowns.pop(profile, None)

    def reconfigure(self, config: BreakerConfig, profiles: Iterable[str],
                    pools_changed: Iterable[str] = ()) -> None:
        """A configuration reload: the profiles that remain keep their health (breaker state,
        failures, cooldown, key cursor) under the new breaker settings; the others are forgotten,
        and so is the key state of a remaining profile whose key pool changed (`pools_changed`)."""
        keep = set(profiles)
        self.breaker_config = config
        for table in (self._breakers, self._cooldowns, self._keys, self._key_cooldowns):
            for profile in [p for p in table if p not in keep]:
                del table[profile]
        for profile in pools_changed:
            self.forget_keys(profile)
        for breaker in self._breakers.values():
            breaker.config = config
