"""docs/configuration.md documents exactly the keys the config model reads: a key added to
machines/config.py without a line there fails here, and so does a documented key that does not
exist (a typo, or a key that was removed)."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import attrs

from relayline.machines import config as model

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# how the reference names the keys of a table whose keys are the operator's own
PLACEHOLDERS = {"providers": "<alias>", "prices": "<model>"}


def _attrs_class(t):
    """The attrs class inside `t` (X, X | None), else None."""
    for candidate in (t, *typing.get_args(t)):
        if isinstance(candidate, type) and attrs.has(candidate):
            return candidate
    return None


def model_keys(cls=model.Config, prefix: str = "") -> set[str]:
    keys: set[str] = set()
    hints = typing.get_type_hints(cls, vars(model))
    for field in attrs.fields(cls):
        name = field.alias or field.name
        t = hints[field.name]
        origin, args = typing.get_origin(t), typing.get_args(t)
        nested = _attrs_class(t)
        if origin is dict and _attrs_class(args[1]) is not None:
            keys |= model_keys(args[1], f"{prefix}{name}.{PLACEHOLDERS.get(name, '<key>')}.")
        elif origin is tuple and args and _attrs_class(args[0]) is not None and args[0] is not model.Secret:
            keys |= model_keys(args[0], f"{prefix}{name}[].")
        elif nested is not None and nested is not model.Secret:
            keys |= model_keys(nested, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def documented_keys() -> set[str]:
    rows = re.findall(r"^\| `([^`]+)` \|", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    assert len(rows) == len(set(rows)), "a key is documented twice"
    return set(rows)


def test_every_config_key_is_documented_and_every_documented_key_exists():
    documented, real = documented_keys(), model_keys()
    missing = sorted(real - documented)
    unknown = sorted(documented - real)
    assert not missing, f"keys of machines/config.py without a line in docs/configuration.md: {missing}"
    assert not unknown, f"keys in docs/configuration.md that the config model does not read: {unknown}"


def test_the_key_walk_sees_nested_tables():
    keys = model_keys()
    assert {"active", "gateway.drain_s", "providers.<alias>.capabilities.prefill", "routes[].hint",
            "providers.<alias>.prices.<model>.input_per_mtok", "providers.<alias>.api_keys"} <= keys


def test_documented_defaults_match_the_model_for_scalar_keys():
    """The default column of every plain number, string or boolean key says the model's default."""
    text = DOC.read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", text, flags=re.MULTILINE))
    checked = 0
    for key, shown in defaults.items():
        shown = shown.strip().strip("`")
        value = _default(key)
        if shown == "required":
            continue
        if isinstance(value, bool):
            assert shown == str(value).lower(), key
        elif isinstance(value, int | float):
            assert float(shown) == value, key
        elif isinstance(value, str):
            assert shown == f'"{value}"', key
        else:
            continue
        checked += 1
    assert checked >= 30


def _default(key: str):
    target = model.Config("a")
    for part in key.split("."):
        if part.startswith("<") or part.endswith("[]"):
            return None
        target = getattr(target, part, None)
        if target is None:
            return None
    return target
