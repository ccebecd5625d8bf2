"""A lifecycle as it runs: the compiled spec (states, transitions, tables) and `Lifecycle`,
one model's state in it.

`Lifecycle` reads a plain table compiled from the spec: the `transitions` library's machine
(`build_machine`) is the executable reference, also used for diagrams, and
tests/core/test_engine.py proves both take the same state sequences on generated event
sequences, so the table is the spec, only faster (docs/performance.md has the figures).

Guards are names. At run time a guard is looked up on the model object (an attribute or a
zero-argument method), in both the table and the transitions machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .errors import IllegalTransition, SpecError
from .tables import Decision, DecisionTable, OutcomeTable, Precedence

# one candidate of a (state, trigger): its destination, guards, unless-guards, the `fired` list
# of its counters and its index there
Move = tuple[str, tuple[str, ...], tuple[str, ...], list[int], int]


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
    precedence: dict[str, Precedence] = attrs.Factory(dict)  # name -> its precedence table
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
    moves: dict[str, dict[str, tuple[Move, ...]]] = attrs.field(factory=dict, eq=False, repr=False)
    # the states tagged terminal, once: every turn's end asks whether its machines reached one
    terminal: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    # (state, trigger) of the self-transitions marked reenter: `Lifecycle.step` runs their entry
    # actions
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


def check_outcomes(spec: Spec, name: str, known: Iterable[str]) -> OutcomeTable:
    """The outcome table `name` of `spec`, checked against the values the code can act on:
    a spec that lacks it, or gives a value the code does not know, is refused."""
    table = spec.outcomes.get(name)
    if table is None:
        raise SpecError(f"{spec.source}: has no [outcomes.{name}], which the code reads")
    strange = sorted(set(table.values) - set(known))
    if strange:
        raise SpecError(f"{spec.source}: outcomes.{name} may give {strange}, which the code does "
                        "not know")
    return table


def check_precedence(spec: Spec, name: str, known: Mapping[str, bool]) -> Precedence:
    """The precedence table `name` of `spec`, checked against the sources the code can ask
    (`known`: name -> whether it always gives a value): a spec that lacks it, names a source the
    code does not have or leaves one out, or says a source always gives a value when the code's
    may not (or the reverse), is refused."""
    table = spec.precedence.get(name)
    if table is None:
        raise SpecError(f"{spec.source}: has no [precedence.{name}], which the code reads")
    unknown = sorted(set(table.names) - set(known))
    missing = sorted(set(known) - set(table.names))
    if unknown or missing:
        raise SpecError(f"{spec.source}: precedence.{name} must name exactly the sources the code "
                        f"asks: unknown {unknown}, missing {missing}")
    for source in table.sources:
        if source.always != known[source.name]:
            says = "always gives" if source.always else "may not give"
            raise SpecError(f"{spec.source}: precedence.{name} says {source.name!r} {says} a "
                            "value, and the code's does not")
    return table



def bind_entry_actions(spec: Spec, registry: dict[str, Any], *,
                       required: Iterable[str] = ()) -> dict[str, tuple[Any, ...]]:
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
        raise SpecError(f"{spec.source}: its [entry_actions] must be exactly what the code "
                        "performs: "
                        f"missing {sorted(set(registry) - set(spec.entry_actions))}, "
                        f"not performed {sorted(set(spec.entry_actions) - set(registry))}")
    for name in required:
        if name in spec.states and not spec.states[name].enter:
            raise SpecError(f"{spec.source}: state {name!r} needs an entry action and names none")
    bound = {name: tuple(registry[a] for a in state.enter) for name, state in spec.states.items()}
    spec.derived[id(registry)] = bound
    return bound



def _passes(guards: tuple[str, ...], unless: tuple[str, ...], model: Any) -> bool:
    # `tables.guard`, inline: a guarded fire reads one or two guards (every turn's end reads one)
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
            raise IllegalTransition(f"{self.spec.name}: no decision is taken in state "
                                    f"{self.state!r}")
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
