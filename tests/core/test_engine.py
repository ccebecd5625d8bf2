"""The spec engine: validation names the problem; the compiled table is the transitions machine;
every shipped spec, parsed afresh, holds exactly what its file says (states, tags, transitions
with `*` expanded, guards, invariants, the decision table and its index, the run-time table), and
every way a spec can be wrong is refused with its own message, naming the file and the element."""

import itertools
import tomllib
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transitions import MachineError

from relayline.machines.engine import (
    SPEC_NAMES,
    bind_entry_actions,
    build_machine,
    load_spec,
    parse_spec,
)
from relayline.machines.errors import IllegalTransition, SpecError
from relayline.machines.vocab import FailureClass

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
    assert not any(hasattr(reference, f"to_{state}") for state in spec.states)  # only the spec's triggers
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
            if (before, trigger) in spec.table:  # declared, every guard blocked: transitions declines
                assert reference.trigger(trigger) is False
            else:  # undeclared from this state: transitions refuses too
                with pytest.raises(MachineError):
                    reference.trigger(trigger)
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
                      r"failure 'timeout' is decided twice when .*other_candidate=yes: decisions\[6\] and decisions\[19\]"),
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


# -- loading, against the file itself ------------------------------------------------------------

def _text(name: str) -> str:
    return resources.files("relayline.specs").joinpath(f"{name}.toml").read_text(encoding="utf-8")


def _strings(value) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_a_shipped_spec_is_what_its_file_says(name):
    raw = tomllib.loads(_text(name))
    spec = parse_spec(_text(name), f"specs/{name}.toml")
    assert (spec.name, spec.initial, spec.source) == (raw["name"], raw["initial"], f"specs/{name}.toml")
    assert spec.doc == raw.get("doc", "") and spec.recurrent == raw.get("recurrent", False)
    assert list(spec.states) == list(raw["states"])
    for state, body in raw["states"].items():
        body = body or {}
        assert spec.states[state].tags == frozenset(body.get("tags", ()))
        assert spec.states[state].doc == body.get("doc", "")
    assert spec.guards == raw.get("guards", {})
    live = [s for s, body in raw["states"].items() if "terminal" not in (body or {}).get("tags", ())]
    assert len(spec.transitions) == len(raw["transitions"])
    for t, body in zip(spec.transitions, raw["transitions"], strict=True):
        sources = tuple(live) if body["source"] == "*" else _strings(body["source"])
        assert (t.trigger, t.sources, t.dest) == (body["trigger"], sources, body["dest"])
        assert (t.guards, t.unless, t.doc) == (_strings(body.get("guards")), _strings(body.get("unless")),
                                              body.get("doc", ""))
    assert [(i.kind, i.from_tag, i.to_tag, i.via, i.doc) for i in spec.invariants] == [
        (b["kind"], b["from_tag"], b["to_tag"], _strings(b.get("via")), b.get("doc", ""))
        for b in raw.get("invariants", [])]
    # the run-time table: every (state, trigger) to its candidates, in declaration order
    expected = {}
    for t in spec.transitions:
        for s in t.sources:
            expected.setdefault((s, t.trigger), []).append(t)
    assert spec.table == {key: tuple(ts) for key, ts in expected.items()}
    assert spec.fired == {key: [0] * len(ts) for key, ts in expected.items()}
    assert spec.triggers == tuple(dict.fromkeys(b["trigger"] for b in raw["transitions"]))
    # the cached spec the machines run is this one
    cached = load_spec(name)
    assert spec == cached and spec.table == cached.table
    if "decisions" not in raw:
        assert spec.decisions is None
        return
    table = spec.decisions
    assert table is not None and table.state == raw["decide"]
    assert (table.situations, table.waits, table.actions) == (raw["situations"], raw["waits"], raw["actions"])
    assert len(table.rows) == len(raw["decisions"])
    for row, body in zip(table.rows, raw["decisions"], strict=True):
        assert (row.failures, row.then, row.wait, row.actions, row.doc) == (
            _strings(body["failure"]), body["then"], body.get("wait"), _strings(body.get("actions")),
            body.get("doc", ""))
        assert row.when == tuple(body.get("when", {}).items())
        assert row.unless == tuple(body.get("unless", {}).items())
    assert table.index == cached.decisions.index
    for failure in FailureClass:
        mine = [r for r in table.rows if failure in r.failures]
        names = tuple(sorted({k for r in mine for k, _ in r.when + r.unless}))
        read, decided = table.index[failure]
        assert read == names
        for values in itertools.product((False, True), repeat=len(names)):
            facts = dict(zip(names, values, strict=True))
            hits = [r for r in mine
                    if all(facts[k] == v for k, v in r.when)
                    and not (r.unless and all(facts[k] == v for k, v in r.unless))]
            assert hits == [decided[values]]
            model = type("Facts", (), facts)()
            assert table.decide(failure, model) is hits[0]


