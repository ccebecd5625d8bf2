"""[health] and [ledger] url: the keys of a fleet, checked with their key paths."""

import pytest

from helpers import config
from relayline.machines.errors import ConfigError

ONE = {"active": "a", "providers": {"a": {}}}


def test_defaults_are_a_memory_store_and_the_sqlite_ledger():
    cfg = config(**ONE)
    assert (cfg.health.store, cfg.health.key_prefix) == ("memory", "relayline:")
    assert cfg.ledger.url is None


@pytest.mark.parametrize(("table", "problem"), [
    ({"health": {"store": "memcached://x"}}, "health.store: must be \"memory\" or a redis://host:port/db URL"),
    ({"health": {"key_prefix": ""}}, "health.key_prefix: must not be empty"),
    ({"health": {"ttl": 3}}, "health.ttl: unknown key"),
    ({"ledger": {"url": "mysql://u:secretpw@h/db"}}, "ledger.url: must be a postgresql://user@host/db URL"),
])
def test_bad_fleet_keys_name_their_key_path_and_never_echo_the_url(table, problem):
    with pytest.raises(ConfigError) as info:
        config(**ONE, **table)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems
    assert "secretpw" not in str(info.value)


def test_redis_and_postgres_urls_are_accepted():
    cfg = config(**ONE, health={"store": "redis://127.0.0.1:6379/2", "key_prefix": "fleet:"},
                 ledger={"url": "postgresql://relayline@127.0.0.1/relayline"})
    assert cfg.health.store.startswith("redis://") and cfg.ledger.url.startswith("postgresql://")
