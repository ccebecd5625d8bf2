"""The configuration, as frozen attrs classes structured from TOML by cattrs.

Keys and defaults are exactly those docs/configuration.md documents. Structuring is strict (a string is not an int, an
unknown key is an error) and reports every problem at once, each with its key path in the
operator's own notation: `providers."anthropic.main".fallbacks[1]`. Values whose validity
depends on other keys (an `active` that names no profile, a route without a hint) are checked
after structuring, with the same paths. Graph problems (dangling fallbacks, cycles) are not
errors here: plan.py prunes them with warnings, as the rules require (docs/concepts.md).
"""

from __future__ import annotations

import re
import tomllib
import typing
from collections.abc import Callable
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import mapping_structure_factory

from .errors import ConfigError


@attrs.frozen(repr=False)
class Secret:
    """A credential. Its repr and str never show it; `reveal()` is the one way to read it."""

    _value: str = attrs.field(alias="value")

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


@attrs.frozen
class Capabilities:
    # docs/wire.md: capabilities left unset default to true, except prefill
    streaming: bool = True
    tools: bool = True
    vision: bool = True
    prefill: bool = False  # accepts a trailing assistant message to continue from
    # strict tools and answers held to a JSON schema (OpenAI's strict / json_schema, Anthropic's
    # structured outputs)
    structured_outputs: bool = True
    # serves OpenAI's Responses API at {base_url}/responses: a Responses client's body goes as sent
    responses: bool = False
    # serves embeddings at {base_url}/embeddings (an openai profile; no other family has the API)
    embeddings: bool = True


@attrs.frozen
class Price:
    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


@attrs.frozen
class Provider:
    family: str
    base_url: str | None = None
    api_key: Secret | None = None
    api_key_env: str | None = None
    api_keys: tuple[Secret, ...] = ()
    model: str | None = None
    fallback_models: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    headers: dict[str, str] = attrs.Factory(dict)
    # client request headers sent on to this profile (beyond its family's own version and beta
    # headers): a header that picks who is billed or carries a credential travels only if named
    forward_headers: tuple[str, ...] = ()
    # the request header that carries the key, as is (Azure OpenAI's `api-key`); None: the
    # family's own (`authorization: Bearer <key>` for openai, `x-api-key` for anthropic)
    auth_header: str | None = None
    locality: Literal["cloud", "local"] = "cloud"
    capabilities: Capabilities = Capabilities()
    price: Price = Price()
    max_output_tokens: int | None = None  # max_tokens for an anthropic entry when the request sets none
    models: dict[str, str] = attrs.Factory(dict)  # catalog model name -> this profile's id for it
    prices: dict[str, Price] = attrs.Factory(dict)  # model name -> its price (else `price`)

    def price_of(self, *names: str | None) -> Price:
        """The price of the first of `names` this profile prices on its own, else its `price`."""
        for name in names:
            if name is not None and name in self.prices:
                return self.prices[name]
        return self.price


@attrs.frozen
class Reliability:
    provider_retries: int = 2
    backoff_ms: int = 500
    backoff_max_ms: int = 10000
    retry_after_max_ms: int = 30000
    rate_limit_cooldown_default_s: float = 10.0
    rate_limit_cooldown_max_s: float = 60.0
    retry_after_wait_max_s: float = 0.0  # a 429 with a Retry-After at most this is waited out (0 = off)
    max_fallback_depth: int = 3
    client_errors: Literal["advance", "stop"] = "advance"
    context_window: Literal["return", "advance"] = "return"
    on_refusal: Literal["return", "advance"] = "return"

    @property
    def first_backoff_s(self) -> float:
        # the first wait has a floor of 50 ms, whatever is configured
        return max(self.backoff_ms, 50) / 1000.0


@attrs.frozen
class Breaker:
    enabled: bool = True
    window_s: float = 300.0
    failure_threshold: int = 3
    open_s: float = 60.0


@attrs.frozen
class Timeouts:
    headers_s: float = 240.0
    first_token_s: float = 0.0
    idle_s: float = 60.0
    gate_commit_s: float = 30.0
    total_s: float = 600.0  # a whole turn: streams, retries and waits included


@attrs.frozen
class Limits:
    max_response_bytes: int = 32 * 1024 * 1024  # a non-streamed body, or the text one stream accumulates


@attrs.frozen
class Stream:
    recovery: Literal["non_streaming", "streaming"] = "non_streaming"
    continue_after_interrupt: bool = False


@attrs.frozen
class Route:
    hint: str
    provider: str
    model: str
    api_key: Secret | None = None


@attrs.frozen
class CatalogModel:
    """A model clients ask for by name, and the profiles (channels) that can serve it."""

    model: str
    channels: tuple[str, ...]
    order: Literal["cost", "config"] = "cost"
    max_hops: int = 3


