"""A streamed answer on the wire: `StreamWire` holds its headers until the turn commits, then
writes its frames through a bounded buffer in the turn's own task; `GateTimer` commits the held
headers of every stream whose `timeouts.gate_commit_s` passed with nothing decisive, from one
task for the whole gateway.

A streamed request sends nothing, not even response headers, until the turn commits (its first
decisive frame), so a turn that fails or recovers before commit can still answer with a proper
status code and a clean body. After commit, a failure ends the stream with an explicit error
event and no `[DONE]`, never a clean-looking truncated success."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import trio

from relayline.machines import wire
from relayline.machines.plan import PlannedEntry
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult

from ..driver import TurnRun
from .bookkeeping import dropped_header
from .http11 import Message, Send

if TYPE_CHECKING:
    from ..codecs.dialects import Dialect

log = logging.getLogger("relayline.gateway")

SEND_GRACE_S = 10.0
# a held stream's entry in the gate timer's heap: [deadline, order, wire (None once released),
# the timer]; a list, so that the heap orders entries by deadline and then order, and a release
# clears the wire in place
_GateEntry = list[Any]


class StreamWire:
    """One streamed response: held headers, the commit, and a bounded write buffer; the driver's
    sink for the turn.

    The dialect renders; the wire decides when bytes go out. It has no task of its own (a task
    with its nursery and scopes would be memory every stream in flight holds): events are rendered
    into a pending buffer, and the turn's own task writes it, in one ASGI send, when the
    upstream adapter is about to wait for its next read (`waiting`), so the frames of one read
    leave together and an idle stream still sends each frame at once. The answer's first
    decisive event (with the headers and what the gate held before it, unless the gate timer
    wrote those already) is written at once, not with the rest of its read; past MAX_PENDING the
    turn writes before it renders more. A client that reads slowly holds the turn's write, and
    with it the next upstream read (TCP backpressure), its idle deadline lifted meanwhile (a
    slow reader is not a stalled provider). The held headers are committed after
    `gate_commit_s` with nothing decisive by the gateway's one gate timer (`GateTimer`), whatever
    the turn is waiting on.
    """

    MAX_PENDING = 256 * 1024

    __slots__ = ("send", "run", "request", "render", "started", "_head", "_pending",
                 "_pending_bytes", "_sending", "_shown",
                 "_ending", "_committing", "_gate", "_cancel_turn", "_unnamed")

    def __init__(self, turn_id: str, send: Send, dialect: Dialect, request: wire.Request) -> None:
        self.send = send
        self.run: TurnRun | None = None  # the turn's, once it exists
        self.request = request
        self.render = dialect.stream_renderer(turn_id, request)
        self.started = False
        self._head: Message | None = None  # the response's start, written with the first bytes
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._sending: trio.CancelScope | None = None
        self._shown = False  # the answer's first decisive event was written
        self._ending = False
        self._committing: trio.Event | None = None  # while the gate timer writes the held commit
        self._gate: _GateEntry | None = None  # the gate timer's entry, while the gate holds
        self._cancel_turn: Callable[[], None] | None = None
        self._unnamed = False  # committed before anything served: the chunks name no model yet

    def bind(self, run: TurnRun, cancel_turn: Callable[[], None]) -> None:
        """The turn this stream shows, once it exists, and what cancels it: its run, or the scope
        around it."""
        self.run = run
        self._cancel_turn = cancel_turn

    def cancel(self) -> None:
        """A hang-up or a drain: the turn is cancelled, and a write in progress gets
        SEND_GRACE_S."""
        self.ending()
        if self._cancel_turn is not None:
            self._cancel_turn()

    def _served_entry(self) -> PlannedEntry | None:
        """The entry that serves what this stream shows, once that is certain (`TurnRun.showing`).
        Headers the gate timer commits before then name no one: a pre-commit failure may still
        hand the turn to another entry."""
        run = self.run
        return run.showing() if run is not None else None

    def _paused(self) -> AbstractContextManager[None]:
        """The turn's upstream idle deadline lifted while it waits for the client."""
        return self.run.consumer_paused() if self.run is not None else contextlib.nullcontext()

    async def _send_whole(self, message: Message) -> None:
        # a write begun must finish (bytes taken from the buffer would otherwise be lost, and a
        # chunk cut in two would garble the stream for the error event a drain still sends): at
        # the client's pace while the turn runs, SEND_GRACE_S at most once it ended. The shield
        # also keeps the turn's own deadline out, and the write runs in the turn's task: so the
        # turn's budget (timeouts.total_s) bounds it here, or a client that stopped reading would
        # hold the turn and its upstream connection until the server's send watchdog
        with trio.CancelScope(shield=True) as scope:
            if self._ending:
                scope.deadline = trio.current_time() + SEND_GRACE_S
            elif self.run is not None:
                scope.deadline = self.run.budget + SEND_GRACE_S
            self._sending = scope
            try:
                await self.send(message)
            finally:
                self._sending = None

    def ending(self) -> None:
        """The turn is over: a write still in progress gets SEND_GRACE_S, not the client's pace."""
        self._ending = True
        self._disarm()
        if self._sending is not None:
            self._sending.deadline = trio.current_time() + SEND_GRACE_S

    def _disarm(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate[3].release(gate)

    def commit(self) -> None:
        """The held headers and the dialect's opening, queued for the first write."""
        if self.started:
            return
        self.started = True
        self._disarm()
        entry = self._served_entry()
        run = self.run
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        if entry is not None:
            headers.append((b"x-relayline-served", entry.label.encode()))
        elif run is None or run.result is not None:
            headers.append((b"x-relayline-served", b"none"))  # the turn ended with no answer
        else:
            self._unnamed = True  # (the final event says who served: `finish`)
        if run is not None:
            headers.append((b"x-relayline-requested", run.requested.encode()))
            # the attempt in flight is not recorded yet; a recovered answer's already is
            headers.append((b"x-relayline-attempts", str(run.attempts_begun()).encode()))
        headers += dropped_header(self.request, entry)
        self._head = {"type": "http.response.start", "status": 200, "headers": headers}
        usage = run.usage_at_commit() if run is not None else None
        self._put(self.render.opening(entry.model if entry is not None else "", usage))

    async def at_gate(self) -> None:
        """`gate_commit_s` passed with nothing decisive: the held headers and preamble go out (a
        slow model is not an error). Run by the gate timer's task while the turn waits; the
        turn's own writes wait for it (`_committing`)."""
        if self.started or self._ending:
            return
        done = self._committing = trio.Event()
        try:
            self.commit()
            await self._write()
        finally:
            self._committing = None
            done.set()

    async def settled(self) -> None:
        """A commit the gate timer began is written whole (before the answer's end, or before
        the request returns)."""
        if self._committing is not None:
            await self._committing.wait()

    def _put(self, data: bytes) -> None:
        if data:
            self._pending.append(data)
            self._pending_bytes += len(data)

    async def _write(self) -> None:
        head, self._head = self._head, None
        if head is not None:
            await self._send_whole(head)
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._pending_bytes = 0
            await self._send_whole({"type": "http.response.body", "body": data, "more_body": True})

    async def _flush(self) -> None:
        await self.settled()
        with self._paused():
            await self._write()

    async def __call__(self, event: Event) -> None:
        if not event.visible:
            # what the stream said of itself (a Responses stream's id)
            if event.ref and not self.started:
                self.render.event(event)
            return  # held protocol frames: the dialect's preamble is rendered at commit
        if not self._shown:
            await self._first(event)
            return
        if self._unnamed:
            self._name_served()
        # nearly every frame: queued inline (no coroutine of its own for each step)
        data = self.render.event(event)
        if data:
            self._pending.append(data)
            self._pending_bytes += len(data)
            if self._pending_bytes > self.MAX_PENDING:
                await self._flush()

    def _name_served(self) -> None:
        """The chunks name who serves them from the first served after headers the gate timer
        sent (which named no one)."""
        entry = self._served_entry()
        if entry is not None:
            self._unnamed = False
            self.render.serving(entry.model)

    async def _first(self, event: Event) -> None:
        """An event up to the answer's first decisive one. That one goes out at once, with what
        is pending before it (the headers, the opening and what the gate held, or the rest of
        them the gate timer did not write), not once the rest of its upstream read is rendered: a
        burst's first token does not wait for its last. A client slow to take it is not a
        stalled provider (`_flush`)."""
        if not self.started:
            self.commit()
        elif self._unnamed:
            self._name_served()
        self._put(self.render.event(event))
        if event.decisive:
            self._shown = True
            await self._flush()
        elif self._pending_bytes > self.MAX_PENDING:
            await self._flush()

    # bounded buffer: when it must wait for the client, it says so (consumer_paused)
    may_block = False

    async def waiting(self) -> None:
        """The upstream adapter is about to wait for its next read: what gathered goes out."""
        if self._pending or self._committing is not None:
            await self._flush()

    async def finish(self, result: TurnResult, relayline: dict[str, Any]) -> None:
        """The end of the response; whatever was not sent yet goes first (after `settled`: a
        commit the gate timer began is written whole)."""
        self.commit()  # an answer with nothing to show (a refusal) still is a stream
        body = (
            self.render.ok(result, relayline)
            if result.outcome == "ok"
            else self.render.failed(result, relayline)
        )
        head, self._head = self._head, None
        if head is not None:
            await self.send(head)
        body = b"".join(self._pending) + body
        self._pending.clear()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


class GateTimer:
    """Every held stream's gate deadline, served by one task for the whole gateway: a heap of
    deadlines, not a timer task per stream (docs/performance-history.md: each task is memory). A
    stream that commits or ends first only clears its entry; when a deadline passes with the
    stream still held, a short task of the timer's own writes its commit (`StreamWire.at_gate`:
    the stream's turn task is busy waiting on the upstream). The task ends when no gate holds and
    starts again with the next one."""

    __slots__ = ("_heap", "_count", "_live", "_sleep", "_runner")

    def __init__(self) -> None:
        self._heap: list[_GateEntry] = []
        self._count = itertools.count()
        self._live = 0
        self._sleep: trio.CancelScope | None = None
        self._runner: object | None = None  # the task serving the heap (a token of its own)

    @property
    def held(self) -> int:
        """The streams whose gate still holds."""
        return self._live

    @property
    def queued(self) -> int:
        """The entries in the heap, those of streams that committed early and are not cleared yet
        among them."""
        return len(self._heap)

    def hold(self, stream: StreamWire, deadline: float) -> None:
        entry = [deadline, next(self._count), stream, self]
        stream._gate = entry
        heapq.heappush(self._heap, entry)
        self._live += 1
        if self._runner is None:
            self._runner = object()
            trio.lowlevel.spawn_system_task(self._run, self._runner, name="relayline gate timer")
        elif self._sleep is not None and deadline < self._sleep.deadline:
            self._sleep.deadline = deadline  # (a reload shortened gate_commit_s)

    def release(self, entry: _GateEntry) -> None:
        """The stream committed or ended (or its deadline came): its entry no longer holds it."""
        entry[2] = None
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            # entries cleared by streams that committed early leave the heap in bulk, not one by
            # one when their deadline comes: thousands of streams may commit within
            # gate_commit_s (the timer's task only yields in its sleep, which looks again)
            self._heap = [entry for entry in self._heap if entry[2] is not None]
            heapq.heapify(self._heap)

    async def _run(self, token: object) -> None:
        try:
            async with trio.open_nursery() as nursery:
                while self._heap:  # (a release may compact it into a new list: looked up each time)
                    deadline, _, stream, _ = self._heap[0]
                    if stream is None:
                        heapq.heappop(self._heap)
                        continue
                    if deadline > trio.current_time():
                        with trio.CancelScope(deadline=deadline) as self._sleep:
                            await trio.sleep_forever()
                        self._sleep = None
                        continue
                    heapq.heappop(self._heap)
                    stream._disarm()
                    nursery.start_soon(self._commit, stream)
                # a gate held from now on starts a new task (this one waits for its commits)
                self._runner = None
        except Exception:  # a system task's error would end the whole run: log it instead
            log.exception("gate_timer_error")
        finally:
            # cancelled with the run (or failed): no gate outlives its task
            if self._runner is token:
                for entry in self._heap:
                    if entry[2] is not None:
                        entry[2]._gate = None
                self._heap, self._live = [], 0
                self._runner = self._sleep = None

    @staticmethod
    async def _commit(stream: StreamWire) -> None:
        try:
            await stream.at_gate()
        except Exception:
            log.exception("gate_commit_error")
