"""From config and request to the exact, ordered chain of entries a turn may attempt.

A reliability domain is one root profile flattened depth first (docs/concepts.md, "Reliability
domains and the attempt order"): the pinned primary, its fallback_models, then each fallback
profile with its own model, its own fallback_models and its own fallbacks. Bad edges are pruned
with a warning, never fatal; a reachable profile that cannot supply its credential, or whose
family is unknown, is fatal.

The router holds one domain for the active profile, one per unique route target, and one per
catalog model (docs/concepts.md "The catalog": its channels, cheapest first, cut at max_hops; a
channel's own fallbacks are not walked). `plan_turn` picks the domain for a request (model,
hint:NAME, catalog name, operator selection or effort decision), fills unpinned entries with the
requested model and prices every entry. Everything here is pure: the environment comes in as a
mapping, and the result is a frozen value the walk consumes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from . import effort
from .config import CatalogModel, Config, Price, Provider, Secret, join_path, resolve_ref
from .engine import Spec, check_precedence, load_spec
from .errors import ConfigError
from .families import FAMILIES

HINT_PREFIX = "hint:"
# plans kept per router: the models clients ask for are few, but a client may name any model, so
# the cache starts over when full rather than growing with them
MAX_CACHED_PLANS = 1024
CATALOG_DOMAIN = "catalog"  # the domain name of every catalog chain; the requested model names it
# what a turn asks a plan for: its model, the operator's model, the scope's selection, whether
# the gateway asks (a route's name then names the route)
PlanKey = tuple[str | None, str | None, effort.RouteSelection | None, bool]


@attrs.frozen
class ConfigWarning:
    code: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.code} at {self.path}: {self.message}"


@attrs.frozen
class Entry:
    """One element of a domain's chain. An unpinned entry has no model of its own: it forwards
    the requested one."""

    profile: str
    model: str | None
    pinned: bool


@attrs.frozen
class Domain:
    root: str
    entries: tuple[Entry, ...]
    # a route's api_key for its target profile (the first route credential wins)
    root_keys: tuple[Secret, ...] = ()
    catalog: CatalogModel | None = None


@attrs.frozen
class Router:
    config: Config
    default: Domain
    domains: dict[str, Domain]  # by route hint
    route_models: dict[str, str]  # by route hint
    catalog: dict[str, Domain]  # by catalog model name
    keys: dict[str, tuple[Secret, ...]]  # each profile's own credentials (a pool or one key)
    warnings: tuple[ConfigWarning, ...]
    # the model names the default domain sends itself (its pins and their catalog ids), or None
    # when it starts unpinned: an unpinned first entry forwards any name, so every name is served
    default_models: frozenset[str] | None = None
    # (model, operator model, selection, gateway) -> the plan `plan_turn` made for them without
    # an effort decision: the model sources read the request's text only for effort routing,
    # which a router has or has not, so such a plan depends on nothing else, and making it again
    # was most of a turn's routing (the sources asked, every entry resolved, priced and made
    # anew); bounded by MAX_CACHED_PLANS
    plans: dict[PlanKey, Plan] = attrs.field(factory=dict, eq=False, repr=False)


@attrs.frozen
class PlannedEntry:
    """An entry of one turn's plan: everything needed to call it, resolved."""

    index: int
    profile: str
    model: str
    pinned: bool
    provider: Provider
    keys: tuple[Secret, ...] = attrs.field(repr=False)
    price: Price = Price()  # this model's price on this profile (the ledger bills with it)
    # profile/model, once: a turn's answer, log lines and console read it several times, and a
    # router keeps its plans (`Router.plans`), so it is made once per model asked for
    label: str = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "label", f"{self.profile}/{self.model}")


