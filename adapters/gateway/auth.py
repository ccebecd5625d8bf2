"""Who may call the gateway: client keys for /v1/*, admin keys for /admin/* and /metrics.

Fail closed: a config that names a key variable which is unset or empty refuses to start (and
`relayline check` says so), because an operator who wrote `api_keys_env` meant to require keys.
Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key
without stopping early, so neither a key's length nor its position leaks through timing. A
client is known afterwards only by its key id, a short hash, and, for a named key
(`[[gateway.keys]]`), by the key's name and team: that is what the ledger, the logs and the
metrics may carry, never the key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Iterable, Mapping

import attrs

from relayline.machines.config import Config, GatewayKey
from relayline.machines.errors import ConfigError

from ..redact import protect


def key_id(key: str) -> str:
    """A stable, short, non-reversible name for a key (12 hex digits of its SHA-256)."""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


@attrs.frozen
class Caller:
    """Who a client key says the caller is: its key id, and for a named key its name and team
    (empty for a key of the flat `api_keys_env` list)."""

    id: str
    name: str = ""
    team: str = ""
    models: frozenset[str] | None = None  # the allowlist (None: every model)

    def may_use(self, model: str | None) -> bool:
        return self.models is None or model in self.models


def _caller(digest: bytes, key: GatewayKey) -> Caller:
    return Caller("k-" + digest.hex()[:12], key.name, key.team or "",
                  frozenset(key.models) if key.models is not None else None)


@attrs.frozen
class KeyRing:
    """A set of keys, held as digests: the ring itself never holds a key in clear."""

    digests: tuple[tuple[bytes, Caller], ...] = ()  # (sha256, who it is)

    @classmethod
    def of(cls, keys: Iterable[str], named: tuple[tuple[bytes, Caller], ...] = ()) -> KeyRing:
        flat = tuple((_digest(k), Caller(key_id(k))) for k in sorted(set(keys)) if k)
        return cls(flat + named)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def caller(self, token: str | None) -> Caller | None:
        """Who `token` is when it is one of the ring's keys, else None."""
        if not token or not self.digests:
            return None
        given = _digest(token)
        found = None
        for digest, who in self.digests:  # no early exit: every key costs the same
            if hmac.compare_digest(given, digest) and found is None:
                found = who
        return found

    def match(self, token: str | None) -> str | None:
        """The key id of `token` when it is one of the ring's keys, else None."""
        who = self.caller(token)
        return who.id if who is not None else None


@attrs.frozen
class Access:
    clients: KeyRing = KeyRing()
    admins: KeyRing = KeyRing()

    def admin_rule(self) -> str:
        if self.admins:
            return "admin key"
        return "client key" if self.clients else "loopback only"


def _read_keys(env: Mapping[str, str], name: str | None, path: str) -> KeyRing:
    if name is None:
        return KeyRing()
    keys = [k.strip() for k in env.get(name, "").split(",") if k.strip()]
    if not keys:
        raise ConfigError([f"{path}: names {name}, which is unset or empty: the gateway would run "
                           f"without authentication (set {name} to comma-separated keys, or remove "
                           f"{path})"])
    protect(keys)  # a key a client echoes back into a path or header never reaches a log line
    return KeyRing.of(keys)


def _named_keys(config: Config,
                env: Mapping[str, str]) -> tuple[tuple[tuple[bytes, Caller], ...], list[str]]:
    """The `[[gateway.keys]]` as (digest, caller), and the problems: an unset variable fails
    closed like `api_keys_env`; one key given twice would make its caller ambiguous."""
    named, problems = [], []
    for i, key in enumerate(config.gateway.keys):
        if key.key_sha256 is not None:
            digest = bytes.fromhex(key.key_sha256)
        else:
            value = env.get(key.key_env or "", "").strip()
            if not value:
                problems.append(f"gateway.keys[{i}].key_env: names {key.key_env}, which is unset "
                                "or empty "
                                f"(set it to the key named {key.name!r}, or remove that key)")
                continue
            protect([value])
            digest = _digest(value)
        named.append((digest, _caller(digest, key)))
    seen: dict[bytes, str] = {}
    for digest, who in named:
        if digest in seen:
            problems.append(f"gateway.keys: {who.name!r} and {seen[digest]!r} are the same key")
        seen[digest] = who.name
    return tuple(named), problems


