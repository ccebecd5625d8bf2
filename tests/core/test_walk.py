"""The walk and the turn driven directly (sans I/O): the cases a sequence of scenario requests
cannot set up. Among them the ends the walk does not choose: the turn's deadline (`expire`,
timeouts.total_s) and relayline's own failure (`abort`); the driver calls them, the fault and
timeout tests show them through HTTP, these pin what each records."""

import pytest
from attrs import evolve as attrs_evolve

from helpers import config, plan
from relayline.machines import classify as fc
from relayline.machines.health import InMemoryHealth
from relayline.machines.ledger import Usage
from relayline.machines.stream import Frame
from relayline.machines.turn import Completion, Rejection, Turn
from relayline.machines.vocab import (
    BreakerState,
    CancellationState,
    ErrorReason,
    Outcome,
    TurnState,
)
from relayline.machines.walk import Call, Sleep, TurnHealth, Walk, WalkDone


def test_a_profile_skipped_while_waiting_is_not_retried():
    """specs/walk.toml `timer` [blocked]: another turn put the profile on cooldown while this
    one waited its backoff: the retry is not sent, the skip is recorded, the next entry serves."""
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}})
    health = TurnHealth(InMemoryHealth(cfg.breaker))
    walk = Walk(plan(cfg, model="m1"), cfg, health)
    call = walk.start(0.0)
    assert isinstance(call, Call) and call.entry.profile == "a"
    wait = walk.on_result(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 0.0)
    assert isinstance(wait, Sleep)
    health.store.set_cooldown("a", 100.0)
    after = walk.on_timer(wait.seconds)
    assert isinstance(after, Call) and after.entry.profile == "b"
    assert [str(s) for s in health.skips] == ["a/m1 cooldown"]
    assert list(walk.life.history) == ["choosing", "calling", "backing_off", "choosing", "calling"]


def test_a_profile_still_healthy_after_the_wait_is_retried():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}})
    health = TurnHealth(InMemoryHealth(cfg.breaker))
    walk = Walk(plan(cfg, model="m1"), cfg, health)
    walk.start(0.0)
    wait = walk.on_result(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 0.0)
    assert isinstance(wait, Sleep)
    again = walk.on_timer(wait.seconds)
    assert isinstance(again, Call) and again.entry.profile == "a" and again.try_number == 2
    assert not health.skips


TURN_CFG = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
             timeouts={"total_s": 30})


def turn(stream: bool, cfg=TURN_CFG, now: float = 0.0) -> Turn:
    t = Turn(plan(cfg, model="m1"), cfg, InMemoryHealth(cfg.breaker), stream=stream)
    return t


def opened(t: Turn, now: float = 0.0) -> Turn:
    """Start a stream turn and let its headers arrive."""
    assert isinstance(t.start(now), Call)
    t.stream_headers()
    return t


def test_expiry_before_commit_is_a_deadline_error_and_no_breaker_failure():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("role"))
    done = t.expire(30.0)
    result = done.result
    assert (result.outcome, result.error) == (Outcome.ERROR, ErrorReason.DEADLINE)
    assert result.message.startswith("the turn did not end within timeouts.total_s (30s) (1 attempt)")
    assert [(a.outcome, a.reason, a.detail) for a in result.attempts] == [
        ("timeout", "timeout", "turn deadline: timeouts.total_s (30s) passed")]
    assert result.attempts[0].ended == 30.0 and not result.ledger and result.partial_text is None
    assert t.life.state == TurnState.FAILED and t.cancellation.state == CancellationState.FINISHED
    assert t.gate is not None and t.gate.life.terminal
    assert t.health.store.breaker("a").state == BreakerState.CLOSED  # the turn's own budget, not ill health
    assert t.call is None and t.continuation is None


def test_expiry_after_commit_ends_interrupted_with_the_forwarded_text_billed():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "partial "))
    t.stream_frame(Frame("text", "answer"))
    result = t.expire(30.0).result
    assert (result.outcome, result.error) == (Outcome.INTERRUPTED, ErrorReason.INTERRUPTED)
    assert result.partial_text == "partial answer" and result.text is None
    assert [(a.outcome, a.reason) for a in result.attempts] == [("interrupted", "timeout")]
    # billed, even without a usage frame: the forwarded text's tokens estimated (14 characters)
    assert [(r.as_json(), r.outcome, r.mode) for r in result.ledger] == [(
        {"provider": "a", "model": "m1", "accepted": False, "input_tokens": 0, "output_tokens": 4, "cost_usd": 0.0,
         "estimated": True}, "interrupted", "stream")]
    assert result.served is None and result.partial_from.profile == "a"
    assert t.life.state == TurnState.INTERRUPTED


def test_expiry_while_waiting_ends_the_walk_without_an_attempt_in_flight():
    t = turn(stream=False)
    t.start(0.0)
    wait = t.on_completion(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 1.0)
    assert isinstance(wait, Sleep) and t.call is None
    result = t.expire(30.0).result
    assert (result.outcome, result.error) == (Outcome.ERROR, ErrorReason.DEADLINE)
    assert [a.outcome for a in result.attempts] == ["retryable"]  # nothing recorded for the wait
    assert t.walk is not None and t.walk.life.state == "cancelled" and t.life.state == TurnState.FAILED


def test_expiry_of_a_non_streamed_call_records_it_as_a_timeout_without_usage():
    t = turn(stream=False)
    t.start(0.0)
    result = t.expire(30.0).result
    assert [(a.outcome, a.mode) for a in result.attempts] == [("timeout", "complete")]
    assert not result.ledger


def test_expiry_during_a_continuation_surfaces_the_interruption():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]},
                                        "b": {"model": "m2", "capabilities": {"prefill": True}}},
                 stream={"continue_after_interrupt": True}, timeouts={"total_s": 30})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("text", "half"))
    nxt = t.stream_failed(fc.Failure(fc.RETRYABLE, "connection reset"), 1.0)
    assert isinstance(nxt, Call) and nxt.prefill == "half" and t.life.state == TurnState.CONTINUING
    result = t.expire(30.0).result
    assert (result.outcome, result.partial_text) == (Outcome.INTERRUPTED, "half")
    assert t.life.state == TurnState.INTERRUPTED and t.continuation is None


