"""Which entry a turn can attempt now, and what a walk hands the driver (sans-I/O).

The walk's next entry, the stream's first, the recovery's and the continuation's candidates,
"another candidate" and "the only candidate" are all one question, `first_candidate`, over one
meaning of "can serve now", `unavailable`. The health a turn remembers across its walks
(`TurnHealth`), the pool key an attempt uses, and the policy's stop errors live here too: the
walk (walk.py) and the turn (turn.py) both read them.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from . import classify as fc
from .config import Capabilities, Reliability
from .health import HealthStore
from .plan import Plan, PlannedEntry
from .vocab import BreakerState, ErrorReason, FailureClass, Mode, SkipReason


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
    # pool keys that drew a 401 or 403 in this turn
    keys_refused: dict[str, set[int]] = attrs.Factory(dict)
    skips: list[Skip] = attrs.Factory(list)
    # on_refusal = "advance": a profile that refused is not asked again in this turn (its other
    # models sit behind the same policy); not a skip, since nothing about its health is known.
    # The turn fills it: it knows the policy, and needs it before the walk hears of the refusal
    refused: set[str] = attrs.Factory(set)

    def skip(self, entry: PlannedEntry, reason: SkipReason, fields: tuple[str, ...] = ()) -> None:
        if reason == SkipReason.REFUSED:
            return  # not a skip: nothing about the profile's health is known
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
        verdict; a failure that does not count hands a held probe back. Telling the same failure
        twice changes nothing (a walk that adopts a failed stream's attempt tells it again)."""
        breaker = self.store.breaker(profile)
        counts = profile not in self.breaker_noted or profile in self.probes
        if kind in fc.BREAKER_CLASSES and counts:
            self.breaker_noted.add(profile)
            breaker.failure(now)
        elif profile in self.probes:
            breaker.release()
        self.probes.discard(profile)

    def release_all(self) -> None:
        for profile in self.probes:
            self.store.breaker(profile).release()
        self.probes.clear()


@attrs.frozen
class Need:
    """What a call asks of an entry beyond being allowed, fit and healthy."""

    stream: bool = False  # it opens a stream...
    tools: bool = False  # ...that carries tool events (the request has tools)
    prefill: bool = False  # it continues from a trailing assistant message

    def met_by(self, caps: Capabilities) -> bool:
        return ((caps.streaming or not self.stream)
                and (caps.tools or not (self.stream and self.tools))
                and (caps.prefill or not self.prefill))



HEALTH_SKIPS = frozenset({SkipReason.COOLDOWN, SkipReason.BREAKER})
# a call that asks nothing beyond being allowed, fit and healthy: met by every entry
ANY_NEED = Need()


def unavailable(plan: Plan, health: TurnHealth, entry: PlannedEntry, now: float,
                need: Need = ANY_NEED) -> SkipReason | None:
    """Why `entry` cannot be attempted now, or None when it can: the one meaning of "can serve
    now" that the walk's choice, its situations, the forced probe, the stream's first entry, the
    recovery and the continuation all read. In order: outside the allowlist, unable to honour the
    request, lacking a capability the call needs, refused in this turn (`REFUSED`, never
    recorded as a skip: nothing is known about its health), cooling down, breaker open."""
    if not plan.allows(entry.profile):
        return SkipReason.ALLOWLIST
    if entry.profile in plan.unfit:
        return SkipReason.UNSUPPORTED
    if need is not ANY_NEED and not need.met_by(entry.provider.capabilities):
        return SkipReason.CAPABILITY
    if entry.profile in health.refused:
        return SkipReason.REFUSED
    return health.blocked(entry.profile, now)


def first_candidate(plan: Plan, health: TurnHealth, now: float, among: Iterable[int],
                    need: Need = ANY_NEED, *, record_skips: bool = False) -> int | None:
    """The one answer to every candidate question: the first of `among` (places in the plan's
    entries, in the order asked) whose entry can be attempted now for `need` (`unavailable`), or
    None. The walk's next entry, the stream's first, the continuation's, "another candidate" and
    "the only candidate" all ask it. With `record_skips`, each entry passed over is recorded as
    skipped, with why."""
    entries = plan.entries
    for j in among:
        entry = entries[j]
        reason = unavailable(plan, health, entry, now, need)
        if reason is None:
            return j
        if record_skips:
            health.skip(entry, reason, plan.unfit.get(entry.profile, ()))
    return None


def another_candidate(plan: Plan, health: TurnHealth, entry: PlannedEntry, now: float,
                      reach: Iterable[int], *, cooled: bool = False) -> bool:
    """Another entry than `entry`, among those the walk would still reach (`reach`, indices), that
    could be attempted now (`first_candidate`). With `cooled`, as it will stand once `entry`'s
    profile is put on cooldown (a 429): then the profile's other entries are out too."""
    others = (j for j in reach if j != entry.index
              and not (cooled and plan.entries[j].profile == entry.profile))
    return first_candidate(plan, health, now, others) is not None


def stop_error(rel: Reliability, failure: fc.Failure) -> ErrorReason | None:
    """The error a failure ends the turn with under the configured policy, or None."""
    if failure.kind == fc.CONTEXT_WINDOW and rel.context_window == "return":
        return ErrorReason.CONTEXT_WINDOW
    if (failure.kind == fc.REJECTED and rel.client_errors == "stop"
            and failure.status in (400, 413, 422)):
        return ErrorReason.CLIENT_ERROR
    return None


def key_index(store: HealthStore, entry: PlannedEntry) -> int | None:
    """The pool key an attempt uses: the profile's cursor (sticky to the key that last worked)."""
    if len(entry.keys) <= 1:
        return None
    return store.key_cursor(entry.profile) % len(entry.keys)


def sitting_out(store: HealthStore, entry: PlannedEntry, now: float) -> set[int]:
    """The pool keys that drew a 401 or 403 lately and sit out until their cooldown ends."""
    return {i for i in range(len(entry.keys)) if store.key_cooldown_until(entry.profile, i) > now}


def rotated_key(store: HealthStore, entry: PlannedEntry, key: int, now: float) -> int:
    """The key after `key` that is not sitting out (the next one when every other one is)."""
    count = len(entry.keys)
    out = sitting_out(store, entry, now)
    later = ((key + step) % count for step in range(1, count))
    return next((k for k in later if k not in out), (key + 1) % count)