def _go(extra: str) -> str:
    return GOOD.replace('source = "a"\ndest = "b"\n', 'source = "a"\ndest = "b"\n' + extra, 1)


def _add(trigger: str, source: str, dest: str, extra: str = "") -> str:
    return GOOD + f'[[transitions]]\ntrigger = "{trigger}"\nsource = "{source}"\ndest = "{dest}"\n{extra}'


REFUSED = {
    "not TOML": ("name = ", None),
    "unknown key": ("colour = 1\n" + GOOD, "toy.toml: unknown top-level keys ['colour']"),
    "no initial": (GOOD.replace('initial = "a"\n', ""), "toy.toml: missing required key 'initial'"),
    "no states": (GOOD.replace("[states.", "[nostates."), None),
    "transition without dest": (GOOD.replace('dest = "done"\n', ""), "toy.toml: transitions[1] is missing 'dest'"),
    "tags not strings": (GOOD.replace('tags = ["terminal"]', "tags = [1]"),
                         "toy.toml: states.done.tags must be a string or a list of strings"),
    "empty states": ('name = "toy"\ninitial = "a"\nstates = {}\ntransitions = []\n', "toy.toml: declares no states"),
    "undeclared initial": (GOOD.replace('initial = "a"', 'initial = "z"'), "toy.toml: initial state 'z' is not declared"),
    "undeclared source": (_add("jump", "z", "b"),
                          "toy.toml: transition 'jump' (transitions[2]) leaves undeclared state 'z'"),
    "leaves terminal": (_add("again", "done", "a"),
                        "toy.toml: transition 'again' (transitions[2]) leaves terminal state 'done'"),
    "undeclared dest": (_add("jump", "a", "z"),
                        "toy.toml: transition 'jump' (transitions[2]) goes to undeclared state 'z'"),
    "undeclared guard": (_go('guards = "nope"\n'),
                         "toy.toml: transition 'go' (transitions[0]) uses undeclared guard 'nope'"),
    "undeclared unless": (_go('unless = "nope"\n'),
                          "toy.toml: transition 'go' (transitions[0]) uses undeclared guard 'nope'"),
    "ambiguous": (_add("go", "a", "done"), "toy.toml: ambiguous trigger 'go' from state 'a': transitions to "
                                           "'b' and 'done' have no distinguishing guards"),
    "same guards": (_go('guards = "ok"\n') + '[[transitions]]\ntrigger = "go"\nsource = "a"\ndest = "done"\nguards = "ok"\n',
                    "toy.toml: ambiguous trigger 'go' from state 'a': transitions to 'b' and 'done' have no "
                    "distinguishing guards"),
    "unreachable": (GOOD + "[states.orphan]\n", "toy.toml: unreachable states ['orphan']"),
    "no terminal": (GOOD.replace('tags = ["terminal"]', "tags = []"), "toy.toml: no state is tagged terminal"),
    "cannot terminate": (GOOD + "[states.loop]\n" + _add("spin", "a", "loop")[len(GOOD):]
                         + '[[transitions]]\ntrigger = "spin"\nsource = "loop"\ndest = "loop"\n',
                         "toy.toml: state 'loop' cannot reach a terminal state"),
    "recurrent stuck": ("recurrent = true\n" + GOOD.replace('tags = ["terminal"]', "tags = []"),
                        "toy.toml: state 'b' cannot return to the initial state"),
    "unknown invariant": (GOOD.replace('kind = "no_path"', 'kind = "maybe"'), "toy.toml: unknown invariant kind 'maybe'"),
    "unknown recovery": (GOOD.replace('to_tag = "provider_call"', 'to_tag = "provider_call"\nvia = ["redo"]'),
                         "toy.toml: invariant names unknown recovery triggers ['redo']"),
    "violated": (_add("replay", "b", "a"), "toy.toml: invariant violated: immutable_output state 'b' reaches "
                                           "provider_call state 'a' without a recovery transition (none named)"),
    "violated, other named": (_add("replay", "b", "a").replace('to_tag = "provider_call"',
                                                               'to_tag = "provider_call"\nvia = ["end"]'),
                              "toy.toml: invariant violated: immutable_output state 'b' reaches provider_call "
                              "state 'a' without a recovery transition (end)"),
    "violated, two named": (_add("replay", "b", "a").replace('to_tag = "provider_call"',
                                                             'to_tag = "provider_call"\nvia = ["end", "go"]'),
                            "toy.toml: invariant violated: immutable_output state 'b' reaches provider_call "
                            "state 'a' without a recovery transition (end, go)"),
    "invariant without kind": (GOOD.replace('kind = "no_path"\n', ""), "toy.toml: unknown invariant kind ''"),
}