def test_an_abort_settles_what_is_known_and_hands_the_probe_back():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 breaker={"failure_threshold": 1})
    t = turn(stream=True, cfg=cfg)
    store = t.health.store
    store.breaker("a").failure(0.0)  # threshold 1: open
    opened(t, store.breaker("a").open_until + 1.0)  # half-open: this turn holds the probe
    assert store.breaker("a").state == BreakerState.PROBING
    t.stream_frame(Frame("text", "x", usage=Usage(5, 1)))
    result = t.abort(100.0).result
    assert (result.outcome, result.error) == (Outcome.ERROR, ErrorReason.INTERNAL)
    assert result.message.startswith("relayline failed to make or read the call (an internal error, logged)")
    assert [(a.outcome, a.reason, a.detail) for a in result.attempts] == [
        ("internal", "internal", "the turn failed inside relayline")]
    assert not result.ledger  # not billed: nothing of it reached an answer
    assert store.breaker("a").state == BreakerState.HALF_OPEN and t.call is None


def test_an_abort_between_calls_records_nothing_more():
    t = turn(stream=False)
    t.start(0.0)
    t.on_completion(Completion("done"), 1.0)
    result = t.abort(2.0).result
    assert [a.outcome for a in result.attempts] == ["ok"] and result.error == ErrorReason.INTERNAL


# -- the errors a turn and a config end with (machines/errors.py) ---------------------------------

def test_a_turn_error_carries_its_reason_as_the_vocabulary_and_its_summary():
    from relayline.machines.errors import RelaylineError, StreamInterruptedAfterOutput, TurnError

    error = TurnError("no candidate left", reason="no_candidate", attempts=("a/m1 503",), partial_text="par")
    assert isinstance(error, RelaylineError) and str(error) == "no candidate left"
    assert error.reason is ErrorReason.NO_CANDIDATE and error.attempts == ("a/m1 503",)
    assert error.partial_text == "par"
    assert TurnError("x", reason="exhausted").attempts == () and TurnError("x", reason="exhausted").partial_text is None
    cut = StreamInterruptedAfterOutput("cut after output", attempts=("a/m1 reset",), partial_text="Hel")
    assert isinstance(cut, TurnError) and cut.reason is ErrorReason.INTERRUPTED and str(cut) == "cut after output"
    assert (cut.attempts, cut.partial_text) == (("a/m1 reset",), "Hel")
    assert StreamInterruptedAfterOutput("cut").partial_text == "" and StreamInterruptedAfterOutput("cut").attempts == ()
    assert RelaylineError("m").reason == "error" and RelaylineError("m", reason="own").reason == "own"


def test_a_config_error_lists_every_problem_on_its_own_line():
    from relayline.machines.errors import ConfigError

    problems = ["providers.a.model: expected a string", "active: names no profile"]
    error = ConfigError(problems)
    problems.append("later")
    assert error.problems == ["providers.a.model: expected a string", "active: names no profile"]
    assert str(error) == ("invalid configuration:\n  providers.a.model: expected a string\n"
                          "  active: names no profile")
    assert error.reason == "config"


# -- the aggregated error a turn ends with: each attempt's number, retry counter, reason class and
# relayline's own detail, bounded (docs/concepts.md "The walk") --------------------------------------

def _complete(cfg, *results, now=0.0, **plan_args):
    """A non-streamed turn answered by `results` in order; its result."""
    t = Turn(plan(cfg, **plan_args), cfg, InMemoryHealth(cfg.breaker), stream=False)
    action = t.start(now)
    for result in results:
        while isinstance(action, Sleep):
            action = t.on_timer(now + action.seconds)
        assert isinstance(action, Call), action
        action = t.on_completion(result, now)
    while isinstance(action, Sleep):
        action = t.on_timer(now + action.seconds)
    assert not isinstance(action, Call), "the turn asked for more than the test gave"
    return action.result


def test_every_candidate_failed_lists_each_attempt_with_its_try_and_detail():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 1, "backoff_ms": 0})
    result = _complete(cfg, fc.Failure(fc.RETRYABLE, "HTTP 503", 503), fc.Failure(fc.TIMEOUT, "no headers within 5s"),
                       fc.Failure(fc.REJECTED, "HTTP 401", 401), model="m1")
    assert (result.outcome, result.error) == (Outcome.ERROR, ErrorReason.EXHAUSTED)
    assert result.message == ("every candidate failed (3 attempts); #1 a/m1 try 1/2 retryable (HTTP 503); "
                              "#2 a/m1 try 2/2 timeout (no headers within 5s); #3 b/m2 try 1/2 rejected (HTTP 401)")
    assert [a.as_json() for a in result.attempts][2] == {
        "provider": "b", "model": "m2", "mode": "complete", "outcome": "rejected", "reason": "rejected",
        "at": 0.0, "key": None}
    assert str(result.attempts[0]) == "a/m1 retryable"


def test_the_error_names_skips_and_stays_bounded():
    providers = {f"p{i}": {"model": f"m{i}", "fallbacks": [f"p{i + 1}"]} for i in range(19)}
    providers["p19"] = {"model": "m19"}
    cfg = config(active="p0", providers=providers, reliability={"provider_retries": 0, "max_fallback_depth": 19})
    result = _complete(cfg, *[fc.Failure(fc.RETRYABLE, "x" * 150)] * 20, model="m0")
    assert result.message.startswith("every candidate failed (20 attempts); #1 p0/m0 try 1/1 retryable (xxx")
    assert len(result.message) == 2000 and result.message.endswith("x...")
    short = _complete(cfg, *[fc.Failure(fc.RETRYABLE, "")] * 20, model="m0")
    assert short.message.endswith("; #16 p15/m15 try 1/1 retryable; ... and 4 more")
    store = InMemoryHealth(cfg.breaker)
    store.set_cooldown("p0", 100.0)
    t = Turn(plan(cfg, model="m0"), cfg, store, stream=False)
    action = t.start(0.0)
    for _ in range(19):
        action = t.on_completion(fc.Failure(fc.RETRYABLE, ""), 0.0)
    assert action.result.message.startswith("every candidate failed (19 attempts, 1 skipped); #1 p1/m1 try 1/1")


