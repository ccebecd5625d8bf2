"""What the OpenAI-compatible and Anthropic adapters share: per-profile connection pools (of the
lean HTTP/1.1 client in providers/upstream.py), error bodies reduced to a classification, and
the SSE pump that turns response bytes into frames.

A protocol supplies three pure pieces: how to build the request, how to read a complete answer,
and a stream parser (SSE events in, frames out, with its own completion rule). Everything that
can go wrong on the wire becomes a `ProviderFailure` with a relayline-written detail; a provider's
body is read to classify it and then dropped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from types import TracebackType
from typing import Any, Protocol, cast

import attrs
import trio

from relayline.machines import classify as fc
from relayline.machines import wire
from relayline.machines.stream import Frame
from relayline.machines.turn import Completion

from .. import jsoncodec
from ..codecs.content_coding import UnsupportedEncoding
from ..codecs.http1 import FixedHead, UpstreamRequest, fixed_head
from ..redact import redact
from ..sse import SSEDecoder, SSEEvent, SSEProtocolError
from .base import DONE, CallRequest, ProviderFailure
from .httpx_pool import HttpxResponse
from .pool import Pools
from .upstream import Response, UpstreamError

log = logging.getLogger("relayline.providers")

# what a profile's pool answers with: the lean client's response, or httpx's behind a proxy
UpstreamResponse = Response | HttpxResponse

# the gateway's request id for the turn running in this task: sent upstream as x-request-id, so a
# provider's logs and ours can be joined (trio tasks inherit it from the request's handler)
REQUEST_ID: ContextVar[str | None] = ContextVar("relayline_request_id", default=None)
MAX_ERROR_BODY = 64 * 1024  # enough to classify; a provider's error page is not read further
PROCESS_PARSE_BYTES = 1 << 20  # above this a body is decoded off the event loop
FIRST_PIECE = 4096  # the part of a stream's first read decoded before the rest (see _frames)
DONE_GRACE_S = 0.01  # after a stream's completion signal: how long its body's end may take
# after a finish the protocol counts as complete at EOF (an OpenAI-compatible finish_reason): how
# long its usage chunk and `[DONE]` may take before the stream is taken as complete without them
# (the text is whole: a server that never ends the body must not turn it into a stall)
FINISH_GRACE_S = 1.0


class _Decoding:
    # where a large body is decoded: a worker process is the gateway's choice (`relayline serve`
    # turns it on). In a library host it stays a thread: a spawned worker re-imports the host's
    # main script (multiprocessing's rule), and a script without a __main__ guard would run again
    in_processes = False


def decode_in_worker_processes() -> None:
    """Decode large answers in worker processes from now on (the gateway: its event loop serves
    every client, and a JSON parse holds the GIL, so a thread would still stall it)."""
    _Decoding.in_processes = True


def decode_completion(protocol: WireProtocol, body: bytes | bytearray) -> Completion | fc.Failure:
    """A complete answer's body read into a Completion, or the failure it amounts to. Module-level
    and pure: it runs in a worker process for large bodies, so its failure comes back as a value."""
    try:
        obj = jsoncodec.loads(body)
    except ValueError:
        return fc.truncated("malformed response: not JSON")
    except RecursionError:
        return fc.malformed("nested too deeply")
    if not isinstance(obj, dict):
        return fc.malformed("not a JSON object")
    try:
        return protocol.completion(obj)
    except wire.WireError as exc:
        return fc.malformed(str(exc))


MAX_REJECTION_CHARS = 1000  # an upstream's rejection message given back to the client, at most


def error_text(body: bytes) -> str:
    """The classifiable part of an error body: codes, types and messages, never kept further."""
    try:
        obj = json.loads(body[:MAX_ERROR_BODY])
    except ValueError:
        return body[:2048].decode("utf-8", "replace")
    parts: list[str] = []

    def collect(value: object) -> None:
        if isinstance(value, dict):
            for key in ("code", "type", "message", "error", "status"):
                if key in value:
                    collect(value[key])
        elif isinstance(value, list):
            for item in value[:4]:
                collect(item)
        elif value is not None:
            parts.append(str(value))

    collect(obj)
    return " ".join(parts)


def _error_object(obj: object) -> dict[str, Any] | None:
    """The object that says what went wrong, in the shapes OpenAI-compatible servers answer:
    `{"error": {...}}` (OpenAI, Anthropic, most), a list of those (Gemini's OpenAI-compatible
    endpoint), or the error itself at the top (vLLM's `{"object": "error", "message": ...}`)."""
    if isinstance(obj, list) and obj:
        obj = obj[0]
    if not isinstance(obj, dict):
        return None
    error = obj.get("error")
    if isinstance(error, dict):
        return cast("dict[str, Any]", error)
    return cast("dict[str, Any]", obj) if obj.get("object") == "error" else None


def rejection(body: bytes) -> tuple[str | None, str | None]:
    """An error body's type and message (OpenAI's and Anthropic's shapes), bounded and with every
    configured secret masked: what a client whose request was rejected is told."""
    try:
        obj = json.loads(body[:MAX_ERROR_BODY])
    except ValueError:
        return None, None
    error = _error_object(obj)
    if error is None:
        return None, None
    kind = error.get("type") if isinstance(error.get("type"), str) else None
    kind = kind or (error.get("status") if isinstance(error.get("status"), str) else None)
    message = error.get("message") if isinstance(error.get("message"), str) else None
    return _bounded(kind), _bounded(message)


def _bounded(text: str | None) -> str | None:
    return redact(text)[:MAX_REJECTION_CHARS] if text else None


async def _finish_body(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows a stream's completion signal (the chunked terminator) when it is already
    here or comes within DONE_GRACE_S: a response closed before its end closes its connection, and
    the next turn pays for a new one (a TLS handshake upstream). Bounded in bytes and time."""
    seen = 0
    with trio.move_on_after(DONE_GRACE_S):
        async for rest in chunks:
            seen += len(rest)
            if seen > MAX_ERROR_BODY:
                return


def _after_finish(what: str) -> None:
    """What a provider sent after its stream's text was complete, unreadable: the stream stands
    as complete, and what was not read is said here (never its bytes: they may echo a prompt)."""
    log.warning("stream_unreadable_after_finish error=%s", redact(what)[:200])


class StreamParser(Protocol):
    done: bool  # the protocol's completion signal arrived

    def feed(self, event: SSEEvent) -> list[Frame]: ...

    def complete_at_eof(self) -> bool: ...


class WireProtocol(Protocol):
    def build(self, request: CallRequest) -> UpstreamRequest: ...

    def completion(self, body: dict[str, Any]) -> Completion: ...

    def parser(self) -> StreamParser: ...


def _unsupported(exc: UnsupportedEncoding) -> ProviderFailure:
    return ProviderFailure(fc.malformed(f"content-encoding {exc} (not asked for: relayline reads "
                                        "gzip and deflate)"))


# a kept head's key: its profile's and its key's ids, the forwarded fields and the query
_HeadKey = tuple[int, int, tuple[tuple[str, str], ...], str]


class FixedHeads:
    """A protocol's `FixedHead`s: one per profile, key, forwarded client headers and query, made by
    its first request and used by every request after it. Building each request's headers afresh
    (its dicts merged, its names folded, the key's header written) and checking each of them
    again in `render` was a large part of the upstream request's building and rendering
    (measured per step in a serving process: docs/performance.md). A head holds its profile and key,
    so neither's id is taken by another while it is kept; at most MOST are kept (a reload's new
    profiles start them over)."""

    MOST = 256
    __slots__ = ("_heads",)

    def __init__(self) -> None:
        self._heads: dict[_HeadKey, tuple[object, object, FixedHead]] = {}

    def get(self, provider: object, key: object, forwarded: tuple[tuple[str, str], ...],
            query: str = "") -> FixedHead | None:
        kept = self._heads.get((id(provider), id(key), forwarded, query))
        return kept[2] if kept is not None and kept[0] is provider and kept[1] is key else None

    def keep(self, provider: object, key: object, forwarded: tuple[tuple[str, str], ...],
             query: str, url: str,
             headers: dict[str, str]) -> FixedHead:
        """The head of `url` (with the client's `query`) and `headers` (the profile's requests'
        own), kept."""
        if len(self._heads) >= self.MOST:
            self._heads.clear()
        if query:
            url = f"{url}{'&' if '?' in url else '?'}{query}"
        head = fixed_head(url, headers)
        self._heads[(id(provider), id(key), forwarded, query)] = (provider, key, head)
        return head


class HttpProvider:
    """A provider client for one protocol (openai or anthropic) over the profile pools."""

    reports_sent = True  # the driver's headers clock starts when the request was written
    reports_waits = True  # a stream's body reads await `request.waiting` first

    def __init__(self, protocol: WireProtocol, pools: Pools | None = None) -> None:
        self.protocol = protocol
        self.pools = pools if pools is not None else Pools()

    async def aclose(self) -> None:
        await self.pools.aclose()

    async def complete(self, request: CallRequest) -> Completion:
        async with _Exchange(self, request) as response:
            try:
                body = await self._read_bounded(response, request)
            except UpstreamError as exc:
                raise ProviderFailure(fc.truncated(str(exc))) from None
            except UnsupportedEncoding as exc:
                raise _unsupported(exc) from None
        if request.clock is not None and len(body) > PROCESS_PARSE_BYTES:
            request.clock.read()  # (the decode below is awaited; an inline one awaits nothing)
        if len(body) > PROCESS_PARSE_BYTES and _Decoding.in_processes:
            # a large answer is decoded in a worker process: JSON parsing holds the GIL for the
            # whole document, so a thread would still stall every other turn for as long. The worker
            # is killed if the turn is cancelled mid-parse. Imported here: only `relayline serve`
            # turns worker decoding on, so the library never loads it
            import trio_parallel

            outcome: Completion | fc.Failure
            try:
                outcome = await trio_parallel.run_sync(decode_completion, self.protocol, body,
                                                       kill_on_cancel=True)
            except trio_parallel.BrokenWorkerError:
                # the worker died (killed by the OOM killer, say): not the provider's fault
                log.warning("decode_worker_died bytes=%d: decoding in a thread instead", len(body))
                outcome = await trio.to_thread.run_sync(decode_completion, self.protocol, body)
        elif len(body) > PROCESS_PARSE_BYTES:
            outcome = await trio.to_thread.run_sync(decode_completion, self.protocol, body)
        else:
            outcome = decode_completion(self.protocol, body)
        del body
        if isinstance(outcome, fc.Failure):
            raise ProviderFailure(outcome)
        return outcome

    @staticmethod
    async def _read_bounded(response: UpstreamResponse, request: CallRequest) -> bytearray:
        """The body, never buffered beyond limits.max_response_bytes: a declared length above it
        is refused before reading, an undeclared one as soon as it crosses it."""
        limit = request.max_bytes
        declared = response.content_length or ""
        if declared.isdigit() and int(declared) > limit:
            raise ProviderFailure(fc.too_large(limit))
        clock = request.clock
        body = bytearray()
        async for chunk in response:
            body += chunk
            if len(body) > limit:
                raise ProviderFailure(fc.too_large(limit))
            if clock is not None:
                clock.received()
        return body

    def stream(self, request: CallRequest) -> _Streamed:
        return _Streamed(self, request)

    async def _frames(self, response: UpstreamResponse,
                      waiting: Callable[[], Awaitable[None]] | None = None,
                      grace: float = FINISH_GRACE_S) -> AsyncGenerator[Frame, None]:
        decoder = SSEDecoder()
        parser = self.protocol.parser()
        chunks = aiter(response)
        first = True
        try:
            while True:
                if waiting is not None:
                    await waiting()  # the last read's frames leave before the next read waits
                finished = parser.complete_at_eof()
                chunk: bytes | None = None
                try:
                    if finished:
                        with trio.move_on_after(grace):
                            chunk = await chunks.__anext__()
                    else:
                        chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                if chunk is None:  # (only a finished stream's grace ends without a read)
                    log.info("stream_complete_without_done after=finish waited_s=%g", grace)
                    yield Frame(DONE)
                    return
                if first and len(chunk) > FIRST_PIECE:
                    # a burst's first read is decoded in two steps: its first events (the first
                    # token) do not wait for every line of the rest to be split (the first byte)
                    pieces: tuple[bytes, ...] = (chunk[:FIRST_PIECE], chunk[FIRST_PIECE:])
                else:
                    pieces = (chunk,)
                first = False
                for piece in pieces:
                    for event in decoder.feed(piece):
                        try:
                            frames = parser.feed(event)
                        except ProviderFailure as exc:
                            # (a finish read before what failed, in this chunk or an earlier one)
                            if not parser.complete_at_eof():
                                raise
                            _after_finish(exc.failure.detail)
                            yield Frame(DONE)
                            return
                        for frame in frames:
                            yield frame
                        if parser.done:
                            await _finish_body(chunks)
                            yield Frame(DONE)
                            return
                # a read is not kept while the next is awaited (a held stream's life)
                del chunk, pieces, piece
        except (SSEProtocolError, UpstreamError) as exc:
            if parser.complete_at_eof():  # (the text was whole: what broke came after it)
                _after_finish(str(exc))
                yield Frame(DONE)
                return
            if type(exc) is SSEProtocolError:
                raise ProviderFailure(fc.truncated(f"malformed stream: {exc}")) from None
            raise ProviderFailure(fc.truncated(f"{exc} (mid-stream)")) from None
        except UnsupportedEncoding as exc:
            raise _unsupported(exc) from None
        decoder.close()
        if parser.complete_at_eof():
            yield Frame(DONE)
        # otherwise the iterator ends without DONE: the driver reports truncation


class _Exchange:
    """One exchange through the profile's pool: the response to the request once its head arrived
    and its status is a success; an error status is read (bounded), classified and raised. A class,
    not an @asynccontextmanager: a stream keeps it for its whole life, and a generator's frame with
    its entry in trio's set of live async generators would be memory every stream in flight
    holds."""

    __slots__ = ("exchange",)

    def __init__(self, provider: HttpProvider, request: CallRequest) -> None:
        upstream = provider.protocol.build(request)
        request_id = REQUEST_ID.get()
        if request_id is not None:
            upstream.headers["x-request-id"] = request_id
        # (the pool drops the rendered request once sent: a stream's exchange lives as long as the
        # stream)
        self.exchange = provider.pools.profile(request.entry.profile).exchange(
            upstream, request.clock
        )

    async def __aenter__(self) -> UpstreamResponse:
        try:
            response = await self.exchange.__aenter__()
        except UpstreamError:  # connecting, writing or the head
            raise ProviderFailure(fc.connection_error()) from None
        if response.status >= 400:
            try:
                await _refusal(response)
            except BaseException as exc:
                await self.__aexit__(type(exc), exc, exc.__traceback__)
                raise
        return response

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        try:
            suppressed = await self.exchange.__aexit__(kind, exc, tb)
        except UpstreamError:
            raise ProviderFailure(fc.connection_error()) from None
        if not suppressed and kind is not None and issubclass(kind, UpstreamError):
            # (a body's own loss is caught where it is read: one that got here is the connection's)
            raise ProviderFailure(fc.connection_error()) from None
        return suppressed


class _Streamed:
    """`HttpProvider.stream`: the exchange entered, its body's frames. A class rather than a
    second @asynccontextmanager around `_Exchange`: that one's generator frame and context
    manager would be memory every in-flight stream holds.

    The frames are closed on exit: a consumer stops at the completion signal, which leaves the
    generator suspended at its last `yield`, and a generator dropped unclosed is handed to
    trio's finalizer (a wake-up of the run loop through its socket pair, and a system task to
    close it) once per stream."""

    __slots__ = ("provider", "exchange", "waiting", "grace", "frames")

    def __init__(self, provider: HttpProvider, request: CallRequest) -> None:
        self.provider = provider
        self.exchange = _Exchange(provider, request)
        self.waiting = request.waiting
        idle = getattr(getattr(request.clock, "timeouts", None), "idle_s", 0.0)
        # (within the stream's own idle deadline, which would otherwise end it as a stall)
        self.grace = min(FINISH_GRACE_S, idle / 2) if idle > 0 else FINISH_GRACE_S
        self.frames: AsyncGenerator[Frame, None] | None = None

    async def __aenter__(self) -> AsyncIterator[Frame]:
        response = await self.exchange.__aenter__()
        frames = self.frames = self.provider._frames(response, self.waiting, self.grace)
        return frames

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        frames, self.frames = self.frames, None
        try:
            if frames is not None:
                await frames.aclose()  # (suspended at a yield, or done: nothing in it is awaited)
        finally:  # the exchange (its connection) is let go whatever the frames' end raised
            suppressed = await self.exchange.__aexit__(kind, exc, tb)
        return suppressed


async def _refusal(response: UpstreamResponse) -> None:
    """An error status: its body read to classify it (bounded), then raised as the failure."""
    body = b""
    try:
        async for chunk in response:
            body += chunk
            if len(body) >= MAX_ERROR_BODY:
                break
    except (UpstreamError, UnsupportedEncoding):
        body = b""
    failure = fc.classify_http(response.status, error_text(body), response.headers, time.time())
    if failure.kind == fc.REJECTED:
        kind, message = rejection(body)
        failure = attrs.evolve(failure, error_type=kind, error_message=message)
    raise ProviderFailure(failure)
