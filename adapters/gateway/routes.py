"""The gateway's routes, in one table: each path's methods, who may ask (no one in particular,
a client key, or an admin key), and what answers it. `dispatch` checks the request's head,
finds its route, asks for the key its area needs, and answers: a path it knows with another
method is a 405 naming the allowed ones (after the key check of the path's area), any other a
404, both in the route's dialect.

Endpoints: POST /v1/chat/completions, POST /v1/messages, POST /v1/responses, POST /v1/embeddings,
POST /v1/messages/count_tokens, GET /v1/models (client keys); GET /admin/plan, GET /admin/health,
POST /admin/reload, GET /metrics, the console at /admin/ (admin keys); GET /healthz, GET /readyz
(no key: probes)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import attrs

from ..codecs.dialects import ANTHROPIC, COUNT_TOKENS, EMBEDDINGS, OPENAI, RESPONSES
from .auth import Access, bearer, is_loopback
from .exchange import Exchange, respond, respond_json
from .http11 import Receive, Scope
from .metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from relayline.machines.config import Gateway as GatewaySettings

    from ..codecs.dialects import Dialect
    from ..relay import Relay
    from .admin import Admin
    from .chat import ChatPath
    from .console import Console
    from .metrics import Metrics

OPEN, CLIENT, ADMIN = "open", "client", "admin"  # who may ask: anyone, a client key, an admin key


class RouteHost(Protocol):
    """What the routes answer with: the gateway's settings, access and relay as they are now (a
    reload swaps each), and its collaborators."""

    settings: GatewaySettings
    access: Access
    relay: Relay
    metrics: Metrics
    console: Console
    admin: Admin
    chat: ChatPath


Answer = Callable[[RouteHost, Exchange, Scope, Receive], Awaitable[None]]


@attrs.frozen
class Route:
    methods: tuple[str, ...] | None  # None: every method (the route tells them apart itself)
    guard: str  # who may ask, with one of `methods` (another method is asked of the path's area)
    answer: Answer  # returns the answer's coroutine: no frame of its own holds the request's scope

    @property
    def allow(self) -> bytes:
        """The Allow header of a 405 (a HEAD is answered wherever a GET is)."""
        return b"GET, HEAD" if self.methods == ("GET",) else ", ".join(self.methods or ()).encode()


def _chat(dialect: Dialect) -> Answer:
    return lambda host, exchange, scope, receive: host.chat.serve(exchange, dialect, scope, receive)


def _to_console(host: RouteHost, exchange: Exchange, scope: Scope,
                receive: Receive) -> Awaitable[None]:
    """/admin, the console's address as people type it: its own page is /admin/ (where a browser
    without credentials is asked for them)."""
    query = scope.get("query_string") or b""
    return respond(exchange, 308, b"", content_type="text/plain",
                   headers=[(b"location", b"/admin/" + (b"?" + query if query else b""))])


def _models(host: RouteHost, exchange: Exchange, scope: Scope,
            receive: Receive) -> Awaitable[None]:
    """GET /v1/models in the client's dialect: what clients may name: route hints, catalog
    models, and the default model."""
    router = host.relay.router
    ids = [*router.domains, *router.catalog]
    default = router.default.entries[0].model if router.default.entries else None
    if default and default not in ids:
        ids.append(default)
    return respond_json(exchange, 200,
                        exchange.dialect.model_list(ids, exchange.query.decode("latin-1")))


GET, POST = ("GET",), ("POST",)
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": Route(POST, CLIENT, _chat(OPENAI)),
    "/v1/messages": Route(POST, CLIENT, _chat(ANTHROPIC)),
    "/v1/responses": Route(POST, CLIENT, _chat(RESPONSES)),
    "/v1/embeddings": Route(POST, CLIENT, _chat(EMBEDDINGS)),
    "/v1/messages/count_tokens": Route(POST, CLIENT, _chat(COUNT_TOKENS)),
    "/v1/models": Route(GET, CLIENT, _models),
    "/healthz": Route(
        GET,
        OPEN,
        lambda host, exchange, scope, receive: respond_json(exchange, 200, {"status": "ok"}),
    ),
    "/readyz": Route(GET, OPEN, lambda host, exchange, scope, receive: host.admin.ready(exchange)),
    "/admin": Route(None, OPEN, _to_console),
    "/metrics": Route(
        GET,
        ADMIN,
        lambda host, exchange, scope, receive: respond(
            exchange, 200, host.metrics.render(), content_type=CONTENT_TYPE
        ),
    ),
    "/admin/plan": Route(
        GET,
        ADMIN,
        lambda host, exchange, scope, receive: host.admin.answer_plan(
            exchange, scope.get("query_string", b"")
        ),
    ),
    "/admin/health": Route(
        GET, ADMIN, lambda host, exchange, scope, receive: host.admin.answer_health(exchange)
    ),
    "/admin/reload": Route(
        POST, ADMIN, lambda host, exchange, scope, receive: host.admin.reload(exchange)
    ),
    "/admin/": Route(
        None,
        ADMIN,
        lambda host, exchange, scope, receive: host.console.handle(scope, receive, exchange),
    ),
}
CONSOLE = ROUTES["/admin/"]  # also every path under /admin/console/
# the paths the request metrics name; the console's pages and the redirect to it count as "other"
METERED = frozenset(path for path, route in ROUTES.items() if route.methods is not None)


def _area(path: str) -> str:
    return ADMIN if path == "/metrics" or path.startswith("/admin/") else CLIENT


async def dispatch(host: RouteHost, exchange: Exchange, scope: Scope,
                   headers: dict[bytes, bytes], receive: Receive) -> None:
    path = exchange.path
    if not await _head_acceptable(host.settings, exchange, scope, headers):
        return
    route = ROUTES.get(path)
    if route is None and path.startswith("/admin/console/"):
        route = CONSOLE
    # a HEAD is a GET whose body the server does not send
    answers = route is not None and (
        route.methods is None
        or ("GET" if exchange.method == "HEAD" else exchange.method) in route.methods
    )
    guard = route.guard if answers and route is not None else _area(path)
    if guard is ADMIN:
        if not await _admin_guard(host.access, scope, headers, exchange):
            return
    elif guard is CLIENT and not await _client_guard(host.access, exchange, headers):
        return
    del headers
    if not answers or route is None:
        await _not_found(exchange, path, route)
        return
    answer = route.answer(host, exchange, scope, receive)
    del scope  # the answer's own frame frees it once the request is read
    await answer


async def _head_acceptable(settings: GatewaySettings, exchange: Exchange, scope: Scope,
                           headers: dict[bytes, bytes]) -> bool:
    """The server bounds a head still arriving; a whole one that came in one read is checked here,
    where its 431 is in the route's dialect (an Anthropic client's error shape) and has its access
    line and request id, which the server's own refusal (no route seen) cannot give. Which of two
    credential headers authenticates a request is no guess to make (proxies in front may each
    read another one): a repeated one is a 400."""
    head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
        len(k) + len(v) + 4 for k, v in scope.get("headers") or ())
    if head > settings.max_header_bytes:
        await respond(
            exchange,
            431,
            exchange.dialect.http_error(
                431,
                f"request headers larger than {settings.max_header_bytes} bytes",
                "headers_too_large",
            ),
            headers=[(b"connection", b"close")],
        )
        return False
    if len(headers) < len(scope.get("headers") or ()):  # a name came twice (the dict kept one)
        repeated = _repeated_credential(scope["headers"])
        if repeated is not None:
            await respond(exchange, 400, exchange.dialect.http_error(
                400, f"more than one {repeated} header: send one credential", "malformed_request"))
            return False
    return True


def _repeated_credential(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The credential header a request carries more than once, if any."""
    seen: set[bytes] = set()
    for name, _ in headers:
        if name in (b"authorization", b"x-api-key"):
            if name in seen:
                return name.decode()
            seen.add(name)
    return None