@pytest.mark.parametrize(("answers", "setup", "error", "head"), [
    ([Completion("")], {}, ErrorReason.SEMANTIC_EMPTY, "every candidate answered without text or tool calls"),
    ([fc.Failure(fc.CONTEXT_WINDOW, "HTTP 400 context window exceeded", 400)], {}, ErrorReason.CONTEXT_WINDOW,
     "the prompt exceeds the model's context window; compact and call again"),
    ([fc.Failure(fc.REJECTED, "HTTP 400", 400)], {"client_errors": "stop"},
     ErrorReason.CLIENT_ERROR, "the provider rejected the request"),
])
def test_each_error_reason_is_named_in_the_message(answers, setup, error, head):
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 0, **setup})
    result = _complete(cfg, *answers, model="m1")
    assert result.error == error and result.message.startswith(head + " (1 attempt); #1 a/m1 try 1/1 ")


def test_no_candidate_and_cancellation_are_named_in_the_message():
    cfg = config(active="a", providers={"a": {}})  # unpinned, and the request names no model
    result = Turn(plan(cfg), cfg, InMemoryHealth(cfg.breaker), stream=False).start(0.0).result
    assert result.error == ErrorReason.NO_CANDIDATE
    assert result.message == "no entry could be attempted (0 attempts)"
    t = turn(stream=False)
    t.start(0.0)
    result = t.cancel(1.0).result
    assert result.message == ("cancelled by the consumer (1 attempt); "
                              "#1 a/m1 try 1/3 cancelled (cancelled by the consumer)")


# -- what a turn's result carries -----------------------------------------------------------------

def test_an_answer_carries_everything_the_provider_said():
    cfg = config(active="a", providers={"a": {"model": "m1", "price": {"input_per_mtok": 1.0}}})
    answer = Completion("it is sunny", "thought", ("weather",), Usage(10, 3), ('{"city":"Oslo"}',), ("call_1",),
                        "tool_calls", "END")
    result = _complete(cfg, answer, model="m1")
    assert (result.outcome, result.error, result.message, result.rejection) == (Outcome.OK, None, None, None)
    assert (result.text, result.reasoning, result.tool_calls, result.tool_arguments, result.tool_ids) == (
        "it is sunny", "thought", ("weather",), ('{"city":"Oslo"}',), ("call_1",))
    assert (result.finish_reason, result.stop_sequence, result.usage) == ("tool_calls", "END", Usage(10, 3))
    assert result.served.label == "a/m1" and not result.fallback and result.notice is None
    assert result.cost_usd == 10 / 1_000_000 and result.requested == "a/m1"
    failed = _complete(config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 0}),
                       fc.Failure(fc.RETRYABLE, "HTTP 503", 503), model="m1")
    assert (failed.text, failed.reasoning, failed.tool_calls, failed.tool_arguments, failed.tool_ids) == (
        None, "", (), (), ())
    assert (failed.finish_reason, failed.stop_sequence, failed.usage, failed.served) == (None, None, None, None)


@pytest.mark.parametrize(("mode", "notice"), [
    ("off", None),
    ("redacted", "Note: a fallback model answered this request."),
    ("detailed", "Note: b/m2 answered because a/m1 was unavailable."),
])
def test_a_fallback_answer_carries_the_configured_notice(mode, notice):
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 0}, notices={"model_fallback_notice": mode})
    result = _complete(cfg, fc.Failure(fc.RETRYABLE, "HTTP 503", 503), Completion("ok"), model="m1")
    assert result.fallback and result.served.label == "b/m2" and result.notice == notice
    first = _complete(cfg, Completion("ok"), model="m1")
    assert not first.fallback and first.notice is None


def test_the_upstreams_rejection_is_given_back_only_when_every_attempt_was_one():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 0})
    bad = fc.Failure(fc.REJECTED, "HTTP 400", 400, error_type="invalid_request_error", error_message="max_tokens: too big")
    result = _complete(cfg, bad, attrs_evolve(bad, error_type=None, error_message=None), model="m1")
    assert result.error == ErrorReason.EXHAUSTED
    assert result.rejection == Rejection(400, "invalid_request_error", "HTTP 400")  # the last one's words
    mixed = _complete(cfg, fc.Failure(fc.RETRYABLE, "HTTP 503", 503), bad, model="m1")
    assert mixed.rejection is None
    unauthorised = _complete(cfg, fc.Failure(fc.REJECTED, "HTTP 401", 401), bad, model="m1")
    assert unauthorised.rejection is None  # a 401 is relayline's credential, not the client's request
    stop = config(active="a", providers={"a": {"model": "m1"}}, reliability={"client_errors": "stop"})
    assert _complete(stop, bad, model="m1").rejection == Rejection(400, "invalid_request_error", "max_tokens: too big")


def test_a_cancel_after_output_records_the_attempt_and_keeps_the_partial_text():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "Hel"))
    t.stream_frame(Frame("usage", usage=Usage(7, 2)))
    result = t.cancel(3.0).result
    assert (result.outcome, result.error, result.partial_text) == (Outcome.CANCELLED, ErrorReason.CANCELLED, "Hel")
    assert [(a.outcome, a.reason, a.detail, a.ended) for a in result.attempts] == [
        ("cancelled", "cancelled", "cancelled by the consumer", 3.0)]
    assert [(r.input_tokens, r.output_tokens, r.accepted, r.outcome) for r in result.ledger] == [
        (7, 2, False, "cancelled")]  # what it used is billed
    assert t.gate.life.terminal and t.call is None and t.cancellation.state == CancellationState.PERSISTED_PARTIAL
    quiet = opened(turn(stream=True))
    quiet.stream_frame(Frame("role"))
    result = quiet.cancel(1.0).result
    assert result.partial_text is None and not result.ledger and quiet.gate.life.terminal


# -- what each end of an attempt records: its outcome, reason class, detail and ledger row ---------

def _records(result):
    return [(a.provider, a.mode, a.outcome, a.reason, a.detail, a.try_number, a.budget) for a in result.attempts]


def _rows(result):
    return [(r.provider, r.input_tokens, r.output_tokens, r.accepted, r.outcome, r.mode) for r in result.ledger]


