"""Decision and outcome tables: a lifecycle's policies as data (specs/*.toml), read and checked.

A decision table says which trigger a failure fires from one state, by failure class and
situation (the walk's failure policy); an outcome table gives a value instead (why a walk ran
out of entries, whether a failed stream is billed). Both are checked complete and unambiguous
when their spec loads: under every combination of the situations a row reads, exactly one row
applies, so no row's position matters. The situations are guards of the model, by name.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from .errors import SpecError
from .vocab import FailureClass

FAILURE_CLASSES = tuple(FailureClass)
# a row's situations and the value each must have, in the order the spec gives them
Situations = tuple[tuple[str, bool], ...]


def guard(model: Any, name: str) -> bool:
    """A guard or a situation, by name: an attribute or a zero-argument method of the model."""
    value = getattr(model, name)
    return bool(value() if callable(value) else value)


def _row_matches(when: Situations, unless: Situations, facts: dict[str, bool]) -> bool:
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
    when: Situations = ()
    unless: Situations = ()
    wait: str | None = None
    actions: tuple[str, ...] = ()
    doc: str = ""

    def matches(self, facts: dict[str, bool]) -> bool:
        return _row_matches(self.when, self.unless, facts)


# failure class -> (the situations its rows read, their values -> the deciding row)
DecisionIndex = dict[str, tuple[tuple[str, ...], dict[tuple[bool, ...], Decision]]]


@attrs.frozen
class DecisionTable:
    """A lifecycle's policy as data: which trigger a failure fires from `state`, by failure
    class and situation. Validated complete and unambiguous: every class, under every
    combination of the situations, is decided by exactly one row, so no row's position
    matters."""

    state: str
    situations: dict[str, str]
    waits: dict[str, str]
    actions: dict[str, str]
    rows: tuple[Decision, ...]
    index: DecisionIndex = attrs.field(factory=dict, eq=False)

    def decide(self, failure: str, model: Any) -> Decision:
        names, rows = self.index[failure]
        return rows[tuple(guard(model, name) for name in names)]


@attrs.frozen
class OutcomeRow:
    """One row of an outcome table: when every `when` situation has its value and not every
    `unless` one has, the table gives `gives`."""

    gives: str
    when: Situations = ()
    unless: Situations = ()
    doc: str = ""

    def matches(self, facts: dict[str, bool]) -> bool:
        return _row_matches(self.when, self.unless, facts)


@attrs.frozen
class OutcomeTable:
    """A policy that gives a value instead of firing a trigger (why a walk ran out of entries,
    whether a failed stream is billed): the situations it reads are guards of the model, by
    name; validated complete and unambiguous like a decision table, so no row's position
    matters. The code that reads it checks at load that every value it can give is one it
    knows."""

    name: str
    values: tuple[str, ...]
    rows: tuple[OutcomeRow, ...]
    doc: str = ""
    reads: tuple[str, ...] = ()  # the situations the rows read, in a fixed order
    # the situations' values -> the value given
    index: dict[tuple[bool, ...], str] = attrs.field(factory=dict, eq=False)

    def decide(self, model: Any) -> str:
        return self.index[tuple(guard(model, name) for name in self.reads)]


# ---------------------------------------------------------------------------------------------
# reading


def as_names(value: object, where: str, source: str) -> tuple[str, ...]:
    """A spec value that names one thing or several: a string, or a list of strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SpecError(f"{source}: {where} must be a string or a list of strings")


def _situations(value: object, where: str, source: str) -> Situations:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(v, bool) for v in value.values()):
        raise SpecError(f"{source}: {where} must be a table of situation = true/false")
    return tuple((str(k), v) for k, v in value.items())


def _refuse_unknown(body: dict[str, Any], allowed: set[str], where: str, source: str) -> None:
    unknown = set(body) - allowed
    if unknown:
        raise SpecError(f"{source}: {where} has unknown keys {sorted(unknown)}")


