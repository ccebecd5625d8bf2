"""The one eligibility function (machines/walk.py `unavailable`) and the one meaning of "another
candidate" (`another_candidate`), driven directly: every reason, its precedence, and what a
candidate is. The scenarios e01-e04 show the same meaning through whole turns."""

import attrs
import pytest

from helpers import config, plan
from relayline.machines.health import InMemoryHealth
from relayline.machines.vocab import SkipReason
from relayline.machines.walk import Need, TurnHealth, another_candidate, unavailable

CFG = config(active="a", providers={
    "a": {"model": "m1", "fallback_models": ["m2"], "fallbacks": ["b"],
          "capabilities": {"streaming": True, "tools": True, "prefill": True}},
    "b": {"model": "m3", "capabilities": {"streaming": False}},
})


def setup():
    p = plan(CFG, model="m1")
    assert [e.label for e in p.entries] == ["a/m1", "a/m2", "b/m3"]
    return p, TurnHealth(InMemoryHealth(CFG.breaker))


def test_an_allowed_fit_healthy_entry_is_available():
    p, health = setup()
    assert [unavailable(p, health, e, 0.0) for e in p.entries] == [None, None, None]


@pytest.mark.parametrize("need, a, b", [
    (Need(stream=True), None, SkipReason.CAPABILITY),
    (Need(stream=True, tools=True), None, SkipReason.CAPABILITY),
    (Need(prefill=True), None, SkipReason.CAPABILITY),
    (Need(tools=True), None, None),  # tools without a stream ask nothing of the stream capability
])
def test_capabilities_are_what_the_call_needs(need, a, b):
    p, health = setup()
    assert unavailable(p, health, p.entries[0], 0.0, need) == a
    assert unavailable(p, health, p.entries[2], 0.0, need) == b


def test_streamed_tools_need_the_tools_capability():
    cfg = config(active="a", providers={"a": {"model": "m1", "capabilities": {"tools": False}}})
    p, health = plan(cfg, model="m1"), TurnHealth(InMemoryHealth(cfg.breaker))
    assert unavailable(p, health, p.entries[0], 0.0, Need(stream=True)) is None
    assert unavailable(p, health, p.entries[0], 0.0, Need(stream=True, tools=True)) == SkipReason.CAPABILITY


def test_reasons_come_in_their_documented_order():
    """allowlist, unsupported, capability, refused, cooldown, breaker: each shown by removing
    the one before it."""
    p, health = setup()
    entry = p.entries[2]  # b/m3: cannot stream
    health.refused.add("b")
    health.store.set_cooldown("b", 10.0)
    for _ in range(CFG.breaker.failure_threshold):
        health.store.breaker("b").failure(0.0)
    need = Need(stream=True)
    blocked = attrs.evolve(p, allowlist=frozenset({"a"}), unfit={"b": ("tools",)})
    assert unavailable(blocked, health, entry, 0.0, need) == SkipReason.ALLOWLIST
    assert unavailable(attrs.evolve(blocked, allowlist=None), health, entry, 0.0, need) == SkipReason.UNSUPPORTED
    assert unavailable(p, health, entry, 0.0, need) == SkipReason.CAPABILITY
    assert unavailable(p, health, entry, 0.0) == SkipReason.REFUSED
    health.refused.clear()
    assert unavailable(p, health, entry, 0.0) == SkipReason.COOLDOWN
    assert unavailable(p, health, entry, 10.0) == SkipReason.BREAKER
    assert unavailable(p, health, entry, 10.0 + CFG.breaker.open_s) is None  # half-open: the probe is free


def test_a_refused_profile_is_never_recorded_as_a_skip():
    p, health = setup()
    health.skip(p.entries[0], SkipReason.REFUSED)
    health.skip(p.entries[0], SkipReason.COOLDOWN)
    assert [str(s) for s in health.skips] == ["a/m1 cooldown"]


def test_another_candidate_is_another_entry_within_reach():
    p, health = setup()
    first, second, third = p.entries
    assert another_candidate(p, health, first, 0.0, range(3))
    assert another_candidate(p, health, first, 0.0, [0, 1])  # the same profile's next model counts
    assert not another_candidate(p, health, first, 0.0, [0])  # never the entry itself
    assert not another_candidate(p, health, third, 0.0, [2])
    assert another_candidate(p, health, third, 0.0, [0, 2])  # reach is the caller's: any index


def test_after_a_cooldown_only_another_profile_is_a_candidate():
    p, health = setup()
    first = p.entries[0]
    assert not another_candidate(p, health, first, 0.0, [0, 1], cooled=True)
    assert another_candidate(p, health, first, 0.0, [0, 1, 2], cooled=True)


def test_a_candidate_must_be_available_now():
    p, health = setup()
    first = p.entries[0]
    health.store.set_cooldown("b", 5.0)
    health.refused.add("a")
    assert not another_candidate(p, health, first, 0.0, range(3))
    assert another_candidate(p, health, first, 5.0, range(3))
