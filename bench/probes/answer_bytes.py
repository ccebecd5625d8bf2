"""What bounds the throughput rows' httpx clients: the gateway beside an instant server that
replays the gateway's own answer, byte for byte.

bench/run.py's throughput share compares the gateway with the direct call, each driven by the same
closed-loop httpx clients. Those clients are not free (about 0.5-1.5 ms of CPU a request), and
the gateway's answer is not the upstream's: it carries the attribution headers (requested,
served, attempts, fallback, cost), a request id and a Date, and a longer body. This bench puts a
raw asyncio server that answers every request with the gateway's exact bytes at once (no
routing, no upstream call: a gateway that cost nothing) beside the gateway and the direct call,
and one that answers with the upstream's bytes, all driven by the same client in one run:
whatever the gateway does not reach of the replay is the gateway's; what the replay does not
reach of the direct call is the client's cost of reading the gateway's answer.

Run: python bench/probes/answer_bytes.py [--rounds 3] [--requests 1600] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import trio

BENCH = Path(__file__).resolve().parent.parent  # bench/: common.py, upstream.py, the standing benches
sys.path.insert(0, str(BENCH))

from common import MESSAGES, row_throughput  # noqa: E402
from peers import Processes  # noqa: E402


def _replay(port: multiprocessing.Queue, answer: bytes) -> None:
    """An HTTP/1.1 keep-alive server answering every request (read by Content-Length) with `answer`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.put(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


def _answer(base: str) -> bytes:
    """One non-streamed answer from `base`, as its bytes came (head and body)."""
    body = json.dumps({"model": "frames-1", "messages": MESSAGES}).encode()
    host, port = base.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            data += sock.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if length and len(rest) >= length[0]:
                return data
    raise RuntimeError(f"no whole answer from {base}")


def run(rounds: int, requests: int) -> dict:
    with Processes() as procs:
        answers = {"replay of the gateway's answer": _answer(procs.gateway),
                   "replay of the upstream's answer": _answer(procs.upstream)}
        urls = {"direct": procs.upstream, "gateway": procs.gateway}
        replays = []
        try:
            for name, answer in answers.items():
                port: multiprocessing.Queue = multiprocessing.Queue()
                replay = multiprocessing.Process(target=_replay, args=(port, answer), daemon=True)
                replay.start()
                replays.append(replay)
                urls[name] = f"http://127.0.0.1:{port.get(timeout=30)}"
            rows: dict = {name: {1: [], 16: []} for name in urls}
            cpu: dict = {name: {1: [], 16: []} for name in urls}

            async def main() -> None:
                for _ in range(rounds):
                    for name, url in urls.items():
                        for concurrency in (1, 16):
                            rows[name][concurrency].append(await row_throughput(
                                f"{url}/v1/chat/completions", concurrency, requests, cpu[name][concurrency]))

            trio.run(main)
        finally:
            for replay in replays:
                replay.terminate()
                replay.join(10)
    return {"load_average": os.getloadavg(), "rounds": rounds, "requests": requests,
            "answer_bytes": {name: len(answer) for name, answer in answers.items()},
            "rps": {name: {c: statistics.median(v) for c, v in by.items()} for name, by in rows.items()},
            "client_cpu_ms_per_request": {name: {c: statistics.median(v) for c, v in by.items()}
                                          for name, by in cpu.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1600, help="per row per round")
    parser.add_argument("--out", help="write the figures here (JSON)")
    args = parser.parse_args()
    out = run(args.rounds, args.requests)
    print(f"load average {out['load_average'][0]:.1f}; answer bytes {out['answer_bytes']}")
    print(f"{'':34} {'req/s c1':>9} {'c16':>7} {'client CPU ms c1':>17} {'c16':>6}")
    for name, rps in out["rps"].items():
        client = out["client_cpu_ms_per_request"][name]
        print(f"{name:34} {rps[1]:9.0f} {rps[16]:7.0f} {client[1]:17.2f} {client[16]:6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
