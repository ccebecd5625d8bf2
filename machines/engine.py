"""Lifecycles declared as data: load a spec and prove its invariants.

A spec (specs/*.toml) is the single source of truth for a lifecycle: its states and their tags,
its transitions with guard names, its entry actions, its decision and outcome tables
(tables.py), and the invariants that must hold on its graph. This module parses and validates
a spec, checking every invariant statically on the graph, so a broken lifecycle fails at import
time with an error naming the spec file and the offending element, and compiles it into the
tables a `Lifecycle` (lifecycle.py) runs on.

The names a lifecycle's users import come from here too: a spec is loaded (`load_spec`), bound
(`bind_entry_actions`) and run (`Lifecycle`) through one module.
"""

from __future__ import annotations

import tomllib
from collections import deque
from collections.abc import Iterable
from importlib import resources
from typing import Any

from .errors import SpecError
from .lifecycle import (
    Invariant,
    Lifecycle,
    Spec,
    StateSpec,
    TransitionSpec,
    bind_entry_actions,
    build_machine,
    check_outcomes,
    check_precedence,
    machine_kwargs,
)
from .tables import (
    DecisionTable,
    as_names,
    parse_decisions,
    parse_outcomes,
    parse_precedence,
    validate_decisions,
    validate_outcomes,
    validate_precedence,
)
from .vocab import SPEC_VOCABULARY

__all__ = ["SPEC_NAMES", "Lifecycle", "Spec", "bind_entry_actions", "build_machine",
           "build_spec", "check_outcomes", "check_precedence", "load_spec", "machine_kwargs",
           "parse_spec", "validate"]

SPEC_NAMES = ("turn", "stream", "cancellation", "breaker", "walk", "budget", "admission")
TOP_LEVEL_KEYS = frozenset({
    "name", "doc", "initial", "recurrent", "states", "transitions", "guards", "invariants",
    "decide", "situations", "waits", "actions", "decisions", "entry_actions", "outcomes",
    "precedence"})


# ---------------------------------------------------------------------------------------------
# loading and validation

