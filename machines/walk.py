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

from collections.abc import Callable, Iterable

from . import classify as fc
from .candidates import (
    ANY_NEED,
    HEALTH_SKIPS,
    Call,
    Need,
    Skip,
    Sleep,
    TurnHealth,
    WalkDone,
    another_candidate,
    first_candidate,
    key_index,
    rotated_key,
    sitting_out,
    stop_error,
    unavailable,
)
from .config import Config
from .engine import Lifecycle, Spec, bind_entry_actions, check_outcomes, load_spec
from .errors import IllegalTransition, SpecError
from .plan import Plan, PlannedEntry
from .vocab import BreakerState, ErrorReason, FailureClass, Mode, SkipReason, WalkState, WalkTrigger

# what a walk's users import with it: its instructions, and the candidate questions it asks
__all__ = ["ANY_NEED", "Call", "Need", "Skip", "Sleep", "TurnHealth", "Walk", "WalkDone",
           "another_candidate", "first_candidate", "key_index", "stop_error", "unavailable"]

# read once as module names, not as enum members: an enum member's read goes through the enum
# class's own attribute lookup, and a walk fires twice a turn (docs/performance-history.md)
_CALLING = WalkState.CALLING
_CALL, _SUCCEED = WalkTrigger.CALL, WalkTrigger.SUCCEED  # (fired by every answered turn)
_COMPLETE = Mode.COMPLETE


