"""The provider families. Each factory is named by machines/families.py and called with the
relay's per-profile connection pools (providers/pool.py), which every adapter shares. The HTTP
families' factories are here; the scripted `sim` family's is in sim.py, which nothing but the
sim tooling imports by name."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ProviderClient

if TYPE_CHECKING:
    from .pool import Pools


def openai_client(pools: Pools) -> ProviderClient:
    from .openai import OpenAIClient

    return OpenAIClient(pools)


def anthropic_client(pools: Pools) -> ProviderClient:
    from .anthropic import AnthropicClient

    return AnthropicClient(pools)
