"""The provider families relayline speaks: one registry, read by config validation, the plan,
the library (which adapter serves a profile) and the sim servers (which wire shapes exist).

A family is data here and code in adapters/: `adapter` names the factory (`module:function`,
called with the relay's upstream connection pools) that builds its protocol client, so neither
the library nor the gateway imports a family's module by name, the scripted `sim` family
included.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Family:
    name: str
    adapter: str  # "module:function": function(pools) -> ProviderClient
    wire: str | None = None  # the HTTP protocol shape it speaks; None: served in process
    # without a base_url it calls the vendor's API, which needs a credential
    public_api: bool = False


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("openai", "relayline.adapters.providers:openai_client", wire="openai",
               public_api=True),
        Family("anthropic", "relayline.adapters.providers:anthropic_client", wire="anthropic",
               public_api=True),
        Family("sim", "relayline.adapters.providers.sim:family_client"),
    )
}

# the protocol shapes on the wire (the sim servers speak each of them)
WIRES: tuple[str, ...] = tuple(f.wire for f in FAMILIES.values() if f.wire is not None)