@attrs.frozen
class EffortRouting:
    local_hint: str = "local"
    cloud_hint: str = "cloud"
    escalation: Literal["auto", "off"] = "auto"


@attrs.frozen
class Notices:
    model_fallback_notice: Literal["off", "redacted", "detailed"] = "off"


BudgetPeriod = Literal["day", "week", "month"]


@attrs.frozen
class GatewayKey:
    """A named client key: who calls, with what limits. The key itself is in the environment
    (`key_env`) or given as its SHA-256 (`key_sha256`), never in the file in clear."""

    name: str
    key_env: str | None = None
    key_sha256: str | None = None
    team: str | None = None
    models: tuple[str, ...] | None = None  # the hints and catalog models it may name (None: all)
    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None
    budget_period: BudgetPeriod = "month"


@attrs.frozen
class GatewayTeam:
    """Limits shared by every key that names the team."""

    name: str
    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None
    budget_period: BudgetPeriod = "month"


@attrs.frozen
class Gateway:
    api_keys_env: str | None = None  # names a variable of comma-separated client keys
    admin_keys_env: str | None = None  # names a variable of comma-separated admin keys
    auth: Literal["keys", "none"] = "keys"  # "none": a gateway open to anyone who can reach it, on purpose
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_in_flight: int = 0  # 0 = unbounded
    body_timeout_s: float = 30.0
    keep_alive_s: float = 75.0
    drain_s: float = 30.0
    drop_unsupported_params: bool = False  # drop (and name) what an entry cannot honour instead of skipping it
    # a model name nothing offers: a 404 naming it ("reject"), or served by the default domain
    unknown_models: Literal["reject", "default"] = "reject"
    keys: tuple[GatewayKey, ...] = ()
    teams: tuple[GatewayTeam, ...] = ()
    limits_on_store_error: Literal["local", "closed", "open"] = "local"


@attrs.frozen
class Ledger:
    path: str | None = None
    url: str | None = None  # postgresql://...: a fleet's ledger (wins over path when both are set)


@attrs.frozen
class Health:
    store: str = "memory"  # or redis://host:port/db: health shared by every worker of a fleet
    key_prefix: str = "relayline:"


@attrs.frozen
class Config:
    active: str
    model: str | None = None
    providers: dict[str, Provider] = attrs.Factory(dict)
    reliability: Reliability = Reliability()
    breaker: Breaker = Breaker()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    stream: Stream = Stream()
    routes: tuple[Route, ...] = ()
    catalog: tuple[CatalogModel, ...] = ()
    effort_routing: EffortRouting | None = None
    notices: Notices = Notices()
    gateway: Gateway = Gateway()
    ledger: Ledger = Ledger()
    health: Health = Health()


# ---------------------------------------------------------------------------------------------
# structuring


def _strict(kind: type, label: str) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _type: Any) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ValueError(f"expected {label}, got {_describe(value)}")
        return value

    return structure


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _structure_literal(value: Any, literal_type: Any) -> Any:
    options = typing.get_args(literal_type)
    if value not in options:
        raise ValueError(f"must be one of {', '.join(repr(o) for o in options)}, got {value!r}")
    return value


def _structure_secret(value: Any, _type: Any) -> Secret:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {_describe(value)}")
    return Secret(value)


def _structure_mapping_table(value: Any, type_: Any) -> Any:
    if not isinstance(value, dict):
        raise ValueError(f"expected a table, got {_describe(value)}")
    return value


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_structure_hook(str, _strict(str, "a string"))
_converter.register_structure_hook(int, _strict(int, "an integer"))
_converter.register_structure_hook(float, _strict(float, "a number"))
_converter.register_structure_hook(bool, _strict(bool, "a boolean"))
_converter.register_structure_hook(Secret, _structure_secret)
_converter.register_structure_hook_func(
    lambda t: typing.get_origin(t) is Literal, _structure_literal  # type: ignore[comparison-overlap]
)


def _structure_tuple(value: Any, type_: Any) -> tuple[Any, ...]:
    # cattrs would read a string as a sequence of characters: only a TOML array is a list here.
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {_describe(value)}")
    elem = typing.get_args(type_)[0]
    out: list[Any] = []
    errors: list[Exception] = []
    for i, item in enumerate(value):
        try:
            out.append(_converter.structure(item, elem))
        except Exception as exc:
            exc.add_note(IterableValidationNote(f"Structuring {type_} @ index {i}", i, elem))
            errors.append(exc)
    if errors:
        raise IterableValidationError(f"While structuring {type_!r}", errors, type_)
    return tuple(out)


_converter.register_structure_hook_func(
    lambda t: typing.get_origin(t) is tuple, _structure_tuple  # type: ignore[comparison-overlap]
)


