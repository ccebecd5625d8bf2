"""Breakers and cooldowns, directly (the scenarios cover them through turns)."""

from hypothesis import example, given
from hypothesis import strategies as st

from relayline.machines.config import Breaker as BreakerConfig
from relayline.machines.health import Breaker

CFG = BreakerConfig(window_s=10, failure_threshold=2, open_s=5)


def tripped() -> Breaker:
    """A breaker that two failures at t=0 and t=1 opened until t=6."""
    b = Breaker(CFG)
    b.failure(0.0)
    b.failure(1.0)
    return b


def test_failures_outside_the_window_do_not_count():
    b = Breaker(CFG)
    b.failure(0.0)
    b.failure(11.0)
    assert b.state == "closed"
    b.failure(12.0)
    assert b.state == "open" and b.open_until == 17.0


def test_half_open_admits_one_probe_and_its_verdict_decides():
    b = tripped()
    assert b.blocks(3.0)
    assert b.claim(6.5) and not b.claim(6.6)  # one probe; the others keep skipping
    assert b.blocks(6.6)
    b.failure(7.0)
    assert b.state == "open" and b.open_until == 12.0  # open again for open_s from the failure
    assert b.claim(12.5)
    b.success(13.0)
    assert b.state == "closed" and not b.failures


def test_a_forced_probe_that_fails_reopens_for_open_s_from_now():
    b = tripped()
    assert b.claim(2.0, force=True)
    b.failure(2.5)
    assert b.state == "open" and b.open_until == 7.5


def test_a_released_probe_returns_to_half_open():
    b = tripped()
    assert b.claim(6.1)
    b.release()
    assert b.state == "half_open" and b.claim(6.2)


def test_late_results_do_not_move_an_open_breaker():
    b = tripped()
    b.success(2.0)
    b.failure(2.5)
    assert b.state == "open" and b.open_until == 6.0


def test_late_results_do_not_move_a_half_open_breaker_and_success_keeps_it_closed():
    b = tripped()
    assert b.refresh(6.1) == "half_open"
    b.success(6.2)
    assert b.state == "half_open"
    b.failure(6.3)
    assert b.state == "half_open" and b.claim(6.4)  # the probe is still there to take
    fresh = Breaker(BreakerConfig(window_s=10, failure_threshold=2, open_s=5))
    fresh.success(0.0)
    assert fresh.state == "closed" and not fresh.blocks(0.1)


def test_a_probe_held_past_its_lease_is_freed_for_another_turn():
    """specs/breaker.toml `lease_expired`: a turn that never gave its verdict loses the probe
    after its lease, and the breaker is half-open again (never open, closed or still probing)."""
    b = Breaker(CFG, probe_lease_s=30.0)
    b.failure(0.0)
    b.failure(1.0)
    assert b.claim(6.5)
    assert b.blocks(36.4) and b.state == "probing"  # within the lease: still held
    assert not b.blocks(36.5) and b.state == "half_open"
    assert list(b.life.history)[-2:] == ["probing", "half_open"]
    assert b.claim(36.6) and b.state == "probing"


# -- the arithmetic at each edge (failure_threshold failures inside window_s open it
# for open_s; after open_s it is half-open; a probe success closes it and clears its failures) ---

def test_a_failure_exactly_window_s_old_has_left_the_window():
    b = Breaker(CFG)
    b.failure(0.0)
    b.failure(10.0)
    assert b.state == "closed" and list(b.failures) == [10.0] and not b.threshold_reached
    b.failure(19.9)
    assert b.state == "open" and b.open_until == 24.9 and not b.failures  # opening clears the count


def test_the_breaker_is_half_open_exactly_at_open_until():
    b = tripped()
    assert b.refresh(5.999) == "open" and b.blocks(5.999)
    assert b.refresh(6.0) == "half_open" and not b.blocks(6.0)


def test_a_success_outside_a_probe_does_not_forgive_failures():
    b = Breaker(CFG)
    b.failure(0.0)
    assert not b.threshold_reached
    b.success(1.0)
    assert list(b.failures) == [0.0]
    b.failure(2.0)
    assert b.state == "open"


def test_a_claim_takes_the_probe_only_when_half_open_or_forced_on_an_open_breaker():
    b = Breaker(CFG, probe_lease_s=30.0)
    assert not b.claim(0.0) and not b.claim(0.0, force=True) and b.state == "closed"
    b.failure(0.0)
    b.failure(1.0)
    assert not b.claim(2.0) and b.state == "open"
    assert b.claim(2.0, force=True) and b.state == "probing" and b.lease_until == 32.0
    assert not b.claim(3.0, force=True)  # one probe, forced or not


def test_transitions_count_every_change_of_state_and_nothing_else():
    b = Breaker(CFG)
    b.failure(0.0)
    b.success(0.5)
    b.release()
    assert b.transitions == 0 and b.state == "closed"
    b.failure(1.0)
    assert b.transitions == 1
    assert b.claim(6.0) and b.transitions == 3  # cool_off, then probe
    b.success(6.5)
    assert b.transitions == 4 and b.state == "closed"


def test_a_disabled_breaker_never_blocks_nor_probes():
    b = Breaker(BreakerConfig(enabled=False, window_s=10, failure_threshold=1, open_s=5))
    b.failure(0.0)
    assert not b.blocks(0.1) and not b.claim(0.1) and not b.claim(0.1, force=True)


