"""The trio driver: executes a turn's actions, and nothing else.

The machines decide (machines/turn.py); this module performs: provider calls through the
protocol adapters, sleeps, sink writes, and the timeouts as trio cancel scopes. Cancellation
arrives as trio.Cancelled from whoever owns the turn (a caller's scope, a gateway client that
went away): the driver records it on the turn, which never retries after it, and re-raises.

Every turn ends, whatever raises. `timeouts.total_s` bounds the whole turn; an exception inside
an attempt (an adapter that could not build or read a call) is that attempt's `internal`
failure and the walk goes on; an exception in relayline's own machines or in the consumer's
sink settles the turn and propagates. In every case the turn's probes are handed back, so no
crash can hold a half-open breaker.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Protocol, TypeGuard

import trio

from relayline.machines import classify as fc
from relayline.machines import wire
from relayline.machines.config import Secret, Timeouts
from relayline.machines.errors import RelaylineError
from relayline.machines.health import HealthStore
from relayline.machines.ledger import Usage
from relayline.machines.plan import PlannedEntry
from relayline.machines.turn import Action, Completion, Finish, Turn, TurnResult
from relayline.machines.vocab import Mode
from relayline.machines.walk import Call, Sleep

from .attempt_clock import AttemptClock
from .providers.base import CallRequest, ProviderClient, ProviderFailure
from .sinks import DISCARD, Sink
from .stream_attempt import Escalated, StreamAttempts

log = logging.getLogger("relayline.driver")


SETTLE_SYNC_S = 5.0


class FleetHealth(HealthStore, Protocol):
    """A health store a fleet's workers share (stores/health.py): synced with the fleet before
    each decision of a turn, and told at the turn's end what the turn did (`pending`); the
    gateway's readiness says whether it answers (`reachable`) and `where` it is."""

    where: str

    @property
    def pending(self) -> bool: ...

    @property
    def reachable(self) -> bool: ...

    async def sync(self, profiles: Iterable[str]) -> None: ...


def is_fleet(store: HealthStore) -> TypeGuard[FleetHealth]:
    """A store shared by a fleet (the store may be any HealthStore: one is told by its `sync`)."""
    return hasattr(store, "sync")


def _whole(completion: Completion | fc.Failure) -> bool:
    """An answer the turn can end with: nothing of the fleet's health needs reading before it."""
    return isinstance(completion, Completion) and completion.has_answer


def _cancellation(exc: BaseException) -> bool:
    """trio.Cancelled, bare or as every member of a group: a nursery inside the transport (the
    connect's happy eyeballs) hands an outer cancellation on wrapped in a BaseExceptionGroup."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_cancellation(member) for member in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


class _Spent(Exception):
    """Carries an attempt's answer out of the turn's scope when the attempt's deadline passed in
    the very step the answer arrived (its read woke in the loop tick that expired the deadline):
    the answer stands, and the scope, already cancelled, would raise at its next checkpoint and
    blame the next attempt, or the turn's budget, for it."""

    def __init__(self, answer: Completion | fc.Failure) -> None:
        super().__init__()
        self.answer = answer


