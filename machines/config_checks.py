"""The configuration's checks that need more than one key, and the key paths they report at.

Structuring (config.py) reads each key on its own: its type, its literal options, whether it is
known. What depends on other keys or on a value's form (an `active` that names no profile, a
route without a hint, a named key's limits, a catalog channel that resolves to no profile) is
checked here, after structuring, and every problem is named by its key path in the operator's
own notation: `providers."anthropic.main".fallbacks[1]`. Graph problems (dangling fallbacks,
cycles) are not errors here: plan.py prunes them with warnings.
"""

from __future__ import annotations

import re
import typing
from urllib.parse import urlsplit

from .config_model import Config, Gateway, GatewayKey, GatewayTeam

_BARE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def key_segment(key: object) -> str:
    """One path segment in the operator's notation: `.name`, `."dotted.alias"`, `[3]`."""
    if isinstance(key, int):
        return f"[{key}]"
    key = str(key)
    return f".{key}" if _BARE.match(key) else f'."{key}"'


def join_path(path: str, key: object) -> str:
    seg = key_segment(key)
    if not path and seg.startswith("."):
        return seg[1:]
    return path + seg


def resolve_ref(cfg: Config, ref: str) -> str | None:
    """A full alias, or a bare alias (the part after the family prefix) unique across families.
    An ambiguous or unknown bare alias resolves to None (dangling)."""
    if ref in cfg.providers:
        return ref
    matches = [a for a in cfg.providers if "." in a and a.split(".", 1)[1] == ref]
    return matches[0] if len(matches) == 1 else None


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")


def _base_url_problems(url: str, where: str) -> list[str]:
    """A base_url is an endpoint, never a credential: `user:pass@` in it would be logged with
    the URL and sent instead of the configured key, so it is refused (and never repeated)."""
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or any(c.isspace() for c in url):
        return [f"{where}: must be an http(s) URL such as https://api.example.com/v1"]
    if "@" in parsed.netloc:
        return [f"{where}: must not carry credentials (user:password@); give the key with "
                "api_key_env"]
    return []


_HEADER_NAME = re.compile(r"^[-!#$%&'*+.^_`|~0-9A-Za-z]+$")  # RFC 9110's token
# what describes the connection or the message's framing, never the client's to pass on
_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive",
                          "upgrade", "te", "trailer", "expect", "proxy-authorization",
                          "proxy-connection", "content-type"})


def _forward_header_problems(names: tuple[str, ...], where: str) -> list[str]:
    problems = []
    for i, name in enumerate(names):
        if not _HEADER_NAME.match(name):
            problems.append(f"{where}[{i}]: not a header name")
        elif name.lower() in _HOP_HEADERS:
            problems.append(f"{where}[{i}]: {name} describes the connection or the body, not the "
                            "request: it is never forwarded")
    return problems


def _gateway_problems(g: Gateway) -> list[str]:
    problems = []
    for name in ("max_body_bytes", "max_header_bytes"):
        if getattr(g, name) < 1:
            problems.append(f"gateway.{name}: must be at least 1")
    if g.max_in_flight < 0:
        problems.append("gateway.max_in_flight: must not be negative (0 = unbounded)")
    for name in ("body_timeout_s", "keep_alive_s"):
        if getattr(g, name) <= 0:
            problems.append(f"gateway.{name}: must be positive")
    if g.drain_s < 0:
        problems.append("gateway.drain_s: must not be negative")
    for name in ("api_keys_env", "admin_keys_env"):
        value = getattr(g, name)
        if value is not None and not value.strip():
            problems.append(f"gateway.{name}: must name an environment variable (leave it out "
                            "for none)")
    if g.auth == "none" and (g.api_keys_env is not None or g.keys):
        problems.append('gateway.auth: "none" says the gateway takes no client keys, but '
                        "gateway.api_keys_env or [[gateway.keys]] names some: remove one of the "
                        "two")
    return problems + _named_key_problems(g)


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _limit_problems(limits: GatewayKey | GatewayTeam, where: str) -> list[str]:
    problems = [f"{where}.{name}: must be at least 1" for name in ("rpm", "tpm")
                if getattr(limits, name) is not None and getattr(limits, name) < 1]
    if limits.budget_usd is not None and limits.budget_usd < 0:
        problems.append(f"{where}.budget_usd: must not be negative")
    return problems


