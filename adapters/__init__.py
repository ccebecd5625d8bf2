"""relayline's I/O edge: the trio driver, protocol adapters, the simulator, the CLI.

The embedder's entry point is `Relay`:

    from relayline.adapters import Relay
    relay = Relay.from_file("relayline.toml")
    reply = await relay.complete(messages, model="hint:fast")
"""

from .relay import Relay, Reply, StreamTurn

__all__ = ["Relay", "Reply", "StreamTurn"]
