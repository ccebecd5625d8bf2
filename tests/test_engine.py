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
    states, never leave the declared states, and a refused event (undeclared, or every guard
    blocked) raises and leaves the state unchanged."""
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
            life.fire(trigger, model)
        except IllegalTransition:
            # undeclared here (transitions raises too), or every guard blocked (transitions
            # declines quietly; the table refuses loudly): either way the state stays
            assert life.state == before
            try:
                assert reference.trigger(trigger) is False
            except MachineError:
                pass
            assert reference.state == before
            continue
        assert reference.trigger(trigger) is True
        assert life.state == reference.state
        assert life.state in spec.states


def test_each_taken_transition_is_counted_on_its_edge():
    guarded = GOOD.replace('trigger = "go"\nsource = "a"\ndest = "b"', 'trigger = "go"\nsource = "a"\ndest = "b"\nguards = "ok"')
    spec = parse_spec(guarded, "guarded.toml")
    model = type("Model", (), {"ok": False})()
    life = spec.start()
    with pytest.raises(IllegalTransition):  # blocked by its guard: nothing taken, nothing counted
        life.fire("go", model)
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


def _walk_text():
    from importlib import resources

    return resources.files("relayline.specs").joinpath("walk.toml").read_text()


TIMEOUT_ADVANCES = '''[[decisions]]
failure = "timeout"
when = { other_candidate = true }
then = "advance"
doc = "A silent route is not retried while another can answer."
'''
BROKEN_TABLES = {
    # a row removed: timeout with another candidate is decided by nothing
    "undecided": (lambda t: t.replace(TIMEOUT_ADVANCES, ""),
                  r"failure 'timeout' is undecided when blocked=no, budget_left=no, other_candidate=yes"),
    # a row duplicated with another outcome: two rows decide one case
    "decided twice": (lambda t: t + TIMEOUT_ADVANCES.replace('"advance"', '"stop"'),
                      r"failure 'timeout' is decided twice when .*other_candidate=yes: decisions\[6\] and decisions\[17\]"),
    "trigger the state does not accept": (lambda t: t.replace(TIMEOUT_ADVANCES, TIMEOUT_ADVANCES.replace('"advance"', '"exhaust"')),
                                          r"decisions\[6\] fires 'exhaust', which state 'calling' does not accept"),
    "undeclared situation": (lambda t: t.replace("{ other_candidate = true }\nthen", "{ sunny = true }\nthen"),
                             r"decisions\[6\] uses undeclared situation 'sunny'"),
    "unknown failure class": (lambda t: t.replace('failure = "timeout"\nwhen = { other_candidate = true }', 'failure = "tired"\nwhen = { other_candidate = true }'),
                              r"decisions\[6\] names unknown failure class 'tired'"),
    "a row that decides nothing": (lambda t: t + '[[decisions]]\nfailure = "quota"\nwhen = { stops = true }\nunless = { stops = true }\nthen = "advance"\n',
                                   r"failure 'quota' is decided twice|never decide anything"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TABLES))
def test_a_broken_decision_table_fails_naming_the_case(case):
    """walk.toml's policy is validated complete and unambiguous at load: a gap, an overlap, a
    trigger `calling` does not accept, an unknown name each fail naming the case."""
    edit, message = BROKEN_TABLES[case]
    text = edit(_walk_text())
    assert text != _walk_text()
    with pytest.raises(SpecError, match=message):
        parse_spec(text, "specs/walk.toml")


def test_the_walk_table_decides_every_class_in_every_situation():
    table = load_spec("walk").decisions
    assert table is not None and table.state == "calling"
    from relayline.machines.vocab import FailureClass

    for failure in FailureClass:
        names, rows = table.index[failure]
        assert len(rows) == 2 ** len(names)  # every combination of what its rows read
    assert {r.then for r in table.rows} == {"stop", "advance", "backoff", "retry_now"}