class TurnRun(StreamAttempts):
    """One turn's execution. `result` is set however the run ends, cancellation included. A
    streamed attempt's stream and frames (`_pump`, `consumer_paused`) are stream_attempt.py's."""

    def __init__(
        self,
        turn: Turn,
        clients: Mapping[str, ProviderClient],
        request: wire.Request,
        *,
        on_draft: Callable[[str], None] | None = None,
    ) -> None:
        self.turn = turn
        self.clients = clients
        self.request = request
        self.timeouts: Timeouts = turn.config.timeouts
        self.max_bytes = turn.config.limits.max_response_bytes
        self.on_draft = on_draft
        self.result: TurnResult | None = None
        self._frames_scope: trio.CancelScope | None = None  # the open stream's idle deadline
        self._scope: trio.CancelScope | None = None  # the turn's (run()), its deadline moved
        self.cancelled = False  # cancel(): the owner's word, kept for a scope not yet open
        self._budget = math.inf  # when timeouts.total_s runs out
        self._clock: AttemptClock | None = None  # the non-streamed attempt in flight
        self._first_token_deadline = math.inf
        # a fleet's shared health (stores/health.py): its mirror is synced with the store before
        # each decision of the turn's machines, so each sees the fleet (an answer needs none:
        # whatever the fleet says, the turn is done), and what the turn did is pushed at its end
        store = turn.health.store
        self._store = store if is_fleet(store) else None

    async def _sync_health(self, *, read: bool = True) -> None:
        store = self._store
        if store is not None and (read or store.pending):
            await store.sync(
                tuple({e.profile: None for e in self.turn.plan.entries}) if read else ()
            )

    async def _sync_settled(self) -> None:
        """After a turn was settled by cancellation or a crash: its held probes go back to the
        fleet even though the turn's own scope is cancelled (bounded: a store may be down)."""
        if self._store is not None:
            with trio.move_on_after(SETTLE_SYNC_S) as scope:
                scope.shield = True
                await self._sync_health(read=False)

    async def run(self, sink: Sink = DISCARD) -> TurnResult:
        turn = self.turn
        try:
            # one cancel scope carries the turn's budget (timeouts.total_s) and, moved by each
            # attempt's clock, the attempt's own deadline: a scope costs more than the turn's
            # routing decision. An attempt that runs out ends the scope; the turn goes on in a
            # new one, with that attempt's timeout as its answer (or with the answer itself,
            # when it arrived in the tick that expired the deadline: _Spent).
            budget = trio.current_time() + self.timeouts.total_s
            action: Action | None = None
            # an attempt's answer the turn goes on with
            resume: Completion | fc.Failure | None = None
            while True:
                with trio.CancelScope(deadline=budget) as scope:
                    self._scope, self._budget = scope, budget
                    if self.cancelled:
                        scope.cancel()
                    try:
                        if resume is not None:
                            answer, resume = resume, None
                            action = await self._answered(answer, _whole(answer))
                        elif action is None:
                            # (no coroutine made for a store that is not a fleet's)
                            if self._store is not None:
                                await self._sync_health()
                            action = turn.start(trio.current_time())
                        while not isinstance(action, Finish):
                            if isinstance(action, Sleep):
                                await trio.sleep(action.seconds)
                                await self._sync_health()
                                action = turn.on_timer(trio.current_time())
                            elif action.mode == "stream":
                                # the pump awaited here, not from a coroutine around it: a held
                                # stream keeps every frame of its path
                                failure = await self._pump(action, sink)
                                action = await self._streamed(failure, sink)
                            else:
                                action = await self._complete(action)
                        finish = action
                    except Escalated as exc:
                        raise exc.error from None
                    except _Spent as spent:
                        resume = spent.answer
                        continue
                if not scope.cancelled_caught:
                    break
                timed_out, self._clock = self._clock, None
                if self.cancelled:
                    self.result = self._settle(turn.cancel)
                    await self._sync_settled()
                    return self.result
                if timed_out is None or not timed_out.ran_out():
                    finish = turn.expire(trio.current_time())
                    break
                resume = timed_out.failure()
            self.result = finish.result
            if self._store is not None:
                await self._sync_health(read=False)
            for event in finish.deliver:
                await sink(event)
            return self.result
        except BaseException as exc:
            # a cancellation (the owner's: never retried), or relayline's own bug or the consumer's
            # sink failing: the turn still ends, and the exception goes to whoever owns the turn
            # (the gateway answers a 500)
            cancelled = _cancellation(exc)
            if not cancelled:
                log.exception("turn_internal_error requested=%s", turn.plan.requested)
            if self.result is None:
                self.result = self._settle(turn.cancel if cancelled else turn.abort)
                await self._sync_settled()
            raise
        finally:
            turn.health.release_all()  # whatever happened above, no probe outlives its turn

    # -- what a stream's wire shows of the turn while it runs ------------------------------------

    @property
    def requested(self) -> str:
        """What the caller asked for, as the plan names it."""
        return self.turn.plan.requested

    def attempts_begun(self) -> int:
        """The attempts recorded so far and the one in flight (an attempt is recorded once it
        ends)."""
        turn = self.turn
        return len(turn.attempts) + (1 if turn.call is not None else 0)

    def showing(self) -> PlannedEntry | None:
        """The entry whose output the caller is shown, once that is certain: the served entry of
        a turn that ended, or the streaming call's once its stream committed (it said something
        decisive). Before then, none: a failure before commit may still hand the turn on."""
        if self.result is not None:
            return self.result.served
        turn = self.turn
        call, gate = turn.call, turn.gate
        if call is not None and call.mode == Mode.STREAM and gate is not None and gate.committed:
            return call.entry
        return None

    def usage_at_commit(self) -> Usage | None:
        """The usage the stream's gate read before its commit (what a stream's opening may
        carry), or None."""
        gate = self.turn.gate
        return gate.usage if gate is not None else None

    @property
    def budget(self) -> float:
        """When the turn's timeouts.total_s runs out (trio time; inf before it runs)."""
        return self._budget

    def cancel(self) -> None:
        """The owner's cancellation, for an owner with no cancel scope of its own around the run
        (the gateway's non-streamed turn: a client that hung up, a drain): the turn ends as
        cancelled, never retried, and run() returns that result where a scope's cancellation
        would raise trio.Cancelled to its owner."""
        self.cancelled = True
        if self._scope is not None:
            self._scope.cancel()

    def _settle(self, how: Callable[[float], Finish]) -> TurnResult:
        now = trio.current_time()
        try:
            return how(now).result
        except Exception:
            # the machines are broken beyond settling normally: build the result regardless
            log.exception("turn_settle_error requested=%s", self.turn.plan.requested)
            return self.turn.abort(now).result

    # -- one call -----------------------------------------------------------------------------

    def _request(self, call: Call, clock: AttemptClock | None = None,
                 waiting: Callable[[], Awaitable[None]] | None = None) -> CallRequest:
        entry = call.entry
        key: Secret | None
        if call.key_index is not None:
            key = entry.keys[call.key_index]
        else:
            key = entry.keys[0] if entry.keys else None
        request = self.request
        if call.prefill is not None:
            # the forwarded text as a trailing assistant message, byte for byte
            request = request.with_prefill(call.prefill)
        return CallRequest(entry, entry.model, request, key, call.key_index, call.mode == "stream",
                           call.probe,
                           self.turn.config.gateway.drop_unsupported_params,
                           clock=clock, max_bytes=self.max_bytes, waiting=waiting)

    def _client(self, call: Call) -> ProviderClient:
        family = call.entry.provider.family
        try:
            return self.clients[family]
        except KeyError:
            raise RelaylineError(f"no protocol adapter for family {family!r}",
                                 reason="config") from None

    def _internal(self, call: Call, exc: Exception) -> fc.Failure:
        """An exception inside an attempt: that attempt's failure (the walk goes on), logged
        once with its stack. Never a breaker failure: the provider may have done nothing wrong."""
        log.error("attempt_internal_error provider=%s model=%s error=%s", call.entry.profile,
                  call.entry.model,
                  type(exc).__name__, exc_info=exc)
        return fc.internal(exc)

    async def _complete(self, call: Call) -> Action:
        client = self._client(call)
        scope = self._scope
        assert scope is not None  # (run() opened it)
        # the attempt's deadline is the turn's scope's, moved (a timeout ends that scope: run())
        clock = self._clock = AttemptClock(scope, self.timeouts,
                                           from_write=getattr(client, "reports_sent", False),
                                           limit=self._budget)
        completion: Completion | fc.Failure
        try:
            completion = await client.complete(self._request(call, clock))
        except ProviderFailure as exc:
            completion = exc.failure
        except Exception as exc:
            completion = self._internal(call, exc)
        self._clock = None
        if scope.cancel_called and not self.cancelled:
            raise _Spent(completion)
        # the attempt's deadline goes back to the turn's budget before anything else is awaited:
        # a failure's next step waits for a fleet's health first; an answer's next step is
        # decided with nothing awaited, and is most often the turn's end, whose scope closes
        # with no checkpoint in between (a deadline set for nothing is a cost on every turn)
        answered = _whole(completion)
        if not answered and scope.deadline != self._budget:
            scope.deadline = self._budget
        action = await self._answered(completion, answered)
        if answered and not isinstance(action, Finish) and scope.deadline != self._budget:
            scope.deadline = self._budget
        return action

    async def _answered(self, completion: Completion | fc.Failure, answered: bool) -> Action:
        """The turn's next action after an attempt's answer or failure (`answered`: `_whole`)."""
        if not answered and self._store is not None:
            await self._sync_health()
        try:
            return self.turn.on_completion(completion, trio.current_time())
        except Exception as exc:
            raise Escalated(exc) from None

    async def _streamed(self, failure: fc.Failure | None, sink: Sink) -> Action:
        """The turn's next action once a stream attempt ended (`failure`: None when it
        completed)."""
        turn = self.turn
        drained = getattr(sink, "drained", None)
        if drained is not None:
            # a sink that hands events on in batches: how the stream ended is decided once the
            # consumer took them all, so that one leaving before cancels the turn
            await drained()
        if failure is not None:
            await self._sync_health()
        now = trio.current_time()
        try:
            if failure is None:
                return turn.stream_done(now)
            gate = turn.gate
            assert gate is not None  # (the stream just ended was the gate's)
            if not gate.committed and self.on_draft is not None:
                self.on_draft("")  # a pre-commit fallback replaces the draft
            return turn.stream_failed(failure, now)
        except Exception as exc:
            raise Escalated(exc) from None

