"""Lifecycles declared as data: load a spec, prove its invariants, run it.

A spec (specs/*.toml) is the single source of truth for a lifecycle: its states and their tags,
its transitions with guard names, and the invariants that must hold on its graph. This module

- parses and validates a spec, checking every invariant statically on the graph, so a broken
  lifecycle fails at import time with an error naming the spec file and the offending element;
- builds a `transitions.Machine` from it: the executable reference, also used for diagrams;
- compiles it into a plain table for the hot path (`Lifecycle`). transitions costs 12-20 µs a
  trigger; the table costs well under 1 µs. tests/core/test_engine.py proves both take the same state
  sequences on generated event sequences, so the table is the spec, only faster.

Guards are names. At run time a guard is looked up on the model object (an attribute or a
zero-argument method), in both the table and the transitions machine.
"""

from __future__ import annotations

import itertools
import tomllib
from collections import deque
from collections.abc import Iterable
from importlib import resources
from typing import Any

import attrs

from .errors import IllegalTransition, SpecError
from .vocab import SPEC_VOCABULARY, FailureClass

FAILURE_CLASSES = tuple(FailureClass)

SPEC_NAMES = ("turn", "stream", "cancellation", "breaker", "walk", "budget", "admission")


@attrs.frozen
class StateSpec:
    name: str
    tags: frozenset[str]
    doc: str = ""
    enter: tuple[str, ...] = ()  # the entry actions, by name, in order


@attrs.frozen
class TransitionSpec:
    trigger: str
    sources: tuple[str, ...]
    dest: str
    guards: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    doc: str = ""
    reenter: bool = False  # a self-transition that enters its state again: its entry actions run


@attrs.frozen
class Invariant:
    """`no_path`: no path leads from a state tagged `from_tag` to one tagged `to_tag`, except
    through a transition listed in `via` (the spec's named recovery), by its trigger or, to name
    one transition of a trigger, as `trigger->dest`."""

    kind: str
    from_tag: str
    to_tag: str
    via: tuple[str, ...] = ()
    doc: str = ""


def _row_matches(when: tuple[tuple[str, bool], ...], unless: tuple[tuple[str, bool], ...],
                 facts: dict[str, bool]) -> bool:
    """A table row applies when every `when` situation has its value and not every `unless`
    one has (a decision table's row and an outcome table's read their situations alike)."""
    if not all(facts[name] == value for name, value in when):
        return False
    return not (unless and all(facts[name] == value for name, value in unless))


@attrs.frozen
class Decision:
    """One row of a decision table: for these failure classes, when every `when` situation has
    its value and not every `unless` one has, fire `then` (and let the model run `actions`)."""

    failures: tuple[str, ...]
    then: str
    when: tuple[tuple[str, bool], ...] = ()
    unless: tuple[tuple[str, bool], ...] = ()
    wait: str | None = None
    actions: tuple[str, ...] = ()
    doc: str = ""

    def matches(self, facts: dict[str, bool]) -> bool:
        return _row_matches(self.when, self.unless, facts)


@attrs.frozen
class DecisionTable:
    """A lifecycle's policy as data: which trigger a failure fires from `state`, by failure
    class and situation. Validated complete and unambiguous: every class, under every combination
    of the situations, is decided by exactly one row, so no row's position matters."""

    state: str
    situations: dict[str, str]
    waits: dict[str, str]
    actions: dict[str, str]
    rows: tuple[Decision, ...]
    # failure class -> (the situations its rows read, their values -> the deciding row)
    index: dict[str, tuple[tuple[str, ...], dict[tuple[bool, ...], Decision]]] = attrs.field(factory=dict, eq=False)

    def decide(self, failure: str, model: Any) -> Decision:
        names, rows = self.index[failure]
        return rows[tuple(_guard(model, name) for name in names)]


@attrs.frozen
class OutcomeRow:
    """One row of an outcome table: when every `when` situation has its value and not every
    `unless` one has, the table gives `gives`."""

    gives: str
    when: tuple[tuple[str, bool], ...] = ()
    unless: tuple[tuple[str, bool], ...] = ()
    doc: str = ""

    def matches(self, facts: dict[str, bool]) -> bool:
        return _row_matches(self.when, self.unless, facts)


