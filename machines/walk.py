"""The reliability walk over one domain (specs/walk.toml), sans-I/O.

The walk answers "what now?": call this entry with this key in this mode, sleep this long, or
finish. The driver performs the action and reports back (`on_result`, `on_timer`). Health is read
and written through the store with the time passed in, so the walk is deterministic for a given
sequence of results and times.

Per entry: up to `budget` attempts (provider_retries + 1 unless the turn overrides it for the
semantic-empty allowances). Key-pool rotations after a 429 are extra attempts at once, bounded by
the pool size; a forced probe (every candidate skipped) is one attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from . import classify as fc
from .config import Config
from .engine import Lifecycle, load_spec
from .health import HealthStore
from .plan import Plan, PlannedEntry
from .vocab import BreakerState, ErrorReason, FailureClass, Mode, SkipReason, WalkTrigger


@attrs.frozen
class Call:
    entry: PlannedEntry
    mode: Mode
    key_index: int | None  # index into entry.keys (None: no key or a single key)
    try_number: int  # 1-based, within this entry
    budget: int
    probe: bool = False  # a forced probe: every candidate was skipped, this one ends soonest
    prefill: str | None = None  # a continuation: continue from exactly this forwarded text


@attrs.frozen
class Sleep:
    seconds: float


@attrs.frozen
class WalkDone:
    ok: bool
    entry: PlannedEntry | None = None
    error: ErrorReason | None = None


@attrs.frozen
class Skip:
    profile: str
    model: str
    reason: SkipReason
    fields: tuple[str, ...] = ()  # unsupported: the request fields the entry cannot honour

    def __str__(self) -> str:
        named = f" ({', '.join(self.fields)})" if self.fields else ""
        return f"{self.profile}/{self.model} {self.reason}{named}"


@attrs.define
class TurnHealth:
    """What one turn remembers about health across its walks (a recovery walk is a new walk)."""

    store: HealthStore
    breaker_noted: set[str] = attrs.Factory(set)  # at most one breaker failure per profile per turn
    probes: set[str] = attrs.Factory(set)  # profiles whose half-open probe this turn holds
    keys_429: dict[str, set[int]] = attrs.Factory(dict)  # pool keys that drew a 429 in this turn
    skips: list[Skip] = attrs.Factory(list)
    # on_refusal = "advance": a profile that refused is not asked again in this turn (its other
    # models sit behind the same policy); not a skip, since nothing about its health is known.
    # The turn fills it: it knows the policy, and needs it before the walk hears of the refusal
    refused: set[str] = attrs.Factory(set)

    def skip(self, entry: PlannedEntry, reason: SkipReason, fields: tuple[str, ...] = ()) -> None:
        skip = Skip(entry.profile, entry.model, reason, fields)
        if skip not in self.skips:
            self.skips.append(skip)

    def blocked(self, profile: str, now: float) -> SkipReason | None:
        if self.store.cooldown_until(profile) > now:
            return SkipReason.COOLDOWN
        if profile not in self.probes and self.store.breaker(profile).blocks(now):
            return SkipReason.BREAKER
        return None

    def window_end(self, profile: str) -> float:
        breaker = self.store.breaker(profile)
        ends = [self.store.cooldown_until(profile)]
        if breaker.state == BreakerState.OPEN:
            ends.append(breaker.open_until)
        return max(ends)

    def before_attempt(self, profile: str, now: float, *, force: bool = False) -> None:
        if profile not in self.probes and self.store.breaker(profile).claim(now, force=force):
            self.probes.add(profile)

    def success(self, profile: str, now: float) -> None:
        self.store.breaker(profile).success(now)
        self.probes.discard(profile)
        self.store.clear_cooldown(profile)

    def failure(self, profile: str, kind: FailureClass, now: float) -> None:
        """A failure counts once per turn, except that a probe's failure always gives its
        verdict; a failure that does not count hands a held probe back."""
        breaker = self.store.breaker(profile)
        if kind in fc.BREAKER_CLASSES and (profile not in self.breaker_noted or profile in self.probes):
            self.breaker_noted.add(profile)
            breaker.failure(now)
        elif profile in self.probes:
            breaker.release()
        self.probes.discard(profile)

    def release_all(self) -> None:
        for profile in self.probes:
            self.store.breaker(profile).release()
        self.probes.clear()


def key_index(store: HealthStore, entry: PlannedEntry) -> int | None:
    """The pool key an attempt uses: the profile's cursor (sticky to the key that last worked)."""
    if len(entry.keys) <= 1:
        return None
    return store.key_cursor(entry.profile) % len(entry.keys)