def test_what_a_spec_leaves_out_is_empty_not_none():
    spec = parse_spec(GOOD.replace('kind = "no_path"\nfrom_tag = "immutable_output"\nto_tag = "provider_call"\n',
                                  'kind = "no_path"\n'), "toy.toml")
    assert spec.doc == "" and not spec.recurrent and spec.decisions is None
    assert {s.doc for s in spec.states.values()} == {""} and {t.doc for t in spec.transitions} == {""}
    assert (spec.invariants[0].from_tag, spec.invariants[0].to_tag, spec.invariants[0].doc) == ("", "", "")


def test_a_recovery_named_by_trigger_or_by_edge_is_allowed():
    replay = _add("replay", "b", "a")
    for via in ('["replay"]', '["replay->a"]'):
        spec = parse_spec(replay.replace('to_tag = "provider_call"', f'to_tag = "provider_call"\nvia = {via}'), "toy.toml")
        assert spec.invariants[0].via == (via[2:-2],)


def _walk(edit) -> str:
    text = _text("walk")
    edited = edit(text)
    assert edited != text
    return edited


REFUSED_TABLES = {
    "undeclared decide state": (lambda t: t.replace('decide = "calling"', 'decide = "dozing"'),
                                "specs/walk.toml: decide names undeclared state 'dozing'"),
    "unknown row key": (lambda t: t.replace('then = "stop"', 'then = "stop"\ncolour = "red"', 1),
                        "specs/walk.toml: decisions[0] has unknown keys ['colour']"),
    "row without then": (lambda t: t.replace('when = { stops = true }\nthen = "stop"\n', 'when = { stops = true }\n', 1),
                         "specs/walk.toml: decisions[0] is missing 'then'"),
    "situation not a bool": (lambda t: t.replace("when = { stops = true }", 'when = { stops = "yes" }', 1),
                             "specs/walk.toml: decisions[0].when must be a table of situation = true/false"),
    "unknown wait": (lambda t: t.replace('wait = "backoff"', 'wait = "nap"', 1),
                     "specs/walk.toml: decisions[3] uses undeclared wait 'nap'"),
    "unknown action": (lambda t: t.replace('actions = ["skip"]', 'actions = ["dance"]', 1),
                       "specs/walk.toml: decisions[5] uses undeclared action 'dance'"),
    "no decide state": (lambda t: t.replace('decide = "calling"', "", 1),
                        "specs/walk.toml: decide names undeclared state ''"),
    "undecided always": (lambda t: t.replace('failure = ["quota", "refused"]', 'failure = ["quota"]', 1),
                         "specs/walk.toml: failure 'refused' is undecided when always"),
    "trigger not accepted": (lambda t: t.replace('then = "stop"', 'then = "exhaust"', 1),
                             "specs/walk.toml: decisions[0] fires 'exhaust', which state 'calling' does not accept"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_TABLES))