def test_an_empty_stream_is_recorded_billed_and_recovered_once_without_streaming():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 1})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("role"))
    t.stream_frame(Frame("usage", usage=Usage(4, 0)))
    recovery = t.stream_done(1.0)
    assert isinstance(recovery, Call) and recovery.mode == "complete" and recovery.entry.profile == "a"
    assert (recovery.try_number, recovery.budget) == (1, 1)  # the one allowance, retries or not
    done = t.on_completion(Completion("", usage=Usage(4, 0)), 2.0)
    result = done.result
    assert result.error == ErrorReason.SEMANTIC_EMPTY
    assert _records(result) == [
        ("a", "stream", "semantic_empty", "empty", "stream completed without an answer", 1, 2),
        ("a", "complete", "empty", "empty", "empty completion", 1, 1)]
    assert _rows(result) == [("a", 4, 0, False, "semantic_empty", "stream"), ("a", 4, 0, False, "empty", "complete")]


def test_a_recovery_answer_is_delivered_as_one_decisive_event_with_ids_padded():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 1})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("reasoning", "hmm"))  # decisive: the turn commits with nothing to show yet
    assert t.shown_reasoning
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("role"))
    assert isinstance(t.stream_done(1.0), Call)
    answer = Completion("sunny", "thought", ("weather", "clock"), Usage(1, 1), ('{"city":"Oslo"}', ""), ("c1",))
    done = t.on_completion(answer, 2.0)
    assert [(e.kind, e.value, e.ref) for e in done.deliver] == [
        ("reasoning", "thought", ""), ("text", "sunny", ""), ("tool", "weather", "c1"),
        ("tool_args", '{"city":"Oslo"}', ""), ("tool", "clock", "")]
    assert done.result.text == "sunny" and t.forwarded == ["sunny"]


def test_a_stream_that_fails_before_output_is_not_billed_and_the_walk_goes_on():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 0})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("role"))
    nxt = t.stream_failed(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 1.0)
    assert isinstance(nxt, Call) and nxt.entry.profile == "b" and nxt.mode == "complete"  # the recovery walk
    result = t.on_completion(Completion("fine", usage=Usage(2, 1)), 2.0).result
    assert _records(result) == [("a", "stream", "stream_failed", "retryable", "HTTP 503", 1, 1),
                                ("b", "complete", "ok", None, "", 1, 1)]
    assert _rows(result) == [("b", 2, 1, True, "ok", "complete")]
    assert t.spent == {0: 1, 1: 1}


def test_a_stream_cut_after_output_is_billed_and_interrupted():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "Hel"))
    result = t.stream_failed(fc.Failure(fc.RETRYABLE, "connection reset"), 1.0).result
    assert (result.outcome, result.partial_text) == (Outcome.INTERRUPTED, "Hel")
    assert _records(result) == [("a", "stream", "interrupted", "retryable", "connection reset", 1, 3)]
    assert _rows(result) == [("a", 0, 1, False, "interrupted", "stream")]  # billed, without a usage frame
    assert [r.estimated for r in result.ledger] == [True]
    assert result.rejection is None


def test_a_continuation_that_fails_names_itself_and_is_not_billed_twice():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]},
                                        "b": {"model": "m2", "capabilities": {"prefill": True}}},
                 stream={"continue_after_interrupt": True})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("text", "half"))
    t.stream_frame(Frame("usage", usage=Usage(3, 1)))
    nxt = t.stream_failed(fc.Failure(fc.RETRYABLE, "connection reset"), 1.0)
    assert isinstance(nxt, Call) and nxt.entry.profile == "b" and nxt.prefill == "half"
    assert (nxt.key_index, nxt.try_number, nxt.budget) == (None, 1, 1)
    t.stream_headers()
    t.stream_frame(Frame("text", " more"))
    result = t.stream_failed(fc.Failure(fc.TIMEOUT, "idle 60s"), 2.0).result
    assert (result.outcome, result.partial_text) == (Outcome.INTERRUPTED, "half more")
    assert _records(result) == [("a", "stream", "interrupted", "retryable", "connection reset", 1, 3),
                                ("b", "stream", "interrupted", "timeout", "continuation: idle 60s", 1, 1)]
    assert _rows(result) == [("a", 3, 1, False, "interrupted", "stream")]


def test_a_continuation_is_only_for_text_and_only_to_a_later_entry_that_can_prefill():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b", "c"]},
                                        "b": {"model": "m2", "capabilities": {"streaming": False, "prefill": True}},
                                        "c": {"model": "m3", "capabilities": {"prefill": True}}},
                 stream={"continue_after_interrupt": True})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("text", "half"))
    nxt = t.stream_failed(fc.Failure(fc.RETRYABLE, "reset"), 1.0)
    assert isinstance(nxt, Call) and nxt.entry.profile == "c"  # b cannot stream
    tools = opened(turn(stream=True, cfg=cfg))
    tools.stream_frame(Frame("tool_call", "weather", ref="c1"))
    assert tools.stream_failed(fc.Failure(fc.RETRYABLE, "reset"), 1.0).result.outcome == Outcome.INTERRUPTED


def test_an_empty_completion_is_recorded_and_billed():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 0})
    result = _complete(cfg, Completion("  ", usage=Usage(5, 0)), model="m1")
    assert _records(result) == [("a", "complete", "empty", "empty", "empty completion", 1, 1)]
    assert _rows(result) == [("a", 5, 0, False, "empty", "complete")]


def test_a_refusal_advances_when_configured_and_is_the_answer_when_nothing_is_left():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"on_refusal": "advance", "provider_retries": 0})
    refusal = Completion("", usage=Usage(3, 0), finish_reason="content_filter")
    result = _complete(cfg, refusal, refusal, model="m1")
    assert result.outcome == Outcome.OK and result.served.label == "b/m2" and result.finish_reason == "content_filter"
    assert _records(result) == [("a", "complete", "refused", "refused", "refusal: finish reason content_filter", 1, 1),
                                ("b", "complete", "ok", None, "refusal: finish reason content_filter", 1, 1)]
    assert _rows(result) == [("a", 3, 0, False, "refused", "complete"), ("b", 3, 0, True, "ok", "complete")]
    http = fc.Failure(fc.REFUSED, "HTTP 400 content policy", 400, error_message="policy")
    result = _complete(cfg, http, http, model="m1")
    assert result.error == ErrorReason.CLIENT_ERROR
    assert [(a.outcome, a.reason) for a in result.attempts] == [("refused", "refused"), ("rejected", "refused")]
    assert result.rejection == Rejection(400, "invalid_request_error", "policy")
    kept = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                  reliability={"provider_retries": 0, "client_errors": "stop"})
    kept_result = _complete(kept, http, model="m1")  # on_refusal = "return": the client error it always was
    assert kept_result.error == ErrorReason.CLIENT_ERROR and [a.outcome for a in kept_result.attempts] == ["rejected"]


