"""What the HTTP server's send timeout costs per write (adapters/gateway/http11.py).

A client that stops reading must not hold its connection (and the turn behind it) for ever, so
a write that makes no progress for `send_timeout_s` ends the connection. The obvious way, a
trio timeout around every write, costs a cancel scope and a deadline per write, and a stream
writes once a frame; the server instead counts its writes and one watchdog task per server
looks at the counters. This compares, in one run, a frame-sized write over a loopback socket
pair: bare, with a timeout scope around it, and with the counters the server keeps.
"""

from __future__ import annotations

import os
import time

import trio

FRAME = b"data: " + b"x" * 200 + b"\n\n"  # a streamed chunk of a few tokens
WRITES = 20_000
ROUNDS = 6  # interleaved; the best of each is reported


class Counters:
    __slots__ = ("writing", "writes")

    def __init__(self) -> None:
        self.writing = False
        self.writes = 0


async def main() -> None:
    a, b = trio.socket.socketpair()
    writer, reader = trio.SocketStream(a), trio.SocketStream(b)
    counters = Counters()

    async def bare() -> None:
        await writer.send_all(FRAME)

    async def scoped() -> None:
        with trio.move_on_after(60):
            await writer.send_all(FRAME)

    async def counted() -> None:  # as _Connection._write
        counters.writing = True
        try:
            counters.writes += 1
            await writer.send_all(FRAME)
        finally:
            counters.writing = False

    async def read_all() -> None:
        while await reader.receive_some(1 << 20):
            pass

    best: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        for _ in range(ROUNDS):
            for name, write in (("bare write", bare), ("timeout scope per write", scoped),
                                ("write counters (the server)", counted)):
                started = time.perf_counter()
                for _ in range(WRITES):
                    await write()
                per_write = (time.perf_counter() - started) / WRITES * 1e6
                best[name] = min(best.get(name, per_write), per_write)
        await writer.aclose()
    floor = best["bare write"]
    print(f"send timeout cost per {len(FRAME)}-byte write, best of {ROUNDS} (load average {os.getloadavg()[0]:.1f}):")
    for name, per_write in best.items():
        print(f"  {name:30} {per_write:7.2f} us  x{per_write / floor:.2f}")


if __name__ == "__main__":
    trio.run(main)
