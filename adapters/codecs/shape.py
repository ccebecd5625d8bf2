"""Reading JSON of a known shape: the checks every codec reads a body or a reply with.

Dialect bodies (a client's mistake: a 400 naming `param`) and provider replies (a provider's
mistake: a `malformed` failure) are read with the same checks. Each names the field it found
wrong in the client's own notation (`messages[2].content[0].text`), so the error says where.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from relayline.machines.ledger import MAX_TOKENS
from relayline.machines.wire import WireError, describe

MAX_MODEL_CHARS = 256  # a model name reaches headers, logs and the ledger: bounded and printable


def check_model(model: object, param: str = "model") -> str | None:
    """A model name a client may send: a printable string of bounded length (or absent)."""
    if model is None:
        return None
    if not isinstance(model, str):
        raise WireError(param, f"expected a string, got {describe(model)}")
    if not model or len(model) > MAX_MODEL_CHARS or not model.isprintable():
        raise WireError(param, f"must be 1 to {MAX_MODEL_CHARS} printable characters")
    return model


# values that say nothing: a client that sends them asked for nothing another family must honour
# (the official SDKs echo `refusal: null`, `annotations: []`, `citations: null` back in history)
NEUTRAL: dict[str, object] = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
                              "store": False}


def extras(fields: Mapping[str, Any], known: Collection[str]) -> list[str]:
    """The names of `fields` outside `known` that carry something (not null, empty or neutral)."""
    return [k for k, v in fields.items()
            if k not in known and v is not None and v != [] and v != {}
            and not (k in NEUTRAL and v == NEUTRAL[k])]


def path(base: str, key: object) -> str:
    if isinstance(key, int):
        return f"{base}[{key}]"
    return f"{base}.{key}" if base else str(key)


def want(value: Any, kind: Any, param: str, label: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise WireError(param, f"expected {label}, got {describe(value)}")
    return value


def _kinds(kind: Any) -> tuple[Any, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def want_str(value: object, param: str) -> str:
    checked: str = want(value, str, param, "a string")
    return checked


def want_list(value: object, param: str) -> list[Any]:
    checked: list[Any] = want(value, list, param, "a list")
    return checked


def want_dict(value: object, param: str) -> dict[str, Any]:
    checked: dict[str, Any] = want(value, dict, param, "an object")
    return checked


def want_bool(value: object, param: str) -> bool:
    checked: bool = want(value, bool, param, "a boolean")
    return checked


def want_int(value: object, param: str, low: int = 0, high: int = MAX_TOKENS) -> int:
    number: int = want(value, int, param, "an integer")
    if not low <= number <= high:
        raise WireError(param, f"must be between {low} and {high}")
    return number


def want_number(value: object, param: str, low: float, high: float) -> float:
    number: float = want(value, int | float, param, "a number")
    if not low <= number <= high:
        raise WireError(param, f"must be between {low:g} and {high:g}")
    return float(number)


def optional(obj: dict[str, Any], key: str, check: Callable[..., Any], base: str = "",
             *args: Any) -> Any:
    """obj[key] checked by `check`, or None when absent or null."""
    value = obj.get(key)
    return None if value is None else check(value, path(base, key), *args)