def parse_decisions(raw: dict[str, Any], source: str) -> DecisionTable:
    """A spec's decision table: its `decide` state, the situations, waits and actions it
    declares, and its [[decisions]] rows."""
    docs = {key: {str(k): str(v) for k, v in raw.get(key, {}).items()}
            for key in ("situations", "waits", "actions")}
    rows = []
    for i, body in enumerate(raw["decisions"]):
        where = f"decisions[{i}]"
        _refuse_unknown(body, {"failure", "when", "unless", "then", "wait", "actions", "doc"},
                        where, source)
        for key in ("failure", "then"):
            if key not in body:
                raise SpecError(f"{source}: {where} is missing {key!r}")
        wait = body.get("wait")
        rows.append(Decision(
            failures=as_names(body["failure"], f"{where}.failure", source),
            then=str(body["then"]),
            when=_situations(body.get("when"), f"{where}.when", source),
            unless=_situations(body.get("unless"), f"{where}.unless", source),
            wait=None if wait is None else str(wait),
            actions=as_names(body.get("actions"), f"{where}.actions", source),
            doc=str(body.get("doc", "")),
        ))
    return DecisionTable(state=str(raw.get("decide", "")), situations=docs["situations"],
                         waits=docs["waits"], actions=docs["actions"], rows=tuple(rows))


def parse_outcomes(name: str, body: dict[str, Any], source: str) -> OutcomeTable:
    """A spec's [outcomes.NAME] table: its values and its rows."""
    where = f"outcomes.{name}"
    _refuse_unknown(body, {"doc", "values", "rows"}, where, source)
    rows = []
    for i, row in enumerate(body.get("rows", [])):
        at = f"{where}.rows[{i}]"
        _refuse_unknown(row, {"when", "unless", "gives", "doc"}, at, source)
        if "gives" not in row:
            raise SpecError(f"{source}: {at} is missing 'gives'")
        rows.append(OutcomeRow(gives=str(row["gives"]),
                               when=_situations(row.get("when"), f"{at}.when", source),
                               unless=_situations(row.get("unless"), f"{at}.unless", source),
                               doc=str(row.get("doc", ""))))
    return OutcomeTable(name=name, values=as_names(body.get("values"), f"{where}.values", source),
                        rows=tuple(rows), doc=str(body.get("doc", "")))


# ---------------------------------------------------------------------------------------------
# checking: complete, unambiguous, every row reachable


def _shown(facts: dict[str, bool]) -> str:
    return ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in facts.items()) or "always"


def validate_outcomes(table: OutcomeTable, source: str, declared: set[str]) -> None:
    """Under every combination of the situations its rows read, exactly one row gives a value;
    every row gives one of the declared values and is reachable; every situation is one of
    `declared` (the spec's guards and situations)."""
    src, where = source, f"outcomes.{table.name}"
    for i, row in enumerate(table.rows):
        if row.gives not in table.values:
            raise SpecError(f"{src}: {where}.rows[{i}] gives {row.gives!r}, "
                            f"not one of its values {list(table.values)}")
        for name, _ in row.when + row.unless:
            if name not in declared:
                raise SpecError(f"{src}: {where}.rows[{i}] reads undeclared situation {name!r}")
    reads = tuple(sorted({name for row in table.rows for name, _ in row.when + row.unless}))
    used = set()
    for values in itertools.product((False, True), repeat=len(reads)):
        facts = dict(zip(reads, values, strict=True))
        hits = [i for i, row in enumerate(table.rows) if row.matches(facts)]
        if not hits:
            raise SpecError(f"{src}: {where} gives nothing when {_shown(facts)}")
        if len(hits) > 1:
            raise SpecError(f"{src}: {where} gives twice when {_shown(facts)}: "
                            f"rows[{hits[0]}] and rows[{hits[1]}]")
        used.add(hits[0])
        table.index[values] = table.rows[hits[0]].gives
    unused = sorted(set(range(len(table.rows))) - used)
    if unused:
        raise SpecError(f"{src}: {where}.rows{unused} never give anything")
    object.__setattr__(table, "reads", reads)


def _validate_names(table: DecisionTable, source: str, accepted: set[str]) -> None:
    """Every name a row uses is declared, and each trigger is one the deciding state accepts."""
    for i, row in enumerate(table.rows):
        where = f"{source}: decisions[{i}]"
        for failure in row.failures:
            if failure not in FAILURE_CLASSES:
                raise SpecError(f"{where} names unknown failure class {failure!r}")
        for name, _ in row.when + row.unless:
            if name not in table.situations:
                raise SpecError(f"{where} uses undeclared situation {name!r}")
        if row.then not in accepted:
            raise SpecError(f"{where} fires {row.then!r}, "
                            f"which state {table.state!r} does not accept")
        if row.wait is not None and row.wait not in table.waits:
            raise SpecError(f"{where} uses undeclared wait {row.wait!r}")
        for action in row.actions:
            if action not in table.actions:
                raise SpecError(f"{where} uses undeclared action {action!r}")


