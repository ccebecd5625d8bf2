"""The `sim` family: scripted upstreams, in process (docs/scenario-files.md, "Replies").

One reply answers one provider call; a profile's script is consumed in order and its last reply
repeats. A profile with no script answers `{ text = "ok" }`. Waits (`delay`, `wait`, `hang`)
are trio sleeps, so under MockClock they take no real time.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

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

from .base import DONE, CallRequest, ProviderClient, ProviderFailure

if TYPE_CHECKING:
    from .pool import Pools

DEFAULT_REPLY: Mapping[str, Any] = {"text": "ok"}
# a reply's `finish`, OpenAI's words
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")


def finish_of(reply: Mapping[str, Any], frame: Mapping[str, Any] | None = None) -> str | None:
    """A reply's scripted finish reason (a `done` frame may carry its own); None: the default."""
    finish: str | None = (frame or {}).get("finish", reply.get("finish"))
    if finish is not None and finish not in FINISH_REASONS:
        raise ValueError(f"finish = {finish!r}: expected one of {', '.join(FINISH_REASONS)}")
    return finish


# what a scripted reply and a stream frame may say (docs/scenario-files.md), each key with the kind
# of value it takes: a typo or a wrong type is an error naming it, never a different fault
_STRING, _FLAG, _WHOLE, _NUMBER, _USAGE = (
    "a string",
    "true or false",
    "a whole number",
    "a number",
    "[IN, OUT]",
)
REPLY_KEYS = {"text": _STRING, "reasoning": _STRING, "tool_call": _STRING, "empty": _FLAG,
              "status": _WHOLE,
              "retry_after": _NUMBER, "error": _STRING, "connect_error": _FLAG, "hang": _FLAG,
              "frames": "a list",
              "finish": _STRING, "malformed_body": _FLAG, "usage": _USAGE, "delay": _NUMBER}
FRAME_KEYS = {"role": _FLAG, "ping": _FLAG, "text": _STRING, "reasoning": _STRING,
              "tool_call": _STRING,
              "executed_tool": _STRING, "error": _STRING, "usage": _USAGE, "done": _FLAG,
              "eof": _FLAG,
              "wait": _NUMBER, "malformed": _FLAG, "finish": _STRING}
SCRIPT_KEYS = ("provider", "model", "script")  # one [[replies]] table


def _is(kind: str, value: object) -> bool:
    if kind == _USAGE:
        return (
            isinstance(value, list)
            and len(value) == 2
            and all(_is(_WHOLE, v) and v >= 0 for v in value)
        )
    if kind == _NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    want = {_STRING: str, _FLAG: bool, _WHOLE: int, "a list": list}[kind]
    return isinstance(value, want) and (want is bool or not isinstance(value, bool))


def _keys_problems(item: object, keys: Mapping[str, str], at: str) -> list[str]:
    if not isinstance(item, Mapping):
        return [f"{at}: expected a table such as {{ text = \"hi\" }}"]
    problems = [
        f"{at}: unknown key {key!r} (known: {', '.join(keys)})" for key in item if key not in keys
    ]
    problems += [f"{at}.{key}: expected {keys[key]}, got {value!r}" for key, value in item.items()
                 if key in keys and not _is(keys[key], value)]
    if not problems and "finish" in item:
        try:
            finish_of(item)
        except ValueError as exc:
            problems.append(f"{at}.{exc}")
    return problems


def reply_problems(reply: object, at: str) -> list[str]:
    """What is wrong with one scripted reply, each problem with its path and key."""
    problems = _keys_problems(reply, REPLY_KEYS, at)
    if problems:
        return problems
    assert isinstance(reply, Mapping)
    status = reply.get("status")
    if reply.get("malformed_body") and status != 200:
        problems.append(f"{at}.malformed_body: goes with status = 200 (a 200 whose body has the "
                        "wrong types)")
    elif status is not None and status < 400 and not reply.get("malformed_body"):
        problems.append(f"{at}.status: {status} is no HTTP error (at least 400; a success is "
                        f"{{ text = \"...\" }}, "
                        "a broken 200 { status = 200, malformed_body = true })")
    for k, frame in enumerate(reply.get("frames", ())):
        where = f"{at}.frames[{k}]"
        found = _keys_problems(frame, FRAME_KEYS, where)
        if not found and "finish" in frame and not frame.get("done"):
            found.append(f"{where}.finish: only a {{ done = true }} frame carries a finish reason")
        problems += found
    return problems


