"""What a turn writes down, counted in instructions (valgrind's cachegrind; never part of `make
test`): a one-row ledger commit and the gateway's bookkeeping after an answer, two trees.

bench/gateway_phases.py clocks these steps in a serving process, where a lever worth a µs or
two is within one run's noise on a loaded machine, and the whole gateway's instructions a
request (bench/proxy_floor.py --instructions) move by about 1 % between two runs of one tree (its
scheduling). Here each runs alone in a loop, one thread, no sockets: "commit" is
`LedgerStore._insert` of one row into a file of 20,000 (the checkpointer off: its copies are
not the commit's), "after" is `Gateway._after` for an answered one-attempt turn (relay
observers, health view, metrics, console, tracing off, breaker transitions, request metrics;
`--log-level warning`, as the benches run). Two runs COUNTS apart per tree and workload, their
difference over the calls between (the start-up cancels out), the collector off.

    python bench/records_steps.py [--base DIR [--after DIR]]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import per_run_instructions, tree_env  # noqa: E402

COUNTS = (2000, 6000)
WORKLOADS = ("commit", "after")


def commit(n: int) -> None:
    import os
    import tempfile

    from relayline.adapters.stores import ledger

    row = (1.7e9, "0123456789abcdef0123456789abcdef", "bench.upstream/frames-1", "bench.upstream", "frames-1",
           "complete", "ok", 1, 12, 34, 0.000123, "")
    with tempfile.TemporaryDirectory() as tmp:
        store = ledger.LedgerStore(os.path.join(tmp, "ledger.sqlite3"))
        store._checkpoint_every = 0
        for _ in range(20):
            store._insert([row] * 1000)
        for _ in range(n):
            store._insert([row])
        store.close()


def after(n: int) -> None:
    import logging

    import trio

    from relayline.adapters.gateway import Gateway
    from relayline.adapters.gateway.app import Exchange
    from relayline.adapters.relay import Relay
    from relayline.machines.config import structure_config
    from relayline.machines.ledger import LedgerRow
    from relayline.machines.turn import AttemptRecord, TurnResult

    logging.getLogger().setLevel(logging.WARNING)
    config = structure_config({"active": "openai.main", "providers": {"openai.main": {"family": "sim", "model": "gpt-4o"}}})

    async def main() -> None:
        relay = Relay(config, env={})
        gateway = Gateway(relay)
        served = relay.plan(model="gpt-4o", gateway=True).entries[0]
        attempt = AttemptRecord("openai.main", "gpt-4o", "complete", "ok", None, 1.0, None, ended=1.1)
        row = LedgerRow("openai.main", "gpt-4o", True, 12, 3, 0.001, "ok", "complete")
        result = TurnResult("ok", None, None, "openai.main/gpt-4o", served, "hi", "", (), None, None, False, (attempt,),
                            (), (row,))

        async def send(message: dict) -> None:
            pass

        for _ in range(n):
            exchange = Exchange(send, "POST", "/v1/chat/completions", "0123456789abcdef0123456789abcdef", {})
            exchange.result, exchange.relay, exchange.status, exchange.turn = result, relay, 200, "chatcmpl-bench"
            exchange.turn_started, exchange.turn_ended, exchange.started, exchange.first_byte = 1.0, 1.2, 0.9, 1.25
            gateway._after(exchange)
        await relay.aclose()

    trio.run(main)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one)")
    parser.add_argument("--out", help="write the figures here (JSON)")
    parser.add_argument("--count", nargs=2, metavar=("WORKLOAD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count:
        import gc

        gc.disable()
        workload, n = args.count
        {"commit": commit, "after": after}[workload](int(n))
        return 0
    trees = {"before": args.base, "after": args.after} if args.base else {"this tree": None}
    out: dict = {}
    for workload in WORKLOADS:
        for side, tree in trees.items():
            out.setdefault(workload, {})[side] = per_run_instructions([__file__, "--count", workload], tree_env(tree),
                                                                      COUNTS, f"{workload} {side}")
        print(f"  {workload:<7} " + "  ".join(f"{side} {count:9,.0f}" for side, count in out[workload].items())
              + " instructions a call", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
