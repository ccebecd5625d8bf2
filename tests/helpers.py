"""Small builders shared by tests."""

import gc
import json
import socket
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import trio

from relayline.adapters.gateway import serve
from relayline.adapters.sim.background import BackgroundGateway
from relayline.adapters.sim.recorder import Answer, RecordingUpstream
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


def to_toml(config: dict) -> str:
    """Enough TOML for these tests' configs: scalars, lists of scalars, tables, arrays of tables."""
    lines: list[str] = []

    def emit(prefix: str, table: dict) -> None:
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        arrays = {k: v for k, v in table.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
        if prefix:
            lines.append(f"[{prefix}]")
        for k, v in table.items():
            if k not in nested and k not in arrays:
                lines.append(f"{json.dumps(k)} = {json.dumps(v)}")
        for k, v in nested.items():
            emit(f"{prefix}.{json.dumps(k)}" if prefix else json.dumps(k), v)
        for k, items in arrays.items():
            for item in items:
                lines.append(f"[[{json.dumps(k)}]]")
                lines.extend(f"{json.dumps(a)} = {json.dumps(b)}" for a, b in item.items())

    emit("", config)
    return "\n".join(lines) + "\n"


def sim_config(*profiles: str | dict, **tables) -> dict:
    """Sim-family profiles `sim.a`, `sim.b`, ... in the order given, the first active and each
    falling back to the next: a profile is given as its model's name, or as a dict of its keys
    (its `model` among them). Every other keyword is a top-level table (or value) of the config."""
    names = [f"sim.{chr(ord('a') + i)}" for i in range(len(profiles))]
    providers = {}
    for name, fallback, profile in zip(names, [*names[1:], None], profiles, strict=True):
        keys = {"model": profile} if isinstance(profile, str) else profile
        providers[name] = {"family": "sim", **({"fallbacks": [fallback]} if fallback else {}), **keys}
    return {"active": names[0], **tables, "providers": providers}


def sim_toml(*profiles: str | dict, **tables) -> str:
    """`sim_config` as the TOML text a config file holds."""
    return to_toml(sim_config(*profiles, **tables))


PRICE = {"input_per_mtok": 1.0, "output_per_mtok": 2.0}


def base_url(family: str, url: str) -> str:
    """The base URL a profile of `family` names for a loopback upstream at `url`: OpenAI's
    clients add the path after /v1, Anthropic's after the host."""
    return f"{url}/v1" if family == "openai" else url


def family_config(family: str, url: str, *, model: str = "model-x", retries: int = 0,
                  fallback: str | None = None, **keys) -> dict:
    """One profile, `{family}.main`, on the loopback upstream at `url`, retried `retries` times;
    `fallback`: the model of a sim profile `sim.b` behind it. Other keywords are profile keys."""
    main = {"family": family, "base_url": base_url(family, url), "model": model, **keys}
    providers = {f"{family}.main": main}
    if fallback is not None:
        main["fallbacks"] = ["sim.b"]
        providers["sim.b"] = {"family": "sim", "model": fallback}
    return {"active": f"{family}.main", "reliability": {"provider_retries": retries, "backoff_ms": 50},
            "providers": providers}


def loopback_config(primary: str, backup: str | None = None, **sections) -> dict:
    """OpenAI-family profiles on loopback upstreams: `primary`, and `backup` as its fallback;
    short timeouts and a breaker that opens on one failure, each section overridable."""
    providers = {"primary": {"family": "openai", "base_url": f"{primary}/v1", "model": "m-primary", "api_key": "k1",
                             "price": PRICE}}
    if backup is not None:
        providers["primary"]["fallbacks"] = ["backup"]
        providers["backup"] = {"family": "openai", "base_url": f"{backup}/v1", "model": "m-backup", "api_key": "k2",
                               "price": PRICE}
    base = {"active": "primary", "providers": providers,
            "reliability": {"provider_retries": 1, "backoff_ms": 50},
            "breaker": {"failure_threshold": 1, "open_s": 30},
            "timeouts": {"headers_s": 0.5, "idle_s": 0.5, "total_s": 5}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return base


def raw_post(url: str, path: str, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """One JSON POST to a gateway at `url` over its own socket, `connection: close`: every byte
    of the answer, head included, as the server wrote them (headers an HTTP client would refuse
    or merge are sent as given)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    with socket.create_connection((host, int(port)), timeout=20) as client:
        client.sendall(f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n{head}"
                       f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


async def asgi_post(app, path: str, body: bytes, headers=(), on_send=None, bound: float = 10
                    ) -> tuple[int | None, list, bytes]:
    """One POST through an ASGI app in process (no socket): (status, headers, body bytes);
    `on_send` runs before each message is taken (it may raise, as a client's socket would)."""
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()

    async def send(message):
        if on_send is not None:
            on_send(message)
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": list(headers)}
    with trio.fail_after(bound):
        await app(scope, receive, send)
    start = next((m for m in sent if m["type"] == "http.response.start"), {})
    return start.get("status"), start.get("headers", []), b"".join(m.get("body", b"") for m in sent
                                                                 if m["type"] == "http.response.body")


async def serve_in_process(nursery: trio.Nursery, gateway) -> str:
    """`gateway` on this process's own HTTP/1.1 server, on a loopback port, until `nursery` ends:
    its URL."""
    binds = await nursery.start(lambda task_status: serve(gateway, port=0, task_status=task_status))
    return binds[0]


@contextmanager
def recording_gateway(providers: dict[str, dict], hints: dict[str, str], key: str = "sk-upstream",
                      shared: dict | None = None, **top):
    """A gateway (client key `gw-key`, no provider retries) before one recording upstream,
    reachable as `gateway.upstream`. Each provider is named `family.label` and given as its model
    and any other profile keys; its base URL points at the upstream, its api_key is
    `{key}-{family}` unless given, and `shared` keys go into every profile. `hints` routes each
    hint to a provider's own model; the first provider is the active one."""
    with RecordingUpstream() as upstream:
        def profile(name: str, keys: dict) -> dict:
            family = name.split(".")[0]
            return {"family": family, "base_url": base_url(family, upstream.url), "api_key": f"{key}-{family}", **(shared or {}), **keys}

        config = {
            "active": next(iter(providers)),
            "reliability": {"provider_retries": 0, "backoff_ms": 50},
            "providers": {name: profile(name, keys) for name, keys in providers.items()},
            "routes": [{"hint": hint, "provider": name, "model": providers[name]["model"]}
                       for hint, name in hints.items()],
            **top,
        }
        with BackgroundGateway(config, api_keys={"gw-key"}) as gateway:
            gateway.upstream = upstream
            yield gateway


def fresh_upstream(gateway):
    """The recording upstream behind a `recording_gateway`, back to the default Answer and with
    nothing recorded: each test starts from there."""
    gateway.upstream.answer = Answer()
    gateway.upstream.seen.clear()
    return gateway.upstream


@contextmanager
def finalized_async_generators() -> Iterator[list[str]]:
    """The names of the async generators handed to trio's finalizer inside the block (one left
    unclosed: a wake-up of the run loop and a system task, or an error once the run has ended),
    with a collection at its end so that none is missed."""
    firstiter, finalizer = sys.get_asyncgen_hooks()  # trio's, for this run
    finalized: list[str] = []

    def counting(agen) -> None:
        finalized.append(agen.__qualname__)
        finalizer(agen)

    sys.set_asyncgen_hooks(firstiter, counting)
    try:
        yield finalized
        gc.collect()
    finally:
        sys.set_asyncgen_hooks(firstiter, finalizer)
