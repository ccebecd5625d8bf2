"""py-spy's collapsed stacks of the gateway (`bench/load.py --profile FILE`), added up by the
relayline module that spent them: `python bench/stacks.py FILE [FILE.gz]` (never part of
`make test`).

A flame graph shows where each stack went; the question docs/performance.md asks of a profile is how the
gateway's own Python is spread over its modules, and whether any one of them is a large share.
Each sample goes to the deepest frame in relayline's own code (adapters/, machines/): a trio or
library frame under it is that module's use of trio or the library. Two leaves are counted
apart, because py-spy counts a runnable thread as busy: the socket write (`send_all`'s
`os.write`: on loopback the kernel delivers to the peer inside the call and the woken peer often
takes the core) and trio's epoll wait. Samples with no relayline frame under `relayline serve`'s
entry point are trio's run loop.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

_OWN = re.compile(r"\(((?:adapters|machines)/(?!cli\.py)[^:)]+)")  # cli.py: only trio.run's caller
_APART = {"send_all (adapters/sockets.py": "the socket write (sockets.send_all's own frame: its os.write)",
          "EpollIOManager.get_events (": "trio's epoll wait",
          "EpollIOManager._epoll_wait (": "trio's epoll wait"}


def split(lines: list[str]) -> tuple[int, collections.Counter]:
    """(all samples, samples by module or by the apart leaves)."""
    by: collections.Counter = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        frames, samples = stack.split(";"), int(count)
        total += samples
        if not stack:
            by["no Python stack read"] += samples
            continue
        apart = next((name for prefix, name in _APART.items() if frames[-1].startswith(prefix)), None)
        if apart is not None:
            by[apart] += samples
            continue
        own = next((m.group(1) for frame in reversed(frames) if (m := _OWN.search(frame))), None)
        by[own or "trio's run loop (no relayline frame)"] += samples
    return total, by


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="collapsed stacks from py-spy (--format raw), or the same gzipped")
    args = parser.parse_args()
    opener = gzip.open if args.path.endswith(".gz") else open
    with opener(Path(args.path), "rt") as file:
        total, by = split(file.readlines())
    print(f"{total} samples")
    for name, samples in by.most_common():
        print(f"  {100 * samples / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
