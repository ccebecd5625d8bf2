"""The processes a bench starts: a gateway is ready once it logs where it listens, and every
process is stopped at the end, killed if it does not go within ten seconds (a bench never leaves
a server behind)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path


def listening(proc: subprocess.Popen, name: str = "the gateway", timeout_s: float = 30.0) -> str:
    """The base URL `relayline serve` logged it listens on (its stderr, a text pipe)."""
    deadline = time.monotonic() + timeout_s
    line = ""
    while time.monotonic() < deadline and "listening on" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
    found = re.search(r"http://[\d.]+:\d+", line)
    if found is None:
        raise RuntimeError(f"{name} did not say where it listens within {timeout_s:.0f} s")
    return found.group(0)


def stop(procs: Iterable[subprocess.Popen]) -> None:
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tree_env(tree: str | None) -> dict:
    """The environment that runs `tree`'s relayline package (None: this tree's): its package is
    linked into a path entry that comes before this tree's editable install. This is how a bench
    measures two checkouts alternated in one run."""
    env = dict(os.environ)
    if tree is not None:
        link = Path(tempfile.mkdtemp(prefix="relayline-tree-"))
        (link / "relayline").symlink_to(Path(tree).resolve())
        env["PYTHONPATH"] = str(link)
    return env


def child_in_tree(script: str, tree: str | None, args: list[str], timeout_s: float = 900) -> dict:
    """`script --child *args` run on `tree`'s package; the JSON of its last line of output."""
    done = subprocess.run([sys.executable, script, "--child", *args], env=tree_env(tree), capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"child failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_run_instructions(args: list[str], env: dict, counts: tuple[int, int], label: str) -> float:
    """Instructions per unit of work of `python *args n`, a script that does `n` units: from
    cachegrind's counts of two runs `counts` units apart, so that their start-up cancels out."""
    refs = []
    for n in counts:
        done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                               sys.executable, *args, str(n)], env=env, capture_output=True, text=True, timeout=1800)
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"{label}: {done.stderr[-2000:]}")
        refs.append(int(found.group(1).replace(",", "")))
    return (refs[1] - refs[0]) / (counts[1] - counts[0])


def tree_arguments(parser: argparse.ArgumentParser, pairs: int = 3) -> None:
    """The options of a bench that measures two trees alternated (`alternate`)."""
    parser.add_argument("--base", help="the package directory of the tree before the lever")
    parser.add_argument("--after", help="the tree after it (default: this one; the base again: a control)")
    parser.add_argument("--pairs", type=int, default=pairs, help="before/after pairs, alternated")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def alternate(script: str, args: argparse.Namespace, child_args: list[str], timeout_s: float = 900) -> dict:
    """{"before": [...], "after": [...]} (only "after" without --base): one child a side a pair,
    the order turned each pair so neither side always runs on the cooler or warmer machine."""
    sides: dict[str, list[dict]] = {"before": [], "after": []} if args.base else {"after": []}
    for pair in range(args.pairs):
        for side in (list(sides) if pair % 2 == 0 else list(sides)[::-1]):
            tree = args.base if side == "before" else args.after
            sides[side].append(child_in_tree(script, tree, child_args, timeout_s))
    return sides


def gateway_server(upstream: str, tmp: str):
    """The gateway's HTTP/1.1 server as `relayline serve` makes it, in this process, in front of
    the upstream at base URL `upstream` (an openai-family profile; the ledger in `tmp`)."""
    from relayline.adapters.configfile import load_config_file
    from relayline.adapters.gateway import Gateway
    from relayline.adapters.gateway.http11 import Server
    from relayline.adapters.gateway.server import _error_body
    from relayline.adapters.relay import Relay

    config = Path(tmp) / "bench.toml"
    config.write_text(f'active = "bench.upstream"\n[ledger]\npath = "{tmp}/ledger.sqlite3"\n'
                      f'[providers."bench.upstream"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                      'api_key = "bench-key"\n')
    gateway = Gateway.from_relay_config(Relay(load_config_file(str(config))))
    settings = gateway.settings
    return Server(gateway, keep_alive_s=settings.keep_alive_s, max_header_bytes=settings.max_header_bytes,
                  graceful_s=1, error_body=_error_body)
