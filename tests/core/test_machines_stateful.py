"""The machines driven directly, sans I/O, step by step (Hypothesis RuleBasedStateMachine): the
stream gate frame by frame, the walk result by result, the turn action by action. After every
step the promises are checked on the machine itself, not on a trace: the lifecycle walked a path
of its spec, nothing reached the sink twice or after the end, no call went where the walk must
not send one."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import config, plan
from relayline.machines import classify as fc
from relayline.machines.engine import Lifecycle
from relayline.machines.errors import IllegalTransition
from relayline.machines.health import InMemoryHealth
from relayline.machines.stream import Frame, StreamGate
from relayline.machines.turn import Call, Completion, Finish, Sleep, Turn
from relayline.machines.vocab import FailureClass, StreamState
from relayline.machines.walk import TurnHealth, Walk, WalkDone

pytestmark = pytest.mark.property


def path_ok(life: Lifecycle) -> bool:
    steps = list(life.history)
    edges = {(s, t.dest) for t in life.spec.transitions for s in t.sources}
    return all(pair in edges for pair in zip(steps, steps[1:], strict=False))


frames = st.sampled_from([
    Frame("role"), Frame("ping"), Frame("preamble"), Frame("text", ""), Frame("text", "a "), Frame("text", "b"),
    Frame("reasoning", "hm"), Frame("tool_call", "lookup"), Frame("tool_args", '{"q":'), Frame("executed_tool", "web"),
])


class GateMachine(RuleBasedStateMachine):
    """One streamed attempt behind the commit gate."""

    @initialize()
    def open(self):
        self.gate = StreamGate()
        self.out: list = []
        self.texts_fed: list[str] = []
        self.committed_at: int | None = None

    def live(self) -> bool:
        return not self.gate.life.terminal

    @precondition(lambda self: self.gate.state == StreamState.OPENING)
    @rule()
    def headers(self):
        self.gate.headers()

    @precondition(lambda self: self.gate.state in (StreamState.HELD, StreamState.COMMITTED))
    @rule(frame=frames)
    def feed(self, frame):
        if frame.kind == "text" and frame.value:
            self.texts_fed.append(frame.value)
        out = self.gate.feed(frame)
        if out and self.committed_at is None:
            self.committed_at = len(self.out)
        self.out.extend(out)

    @precondition(lambda self: self.gate.state in (StreamState.HELD, StreamState.COMMITTED))
    @rule()
    def finish(self):
        state = self.gate.finish()
        assert state == (StreamState.COMPLETED if self.gate.has_answer else StreamState.SEMANTIC_EMPTY)

    @precondition(live)
    @rule()
    def fail(self):
        was_committed = self.gate.committed
        state = self.gate.fail()
        assert state == (StreamState.INTERRUPTED if was_committed else StreamState.FAILED)

    @precondition(live)
    @rule()
    def cancel(self):
        self.gate.cancel()
        assert self.gate.state == StreamState.CANCELLED

    @precondition(lambda self: self.gate.life.terminal)
    @rule(trigger=st.sampled_from(["headers", "decisive", "finish", "fail", "cancel"]))
    def after_the_end(self, trigger):
        with pytest.raises(IllegalTransition):  # a terminal state takes nothing
            self.gate.life.fire(trigger, self.gate)

    @invariant()
    def commit_is_the_first_decisive_frame_and_final(self):
        assert path_ok(self.gate.life)
        if self.committed_at is None:
            assert self.out == [] and not self.gate.text  # nothing shown before commit
            return
        assert "committed" in self.gate.life.history
        # text reached the sink once each, in order: exactly the gate's record of it
        assert [e.value for e in self.out if e.kind == "text"] == self.gate.text
        # held preamble goes out with the commit, never after the first decisive event
        kinds = [e.kind for e in self.out]
        first_decisive = next(i for i, k in enumerate(kinds) if k != "preamble")
        assert "preamble" not in kinds[first_decisive:]


TestGate = GateMachine.TestCase


FAILURES = [k for k in FailureClass]


class WalkMachine(RuleBasedStateMachine):
    """The walk over three profiles (one with a key pool), fed random results and timer ends."""

    @initialize(retries=st.integers(0, 2), wait_max=st.sampled_from([0, 1]), threshold=st.integers(1, 3))
    def start(self, retries, wait_max, threshold):
        cfg = config(active="a", reliability={"provider_retries": retries, "retry_after_wait_max_s": wait_max},
                     breaker={"failure_threshold": threshold},
                     providers={"a": {"model": "m1", "fallbacks": ["b"], "api_keys": ["k0", "k1"]},
                                "b": {"model": "m2", "fallbacks": ["c"]}, "c": {"model": "m3"}})
        self.plan = plan(cfg, model="m1")
        self.rel = cfg.reliability
        self.health = TurnHealth(InMemoryHealth(cfg.breaker))
        self.walk = Walk(self.plan, cfg, self.health)
        self.now = 0.0
        self.calls: list[Call] = []
        self.action = self.walk.start(self.now)
        self._took(self.action)

    def _took(self, action):
        if isinstance(action, Call):
            # a call goes to an allowed profile that is not skipped, unless it is the forced probe
            assert action.probe or not self.health.blocked(action.entry.profile, self.now) or \
                action.entry.profile in self.health.probes
            assert action.try_number <= action.budget
            self.calls.append(action)

    @precondition(lambda self: isinstance(self.action, Call))
    @rule(kind=st.sampled_from(FAILURES + [None]), retry_after=st.sampled_from([None, 0.5, 5.0]),
          status=st.sampled_from([400, 429, 503]))
    def result(self, kind, retry_after, status):
        failure = None if kind is None else fc.Failure(kind, "scripted", status, retry_after)
        self.action = self.walk.on_result(failure, self.now)
        self._took(self.action)

    @precondition(lambda self: isinstance(self.action, Sleep))
    @rule()
    def timer(self):
        assert self.action.seconds >= 0
        self.now += self.action.seconds
        self.action = self.walk.on_timer(self.now)
        self._took(self.action)

    @precondition(lambda self: isinstance(self.action, WalkDone))
    @rule(trigger=st.sampled_from(["call", "succeed", "advance", "timer", "cancel"]))
    def after_the_end(self, trigger):
        with pytest.raises(IllegalTransition):
            self.walk.life.fire(trigger, self.walk)

    @invariant()
    def promises(self):
        assert path_ok(self.walk.life)
        done = isinstance(self.action, WalkDone)
        assert done == self.walk.life.terminal
        if done:
            assert self.action.ok == (self.walk.life.state == "succeeded")
        # per entry: at most its budget plus one rotation per pool key, and never more than the
        # walk's own bound
        per_entry: dict[int, int] = {}
        for call in self.calls:
            per_entry[call.entry.index] = per_entry.get(call.entry.index, 0) + 1
        for index, n in per_entry.items():
            entry = self.plan.entries[index]
            assert n <= self.rel.provider_retries + 1 + len(entry.keys)


TestWalk = WalkMachine.TestCase


class TurnMachine(RuleBasedStateMachine):
    """A whole streamed turn, driven action by action with random stream frames and endings."""

    @initialize(retries=st.integers(0, 1), continue_after=st.booleans(), recovery=st.sampled_from(["non_streaming", "streaming"]))
    def start(self, retries, continue_after, recovery):
        cfg = config(active="a", reliability={"provider_retries": retries},
                     stream={"continue_after_interrupt": continue_after, "recovery": recovery},
                     providers={"a": {"model": "m1", "fallbacks": ["b"]},
                                "b": {"model": "m2", "capabilities": {"prefill": True}}})
        self.turn = Turn(plan(cfg, model="m1"), cfg, InMemoryHealth(cfg.breaker), stream=True)
        self.now = 0.0
        self.shown: list[str] = []
        self.calls_after_output = 0
        self.action = self.turn.start(self.now)
        self.opened = False

    def _next(self, action):
        if isinstance(action, Call) and self.shown:
            self.calls_after_output += 1
            # after output only the named exceptions call again: a continuation carrying
            # exactly the forwarded text, or the semantic-empty recovery (nothing text was shown)
            assert action.prefill == "".join(self.turn.forwarded) or not "".join(self.shown).strip()
        self.action = action
        self.opened = False

    def streaming(self) -> bool:
        return isinstance(self.action, Call) and self.action.mode == "stream"

    @precondition(lambda self: self.streaming() and not self.opened)
    @rule()
    def headers(self):
        self.turn.stream_headers()
        self.opened = True

    @precondition(lambda self: self.streaming() and self.opened)
    @rule(frame=frames)
    def frame(self, frame):
        for event in self.turn.stream_frame(frame):
            if event.kind == "text":
                self.shown.append(event.value)

    @precondition(lambda self: self.streaming() and self.opened)
    @rule()
    def done(self):
        self._next(self.turn.stream_done(self.now))

    @precondition(lambda self: self.streaming())
    @rule(kind=st.sampled_from([FailureClass.RETRYABLE, FailureClass.TIMEOUT, FailureClass.RATE_LIMITED]))
    def failed(self, kind):
        self._next(self.turn.stream_failed(fc.Failure(kind, "scripted"), self.now))

    @precondition(lambda self: isinstance(self.action, Call) and self.action.mode == "complete")
    @rule(text=st.sampled_from(["", "answer"]), fail=st.booleans())
    def completion(self, text, fail):
        result = fc.Failure(FailureClass.RETRYABLE, "scripted") if fail else Completion(text)
        self._next(self.turn.on_completion(result, self.now))

    @precondition(lambda self: isinstance(self.action, Sleep))
    @rule()
    def timer(self):
        self.now += self.action.seconds
        self._next(self.turn.on_timer(self.now))

    @precondition(lambda self: not isinstance(self.action, Finish))
    @rule()
    def cancel(self):
        self._next(self.turn.cancel(self.now))

    @precondition(lambda self: isinstance(self.action, Finish))
    @rule(trigger=st.sampled_from(["commit", "complete", "fail", "end", "cancel"]))
    def after_the_end(self, trigger):
        with pytest.raises(IllegalTransition):
            self.turn.life.fire(trigger, self.turn)

    @invariant()
    def promises(self):
        for life in self.turn.lifecycles:
            assert path_ok(life)
        assert self.calls_after_output <= 2
        assert "".join(self.turn.forwarded).startswith("".join(self.shown))
        if isinstance(self.action, Finish):
            result = self.action.result
            assert self.turn.life.terminal
            assert result.outcome == {"completed": "ok", "failed": "error", "interrupted": "interrupted",
                                      "cancelled": "cancelled"}[self.turn.life.state]
            if result.outcome in ("interrupted", "cancelled") and result.partial_text:
                assert result.partial_text == "".join(self.shown)


TestTurn = TurnMachine.TestCase