def test_a_stream_refusal_before_output_advances_when_configured():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"on_refusal": "advance", "provider_retries": 0})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("usage", usage=Usage(2, 0)))
    t.stream_frame(Frame("finish", "content_filter"))
    nxt = t.stream_done(1.0)
    assert isinstance(nxt, Call) and nxt.entry.profile == "b"
    assert [(a.outcome, a.reason, a.detail) for a in t.attempts] == [
        ("refused", "refused", "refusal before output: finish reason content_filter")]
    assert [(r.input_tokens, r.outcome) for r in t.ledger] == [(2, "refused")]
    assert t.refusal.answer == Completion(usage=Usage(2, 0), finish_reason="content_filter")
    failed = opened(turn(stream=True, cfg=cfg))
    failed.stream_frame(Frame("usage", usage=Usage(6, 0)))
    nxt = failed.stream_failed(fc.Failure(fc.REFUSED, "stream error: content policy"), 1.0)
    assert isinstance(nxt, Call) and [(r.input_tokens, r.outcome) for r in failed.ledger] == [(6, "refused")]


# -- the stream gate directly ----------------------------------------------------------------------

def test_the_gate_holds_the_preamble_until_the_first_decisive_frame_and_then_forwards_each():
    from relayline.machines.stream import StreamGate

    gate = StreamGate()
    gate.headers()
    assert gate.feed(Frame("role")) == () and gate.feed(Frame("text", "")) == ()
    first = gate.feed(Frame("tool_call", "weather", ref="c1"))
    assert [(e.kind, e.value, e.ref) for e in first] == [("preamble", "role", ""), ("preamble", "text", ""),
                                                         ("tool", "weather", "c1")]
    assert gate.committed and gate.feed(Frame("ping")) == () and not gate.held  # nothing held after commit
    assert [(e.kind, e.value) for e in gate.feed(Frame("tool_args", '{"city":'))] == [("tool_args", '{"city":')]
    gate.feed(Frame("tool_call", "clock", ref="c2"))
    gate.feed(Frame("tool_args", "{}"))
    gate.feed(Frame("tool_args", ""))  # not decisive
    gate.feed(Frame("text", "done"))
    gate.feed(Frame("finish", "stop_sequence", ref="END"))
    assert (gate.tools, gate.tool_ids, gate.tool_arguments) == (["weather", "clock"], ["c1", "c2"], ('{"city":', "{}"))
    assert (gate.finish_reason, gate.stop_sequence, gate.forwarded_text) == ("stop_sequence", "END", "done")
    plain = StreamGate()
    plain.feed(Frame("finish", "stop"))
    assert (plain.finish_reason, plain.stop_sequence) == ("stop", None)


def test_an_event_is_decisive_as_the_frame_it_came_from():
    """What the gate held before the first decisive frame comes out with it, not decisive itself
    (the gateway writes at once what ends with the first decisive event)."""
    from relayline.machines.stream import StreamGate

    gate = StreamGate()
    gate.headers()
    held = [Frame("role"), Frame("redacted_reasoning", "EmwK"), Frame("text", "", ref="cite")]
    assert all(gate.feed(frame) == () for frame in held)
    released = gate.feed(Frame("reasoning", "hm"))
    assert [e.decisive for e in released] == [False, False, False, True]
    after = [Frame("reasoning", "", ref="sig"), Frame("tool_call", "", ref="c1"), Frame("tool_args", "{}"),
             Frame("executed_tool", "search"), Frame("text", "a")]
    assert [e.decisive for frame in after for e in gate.feed(frame)] == [frame.decisive for frame in after]
    assert [frame.decisive for frame in after] == [False, True, True, True, True]


# -- waits ------------------------------------------------------------------------------------------

def test_the_backoff_doubles_up_to_backoff_max_ms():
    cfg = config(active="a", providers={"a": {"model": "m1"}},
                 reliability={"provider_retries": 4, "backoff_ms": 500, "backoff_max_ms": 1500})
    walk = Walk(plan(cfg, model="m1"), cfg, TurnHealth(InMemoryHealth(cfg.breaker)))
    walk.start(0.0)
    waits, now = [], 0.0
    for _ in range(4):
        wait = walk.on_result(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), now)
        waits.append(wait.seconds)
        now += wait.seconds
        assert isinstance(walk.on_timer(now), Call)
    assert waits == [0.5, 1.0, 1.5, 1.5]


@pytest.mark.parametrize(("retry_after", "seconds"), [(10.0, 2.0), (1.5, 1.5), (0.1, 0.5), (None, 0.5)])
def test_a_lone_profiles_429_waits_its_retry_after_capped_and_never_less_than_the_backoff(retry_after, seconds):
    cfg = config(active="a", providers={"a": {"model": "m1"}},
                 reliability={"provider_retries": 2, "backoff_ms": 500, "retry_after_max_ms": 2000})
    walk = Walk(plan(cfg, model="m1"), cfg, TurnHealth(InMemoryHealth(cfg.breaker)))
    walk.start(0.0)
    assert walk.on_result(fc.Failure(fc.RATE_LIMITED, "HTTP 429 rate limited", 429, retry_after), 0.0) == Sleep(seconds)


def test_a_request_no_entry_can_honour_names_the_fields():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}})
    unfit = attrs_evolve(plan(cfg, model="m1"), unfit={"a": ("image",), "b": ("image", "tools")})
    for stream in (True, False):
        t = Turn(unfit, cfg, InMemoryHealth(cfg.breaker), stream=stream)
        result = t.start(0.0).result
        assert result.error == ErrorReason.UNSUPPORTED
        assert result.message == "no entry can honour the request as asked: image, tools (0 attempts, 2 skipped)"
        assert [str(s) for s in result.skipped] == ["a/m1 unsupported (image)", "b/m2 unsupported (image, tools)"]


def test_an_attempts_json_rounds_its_time_to_the_microsecond():
    from relayline.machines.turn import AttemptRecord

    record = AttemptRecord("a", "m1", "stream", "ok", None, 1.23456789, 2)
    assert record.as_json() == {"provider": "a", "model": "m1", "mode": "stream", "outcome": "ok", "reason": None,
                                "at": 1.234568, "key": 2}


