"""The ledger's rows, the one shape both stores keep: SQLite (stores/ledger.py) and PostgreSQL
(stores/postgres.py) write these columns in this order, and `relayline ledger` groups and reports
on them whichever store holds them. Each store keeps its own table definition and migrations
(the SQL dialects differ); a column added here is added to both.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from relayline.machines.turn import TurnResult

# what `relayline ledger --by` groups on (both stores)
GROUPS = {"model": ("provider", "model"), "client": ("client",), "key": ("key_name",),
          "team": ("team",)}
# what a budget's spend is read from (`spend`): the column a scope's name is in
SPEND_COLUMNS = {"key": "key_name", "team": "team"}

COLUMNS = ("ts", "turn", "requested", "provider", "model", "mode", "outcome", "accepted",
           "input_tokens", "output_tokens", "cost_usd", "client", "estimated", "key_name", "team")


def ledger_rows(turn_id: str, result: TurnResult, now: float | None = None, *, client: str = "",
                key: str = "", team: str = "") -> list[tuple[Any, ...]]:
    """A turn's ledger rows as tuples in COLUMNS order (both stores write these). `client` is
    the gateway client's key id; `key` and `team` a named key's name and team."""
    ts = time.time() if now is None else now
    return [(ts, turn_id, result.requested, r.provider, r.model, r.mode, r.outcome, int(r.accepted),
             r.input_tokens, r.output_tokens, r.cost_usd, client, int(r.estimated), key, team)
            for r in result.ledger]


class LedgerBackend(Protocol):
    """What each store of the ledger offers (`open_ledger` picks one): a turn's rows written,
    whether a write could be made now, the rows and a report read back, a budget's spend."""

    async def record(self, turn_id: str, result: TurnResult, *, client: str = "", key: str = "",
                     team: str = "") -> int: ...

    def writable(self) -> bool: ...

    def rows(self, since: float = 0.0) -> list[dict[str, Any]]: ...

    def report(self, since: float = 0.0, by: str = "model") -> list[dict[str, Any]]: ...

    def spend(self, scope: str, name: str, since: float) -> float: ...

    def close(self) -> None: ...


class LedgerUnavailable(Exception):
    """The ledger did not take a turn's rows within `waited_s` (its server is down or hangs);
    never says where (a URL may hold a password)."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"the ledger did not commit within {waited_s:g} s")
        self.waited_s = waited_s