def test_a_broken_decision_table_is_refused_with_its_own_message(case):
    edit, message = REFUSED_TABLES[case]
    with pytest.raises(SpecError) as caught:
        parse_spec(_walk(edit), "specs/walk.toml")
    assert str(caught.value) == message


def test_a_blocked_trigger_says_so_and_the_history_keeps_the_last_256_states():
    guarded = GOOD.replace('trigger = "go"\nsource = "a"\ndest = "b"', 'trigger = "go"\nsource = "a"\ndest = "b"\nguards = "ok"')
    life = parse_spec(guarded, "guarded.toml").start()
    with pytest.raises(IllegalTransition) as caught:
        life.fire("go", type("Model", (), {"ok": False})())
    assert str(caught.value).endswith("(every candidate's guards are blocked)")
    loop = parse_spec(GOOD + '[[transitions]]\ntrigger = "again"\nsource = "a"\ndest = "a"\n', "loop.toml").start()
    for _ in range(300):
        loop.fire("again")
    assert len(loop.history) == 256


def test_a_lifecycle_keeps_the_last_states_within_its_bound():
    life = load_spec("breaker").start(history_limit=3)
    for state in ("open", "half_open", "probing", "closed"):
        life.record(state)
    assert life.history == ["half_open", "probing", "closed"]


# ---------------------------------------------------------------------------------------------
# entry actions: named in the spec, performed by a registry, both checked


def _breaker_text(old: str = "", new: str = "") -> str:
    text = _text("breaker")
    assert old in text
    return text.replace(old, new, 1)


ENTRY_REFUSED = {
    "undeclared action": (_breaker_text('enter = ["lease_probe"]', 'enter = ["lease_probe", "ring_a_bell"]'),
                          "toy.toml: state 'probing' enters with undeclared action 'ring_a_bell'"),
    "declared, never taken": (_breaker_text('enter = ["forget_failures"]\n'),
                              "toy.toml: entry actions ['forget_failures'] are declared but no state takes them"),
    "not a list of names": (_breaker_text('enter = ["lease_probe"]', "enter = 3"),
                            "toy.toml: states.probing.enter must be a string or a list of strings"),
}


def test_a_registry_must_perform_exactly_the_spec_entry_actions_and_each_needed_state_has_one():
    from relayline.machines.config import Breaker as BreakerConfig
    from relayline.machines.health import ENTRY_ACTIONS, Breaker, BreakerShape

    spec = parse_spec(_text("breaker"), "toy.toml")
    short = {k: v for k, v in ENTRY_ACTIONS.items() if k != "lease_probe"}
    with pytest.raises(SpecError, match=r"toy.toml: its \[entry_actions\] must be exactly what the code performs: "
                                        r"missing \[\], not performed \['lease_probe'\]"):
        bind_entry_actions(spec, short)
    # open is left by time (cool_off): without an action setting open_until it would never end
    moved = _breaker_text('enter = ["open_for_open_s"]\n').replace(
        'doc = "open_s passed:', 'enter = ["open_for_open_s"]\ndoc = "open_s passed:')
    no_deadline = parse_spec(moved, "toy.toml")  # a valid spec: only the model needs the action there
    with pytest.raises(SpecError, match="toy.toml: state 'open' needs an entry action and names none"):
        BreakerShape.of(no_deadline)
    # the shipped spec binds, and a breaker runs its actions on entering a state
    assert bind_entry_actions(spec, ENTRY_ACTIONS)["open"] == (ENTRY_ACTIONS["open_for_open_s"],)
    b = Breaker(BreakerConfig(failure_threshold=1, open_s=5))
    b.failure(2.0)
    assert b.state == "open" and b.open_until == 7.0


def test_every_walk_state_needs_an_entry_action():
    """Entering a walk state is what the walk does next: a state without an action is refused
    when a walk binds the spec, naming the state."""
    from relayline.machines.walk import ENTRY_ACTIONS

    text = _text("walk")
    moved = text.replace('enter = ["sleep"]\n', "", 1).replace(
        'enter = ["release_probes", "cancelled"]', 'enter = ["release_probes", "sleep", "cancelled"]', 1)
    assert moved.count('"sleep"') == text.count('"sleep"')
    spec = parse_spec(moved, "toy.toml")
    with pytest.raises(SpecError, match="toy.toml: state 'backing_off' needs an entry action and names none"):
        bind_entry_actions(spec, ENTRY_ACTIONS, required=spec.states)


