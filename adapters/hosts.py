"""How asyncio and synchronous hosts reach the trio driver.

trio drives every turn. A trio host runs its turns in its own run. Every other host, an asyncio
loop (FastAPI, notebooks, agent frameworks) or a plain thread (scripts, thread-based servers),
hands its turns to one trio run in a daemon thread that the whole process shares: the runtime.
One run owning every non-trio turn keeps what turns share in one thread, as the machines expect
(health stores, pooled connections, a relay's routing state), whatever mix of hosts and threads
calls in. bench/hosts.py measures this bridge against trio's guest mode; docs/library.md says why.

A bridged call is a trio task under its own cancel scope. The host waits for it in its own way
(an asyncio future, a queue); when the host gives up (a cancelled asyncio task, an interrupted
thread), the scope is cancelled and the host waits until the task has unwound, so the turn has
recorded its cancellation, and can never retry, before the host's own cancellation continues.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import sniffio
import trio

T = TypeVar("T")


class Outcome(Generic[T]):
    """A bridged call's value or exception, carried across threads."""

    __slots__ = ("value", "error")

    def __init__(self, value: T | None = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error

    def unwrap(self) -> T:
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class RuntimeStopped(RuntimeError):
    """The runtime thread ended (interpreter shutdown) before a bridged call finished."""


class Call(Generic[T]):
    """One async function running in the runtime on behalf of a foreign host."""

    def __init__(self, runtime: Runtime, fn: Callable[[], Awaitable[T]],
                 deliver: Callable[[Outcome[T]], None]) -> None:
        self._runtime = runtime
        self._fn = fn
        self._deliver = deliver
        self._scope = trio.CancelScope()

    async def run(self) -> None:
        outcome: Outcome[T] = Outcome(error=RuntimeStopped("relayline's runtime stopped"))
        try:
            with self._scope:
                try:
                    outcome = Outcome(await self._fn())
                except trio.Cancelled:
                    # a host that cancelled raises its own exception; this one is for a runtime
                    # that stopped under the call
                    outcome = Outcome(error=RuntimeStopped("relayline's runtime stopped"))
                    raise
                except BaseException as exc:  # handed to the host, which raises it
                    outcome = Outcome(error=exc)
        finally:
            self._deliver(outcome)

    def cancel(self) -> None:
        """From any thread: cancel the call (a no-op once it finished)."""
        self._runtime.call_soon(self._scope.cancel)


class Runtime:
    """A trio run in a daemon thread, shared by every Relay in the process."""

    _lock = threading.Lock()
    _current: Runtime | None = None

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=self._main, name="relayline-runtime", daemon=True)
        self._thread.start()
        self._ready.wait()

    @classmethod
    def get(cls) -> Runtime:
        with cls._lock:
            if cls._current is None or not cls._current._thread.is_alive():
                cls._current = Runtime()
                atexit.register(cls._current.stop)
            return cls._current

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        """The run's main task: a nursery for bridged calls, until `stop`."""
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await trio.sleep_forever()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run a synchronous callback in the runtime's trio run, from any thread."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise RuntimeStopped("relayline's runtime stopped") from None

    def start(self, fn: Callable[[], Awaitable[T]], deliver: Callable[[Outcome[T]], None]
              ) -> Call[T]:
        call = Call(self, fn, deliver)
        assert self._nursery is not None
        self.call_soon(self._nursery.start_soon, call.run)
        return call

    def stop(self) -> None:
        if self._nursery is not None and self._thread.is_alive():
            try:
                self.call_soon(self._nursery.cancel_scope.cancel)
            except RuntimeStopped:
                return
            self._thread.join(5)


def host() -> str:
    """"trio", "asyncio", or "sync" (no async library is running in this thread)."""
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return "sync"


def require_sync_host(what: str) -> None:
    """A blocking call inside an event loop would stall every task of that loop."""
    kind = host()
    if kind != "sync":
        raise RuntimeError(f"{what} blocks its thread; from {kind} code use the async API "
                           f"(await relay.complete(...), async with relay.stream(...))")
    if threading.current_thread() is Runtime.get().thread:
        raise RuntimeError(f"{what} cannot run on relayline's own runtime thread")


async def run_from_asyncio(fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()` run in the runtime. Cancelling the awaiting task cancels it there, waits
    until it unwound, then raises CancelledError."""
    done: asyncio.Future[Outcome[T]] = asyncio.get_running_loop().create_future()
    call = Runtime.get().start(fn, settler(done))
    try:
        outcome = await asyncio.shield(done)
    except asyncio.CancelledError:
        call.cancel()
        await unwind(done)
        raise
    return outcome.unwrap()


async def unwind(done: asyncio.Future[Any]) -> None:
    """Wait, through further cancellations, for a cancelled call to finish unwinding: bounded,
    since trio delivers the cancellation at the call's next checkpoint."""
    while not done.done():
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            continue


def settler(future: asyncio.Future[T]) -> Callable[[T], None]:
    """A callback, for any thread, that settles `future` on its loop (unless it was cancelled)."""
    loop = future.get_loop()

    def settle(value: T) -> None:
        if not future.done():
            future.set_result(value)

    def settle_soon(value: T) -> None:
        loop.call_soon_threadsafe(settle, value)

    return settle_soon


def run_from_thread(fn: Callable[[], Awaitable[T]]) -> T:
    """Block this thread on `fn()` run in the runtime. An exception that interrupts the wait
    (KeyboardInterrupt) cancels the call and waits until it unwound before propagating."""
    box: queue.SimpleQueue[Outcome[T]] = queue.SimpleQueue()
    call = Runtime.get().start(fn, box.put)
    try:
        outcome = box.get()
    except BaseException:
        call.cancel()
        box.get()
        raise
    return outcome.unwrap()


async def run_in_host(fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()` (trio code) from whichever async library runs this task."""
    kind = host()
    if kind == "trio":
        return await fn()
    if kind == "asyncio":
        return await run_from_asyncio(fn)
    raise RuntimeError(f"relayline runs under trio or asyncio, not {kind}")


class Handoff:
    """Hands a trio producer's events to a consumer in another thread, one event per demand,
    so that an event is sent only to a consumer that asked for it, as with an unbuffered
    channel. Lives in the runtime: `demand` arrives through `Runtime.call_soon`, `send` is the
    producer's sink, and `deliver(None)` tells the consumer the producer finished."""

    def __init__(self) -> None:
        self._deliver: Callable[[Any], None] | None = None
        self._wanted = trio.Event()
        self._closed = False

    def demand(self, deliver: Callable[[Any], None]) -> None:
        if self._closed:
            deliver(None)
        else:
            self._deliver = deliver
            self._wanted.set()

    async def send(self, event: object) -> None:
        await self._wanted.wait()
        self._wanted = trio.Event()
        deliver, self._deliver = self._deliver, None
        assert deliver is not None
        deliver(event)

    def close(self) -> None:
        self._closed = True
        if self._deliver is not None:
            deliver, self._deliver = self._deliver, None
            deliver(None)
