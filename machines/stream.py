"""The commit gate of one streamed attempt (specs/stream.toml), sans-I/O.

Frames come in, events to forward come out. Preamble frames (role deltas, message_start, pings,
empty blocks) are held; the first decisive frame (non-empty text or reasoning, a tool call, a
provider-executed tool event) commits, and the held frames go out with it. Until then nothing is
immutable and the turn may still recover elsewhere. After commit each frame is bookkeeping plus
one event: the lifecycle machine is not consulted per token, only at the stream's end.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

from .engine import Lifecycle, Spec, bind_entry_actions, load_spec
from .ledger import Usage
from .vocab import EventKind, FrameKind, StreamState, StreamTrigger

# frame kinds, as protocol adapters and the simulator produce them
ROLE = FrameKind.ROLE
PING = FrameKind.PING
PREAMBLE = FrameKind.PREAMBLE
TEXT = FrameKind.TEXT
REASONING = FrameKind.REASONING
REDACTED_REASONING = FrameKind.REDACTED_REASONING
TOOL_CALL = FrameKind.TOOL_CALL
TOOL_ARGS = FrameKind.TOOL_ARGS
EXECUTED_TOOL = FrameKind.EXECUTED_TOOL
USAGE = FrameKind.USAGE
FINISH = FrameKind.FINISH

# the event a decisive frame becomes at the immutable sink
EVENT_NAMES: dict[str, EventKind] = {
    TEXT: EventKind.TEXT, REASONING: EventKind.REASONING, TOOL_CALL: EventKind.TOOL,
    TOOL_ARGS: EventKind.TOOL_ARGS, EXECUTED_TOOL: EventKind.EXECUTED_TOOL}

# a decisive frame's event back to its frame's kind (`Event.decisive` asks what `Frame.decisive`
# says of the frame it came from)
_FRAME_KINDS: dict[str, str] = {event: frame for frame, event in EVENT_NAMES.items()}
_WORDS = frozenset((TEXT, REASONING, TOOL_ARGS))  # decisive only when they carry something


def _decisive(kind: str, value: str) -> bool:
    if kind in _WORDS:
        return bool(value)
    return kind in (TOOL_CALL, EXECUTED_TOOL)


_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)


def strip_think(text: str) -> str:
    # a text without "<" (a memchr) has no tag: the regex scan of a 32 MiB answer is skipped
    return _THINK.sub("", text) if "<" in text else text


@attrs.frozen(slots=True)
class Frame:
    kind: str  # a FrameKind (adapters may pass the plain string)
    value: str = ""
    usage: Usage | None = None
    # a tool call's id, as the provider sent it; for tool_args, an earlier call's place
    ref: str = ""

    @property
    def decisive(self) -> bool:
        return _decisive(self.kind, self.value)


@attrs.frozen(slots=True)
class Event:
    """What a consumer sees. `kind` is text, reasoning, tool, executed_tool, or preamble (held
    protocol frames released at commit, which library consumers skip and the gateway renders)."""

    kind: EventKind
    value: str
    ref: str = ""  # a tool call's id, as the provider sent it ("" when it sent none)

    @property
    def visible(self) -> bool:
        return self.kind != EventKind.PREAMBLE

    @property
    def decisive(self) -> bool:
        """The event of a decisive frame (`Frame.decisive`): words, a tool call or its arguments,
        an executed tool; not what the gate held before it (a preamble, a redacted block, a
        signature or the citations of what was shown)."""
        kind = _FRAME_KINDS.get(self.kind)
        return kind is not None and _decisive(kind, self.value)

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


class StreamGate:
    __slots__ = ("life", "entry_actions", "held", "text", "tools", "tool_ids", "arguments",
                 "usage", "finish_reason", "stop_sequence")

    def __init__(self) -> None:
        self.life: Lifecycle = (spec := load_spec("stream")).start()
        self.entry_actions = spec.derived.get(id(ENTRY_ACTIONS)) or _bind(spec)
        self.held: list[Event] = []
        self.text: list[str] = []  # text forwarded to the immutable sink, in order
        self.tools: list[str] = []
        self.tool_ids: list[str] = []
        self.arguments: list[list[str]] = []  # argument fragments per tool call
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        # the stop sequence that ended the answer, if the provider said
        self.stop_sequence: str | None = None

    @property
    def state(self) -> StreamState:
        return StreamState(self.life.state)

    @property
    def committed(self) -> bool:
        return self.life.state == StreamState.COMMITTED

    @property
    def has_answer(self) -> bool:
        return bool(self.tools) or bool(strip_think("".join(self.text)).strip())

    @property
    def tool_arguments(self) -> tuple[str, ...]:
        return tuple("".join(parts) for parts in self.arguments)

    @property
    def forwarded_text(self) -> str:
        return "".join(self.text)

    def headers(self) -> None:
        self.life.fire(StreamTrigger.HEADERS)

    def feed(self, frame: Frame) -> tuple[Event, ...]:
        """One frame in; the events to forward now (none while held)."""
        if frame.kind == USAGE:
            self.usage = frame.usage
            return ()
        if frame.kind == FINISH:
            self.finish_reason = frame.value
            self.stop_sequence = frame.ref or None
            return ()
        if not frame.decisive:
            if (frame.ref and frame.kind in (REASONING, TEXT)) or frame.kind == REDACTED_REASONING:
                # the signature of the thinking just shown (Anthropic's signature_delta), a
                # redacted thinking block, or the citations of the text just shown (a Responses
                # stream's annotations): they belong with what was shown, so they go where it
                # went (none commits: they are no words of the answer)
                event = (Event(EVENT_NAMES[frame.kind], "", frame.ref)
                         if frame.kind != REDACTED_REASONING
                         else Event(EventKind.REDACTED_REASONING, frame.value))
                if self.life.state == StreamState.COMMITTED:
                    return (event,)
                self.held.append(event)
            elif self.life.state == StreamState.HELD:
                # (a preamble's ref is what the stream said of itself: a Responses stream's id)
                self.held.append(Event(EventKind.PREAMBLE, frame.kind, frame.ref))
            return ()
        event = Event(EVENT_NAMES[frame.kind], frame.value, frame.ref)
        if frame.kind == TEXT:
            self.text.append(frame.value)
        elif frame.kind == TOOL_CALL:
            self.tools.append(frame.value)
            self.tool_ids.append(frame.ref)
            self.arguments.append([])
        elif frame.kind == TOOL_ARGS and self.arguments:
            known = frame.ref.isdigit() and int(frame.ref) < len(self.arguments)
            place = int(frame.ref) if known else -1
            self.arguments[place].append(frame.value)
        if self.life.state == StreamState.COMMITTED:
            return (event,)
        released: tuple[Event, ...] = self.life.step(StreamTrigger.DECISIVE, self,
                                                     self.entry_actions)
        return (*released, event)

    # -- entry actions (specs/stream.toml [entry_actions]) ------------------------------------

    def release_held(self) -> tuple[Event, ...]:
        held, self.held = tuple(self.held), []
        return held

    def finish(self) -> StreamState:
        """The completion signal came: completed, or semantic_empty."""
        self.life.fire(StreamTrigger.FINISH, self)
        return self.state

    def fail(self) -> StreamState:
        """A failure: `failed` before commit (recoverable), `interrupted` after."""
        self.life.fire(StreamTrigger.FAIL)
        return self.state

    def cancel(self) -> None:
        self.life.fire(StreamTrigger.CANCEL)


# the entry actions specs/stream.toml names, checked against it when a gate binds it
ENTRY_ACTIONS: dict[str, Callable[[StreamGate], object]] = {"release_held": StreamGate.release_held}


def _bind(spec: Spec) -> dict[str, tuple[Callable[[StreamGate], object], ...]]:
    # committing is what releases the held frames: a committed state without it would lose them
    return bind_entry_actions(spec, ENTRY_ACTIONS, required=(StreamState.COMMITTED.value,))
