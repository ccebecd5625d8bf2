"""The walk driven directly (sans I/O): the cases a sequence of scenario requests cannot set up."""

from helpers import config, plan
from relayline.machines import classify as fc
from relayline.machines.health import InMemoryHealth
from relayline.machines.walk import Call, Sleep, TurnHealth, Walk


def test_a_profile_skipped_while_waiting_is_not_retried():
    """specs/walk.toml `timer` [blocked]: another turn put the profile on cooldown while this
    one waited its backoff: the retry is not sent, the skip is recorded, the next entry serves."""
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}})
    health = TurnHealth(InMemoryHealth(cfg.breaker))
    walk = Walk(plan(cfg, model="m1"), cfg, health)
    call = walk.start(0.0)
    assert isinstance(call, Call) and call.entry.profile == "a"
    wait = walk.on_result(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 0.0)
    assert isinstance(wait, Sleep)
    health.store.set_cooldown("a", 100.0)
    after = walk.on_timer(wait.seconds)
    assert isinstance(after, Call) and after.entry.profile == "b"
    assert [str(s) for s in health.skips] == ["a/m1 cooldown"]
    assert list(walk.life.history) == ["choosing", "calling", "backing_off", "choosing", "calling"]


def test_a_profile_still_healthy_after_the_wait_is_retried():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}})
    health = TurnHealth(InMemoryHealth(cfg.breaker))
    walk = Walk(plan(cfg, model="m1"), cfg, health)
    walk.start(0.0)
    wait = walk.on_result(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 0.0)
    assert isinstance(wait, Sleep)
    again = walk.on_timer(wait.seconds)
    assert isinstance(again, Call) and again.entry.profile == "a" and again.try_number == 2
    assert not health.skips