async def _not_found(send: Exchange, path: str, route: Route | None) -> None:
    if route is not None:
        allowed = route.allow
        await respond(send, 405, send.dialect.http_error(
            405, f"{path} answers {allowed.decode()}, not {send.method}", "method_not_allowed"),
            headers=[(b"allow", allowed)])
        return
    await respond(send, 404,
                  send.dialect.http_error(404, f"no route for {send.method} {path[:200]}",
                                          "not_found"))


async def _unauthorised(send: Exchange, message: str) -> None:
    challenges = [(b"www-authenticate", b"Bearer")]
    if send.path == "/admin/":
        # a browser opening the console asks its user for the key
        challenges.append((b"www-authenticate", b'Basic realm="relayline admin", charset="UTF-8"'))
    await respond(send, 401, send.dialect.http_error(401, message, "invalid_api_key"),
                  headers=challenges)


async def _client_guard(access: Access, exchange: Exchange, headers: dict[bytes, bytes]) -> bool:
    """A client key when client keys are configured: its caller is noted on the exchange."""
    if not access.clients:
        return True
    who = access.clients.caller(bearer(headers))
    if who is not None:
        exchange.client, exchange.caller = who.id, who
        return True
    await _unauthorised(exchange, "missing or invalid gateway API key")
    return False


async def _admin_guard(access: Access, scope: Scope, headers: dict[bytes, bytes],
                       send: Exchange) -> bool:
    """/admin/* and /metrics: an admin key when admin keys are configured, else a client key
    when client keys are, else loopback clients only."""
    if access.admins:
        if access.admins.match(bearer(headers)) is not None:
            return True
        await _unauthorised(send, "missing or invalid admin key")
        return False
    if access.clients:
        if access.clients.match(bearer(headers)) is not None:
            return True
        await _unauthorised(send, "missing or invalid gateway API key")
        return False
    if is_loopback(scope.get("client")):
        return True
    await respond(send, 403, send.dialect.http_error(
        403,
        "admin endpoints answer loopback clients only when no admin or client keys are configured "
        "([gateway] admin_keys_env)", "forbidden"))
    return False