class Walk:
    """One pass over a plan's entries, as specs/walk.toml declares it. What a failed attempt
    leads to is the spec's decision table: this class only reports the situations the table
    reads (properties named as in the spec), performs the actions and waits a row names, and
    what entering a state means is that state's entry actions in the spec (`ENTRY_ACTIONS`),
    whose last one gives the driver its next instruction."""

    __slots__ = ("plan", "rel", "health", "mode_for", "budgets", "exclude", "life",
                 "entry_actions", "index", "tries", "backoff", "attempted", "forced",
                 "last_failure", "failure", "now", "wait")

    def __init__(
        self,
        plan: Plan,
        config: Config,
        health: TurnHealth,
        *,
        mode_for: Callable[[PlannedEntry], Mode] | None = None,
        budgets: dict[int, int] | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> None:
        self.plan = plan
        self.rel = config.reliability
        self.health = health
        self.mode_for = mode_for  # None: every call in complete mode
        self.budgets = budgets or {}
        self.exclude = exclude
        self.life = Lifecycle(spec := load_spec("walk"))
        self.entry_actions = spec.derived.get(id(ENTRY_ACTIONS)) or _bind(spec)
        self.index = -1
        self.tries = 0
        self.backoff = self.rel.first_backoff_s
        self.attempted = False
        self.forced = False  # the forced probe: every candidate was skipped, one is tried once
        self.last_failure: FailureClass | None = None
        self.failure: fc.Failure | None = None  # the failure being decided
        self.now = 0.0  # the time of the result being decided (the situations read it)
        self.wait: float | None = None  # what a decision named to wait, for backing_off's entry

    # -- helpers ------------------------------------------------------------------------------

    @property
    def entry(self) -> PlannedEntry:
        return self.plan.entries[self.index]

    def budget(self, index: int) -> int:
        if self.forced:
            return 1
        return self.budgets.get(index, self.rel.provider_retries + 1)

    def _reach(self) -> list[int]:
        """The entries this walk would still attempt: after the current one, with budget left."""
        return [j for j in range(self.index + 1, len(self.plan.entries))
                if j not in self.exclude and self.budget(j) > 0]

    def _blocked_reason(self) -> SkipReason | None:
        return None if self.forced else self.health.blocked(self.entry.profile, self.now)

    def _decided(self) -> fc.Failure:
        assert self.failure is not None, "no failure is being decided"
        return self.failure

    # -- situations (specs/walk.toml [situations] and [guards]) -------------------------------

    @property
    def stops(self) -> bool:
        return stop_error(self.rel, self._decided()) is not None

    @property
    def short_retry_after(self) -> bool:
        wait, limit = self._decided().retry_after_s, self.rel.retry_after_wait_max_s
        return limit > 0 and wait is not None and wait <= limit

    @property
    def keys_left(self) -> bool:
        entry = self.entry
        key = key_index(self.health.store, entry)
        if key is None or self.index in self.budgets:
            # where the turn set the budget (the semantic-empty recovery), an attempt it allows
            # is used once, whatever the key
            return False
        spent = (self.health.keys_429.get(entry.profile, set())
                 | sitting_out(self.health.store, entry, self.now))
        return len(spent) < len(entry.keys)

    @property
    def bad_key(self) -> bool:
        failure = self._decided()
        entry = self.entry
        if (failure.status not in (401, 403) or key_index(self.health.store, entry) is None
                or self.index in self.budgets):
            return False
        spent = (self.health.keys_refused.get(entry.profile, set())
                 | sitting_out(self.health.store, entry, self.now))
        return len(spent) < len(entry.keys)

    @property
    def other_candidate(self) -> bool:
        """Another candidate (`another_candidate`) after the current entry; after a 429, as it
        will stand once the profile cools down (cool down and advance only when there
        is somewhere to advance to)."""
        return another_candidate(self.plan, self.health, self.entry, self.now, self._reach(),
                                 cooled=self.failure is not None
                                 and self.failure.kind == fc.RATE_LIMITED)

    @property
    def budget_left(self) -> bool:
        return self.tries < self.budget(self.index)

    @property
    def blocked(self) -> bool:
        return self._blocked_reason() is not None

    # -- actions and waits a decision names (specs/walk.toml [actions], [waits]) --------------

    def rotate_key(self) -> None:
        entry = self.entry
        key = key_index(self.health.store, entry)
        assert key is not None
        store = self.health.store
        store.set_key_cursor(entry.profile, rotated_key(store, entry, key, self.now))
        self.tries -= 1  # a rotation is not a retry: the pool size bounds it

    def sit_out_key(self) -> None:
        entry = self.entry
        key = key_index(self.health.store, entry)
        assert key is not None
        until = self.now + self.rel.rate_limit_cooldown_default_s
        self.health.store.set_key_cooldown(entry.profile, key, until)
        self.rotate_key()

    def cool_down(self) -> None:
        self._cool_down(self.entry.profile, self._decided(), self.now)

    def skip(self) -> None:
        reason = self._blocked_reason()
        assert reason is not None
        self.health.skip(self.entry, reason)

    def _cool_down(self, profile: str, failure: fc.Failure, now: float) -> None:
        wait = failure.retry_after_s
        if wait is None:
            wait = self.rel.rate_limit_cooldown_default_s
        self.health.store.set_cooldown(profile, now + min(wait, self.rel.rate_limit_cooldown_max_s))

    def _wait(self, kind: str) -> float:
        """How long the wait a decision names lasts (`WAITS`); each wait doubles the backoff."""
        seconds = WAITS[kind](self)
        ceiling = max(self.rel.backoff_max_ms / 1000.0, self.rel.first_backoff_s)
        self.backoff = min(self.backoff * 2, ceiling)
        return seconds

    def wait_backoff(self) -> float:
        return self.backoff

    def wait_retry_after(self) -> float:
        retry_after = self._decided().retry_after_s
        return self.backoff if retry_after is None else retry_after

    def wait_retry_after_capped(self) -> float:
        retry_after = self._decided().retry_after_s
        if retry_after is None:
            return self.backoff
        return max(min(retry_after, self.rel.retry_after_max_ms / 1000.0), self.backoff)

    # -- the walk -----------------------------------------------------------------------------

    def start(self, now: float) -> Call | Sleep | WalkDone:
        self.now = now
        return self._choose()

    def _step(self, trigger: str, wait: float | None = None) -> Call | Sleep | WalkDone:
        """Fire `trigger`; the entry actions of the state reached say what happens next."""
        self.wait = wait
        result: Call | Sleep | WalkDone = self.life.step(trigger, self, self.entry_actions)
        return result

    # -- entry actions (specs/walk.toml [entry_actions]) --------------------------------------

    def sleep(self) -> Sleep:
        return Sleep(self.backoff if self.wait is None else self.wait)

    def answered(self) -> WalkDone:
        within = 0 <= self.index < len(self.plan.entries)
        return WalkDone(ok=True, entry=self.entry if within else None)

    def release_probes(self) -> None:
        self.health.release_all()

    def ended_without_answer(self) -> WalkDone:
        came_from = self.life.history[-2] if len(self.life.history) > 1 else None
        if came_from == _CALLING and self.failure is not None:  # stopped by a decision
            stop = stop_error(self.rel, self.failure)
            if stop is None:
                raise IllegalTransition(f"walk: a {self.failure.kind} failure cannot stop the walk")
            return WalkDone(ok=False, entry=self.entry, error=stop)
        if came_from == WalkState.CHOOSING:
            return WalkDone(ok=False, error=self._exhausted_reason())
        raise IllegalTransition(f"walk: cannot end in {self.life.state!r} "
                                f"coming from {came_from!r}")

    def cancelled(self) -> WalkDone:
        return WalkDone(ok=False, error=ErrorReason.CANCELLED)

    def _call(self) -> Call:
        entry = self.plan.entries[self.index]
        self.tries += 1
        self.attempted = True
        self.health.before_attempt(entry.profile, self.now, force=self.forced)
        mode = _COMPLETE if self.mode_for is None else self.mode_for(entry)
        return Call(entry, mode, key_index(self.health.store, entry), self.tries,
                    self.budget(self.index), self.forced)

    def _exhausted_reason(self) -> ErrorReason:
        """The spec's [outcomes.exhausted], on this walk's situations."""
        return ErrorReason(check_outcomes(self.life.spec, "exhausted", ERROR_REASONS).decide(self))

    # -- what [outcomes.exhausted] reads (specs/walk.toml [guards]) ---------------------------

    @property
    def none_can_honour(self) -> bool:
        return bool(self.plan.unfit) and not any(
            self.plan.serves(e.profile) for j, e in enumerate(self.plan.entries)
            if j not in self.exclude)

    @property
    def last_empty(self) -> bool:
        return self.last_failure == fc.EMPTY

    @property
    def last_internal(self) -> bool:
        return self.last_failure == fc.INTERNAL

    def _choose(self) -> Call | Sleep | WalkDone:
        if not self.forced:  # a forced probe is the walk's last attempt
            # `_reach`, read lazily: the first entry that can be attempted ends the scan
            after: Iterable[int] = range(self.index + 1, len(self.plan.entries))
            # (without exclusions or budgets, every entry after the current one is within reach)
            if self.exclude or self.budgets:
                after = [j for j in after if j not in self.exclude and self.budget(j) > 0]
            j = first_candidate(self.plan, self.health, self.now, after, record_skips=True)
            if j is not None:
                self.index, self.tries, self.backoff = j, 0, self.rel.first_backoff_s
                return self._step(_CALL)
        # no entry left: the spec's `exhaust` fails the walk, or makes the forced probe
        # (`probe_due`)
        probe = None if self.attempted or self.forced else self._forced_probe()
        if probe is None:
            self.index = len(self.plan.entries)
        else:
            self.forced, self.index, self.tries = True, probe, 0
        return self._step(WalkTrigger.EXHAUST)

    def _forced_probe(self) -> int | None:
        """Every entry was skipped for its health before any attempt: the one whose window ends
        soonest, to probe once rather than fail without trying (None: no such entry)."""
        skipped = [
            j for j in range(len(self.plan.entries))
            if j not in self.exclude and self.budget(j) > 0
            and unavailable(self.plan, self.health, self.plan.entries[j], self.now) in HEALTH_SKIPS
            and self.plan.entries[j].profile not in self.health.probes
            and (self.health.store.breaker(self.plan.entries[j].profile).state
                 != BreakerState.PROBING)
        ]
        if not skipped:
            return None
        return min(skipped, key=lambda k: (self.health.window_end(self.plan.entries[k].profile), k))

    @property
    def probe_due(self) -> bool:
        return self.forced and not self.attempted

    def adopt(self, index: int, failure: fc.Failure, now: float) -> Call | Sleep | WalkDone:
        """Take a failed attempt made outside this walk (a stream) as this walk's own first
        attempt on `index`, and go on from there (retry it, or advance)."""
        self.index, self.tries, self.attempted = index, 1, True
        # the attempt was made (the stream's): `calling` is taken over, not entered, so no call
        self.life.fire(WalkTrigger.CALL)
        return self.on_result(failure, now)

    def note_failure(self, index: int, failure: fc.Failure, now: float) -> WalkDone | None:
        """Take a failure made outside this walk (a stream the walk will skip), whose breaker
        observation the turn has recorded, before the walk starts: a 429 cools the profile down
        when there is another candidate. Returns a finished walk when the failure ends the turn."""
        entry = self.plan.entries[index]
        self.index, self.now, self.failure = index, now, failure
        try:
            if failure.kind == fc.RATE_LIMITED and self.other_candidate:
                self._cool_down(entry.profile, failure, now)
            elif failure.kind == fc.REJECTED and self.bad_key:
                # the entry is skipped in this walk, but its pool moves past the key for the next
                # turns as it would have here
                key = key_index(self.health.store, entry)
                assert key is not None  # (bad_key: a pool)
                self.health.keys_refused.setdefault(entry.profile, set()).add(key)
                self.sit_out_key()
            stop = stop_error(self.rel, failure)
        finally:
            self.index, self.failure = -1, None
        if stop:
            self.index, self.failure = index, failure
            # taken over, as in `adopt`: the stream made the attempt
            self.life.fire(WalkTrigger.CALL)
            done = self._step(WalkTrigger.STOP)
            assert isinstance(done, WalkDone)
            return done
        return None

    def on_result(self, failure: fc.Failure | None, now: float) -> Call | Sleep | WalkDone:
        """The result of the pending call: None for a success, else its classified failure,
        which the spec's decision table turns into the next trigger."""
        self.now = now
        entry = self.plan.entries[self.index]
        if failure is None:
            self.health.success(entry.profile, now)
            return self._step(_SUCCEED)
        self.failure, self.last_failure = failure, failure.kind
        self.health.failure(entry.profile, failure.kind, now)
        key = key_index(self.health.store, entry)
        if key is not None and self.index not in self.budgets:
            if failure.kind == fc.RATE_LIMITED:
                self.health.keys_429.setdefault(entry.profile, set()).add(key)
            elif failure.status in (401, 403) and failure.kind == fc.REJECTED:
                self.health.keys_refused.setdefault(entry.profile, set()).add(key)
        decision = self.life.decision(failure.kind, self)
        # before the entry: a rotated key is the one the next call uses
        for action in decision.actions:
            ACTIONS[action](self)
        wait = None if decision.wait is None else self._wait(decision.wait)
        return self._step(decision.then, wait)

    def on_timer(self, now: float) -> Call | Sleep | WalkDone:
        """The wait ended: retry, unless the profile is skipped now (the breaker opened, this
        turn's failure perhaps the last straw, or another turn put it on cooldown)."""
        self.now = now
        reason = self._blocked_reason()
        # (the timer's guard `blocked`) recorded before choosing's entry scans on
        if reason is not None:
            self.health.skip(self.entry, reason)
        return self._step(WalkTrigger.TIMER)

    def on_committed(self) -> None:
        """A streamed attempt committed: the turn leaves the walk for good. The stream's own end
        (completed, interrupted) is what reaches the profile's health, and any probe stays held."""
        self._step(WalkTrigger.SUCCEED)

    def cancel(self) -> None:
        if not self.life.terminal:
            self._step(WalkTrigger.CANCEL)
        self.health.release_all()  # (a walk that had ended may hold a committed stream's probe)


# the actions specs/walk.toml may name, checked against its [actions] when this module loads
ACTIONS: dict[str, Callable[[Walk], None]] = {
    "rotate_key": Walk.rotate_key,
    "sit_out_key": Walk.sit_out_key,
    "cool_down": Walk.cool_down,
    "skip": Walk.skip,
}
# the waits specs/walk.toml may name: how long each lasts
WAITS: dict[str, Callable[[Walk], float]] = {
    "backoff": Walk.wait_backoff,
    "retry_after": Walk.wait_retry_after,
    "retry_after_capped": Walk.wait_retry_after_capped,
}
ERROR_REASONS = frozenset(ErrorReason)  # what [outcomes.exhausted] may give
# the entry actions specs/walk.toml names, checked against it when a walk binds it
ENTRY_ACTIONS: dict[str, Callable[[Walk], object]] = {
    "choose": Walk._choose,
    "call": Walk._call,
    "sleep": Walk.sleep,
    "answered": Walk.answered,
    "release_probes": Walk.release_probes,
    "ended_without_answer": Walk.ended_without_answer,
    "cancelled": Walk.cancelled,
}


def _bind(spec: Spec) -> dict[str, tuple[Callable[[Walk], object], ...]]:
    # every state needs an action: entering it is what the walk does next
    return bind_entry_actions(spec, ENTRY_ACTIONS, required=spec.states)


def _check_policy() -> None:
    table = load_spec("walk").decisions
    if table is None or set(table.actions) != set(ACTIONS) or set(table.waits) != set(WAITS):
        raise SpecError("specs/walk.toml: its [actions] and [waits] must be exactly what "
                        "machines/walk.py "
                        f"performs: actions {sorted(ACTIONS)}, waits {sorted(WAITS)}")
    check_outcomes(load_spec("walk"), "exhausted", ERROR_REASONS)


_check_policy()