# the turn's, the stream's and the cancellation's entry actions: the same checks, each shown failing


def _moved(name: str, old: str, new: str) -> str:
    text = _text(name)
    assert text.count(old) == 1, old
    return text.replace(old, new, 1)


def _installed(name: str, text: str):
    """`text` as the shipped spec `name` while the block runs (as the spec-mutation sweep does)."""
    import contextlib

    from relayline.machines import engine

    @contextlib.contextmanager
    def swap():
        real = engine.load_spec(name)
        engine._CACHE[name] = parse_spec(text, f"specs/{name}.toml")
        try:
            yield
        finally:
            engine._CACHE[name] = real
    return swap()


def _a_turn(stream: bool = True):
    from helpers import config, plan
    from relayline.machines.health import InMemoryHealth
    from relayline.machines.turn import Turn

    cfg = config(active="a", providers={"a": {"model": "m1"}})
    return Turn(plan(cfg, model="m1"), cfg, InMemoryHealth(cfg.breaker), stream=stream)


# (spec, the broken text, the error a turn or a gate meets when it binds it)
BOUND_REFUSED = {
    "turn: a walk state without its action": (
        "turn", _moved("turn", 'enter = ["recover"]\n', "").replace(
            'enter = ["ended_cancelled"]', 'enter = ["recover", "ended_cancelled"]', 1),
        "specs/turn.toml: state 'recovering' needs an entry action and names none"),
    "turn: an action the code does not perform": (
        "turn", _moved("turn", 'enter = ["answered"]', 'enter = ["answered", "ring_a_bell"]').replace(
            "[entry_actions]\n", '[entry_actions]\nring_a_bell = "rings"\n', 1),
        r"specs/turn.toml: its [entry_actions] must be exactly what the code performs: missing [], "
        r"not performed ['ring_a_bell']"),
    "turn: an outcome the code cannot act on": (
        "turn", _moved("turn", '"continuation_failed", "continuation_interrupted"]',
                       '"continuation_failed", "free"]').replace(
            'gives = "continuation_interrupted"', 'gives = "free"'),
        "specs/turn.toml: outcomes.failed_stream may give ['free'], which the code does not know"),
    "turn: a refusal the code cannot act on": (
        "turn", _moved("turn", 'values = ["advance", "answer", "client_error", "cut"]',
                       'values = ["advance", "answer", "client_error", "shrug"]').replace(
            'gives = "cut"', 'gives = "shrug"'),
        "specs/turn.toml: outcomes.refusal may give ['shrug'], which the code does not know"),
    "turn: no refusal policy": (
        "turn", _moved("turn", "[outcomes.refusal]\n", "[outcomes.refusal_policy]\n").replace(
            "[[outcomes.refusal.rows]]", "[[outcomes.refusal_policy.rows]]"),
        "specs/turn.toml: has no [outcomes.refusal], which the code reads"),
    "stream: a commit that releases nothing": (
        "stream", _moved("stream", 'tags = ["immutable_output"]\nenter = ["release_held"]\n',
                         'tags = ["immutable_output"]\n').replace(
            'tags = ["pre_output"]\n', 'tags = ["pre_output"]\nenter = ["release_held"]\n', 1),
        "specs/stream.toml: state 'committed' needs an entry action and names none"),
    "cancellation: a settlement that persists nothing said": (
        "cancellation", _moved("cancellation", 'enter = ["keep_partial"]\n', "").replace(
            'enter = ["drop_partial"]', 'enter = ["drop_partial", "keep_partial"]', 1),
        "specs/cancellation.toml: state 'persisted_partial' needs an entry action and names none"),
}


@pytest.mark.parametrize("case", sorted(BOUND_REFUSED))
def test_a_turn_refuses_a_spec_whose_entry_actions_it_cannot_take(case):
    """Each broken spec is a valid lifecycle: only the code that runs it can say an action is
    missing or unknown, and it says so the first time a turn (and its gate) binds the spec."""
    from relayline.machines.stream import StreamGate

    name, text, message = BOUND_REFUSED[case]
    parse_spec(text, "toy.toml")  # the spec alone is sound
    with _installed(name, text), pytest.raises(SpecError) as caught:
        _a_turn()
        StreamGate()
    assert str(caught.value) == message


