"""The gateway process's CPU per non-streamed request, two trees side by side in one run (never
part of `make test`): a lever with no switch to turn it off (bench/gateway_cpu.py's LEVERS) is
measured against a checkout of the code before it.

Each tree serves from its own `relayline serve` process on the sim family (an in-process
upstream: what is measured is the gateway's own path and its HTTP framing, no upstream call),
its ledger on. Rounds alternate the two processes, in turn order, so that machine noise hits
both alike: per round, requests one after another on one keep-alive connection (CPU per request
from /proc, p50 and p99), then closed loops at each `--levels` concurrency (CPU per request under
load: how it grows with the turns in flight). The client is raw asyncio (bench/load.py's). The
figures are the medians over rounds of each tree's value and of their ratio in the same round.

    python bench/gateway_trees.py --base DIR [--after DIR] [--rounds 10] [--levels 16,200,1000]
                                  [--log-level warning|info]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    closed_loop,
    cpu_s,
    listening,
    listening_logged,
    percentile,
    sequential,  # noqa: E402
    stop,
)

SERVE = "import sys; from relayline.adapters.cli import main; sys.exit(main(sys.argv[1:]))"


def _start(tree: str | None, tmp: str, name: str, log_level: str = "warning") -> tuple[subprocess.Popen, str]:
    config = Path(tmp) / f"{name}.toml"
    config.write_text(f'active = "sim"\n[ledger]\npath = "{tmp}/{name}.sqlite3"\n'
                      '[providers.sim]\nfamily = "sim"\nmodel = "frames-1"\n')
    env = dict(os.environ)
    if tree is not None:
        link = Path(tmp) / f"{name}-tree"
        link.mkdir()
        (link / "relayline").symlink_to(Path(tree).resolve())
        env["PYTHONPATH"] = str(link)  # that tree's package shadows this tree's editable install
    command = [sys.executable, "-c", SERVE, "serve", "--config", str(config), "--port", "0", "--log-level",
               log_level]
    if log_level in ("info", "debug"):  # a line a request: to a file, as a user's, not a pipe that fills
        log = Path(tmp) / f"{name}.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(command, stderr=sink, env=env)
        return proc, listening_logged(proc, log, f"the gateway ({name})") + "/v1/chat/completions"
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    return proc, listening(proc, f"the gateway ({name})") + "/v1/chat/completions"


def run(base: str, after: str | None, rounds: int, n: int, levels: tuple[int, ...], seconds: float,
        log_level: str = "warning") -> dict:
    trees = {"before": base, "after": after}
    figures: dict[str, dict[str, list[float]]] = {side: {} for side in trees}
    latencies: dict[str, list[float]] = {side: [] for side in trees}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        procs, urls = {}, {}
        try:
            for side, tree in trees.items():
                procs[side], urls[side] = _start(tree, tmp, side, log_level)

            async def main() -> None:
                for side in trees:
                    await sequential(urls[side], 300)  # warm: imports, caches, the ledger's pages
                for round_ in range(rounds):
                    loads.append(os.getloadavg()[0])
                    for side in (list(trees) if round_ % 2 == 0 else list(trees)[::-1]):
                        pid = procs[side].pid
                        before = cpu_s(pid)
                        latencies[side] += await sequential(urls[side], n)
                        figures[side].setdefault("cpu_ms_c1", []).append((cpu_s(pid) - before) / n * 1e3)
                        for level in levels:
                            before = cpu_s(pid)
                            row = await closed_loop(urls[side], level, seconds)
                            used = (cpu_s(pid) - before) / max(1, row["requests"]) * 1e3
                            figures[side].setdefault(f"cpu_ms_c{level}", []).append(used)
                            figures[side].setdefault(f"errors_c{level}", []).append(row["errors"])

            asyncio.run(main())
        finally:
            stop(procs.values())
    out: dict = {"load_average": [min(loads), max(loads)], "rounds": rounds, "figures": {}}
    for key in figures["after"]:
        if key.startswith("errors"):
            out["figures"][key] = {side: sum(figures[side][key]) for side in trees}
            continue
        out["figures"][key] = {side: statistics.median(figures[side][key]) for side in trees}
        out["figures"][key]["ratio"] = statistics.median(
            a / b for a, b in zip(figures["after"][key], figures["before"][key], strict=True))
    for side in trees:
        out["figures"].setdefault("p50_ms_c1", {})[side] = statistics.median(latencies[side]) * 1e3
        out["figures"].setdefault("p99_ms_c1", {})[side] = percentile(latencies[side], 0.99) * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one; the base again: a control)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--n", type=int, default=300, help="requests one after another per round")
    parser.add_argument("--levels", default="16,200,1000", help="closed-loop concurrency levels ('' for none)")
    parser.add_argument("--seconds", type=float, default=1.5, help="each closed loop's measured window")
    parser.add_argument("--log-level", default="warning",
                        help="the gateways' (info: the default configuration's access line, to a file)")
    args = parser.parse_args()
    levels = tuple(int(c) for c in args.levels.split(",") if c)
    result = run(args.base, args.after, args.rounds, args.n, levels, args.seconds, args.log_level)
    low, high = result["load_average"]
    print(f"the gateway process, sim upstream, ledger on, --log-level {args.log_level}: medians of "
          f"{args.rounds} alternated rounds (load average {low:.1f}-{high:.1f})")
    print(f"  {'figure':<16} {'before':>10} {'after':>10} {'after/before':>13}")
    for key, row in result["figures"].items():
        ratio = f"{row['ratio']:>13.3f}" if "ratio" in row else ""
        print(f"  {key:<16} {row['before']:>10.3f} {row['after']:>10.3f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
