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
from collections.abc import Iterable
from typing import Protocol

from .config import Breaker as BreakerConfig
from .engine import Lifecycle, load_spec
from .vocab import BreakerState, BreakerTrigger

# a turn lives at most timeouts.total_s (its default): no probe outlives its turn by more
DEFAULT_PROBE_LEASE_S = 600.0
# a state name as its BreakerState: a lookup, where BreakerState(name) costs a µs (Enum's
# __call__), and a breaker's state is read several times a turn
_STATES = {state.value: state for state in BreakerState}
# the states a breaker's every turn compares with, read once: on 3.11 reading an enum's member
# costs 77 ns where a module's name costs 12 (EnumType's __getattr__ sends every read of the
# class's attributes through Python), and a turn reads them a dozen times
_CLOSED, _OPEN, _HALF_OPEN, _PROBING = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.PROBING
_SUCCESS = BreakerTrigger.SUCCESS  # (fired by every answered turn)
_NEVER = -math.inf  # a profile never cooled down


class Breaker:
    """One profile's breaker, executing specs/breaker.toml. Failures are timestamps inside
    window_s; `open_until` is when an open breaker turns half-open; `lease_until` is when a
    held probe is taken back from a turn that never gave its verdict (it crashed, or hung)."""

    __slots__ = ("config", "life", "failures", "open_until", "lease_s", "lease_until", "transitions")

    def __init__(self, config: BreakerConfig, probe_lease_s: float = DEFAULT_PROBE_LEASE_S) -> None:
        self.config = config
        self.life: Lifecycle = load_spec("breaker").start(history_limit=16)
        self.failures: deque[float] = deque()
        self.open_until = 0.0
        self.lease_s = probe_lease_s
        self.lease_until = 0.0
        self.transitions = 0  # state changes, for metrics

    @property
    def state(self) -> BreakerState:
        return _STATES[self.life.state]

    @property
    def threshold_reached(self) -> bool:
        return len(self.failures) >= self.config.failure_threshold

    def refresh(self, now: float) -> BreakerState:
        state = self.life.state
        if state == _OPEN and now >= self.open_until:
            self._fire(BreakerTrigger.COOL_OFF)
            state = self.life.state
        elif state == _PROBING and now >= self.lease_until:
            self._fire(BreakerTrigger.LEASE_EXPIRED)
            state = self.life.state
        return _STATES[state]  # (`state`, without its property call: a turn refreshes three times)

    def _fire(self, trigger: BreakerTrigger) -> None:
        before = self.life.state
        self.life.fire(trigger, self)
        if self.life.state != before:
            self.transitions += 1

    def blocks(self, now: float) -> bool:
        """True when a turn must skip this profile before sending anything."""
        # `refresh` moves only an open or a probing breaker (their time-outs): a closed one, every
        # healthy profile's, is answered without it (here, in `claim` and in `success`)
        if not self.config.enabled or self.life.state == _CLOSED:
            return False
        return self.refresh(now) in (_OPEN, _PROBING)

    def claim(self, now: float, *, force: bool = False) -> bool:
        """Before an attempt: take the half-open probe (or, forced, probe an open breaker).
        Returns True when this caller now holds the probe."""
        if not self.config.enabled or self.life.state == _CLOSED:
            return False
        state = self.refresh(now)
        if state == _HALF_OPEN:
            self._fire(BreakerTrigger.PROBE)
        elif state == _OPEN and force:
            self._fire(BreakerTrigger.FORCE_PROBE)
        else:
            return False
        self.lease_until = now + self.lease_s
        return True

    def failure(self, now: float) -> None:
        window_start = now - self.config.window_s
        while self.failures and self.failures[0] <= window_start:
            self.failures.popleft()
        self.failures.append(now)
        before = self.refresh(now)
        self._fire(BreakerTrigger.FAILURE)
        if self.life.state == _OPEN and before != _OPEN:
            # tripped, or a probe (half-open or forced) failed: open for open_s from now
            self.open_until = now + self.config.open_s
            self.failures.clear()

    def success(self, now: float) -> None:
        if self.life.state != _CLOSED:
            self.refresh(now)
        probing = self.life.state == _PROBING
        self._fire(_SUCCESS)
        if probing:
            self.failures.clear()

    def release(self) -> None:
        if self.life.state == _PROBING:
            self._fire(BreakerTrigger.RELEASE)

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

    def reconfigure(self, config: BreakerConfig, profiles: Iterable[str]) -> None:
        """A configuration reload: the profiles that remain keep their health (breaker state,
        failures, cooldown, key cursor) under the new breaker settings; the others are forgotten."""
        keep = set(profiles)
        self.breaker_config = config
        for table in (self._breakers, self._cooldowns, self._keys, self._key_cooldowns):
            for profile in [p for p in table if p not in keep]:
                del table[profile]
        for breaker in self._breakers.values():
            breaker.config = config