def test_the_turn_specs_name_each_entry_action_once_and_refuse_an_undeclared_one():
    for name, old in (("turn", 'enter = ["walk"]'), ("stream", 'enter = ["release_held"]'),
                      ("cancellation", 'enter = ["settle"]')):
        with pytest.raises(SpecError, match="toy.toml: state '.*' enters with undeclared action 'ring_a_bell'"):
            parse_spec(_moved(name, old, old[:-1] + ', "ring_a_bell"]'), "toy.toml")
    with pytest.raises(SpecError, match=r"toy.toml: entry actions \['walk'\] are declared but no state takes them"):
        parse_spec(_moved("turn", 'enter = ["walk"]\n', ""), "toy.toml")


def test_the_turn_start_is_the_spec_choice():
    """stream or walk is the `start` transitions' guards: a spec whose start sends a stream
    request to the walk makes the turn walk it (its first call in complete mode)."""
    from relayline.machines.walk import Call

    first = _a_turn().start(0.0)
    assert isinstance(first, Call) and first.mode == "stream"
    walked = _moved("turn", 'dest = "streaming"\nguards = ["stream_requested", "stream_entry"]',
                    'dest = "walking"\nguards = ["stream_requested", "stream_entry"]')
    with _installed("turn", walked):
        turn = _a_turn()
        call = turn.start(0.0)
    assert isinstance(call, Call) and call.mode == "complete" and turn.life.state == "walking"


# outcome tables: a policy that gives a value (why a walk ran out of entries), checked at load

_LAST_ROW = 'when = { attempted = true, last_empty = false, last_internal = false }\ngives = "exhausted"\n'

OUTCOMES_REFUSED = {
    "a row left out": (_moved("walk", _LAST_ROW, "").replace("[[outcomes.exhausted.rows]]\n\n", "\n", 1),
                       "toy.toml: outcomes.exhausted gives nothing when attempted=yes, last_empty=no, "
                       "last_internal=no, none_can_honour=no"),
    "two rows at once": (_moved("walk", _LAST_ROW, _LAST_ROW.replace(", last_internal = false", "")),
                         "toy.toml: outcomes.exhausted gives twice when attempted=yes, last_empty=no, "
                         "last_internal=yes, none_can_honour=no: rows[3] and rows[4]"),
    "an undeclared value": (_moved("walk", _LAST_ROW, _LAST_ROW.replace('"exhausted"', '"tired"')),
                            "toy.toml: outcomes.exhausted.rows[4] gives 'tired', not one of its values "
                            "['unsupported', 'no_candidate', 'semantic_empty', 'internal', 'exhausted']"),
    "an undeclared situation": (_moved("walk", _LAST_ROW, _LAST_ROW.replace("attempted = true", "tried = true")),
                                "toy.toml: outcomes.exhausted.rows[4] reads undeclared situation 'tried'"),
    "a row that never gives": (_moved("walk", _LAST_ROW, _LAST_ROW + '[[outcomes.exhausted.rows]]\n'
                                      'when = { attempted = true }\nunless = { attempted = true }\ngives = "exhausted"\n'),
                               "toy.toml: outcomes.exhausted.rows[5] never give anything"),
}


# the turn's [precedence.model]: an ordered table of named sources, the last the default
_OPERATOR = '[[precedence.model.sources]]\nname = "operator_model"\n'
_DEFAULT = '[[precedence.model.sources]]\nname = "active_profile"\nalways = true\n'

