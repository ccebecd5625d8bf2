"""The library from each host, beside the trio path, in one run (`make bench`).

    trio      Relay.complete / Relay.stream in the caller's own trio run: the baseline
    asyncio   the same calls from an asyncio loop: turns run in relayline's runtime thread
    sync      complete_sync / stream_sync from a plain thread: the same runtime thread
    guest     the asyncio calls again, with the runtime swapped for a trio guest run on the
              asyncio loop itself (trio.lowlevel.start_guest_run): the alternative design,
              measured through the very same library code

Upstreams are the in-process sim family, so the figures are the hosts' own overhead: per turn
(a non-streaming turn), per frame (a 200-frame stream minus a 1-frame stream, over 199), and a
FastAPI-like load (many concurrent turns on one loop). Each figure is the least disturbed of
several interleaved rounds (the minimum time, the maximum rate): every host crosses threads,
and on a loaded 2-core machine a thread hop waits for the scheduler, which medians carry as
noise. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import trio

from relayline.adapters import Relay
from relayline.adapters.hosts import Runtime
from relayline.adapters.providers.sim import SimUpstream
from relayline.machines.config import structure_config

CONFIG = structure_config({"active": "a", "providers": {"a": {"family": "sim", "model": "m1"}}})
HI = [{"role": "user", "content": "hi"}]
FRAMES = 200


class GuestRuntime(Runtime):
    """The runtime's interface on a trio guest run hosted by the running asyncio loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._ready = threading.Event()
        self._thread = threading.current_thread()
        self.finished: asyncio.Future[object] = loop.create_future()
        trio.lowlevel.start_guest_run(self._serve, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                                      run_sync_soon_not_threadsafe=loop.call_soon,
                                      done_callback=self.finished.set_result, host_uses_signal_set_wakeup_fd=True)

    async def started(self) -> None:
        while not self._ready.is_set():
            await asyncio.sleep(0.001)

    async def aclose(self) -> None:
        assert self._nursery is not None
        self.call_soon(self._nursery.cancel_scope.cancel)
        await self.finished


def relay(frames: int = 1) -> Relay:
    script = [{"frames": [{"role": True}, *({"text": f" w{i}"} for i in range(frames)), {"done": True}]}]
    return Relay(CONFIG, env={}, clients=SimUpstream.from_replies([{"provider": "a", "script": script}]).clients())


async def one_stream(r: Relay) -> int:
    n = 0
    async with r.stream(HI) as turn:
        async for _ in turn:
            n += 1
    return n


def one_stream_sync(r: Relay) -> int:
    n = 0
    with r.stream_sync(HI) as turn:
        for _ in turn:
            n += 1
    return n


def timed_async(host: str, body: Callable[[], Awaitable[None]]) -> float:
    """Seconds `body()` takes under `host` (trio, asyncio, guest)."""
    if host == "trio":
        async def run() -> float:
            start = time.perf_counter()
            await body()
            return time.perf_counter() - start

        return trio.run(run)

    async def run_asyncio() -> float:
        guest = None
        if host == "guest":
            guest = GuestRuntime(asyncio.get_running_loop())
            await guest.started()
            saved, Runtime._current = Runtime._current, guest
        try:
            start = time.perf_counter()
            await body()
            return time.perf_counter() - start
        finally:
            if guest is not None:
                Runtime._current = saved
                await guest.aclose()

    return asyncio.run(run_asyncio())


def per_turn_us(host: str, turns: int) -> float:
    r = relay()
    if host == "sync":
        start = time.perf_counter()
        for _ in range(turns):
            r.complete_sync(HI)
        return (time.perf_counter() - start) / turns * 1e6

    async def body() -> None:
        for _ in range(turns):
            await r.complete(HI)

    return timed_async(host, body) / turns * 1e6


def stream_us(host: str, frames: int, streams: int) -> float:
    """Microseconds per whole stream of `frames` frames."""
    r = relay(frames)
    if host == "sync":
        start = time.perf_counter()
        for _ in range(streams):
            assert one_stream_sync(r) == frames
        return (time.perf_counter() - start) / streams * 1e6

    async def body() -> None:
        for _ in range(streams):
            assert await one_stream(r) == frames

    return timed_async(host, body) / streams * 1e6


def concurrent_turns_per_s(host: str, concurrency: int, turns: int) -> float:
    """A FastAPI-like load: `concurrency` tasks on one loop, `turns` turns in all."""
    r = relay()
    each = turns // concurrency

    async def worker() -> None:
        for _ in range(each):
            await r.complete(HI)

    if host == "trio":
        async def body() -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
    elif host == "sync":
        threads = [threading.Thread(target=lambda: [r.complete_sync(HI) for _ in range(each)])
                   for _ in range(concurrency)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return each * concurrency / (time.perf_counter() - start)
    else:
        async def body() -> None:
            await asyncio.gather(*(worker() for _ in range(concurrency)))

    return each * concurrency / timed_async(host, body)


HOSTS = ("trio", "asyncio", "guest", "sync")


def bench_hosts(quick: bool = False) -> dict:
    rounds, turns, streams = (1, 100, 5) if quick else (5, 300, 15)
    out: dict[str, dict[str, float]] = {h: {} for h in HOSTS}
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):  # rounds interleave the hosts, so machine noise hits them alike
        for h in HOSTS:
            samples.setdefault((h, "turn_us"), []).append(per_turn_us(h, turns))
            full, one = stream_us(h, FRAMES, streams), stream_us(h, 1, streams)
            samples.setdefault((h, "frame_us"), []).append((full - one) / (FRAMES - 1))
            samples.setdefault((h, "turns_per_s_50"), []).append(concurrent_turns_per_s(h, 50, 1000 if not quick else 200))
    for (h, key), values in samples.items():
        out[h][key] = max(values) if key.startswith("turns_per_s") else min(values)
    for h in HOSTS:
        out[h]["turn_added_us"] = out[h]["turn_us"] - out["trio"]["turn_us"]
        out[h]["frame_added_us"] = out[h]["frame_us"] - out["trio"]["frame_us"]
    return out


def print_hosts(h: dict) -> None:
    print("\nthe library from each host (in-process sim upstream; added = minus trio, same run)")
    print(f"{'host':<9} {'turn µs':>9} {'added':>8} {'frame µs':>9} {'added':>8} {'turns/s, 50 concurrent':>24}")
    for name in HOSTS:
        row = h[name]
        print(f"{name:<9} {row['turn_us']:>9.0f} {row['turn_added_us']:>8.0f} {row['frame_us']:>9.1f} "
              f"{row['frame_added_us']:>8.1f} {row['turns_per_s_50']:>24,.0f}")


if __name__ == "__main__":
    import sys

    print_hosts(bench_hosts(quick="--quick" in sys.argv))
