"""The chat turns a gateway has in flight: their count (the shedding limit), what cancels each
(a drain that runs out of time cancels them all), and the relay each runs on, so that a relay a
reload retired is closed when its last turn ends."""

from __future__ import annotations

from typing import Protocol

import trio


class Canceller(Protocol):
    """What cancels one turn: its run, its stream's wire, or the cancel scope around it."""

    def cancel(self) -> None: ...


class TurnsInFlight:
    """The chat turns in flight and the drain that ends them."""

    def __init__(self) -> None:
        self.count = 0
        self.draining = False
        self.cancellers: set[Canceller] = set()
        self._cancelled_by_drain: set[Canceller] = set()
        self._cut = False  # the drain ran out of time: a turn that starts now is cancelled at once
        self._idle = trio.Event()
        self._idle.set()
        self._on_relay: dict[object, int] = {}  # turns in flight per relay (a reload retires one)

    def shed(self, limit: int) -> str | None:
        """Why a new chat request is turned away before its body is read, or None to serve it."""
        if self.draining:
            return "the gateway is shutting down"
        if limit and self.count >= limit:
            return f"{limit} turns are in flight, the limit"
        return None

    def enter(self) -> None:
        self.count += 1
        if self._idle.is_set():
            self._idle = trio.Event()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    def admit(self, owner: Canceller) -> None:
        """A turn's canceller joins those a drain cancels (at once, when the drain ran out of
        time)."""
        self.cancellers.add(owner)
        if self._cut:
            self._cancelled_by_drain.add(owner)
            owner.cancel()

    def forget(self, owner: Canceller | None) -> None:
        if owner is not None:
            self.cancellers.discard(owner)

    def drained(self, owner: Canceller | None) -> bool:
        """Whether the drain cancelled this turn; asked once, as its turn ends."""
        if owner in self._cancelled_by_drain:
            self._cancelled_by_drain.discard(owner)
            return True
        return False

    def on(self, relay: object) -> None:
        """A turn starts on `relay`, and runs on it to its end whatever a reload does."""
        self._on_relay[relay] = self._on_relay.get(relay, 0) + 1

    def off(self, relay: object) -> bool:
        """A turn on `relay` ended: whether it was the last one on it."""
        self._on_relay[relay] -= 1
        if self._on_relay[relay]:
            return False
        del self._on_relay[relay]
        return True

    def running_on(self, relay: object) -> int:
        return self._on_relay.get(relay, 0)

    async def drain(self, seconds: float) -> None:
        """Stop admitting turns, wait up to `seconds` for those in flight, then cancel the rest.
        Returns once no turn is in flight."""
        self.draining = True
        with trio.move_on_after(seconds):
            await self._idle.wait()
        self.cancel_all()
        await self._idle.wait()

    def cancel_all(self) -> None:
        self._cut = True
        for owner in list(self.cancellers):
            self._cancelled_by_drain.add(owner)
            owner.cancel()
