"""A loopback TCP server that answers with raw bytes, as a provider (or a broken one) would send
them: for the upstream client's tests and the turn's fault tests."""

from __future__ import annotations

import ssl
from functools import partial

import trio


class RawServer:
    """Loopback TCP: each accepted connection reads requests and answers each with what
    `answer(number, request_index)` returns (raw bytes; None: close without a word; an async
    function of the stream: it writes the answer itself)."""

    def __init__(self, answer, *, pieces: int = 0, close: bool = False) -> None:
        self.answer = answer
        self.pieces = pieces  # > 0: send the answer in pieces of this many bytes, one send each
        self.close = close  # close the connection after each answer
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection, head, body)
        self.accepted = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def start(self, nursery: trio.Nursery, ssl_context: ssl.SSLContext | None = None) -> None:
        handler = self._serve
        if ssl_context is not None:
            async def handler(stream):
                await self._serve(trio.SSLStream(stream, ssl_context, server_side=True))
        listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]

    async def _serve(self, stream) -> None:
        self.accepted += 1
        number = self.accepted
        buffer = b""
        try:
            for index in range(100):
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                body, buffer = buffer[:length], buffer[length:]
                self.requests.append((number, head, body))
                answer = self.answer(number, index)
                if answer is None:
                    return
                if callable(answer):  # an answer that delivers itself (tests/library/test_faults.py)
                    await answer(stream)
                elif self.pieces:
                    for at in range(0, len(answer), self.pieces):
                        await stream.send_all(answer[at:at + self.pieces])
                        await trio.sleep(0.001)  # each piece its own segment: split reads
                else:
                    await stream.send_all(answer)
                if self.close or (type(answer) is bytes and b"connection: close" in answer.lower()):
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)
