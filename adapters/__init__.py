"""relayline's I/O edge: the trio driver, protocol adapters, the simulator, the CLI.

This module is the embedder's whole surface (docs/library.md): the same `Relay`
serves trio, asyncio and synchronous code.

    from relayline.adapters import Relay
    relay = Relay.from_file("relayline.toml")
    reply = await relay.complete(messages, model="hint:fast")     # trio or asyncio
    reply = relay.complete_sync(messages, model="hint:fast")      # synchronous code
"""

from relayline.machines.config import Config, parse_config
from relayline.machines.errors import (
    ConfigError,
    RelaylineError,
    StreamInterruptedAfterOutput,
    TurnError,
)
from relayline.machines.health import HealthStore, InMemoryHealth
from relayline.machines.ledger import LedgerRow, Usage
from relayline.machines.stream import Event
from relayline.machines.turn import TurnResult
from relayline.machines.vocab import ErrorReason, Outcome
from relayline.machines.wire import Message, Request, Tool, ToolCall, WireError

from .relay import Relay, Reply, responses_request
from .stream_turn import StreamTurn

__all__ = [
    "Config",
    "ConfigError",
    "ErrorReason",
    "Event",
    "HealthStore",
    "InMemoryHealth",
    "LedgerRow",
    "Message",
    "Outcome",
    "Relay",
    "RelaylineError",
    "Reply",
    "Request",
    "StreamInterruptedAfterOutput",
    "StreamTurn",
    "Tool",
    "ToolCall",
    "TurnError",
    "TurnResult",
    "Usage",
    "WireError",
    "parse_config",
    "responses_request",
]
