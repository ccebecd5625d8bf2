"""A streamed turn as the embedder reads it (`Relay.stream`): its events handed from the trio run
the turn runs in to the caller's code, under trio (in the same run), asyncio (relayline's
runtime thread) or plain threads, and its result after the block."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Awaitable, Callable
from functools import partial
from types import TracebackType
from typing import Any

import trio

from relayline.machines import wire
from relayline.machines.ledger import LedgerRow, Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from .driver import TurnRun
from .hosts import Handoff, Outcome, Runtime, host, require_sync_host, settler, unwind
from .sinks import Sink
from .turns import raise_for, response_object


class _Batches:
    """How a streamed turn's events reach a consumer in the same trio run: the turn puts each
    event without a checkpoint, and the consumer takes whatever gathered in one wake-up (the
    frames of one upstream read, since the turn runs until its next read), then hands them out
    one per iteration with no trio call. An unbuffered channel cost two scheduler passes an
    event (bench/run.py's hand-off row).

    What the unbuffered channel guaranteed still holds. The turn decides how its stream ended
    only once the consumer took every event (`drained`), so a consumer that leaves early still
    cancels it; events it never took are withdrawn from what the turn counts as forwarded
    (`partial_text` is exactly what the consumer received); and the turn runs at most MAX_AHEAD
    events ahead of the consumer (beyond it, it waits, its idle deadline lifted: a slow
    consumer is not a stalled provider)."""

    MAX_AHEAD = 256

    __slots__ = ("run", "pending", "batch", "at", "closed", "left", "first", "_consumer",
                 "_producer", "_want")

    def __init__(self) -> None:
        self.run: TurnRun | None = None
        self.pending: list[Event] = []  # put, not taken yet
        self.batch: list[Event] = []  # taken, handed out from `at`
        self.at = 0
        self.closed = False  # the turn ended: nothing more comes
        self.left = False  # the consumer left (or cancelled): nothing more goes to it
        self.first = True  # no event was put yet
        self._consumer: trio.Event | None = None  # set for a consumer waiting for a batch
        self._producer: trio.Event | None = None  # set for a turn waiting for the consumer
        self._want = 0  # ... until this many events are left untaken

    # -- the turn's side: the driver's sink
    # ----------------------------------------------------------

    may_block = False  # bounded: when the turn must wait, it says so (consumer_paused)

    async def __call__(self, event: Event) -> None:
        if not event.visible:
            return
        if self.left:
            # the cancellation has not reached the turn yet (its read had completed): the event
            # it produced meanwhile is not the consumer's
            self._withdraw([event])
            return
        self.pending.append(event)
        if self._consumer is not None:
            self._consumer.set()
            self._consumer = None
        if self.first or len(self.pending) >= self.MAX_AHEAD:
            # the first event goes to the consumer at once, not after the rest of its read was
            # decoded (the first byte); later ones wait only for room, and then until half of
            # it is free (not woken again for each event taken)
            untaken = 0 if self.first else self.MAX_AHEAD // 2
            self.first = False
            assert self.run is not None
            with self.run.consumer_paused():
                await self._until(untaken)

    async def drained(self) -> None:
        """Every event put so far was handed to the consumer (or it left: then the turn is
        cancelled here, whether or not it had to wait)."""
        await self._until(0)
        await trio.lowlevel.checkpoint_if_cancelled()

    def _untaken(self) -> int:
        return len(self.pending) + len(self.batch) - self.at

    async def _until(self, untaken: int) -> None:
        while self._untaken() > untaken:
            self._want = untaken
            self._producer = trio.Event()
            await self._producer.wait()

    def close(self) -> None:
        self.closed = True
        if self._consumer is not None:
            self._consumer.set()

    # -- the consumer's side
    # ------------------------------------------------------------------------

    async def take(self) -> Event | None:
        """The next event, or None once the turn ended and every event was taken."""
        if self.at == len(self.batch):
            while not self.pending:
                if self.closed or self.left:
                    return None
                self._consumer = trio.Event()
                await self._consumer.wait()
            self.batch, self.pending = self.pending, self.batch
            self.pending.clear()
            self.at = 0
        event = self.batch[self.at]
        self.at += 1
        if self._producer is not None and self._untaken() <= self._want:
            self._producer.set()
            self._producer = None
        return event

    def leave(self) -> None:
        """The consumer leaves: what it did not take is withdrawn from the turn."""
        self.left = True
        untaken = self.batch[self.at:] + self.pending
        self.batch, self.pending, self.at = [], [], 0
        # (a turn waiting for the consumer is woken by the cancellation that follows)
        self._withdraw(untaken)

    def _withdraw(self, events: list[Event]) -> None:
        run = self.run
        if events and run is not None and run.result is None:  # a settled turn's record is final
            run.turn.withdraw(events)


class StreamTurn:
    """A streamed turn. Iterating yields immutable events only (text, reasoning, tool calls).

    The iteration ends cleanly when the turn succeeded, or when the consumer cancelled it
    (`cancel()`); otherwise it raises: `StreamInterruptedAfterOutput` when the stream failed
    after output (never replayed; what was forwarded is in `partial_text`), `TurnError` when no
    answer came. Leaving the block early cancels the turn (never a retry); so does cancelling
    the host's task. After the block: `outcome`, `partial_text`, `served`, `ledger`, `notice`,
    `result`.
    """

    def __init__(self, run_turn: Callable[..., Awaitable[TurnResult]],
                 request: wire.Request | None = None) -> None:
        self._run_turn = run_turn  # the relay's turn, its request bound (`Turns.run`)
        self._request = request
        self._run: TurnRun | None = None
        self._scope = trio.CancelScope()
        self._host = ""

    # -- the producer, in a trio run (the host's own, or the runtime's) ---------------------------

    async def _produce(self, sink: Sink) -> None:
        try:
            with self._scope:
                await self._run_turn(sink=sink, run_hook=self._attach)
        finally:
            if self._host == "trio":
                self._batches.close()
            else:
                self._handoff.close()

    def _attach(self, run: TurnRun) -> None:
        self._run = run
        if self._host == "trio":
            self._batches.run = run

    def cancel(self) -> None:
        """Cancel the turn from the consuming code: the iteration ends, never a retry."""
        if self._host == "trio":
            self._batches.leave()
            self._scope.cancel()
        elif self._host:
            Runtime.get().call_soon(self._scope.cancel)

    def _end(self) -> None:
        """The producer finished: a turn that did not answer raises, unless it was cancelled
        (by the consumer: any other cancellation reaches the host as its own exception)."""
        if self.result is not None and self.result.outcome != "cancelled":
            raise_for(self.result)

    # -- trio and asyncio hosts -----------------------------------------------------------------

    async def __aenter__(self) -> StreamTurn:
        self._host = host()
        if self._host == "trio":
            self._batches = _Batches()
            self._nursery_manager = trio.open_nursery()
            nursery = await self._nursery_manager.__aenter__()
            nursery.start_soon(self._produce, self._batches)
        elif self._host == "asyncio":
            self._handoff = Handoff()
            self._done: asyncio.Future[Outcome[None]] = asyncio.get_running_loop().create_future()
            Runtime.get().start(partial(self._produce, self._visible(self._handoff.send)),
                                settler(self._done))
        else:
            raise RuntimeError(f"relayline runs under trio or asyncio, not {self._host}")
        return self

    def __aiter__(self) -> StreamTurn:
        return self

    async def __anext__(self) -> Event:
        if self._host == "trio":
            taken = await self._batches.take()
            if taken is not None:
                return taken
        else:
            item: asyncio.Future[Event | None] = asyncio.get_running_loop().create_future()
            Runtime.get().call_soon(self._handoff.demand, settler(item))
            event = await item
            if event is not None:
                return event
        self._end()
        raise StopAsyncIteration

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._host == "trio":
            self.cancel()  # a no-op when the turn already finished
            try:
                await self._nursery_manager.__aexit__(exc_type, exc, tb)
            except BaseExceptionGroup as group:
                if exc is None or group.exceptions != (exc,):
                    raise
                # the block's own exception, wrapped by the nursery: it propagates as it was
        else:
            self.cancel()  # a no-op when the turn already finished
            await unwind(self._done)
            if exc is None:
                self._done.result().unwrap()

    # -- synchronous hosts ------------------------------------------------------------------------

    def __enter__(self) -> StreamTurn:
        require_sync_host("Relay.stream_sync")
        self._host = "sync"
        self._handoff = Handoff()
        self._finished: queue.SimpleQueue[Outcome[None]] = queue.SimpleQueue()
        Runtime.get().start(partial(self._produce, self._visible(self._handoff.send)),
                            self._finished.put)
        return self

    @staticmethod
    def _visible(send: Callable[[Event], Awaitable[None]]) -> Sink:
        async def sink(event: Event) -> None:
            if event.visible:
                await send(event)

        return sink

    def __iter__(self) -> StreamTurn:
        return self

    def __next__(self) -> Event:
        box: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        Runtime.get().call_soon(self._handoff.demand, box.put)
        event = box.get()
        if event is not None:
            return event
        self._end()
        raise StopIteration

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cancel()
        outcome = self._finished.get()
        if exc is None:
            outcome.unwrap()

    # -- after the block ------------------------------------------------------------------------

    @property
    def result(self) -> TurnResult | None:
        """Set however the turn ended: a cancelled turn's outcome is recorded before it unwinds."""
        return self._run.result if self._run else None

    @property
    def outcome(self) -> str | None:
        return self.result.outcome if self.result else None

    @property
    def partial_text(self) -> str | None:
        return self.result.partial_text if self.result else None

    @property
    def served(self) -> str | None:
        return self.result.served.label if self.result and self.result.served else None

    @property
    def ledger(self) -> tuple[LedgerRow, ...]:
        return self.result.ledger if self.result else ()

    @property
    def notice(self) -> str | None:
        return self.result.notice if self.result else None

    @property
    def finish_reason(self) -> str | None:
        result = self.result
        return (
            wire.finish_reason(result.finish_reason, len(result.tool_calls))
            if result and result.outcome == "ok"
            else None
        )

    @property
    def usage(self) -> Usage | None:
        return self.result.usage if self.result else None

    def response(self) -> dict[str, Any]:
        """After the block, the answer as the Responses API's `response` object (as
        `Reply.response()`), once the turn succeeded."""
        result = self.result
        if result is None or result.outcome != "ok":
            raise RuntimeError("response(): the turn has no answer (it has not ended, or did not "
                               "succeed)")
        return response_object(result, self._request)
