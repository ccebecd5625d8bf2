"""Small builders shared by tests."""

import trio

from relayline.machines.config import structure_config
from relayline.machines.plan import build_router, plan_turn


def config(**top):
    """A config from keyword tables; providers given as {alias: {...}}; sim family by default."""
    providers = {alias: {"family": "sim", **body} for alias, body in top.pop("providers").items()}
    return structure_config({"providers": providers, **top})


def plan(cfg, env=None, **kwargs):
    return plan_turn(build_router(cfg, env or {}), **kwargs)


def labels(p):
    return [e.label for e in p.entries]


async def asgi_post(app, path: str, body: bytes, headers=()) -> tuple[int, list, bytes]:
    """One POST through an ASGI app in process (no socket): (status, headers, body bytes)."""
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": list(headers)}
    with trio.fail_after(10):
        await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], start["headers"], b"".join(m.get("body", b"") for m in sent
                                                       if m["type"] == "http.response.body")
