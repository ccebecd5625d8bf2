"""The configuration, structured from TOML by cattrs into the model's frozen attrs classes
(config_model.py, re-exported here).

Keys and defaults are exactly those docs/configuration.md documents. Structuring is strict (a
string is not an int, an unknown key is an error) and reports every problem at once, each with
its key path in the operator's own notation: `providers."anthropic.main".fallbacks[1]`. Values
whose validity depends on other keys are checked after structuring, with the same paths
(config_checks.py).
"""

from __future__ import annotations

import tomllib
import typing
from collections.abc import Callable
from typing import Any, Literal

import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import mapping_structure_factory

from .config_checks import join_path, key_segment, resolve_ref, semantic_problems
from .config_model import (
    Breaker,
    BudgetPeriod,
    Capabilities,
    CatalogModel,
    Config,
    EffortRouting,
    Gateway,
    GatewayKey,
    GatewayTeam,
    Health,
    Ledger,
    Limits,
    Notices,
    Price,
    Provider,
    Reliability,
    Route,
    Secret,
    Stream,
    Timeouts,
)
from .errors import ConfigError

__all__ = [  # the model, imported from here by every caller
    "Secret", "Capabilities", "Price", "Provider", "Reliability", "Breaker", "Timeouts", "Limits",
    "Stream", "Route", "CatalogModel", "EffortRouting", "Notices", "BudgetPeriod", "GatewayKey",
    "GatewayTeam", "Gateway", "Ledger", "Health", "Config", "ConfigError", "join_path",
    "key_segment", "parse_config", "parse_toml", "resolve_ref", "structure_config",
]


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
    lambda t: typing.get_origin(t) is Literal,  # type: ignore[comparison-overlap]
    _structure_literal,
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
    base = mapping_structure_factory(type_, _converter, dict,
                                     detailed_validation=_converter.detailed_validation)

    def structure(value: Any, _type: Any) -> Any:
        return base(_structure_mapping_table(value, _type), _type)

    return structure


_converter.register_structure_hook_factory(
    lambda t: typing.get_origin(t) is dict, _structure_dicts  # type: ignore[comparison-overlap]
)


def _require_tables(converter: cattrs.Converter) -> None:
    # leaves first: a class's generated hook captures the hooks of its fields when it is made
    for cls in (Capabilities, Price, Provider, Reliability, Breaker, Timeouts, Limits, Stream,
                Route, CatalogModel, EffortRouting, Notices, GatewayKey, GatewayTeam, Gateway,
                Ledger, Health, Config):
        base = converter.get_structure_hook(cls)

        def structure(value: Any, type_: Any, _base: Any = base) -> Any:
            return _base(_structure_mapping_table(value, type_), type_)

        converter.register_structure_hook(cls, structure)


_require_tables(_converter)

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


def structure_config(raw: dict[str, Any]) -> Config:
    """Structure a parsed TOML document; raise ConfigError listing every problem."""
    if not isinstance(raw, dict):
        raise ConfigError(["config: expected a table"])
    try:
        cfg = _converter.structure(raw, Config)
    except Exception as exc:  # cattrs raises an exception group carrying every problem
        problems = _problems(exc, "")
        raise ConfigError(problems or [str(exc)]) from None
    problems = semantic_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """A TOML document as plain data; ConfigError when it is not TOML or nests deeper than the
    parser recurses (`a = [[[...]]]` thousands deep), which is no config either."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from None
    except RecursionError:
        raise ConfigError([f"{source}: not a usable config: its tables or arrays nest too "
                           "deeply"]) from None


def parse_config(text: str, source: str = "config") -> Config:
    return structure_config(parse_toml(text, source))
