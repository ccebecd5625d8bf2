"""The configuration's model: frozen attrs classes, one per table, with the defaults
docs/configuration.md documents. config.py structures them from TOML (and re-exports them, the
place every caller imports them from); config_checks.py checks what needs more than one key.
"""

from __future__ import annotations

from typing import Literal

import attrs


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
    # max_tokens for an anthropic entry when the request sets none
    max_output_tokens: int | None = None
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
    # a 429 with a Retry-After at most this is waited out (0 = off)
    retry_after_wait_max_s: float = 0.0
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
    # a non-streamed body, or the text one stream accumulates
    max_response_bytes: int = 32 * 1024 * 1024


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
    # "none": a gateway open to anyone who can reach it, on purpose
    auth: Literal["keys", "none"] = "keys"
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_in_flight: int = 0  # 0 = unbounded
    body_timeout_s: float = 30.0
    keep_alive_s: float = 75.0
    drain_s: float = 30.0
    # drop (and name) what an entry cannot honour instead of skipping it
    drop_unsupported_params: bool = False
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