def _named(items: typing.Sequence[GatewayKey | GatewayTeam],
           where: str) -> tuple[dict[str, int], list[str]]:
    """The names of `items` (index by name), and the problems of blank or repeated ones."""
    names: dict[str, int] = {}
    problems = []
    for i, item in enumerate(items):
        if not item.name or item.name != item.name.strip() or any(c.isspace() or not c.isprintable()
                                                                  for c in item.name):
            problems.append(f"{where}[{i}].name: must be a non-blank name without spaces")
        elif item.name in names:
            problems.append(f"{where}[{i}].name: {item.name!r} is already "
                            f"{where}[{names[item.name]}].name")
        else:
            names[item.name] = i
    return names, problems


def _named_key_problems(g: Gateway) -> list[str]:
    teams, problems = _named(g.teams, "gateway.teams")
    problems += [p for i, team in enumerate(g.teams)
                 for p in _limit_problems(team, f"gateway.teams[{i}]")]
    _, key_problems = _named(g.keys, "gateway.keys")
    problems += key_problems
    for i, key in enumerate(g.keys):
        where = f"gateway.keys[{i}]"
        given = [k for k in ("key_env", "key_sha256") if getattr(key, k) is not None]
        if len(given) != 1:
            problems.append(f"{where}: set exactly one of key_env, key_sha256")
        if key.key_env is not None and not _ENV_NAME.match(key.key_env):
            problems.append(f"{where}.key_env: must name an environment variable (letters, digits "
                            "and underscores, not starting with a digit); to give the key itself "
                            "use key_sha256")
        if key.key_sha256 is not None and not _SHA256_HEX.match(key.key_sha256):
            problems.append(f"{where}.key_sha256: must be 64 lowercase hex digits (the key's "
                            "SHA-256)")
        if key.team is not None and key.team not in teams:
            problems.append(f"{where}.team: names no [[gateway.teams]] entry ({key.team!r})")
        if key.models is not None and not key.models:
            problems.append(f"{where}.models: must list at least one model (leave it out for all)")
        problems += _limit_problems(key, where)
    return problems


def semantic_problems(cfg: Config) -> list[str]:
    """Checks that need more than one key. Graph problems are plan.py's (warnings)."""
    problems = []
    if cfg.active not in cfg.providers:
        problems.append(f"active: names no profile under [providers] ({cfg.active!r})")
    r = cfg.reliability
    for name in ("provider_retries", "backoff_ms", "backoff_max_ms", "retry_after_max_ms",
                 "max_fallback_depth"):
        if getattr(r, name) < 0:
            problems.append(f"reliability.{name}: must not be negative")
    if r.provider_retries > 20:
        problems.append("reliability.provider_retries: at most 20")
    for name in ("rate_limit_cooldown_default_s", "rate_limit_cooldown_max_s",
                 "retry_after_wait_max_s"):
        if getattr(r, name) < 0:
            problems.append(f"reliability.{name}: must not be negative")
    b = cfg.breaker
    if b.failure_threshold < 1:
        problems.append("breaker.failure_threshold: must be at least 1")
    for name in ("window_s", "open_s"):
        if getattr(b, name) <= 0:
            problems.append(f"breaker.{name}: must be positive")
    for name in ("headers_s", "first_token_s", "idle_s", "gate_commit_s"):
        if getattr(cfg.timeouts, name) < 0:
            problems.append(f"timeouts.{name}: must not be negative")
    if not cfg.timeouts.total_s > 0:
        problems.append("timeouts.total_s: must be positive (every turn ends)")
    if cfg.limits.max_response_bytes < 1:
        problems.append("limits.max_response_bytes: must be at least 1")
    problems += _gateway_problems(cfg.gateway)
    for alias, p in cfg.providers.items():
        where = join_path("providers", alias)
        given = [k for k in ("api_key", "api_key_env", "api_keys") if getattr(p, k)]
        if p.api_key_env is not None and not _ENV_NAME.match(p.api_key_env):
            # a key pasted here by mistake must not be echoed back: say what is wrong, not what it
            # is
            problems.append(f"{where}.api_key_env: must name an environment variable (letters, "
                            "digits and underscores, not starting with a digit); to give the key "
                            "itself use api_key")
        if p.base_url is not None:
            problems.extend(_base_url_problems(p.base_url, f"{where}.base_url"))
        if len(given) > 1:
            problems.append(f"{where}: set only one of api_key, api_key_env, api_keys "
                            f"(found {', '.join(given)})")
        for name in ("input_per_mtok", "output_per_mtok"):
            if getattr(p.price, name) < 0:
                problems.append(f"{where}.price.{name}: must not be negative")
        if p.max_output_tokens is not None and p.max_output_tokens < 1:
            problems.append(f"{where}.max_output_tokens: must be at least 1")
        problems.extend(_forward_header_problems(p.forward_headers, f"{where}.forward_headers"))
        if p.auth_header is not None and (not _HEADER_NAME.match(p.auth_header) or
                                          p.auth_header.lower() in _HOP_HEADERS):
            problems.append(f"{where}.auth_header: not a header name that can carry a key")
        if p.model is not None and not p.model.strip():
            problems.append(f"{where}.model: must not be blank (leave it out for an unpinned "
                            "profile)")
    seen_hints: dict[str, int] = {}
    for i, route in enumerate(cfg.routes):
        where = f"routes[{i}]"
        if not route.hint or route.hint != route.hint.strip():
            problems.append(f"{where}.hint: must be a non-blank name without surrounding spaces")
        elif route.hint in seen_hints:
            problems.append(f"{where}.hint: {route.hint!r} is already "
                            f"routes[{seen_hints[route.hint]}].hint")
        else:
            seen_hints[route.hint] = i
        if not route.model.strip():
            problems.append(f"{where}.model: must not be blank")
    store = cfg.health.store
    if store != "memory" and not store.startswith(("redis://", "rediss://", "unix://")):
        problems.append("health.store: must be \"memory\" or a redis://host:port/db URL")
    if not cfg.health.key_prefix:
        problems.append("health.key_prefix: must not be empty (every worker's keys live under it)")
    url = cfg.ledger.url
    if url is not None and not url.startswith(("postgresql://", "postgres://")):
        problems.append("ledger.url: must be a postgresql://user@host/db URL")
    if cfg.effort_routing is not None:
        for name in ("local_hint", "cloud_hint"):
            hint = getattr(cfg.effort_routing, name)
            if hint not in seen_hints:
                problems.append(f"effort_routing.{name}: no route has hint {hint!r}")
    return problems + _catalog_problems(cfg, seen_hints) + _allowlist_problems(cfg, seen_hints)