def test_a_last_refusal_without_an_answer_is_recorded_as_the_rejection_it_ends_with():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b", "c"]}, "b": {"model": "m2"},
                                        "c": {"model": "m3"}},
                 reliability={"on_refusal": "advance", "provider_retries": 0})
    http = fc.Failure(fc.REFUSED, "HTTP 400 content policy", 400)
    result = _complete(cfg, fc.Failure(fc.RETRYABLE, "HTTP 503", 503), fc.Failure(fc.RETRYABLE, "HTTP 503", 503),
                       http, model="m1")
    assert result.error == ErrorReason.CLIENT_ERROR
    assert [a.outcome for a in result.attempts] == ["retryable", "retryable", "rejected"]


def test_when_every_entry_is_skipped_for_health_the_one_whose_window_ends_first_is_probed_once():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 2})
    store = InMemoryHealth(cfg.breaker)
    store.set_cooldown("a", 100.0)
    store.set_cooldown("b", 50.0)
    health = TurnHealth(store)
    walk = Walk(plan(cfg, model="m1"), cfg, health)
    call = walk.start(0.0)
    assert (call.entry.profile, call.try_number, call.budget, call.probe) == ("b", 1, 1, True)
    assert [str(s) for s in health.skips] == ["a/m1 cooldown", "b/m2 cooldown"]
    done = walk.on_result(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 0.0)
    assert isinstance(done, WalkDone) and done.error == ErrorReason.EXHAUSTED  # probed once, no retry


def test_a_forced_probe_of_an_open_breaker_holds_the_probe():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, breaker={"failure_threshold": 1})
    store = InMemoryHealth(cfg.breaker)
    store.breaker("a").failure(0.0)
    health = TurnHealth(store)
    call = Walk(plan(cfg, model="m1"), cfg, health).start(1.0)
    assert call.probe and store.breaker("a").state == BreakerState.PROBING and health.probes == {"a"}


def test_streaming_recovery_retries_as_a_stream_and_the_turn_says_so_on_its_path():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]},
                                        "b": {"model": "m2", "capabilities": {"streaming": False}}},
                 stream={"recovery": "streaming"}, reliability={"provider_retries": 1})
    t = opened(turn(stream=True, cfg=cfg))
    wait = t.stream_failed(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 1.0)
    retry = t.on_timer(1.0 + wait.seconds)
    assert (retry.entry.profile, retry.mode, retry.try_number) == ("a", "stream", 2)
    assert list(t.life.history) == ["planned", "streaming", "streaming", "streaming"]  # open, fail, retry_stream
    t.stream_headers()
    wait = t.stream_failed(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 3.0)
    last = wait if isinstance(wait, Call) else t.on_timer(3.0 + wait.seconds)
    assert (last.entry.profile, last.mode) == ("b", "complete")  # b cannot stream: asked whole
    done = t.on_completion(Completion("ok"), 5.0)
    assert [(e.kind, e.value) for e in done.deliver] == [("text", "ok")]
    # open_stream, fail, retry_stream, fail (b answers whole, without a stream), end
    assert list(t.life.history) == ["planned", "streaming", "streaming", "streaming", "streaming", "completed"]


def test_a_streamed_answer_carries_its_usage_and_stop_sequence_and_no_reasoning_of_its_own():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "Hello"))
    t.stream_frame(Frame("usage", usage=Usage(3, 2)))
    t.stream_frame(Frame("finish", "stop_sequence", ref="END"))
    result = t.stream_done(1.0).result
    assert (result.text, result.reasoning, result.usage, result.finish_reason, result.stop_sequence) == (
        "Hello", "", Usage(3, 2), "stop_sequence", "END")
    assert _rows(result) == [("a", 3, 2, True, "ok", "stream")]


def test_a_continuation_that_adds_nothing_still_completes_the_answer_already_shown():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]},
                                        "b": {"model": "m2", "capabilities": {"prefill": True},
                                              "api_keys": ["k1", "k2"]}},
                 stream={"continue_after_interrupt": True})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("text", "Hel"))
    t.stream_frame(Frame("text", "lo"))
    nxt = t.stream_failed(fc.Failure(fc.RETRYABLE, "connection reset"), 1.0)
    assert (nxt.prefill, nxt.key_index) == ("Hello", 0)
    t.stream_headers()
    t.stream_frame(Frame("role"))
    result = t.stream_done(2.0).result
    assert (result.outcome, result.text, result.served.label) == (Outcome.OK, "Hello", "b/m2")


def test_a_stream_rejected_before_output_gives_back_the_upstreams_words_and_bills_what_it_reported():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"client_errors": "stop"})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("usage", usage=Usage(9, 0)))
    bad = fc.Failure(fc.REJECTED, "HTTP 400", 400, error_type="invalid_request_error", error_message="bad tool")
    result = t.stream_failed(bad, 1.0).result
    assert result.error == ErrorReason.CLIENT_ERROR
    assert _rows(result) == [("a", 9, 0, False, "stream_failed", "stream")]  # usage reported is usage billed
    assert result.rejection == Rejection(400, "invalid_request_error", "bad tool")
    assert result.message.startswith("the provider rejected the request (1 attempt); #1 a/m1 try 1/3 rejected")


def test_a_cut_stream_says_it_is_not_replayed():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "Hel"))
    result = t.stream_failed(fc.Failure(fc.RETRYABLE, "connection reset"), 1.0).result
    assert result.message == ("the stream failed after output was forwarded; it is not replayed (1 attempt); "
                              "#1 a/m1 try 1/3 retryable (connection reset)")


def test_the_deadline_bills_what_a_stream_reported_and_an_empty_row_only_once_output_was_shown():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("usage", usage=Usage()))
    assert not t.expire(30.0).result.ledger
    t = opened(turn(stream=True))
    t.stream_frame(Frame("usage", usage=Usage(8, 0)))
    assert _rows(t.expire(30.0).result) == [("a", 8, 0, False, "timeout", "stream")]
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "Hel"))
    t.stream_frame(Frame("usage", usage=Usage(8, 1)))
    assert _rows(t.expire(30.0).result) == [("a", 8, 1, False, "interrupted", "stream")]


