"""A request body trickled in small pieces against the same body sent at once: the gateway
process's CPU for each (`python bench/probes/body_trickle.py`; never part of `make test`).

A client that sends a 4 MB body in 150-byte writes, each its own TCP segment, makes the server
read it piece by piece; what such a body costs the server is its CPU (from /proc) for the whole
request, beside the same request with the body in one write, in the same process and run.

Run: python bench/probes/body_trickle.py [--size BYTES] [--piece BYTES]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent  # bench/: common.py, upstream.py, the standing benches
sys.path.insert(0, str(BENCH))

from common import (  # noqa: E402
    cpu_s,  # noqa: E402
    listening,
    stop,
)


def post(pid: int, port: int, body: bytes, piece: int | None) -> tuple[float, float]:
    """(server CPU s, wall s) for one chat request, its body at once or in `piece`-byte writes."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before, began = cpu_s(pid), time.monotonic()
        sock.sendall(head)
        if piece is None:
            sock.sendall(body)
        else:
            for start in range(0, len(body), piece):
                sock.sendall(body[start:start + piece])
                time.sleep(0.0001)  # each piece its own segment, as a slow client's
        answer = sock.recv(65536)
        wall = time.monotonic() - began
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    time.sleep(0.2)
    return cpu_s(pid) - before, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=4 * 1024 * 1024 - 256)
    parser.add_argument("--piece", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    body = json.dumps({"model": "claude-sonnet-4", "messages": [{"role": "user", "content": "a" * (args.size - 80)}]}).encode()
    proc = subprocess.Popen([sys.executable, "-m", "relayline.adapters.cli", "serve", "--port", "0"],
                            cwd=tempfile.mkdtemp(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = int(listening(proc).rsplit(":", 1)[1])
        for round_ in range(args.rounds):
            at_once = post(proc.pid, port, body, None)
            trickled = post(proc.pid, port, body, args.piece)
            print(f"round {round_ + 1}: {len(body)} bytes at once {at_once[0]:.2f} s CPU ({at_once[1]:.2f} s wall); "
                  f"in {args.piece}-byte pieces {trickled[0]:.2f} s CPU ({trickled[1]:.2f} s wall): "
                  f"{trickled[0] / max(at_once[0], 0.01):.1f}x")
    finally:
        stop([proc])


if __name__ == "__main__":
    main()
