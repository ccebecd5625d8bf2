"""The `sim` family: scripted upstreams, in process (docs/behaviour.md).

One reply answers one provider call; a profile's script is consumed in order and its last reply
repeats. A profile with no script answers `{ text = "ok" }`. Waits (`delay`, `wait`, `hang`)
are trio sleeps, so under MockClock they take no real time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import trio

from relayline.machines import classify as fc
from relayline.machines.ledger import Usage
from relayline.machines.stream import (
    EXECUTED_TOOL,
    FINISH,
    PING,
    REASONING,
    ROLE,
    TEXT,
    TOOL_CALL,
    USAGE,
    Frame,
)
from relayline.machines.turn import Completion

from ..providers.base import DONE, CallRequest, ProviderFailure

if TYPE_CHECKING:
    from ..relay import Relay

DEFAULT_REPLY: Mapping = {"text": "ok"}
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")  # a reply's `finish`, OpenAI's words


def finish_of(reply: Mapping, frame: Mapping | None = None) -> str | None:
    """A reply's scripted finish reason (a `done` frame may carry its own); None: the default."""
    finish = (frame or {}).get("finish", reply.get("finish"))
    if finish is not None and finish not in FINISH_REASONS:
        raise ValueError(f"finish = {finish!r}: expected one of {', '.join(FINISH_REASONS)}")
    return finish


@attrs.define
class Script:
    provider: str
    model: str | None
    replies: list[Mapping]
    position: int = 0

    def next(self) -> Mapping:
        reply = self.replies[min(self.position, len(self.replies) - 1)]
        self.position += 1
        return reply


@attrs.frozen
class SimCall:
    """What the upstream saw: the key is kept as the pool index it matched, never its value."""

    provider: str
    model: str
    mode: str
    key_index: int | None


def default_usage(reply: Mapping, words_from: Sequence[str] | None = None) -> Usage:
    if "usage" in reply:
        tokens_in, tokens_out = reply["usage"]
        return Usage(int(tokens_in), int(tokens_out))
    parts = words_from if words_from is not None else [reply.get("text", ""), reply.get("reasoning", "")]
    return Usage(10, sum(len(p.split()) for p in parts))


def aggregate_frames(frames: Sequence[Mapping]) -> dict:
    """An explicit stream asked for without streaming, as one reply: its whole answer, or its
    failure (`stream_error`, or `cut` for an EOF or a malformed frame), after its waits."""
    text, reasoning, tools, usage, wait = [], [], [], None, 0.0
    for frame in frames:
        if "wait" in frame:
            wait += float(frame["wait"])
        elif "error" in frame:
            return {"stream_error": frame["error"], "wait": wait}
        elif frame.get("eof") or frame.get("malformed"):
            return {"cut": True, "wait": wait}
        elif "text" in frame:
            text.append(frame["text"])
        elif "reasoning" in frame:
            reasoning.append(frame["reasoning"])
        elif "tool_call" in frame:
            tools.append(frame["tool_call"])
        elif "usage" in frame:
            usage = list(frame["usage"])
    reply: dict = {"text": "".join(text), "wait": wait,
                   "usage": usage or [10, sum(len(p.split()) for p in text + reasoning)]}
    finish = next((f["finish"] for f in frames if f.get("done") and "finish" in f), None)
    if finish is not None:
        reply["finish"] = finish
    if reasoning:
        reply["reasoning"] = "".join(reasoning)
    if tools:
        reply["tool_call"] = tools[0]
    if not text and not tools:
        reply["empty"] = True
    return reply


def reply_frames(reply: Mapping) -> list[Mapping]:
    """A reply as explicit stream frames (docs/behaviour.md): role preamble, reasoning, one text
    frame per word (spaces kept), tool call, usage, the completion signal."""
    if "frames" in reply:
        return list(reply["frames"])
    frames: list[Mapping] = [{"role": True}]
    if reply.get("reasoning"):
        frames.append({"reasoning": reply["reasoning"]})
    text = reply.get("text", "")
    if text:
        words = text.split(" ")
        frames.extend({"text": (w if i == 0 else " " + w)} for i, w in enumerate(words) if w or i)
    if reply.get("tool_call"):
        frames.append({"tool_call": reply["tool_call"]})
    usage = default_usage(reply)
    frames.append({"usage": [usage.input_tokens, usage.output_tokens]})
    frames.append({"done": True})
    return frames