def _structure_dicts(type_: Any) -> Callable[[Any, Any], Any]:
    # cattrs' own mapping hook calls .items() on whatever it is given: a TOML string or array
    # where a table belongs would surface as "'str' object has no attribute 'items'"
    # (cattrs.gen's factory: the converter's gen_structure_mapping would register the bare hook)
    base = mapping_structure_factory(type_, _converter, dict, detailed_validation=_converter.detailed_validation)

    def structure(value: Any, _type: Any) -> Any:
        return base(_structure_mapping_table(value, _type), _type)

    return structure


_converter.register_structure_hook_factory(
    lambda t: typing.get_origin(t) is dict, _structure_dicts  # type: ignore[comparison-overlap]
)


def _require_tables(converter: cattrs.Converter) -> None:
    # leaves first: a class's generated hook captures the hooks of its fields when it is made
    for cls in (Capabilities, Price, Provider, Reliability, Breaker, Timeouts, Limits, Stream, Route,
                CatalogModel, EffortRouting, Notices, GatewayKey, GatewayTeam, Gateway, Ledger, Health, Config):
        base = converter.get_structure_hook(cls)

        def structure(value: Any, type_: Any, _base: Any = base) -> Any:
            return _base(_structure_mapping_table(value, type_), type_)

        converter.register_structure_hook(cls, structure)


_require_tables(_converter)

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


def _problems(exc: BaseException, path: str) -> list[str]:
    if isinstance(exc, ForbiddenExtraKeysError):
        return [f"{join_path(path, k)}: unknown key" for k in sorted(exc.extra_fields)]
    if isinstance(exc, BaseValidationError):
        out = []
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", ()):
                if isinstance(note, AttributeValidationNote):
                    sub_path = join_path(path, note.name)
                elif isinstance(note, IterableValidationNote):
                    sub_path = join_path(path, note.index)
            out.extend(_problems(sub, sub_path))
        return out
    if isinstance(exc, KeyError):
        return [f"{path}: required key is missing"]
    return [f"{path or 'config'}: {exc}"]


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,255}$")


def _base_url_problems(url: str, where: str) -> list[str]:
    """A base_url is an endpoint, never a credential: `user:pass@` in it would be logged with
    the URL and sent instead of the configured key, so it is refused (and never repeated)."""
    parsed = urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or any(c.isspace() for c in url):
        return [f"{where}: must be an http(s) URL such as https://api.example.com/v1"]
    if "@" in parsed.netloc:
        return [f"{where}: must not carry credentials (user:password@); give the key with api_key_env"]
    return []


_HEADER_NAME = re.compile(r"^[-!#$%&'*+.^_`|~0-9A-Za-z]+$")  # RFC 9110's token
# what describes the connection or the message's framing, never the client's to pass on
_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
                          "trailer", "expect", "proxy-authorization", "proxy-connection", "content-type"})


def _forward_header_problems(names: tuple[str, ...], where: str) -> list[str]:
    problems = []
    for i, name in enumerate(names):
        if not _HEADER_NAME.match(name):
            problems.append(f"{where}[{i}]: not a header name")
        elif name.lower() in _HOP_HEADERS:
            problems.append(f"{where}[{i}]: {name} describes the connection or the body, not the request: it is "
                            "never forwarded")
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
            problems.append(f"gateway.{name}: must name an environment variable (leave it out for none)")
    if g.auth == "none" and (g.api_keys_env is not None or g.keys):
        problems.append('gateway.auth: "none" says the gateway takes no client keys, but gateway.api_keys_env '
                        "or [[gateway.keys]] names some: remove one of the two")
    return problems + _named_key_problems(g)


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _limit_problems(limits: GatewayKey | GatewayTeam, where: str) -> list[str]:
    problems = [f"{where}.{name}: must be at least 1" for name in ("rpm", "tpm")
                if getattr(limits, name) is not None and getattr(limits, name) < 1]
    if limits.budget_usd is not None and limits.budget_usd < 0:
        problems.append(f"{where}.budget_usd: must not be negative")
    return problems


def _named(items: typing.Sequence[GatewayKey | GatewayTeam], where: str) -> tuple[dict[str, int], list[str]]:
    """The names of `items` (index by name), and the problems of blank or repeated ones."""
    names: dict[str, int] = {}
    problems = []
    for i, item in enumerate(items):
        if not item.name or item.name != item.name.strip() or any(c.isspace() or not c.isprintable() for c in item.name):
            problems.append(f"{where}[{i}].name: must be a non-blank name without spaces")
        elif item.name in names:
            problems.append(f"{where}[{i}].name: {item.name!r} is already {where}[{names[item.name]}].name")
        else:
            names[item.name] = i
    return names, problems


