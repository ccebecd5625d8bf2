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


def test_unreachable_state_is_named():
    text = GOOD + '[states.orphan]\n'
    with pytest.raises(SpecError, match=r"toy.toml: unreachable states \['orphan'\]"):
        parse_spec(text, "toy.toml")


def test_transition_to_undeclared_state_is_named():
    text = GOOD + '[[transitions]]\ntrigger = "jump"\nsource = "a"\ndest = "nowhere"\n'
    with pytest.raises(SpecError, match=r"toy.toml: transition 'jump' .* undeclared state 'nowhere'"):
        parse_spec(text, "toy.toml")


def test_violated_invariant_is_named():
    text = GOOD + '[[transitions]]\ntrigger = "replay"\nsource = "b"\ndest = "a"\n'
    with pytest.raises(SpecError, match=r"invariant violated: immutable_output state 'b' reaches provider_call state 'a'"):
        parse_spec(text, "toy.toml")


def test_invariant_allows_the_named_recovery():
    text = GOOD.replace('to_tag = "provider_call"', 'to_tag = "provider_call"\nvia = ["replay"]')
    text += '[[transitions]]\ntrigger = "replay"\nsource = "b"\ndest = "a"\n'
    parse_spec(text, "toy.toml")


def test_ambiguous_trigger_is_named():
    text = GOOD + '[[transitions]]\ntrigger = "go"\nsource = "a"\ndest = "done"\n'
    with pytest.raises(SpecError, match=r"ambiguous trigger 'go' from state 'a'"):
        parse_spec(text, "toy.toml")


def test_guards_that_exclude_each_other_are_not_ambiguous():
    text = GOOD.replace('source = "a"\ndest = "b"', 'source = "a"\ndest = "b"\nguards = "ok"')
    text += '[[transitions]]\ntrigger = "go"\nsource = "a"\ndest = "done"\nunless = "ok"\n'
    parse_spec(text, "toy.toml")


def test_state_that_cannot_terminate_is_named():
    text = GOOD + '[states.loop]\n[[transitions]]\ntrigger = "spin"\nsource = "a"\ndest = "loop"\n'
    text += '[[transitions]]\ntrigger = "spin"\nsource = "loop"\ndest = "loop"\n'
    with pytest.raises(SpecError, match=r"state 'loop' cannot reach a terminal state"):
        parse_spec(text, "toy.toml")


def test_undeclared_guard_is_named():
    text = GOOD.replace('source = "a"\ndest = "b"', 'source = "a"\ndest = "b"\nguards = "nope"')
    with pytest.raises(SpecError, match=r"undeclared guard 'nope'"):
        parse_spec(text, "toy.toml")


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
