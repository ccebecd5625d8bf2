"""Small builders shared by tests."""

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
