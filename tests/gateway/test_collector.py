"""The gateway process's collector (serving.py's tune_collector): `relayline serve` freezes what it
built at startup and makes the collector's passes rarer before it serves; the library leaves its
host's collector alone."""

import subprocess
import sys

from relayline.adapters.gateway.serving import (
    GC_THRESHOLDS,
    GC_YOUNG_MOST,
    GC_YOUNG_PER_CONNECTION,
    follow_connections,
)

# the gateway as `relayline serve` starts it, stopped where it would start serving
SERVE = """
import gc, sys, trio
from relayline.adapters.cli import main
def run(*args, **kwargs):
    print(gc.get_threshold(), gc.get_freeze_count(), flush=True)
trio.run = run
sys.exit(main(["serve", "--port", "0"]))
"""

LIBRARY = """
import gc, trio
from relayline.adapters.sim.demo import builtin_relay
async def main():
    async with builtin_relay() as relay:
        await relay.complete([{"role": "user", "content": "hi"}])
trio.run(main)
print(gc.get_threshold(), gc.get_freeze_count())
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_serve_freezes_its_startup_objects_and_sets_the_thresholds_before_serving():
    thresholds, frozen = _run(SERVE).rsplit(" ", 1)
    assert thresholds == str(GC_THRESHOLDS)
    assert int(frozen) > 10_000  # the modules, the config and the routing tables


def test_the_library_leaves_its_hosts_collector_alone():
    import gc

    assert _run(LIBRARY) == f"{gc.get_threshold()} 0"


FOLLOW = """
import gc
from relayline.adapters.gateway.serving import tune_collector, follow_connections
tune_collector()
seen = []
for count in (10, 1_000, 5_000, 3):
    follow_connections(count)
    seen.append(gc.get_threshold())
print(seen)
"""


def test_in_a_gateway_process_the_young_threshold_grows_with_the_open_connections_to_a_bound_and_comes_back():
    young, *older = GC_THRESHOLDS
    per = GC_YOUNG_PER_CONNECTION
    assert young < per * 1_000 <= GC_YOUNG_MOST < per * 5_000  # 1,000 clients raise it; 5,000 meet the bound
    assert _run(FOLLOW) == str([GC_THRESHOLDS, (per * 1_000, *older), (GC_YOUNG_MOST, *older), GC_THRESHOLDS])


def test_the_library_process_collector_does_not_follow_connections():
    import gc

    before = gc.get_threshold()
    follow_connections(5_000)  # tune_collector never ran here
    assert gc.get_threshold() == before