PRECEDENCE_REFUSED = {
    "a source named twice": (
        _moved("turn", _OPERATOR, _OPERATOR + 'doc = "once"\n' + _OPERATOR),
        "toy.toml: precedence.model.sources[1] names 'operator_model' a second time"),
    "no source that always gives": (
        _moved("turn", _DEFAULT, _DEFAULT.replace("always = true\n", "")),
        "toy.toml: precedence.model has no source that always gives a value: a choice could be "
        "left unmade"),
    "a source after the default, never asked": (
        _moved("turn", 'name = "selection"\n', 'name = "selection"\nalways = true\n'),
        "toy.toml: precedence.model: sources ['active_profile'] come after 'selection', which "
        "always gives a value, and are never asked"),
    "a source without a name": (
        _moved("turn", _OPERATOR, '[[precedence.model.sources]]\nnom = "operator_model"\n'),
        "toy.toml: precedence.model.sources[0] has unknown keys ['nom']"),
    "an always that is not a truth": (
        _moved("turn", _DEFAULT, _DEFAULT.replace("always = true", 'always = "yes"')),
        "toy.toml: precedence.model.sources[5].always must be true or false"),
    "an unknown key in the table": (
        _moved("turn", "[precedence.model]\n", "[precedence.model]\nweight = 1\n"),
        "toy.toml: precedence.model has unknown keys ['weight']"),
}


# every spec the loader refuses, each with its own message: the lifecycle's shape and invariants,
# its entry actions, its outcome and precedence tables
EVERY_REFUSED = {**REFUSED, **{f"entry: {k}": v for k, v in ENTRY_REFUSED.items()},
                 **{f"outcomes: {k}": v for k, v in OUTCOMES_REFUSED.items()},
                 **{f"precedence: {k}": v for k, v in PRECEDENCE_REFUSED.items()}}


@pytest.mark.parametrize("case", sorted(EVERY_REFUSED))
def test_a_broken_spec_is_refused_with_its_own_message(case):
    text, message = EVERY_REFUSED[case]
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "toy.toml")
    if message is None:  # TOML's own words follow; the file is named first
        assert str(caught.value).startswith("toy.toml: ")
    else:
        assert str(caught.value) == message


def test_the_walk_refuses_an_outcome_it_cannot_act_on():
    """A sound table that gives a value the walk does not know, or no table at all, is refused
    where the walk reads it, naming the value."""
    from relayline.machines.engine import check_outcomes
    from relayline.machines.walk import ERROR_REASONS

    tired = _moved("walk", _LAST_ROW, _LAST_ROW.replace('"exhausted"', '"tired"')).replace(
        '"internal", "exhausted"]', '"internal", "tired"]', 1)
    spec = parse_spec(tired, "toy.toml")
    with pytest.raises(SpecError, match=r"toy.toml: outcomes.exhausted may give \['tired'\], which the code does not know"):
        check_outcomes(spec, "exhausted", ERROR_REASONS)
    with pytest.raises(SpecError, match=r"toy.toml: has no \[outcomes.exhausted\], which the code reads"):
        check_outcomes(parse_spec(_text("breaker"), "toy.toml"), "exhausted", ERROR_REASONS)


OUTCOMES_MALFORMED = {
    "an unknown key in a table": ('[outcomes.exhausted]\ndoc = "the error', '[outcomes.exhausted]\nweight = 3\ndoc = "the error',
                                  "toy.toml: outcomes.exhausted has unknown keys ['weight']"),
    "an unknown key in a row": ('gives = "unsupported"\n', 'gives = "unsupported"\nthen = "stop"\n',
                                "toy.toml: outcomes.exhausted.rows[0] has unknown keys ['then']"),
    "a row that gives nothing": ('gives = "unsupported"\n', "",
                                 "toy.toml: outcomes.exhausted.rows[0] is missing 'gives'"),
    "values that are not names": ('values = ["unsupported", "no_candidate", "semantic_empty", "internal", "exhausted"]',
                                  "values = 3", "toy.toml: outcomes.exhausted.values must be a string or a list of strings"),
    "a situation that is not a truth": ("when = { attempted = false, none_can_honour = true }",
                                        'when = { attempted = "no", none_can_honour = true }',
                                        "toy.toml: outcomes.exhausted.rows[0].when must be a table of situation = true/false"),
}


@pytest.mark.parametrize("case", sorted(OUTCOMES_MALFORMED))
def test_a_malformed_outcome_table_is_refused_naming_where(case):
    old, new, message = OUTCOMES_MALFORMED[case]
    with pytest.raises(SpecError) as caught:
        parse_spec(_moved("walk", old, new), "toy.toml")
    assert str(caught.value) == message