def load_access(config: Config, env: Mapping[str, str]) -> Access:
    """The gateway's keys from the environment; ConfigError (with the key path) when a named
    variable holds no key."""
    problems = []
    rings = []
    for name in ("api_keys_env", "admin_keys_env"):
        try:
            rings.append(_read_keys(env, getattr(config.gateway, name), f"gateway.{name}"))
        except ConfigError as exc:
            problems += exc.problems
            rings.append(KeyRing())
    named, named_problems = _named_keys(config, env)
    problems += named_problems
    flat = {digest for digest, _ in rings[0].digests}
    problems += [
        f"gateway.keys: {who.name!r} is also a key of gateway.api_keys_env"
        for digest, who in named
        if digest in flat
    ]
    if problems:
        raise ConfigError(problems)
    return Access(KeyRing(rings[0].digests + named), rings[1])


# the request headers a client may present a key in
CREDENTIAL_HEADERS = frozenset({b"authorization", b"x-api-key"})


def credential_header(headers: Mapping[bytes, bytes]) -> bytes | None:
    """The header `bearer` reads the client's key from: `authorization` when it is a Bearer or
    Basic one, else `x-api-key` when there is one."""
    scheme = headers.get(b"authorization", b"")[:7].lower()
    if scheme == b"bearer " or scheme[:6] == b"basic ":
        return b"authorization"
    return b"x-api-key" if b"x-api-key" in headers else None


def bearer(headers: Mapping[bytes, bytes]) -> str | None:
    """The key a client presented: `Authorization: Bearer K` (OpenAI) or `x-api-key: K`
    (Anthropic), or the password of `Authorization: Basic` (a browser opening the console can
    send nothing else; the user name is ignored)."""
    name = credential_header(headers)
    if name is None:
        return None
    given = headers[name].decode("latin-1")
    if name == b"x-api-key":
        return given.strip() or None
    if given[:7].lower() == "bearer ":
        return given[7:].strip()
    try:
        return base64.b64decode(given[6:].strip(),
                                validate=True).decode("utf-8").partition(":")[2] or None
    except (ValueError, UnicodeDecodeError):
        return None


def is_loopback(client: tuple[str, int] | None) -> bool:
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def keyless(config: Config) -> bool:
    """A gateway that requires client keys (`auth = "keys"`, the default) but names none: it
    serves loopback clients only, so that it is never open by accident."""
    return (
        config.gateway.auth == "keys"
        and config.gateway.api_keys_env is None
        and not config.gateway.keys
    )


KEYLESS_NOTE = ("no client keys: the gateway answers on loopback addresses only (set [gateway] "
                "api_keys_env to a "
                'variable of comma-separated keys, or name keys with [[gateway.keys]], or auth = '
                '"none" for a '
                "gateway open on purpose)")


def _loopback_host(host: str) -> bool:
    """Whether every address `host` names (resolved as the bind will) is a loopback one."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    try:
        return bool(found) and all(
            ipaddress.ip_address(str(info[4][0]).partition("%")[0]).is_loopback for info in found
        )
    except ValueError:
        return False


def bind_refusal(config: Config, host: str) -> str | None:
    """Why `serve` must not listen on `host` with this config: a keyless gateway on an address
    other clients can reach. None when it may."""
    if not keyless(config) or _loopback_host(host):
        return None
    return (f"--host {host}: not a loopback address, and the gateway has no client keys; set "
            "[gateway] api_keys_env "
            'to a variable of comma-separated keys or name keys with [[gateway.keys]] (or auth = '
            '"none" for a '
            "gateway open on purpose)")