def validate_decisions(table: DecisionTable, source: str, accepted: set[str]) -> None:
    """Every failure class, under every combination of the situations, decided exactly once;
    every row reachable; names declared; each trigger one of `accepted`, those the deciding
    state accepts."""
    src = source
    _validate_names(table, source, accepted)
    used = set()
    for failure in FAILURE_CLASSES:
        rows = [(i, r) for i, r in enumerate(table.rows) if failure in r.failures]
        read = tuple(sorted({name for _, r in rows for name, _ in r.when + r.unless}))
        decided: dict[tuple[bool, ...], Decision] = {}
        for values in itertools.product((False, True), repeat=len(read)):
            facts = dict(zip(read, values, strict=True))
            hits = [(i, r) for i, r in rows if r.matches(facts)]
            if not hits:
                raise SpecError(f"{src}: failure '{failure}' is undecided when {_shown(facts)}")
            if len(hits) > 1:
                raise SpecError(f"{src}: failure '{failure}' is decided twice when "
                                f"{_shown(facts)}: decisions[{hits[0][0]}] and "
                                f"decisions[{hits[1][0]}]")
            used.add(hits[0][0])
            decided[values] = hits[0][1]
        table.index[failure] = (read, decided)
    unused = sorted(set(range(len(table.rows))) - used)
    if unused:
        raise SpecError(f"{src}: decisions{unused} never decide anything")


# ---------------------------------------------------------------------------------------------
# precedence: an ordered table of named sources, the first that gives a value wins


@attrs.frozen
class Source:
    """One source of a precedence table; `always`: it always gives a value (the default), so
    nothing after it is ever asked."""

    name: str
    doc: str = ""
    always: bool = False


@attrs.frozen
class Precedence:
    """A choice made by asking named sources in order: the first that gives a value decides.
    Checked at load: names unique, exactly one source always gives a value, and it is the last
    (a source after it could never be asked)."""

    name: str
    sources: tuple[Source, ...]
    doc: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(source.name for source in self.sources)


def parse_precedence(name: str, body: dict[str, Any], source: str) -> Precedence:
    """A spec's [precedence.NAME] table: its doc and its [[precedence.NAME.sources]], in order."""
    where = f"precedence.{name}"
    _refuse_unknown(body, {"doc", "sources"}, where, source)
    sources = []
    for i, row in enumerate(body.get("sources", [])):
        at = f"{where}.sources[{i}]"
        _refuse_unknown(row, {"name", "doc", "always"}, at, source)
        if not isinstance(row.get("name"), str):
            raise SpecError(f"{source}: {at} must have a name")
        if not isinstance(row.get("always", False), bool):
            raise SpecError(f"{source}: {at}.always must be true or false")
        sources.append(Source(row["name"], str(row.get("doc", "")), row.get("always", False)))
    return Precedence(name, tuple(sources), str(body.get("doc", "")))


def validate_precedence(table: Precedence, source: str) -> None:
    """Each source named once; the last, and only it, always gives a value: before it every
    source may pass, after it none would ever be asked."""
    where = f"{source}: precedence.{table.name}"
    seen: set[str] = set()
    for i, item in enumerate(table.sources):
        if item.name in seen:
            raise SpecError(f"{where}.sources[{i}] names {item.name!r} a second time")
        seen.add(item.name)
    always = [i for i, item in enumerate(table.sources) if item.always]
    if not always:
        raise SpecError(f"{where} has no source that always gives a value: a choice could be "
                        "left unmade")
    if always[0] != len(table.sources) - 1:
        unreachable = [item.name for item in table.sources[always[0] + 1:]]
        raise SpecError(f"{where}: sources {unreachable} come after "
                        f"{table.sources[always[0]].name!r}, which always gives a value, and "
                        "are never asked")