def _allowlist_problems(cfg: Config, hints: dict[str, int]) -> list[str]:
    """A key's allowlist names what clients may ask for: a name that is neither a route hint
    nor a catalog model would refuse every request for it, so it is a typo, said at load."""
    known = set(hints) | {item.model for item in cfg.catalog}
    return [f"gateway.keys[{i}].models[{j}]: {name!r} is neither a route hint nor a catalog model"
            for i, key in enumerate(cfg.gateway.keys) for j, name in enumerate(key.models or ())
            if name not in known]


def _catalog_problems(cfg: Config, hints: dict[str, int]) -> list[str]:
    """The catalog is static and read by operators: every entry must be exactly right, so what
    would be a pruning warning in the fallback graph (a channel naming no profile) is an error."""
    problems = []
    names: dict[str, int] = {}
    for i, item in enumerate(cfg.catalog):
        where = f"catalog[{i}]"
        name = item.model
        if not name or name != name.strip():
            problems.append(f"{where}.model: must be a non-blank name without surrounding spaces")
        elif name.startswith("hint:") or name == "auto":
            problems.append(f"{where}.model: {name!r} is reserved (hint:NAME selects a route, auto "
                            "effort routing)")
        elif name in names:
            problems.append(f"{where}.model: {name!r} is already catalog[{names[name]}].model")
        elif name in hints:
            problems.append(f"{where}.model: {name!r} is also routes[{hints[name]}].hint; "
                            "a name is either a route hint or a catalog model")
        else:
            names[name] = i
        if not item.channels:
            problems.append(f"{where}.channels: must list at least one profile")
        seen: dict[str, int] = {}
        for j, ref in enumerate(item.channels):
            alias = resolve_ref(cfg, ref)
            if alias is None:
                problems.append(f"{where}.channels[{j}]: {ref!r} names no profile (or an ambiguous "
                                "bare alias)")
            elif alias in seen:
                problems.append(f"{where}.channels[{j}]: {ref!r} is already "
                                f"channels[{seen[alias]}]")
            else:
                seen[alias] = j
        if item.max_hops < 1:
            problems.append(f"{where}.max_hops: must be at least 1")
    for alias, p in cfg.providers.items():
        where = join_path("providers", alias)
        for name, model_id in p.models.items():
            at = join_path(f"{where}.models", name)
            if name not in names:
                problems.append(f"{at}: names no [[catalog]] model")
            if not model_id.strip():
                problems.append(f"{at}: must not be blank")
        for name, price in p.prices.items():
            for field in ("input_per_mtok", "output_per_mtok"):
                if getattr(price, field) < 0:
                    at = join_path(f"{where}.prices", name)
                    problems.append(f"{at}.{field}: must not be negative")
    return problems