@attrs.frozen
class OutcomeTable:
    """A policy that gives a value instead of firing a trigger (why a walk ran out of entries,
    whether a failed stream is billed): the situations it reads are guards of the model, by
    name; validated complete and unambiguous like a decision table, so no row's position
    matters. The code that reads it checks at load that every value it can give is one it knows."""

    name: str
    values: tuple[str, ...]
    rows: tuple[OutcomeRow, ...]
    doc: str = ""
    reads: tuple[str, ...] = ()  # the situations the rows read, in a fixed order
    index: dict[tuple[bool, ...], str] = attrs.field(factory=dict, eq=False)  # their values -> the value given

    def decide(self, model: Any) -> str:
        return self.index[tuple(_guard(model, name) for name in self.reads)]


@attrs.frozen
class Spec:
    name: str
    source: str
    initial: str
    states: dict[str, StateSpec]
    transitions: tuple[TransitionSpec, ...]
    guards: dict[str, str]
    invariants: tuple[Invariant, ...]
    doc: str = ""
    recurrent: bool = False
    decisions: DecisionTable | None = None
    entry_actions: dict[str, str] = attrs.Factory(dict)  # name -> what it does, for the diagrams
    outcomes: dict[str, OutcomeTable] = attrs.Factory(dict)  # name -> its outcome table
    # what the code derives from this spec once (its entry actions as functions, a model's
    # shortcuts), kept with it: a mutated spec installed in a shipped one's place derives its own
    derived: dict[Any, Any] = attrs.field(factory=dict, eq=False, repr=False)
    # (state, trigger) -> candidate transitions, in declaration order
    table: dict[tuple[str, str], tuple[TransitionSpec, ...]] = attrs.field(factory=dict, eq=False)
    # (state, trigger) -> how often each candidate fired, summed over every Lifecycle of this spec
    # object (a shipped spec is loaded once per process: since start). The operator's console
    # draws them on the diagrams; a list per key keeps the hot path to one lookup and one add.
    fired: dict[tuple[str, str], list[int]] = attrs.field(factory=dict, eq=False)
    # the table again as `Lifecycle.fire` reads it: state -> trigger -> its candidates, each as
    # (dest, guards, unless, its `fired` list, its index there): one lookup by the state a
    # lifecycle holds and one by the trigger, no key tuple made and hashed, twice, each fire
    moves: dict[str, dict[str, tuple[tuple[str, tuple[str, ...], tuple[str, ...], list[int], int], ...]]] = \
        attrs.field(factory=dict, eq=False, repr=False)
    # the states tagged terminal, once: every turn's end asks whether its machines reached one
    terminal: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    # (state, trigger) of the self-transitions marked reenter: `Lifecycle.step` runs their entry actions
    reentering: frozenset[tuple[str, str]] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "terminal", self.tagged("terminal"))
        object.__setattr__(self, "reentering", frozenset(
            (t.dest, t.trigger) for t in self.transitions if t.reenter and t.dest in t.sources))

    @property
    def triggers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.trigger for t in self.transitions))

    def tagged(self, tag: str) -> frozenset[str]:
        return frozenset(s.name for s in self.states.values() if tag in s.tags)

    def start(self, history_limit: int = 256) -> Lifecycle:
        return Lifecycle(self, history_limit)

    def fired_counts(self) -> dict[tuple[str, str, str], int]:
        """(source, trigger, dest) -> transitions taken, for every edge of the graph."""
        counts: dict[tuple[str, str, str], int] = {}
        for (source, trigger), candidates in self.table.items():
            for t, n in zip(candidates, self.fired[(source, trigger)], strict=True):
                key = (source, trigger, t.dest)
                counts[key] = counts.get(key, 0) + n
        return counts


# ---------------------------------------------------------------------------------------------
# loading and validation


def _as_tuple(value: object, where: str, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"{source}: {where} must be a string or a list of strings")


