"""Where a streamed turn's events go: the `Sink` the driver awaits with each event, the optional
parts a sink may have (the driver looks each up by name), and `DISCARD`, the sink of a turn
nobody streams to."""

from __future__ import annotations

from typing import Protocol

from relayline.machines.stream import Event


class Sink(Protocol):
    """Where a turn's events go: awaited with each one, in order. A plain async function is a
    sink; a sink may also have any of the parts PacedSink, DrainingSink and GatheringSink name,
    which the driver looks up by name."""

    async def __call__(self, event: Event, /) -> None: ...


class PacedSink(Sink, Protocol):
    """A sink that says whether awaiting it may wait on a consumer reading at its own pace. True
    (also a sink that says nothing): the stream's idle deadline is lifted while it runs, a slow
    consumer is not a stalled provider. False: it waits only within a bound of its own, and says
    so with `TurnRun.consumer_paused` (TurnRun._frames)."""

    may_block: bool


class DrainingSink(Sink, Protocol):
    """A sink that hands events on in batches (TurnRun._streamed)."""

    async def drained(self) -> None:
        """Return once every event put so far was taken by the consumer."""


class GatheringSink(Sink, Protocol):
    """A sink that gathers what it writes (TurnRun._pump)."""

    async def waiting(self) -> None:
        """Send what was gathered: the driver is about to wait on the upstream."""


class Discard:
    """The sink of a turn nobody streams to: each event dropped, never a wait."""

    may_block = False

    async def __call__(self, event: Event, /) -> None:
        return None


DISCARD = Discard()
