"""What operating the gateway costs per request: the access line (JSON, at info) and the
metrics, measured as two `relayline serve` processes in front of one loopback upstream, same
run, rounds interleaved: one at `--log-level warning` (no access line) and one at
`--log-level info --log-format json` (an access line per request, to a file). Both update the
Prometheus metrics on every request; the second also scrapes /metrics between rounds.

Run alone (`python bench/ops.py`) or as part of `make bench`. Loopback only; bounded loops.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import stop, timed_posts  # noqa: E402


def _gateway(config: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--config", str(config),
                                 "--port", "0", *args], stderr=out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())
        if found:
            return proc, found.group(1)
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the gateway did not start")


def run(rounds: int = 5, n: int = 200) -> dict:
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            up = subprocess.Popen([sys.executable, str(HERE / "upstream.py"), "0", "5"], stdout=subprocess.PIPE,
                                  text=True)
            procs.append(up)
            upstream = f"http://127.0.0.1:{up.stdout.readline().split()[1]}"
            urls = {}
            for name, args in (("quiet", ("--log-level", "warning")),
                               ("logged", ("--log-level", "info", "--log-format", "json"))):
                config = Path(tmp) / f"{name}.toml"
                config.write_text(f'active = "bench.upstream"\n[ledger]\npath = "{tmp}/{name}.sqlite3"\n'
                                  f'[providers."bench.upstream"]\nfamily = "openai"\nbase_url = "{upstream}/v1"\n'
                                  'api_key = "bench-key"\n')
                proc, url = _gateway(config, Path(tmp) / f"{name}.log", *args)
                procs.append(proc)
                urls[name] = url
            latency: dict[str, list[float]] = {"direct": [], "quiet": [], "logged": []}

            async def main() -> None:
                async with httpx.AsyncClient(timeout=60) as client:
                    targets = {"direct": f"{upstream}/v1/chat/completions",
                               **{k: f"{v}/v1/chat/completions" for k, v in urls.items()}}
                    for url in targets.values():
                        await timed_posts(client, url, 50)  # warm up
                    for _ in range(rounds):
                        for name, url in targets.items():
                            latency[name] += await timed_posts(client, url, n)
                        assert (await client.get(f"{urls['logged']}/metrics")).status_code == 200

            trio.run(main)
            lines = (Path(tmp) / "logged.log").read_text().splitlines()
            access = [json.loads(line) for line in lines if '"relayline.access"' in line]
        finally:
            stop(procs)
    p50 = {k: statistics.median(v) * 1000 for k, v in latency.items()}
    return {"p50_ms": p50, "requests": {k: len(v) for k, v in latency.items()}, "access_lines": len(access),
            "logged_over_quiet": p50["logged"] / p50["quiet"], "quiet_over_direct": p50["quiet"] / p50["direct"]}


def report(result: dict) -> None:
    p50 = result["p50_ms"]
    print(f"gateway p50, access line off: {p50['quiet']:.2f} ms; on (JSON): {p50['logged']:.2f} ms "
          f"({result['logged_over_quiet']:.2f}x); direct {p50['direct']:.2f} ms "
          f"({result['access_lines']} access lines written)")


if __name__ == "__main__":
    report(run())