def parse_spec(text: str, source: str) -> Spec:
    """Parse and validate a spec; raise SpecError naming `source` and the problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    return build_spec(raw, source)


def build_spec(raw: dict[str, Any], source: str) -> Spec:
    """Validate and compile a spec already read from TOML (tests mutate such documents)."""
    known = {"name", "doc", "initial", "recurrent", "states", "transitions", "guards", "invariants",
             "decide", "situations", "waits", "actions", "decisions", "entry_actions", "outcomes"}
    unknown = set(raw) - known
    if unknown:
        raise SpecError(f"{source}: unknown top-level keys {sorted(unknown)}")
    for key in ("name", "initial", "states", "transitions"):
        if key not in raw:
            raise SpecError(f"{source}: missing required key {key!r}")
    states = {}
    for name, body in raw["states"].items():
        body = body or {}
        states[name] = StateSpec(
            name=name,
            tags=frozenset(_as_tuple(body.get("tags"), f"states.{name}.tags", source)),
            doc=str(body.get("doc", "")),
            enter=_as_tuple(body.get("enter"), f"states.{name}.enter", source),
        )
    guards = {str(k): str(v) for k, v in raw.get("guards", {}).items()}
    transitions = []
    for i, body in enumerate(raw["transitions"]):
        where = f"transitions[{i}]"
        for key in ("trigger", "source", "dest"):
            if key not in body:
                raise SpecError(f"{source}: {where} is missing {key!r}")
        sources = _as_tuple(body["source"], f"{where}.source", source)
        if sources == ("*",):
            sources = tuple(s for s, st in states.items() if "terminal" not in st.tags)
        transitions.append(
            TransitionSpec(
                trigger=body["trigger"],
                sources=sources,
                dest=body["dest"],
                guards=_as_tuple(body.get("guards"), f"{where}.guards", source),
                unless=_as_tuple(body.get("unless"), f"{where}.unless", source),
                doc=str(body.get("doc", "")),
                reenter=bool(body.get("reenter", False)),
            )
        )
    invariants = tuple(
        Invariant(
            kind=body.get("kind", ""),
            from_tag=body.get("from_tag", ""),
            to_tag=body.get("to_tag", ""),
            via=_as_tuple(body.get("via"), f"invariants[{i}].via", source),
            doc=str(body.get("doc", "")),
        )
        for i, body in enumerate(raw.get("invariants", []))
    )
    spec = Spec(
        name=raw["name"],
        source=source,
        initial=raw["initial"],
        states=states,
        transitions=tuple(transitions),
        guards=guards,
        invariants=invariants,
        doc=str(raw.get("doc", "")),
        recurrent=bool(raw.get("recurrent", False)),
        decisions=_parse_decisions(raw, source) if "decisions" in raw else None,
        entry_actions={str(k): str(v) for k, v in raw.get("entry_actions", {}).items()},
        outcomes={str(name): _parse_outcomes(str(name), body, source) for name, body in raw.get("outcomes", {}).items()},
    )
    validate(spec)
    for outcome in spec.outcomes.values():
        _validate_outcomes(spec, outcome)
    _validate_entry_actions(spec)
    _check_vocabulary(spec)
    if spec.decisions is not None:
        _validate_decisions(spec, spec.decisions)
    table: dict[tuple[str, str], tuple[TransitionSpec, ...]] = {}
    for t in spec.transitions:
        for s in t.sources:
            table[(s, t.trigger)] = table.get((s, t.trigger), ()) + (t,)
    spec.table.update(table)
    spec.fired.update((key, [0] * len(candidates)) for key, candidates in table.items())
    spec.moves.update((name, {}) for name in spec.states)
    for (source, trigger), candidates in table.items():
        counts = spec.fired[(source, trigger)]
        spec.moves[source][trigger] = tuple((t.dest, t.guards, t.unless, counts, i) for i, t in enumerate(candidates))
    return spec


def _situations(value: object, where: str, source: str) -> tuple[tuple[str, bool], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(v, bool) for v in value.values()):
        raise SpecError(f"{source}: {where} must be a table of situation = true/false")
    return tuple((str(k), v) for k, v in value.items())


def _parse_decisions(raw: dict[str, Any], source: str) -> DecisionTable:
    docs = {key: {str(k): str(v) for k, v in raw.get(key, {}).items()} for key in ("situations", "waits", "actions")}
    rows = []
    for i, body in enumerate(raw["decisions"]):
        where = f"decisions[{i}]"
        unknown = set(body) - {"failure", "when", "unless", "then", "wait", "actions", "doc"}
        if unknown:
            raise SpecError(f"{source}: {where} has unknown keys {sorted(unknown)}")
        for key in ("failure", "then"):
            if key not in body:
                raise SpecError(f"{source}: {where} is missing {key!r}")
        wait = body.get("wait")
        rows.append(Decision(
            failures=_as_tuple(body["failure"], f"{where}.failure", source),
            then=str(body["then"]),
            when=_situations(body.get("when"), f"{where}.when", source),
            unless=_situations(body.get("unless"), f"{where}.unless", source),
            wait=None if wait is None else str(wait),
            actions=_as_tuple(body.get("actions"), f"{where}.actions", source),
            doc=str(body.get("doc", "")),
        ))
    return DecisionTable(state=str(raw.get("decide", "")), situations=docs["situations"], waits=docs["waits"],
                         actions=docs["actions"], rows=tuple(rows))


def _parse_outcomes(name: str, body: dict[str, Any], source: str) -> OutcomeTable:
    where = f"outcomes.{name}"
    unknown = set(body) - {"doc", "values", "rows"}
    if unknown:
        raise SpecError(f"{source}: {where} has unknown keys {sorted(unknown)}")
    rows = []
    for i, row in enumerate(body.get("rows", [])):
        at = f"{where}.rows[{i}]"
        unknown = set(row) - {"when", "unless", "gives", "doc"}
        if unknown:
            raise SpecError(f"{source}: {at} has unknown keys {sorted(unknown)}")
        if "gives" not in row:
            raise SpecError(f"{source}: {at} is missing 'gives'")
        rows.append(OutcomeRow(gives=str(row["gives"]), when=_situations(row.get("when"), f"{at}.when", source),
                               unless=_situations(row.get("unless"), f"{at}.unless", source), doc=str(row.get("doc", ""))))
    return OutcomeTable(name=name, values=_as_tuple(body.get("values"), f"{where}.values", source), rows=tuple(rows),
                        doc=str(body.get("doc", "")))


def _validate_outcomes(spec: Spec, table: OutcomeTable) -> None:
    """Under every combination of the situations its rows read, exactly one row gives a value;
    every row gives one of the declared values and is reachable; every situation is a declared
    guard or situation of the spec."""
    src, where = spec.source, f"outcomes.{table.name}"
    declared = set(spec.guards) | (set(spec.decisions.situations) if spec.decisions is not None else set())
    for i, row in enumerate(table.rows):
        if row.gives not in table.values:
            raise SpecError(f"{src}: {where}.rows[{i}] gives {row.gives!r}, not one of its values {list(table.values)}")
        for name, _ in row.when + row.unless:
            if name not in declared:
                raise SpecError(f"{src}: {where}.rows[{i}] reads undeclared situation {name!r}")
    reads = tuple(sorted({name for row in table.rows for name, _ in row.when + row.unless}))
    used = set()
    for values in itertools.product((False, True), repeat=len(reads)):
        facts = dict(zip(reads, values, strict=True))
        hits = [i for i, row in enumerate(table.rows) if row.matches(facts)]
        shown = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in facts.items()) or "always"
        if not hits:
            raise SpecError(f"{src}: {where} gives nothing when {shown}")
        if len(hits) > 1:
            raise SpecError(f"{src}: {where} gives twice when {shown}: rows[{hits[0]}] and rows[{hits[1]}]")
        used.add(hits[0])
        table.index[values] = table.rows[hits[0]].gives
    unused = sorted(set(range(len(table.rows))) - used)
    if unused:
        raise SpecError(f"{src}: {where}.rows{unused} never give anything")
    object.__setattr__(table, "reads", reads)


def check_outcomes(spec: Spec, name: str, known: Iterable[str]) -> OutcomeTable:
    """The outcome table `name` of `spec`, checked against the values the code can act on:
    a spec that lacks it, or gives a value the code does not know, is refused."""
    table = spec.outcomes.get(name)
    if table is None:
        raise SpecError(f"{spec.source}: has no [outcomes.{name}], which the code reads")
    strange = sorted(set(table.values) - set(known))
    if strange:
        raise SpecError(f"{spec.source}: outcomes.{name} may give {strange}, which the code does not know")
    return table


def _validate_decisions(spec: Spec, table: DecisionTable) -> None:
    """Every failure class, under every combination of the situations, decided exactly once;
    every row reachable; names declared; each trigger one the deciding state accepts."""
    src = spec.source
    if table.state not in spec.states:
        raise SpecError(f"{src}: decide names undeclared state {table.state!r}")
    accepted = {t.trigger for t in spec.transitions if table.state in t.sources}
    for i, row in enumerate(table.rows):
        where = f"decisions[{i}]"
        for failure in row.failures:
            if failure not in FAILURE_CLASSES:
                raise SpecError(f"{src}: {where} names unknown failure class {failure!r}")
        for name, _ in row.when + row.unless:
            if name not in table.situations:
                raise SpecError(f"{src}: {where} uses undeclared situation {name!r}")
        if row.then not in accepted:
            raise SpecError(f"{src}: {where} fires {row.then!r}, which state {table.state!r} does not accept")
        if row.wait is not None and row.wait not in table.waits:
            raise SpecError(f"{src}: {where} uses undeclared wait {row.wait!r}")
        for action in row.actions:
            if action not in table.actions:
                raise SpecError(f"{src}: {where} uses undeclared action {action!r}")
    used = set()
    for failure in FAILURE_CLASSES:
        rows = [(i, r) for i, r in enumerate(table.rows) if failure in r.failures]
        read = tuple(sorted({name for _, r in rows for name, _ in r.when + r.unless}))
        decided: dict[tuple[bool, ...], Decision] = {}
        for values in itertools.product((False, True), repeat=len(read)):
            facts = dict(zip(read, values, strict=True))
            hits = [(i, r) for i, r in rows if r.matches(facts)]
            shown = ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in facts.items()) or "always"
            if not hits:
                raise SpecError(f"{src}: failure '{failure}' is undecided when {shown}")
            if len(hits) > 1:
                raise SpecError(f"{src}: failure '{failure}' is decided twice when {shown}: "
                                f"decisions[{hits[0][0]}] and decisions[{hits[1][0]}]")
            used.add(hits[0][0])
            decided[values] = hits[0][1]
        table.index[failure] = (read, decided)
    unused = sorted(set(range(len(table.rows))) - used)
    if unused:
        raise SpecError(f"{src}: decisions{unused} never decide anything")


def _validate_entry_actions(spec: Spec) -> None:
    """Every entry action a state names is declared in [entry_actions], and every declared one is
    taken by some state."""
    used = set()
    for state in spec.states.values():
        for action in state.enter:
            if action not in spec.entry_actions:
                raise SpecError(f"{spec.source}: state {state.name!r} enters with undeclared action {action!r}")
            used.add(action)
    unused = sorted(set(spec.entry_actions) - used)
    if unused:
        raise SpecError(f"{spec.source}: entry actions {unused} are declared but no state takes them")


def bind_entry_actions(spec: Spec, registry: dict[str, Any], *, required: Iterable[str] = ()) -> dict[str, tuple[Any, ...]]:
    """Each state's entry actions as the functions of `registry` (action name -> function of the
    model), checked once per spec: the registry performs exactly the actions the spec declares,
    and each state in `required` (those whose meaning is an action: a deadline to set, a next
    step to take) takes at least one. A mutated spec installed in place of a shipped one is
    checked the first time a model binds it."""
    try:
        return spec.derived[id(registry)]  # type: ignore[no-any-return]
    except KeyError:
        pass
    if set(registry) != set(spec.entry_actions):
        raise SpecError(f"{spec.source}: its [entry_actions] must be exactly what the code performs: "
                        f"missing {sorted(set(registry) - set(spec.entry_actions))}, "
                        f"not performed {sorted(set(spec.entry_actions) - set(registry))}")
    for name in required:
        if name in spec.states and not spec.states[name].enter:
            raise SpecError(f"{spec.source}: state {name!r} needs an entry action and names none")
    bound = {name: tuple(registry[a] for a in state.enter) for name, state in spec.states.items()}
    spec.derived[id(registry)] = bound
    return bound


def _successors(spec: Spec, exclude: Iterable[str] = ()) -> dict[str, set[str]]:
    excluded = set(exclude)
    succ: dict[str, set[str]] = {s: set() for s in spec.states}
    for t in spec.transitions:
        if t.trigger in excluded or f"{t.trigger}->{t.dest}" in excluded:
            continue
        for s in t.sources:
            succ[s].add(t.dest)
    return succ


def _reachable(succ: dict[str, set[str]], starts: Iterable[str]) -> set[str]:
    seen = set(starts)
    queue = deque(seen)
    while queue:
        for nxt in succ[queue.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _exclusive(a: TransitionSpec, b: TransitionSpec) -> bool:
    """Two transitions on the same trigger and source are distinguishable only when some guard
    one requires is one the other forbids: then at most one of them can ever fire."""
    return bool(set(a.guards) & set(b.unless) or set(a.unless) & set(b.guards))


def validate(spec: Spec) -> None:
    src = spec.source
    if not spec.states:
        raise SpecError(f"{src}: declares no states")
    if spec.initial not in spec.states:
        raise SpecError(f"{src}: initial state {spec.initial!r} is not declared")
    for i, t in enumerate(spec.transitions):
        for s in t.sources:
            if s not in spec.states:
                raise SpecError(f"{src}: transition {t.trigger!r} (transitions[{i}]) leaves undeclared state {s!r}")
            if "terminal" in spec.states[s].tags:
                raise SpecError(f"{src}: transition {t.trigger!r} (transitions[{i}]) leaves terminal state {s!r}")
        if t.dest not in spec.states:
            raise SpecError(f"{src}: transition {t.trigger!r} (transitions[{i}]) goes to undeclared state {t.dest!r}")
        for g in t.guards + t.unless:
            if g not in spec.guards:
                raise SpecError(f"{src}: transition {t.trigger!r} (transitions[{i}]) uses undeclared guard {g!r}")
    by_key: dict[tuple[str, str], list[TransitionSpec]] = {}
    for t in spec.transitions:
        for s in t.sources:
            by_key.setdefault((s, t.trigger), []).append(t)
    for (s, trig), group in by_key.items():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if not _exclusive(a, b):
                    raise SpecError(
                        f"{src}: ambiguous trigger {trig!r} from state {s!r}: transitions to "
                        f"{a.dest!r} and {b.dest!r} have no distinguishing guards"
                    )
    succ = _successors(spec)
    reachable = _reachable(succ, [spec.initial])
    unreachable = sorted(set(spec.states) - reachable)
    if unreachable:
        raise SpecError(f"{src}: unreachable states {unreachable}")
    terminal = spec.terminal
    if spec.recurrent:
        # a lifecycle without an end (a breaker) must at least never get stuck
        for s in spec.states:
            if spec.initial not in _reachable(succ, [s]):
                raise SpecError(f"{src}: state {s!r} cannot return to the initial state")
    elif not terminal:
        raise SpecError(f"{src}: no state is tagged terminal")
    for s in spec.states:
        if s not in terminal and not spec.recurrent and not (_reachable(succ, [s]) & terminal):
            raise SpecError(f"{src}: state {s!r} cannot reach a terminal state")
    for inv in spec.invariants:
        if inv.kind != "no_path":
            raise SpecError(f"{src}: unknown invariant kind {inv.kind!r}")
        named = {t.trigger for t in spec.transitions} | {f"{t.trigger}->{t.dest}" for t in spec.transitions}
        unknown_via = set(inv.via) - named
        if unknown_via:
            raise SpecError(f"{src}: invariant names unknown recovery triggers {sorted(unknown_via)}")
        without_recovery = _successors(spec, exclude=inv.via)
        targets = spec.tagged(inv.to_tag)
        for s in sorted(spec.tagged(inv.from_tag)):
            # a path of at least one step: s itself may carry both tags only if it is not re-entered
            bad = _reachable(without_recovery, without_recovery[s]) & targets
            if bad:
                raise SpecError(
                    f"{src}: invariant violated: {inv.from_tag} state {s!r} reaches "
                    f"{inv.to_tag} state {sorted(bad)[0]!r} without a recovery transition "
                    f"({', '.join(inv.via) or 'none named'})"
                )


def _check_vocabulary(spec: Spec) -> None:
    """A shipped lifecycle's states and triggers are exactly its enums in vocab.py: the code
    that branches on them and the spec that declares them cannot drift apart."""
    if spec.name not in SPEC_VOCABULARY:
        return
    for enum, declared in zip(SPEC_VOCABULARY[spec.name], (set(spec.states), set(spec.triggers)), strict=True):
        known = {member.value for member in enum}
        if declared != known:
            raise SpecError(f"{spec.source}: differs from vocab.{enum.__name__}: missing "
                            f"{sorted(known - declared)}, not in the vocabulary {sorted(declared - known)}")


def load_spec(name: str) -> Spec:
    """Load a spec shipped with relayline (`relayline.specs`), validated."""
    try:
        return _CACHE[name]
    except KeyError:
        pass
    path = resources.files("relayline.specs").joinpath(f"{name}.toml")
    spec = parse_spec(path.read_text(encoding="utf-8"), f"specs/{name}.toml")
    _CACHE[name] = spec
    return spec


_CACHE: dict[str, Spec] = {}


# ---------------------------------------------------------------------------------------------
# running


def _guard(model: Any, name: str) -> bool:
    value = getattr(model, name)
    return bool(value() if callable(value) else value)


def _passes(guards: tuple[str, ...], unless: tuple[str, ...], model: Any) -> bool:
    # `_guard`, inline: a guarded fire reads one or two guards (every turn's end reads one)
    for g in guards:
        value = getattr(model, g)
        if not (value() if callable(value) else value):
            return False
    for g in unless:
        value = getattr(model, g)
        if value() if callable(value) else value:
            return False
    return True


class Lifecycle:
    """The compiled form of a spec, for one model: a state, a table lookup per trigger.

    `fire` takes the one transition whose guards hold and returns True; it raises
    IllegalTransition, leaving the state unchanged, for a trigger the spec does not accept in the
    current state or when guards block every candidate. Either is a bug in the caller (it asked
    for something the lifecycle forbids), never a provider's fault: the caller branches on the
    state `fire` reached, so a guard can never be silently ignored.
    """

    __slots__ = ("spec", "state", "history", "history_limit")

    def __init__(self, spec: Spec, history_limit: int = 256) -> None:
        self.spec = spec
        self.state = spec.initial
        # a list, not a bounded deque: a deque's first block is 64 slots, and a streamed turn has
        # six lifecycles (bench/frames.py, memory per stream); `record` keeps it bounded
        self.history: list[str] = [spec.initial]
        self.history_limit = history_limit

    def record(self, state: str) -> None:
        """`state` was entered; the history keeps the last `history_limit` states (a breaker
        lives as long as the process; a turn's machines stay far below the bound)."""
        history = self.history
        history.append(state)
        if len(history) > self.history_limit:
            del history[0]

    def fire(self, trigger: str, model: Any = None) -> bool:
        candidates = self.spec.moves[self.state].get(trigger)
        if candidates is None:
            raise IllegalTransition(
                f"{self.spec.name}: trigger {trigger!r} is not declared from state {self.state!r}"
            )
        for dest, guards, unless, fired, i in candidates:
            if (guards or unless) and not _passes(guards, unless, model):
                continue
            self.state = dest
            history = self.history  # (`record`, inline: a turn fires six times)
            history.append(dest)
            if len(history) > self.history_limit:
                del history[0]
            fired[i] += 1
            return True
        raise IllegalTransition(
            f"{self.spec.name}: no transition on {trigger!r} from state {self.state!r} is enabled "
            "(every candidate's guards are blocked)"
        )

    def step(self, trigger: str, model: Any, bound: dict[str, tuple[Any, ...]]) -> Any:
        """Fire `trigger` and, when it changed the state, run the entry actions of the state it
        entered (`bound`, from `bind_entry_actions`), returning what the last one returned. A
        self-transition is an entry only when the spec marks it `reenter` (a key pool's next key
        is a new call): a late result that leaves an open breaker open does not open it again."""
        before = self.state
        self.fire(trigger, model)
        dest = self.state
        result = None
        if dest != before or (before, trigger) in self.spec.reentering:
            for action in bound[dest]:
                result = action(model)
        return result

    def decision(self, failure: str, model: Any) -> Decision:
        """The row of the spec's decision table for `failure` in the situations that `model`
        reports (guards by name): the trigger to fire, and the wait and actions it names."""
        table = self.spec.decisions
        if table is None or self.state != table.state:
            raise IllegalTransition(f"{self.spec.name}: no decision is taken in state {self.state!r}")
        return table.decide(failure, model)

    @property
    def terminal(self) -> bool:
        return self.state in self.spec.terminal


def machine_kwargs(spec: Spec) -> dict[str, Any]:
    """The arguments that build a transitions machine equivalent to `spec`."""
    return dict(
        states=list(spec.states),
        initial=spec.initial,
        transitions=[
            {
                "trigger": t.trigger,
                "source": list(t.sources),
                "dest": t.dest,
                "conditions": list(t.guards),
                "unless": list(t.unless),
            }
            for t in spec.transitions
        ],
        auto_transitions=False,
        send_event=False,
        ignore_invalid_triggers=False,
    )


def build_machine(spec: Spec, model: Any) -> Any:
    """The executable reference: a transitions.Machine on `model` (tests, audits)."""
    from transitions import Machine

    return Machine(model=model, **machine_kwargs(spec))