def test_a_shared_stores_view_replaces_the_local_breaker():
    b = Breaker(CFG)
    b.adopt("open", [3.0], 9.0)
    assert b.state == "open" and list(b.failures) == [3.0] and b.open_until == 9.0 and b.transitions == 1
    assert list(b.life.history)[-1] == "open" and b.blocks(8.9)
    b.adopt("open", [], 9.5)
    assert b.transitions == 1 and b.open_until == 9.5 and not b.failures
    assert b.lease_until == 0.0  # only another worker's probe has the store's lease
    b.adopt("probing", [], 0.0)
    assert b.lease_until == float("inf") and b.blocks(10**9)  # another worker holds the probe
    assert b.transitions == 2
    try:
        b.adopt("ajar", [], 0.0)
    except ValueError as exc:
        assert str(exc) == "breaker: no state 'ajar'"
    else:
        raise AssertionError("an unknown state was adopted")


def test_in_memory_health_keeps_the_longest_cooldown_and_forgets_removed_profiles():
    from relayline.machines.health import InMemoryHealth

    store = InMemoryHealth(CFG, probe_lease_s=7.0)
    assert store.cooldown_until("a") == float("-inf") and store.key_cursor("a") == 0
    store.set_cooldown("a", 10.0)
    store.set_cooldown("a", 4.0)
    assert store.cooldown_until("a") == 10.0
    store.clear_cooldown("a")
    store.clear_cooldown("never-set")
    assert store.cooldown_until("a") == float("-inf")
    store.set_cooldown("a", 10.0)
    store.set_cooldown("b", 10.0)
    store.set_key_cursor("a", 2)
    store.set_key_cursor("b", 1)
    breaker = store.breaker("a")
    assert store.breaker("a") is breaker and breaker.lease_s == 7.0 and store.breaker("b") is not breaker
    breaker.failure(0.0)
    wider = BreakerConfig(window_s=100, failure_threshold=5, open_s=50)
    store.reconfigure(wider, ["a"])
    assert store.breaker("a") is breaker and breaker.config == wider and list(breaker.failures) == [0.0]
    assert store.cooldown_until("a") == 10.0 and store.key_cursor("a") == 2
    assert store.cooldown_until("b") == float("-inf") and store.key_cursor("b") == 0
    assert store.breaker("b").config == wider and store.breaker_config == wider


def test_a_probe_success_clears_the_failures_a_shared_store_handed_over():
    b = Breaker(CFG)
    b.adopt("probing", [1.0, 2.0], 0.0)
    b.success(3.0)
    assert b.state == "closed" and not b.failures


class _AlwaysRefreshed(Breaker):
    """The breaker without its shortcut for quiet states: every question refreshes."""

    __slots__ = ()

    def blocks(self, now: float) -> bool:
        if not self.config.enabled:
            return False
        return self.refresh(now) in ("open", "probing")

    def claim(self, now: float, *, force: bool = False) -> bool:
        if not self.config.enabled:
            return False
        state = self.refresh(now)
        if state == "half_open":
            self._fire("probe", now)
        elif state == "open" and force:
            self._fire("force_probe", now)
        else:
            return False
        return True

    def success(self, now: float) -> None:
        self.refresh(now)
        self._fire("success", now)


_OPS = st.sampled_from(("failure", "success", "blocks", "claim", "force", "release", "refresh"))


@given(st.lists(st.tuples(_OPS, st.sampled_from((0.0, 0.5, 1.0, 2.0))), max_size=40), st.booleans())
# an open breaker whose open_s passed, asked before anything refreshed it: the case a shortcut
# taken for more than a closed breaker gets wrong (80 generated examples may not build it)
@example([("failure", 0.0), ("failure", 0.0), ("success", 2.0)], True)
@example([("failure", 0.0), ("failure", 0.0), ("blocks", 2.0)], True)
@example([("failure", 0.0), ("failure", 0.0), ("claim", 2.0), ("success", 2.0)], True)
def test_a_closed_breaker_answers_as_a_refreshed_one(ops, enabled):
    """`blocks`, `claim` and `success` skip `refresh` for a closed breaker (refresh moves only an
    open or a probing one): any sequence of questions and verdicts gets the same answers, states,
    history and transition counts as a breaker that refreshes every time."""
    # short windows, so that a few steps open a breaker, let it cool off and a held probe lapse
    config = BreakerConfig(enabled=enabled, window_s=3, failure_threshold=2, open_s=1)
    fast, reference = Breaker(config, probe_lease_s=1.0), _AlwaysRefreshed(config, probe_lease_s=1.0)
    now = 0.0
    for op, step in ops:
        now += step
        answers = []
        for b in (fast, reference):
            if op == "force":
                answers.append(b.claim(now, force=True))
            elif op == "release":
                answers.append(b.release())
            else:
                answers.append(getattr(b, op)(now))
        assert answers[0] == answers[1], (op, now)
        assert (fast.life.state, fast.life.history, fast.transitions, list(fast.failures), fast.open_until,
                fast.lease_until) == (reference.life.state, reference.life.history, reference.transitions,
                                      list(reference.failures), reference.open_until, reference.lease_until)


def test_a_reload_that_changes_a_pool_forgets_only_that_pools_keys():
    from relayline.machines.health import InMemoryHealth

    # a key is named by its place in the pool: a changed pool gives that place to another key
    store = InMemoryHealth(CFG)
    for profile in ("a", "b"):
        store.set_key_cursor(profile, 2)
        store.set_key_cooldown(profile, 1, 30.0)
        store.set_cooldown(profile, 10.0)
    # (a changed pool whose keys never had state has nothing to forget)
    store.reconfigure(CFG, ["a", "b", "c"], pools_changed=["a", "c"])
    assert (store.key_cursor("a"), store.key_cooldown_until("a", 1)) == (0, float("-inf"))
    assert (store.key_cursor("b"), store.key_cooldown_until("b", 1)) == (2, 30.0)
    assert store.cooldown_until("a") == 10.0  # the profile's own health stays
