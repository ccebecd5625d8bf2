"""Single-transition mutations of the shipped specs, and the checks that must catch each one.

A mutation changes one transition of one spec (deletes it, redirects its destination to another
state, or swaps its `guards` and `unless`). It is caught when the spec validator rejects it, or
when, installed in place of the real spec, some scenario (the shared conformance set and the
project's own, in process on virtual time) or some direct check of the machines fails or
crashes. A mutation nothing catches is a transition whose diagram is not what runs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import signal
import sys
import tomllib
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import trio
from trio._core._run import GLOBAL_RUN_CONTEXT

from relayline.adapters.sim.simulate import check_scenario, load_scenario
from relayline.machines import engine
from relayline.machines.errors import SpecError

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = (sorted((ROOT / "tests" / "scenarios").glob("*.toml"))
             + sorted((ROOT.parent / "shared" / "conformance").glob("*.toml")))


@attrs.frozen
class Mutation:
    spec: str
    index: int  # transitions[index]
    kind: str  # delete | redirect | swap
    dest: str = ""

    def __str__(self) -> str:
        what = f"redirect to {self.dest}" if self.kind == "redirect" else self.kind
        return f"{self.spec}.toml transitions[{self.index}] {what}"

    def apply(self, raw: dict) -> dict:
        raw = copy.deepcopy(raw)
        transitions = raw["transitions"]
        if self.kind == "delete":
            del transitions[self.index]
        elif self.kind == "redirect":
            transitions[self.index]["dest"] = self.dest
        else:
            t = transitions[self.index]
            guards, unless = t.pop("guards", None), t.pop("unless", None)
            if unless is not None:
                t["guards"] = unless
            if guards is not None:
                t["unless"] = guards
        return raw


def raw_spec(name: str) -> dict:
    return tomllib.loads(resources.files("relayline.specs").joinpath(f"{name}.toml").read_text())


def mutations(name: str) -> Iterator[Mutation]:
    raw = raw_spec(name)
    states = list(raw["states"])
    for i, t in enumerate(raw["transitions"]):
        yield Mutation(name, i, "delete")
        for dest in states:
            if dest != t["dest"]:
                yield Mutation(name, i, "redirect", dest)
        if t.get("guards") or t.get("unless"):
            yield Mutation(name, i, "swap")


def all_mutations() -> list[Mutation]:
    return [m for name in engine.SPEC_NAMES for m in mutations(name)]


_LOADED = {p: load_scenario(p) for p in SCENARIOS}


class Hung(BaseException):
    """A mutant ran a scenario without end (virtual time jumps, real time does not). A
    BaseException, so that the driver's own `except Exception` (an attempt's internal failure,
    after which the walk goes on) cannot swallow it and loop on."""


class _Alarm:
    fired = 0  # times the alarm went off in this observer: a KeyboardInterrupt then is its own


# the alarm fires again every 0.2 s: a mutant whose main task reaches no checkpoint in this many
# goes is stopped where it runs, once that is its own code (never inside trio's)
DEFERRALS = 5


def _hang(signum: int, frame: Any) -> None:
    """Stop the mutant. Inside a trio run, as trio stops one on Ctrl-C when KeyboardInterrupt is
    restricted to checkpoints: its main task raises at its next checkpoint, and the run unwinds
    as runs do. Raised wherever the alarm landed (trio's run loop, a nursery's exit, between a
    coroutine made and awaited), the run was left half torn down, and what it left (the run's
    init task, a coroutine never awaited, an async generator of a finished run) complained when
    the collector reached it between mutants."""
    _Alarm.fired += 1
    if trio.lowlevel.in_trio_run() and (_Alarm.fired <= DEFERRALS or trio.lowlevel.currently_ki_protected()):
        GLOBAL_RUN_CONTEXT.runner.deliver_ki()  # (trio's own Ctrl-C delivery: no public door to it)
        return
    raise Hung  # outside trio, or in the mutant's code spinning without a checkpoint


def close_aborted_runs() -> None:
    """Close what a hung run left mid-flight, now, outside any trio run. Left alone, it is
    finalized whenever the last reference goes (a captured log record's traceback can hold it):
    once that was inside a later test's trio run, where its cancel scopes exited and corrupted
    that run (TrioInternalError). Closed here, its cancel scopes complain outside a run, where
    nothing depends on them."""
    gc.collect()
    for obj in gc.get_objects():
        if inspect.iscoroutine(obj) and obj.cr_frame is not None and obj.__qualname__ == "run_scenario.<locals>.main":
            with contextlib.suppress(BaseException):
                obj.close()


def _alarmed(exc: BaseException) -> bool:
    """Whether `exc` (or one in its group) is the alarm's: a Hung, or trio's KeyboardInterrupt
    after the alarm went off."""
    kinds = (Hung, KeyboardInterrupt) if _Alarm.fired else (Hung,)
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(kinds) is not None
    return isinstance(exc, kinds)


def _drop_our_own(hook: Callable[[Any], object], unraisable: Any) -> None:
    """A Hung raised where Python can only report it (a weakref callback, a finalizer) is the
    alarm's own, raised again 0.2 s on: dropped. Anything else goes to `hook` as it came."""
    if not isinstance(unraisable.exc_value, Hung):
        hook(unraisable)


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)