class Walk:
    """One pass over a plan's entries. Guards for the spec are not needed: the walk decides and
    fires unguarded triggers; the spec constrains which decisions are possible at all."""

    def __init__(
        self,
        plan: Plan,
        config: Config,
        health: TurnHealth,
        *,
        mode_for: Callable[[PlannedEntry], Mode] = lambda e: Mode.COMPLETE,
        budgets: dict[int, int] | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        self.plan = plan
        self.rel = config.reliability
        self.health = health
        self.mode_for = mode_for
        self.budgets = budgets or {}
        self.exclude = exclude
        self.life: Lifecycle = load_spec("walk").start()
        self.index = -1
        self.tries = 0
        self.backoff = self.rel.first_backoff_s
        self.attempted = False
        self.forced = False
        self.last_failure: FailureClass | None = None

    # -- helpers ------------------------------------------------------------------------------

    def budget(self, index: int) -> int:
        if self.forced:
            return 1
        return self.budgets.get(index, self.rel.provider_retries + 1)

    def _eligible(self, index: int, now: float, *, record: bool) -> bool:
        entry = self.plan.entries[index]
        if index in self.exclude or self.budget(index) <= 0 or entry.profile in self.health.refused:
            return False
        if not self.plan.allows(entry.profile):
            if record:
                self.health.skip(entry, SkipReason.ALLOWLIST)
            return False
        if entry.profile in self.plan.unfit:
            if record:
                self.health.skip(entry, SkipReason.UNSUPPORTED, self.plan.unfit[entry.profile])
            return False
        reason = self.health.blocked(entry.profile, now)
        if reason:
            if record:
                self.health.skip(entry, reason)
            return False
        return True

    def other_candidate(self, now: float) -> bool:
        """Is there an entry after the current one, of another profile, that could still serve?"""
        current = self.plan.entries[self.index].profile
        return any(
            self.plan.entries[j].profile != current and self._eligible(j, now, record=False)
            for j in range(self.index + 1, len(self.plan.entries))
        )

    def _call(self, now: float) -> Call:
        entry = self.plan.entries[self.index]
        self.tries += 1
        self.attempted = True
        self.health.before_attempt(entry.profile, now, force=self.forced)
        return Call(entry, self.mode_for(entry), key_index(self.health.store, entry), self.tries,
                    self.budget(self.index), self.forced)

    def _finish(self, trigger: WalkTrigger, **kw: Any) -> WalkDone:
        self.life.fire(trigger)
        self.health.release_all()
        return WalkDone(**kw)

    def _exhausted(self) -> WalkDone:
        if not self.attempted and self.plan.unfit and not any(
                self.plan.serves(e.profile) for j, e in enumerate(self.plan.entries) if j not in self.exclude):
            error = ErrorReason.UNSUPPORTED  # no entry can honour the request: the client's to change
        elif not self.attempted:
            error = ErrorReason.NO_CANDIDATE
        elif self.last_failure == fc.EMPTY:
            error = ErrorReason.SEMANTIC_EMPTY
        else:
            error = ErrorReason.EXHAUSTED
        return self._finish(WalkTrigger.EXHAUST, ok=False, error=error)

    # -- the walk -----------------------------------------------------------------------------

    def start(self, now: float) -> Call | WalkDone:
        return self._choose(now)

    def _choose(self, now: float) -> Call | WalkDone:
        for j in range(self.index + 1, len(self.plan.entries)):
            if self._eligible(j, now, record=True):
                self.index, self.tries, self.backoff = j, 0, self.rel.first_backoff_s
                self.life.fire(WalkTrigger.CALL)
                return self._call(now)
        self.index = len(self.plan.entries)
        if not self.attempted and not self.forced:
            # CONFIG.md: every entry was skipped for health before any attempt: probe the one
            # whose window ends soonest, once, rather than failing without trying
            skipped = [
                j for j, e in enumerate(self.plan.entries)
                if j not in self.exclude and self.budgets.get(j, 1) > 0 and self.plan.serves(e.profile)
                and e.profile not in self.health.refused
                and e.profile not in self.health.probes
                and self.health.store.breaker(e.profile).state != BreakerState.PROBING
            ]
            if skipped:
                j = min(skipped, key=lambda k: (self.health.window_end(self.plan.entries[k].profile), k))
                self.forced = True
                self.index, self.tries = j, 0
                self.life.fire(WalkTrigger.CALL)
                return self._call(now)
        return self._exhausted()

    def adopt(self, index: int, failure: fc.Failure, now: float) -> Call | Sleep | WalkDone:
        """Take a failed attempt made outside this walk (a stream) as this walk's own first
        attempt on `index`, and go on from there (retry it, or advance)."""
        self.index, self.tries, self.attempted = index, 1, True
        self.life.fire(WalkTrigger.CALL)
        return self.on_result(failure, now)

    def note_failure(self, index: int, failure: fc.Failure, now: float) -> WalkDone | None:
        """Apply the health effects of a failure made outside this walk (a stream the walk will
        skip), before the walk starts. Returns a finished walk when the failure ends the turn."""
        entry = self.plan.entries[index]
        self.index = index
        try:
            self.health.failure(entry.profile, failure.kind, now)
            if failure.kind == fc.RATE_LIMITED and self.other_candidate(now):
                self._cool_down(entry.profile, failure, now)
            stop = self._stop_error(failure)
        finally:
            self.index = -1
        if stop:
            self.life.fire(WalkTrigger.CALL)
            return self._finish(WalkTrigger.STOP, ok=False, entry=entry, error=stop)
        return None

    def _stop_error(self, failure: fc.Failure) -> ErrorReason | None:
        if failure.kind == fc.CONTEXT_WINDOW and self.rel.context_window == "return":
            return ErrorReason.CONTEXT_WINDOW
        if failure.kind == fc.REJECTED and self.rel.client_errors == "stop" and failure.status in (400, 413, 422):
            return ErrorReason.CLIENT_ERROR
        return None

    def _cool_down(self, profile: str, failure: fc.Failure, now: float) -> None:
        wait = failure.retry_after_s
        if wait is None:
            wait = self.rel.rate_limit_cooldown_default_s
        self.health.store.set_cooldown(profile, now + min(wait, self.rel.rate_limit_cooldown_max_s))

    def on_result(self, failure: fc.Failure | None, now: float) -> Call | Sleep | WalkDone:
        """The result of the pending call: None for a success, else its classified failure."""
        entry = self.plan.entries[self.index]
        profile = entry.profile
        if failure is None:
            self.health.success(profile, now)
            return self._finish(WalkTrigger.SUCCEED, ok=True, entry=entry)
        kind = failure.kind
        self.last_failure = kind
        self.health.failure(profile, kind, now)
        budget = self.budget(self.index)
        stop = self._stop_error(failure)
        if stop:
            return self._finish(WalkTrigger.STOP, ok=False, entry=entry, error=stop)
        if kind in (fc.CONTEXT_WINDOW, fc.REJECTED, fc.QUOTA, fc.REFUSED):
            return self._advance(now)
        if kind == fc.RATE_LIMITED:
            pool = len(entry.keys)
            key = key_index(self.health.store, entry)
            # a pool rotates to its next key at once, except where the turn set the budget (the
            # semantic-empty recovery): an attempt it allows is used once, whatever the key
            if pool > 1 and key is not None and self.index not in self.budgets:
                drew = self.health.keys_429.setdefault(profile, set())
                drew.add(key)
                if len(drew) < pool:
                    self.health.store.set_key_cursor(profile, (key + 1) % pool)
                    self.tries -= 1  # a rotation is not a retry: the pool size bounds it
                    self.life.fire(WalkTrigger.RETRY_NOW)
                    return self._call(now)
            if self.other_candidate(now) and not self.forced:
                self._cool_down(profile, failure, now)
                return self._advance(now)
            if self.tries >= budget:
                return self._advance(now)
            wait = self.backoff
            if failure.retry_after_s is not None:
                wait = max(min(failure.retry_after_s, self.rel.retry_after_max_ms / 1000.0), self.backoff)
            return self._sleep(wait, now)
        if kind == fc.TIMEOUT and self.other_candidate(now):
            return self._advance(now)  # a silent route is not retried while another can answer
        # retryable, empty, and a timeout with no other candidate
        if self.tries >= budget:
            return self._advance(now)
        return self._sleep(self.backoff, now)

    def _sleep(self, seconds: float, now: float) -> Sleep | Call | WalkDone:
        entry = self.plan.entries[self.index]
        reason = None if self.forced else self.health.blocked(entry.profile, now)
        if reason:
            # this failure opened the profile's breaker: no retry is sent to it
            self.health.skip(entry, reason)
            return self._advance(now)
        self.backoff = min(self.backoff * 2, max(self.rel.backoff_max_ms / 1000.0, self.rel.first_backoff_s))
        self.life.fire(WalkTrigger.BACKOFF)
        return Sleep(seconds)

    def _advance(self, now: float) -> Call | WalkDone:
        self.life.fire(WalkTrigger.ADVANCE)
        if self.forced:
            self.index = len(self.plan.entries)
            return self._exhausted()
        return self._choose(now)

    def on_timer(self, now: float) -> Call | WalkDone:
        entry = self.plan.entries[self.index]
        reason = None if self.forced else self.health.blocked(entry.profile, now)
        if reason:
            # the breaker opened (this turn's failure may have been the last straw) or another
            # turn put the profile on cooldown: a retry would send to a profile that is skipped
            self.health.skip(entry, reason)
            self.life.fire(WalkTrigger.ABANDON)
            return self._choose(now)
        self.life.fire(WalkTrigger.TIMER)
        return self._call(now)

    def on_committed(self) -> WalkDone:
        """A streamed attempt committed: the turn leaves the walk for good. The stream's own end
        (completed, interrupted) is what reaches the profile's health, and any probe stays held."""
        self.life.fire(WalkTrigger.SUCCEED)
        return WalkDone(ok=True, entry=self.plan.entries[self.index])

    def cancel(self) -> None:
        if not self.life.terminal:
            self.life.fire(WalkTrigger.CANCEL)
        self.health.release_all()
