"""Loading a spec, checked against the file itself: every shipped spec, parsed afresh, holds
exactly what its TOML says (states, tags, transitions with `*` expanded, guards, invariants, the
decision table and its index, the run-time table), and every way a spec can be wrong is refused
with its own message, naming the file and the element."""

import itertools
import tomllib
from importlib import resources

import pytest

from relayline.machines.engine import SPEC_NAMES, load_spec, parse_spec
from relayline.machines.errors import SpecError
from relayline.machines.vocab import FailureClass


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


GOOD = """name = "toy"
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


def _go(extra: str) -> str:
    return GOOD.replace('source = "a"\ndest = "b"\n', 'source = "a"\ndest = "b"\n' + extra, 1)


def _add(trigger: str, source: str, dest: str, extra: str = "") -> str:
    return GOOD + f'[[transitions]]\ntrigger = "{trigger}"\nsource = "{source}"\ndest = "{dest}"\n{extra}'


BROKEN = {
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
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_spec_is_refused_with_its_own_message(case):
    text, message = BROKEN[case]
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "toy.toml")
    if message is None:  # TOML's own words follow; the file is named first
        assert str(caught.value).startswith("toy.toml: ")
    else:
        assert str(caught.value) == message


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


TABLES = {
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
    "trigger not accepted": (lambda t: t.replace('then = "stop"', 'then = "exhaust"', 1),
                             "specs/walk.toml: decisions[0] fires 'exhaust', which state 'calling' does not accept"),
}


@pytest.mark.parametrize("case", sorted(TABLES))
def test_a_broken_decision_table_is_refused_with_its_own_message(case):
    edit, message = TABLES[case]
    with pytest.raises(SpecError) as caught:
        parse_spec(_walk(edit), "specs/walk.toml")
    assert str(caught.value) == message
