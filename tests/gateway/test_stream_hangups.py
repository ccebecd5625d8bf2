"""Many streams whose clients hang up at random points leave nothing behind.
(A quarter of the requests are not streamed: their turn is cancelled by the hang-up alone.)

A gateway stream has no task of its own: the turn's task writes it, the gateway's one gate
timer commits a held one, the server calls back on a hang-up. Here streams go through the real
server and upstream client against a loopback provider that is sometimes slow to answer (longer
than gate_commit_s: the gate timer commits it) and then streams frames with pauses; each client
hangs up at a random moment (before the head, while the gate holds, mid-stream, by a close or a
reset) or reads to the end. Afterwards: no turn in flight, no stream on the gate timer, no
upstream connection out of its pool or left open uncounted, no file descriptor and no task more
than before (counted as what this test opened), and every client that read to the end got a clean
stream's end.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
from collections import Counter

import trio

from helpers import serve_in_process
from relayline.adapters import Relay
from relayline.adapters.gateway import Gateway
from relayline.adapters.sim.loopback import LoopbackServer, Reply
from relayline.machines.config import structure_config

STREAMS = int(os.environ.get("RELAYLINE_HANGUP_STREAMS", "160"))  # the review ran 1,000
GATE_S = 0.1
FRAMES = 8
PAUSE_S = 0.03


def chunk(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def reply(seen) -> Reply:
    delay = float(seen.body["messages"][0]["content"])
    if not seen.body.get("stream"):
        return Reply(headers=(("content-type", "application/json"),), delay=delay + FRAMES * PAUSE_S, pieces=(
            json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "whole"},
                                     "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
                       ).encode(),))
    pieces: list[bytes | float] = [chunk({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    for i in range(FRAMES):
        pieces += [PAUSE_S, chunk({"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]})]
    pieces += [chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), b"data: [DONE]\n\n"]
    return Reply(delay=delay, pieces=tuple(pieces))


def open_fds() -> dict[str, str]:
    """What each of the process's file descriptors is, by number."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (listdir's own)
            pass
    return fds


def opened_since(before: dict[str, str], ports: tuple[int, int]) -> tuple[list[tuple[int, int]], list[str]]:
    """The descriptors opened since `before` and still open: the TCP sockets that touch `ports`
    (the gateway's and the provider's) as (local port, remote port), and every other one. Only
    what was opened is counted: an fd that another test left behind may close at any moment
    (a socket in a cycle the collector frees, a thread still ending), and counting all of them
    once read one fewer than this test left."""
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                inodes[f"socket:[{fields[9]}]"] = (int(fields[1].rsplit(":", 1)[1], 16),
                                                   int(fields[2].rsplit(":", 1)[1], 16))
    ours, others = [], []
    for fd, target in open_fds().items():
        if before.get(fd) == target:
            continue
        if target in inodes and set(inodes[target]) & set(ports):
            ours.append(inodes[target])
        else:
            others.append(target)
    return ours, others


def tasks() -> list[str]:
    """The names of every task of the trio run (its system tasks included)."""
    names, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        names.append(task.name)
        todo += [child for nursery in task.child_nurseries for child in nursery.child_tasks]
    return sorted(names)


async def client(url: str, rng: random.Random, ends: list[str]) -> None:
    host, port = url.removeprefix("http://").split(":")
    path, closing = rng.choice([("/v1/chat/completions", b"data: [DONE]"), ("/v1/messages", b"message_stop")])
    streamed = rng.random() < 0.75
    if not streamed:
        closing = b'"whole"'
    body = json.dumps({"model": "m-primary", "stream": streamed, "max_tokens": 64,
                       "messages": [{"role": "user", "content": str(rng.choice([0, 0, 0.05, 0.2]))}]}).encode()
    head = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    reads_to_the_end = rng.random() < 0.25
    hang_up_after = rng.uniform(0, 0.45)
    sock = trio.socket.socket()
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    try:
        await stream.send_all(head + body)
        received = bytearray()
        with trio.move_on_after(5 if reads_to_the_end else hang_up_after):
            while not received.endswith(b"0\r\n\r\n") and not (not streamed and closing in received):
                data = await stream.receive_some(65536)
                if not data:
                    break
                received += data
        if reads_to_the_end:
            ends.append("clean" if closing in received and (received.endswith(b"0\r\n\r\n") or not streamed)
                        else "cut")
        elif rng.random() < 0.5:  # a reset rather than a close
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        await stream.aclose()


async def test_streams_hung_up_at_random_points_leave_nothing_behind():
    upstream = LoopbackServer(reply)
    config = {"active": "primary",
              "providers": {"primary": {"family": "openai", "base_url": "", "model": "m-primary", "api_key": "k-hangup"}},
              "reliability": {"provider_retries": 0},
              "timeouts": {"headers_s": 5, "idle_s": 2, "total_s": 10, "gate_commit_s": GATE_S}}
    rng = random.Random(17)
    ends: list[str] = []
    async with trio.open_nursery() as nursery:
        await upstream.start(nursery)
        config["providers"]["primary"]["base_url"] = f"{upstream.url}/v1"
        relay = Relay(structure_config(config), env={})
        gateway = Gateway(relay)
        url = await serve_in_process(nursery, gateway)
        gateway_port = int(url.rsplit(":", 1)[1])
        await trio.sleep(0.05)
        fds_before, tasks_before = open_fds(), tasks()
        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                for _ in range(STREAMS):
                    clients.start_soon(client, url, rng, ends)
                    await trio.sleep(0.002)
            while gateway.in_flight or upstream.closed + idle_upstreams(relay) < upstream.accepted:
                await trio.sleep(0.02)
            await trio.sleep(0.1)  # the server's connection tasks close their sockets
        pools = relay.http_pools().profile("primary")
        idle = idle_upstreams(relay)
        more_tasks = Counter(tasks()) - Counter(tasks_before)
        ours, others = opened_since(fds_before, (gateway_port, upstream.port))
        # each idle pooled connection is two sockets, its client's end and the provider's
        client_ends = sorted(local for local, remote in ours if remote == upstream.port)
        provider_ends = sorted(remote for local, remote in ours if local == upstream.port)
        left = (len(ours), client_ends == provider_ends, others, more_tasks, len(gateway.turns.cancellers),
                gateway.chat.gates.held, pools.opened - idle)
        await relay.aclose()
        nursery.cancel_scope.cancel()

    assert ends and set(ends) == {"clean"}, ends
    # what is left is the pool's idle connections, both of their ends in this process (the
    # provider's task for each, and the pool's expiry task with them)
    expected = Counter({"trio._highlevel_serve_listeners._run_handler": idle, "relayline upstream pool expiry": 1})
    assert left == (2 * idle, True, [], +expected, 0, 0, 0), (left, idle)
    assert len(upstream.seen) <= STREAMS  # never a retry after a hang-up


def idle_upstreams(relay: Relay) -> int:
    pools = relay.http_pools().profile("primary")
    return sum(len(stack) for stack in pools.idle.values())
