"""The spec engine: validation names the problem; the compiled table is the transitions machine."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from relayline.machines.engine import SPEC_NAMES, build_machine, load_spec, parse_spec
from relayline.machines.errors import IllegalTransition, SpecError

GOOD = """
name = "toy"
initial = "a"
[states.a]
tags = ["provider_call"]
[states.b]
tags = ["immutable_output"]
[states.done]
tags = ["terminal"]
[guards]
ok = "it is ok"
[[transitions]]
trigger = "go"
source = "a"
dest = "b"
[[transitions]]
trigger = "end"
source = "b"
dest = "done"
[[invariants]]
kind = "no_path"
from_tag = "immutable_output"
to_tag = "provider_call"
"""


def test_a_good_spec_loads():
    spec = parse_spec(GOOD, "toy.toml")
    assert spec.initial == "a" and spec.terminal == {"done"}


def transition(trigger: str, source: str, dest: str, extra: str = "") -> str:
    return f'[[transitions]]\ntrigger = "{trigger}"\nsource = "{source}"\ndest = "{dest}"\n{extra}'


PINNED_GO = GOOD.replace('source = "a"\ndest = "b"', 'source = "a"\ndest = "b"\nguards = "ok"')
BROKEN = {
    "unreachable state": (GOOD + "[states.orphan]\n", r"toy.toml: unreachable states \['orphan'\]"),
    "undeclared destination": (GOOD + transition("jump", "a", "nowhere"),
                               r"toy.toml: transition 'jump' .* undeclared state 'nowhere'"),
    "violated invariant": (GOOD + transition("replay", "b", "a"),
                           r"invariant violated: immutable_output state 'b' reaches provider_call state 'a'"),
    "ambiguous trigger": (GOOD + transition("go", "a", "done"), r"ambiguous trigger 'go' from state 'a'"),
    "state that cannot terminate": (GOOD + "[states.loop]\n" + transition("spin", "a", "loop")
                                    + transition("spin", "loop", "loop"), r"state 'loop' cannot reach a terminal state"),
    "undeclared guard": (GOOD.replace('source = "a"\ndest = "b"', 'source = "a"\ndest = "b"\nguards = "nope"'),
                         r"undeclared guard 'nope'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_spec_fails_naming_the_problem(case):
    text, message = BROKEN[case]
    with pytest.raises(SpecError, match=message):
        parse_spec(text, "toy.toml")


def test_invariant_allows_the_named_recovery():
    text = GOOD.replace('to_tag = "provider_call"', 'to_tag = "provider_call"\nvia = ["replay"]')
    parse_spec(text + transition("replay", "b", "a"), "toy.toml")


def test_guards_that_exclude_each_other_are_not_ambiguous():
    parse_spec(PINNED_GO + transition("go", "a", "done", 'unless = "ok"\n'), "toy.toml")


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_every_shipped_spec_is_valid(name):
    spec = load_spec(name)
    assert spec.states and spec.transitions


class Facts:
    """A model whose guard values the test controls."""

    def __init__(self, values):
        self.__dict__.update(values)


def _guard_names(spec):
    return sorted(spec.guards)


@pytest.mark.property
@pytest.mark.parametrize("name", SPEC_NAMES)
@given(data=st.data())
def test_table_and_transitions_agree(name, data):
    """Random events on each spec: the compiled table and the transitions machine take the same
    states, never leave the declared states, and a rejected event leaves the state unchanged."""
    spec = load_spec(name)
    guards = _guard_names(spec)
    life = spec.start()
    reference = Facts({g: False for g in guards})
    build_machine(spec, reference)
    for _ in range(data.draw(st.integers(0, 25))):
        trigger = data.draw(st.sampled_from(spec.triggers))
        facts = {g: data.draw(st.booleans()) for g in guards}
        reference.__dict__.update(facts)
        model = Facts(facts)
        before = life.state
        try:
            taken = life.fire(trigger, model)
        except IllegalTransition:
            assert life.state == before
            with pytest.raises(MachineError):
                reference.trigger(trigger)
            continue
        ref_taken = reference.trigger(trigger)
        assert taken == ref_taken
        if not taken:
            assert life.state == before
        assert life.state == reference.state
        assert life.state in spec.states


def test_each_taken_transition_is_counted_on_its_edge():
    guarded = GOOD.replace('trigger = "go"\nsource = "a"\ndest = "b"', 'trigger = "go"\nsource = "a"\ndest = "b"\nguards = "ok"')
    spec = parse_spec(guarded, "guarded.toml")
    model = type("Model", (), {"ok": False})()
    life = spec.start()
    assert life.fire("go", model) is False  # blocked by its guard: nothing taken, nothing counted
    assert set(spec.fired_counts().values()) == {0}
    model.ok = True
    life.fire("go", model)
    spec.start().fire("go", model)  # every lifecycle of a spec adds to the same counts
    counts = spec.fired_counts()
    assert counts[("a", "go", "b")] == 2 and sum(counts.values()) == 2
    assert set(counts) == {(s, t.trigger, t.dest) for t in spec.transitions for s in t.sources}


def test_a_shipped_spec_and_its_vocabulary_must_agree():
    """vocab.py's enums are the names the core branches on: a spec that renames a state or a
    trigger without them fails at load, naming the enum and the difference."""
    from importlib import resources

    text = resources.files("relayline.specs").joinpath("stream.toml").read_text()
    with pytest.raises(SpecError, match=r"differs from vocab.StreamState: missing \['held'\], not in the vocabulary \['waiting'\]"):
        parse_spec(text.replace("held", "waiting"), "specs/stream.toml")
    with pytest.raises(SpecError, match=r"differs from vocab.StreamTrigger: missing \['headers'\]"):
        parse_spec(text.replace('"headers"', '"hdrs"'), "specs/stream.toml")
