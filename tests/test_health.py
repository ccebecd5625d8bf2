"""Breakers and cooldowns, directly (the scenarios cover them through turns)."""

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