def test_an_abort_bills_what_the_provider_reported():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("usage", usage=Usage(5, 1)))
    assert _rows(t.abort(1.0).result) == [("a", 5, 1, False, "internal", "stream")]
    quiet = opened(turn(stream=True))
    quiet.stream_frame(Frame("usage", usage=Usage()))
    assert not quiet.abort(1.0).result.ledger


def test_a_cancel_bills_only_what_the_provider_reported_using():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("usage", usage=Usage()))
    assert not t.cancel(1.0).result.ledger


def test_an_error_after_an_accepted_attempt_names_its_outcome():
    t = turn(stream=False)
    t.start(0.0)
    t.on_completion(Completion("done"), 1.0)
    assert t.abort(2.0).result.message.endswith("(1 attempt); #1 a/m1 try 1/3 ok")


def test_sixteen_attempts_are_listed_without_a_remainder():
    providers = {f"p{i}": {"model": f"m{i}", "fallbacks": [f"p{i + 1}"]} for i in range(15)}
    providers["p15"] = {"model": "m15"}
    cfg = config(active="p0", providers=providers, reliability={"provider_retries": 0, "max_fallback_depth": 15})
    message = _complete(cfg, *[fc.Failure(fc.RETRYABLE, "")] * 16, model="m0").message
    assert message.endswith("#16 p15/m15 try 1/1 retryable") and "more" not in message


def test_a_recovery_answer_without_reasoning_delivers_none():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 1})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("role"))
    t.stream_done(1.0)
    assert [e.kind for e in t.on_completion(Completion("ok"), 2.0).deliver] == ["text"]


def test_a_lone_entrys_failed_stream_is_its_first_attempt_and_the_walk_exhausts_after_it():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, reliability={"provider_retries": 0})
    t = opened(turn(stream=True, cfg=cfg))
    result = t.stream_failed(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 1.0).result
    assert result.error == ErrorReason.EXHAUSTED and len(result.attempts) == 1


def test_a_commit_ends_the_streaming_walk_it_belongs_to():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, stream={"recovery": "streaming"})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("text", "hi"))
    assert t.walk.life.state == "succeeded"


def test_a_failure_that_teaches_the_breaker_nothing_leaves_another_turns_probe_alone():
    cfg = config(active="a", providers={"a": {"model": "m1"}}, breaker={"failure_threshold": 1})
    store = InMemoryHealth(cfg.breaker)
    store.breaker("a").failure(0.0)
    holder = TurnHealth(store)
    holder.before_attempt("a", 100.0)
    assert store.breaker("a").state == BreakerState.PROBING
    TurnHealth(store).failure("a", fc.RATE_LIMITED, 100.0)
    assert store.breaker("a").state == BreakerState.PROBING
    holder.failure("a", fc.RATE_LIMITED, 100.0)  # its own probe, told nothing: handed back
    assert store.breaker("a").state == BreakerState.HALF_OPEN and not holder.probes


def test_a_continuation_needs_text_shown_tools_honoured_and_an_entry_after_the_failed_one():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b", "c"]},
                                        "b": {"model": "m2", "capabilities": {"prefill": True, "tools": False}},
                                        "c": {"model": "m3", "capabilities": {"prefill": True}}},
                 stream={"continue_after_interrupt": True})
    thinking = opened(turn(stream=True, cfg=cfg))
    thinking.stream_frame(Frame("reasoning", "hmm"))  # committed, but no text to continue from
    assert thinking.stream_failed(fc.Failure(fc.RETRYABLE, "reset"), 1.0).result.outcome == Outcome.INTERRUPTED
    tools = Turn(plan(cfg, model="m1"), cfg, InMemoryHealth(cfg.breaker), stream=True, tools=True)
    opened(tools).stream_frame(Frame("text", "half"))
    assert tools.stream_failed(fc.Failure(fc.RETRYABLE, "reset"), 1.0).entry.profile == "c"  # b has no tools
    store = InMemoryHealth(cfg.breaker)
    store.set_cooldown("a", 100.0)
    later = Turn(plan(cfg, model="m1"), cfg, store, stream=True)
    assert later.start(0.0).entry.profile == "b"
    later.stream_headers()
    later.stream_frame(Frame("text", "half"))
    assert later.stream_failed(fc.Failure(fc.RETRYABLE, "reset"), 1.0).entry.profile == "c"  # never b again


def test_an_accepted_answer_without_usage_is_a_row_billed_at_the_estimate():
    cfg = config(active="a", providers={"a": {"model": "m1"}})
    result = _complete(cfg, Completion("nine char", tool_calls=("get",), tool_arguments=("{}",)), model="m1")
    assert _rows(result) == [("a", 0, 4, True, "ok", "complete")]  # 9 + 3 + 2 characters out, 4 a token
    assert result.ledger[0].estimated
    counted = _complete(cfg, Completion("nine char", usage=Usage(0, 0)), model="m1")
    assert _rows(counted) == [("a", 0, 0, True, "ok", "complete")] and not counted.ledger[0].estimated


def test_a_completed_stream_without_usage_is_billed_at_the_estimate():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "twelve chars"))
    result = t.stream_done(1.0).result
    assert _rows(result) == [("a", 0, 3, True, "ok", "stream")] and result.ledger[0].estimated


def test_a_stream_failure_before_output_bills_a_row_only_for_usage_it_reported():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("usage", usage=Usage()))
    t.stream_failed(fc.Failure(fc.RETRYABLE, "HTTP 503", 503), 1.0)
    assert not t.ledger


def test_the_semantic_empty_recovery_leaves_the_other_entries_their_whole_budget():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 reliability={"provider_retries": 1})
    t = opened(turn(stream=True, cfg=cfg))
    t.stream_frame(Frame("role"))
    assert t.stream_done(1.0).entry.profile == "a"  # its one allowance
    nxt = t.on_completion(Completion(""), 2.0)
    assert (nxt.entry.profile, nxt.budget) == ("b", 2)


def test_one_key_is_no_pool_and_a_pool_starts_at_the_cursor():
    one = config(active="a", providers={"a": {"model": "m1", "api_key": "k"}})
    assert Walk(plan(one, model="m1"), one, TurnHealth(InMemoryHealth(one.breaker))).start(0.0).key_index is None
    pool = config(active="a", providers={"a": {"model": "m1", "api_keys": ["k1", "k2", "k3"]}})
    store = InMemoryHealth(pool.breaker)
    store.set_key_cursor("a", 4)
    assert Walk(plan(pool, model="m1"), pool, TurnHealth(store)).start(0.0).key_index == 1


