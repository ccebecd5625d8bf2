"""The HTTP provider families. Each factory is named by machines/families.py and called with the
Relay, whose per-profile connection pools (providers/pool.py) every adapter shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import ProviderClient

if TYPE_CHECKING:
    from ..relay import Relay


def openai_client(relay: Relay) -> ProviderClient:
    from .openai import OpenAIClient

    return OpenAIClient(relay.http_pools())


def anthropic_client(relay: Relay) -> ProviderClient:
    from .anthropic import AnthropicClient

    return AnthropicClient(relay.http_pools())