def test_an_outcome_table_gives_by_the_situations_of_its_model():
    """Every combination of the exhausted table's situations gives the ladder's answer."""
    spec = parse_spec(_text("walk"), "toy.toml")
    table = spec.outcomes["exhausted"]
    assert table.reads == ("attempted", "last_empty", "last_internal", "none_can_honour")

    class Model:
        def __init__(self, **facts):
            self.__dict__.update(facts)

    for attempted, empty, internal, unfit in itertools.product((False, True), repeat=4):
        expected = (("unsupported" if unfit else "no_candidate") if not attempted
                    else "semantic_empty" if empty else "internal" if internal else "exhausted")
        given = table.decide(Model(attempted=attempted, last_empty=empty, last_internal=internal, none_can_honour=unfit))
        assert given == expected


def test_a_plan_refuses_model_sources_it_cannot_ask():
    """A sound precedence table that names a source the code does not have, leaves one out, or
    says a source always names a model when the code's may not, is refused where the plan
    reads it, naming the source."""
    from relayline.machines.engine import check_precedence
    from relayline.machines.plan import MODEL_SOURCES, model_sources

    known = {name: always for name, (_, always) in MODEL_SOURCES.items()}
    renamed = parse_spec(_moved("turn", 'name = "route_hint"', 'name = "horoscope"'), "toy.toml")
    with pytest.raises(SpecError, match=r"toy.toml: precedence.model must name exactly the sources "
                       r"the code asks: unknown \['horoscope'\], missing \['route_hint'\]"):
        model_sources(renamed)
    shipped = parse_spec(_text("turn"), "toy.toml")
    with pytest.raises(SpecError, match="toy.toml: precedence.model says 'active_profile' always "
                       "gives a value, and the code's does not"):
        check_precedence(shipped, "model", {**known, "active_profile": False})
    with pytest.raises(SpecError, match=r"toy.toml: has no \[precedence.model\], which the code reads"):
        check_precedence(parse_spec(_text("walk"), "toy.toml"), "model", known)


def test_the_turns_model_is_the_first_source_of_the_spec_that_names_one():
    """The plan asks [precedence.model]'s sources in the spec's order: with the request's model
    put before the operator's, the request's wins."""
    from helpers import config, plan

    cfg = config(active="a", providers={"a": {}})
    assert plan(cfg, model="asked", operator_model="chosen").requested_model == "chosen"
    _REQUEST = '[[precedence.model.sources]]\nname = "request_model"\n'
    text = _text("turn")
    request_block = text[text.index(_REQUEST):text.index("[[precedence.model.sources]]", text.index(_REQUEST) + 1)]
    swapped = text.replace(request_block, "", 1).replace(_OPERATOR, request_block + _OPERATOR, 1)
    with _installed("turn", swapped):
        assert plan(cfg, model="asked", operator_model="chosen").requested_model == "asked"


def test_a_refusal_does_what_the_turn_spec_gives():
    """[outcomes.refusal] decides a refusal: under on_refusal = "return" a content-policy 400 is
    the client error it was; a spec whose row gives `advance` there makes the turn advance past
    it, recorded as a refusal."""
    from helpers import config, plan
    from relayline.machines import classify as fc
    from relayline.machines.health import InMemoryHealth
    from relayline.machines.turn import Turn
    from relayline.machines.walk import Call

    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 0})
    policy_400 = fc.Failure(fc.REFUSED, "HTTP 400 content policy", 400)

    def refused_once():
        turn = Turn(plan(cfg, model="m1"), cfg, InMemoryHealth(cfg.breaker), stream=False)
        turn.start(0.0)
        return turn, turn.on_completion(policy_400, 0.0)

    turn, _ = refused_once()
    assert [(a.outcome, a.reason) for a in turn.attempts] == [("rejected", "rejected")]
    row = 'when = { refusals_advance = false, refusal_answered = false }\ngives = '
    with _installed("turn", _moved("turn", row + '"client_error"', row + '"advance"')):
        turn, nxt = refused_once()
    assert [(a.outcome, a.reason) for a in turn.attempts] == [("refused", "refused")]
    assert isinstance(nxt, Call) and nxt.entry.profile == "b" and turn.refusal is not None