def parse_spec(text: str, source: str) -> Spec:
    """Parse and validate a spec; raise SpecError naming `source` and the problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    return build_spec(raw, source)


def _states(raw: dict[str, Any], source: str) -> dict[str, StateSpec]:
    states = {}
    for name, body in raw["states"].items():
        body = body or {}
        states[name] = StateSpec(
            name=name,
            tags=frozenset(as_names(body.get("tags"), f"states.{name}.tags", source)),
            doc=str(body.get("doc", "")),
            enter=as_names(body.get("enter"), f"states.{name}.enter", source),
        )
    return states


def _transitions(raw: dict[str, Any], states: dict[str, StateSpec],
                 source: str) -> tuple[TransitionSpec, ...]:
    transitions = []
    for i, body in enumerate(raw["transitions"]):
        where = f"transitions[{i}]"
        for key in ("trigger", "source", "dest"):
            if key not in body:
                raise SpecError(f"{source}: {where} is missing {key!r}")
        sources = as_names(body["source"], f"{where}.source", source)
        if sources == ("*",):
            sources = tuple(s for s, st in states.items() if "terminal" not in st.tags)
        transitions.append(
            TransitionSpec(
                trigger=body["trigger"],
                sources=sources,
                dest=body["dest"],
                guards=as_names(body.get("guards"), f"{where}.guards", source),
                unless=as_names(body.get("unless"), f"{where}.unless", source),
                doc=str(body.get("doc", "")),
                reenter=bool(body.get("reenter", False)),
            )
        )
    return tuple(transitions)


def _invariants(raw: dict[str, Any], source: str) -> tuple[Invariant, ...]:
    return tuple(
        Invariant(
            kind=body.get("kind", ""),
            from_tag=body.get("from_tag", ""),
            to_tag=body.get("to_tag", ""),
            via=as_names(body.get("via"), f"invariants[{i}].via", source),
            doc=str(body.get("doc", "")),
        )
        for i, body in enumerate(raw.get("invariants", []))
    )


def build_spec(raw: dict[str, Any], source: str) -> Spec:
    """Validate and compile a spec already read from TOML (tests mutate such documents)."""
    unknown = set(raw) - TOP_LEVEL_KEYS
    if unknown:
        raise SpecError(f"{source}: unknown top-level keys {sorted(unknown)}")
    for key in ("name", "initial", "states", "transitions"):
        if key not in raw:
            raise SpecError(f"{source}: missing required key {key!r}")
    states = _states(raw, source)
    outcomes = raw.get("outcomes", {})
    spec = Spec(
        name=raw["name"],
        source=source,
        initial=raw["initial"],
        states=states,
        transitions=_transitions(raw, states, source),
        guards={str(k): str(v) for k, v in raw.get("guards", {}).items()},
        invariants=_invariants(raw, source),
        doc=str(raw.get("doc", "")),
        recurrent=bool(raw.get("recurrent", False)),
        decisions=parse_decisions(raw, source) if "decisions" in raw else None,
        entry_actions={str(k): str(v) for k, v in raw.get("entry_actions", {}).items()},
        outcomes={str(name): parse_outcomes(str(name), body, source)
                  for name, body in outcomes.items()},
        precedence={str(name): parse_precedence(str(name), body, source)
                    for name, body in raw.get("precedence", {}).items()},
    )
    validate(spec)
    declared = set(spec.guards) | (set(spec.decisions.situations) if spec.decisions else set())
    for outcome in spec.outcomes.values():
        validate_outcomes(outcome, source, declared)
    for precedence in spec.precedence.values():
        validate_precedence(precedence, source)
    _validate_entry_actions(spec)
    _check_vocabulary(spec)
    if spec.decisions is not None:
        _validate_decisions(spec, spec.decisions)
    _compile(spec)
    return spec


def _validate_decisions(spec: Spec, table: DecisionTable) -> None:
    if table.state not in spec.states:
        raise SpecError(f"{spec.source}: decide names undeclared state {table.state!r}")
    accepted = {t.trigger for t in spec.transitions if table.state in t.sources}
    validate_decisions(table, spec.source, accepted)


def _compile(spec: Spec) -> None:
    """The tables `Lifecycle` reads: (state, trigger) -> candidates, their counters, and the
    same again by state then trigger."""
    table: dict[tuple[str, str], tuple[TransitionSpec, ...]] = {}
    for t in spec.transitions:
        for s in t.sources:
            table[(s, t.trigger)] = table.get((s, t.trigger), ()) + (t,)
    spec.table.update(table)
    spec.fired.update((key, [0] * len(candidates)) for key, candidates in table.items())
    spec.moves.update((name, {}) for name in spec.states)
    for (state, trigger), candidates in table.items():
        counts = spec.fired[(state, trigger)]
        spec.moves[state][trigger] = tuple((t.dest, t.guards, t.unless, counts, i)
                                           for i, t in enumerate(candidates))


def _validate_entry_actions(spec: Spec) -> None:
    """Every entry action a state names is declared in [entry_actions], and every declared one is
    taken by some state."""
    used = set()
    for state in spec.states.values():
        for action in state.enter:
            if action not in spec.entry_actions:
                raise SpecError(f"{spec.source}: state {state.name!r} enters with undeclared "
                                f"action {action!r}")
            used.add(action)
    unused = sorted(set(spec.entry_actions) - used)
    if unused:
        raise SpecError(f"{spec.source}: entry actions {unused} are declared but no state "
                        "takes them")



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
        where = f"{src}: transition {t.trigger!r} (transitions[{i}])"
        for s in t.sources:
            if s not in spec.states:
                raise SpecError(f"{where} leaves undeclared state {s!r}")
            if "terminal" in spec.states[s].tags:
                raise SpecError(f"{where} leaves terminal state {s!r}")
        if t.dest not in spec.states:
            raise SpecError(f"{where} goes to undeclared state {t.dest!r}")
        for g in t.guards + t.unless:
            if g not in spec.guards:
                raise SpecError(f"{where} uses undeclared guard {g!r}")
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
        named = ({t.trigger for t in spec.transitions}
                 | {f"{t.trigger}->{t.dest}" for t in spec.transitions})
        unknown_via = set(inv.via) - named
        if unknown_via:
            raise SpecError(f"{src}: invariant names unknown recovery triggers "
                            f"{sorted(unknown_via)}")
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
    names = (set(spec.states), set(spec.triggers))
    for enum, declared in zip(SPEC_VOCABULARY[spec.name], names, strict=True):
        known = {member.value for member in enum}
        if declared != known:
            raise SpecError(f"{spec.source}: differs from vocab.{enum.__name__}: missing "
                            f"{sorted(known - declared)}, not in the vocabulary "
                            f"{sorted(declared - known)}")


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