@attrs.frozen
class Plan:
    domain: str
    requested_model: str | None
    entries: tuple[PlannedEntry, ...]
    allowlist: frozenset[str] | None
    effort: effort.EffortDecision | None
    warnings: tuple[str, ...]
    hint: str | None = None
    # profiles that cannot honour this turn's request, with the fields they cannot
    # (wire.unsupported)
    unfit: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    catalog: CatalogModel | None = None
    # what the turn asked for, "domain/model", made once: a kept plan serves many turns, and each
    # turn's result, error message and log read it
    requested: str = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        model = self.requested_model or (self.entries[0].model if self.entries else "")
        object.__setattr__(self, "requested", f"{self.domain}/{model}")

    def allows(self, profile: str) -> bool:
        return self.allowlist is None or profile in self.allowlist

    def serves(self, profile: str) -> bool:
        """Allowed, and able to honour the request as asked."""
        return self.allows(profile) and profile not in self.unfit

    def as_json(self) -> dict[str, object]:
        return {
            "domain": self.domain,
            "effort": self.effort.as_json() if self.effort else None,
            "allowlist": sorted(self.allowlist) if self.allowlist is not None else None,
            "catalog": attrs.asdict(self.catalog) if self.catalog else None,
            "entries": [{"provider": e.profile, "model": e.model, "pinned": e.pinned,
                         "price": attrs.asdict(e.price)} for e in self.entries],
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------------------------
# fallback references and materialisation


def materialise(config: Config, root: str,
                primary: str | None) -> tuple[tuple[Entry, ...], list[ConfigWarning]]:
    entries: list[Entry] = []
    warnings: list[ConfigWarning] = []
    visited: set[str] = set()
    max_depth = config.reliability.max_fallback_depth

    def add_profile(alias: str, model: str | None, path: tuple[str, ...], depth: int) -> None:
        visited.add(alias)
        profile = config.providers[alias]
        where = join_path("providers", alias)
        if model is not None:
            pins = [model]
            entries.append(Entry(alias, model, True))
            for i, fm in enumerate(profile.fallback_models):
                at = f"{where}.fallback_models[{i}]"
                if not fm.strip():
                    warnings.append(ConfigWarning("empty_fallback_model", at,
                                                  "blank model id pruned"))
                elif fm == model:
                    warnings.append(ConfigWarning("fallback_model_duplicates_primary", at,
                                                  f"{fm!r} is the primary model; pruned"))
                elif fm not in pins:
                    pins.append(fm)
                    entries.append(Entry(alias, fm, True))
        else:
            entries.append(Entry(alias, None, False))
        for i, ref in enumerate(profile.fallbacks):
            at = f"{where}.fallbacks[{i}]"
            target = resolve_ref(config, ref)
            if target is None:
                warnings.append(ConfigWarning("dangling_fallback_ref", at,
                                              f"{ref!r} names no profile (or an ambiguous bare "
                                              "alias); pruned"))
            elif target in path:
                warnings.append(ConfigWarning("fallback_cycle", at,
                                              f"{ref!r} is already on the path "
                                              f"{' -> '.join(path)}; pruned"))
            elif depth + 1 > max_depth:
                warnings.append(ConfigWarning("max_fallback_depth_exceeded", at,
                                              f"{ref!r} is at depth {depth + 1} > "
                                              f"max_fallback_depth {max_depth}; pruned"))
            elif target not in visited:
                # a profile reached twice through different branches is attempted once, first
                # place wins
                add_profile(target, config.providers[target].model, path + (target,), depth + 1)

    add_profile(root, primary, (root,), 0)
    return tuple(entries), warnings


def catalog_chain(config: Config, item: CatalogModel,
                  at: str) -> tuple[tuple[Entry, ...], list[ConfigWarning]]:
    """One pinned entry per channel with the channel's id for the model, cheapest first by that
    model's input + output price (a stable sort: ties keep the listed order), cut at max_hops.
    Channels were validated with the config: each names a profile, once."""
    chain, warnings = [], []
    for j, ref in enumerate(item.channels):
        alias = resolve_ref(config, ref)
        assert alias is not None  # channels were validated with the config
        profile = config.providers[alias]
        model = profile.models.get(item.model, item.model)
        chain.append(Entry(alias, model, True))
        if (item.order == "cost" and profile.price == Price()
                and not {item.model, model} & set(profile.prices)):
            # an unpriced channel counts as free: it would go first, and bill nothing
            warnings.append(ConfigWarning("unpriced_catalog_channel", f"{at}.channels[{j}]",
                                          f"{alias!r} has no price for {item.model!r} (prices or "
                                          "price): it is ordered as free"))
    if item.order == "cost":
        def cost(entry: Entry) -> float:
            price = config.providers[entry.profile].price_of(item.model, entry.model)
            return price.input_per_mtok + price.output_per_mtok

        chain.sort(key=cost)
    return tuple(chain[: item.max_hops]), warnings


def profile_keys(alias: str, profile: Provider,
                 env: Mapping[str, str]) -> tuple[tuple[Secret, ...], str | None]:
    """The profile's credentials and, when it cannot supply a required one, the problem."""
    if profile.api_keys:
        return tuple(profile.api_keys), None
    if profile.api_key is not None:
        return (profile.api_key,), None
    where = join_path("providers", alias)
    if profile.api_key_env:
        value = env.get(profile.api_key_env, "")
        if not value:
            return (), f"{where}.api_key_env: environment variable {profile.api_key_env} is not set"
        return (Secret(value),), None
    family = FAMILIES.get(profile.family)
    if family is not None and family.public_api and profile.base_url is None:
        return (), (f"{where}: the {profile.family} public API needs a credential (api_key, "
                    "api_key_env or api_keys)")
    return (), None


def build_router(config: Config, env: Mapping[str, str]) -> Router:
    """Materialise every domain. Raises ConfigError (naming the alias) for fatal problems."""
    warnings: list[ConfigWarning] = []
    primary = config.model or config.providers[config.active].model
    default_entries, w = materialise(config, config.active, primary)
    warnings += w
    default = Domain(config.active, default_entries)
    targets: dict[str, str] = {}  # route hint -> its target profile
    route_models: dict[str, str] = {}
    by_target: dict[str, Domain] = {config.active: default}
    for i, route in enumerate(config.routes):
        target = resolve_ref(config, route.provider)
        if target is None:
            warnings.append(ConfigWarning("unknown_route_provider", f"routes[{i}].provider",
                                          f"{route.provider!r} names no profile; route "
                                          f"{route.hint!r} dropped"))
            continue
        if target not in by_target:
            entries, w = materialise(config, target, config.providers[target].model)
            warnings += w
            by_target[target] = Domain(target, entries, (route.api_key,) if route.api_key else ())
        elif route.api_key and target != config.active and not by_target[target].root_keys:
            by_target[target] = attrs.evolve(by_target[target], root_keys=(route.api_key,))
        targets[route.hint] = target
        route_models[route.hint] = route.model
    # resolved after every route: a later route's credential also serves the earlier hints to its
    # target
    domains = {hint: by_target[target] for hint, target in targets.items()}
    catalog: dict[str, Domain] = {}
    for i, item in enumerate(config.catalog):
        entries, w = catalog_chain(config, item, f"catalog[{i}]")
        warnings += w
        catalog[item.model] = Domain(CATALOG_DOMAIN, entries, catalog=item)
    # fatal problems, for every profile any domain can reach
    problems: list[str] = []
    keys: dict[str, tuple[Secret, ...]] = {}
    # a route's own credential stands in for its target's, but not inside a catalog chain
    route_keyed = {d.root for d in by_target.values() if d.root_keys}
    route_keyed -= {e.profile for d in catalog.values() for e in d.entries}
    for domain in [*by_target.values(), *catalog.values()]:
        for entry in domain.entries:
            alias = entry.profile
            if alias in keys:
                continue
            profile = config.providers[alias]
            if profile.family not in FAMILIES:
                problems.append(f"{join_path('providers', alias)}.family: unknown family "
                                f"{profile.family!r} (known: {', '.join(FAMILIES)})")
            if profile.capabilities.responses and profile.family != "openai":
                problems.append(f"{join_path('providers', alias)}.capabilities.responses: only an "
                                f"openai profile serves the Responses API, not {profile.family!r}")
            found, problem = profile_keys(alias, profile, env)
            if problem and alias not in route_keyed:
                problems.append(problem)
            keys[alias] = found
    if problems:
        raise ConfigError(sorted(set(problems)))
    unique: dict[tuple[str, str], ConfigWarning] = {}
    for warning in warnings:
        unique.setdefault((warning.code, warning.path), warning)
    return Router(config, default, domains, route_models, catalog, keys, tuple(unique.values()),
                  _sent_models(config, default))


def _sent_models(config: Config, default: Domain) -> frozenset[str] | None:
    """What the default domain would send: each pin, and each of its profiles' catalog ids."""
    if not default.entries or not default.entries[0].pinned:
        return None
    names = {e.model for e in default.entries if e.model is not None}
    for entry in default.entries:
        names.update(config.providers[entry.profile].models.values())
    return frozenset(names)


def model_offered(router: Router, model: str) -> bool:
    """Whether a requested model names something this router offers: a route hint (bare or as
    hint:NAME), a catalog model, "auto" (the router chooses), or a model the default domain
    would send, also as "profile/model" with the default domain's own profile. Any other name
    would be answered by the default domain's pins, a model the caller did not ask for."""
    if model == "auto" or model in router.domains or model in router.catalog:
        return True
    if model.startswith(HINT_PREFIX):
        return model[len(HINT_PREFIX):] in router.domains
    sent = router.default_models
    if sent is None:
        return True
    root = router.default.root + "/"
    return model in sent or (model.startswith(root) and model[len(root):] in sent)


# ---------------------------------------------------------------------------------------------
# one turn's plan


# what a model source gives: the model chosen (None: the active profile's) and effort routing's
# decision when it chose; a source that names nothing gives None and the next one is asked
Choice = tuple[str | None, effort.EffortDecision | None]
ModelSource = Callable[[Config, str | None, str, str | None, effort.RouteSelection | None],
                       Choice | None]
AUTO = "auto"  # a selection or a model that hands the choice back to effort routing


def _operator_model(config: Config, model: str | None, text: str, operator_model: str | None,
                    selection: effort.RouteSelection | None) -> Choice | None:
    return (operator_model, None) if operator_model is not None and operator_model != AUTO else None


def _operator_selection(config: Config, model: str | None, text: str, operator_model: str | None,
                        selection: effort.RouteSelection | None) -> Choice | None:
    if operator_model is None and selection is not None and selection.owner == "operator":
        return selection.model, None
    return None


def _request_model(config: Config, model: str | None, text: str, operator_model: str | None,
                   selection: effort.RouteSelection | None) -> Choice | None:
    return (model, None) if model is not None and model != AUTO else None


def _route_hint(config: Config, model: str | None, text: str, operator_model: str | None,
                selection: effort.RouteSelection | None) -> Choice | None:
    decision = effort.decide(config, text)
    return None if decision is None else (HINT_PREFIX + decision.hint, decision)


def _selection(config: Config, model: str | None, text: str, operator_model: str | None,
               selection: effort.RouteSelection | None) -> Choice | None:
    return None if selection is None else (selection.model, None)


def _active_profile(config: Config, model: str | None, text: str, operator_model: str | None,
                    selection: effort.RouteSelection | None) -> Choice | None:
    return None, None


# the sources specs/turn.toml's [precedence.model] may name, and whether each always names a
# model (checked when the spec is first read for a plan)
MODEL_SOURCES: dict[str, tuple[ModelSource, bool]] = {
    "operator_model": (_operator_model, False),
    "operator_selection": (_operator_selection, False),
    "request_model": (_request_model, False),
    "route_hint": (_route_hint, False),
    "selection": (_selection, False),
    "active_profile": (_active_profile, True),
}


MODEL_SOURCES_BOUND = "plan.model_sources"  # where a spec keeps its sources, bound once


def model_sources(spec: Spec) -> tuple[ModelSource, ...]:
    """[precedence.model]'s sources, in its order, as the functions that ask them (checked once
    per spec: a mutated spec installed in place of the shipped one is checked when first read)."""
    bound: tuple[ModelSource, ...] | None = spec.derived.get(MODEL_SOURCES_BOUND)
    if bound is not None:
        return bound
    table = check_precedence(spec, "model", {name: always for name, (_, always)
                                             in MODEL_SOURCES.items()})
    ordered = tuple(MODEL_SOURCES[name][0] for name in table.names)
    spec.derived[MODEL_SOURCES_BOUND] = ordered
    return ordered


def plan_turn(
    router: Router,
    *,
    model: str | None = None,
    text: str = "",
    operator_model: str | None = None,
    selection: effort.RouteSelection | None = None,
    gateway: bool = False,
) -> Plan:
    """The plan for one turn: the model it is for is the first of specs/turn.toml's
    [precedence.model] sources that names one (the operator's, the request's, effort routing's,
    the scope's selection, the active profile's); "auto" in either selection hands the choice
    back to effort routing.
    """
    plans = router.plans
    key = (model, operator_model, selection, gateway)
    plan = plans.get(key)
    if plan is not None:
        return plan
    config = router.config
    choice: Choice | None = None
    for source in model_sources(load_spec("turn")):
        choice = source(config, model, text, operator_model, selection)
        if choice is not None:
            break
    assert choice is not None, "the last model source always names one"
    chosen, decision = choice
    if decision is not None:
        return _plan(router, chosen, decision, gateway)
    if len(plans) >= MAX_CACHED_PLANS:
        plans.clear()
    plan = plans[key] = _plan(router, chosen, None, gateway)
    return plan


def _plan(router: Router, chosen: str | None, decision: effort.EffortDecision | None,
          gateway: bool) -> Plan:
    """The plan for the model `chosen` (None: the active profile's), as `plan_turn` decided it."""
    config = router.config
    notes: list[str] = []
    domain, requested, hint = router.default, chosen, None
    if chosen is not None and chosen.startswith(HINT_PREFIX):
        name = chosen[len(HINT_PREFIX):]
        if name in router.domains:
            domain, requested, hint = router.domains[name], router.route_models[name], name
        else:
            notes.append(f"unknown_hint: {chosen!r} names no route; the default domain serves it")
    elif chosen in router.catalog:
        domain = router.catalog[chosen]
    elif gateway and chosen in router.domains:
        domain, requested, hint = router.domains[chosen], router.route_models[chosen], chosen
    elif (chosen is not None and chosen.startswith(domain.root + "/")
          and len(chosen) > len(domain.root) + 1):
        # "profile/model" naming the default domain's own profile (the form x-relayline-served
        # shows): that model on it; an unpinned entry is sent the model, not the pair, and the
        # requested label names the profile once
        requested = chosen[len(domain.root) + 1:]
    entries: list[PlannedEntry] = []
    for entry in domain.entries:
        entry_model = entry.model if entry.pinned else requested
        if entry_model is None:
            notes.append(f"no_model: {entry.profile} is unpinned and the request names no model; "
                         "skipped")
            continue
        own = entry.profile == domain.root and domain.root_keys
        keys = domain.root_keys if own else router.keys[entry.profile]
        provider = config.providers[entry.profile]
        # a catalog chain prices by the catalog name first: `prices` is keyed by the names clients
        # ask for
        price = provider.price_of(requested if domain.catalog else None, entry_model)
        entries.append(PlannedEntry(len(entries), entry.profile, entry_model, entry.pinned,
                                    provider, keys, price))
    return Plan(
        domain=domain.root,
        requested_model=requested,
        entries=tuple(entries),
        allowlist=effort.allowlist(config, decision),
        effort=decision,
        warnings=tuple(str(w) for w in router.warnings) + tuple(notes),
        hint=hint,
        catalog=domain.catalog,
    )