class SimUpstream:
    """The scripted upstreams of a scenario, shared by every sim profile."""

    def __init__(self, scripts: Sequence[Script] = ()) -> None:
        self.scripts = list(scripts)
        self.calls: list[SimCall] = []

    @classmethod
    def from_replies(cls, replies: Sequence[Mapping]) -> SimUpstream:
        return cls([Script(r["provider"], r.get("model"), list(r.get("script") or [DEFAULT_REPLY])) for r in replies])

    def next_reply(self, request: CallRequest, mode: str) -> Mapping:
        self.calls.append(SimCall(request.entry.profile, request.model, mode, request.key_index))
        for script in self.scripts:
            if script.provider == request.entry.profile and script.model in (None, request.model):
                return script.next()
        return DEFAULT_REPLY


class SimClient:
    reports_waits = True  # a stream's waits await `request.waiting` first

    def __init__(self, upstream: SimUpstream) -> None:
        self.upstream = upstream

    async def _before_headers(self, reply: Mapping) -> None:
        if reply.get("delay"):
            await trio.sleep(float(reply["delay"]))
        if reply.get("hang"):
            await trio.sleep_forever()
        if reply.get("connect_error"):
            raise ProviderFailure(fc.connection_error())
        if "status" in reply:
            headers = {"retry-after": str(reply["retry_after"])} if "retry_after" in reply else None
            raise ProviderFailure(fc.classify_http(int(reply["status"]), reply.get("error"), headers))

    async def complete(self, request: CallRequest) -> Completion:
        reply = self.upstream.next_reply(request, "complete")
        if "frames" in reply:
            reply = {**aggregate_frames(reply["frames"]), "delay": float(reply.get("delay", 0.0))}
        await self._before_headers(reply)
        if reply.get("wait"):
            await trio.sleep(reply["wait"])
        if "stream_error" in reply:
            raise ProviderFailure(fc.classify_stream_error(reply["stream_error"]))
        if reply.get("cut"):
            raise ProviderFailure(fc.truncated())
        if reply.get("empty"):
            return Completion(usage=default_usage(reply, []), finish_reason=finish_of(reply))
        return Completion(reply.get("text", ""), reply.get("reasoning", ""),
                          (reply["tool_call"],) if reply.get("tool_call") else (), default_usage(reply),
                          finish_reason=finish_of(reply))

    @asynccontextmanager
    async def stream(self, request: CallRequest):
        reply = self.upstream.next_reply(request, "stream")
        await self._before_headers(reply)
        yield self._frames(reply, request.waiting)

    async def _frames(self, reply: Mapping, waiting=None) -> AsyncIterator[Frame]:
        words: list[str] = []
        explicit_usage = False
        for spec in reply_frames(reply):
            if "wait" in spec:
                if waiting is not None:  # as a real upstream's read: what came before leaves first
                    await waiting()
                await trio.sleep(float(spec["wait"]))
                continue
            await trio.lowlevel.checkpoint()
            if spec.get("role"):
                yield Frame(ROLE)
            elif spec.get("ping"):
                yield Frame(PING)
            elif "text" in spec:
                words.append(spec["text"])
                yield Frame(TEXT, spec["text"])
            elif "reasoning" in spec:
                words.append(spec["reasoning"])
                yield Frame(REASONING, spec["reasoning"])
            elif "tool_call" in spec:
                yield Frame(TOOL_CALL, spec["tool_call"])
            elif "executed_tool" in spec:
                yield Frame(EXECUTED_TOOL, spec["executed_tool"])
            elif "usage" in spec:
                explicit_usage = True
                yield Frame(USAGE, usage=Usage(*map(int, spec["usage"])))
            elif "error" in spec:
                raise ProviderFailure(fc.classify_stream_error(spec["error"]))
            elif spec.get("malformed"):
                raise ProviderFailure(fc.truncated("malformed frame: a data line that is not valid JSON"))
            elif spec.get("eof"):
                return
            elif spec.get("done"):
                if not explicit_usage:
                    yield Frame(USAGE, usage=default_usage(reply, words))
                if finish := finish_of(reply, spec):
                    yield Frame(FINISH, finish)
                yield Frame(DONE)
                return


def family_client(relay: Relay) -> SimClient:
    """The sim family's factory (machines/families.py): the relay's scripted upstreams, or a
    fresh set answering `{ text = "ok" }`."""
    if relay.sim is None:
        relay.sim = SimUpstream()
    return SimClient(relay.sim)