@pytest.mark.parametrize(("status", "stops"), [(400, True), (413, True), (422, True), (401, False), (404, False)])
def test_client_errors_stop_only_on_the_statuses_that_name_the_request(status, stops):
    from relayline.machines.walk import stop_error

    cfg = config(active="a", providers={"a": {}}, reliability={"client_errors": "stop"})
    error = stop_error(cfg.reliability, fc.Failure(fc.REJECTED, f"HTTP {status}", status))
    assert error == (ErrorReason.CLIENT_ERROR if stops else None)


def test_a_stream_with_tools_opens_on_the_first_entry_that_streams_tool_events():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"], "capabilities": {"tools": False}},
                                        "b": {"model": "m2"}})
    t = Turn(plan(cfg, model="m1"), cfg, InMemoryHealth(cfg.breaker), stream=True, tools=True)
    assert t.start(0.0).entry.profile == "b"


def test_events_withdrawn_before_the_consumer_took_them_are_not_its_partial_text():
    t = opened(turn(stream=True))
    t.stream_frame(Frame("text", "H"))
    t.stream_frame(Frame("text", "el"))
    late = t.stream_frame(Frame("text", "lo"))
    t.withdraw(())  # nothing to withdraw
    t.withdraw(late)
    assert t.forwarded == ["H", "el"]
    try:
        t.withdraw(late)
    except ValueError as exc:
        assert str(exc) == "only the events stream_frame returned last can be withdrawn"
    else:
        raise AssertionError("withdrew what was not forwarded last")
    assert t.forwarded == ["H", "el"] and t.cancel(1.0).result.partial_text == "Hel"


def test_after_an_empty_stream_an_entry_the_streaming_walk_tried_keeps_what_is_left_of_its_budget():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}},
                 stream={"recovery": "streaming"}, reliability={"provider_retries": 1})
    t = opened(turn(stream=True, cfg=cfg))
    to_b = t.stream_failed(fc.Failure(fc.TIMEOUT, "no first byte within 5s"), 1.0)
    assert (to_b.entry.profile, to_b.mode) == ("b", "stream")  # a timeout advances when another can serve
    t.stream_headers()
    t.stream_frame(Frame("role"))
    nxt = t.stream_done(2.0)  # the recovery walk, in order: a has one of its two attempts left
    assert (nxt.entry.profile, nxt.mode, nxt.try_number, nxt.budget) == ("a", "complete", 1, 1)
    last = t.on_completion(Completion(""), 3.0)
    assert (last.entry.profile, last.budget) == ("b", 1)  # then b's one recovery attempt


# -- a key pool's 401 and 403: the key's fault, not the profile's


POOL_CFG = config(active="a", providers={"a": {"model": "m1", "api_keys": ["k0", "k1", "k2"], "fallbacks": ["b"]},
                                         "b": {"model": "m2"}},
                  reliability={"rate_limit_cooldown_default_s": 60, "provider_retries": 0})


def test_a_401_or_403_on_a_pool_key_tries_the_next_key_at_once_and_the_bad_key_sits_out():
    health = TurnHealth(InMemoryHealth(POOL_CFG.breaker))
    walk = Walk(plan(POOL_CFG, model="m1"), POOL_CFG, health)
    first = walk.start(0.0)
    assert isinstance(first, Call) and first.key_index == 0
    second = walk.on_result(fc.Failure(fc.REJECTED, "HTTP 401", 401), 1.0)
    # the same entry, the next key, no wait, and not a retry (provider_retries = 0 allows one try)
    assert isinstance(second, Call) and (second.entry.profile, second.key_index, second.try_number) == ("a", 1, 1)
    assert health.store.key_cooldown_until("a", 0) == 61.0
    third = walk.on_result(fc.Failure(fc.REJECTED, "HTTP 403", 403), 2.0)
    assert isinstance(third, Call) and (third.entry.profile, third.key_index) == ("a", 2)
    # every key drew a 401 or 403: the walk advances as for any non-retryable 4xx, and the profile
    # is neither cooled down nor charged a breaker failure
    fourth = walk.on_result(fc.Failure(fc.REJECTED, "HTTP 401", 401), 3.0)
    assert isinstance(fourth, Call) and fourth.entry.profile == "b"
    assert health.store.cooldown_until("a") < 3.0 and not health.store.breaker("a").failures
    assert list(walk.life.history) == ["choosing", "calling", "calling", "calling", "choosing", "calling"]


def test_a_pool_key_sitting_out_is_passed_by_a_429_rotation_until_its_time_is_up():
    store = InMemoryHealth(POOL_CFG.breaker)
    store.set_key_cooldown("a", 1, 60.0)
    walk = Walk(plan(POOL_CFG, model="m1"), POOL_CFG, TurnHealth(store))
    walk.start(0.0)
    after_429 = walk.on_result(fc.Failure(fc.RATE_LIMITED, "HTTP 429", 429), 10.0)
    assert isinstance(after_429, Call) and after_429.key_index == 2
    # keys 0 and 2 drew a 429, key 1 sits out: none is left, the profile cools down, b answers
    advanced = walk.on_result(fc.Failure(fc.RATE_LIMITED, "HTTP 429", 429), 10.0)
    assert isinstance(advanced, Call) and advanced.entry.profile == "b"
    store.clear_cooldown("a")
    later = Walk(plan(POOL_CFG, model="m1"), POOL_CFG, TurnHealth(store))
    keys = [later.start(61.0).key_index]  # (the cursor stayed on key 2)
    for _ in range(2):
        keys.append(later.on_result(fc.Failure(fc.RATE_LIMITED, "HTTP 429", 429), 61.0).key_index)
    assert keys == [2, 0, 1]  # key 1's minute is over


def test_a_401_on_a_profile_without_a_pool_advances_and_sits_nothing_out():
    cfg = config(active="a", providers={"a": {"model": "m1", "fallbacks": ["b"]}, "b": {"model": "m2"}})
    health = TurnHealth(InMemoryHealth(cfg.breaker))
    walk = Walk(plan(cfg, model="m1"), cfg, health)
    walk.start(0.0)
    after = walk.on_result(fc.Failure(fc.REJECTED, "HTTP 401", 401), 0.0)
    assert isinstance(after, Call) and after.entry.profile == "b" and not health.keys_refused