def scripts_of(replies: Sequence[Mapping[str, Any]]) -> list[Script]:
    """The scripts of [[replies]] tables; ValueError listing every problem, each with its path."""
    problems: list[str] = []
    for i, table in enumerate(replies):
        at = f"replies[{i}]"
        if not isinstance(table, Mapping) or not isinstance(table.get("provider"), str):
            problems.append(f"{at}.provider: required, the profile alias the script answers for")
            continue
        problems += [f"{at}: unknown key {key!r} (known: {', '.join(SCRIPT_KEYS)})" for key in table
                     if key not in SCRIPT_KEYS]
        script = table.get("script", [])
        if not isinstance(script, list):
            problems.append(f"{at}.script: expected a list of replies")
            continue
        for j, reply in enumerate(script):
            problems += reply_problems(reply, f"{at}.script[{j}]")
    if problems:
        raise ValueError("; ".join(problems))
    return [Script(r["provider"], r.get("model"),
                   list(r.get("script") or [DEFAULT_REPLY])) for r in replies]


@attrs.define
class Script:
    provider: str
    model: str | None
    replies: list[Mapping[str, Any]]
    position: int = 0

    def next(self) -> Mapping[str, Any]:
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


def default_usage(reply: Mapping[str, Any], words_from: Sequence[str] | None = None) -> Usage:
    if "usage" in reply:
        tokens_in, tokens_out = reply["usage"]
        return Usage(int(tokens_in), int(tokens_out))
    parts = words_from if words_from is not None else [reply.get("text", ""),
                                                       reply.get("reasoning", "")]
    return Usage(10, sum(len(p.split()) for p in parts))


def aggregate_frames(frames: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
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
    reply: dict[str, Any] = {"text": "".join(text), "wait": wait,
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


def reply_frames(reply: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A reply as explicit stream frames (docs/scenario-files.md): role preamble, reasoning, one
    text frame per word (spaces kept), tool call, usage, the completion signal."""
    if "frames" in reply:
        return list(reply["frames"])
    frames: list[Mapping[str, Any]] = [{"role": True}]
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
    def from_replies(cls, replies: Sequence[Mapping[str, Any]]) -> SimUpstream:
        return cls(scripts_of(replies))

    def clients(self) -> dict[str, ProviderClient]:
        """The family clients a Relay is given (`Relay(config, clients=...)`) to serve its sim
        profiles from these scripts; `calls` then records what each profile was asked."""
        return {"sim": SimClient(self)}

    def next_reply(self, request: CallRequest, mode: str) -> Mapping[str, Any]:
        self.calls.append(SimCall(request.entry.profile, request.model, mode, request.key_index))
        for script in self.scripts:
            if script.provider == request.entry.profile and script.model in (None, request.model):
                return script.next()
        return DEFAULT_REPLY


class SimClient:
    reports_waits = True  # a stream's waits await `request.waiting` first

    def __init__(self, upstream: SimUpstream) -> None:
        self.upstream = upstream

    async def _before_headers(self, reply: Mapping[str, Any]) -> None:
        if reply.get("delay"):
            await trio.sleep(float(reply["delay"]))
        if reply.get("hang"):
            await trio.sleep_forever()
        if reply.get("connect_error"):
            raise ProviderFailure(fc.connection_error())
        if reply.get("malformed_body"):
            raise ProviderFailure(fc.malformed("a 200 whose JSON has the wrong types"))
        if "status" in reply:
            headers = {"retry-after": str(reply["retry_after"])} if "retry_after" in reply else None
            raise ProviderFailure(fc.classify_http(int(reply["status"]), reply.get("error"),
                                                   headers))

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
                          (reply["tool_call"],) if reply.get("tool_call") else (),
                          default_usage(reply),
                          finish_reason=finish_of(reply))

    @asynccontextmanager
    async def stream(self, request: CallRequest) -> AsyncIterator[AsyncIterator[Frame]]:
        reply = self.upstream.next_reply(request, "stream")
        await self._before_headers(reply)
        frames = self._frames(reply, request.waiting)
        try:
            yield frames
        finally:
            # the driver stops at the completion signal, leaving the frames at a yield: closed
            # here, as an HTTP family's are, not by trio's finalizer after the run has ended
            await frames.aclose()

    async def _frames(self, reply: Mapping[str, Any],
                      waiting: Callable[[], Awaitable[None]] | None = None
                      ) -> AsyncGenerator[Frame, None]:
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
                raise ProviderFailure(fc.truncated("malformed frame: a data line that is not valid "
                                                   "JSON"))
            elif spec.get("eof"):
                return
            elif spec.get("done"):
                if not explicit_usage:
                    yield Frame(USAGE, usage=default_usage(reply, words))
                if finish := finish_of(reply, spec):
                    yield Frame(FINISH, finish)
                yield Frame(DONE)
                return


def family_client(pools: Pools) -> SimClient:
    """The sim family's factory (machines/families.py), for a relay given no sim client
    (`SimUpstream.clients`): fresh scripted upstreams answering `{ text = "ok" }`. The pools go
    unused: the sim answers in process."""
    return SimClient(SimUpstream())