def _named_key_problems(g: Gateway) -> list[str]:
    teams, problems = _named(g.teams, "gateway.teams")
    problems += [p for i, team in enumerate(g.teams) for p in _limit_problems(team, f"gateway.teams[{i}]")]
    _, key_problems = _named(g.keys, "gateway.keys")
    problems += key_problems
    for i, key in enumerate(g.keys):
        where = f"gateway.keys[{i}]"
        given = [k for k in ("key_env", "key_sha256") if getattr(key, k) is not None]
        if len(given) != 1:
            problems.append(f"{where}: set exactly one of key_env, key_sha256")
        if key.key_env is not None and not _ENV_NAME.match(key.key_env):
            problems.append(f"{where}.key_env: must name an environment variable (letters, digits and "
                            "underscores, not starting with a digit); to give the key itself use key_sha256")
        if key.key_sha256 is not None and not _SHA256_HEX.match(key.key_sha256):
            problems.append(f"{where}.key_sha256: must be 64 lowercase hex digits (the key's SHA-256)")
        if key.team is not None and key.team not in teams:
            problems.append(f"{where}.team: names no [[gateway.teams]] entry ({key.team!r})")
        if key.models is not None and not key.models:
            problems.append(f"{where}.models: must list at least one model (leave it out for all)")
        problems += _limit_problems(key, where)
    return problems


def _semantic_problems(cfg: Config) -> list[str]:
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
    for name in ("rate_limit_cooldown_default_s", "rate_limit_cooldown_max_s", "retry_after_wait_max_s"):
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
            # a key pasted here by mistake must not be echoed back: say what is wrong, not what it is
            problems.append(f"{where}.api_key_env: must name an environment variable (letters, digits and "
                            f"underscores, not starting with a digit); to give the key itself use api_key")
        if p.base_url is not None:
            problems.extend(_base_url_problems(p.base_url, f"{where}.base_url"))
        if len(given) > 1:
            problems.append(f"{where}: set only one of api_key, api_key_env, api_keys (found {', '.join(given)})")
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
            problems.append(f"{where}.model: must not be blank (leave it out for an unpinned profile)")
    seen_hints: dict[str, int] = {}
    for i, route in enumerate(cfg.routes):
        where = f"routes[{i}]"
        if not route.hint or route.hint != route.hint.strip():
            problems.append(f"{where}.hint: must be a non-blank name without surrounding spaces")
        elif route.hint in seen_hints:
            problems.append(f"{where}.hint: {route.hint!r} is already routes[{seen_hints[route.hint]}].hint")
        else:
            seen_hints[route.hint] = i
        if not route.model.strip():
            problems.append(f"{where}.model: must not be blank")
    if cfg.health.store != "memory" and not cfg.health.store.startswith(("redis://", "rediss://", "unix://")):
        problems.append("health.store: must be \"memory\" or a redis://host:port/db URL")
    if not cfg.health.key_prefix:
        problems.append("health.key_prefix: must not be empty (every worker's keys live under it)")
    if cfg.ledger.url is not None and not cfg.ledger.url.startswith(("postgresql://", "postgres://")):
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
            problems.append(f"{where}.model: {name!r} is reserved (hint:NAME selects a route, auto effort routing)")
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
                problems.append(f"{where}.channels[{j}]: {ref!r} names no profile (or an ambiguous bare alias)")
            elif alias in seen:
                problems.append(f"{where}.channels[{j}]: {ref!r} is already channels[{seen[alias]}]")
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
                    problems.append(f"{join_path(f'{where}.prices', name)}.{field}: must not be negative")
    return problems


def resolve_ref(cfg: Config, ref: str) -> str | None:
    """A full alias, or a bare alias (the part after the family prefix) unique across families.
    An ambiguous or unknown bare alias resolves to None (dangling)."""
    if ref in cfg.providers:
        return ref
    matches = [a for a in cfg.providers if "." in a and a.split(".", 1)[1] == ref]
    return matches[0] if len(matches) == 1 else None


def structure_config(raw: dict[str, Any]) -> Config:
    """Structure a parsed TOML document; raise ConfigError listing every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(["config: expected a table"])
    try:
        cfg = _converter.structure(raw, Config)
    except Exception as exc:  # cattrs raises an exception group carrying every problem
        problems = _problems(exc, "")
        raise ConfigError(problems or [str(exc)]) from None
    problems = _semantic_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_toml(text: str, source: str = "config") -> dict[str, Any]:
    """A TOML document as plain data; ConfigError when it is not TOML or nests deeper than the
    parser recurses (`a = [[[...]]]` thousands deep), which is no config either."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from None
    except RecursionError:
        raise ConfigError([f"{source}: not a usable config: its tables or arrays nest too deeply"]) from None


def parse_config(text: str, source: str = "config") -> Config:
    return structure_config(parse_toml(text, source))