Observer = tuple[str, Callable[[], bool]]  # a name, and whether it sees a difference


def _calls(check: Callable[..., None]) -> list[dict[str, object]]:
    """The arguments of each case of a test: one call with none, or one per combination of its
    `pytest.mark.parametrize` values. A test that needs a fixture is not a check here (called
    without it, it would raise TypeError, which would read as catching every mutation)."""
    cases: list[dict[str, object]] = [{}]
    for mark in reversed(getattr(check, "pytestmark", [])):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        rows = [tuple(value.values) if hasattr(value, "marks")  # a pytest.param(...)
                else tuple(value) if len(names) > 1 else (value,) for value in mark.args[1]]
        cases = [{**case, **dict(zip(names, row, strict=True))} for case in cases for row in rows]
    wanted = set(inspect.signature(check).parameters)
    return [case for case in cases if set(case) == wanted]


def _label(args: dict[str, object]) -> str:
    return f"[{', '.join(map(repr, args.values()))}]" if args else ""


def observers(checks: Iterable[Callable[[], None]] = ()) -> list[Observer]:
    """Everything that may observe a mutation: each check (a test: it fails by raising), then
    each scenario (shared and own, in process on virtual time)."""
    def failing(check: Callable[..., None], args: dict[str, object]) -> Callable[[], bool]:
        def observe() -> bool:
            check(**args)
            return False
        return observe

    found: list[Observer] = [(f"{check.__name__}{_label(args)}", failing(check, args))
                             for check in checks for args in _calls(check)]
    for path, scenario in _LOADED.items():
        found.append((path.stem, lambda scenario=scenario: not check_scenario(scenario).ok))
    return found


def caught_by(mutation: Mutation, watch: list[Observer], limit_s: float = 3.0,
              backstop_s: float = 20.0) -> str | None:
    """What catches `mutation` (the validator, or the name of an observer in `watch`), or None.
    An observer that does not end within `limit_s` of CPU time (or `backstop_s` of real time, for
    one that waits without end) caught it too (a lifecycle that loops forever is not the one
    drawn). CPU time, because real time runs on while a loaded machine runs other processes: a
    sound scenario slowed past a real-time limit was taken for a hang. The observer that catches it moves to the front of
    `watch`: the next mutation, often of the same transition, is likely caught by it too, so a
    sweep runs about one observer per mutation instead of dozens."""
    try:
        spec = engine.build_spec(mutation.apply(raw_spec(mutation.spec)), f"specs/{mutation.spec}.toml")
    except SpecError:
        return "the spec validator"
    real = engine.load_spec(mutation.spec)
    engine._CACHE[mutation.spec] = spec
    previous = {sig: signal.signal(sig, _hang) for sig in (signal.SIGALRM, signal.SIGVTALRM)}
    _Alarm.fired = 0
    unraisable = sys.unraisablehook
    sys.unraisablehook = partial(_drop_our_own, unraisable)
    hung = False
    try:
        for i, (name, observe) in enumerate(watch):
            # then again every 0.2 s: a Hung raised where it is swallowed (trio finalizing an
            # async generator) must not let the mutant run on unbounded
            signal.setitimer(signal.ITIMER_VIRTUAL, limit_s, 0.2)
            signal.setitimer(signal.ITIMER_REAL, backstop_s, 0.2)
            try:
                observed = observe()
            except Exception:
                observed = True
            if observed:
                watch.insert(0, watch.pop(i))
                return name
        return None
    except BaseException as exc:  # trio delivers the alarm inside an exception group
        _disarm()
        if _alarmed(exc):
            hung = True
            return "a scenario that never ends"
        raise
    finally:
        _disarm()
        sys.unraisablehook = unraisable
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if hung:
            close_aborted_runs()
        engine._CACHE[mutation.spec] = real
