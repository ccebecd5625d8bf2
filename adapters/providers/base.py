"""What the driver needs from a provider protocol adapter, and what it hands one.

An adapter turns one `CallRequest` into either a `Completion` (complete mode) or a stream of
`Frame`s (stream mode), and every failure into a `ProviderFailure` carrying a classified
`Failure`. Entering `stream()` means the response headers arrived; iterating yields frames and
ends after the protocol's completion signal (a `done` frame). Ending without it is truncation,
which the driver reports; adapters never decide retries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import attrs

from relayline.machines import dropping, wire
from relayline.machines.config import Provider, Secret
from relayline.machines.plan import PlannedEntry
from relayline.machines.stream import Frame
from relayline.machines.turn import Completion

from .. import jsoncodec
from ..codecs.common import ProviderFailure as ProviderFailure  # (the families' and the driver's)

DONE = "done"  # the frame kind of a protocol's completion signal




# the client request headers each family's own API reads, forwarded to a provider of the family
# the client spoke: the API's version and feature flags, never a credential or a billing choice
FAMILY_HEADERS = {"openai": frozenset({"openai-beta"}),
                  "anthropic": frozenset({"anthropic-beta", "anthropic-version"})}
TRAVELLING = frozenset().union(*FAMILY_HEADERS.values())




def credential(provider: Provider, key: Secret, family_header: str, family_value: str
               ) -> tuple[str, str]:
    """The header that carries a profile's key: the family's own (`family_header: family_value`),
    or the one the profile names in `auth_header`, with the key as is."""
    if provider.auth_header:
        return provider.auth_header.lower(), key.reveal()
    return family_header, family_value


@attrs.frozen
class CallRequest:
    entry: PlannedEntry
    model: str
    request: wire.Request
    key: Secret | None = attrs.field(default=None, repr=False)
    key_index: int | None = None
    stream: bool = False
    probe: bool = False
    # [gateway] drop_unsupported_params: drop what the entry cannot honour
    drop_unsupported: bool = False
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
        return dropping.droppable(self.request, provider.family, provider.capabilities)

    def wire_request(self) -> wire.Request:
        """The canonical request as this entry is sent it (unsupported fields dropped if asked)."""
        return dropping.without(self.request, self.dropped)

    def body_bytes(self, body: dict[str, Any], sent: wire.Passthrough | None) -> bytes:
        """`body` as the upstream request's bytes. When it is the client's own body (`sent`, the
        passthrough it was rendered from) with at most members appended, the client's bytes are
        sent (`jsoncodec.dumps_appended`): as the client wrote them, and not written anew. The
        bytes are held no more once any request of the turn was built (`wire.ReadBytes`)."""
        own = self.request.passthrough
        read = own.read if own is not None else None
        if read is not None:
            data = read.take(sent.body if sent is not None else None)
            if data is not None and sent is not None:
                out = jsoncodec.dumps_appended(data, sent.body, body)
                if out is not None:
                    return out
        return jsoncodec.dumps_kept(body)

    def forwarded_headers(self, family: str) -> tuple[tuple[str, str], ...]:
        """The client's headers this entry is sent: those its profile names in `forward_headers`,
        and to a provider of `family` when the client spoke it, the family's own version and beta
        headers."""
        passthrough = self.request.passthrough
        if passthrough is None or not passthrough.headers:
            return ()
        named = self.entry.provider.forward_headers
        # the family's own headers go where the client's body goes as sent (its own dialect)
        capabilities = self.entry.provider.capabilities
        own = FAMILY_HEADERS[family] if wire.passes_through(self.request, family, capabilities) \
            else frozenset()
        if not named:
            return tuple([(k, v) for k, v in passthrough.headers if k in own])
        wanted = own | {name.lower() for name in named}
        return tuple([(k, v) for k, v in passthrough.headers if k in wanted])

    def forwarded_query(self, family: str) -> str:
        """The query of the client's URL, sent on to a provider of the family the client spoke
        (across families its parameters would mean nothing, or something else)."""
        passthrough = self.request.passthrough
        capabilities = self.entry.provider.capabilities
        if passthrough is None or not wire.passes_through(self.request, family, capabilities):
            return ""
        return passthrough.query


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
