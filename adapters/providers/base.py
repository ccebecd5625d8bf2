"""What the driver needs from a provider protocol adapter, and what it hands one.

An adapter turns one `CallRequest` into either a `Completion` (complete mode) or a stream of
`Frame`s (stream mode), and every failure into a `ProviderFailure` carrying a classified
`Failure`. Entering `stream()` means the response headers arrived; iterating yields frames and
ends after the protocol's completion signal (a `done` frame). Ending without it is truncation,
which the driver reports; adapters never decide retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import attrs

from relayline.machines import wire
from relayline.machines.classify import Failure
from relayline.machines.config import Secret
from relayline.machines.plan import PlannedEntry
from relayline.machines.stream import Frame
from relayline.machines.turn import Completion

DONE = "done"  # the frame kind of a protocol's completion signal


class ProviderFailure(Exception):
    """A provider call failed; `failure` is already classified. The message is relayline's own."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.detail)
        self.failure = failure


def client_headers(headers: Iterable[tuple[str, str]], dialect: str) -> tuple[tuple[str, str], ...]:
    """The client request headers that travel to a provider of the dialect's own family: the
    API's version and feature flags, never credentials or hop-by-hop headers. (The gateway
    decodes for it only the names these start with: app.py's `_TRAVELLING`.)"""
    if dialect == "anthropic":
        return tuple([(name, v) for k, v in headers if (name := k.lower()) in ("anthropic-beta", "anthropic-version")])
    return tuple([(name, v) for k, v in headers if (name := k.lower()).startswith("openai-")])


@attrs.frozen
class CallRequest:
    entry: PlannedEntry
    model: str
    request: wire.Request
    key: Secret | None = attrs.field(default=None, repr=False)
    key_index: int | None = None
    stream: bool = False
    probe: bool = False
    drop_unsupported: bool = False  # [gateway] drop_unsupported_params: drop what the entry cannot honour
    # the driver's AttemptClock: an adapter that can tell calls `sent()` once the request is
    # written, `headers()` when the response headers arrived, `received()` per body chunk
    clock: AttemptClockLike | None = attrs.field(default=None, eq=False, repr=False)
    max_bytes: int = 32 * 1024 * 1024  # limits.max_response_bytes: a larger body is too_large
    # the consumer's `waiting` (a stream's sink that gathers what it writes): an adapter that
    # reports waits (`reports_waits = True`) awaits it before each read of the stream's body that
    # may block, so what the frames of the last read rendered goes out before the wait
    waiting: Callable[[], Awaitable[None]] | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def dropped(self) -> tuple[str, ...]:
        if not self.drop_unsupported:
            return ()
        provider = self.entry.provider
        return wire.droppable(self.request, provider.family, provider.capabilities)

    def wire_request(self) -> wire.Request:
        """The canonical request as this entry is sent it (unsupported fields dropped if asked)."""
        return wire.without(self.request, self.dropped)

    def forwarded_headers(self, family: str) -> tuple[tuple[str, str], ...]:
        """The client's headers that travel to a provider of `family` (its own dialect's)."""
        request = self.request
        if request.passthrough is None or request.source != family:
            return ()
        return request.passthrough.headers


class AttemptClockLike(Protocol):
    def sent(self) -> None: ...

    def headers(self) -> None: ...

    def received(self) -> None: ...

    def read(self) -> None: ...


class ProviderClient(Protocol):
    # optional: `reports_sent = True` when the adapter calls `request.clock.sent()`; otherwise
    # the headers clock starts with the call. `reports_waits = True` when a stream awaits
    # `request.waiting` before each body read; otherwise the driver awaits it after each frame
    async def complete(self, request: CallRequest) -> Completion: ...

    def stream(self, request: CallRequest) -> AbstractAsyncContextManager[AsyncIterator[Frame]]: ...
