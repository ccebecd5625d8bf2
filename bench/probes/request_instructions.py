"""Instructions a small request costs the whole gateway process, two trees side by side (never
part of `make test`).

CPU time a request moves with the machine's load by more than a small lever's change (the same
work runs several times slower in a busy span: bench/probes/tail_sources.py --perf); an
instruction count does not. Each tree's `relayline serve` (the default configuration: info
logging to a file, the SQLite ledger, the loopback upstream of bench/upstream.py) runs under
valgrind's callgrind, so everything it runs is counted: the HTTP read and write, the plan and the
turn, the upstream exchange, the ledger's commit, the access line, the collector. After
`--warm` requests its counts are zeroed (callgrind_control -z), `--requests` one-message
requests are sent one after another by a raw client, and the counts are dumped
(callgrind_control -d): their sum over the requests is the figure (the event loop's idle turns
between requests included, as they are the gateway's). `--repeats` runs of each tree, alternated;
the medians and their ratio. Needs valgrind (`apt-get install -y valgrind`).

    python bench/probes/request_instructions.py --base DIR [--after DIR] [--requests 300]
                                                [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from common import back_to_back, listening_logged, raw_post, stop, tree_env  # noqa: E402

BODY = {"model": "frames-1", "messages": [{"role": "user", "content": "hi"}]}


def instructions(tree: str | None, upstream: str, warm: int, n: int) -> float:
    """Instructions a request of `tree`'s gateway (None: this tree's) under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gateway.toml"
        config.write_text(f'active = "bench.openai"\n[ledger]\npath = "{tmp}/ledger.sqlite3"\n'
                          f'[providers."bench.openai"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                          'api_key = "bench-key"\n')
        log, counts = Path(tmp) / "gateway.log", Path(tmp) / "callgrind.out"
        with log.open("w") as sink:
            gateway = subprocess.Popen(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={counts}", sys.executable, "-m",
                 "relayline.adapters.cli", "serve", "--config", str(config), "--port", "0"],
                stderr=sink, env=tree_env(tree))
        try:
            url = listening_logged(gateway, log, "the gateway under callgrind", timeout_s=600)
            url += "/v1/chat/completions"
            asyncio.run(back_to_back(url, raw_post(url, BODY), warm))
            subprocess.run(["callgrind_control", "-z", str(gateway.pid)], check=True, capture_output=True)
            asyncio.run(back_to_back(url, raw_post(url, BODY), n))
            subprocess.run(["callgrind_control", "-d", str(gateway.pid)], check=True, capture_output=True)
            dump = Path(f"{counts}.1")
            for _ in range(100):  # (written by the process itself, a moment after the request)
                if dump.exists() and re.search(r"^totals:", dump.read_text(errors="replace"), re.M):
                    break
                time.sleep(0.1)
            found = re.search(r"^(?:summary|totals):\s*(\d+)", dump.read_text(errors="replace"), re.M)
            if found is None:
                raise SystemExit(f"no count in {dump}")
            return int(found.group(1)) / n
        finally:
            stop([gateway])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one; the base again: a control)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warm", type=int, default=100, help="requests before the counts are zeroed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0"], stdout=subprocess.PIPE, text=True)
    counts: dict[str, list[float]] = {"before": [], "after": []}
    try:
        upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
        for repeat in range(args.repeats):
            for side in (("before", "after") if repeat % 2 == 0 else ("after", "before")):
                tree = args.base if side == "before" else args.after
                counts[side].append(instructions(tree, upstream, args.warm, args.requests))
    finally:
        stop([up])
    before, after = statistics.median(counts["before"]), statistics.median(counts["after"])
    result = {"requests": args.requests, "repeats": args.repeats, "instructions_a_request": counts,
              "median": {"before": before, "after": after}, "after_over_before": after / before}
    print(f"instructions a request, the whole gateway process (median of {args.repeats}): "
          f"before {before:,.0f}, after {after:,.0f}, after/before {after / before:.3f}")
    for side, values in counts.items():
        print(f"  {side}: {', '.join(f'{v:,.0f}' for v in values)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
