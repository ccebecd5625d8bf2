"""A FastAPI service (asyncio) that embeds relayline and streams to its own clients with
server-sent events.

    RELAYLINE_CONFIG=relayline.toml uvicorn examples.fastapi_app:app

One Relay for the whole app, built at startup and closed at shutdown: one router, one health
store (breakers and cooldowns learned by one request protect the next), one connection pool.
Many requests share it concurrently on the app's asyncio loop; each awaits `relay.complete` or
iterates `relay.stream`. A client that disconnects mid-stream cancels its turn (Starlette
cancels the response, the cancellation reaches the turn): the upstream is never asked again.

    POST /chat          {"messages": [...], "model": "hint:fast"?}  -> JSON reply, or 502/400
    POST /chat/stream   same body -> SSE: `data: {"kind", "value"}` per event, then
                        `event: done` (served, notice) or `event: error` (reason, partial_text)
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from relayline.adapters import ErrorReason, Relay, StreamInterruptedAfterOutput, TurnError


class Chat(BaseModel):
    messages: list[dict[str, Any]]
    model: str | None = None


def sse(data: dict[str, Any], event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(data)}\n\n"


def create_app(config_path: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with Relay.from_file(config_path or os.environ["RELAYLINE_CONFIG"]) as relay:
            app.state.relay = relay
            yield

    app = FastAPI(lifespan=lifespan)

    def relay_of(request: Request) -> Relay:
        relay: Relay = request.app.state.relay
        return relay

    @app.post("/chat")
    async def chat(body: Chat, request: Request) -> dict[str, Any]:
        try:
            reply = await relay_of(request).complete(body.messages, model=body.model)
        except TurnError as exc:
            # the caller's own mistake (a context window, a rejected request) is theirs to fix
            status = 400 if exc.reason in (ErrorReason.CONTEXT_WINDOW, ErrorReason.CLIENT_ERROR) else 502
            raise HTTPException(status, detail={"reason": str(exc.reason), "message": str(exc)}) from None
        return {"text": reply.text, "served": reply.served, "requested": reply.requested,
                "notice": reply.notice, "cost_usd": reply.cost_usd}

    @app.post("/chat/stream")
    async def chat_stream(body: Chat, request: Request) -> StreamingResponse:
        relay = relay_of(request)

        async def events() -> AsyncIterator[str]:
            try:
                async with relay.stream(body.messages, model=body.model) as turn:
                    async for event in turn:
                        yield sse({"kind": event.kind, "value": event.value})
            except StreamInterruptedAfterOutput as exc:
                yield sse({"reason": str(exc.reason), "partial_text": exc.partial_text}, "error")
                return
            except TurnError as exc:
                yield sse({"reason": str(exc.reason), "message": str(exc)}, "error")
                return
            yield sse({"served": turn.served, "notice": turn.notice}, "done")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


app = create_app()
