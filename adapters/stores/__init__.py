"""Where a gateway keeps what outlives a turn: the ledger (SQLite)."""
