"""A reload of a bad file never takes a gateway down: every way a config file can be bad, read by
a real `relayline serve` (one process, and a fleet of two workers) on SIGHUP and on
POST /admin/reload, while requests and streams are in flight. And a large good file is read off
the event loop: the streams in flight do not stand still while it is parsed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trio
from fleet import ServeProcess, Upstream, fleet_config

HI = [{"role": "user", "content": "hi"}]
KEYS = {"RELOAD_TEST_KEYS": "reload-key"}
AUTH = {"authorization": "Bearer reload-key"}
GATEWAY = '[gateway]\napi_keys_env = "RELOAD_TEST_KEYS"'


@pytest.fixture
def upstream():
    with Upstream() as up:
        yield up


def good(upstream, chain=("a", "b")) -> str:
    return fleet_config(upstream, chain=chain, extra=GATEWAY)


def _put(path: Path, content: bytes | None = None) -> None:
    """`path` as a plain file again (after a shape made it a directory, a link or a FIFO)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if content is not None:
        path.write_bytes(content)


def bad_shapes(upstream) -> list[tuple[str, object, str]]:
    """(name, how to make the file bad, what the refusal says)."""
    base = good(upstream)

    def text(content: bytes):
        return lambda path: _put(path, content)

    def oversized(path: Path) -> None:
        _put(path, b"")
        os.truncate(path, 32 * 1024 * 1024 + 1)  # one byte over the bound (sparse: nothing is written)

    def unreadable(path: Path) -> None:
        _put(path)
        if os.geteuid() == 0:  # root reads any mode: a file whose every read fails instead
            path.symlink_to("/proc/self/mem")
        else:
            path.write_text(base)
            path.chmod(0)

    return [
        ("encoding", text(b'active = "\xff"\n'), "not UTF-8"),
        ("nesting", text(b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n"), "nest too deeply"),
        ("size", oversized, "larger than 32 MiB"),
        ("types", text(base.replace("[gateway]", '[gateway]\nmax_body_bytes = "big"').encode()),
         "gateway.max_body_bytes: expected an integer"),
        ("unknown key", text(base.replace("[gateway]", "[gateway]\nnope = 1").encode()), "gateway.nope: unknown key"),
        ("removed key", text(base.replace('active = "a"', "").encode()), "active: required key is missing"),
        ("removed profile", text(base.replace('active = "a"', 'active = "gone"').encode()), "active: names no profile"),
        ("auth removed", text(base.replace(GATEWAY, "").encode()), "never turns authentication off"),
        ("auth opened", text(base.replace(GATEWAY, '[gateway]\nauth = "none"').encode()),
         "never turns authentication off"),
        ("key variable unset", text(base.replace("RELOAD_TEST_KEYS", "RELOAD_TEST_UNSET").encode()),
         "RELOAD_TEST_UNSET, which is unset"),
        ("health changed", text((base + '[health]\nstore = "redis://127.0.0.1:1/0"\n').encode()), "health: changed"),
        ("unreadable", unreadable, "Input/output error" if os.geteuid() == 0 else "Permission denied"),
        ("directory", lambda path: (_put(path), path.mkdir()), "is a directory"),
        ("missing", lambda path: _put(path), "No such file or directory"),
        ("fifo", lambda path: (_put(path), os.mkfifo(path)), "not a regular file"),
    ]


def _wait_for(predicate, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _served(url: str) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "model-a", "messages": HI}, headers=AUTH, timeout=20)
    assert r.status_code == 200, r.text
    return r.json()["relayline"]["served"]


def test_a_sighup_of_every_bad_file_is_refused_once_logged_and_the_gateway_serves_on(tmp_path, upstream):
    """Before, a file that was not UTF-8 or nested too deeply raised out of the SIGHUP reload
    and the process died; POST /admin/reload answered 500."""
    config = tmp_path / "gateway.toml"
    config.write_text(good(upstream))
    with ServeProcess(config, env=KEYS) as gateway:
        upstream.set("a", status=503)  # every answer names the chain it walked: b is the file's
        assert _served(gateway.url) == "b/model-b"
        for name, make_bad, says in bad_shapes(upstream):
            before = gateway.stderr.count("config_reload_rejected")
            make_bad(config)
            gateway.signal(signal.SIGHUP)
            _wait_for(lambda before=before: gateway.stderr.count("config_reload_rejected") > before
                      or gateway.proc.poll() is not None)
            assert gateway.proc.poll() is None, f"{name}: the gateway died on a SIGHUP: {gateway.stderr[-2000:]}"
            lines = [line for line in gateway.stderr.splitlines() if "config_reload_rejected" in line]
            assert len(lines) == before + 1 and says in lines[-1], (name, lines[-1:])
            r = httpx.post(f"{gateway.url}/admin/reload", headers=AUTH, timeout=30)
            assert r.status_code == 422, (name, r.status_code, r.text)
            assert r.json()["reloaded"] is False and says in " ".join(r.json()["problems"]), (name, r.text)
            assert gateway.stderr.count("config_reload_rejected") == before + 2, name  # one line a reload
            assert _served(gateway.url) == "b/model-b", f"{name}: a refused file changed the config"
            _put(config, good(upstream).encode())
        assert "Traceback" not in gateway.stderr
        config.write_text(good(upstream, chain=("a", "c")))
        r = httpx.post(f"{gateway.url}/admin/reload", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["reloaded"] is True
        assert _served(gateway.url) == "c/model-c"


def _children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return {int(child) for child in out}


def _two_workers(gateway: ServeProcess) -> set[int]:
    """The workers' pids, once both listen (the supervisor's line and each worker's)."""
    _wait_for(lambda: gateway.stderr.count("relayline gateway listening") == 3, 30)
    return _children(gateway.proc.pid)


def test_a_fleet_under_load_refuses_every_bad_file_with_no_worker_dead_and_no_request_failed(tmp_path, upstream):
    """Two workers, requests and streams in flight throughout, every bad shape SIGHUP'd to the
    fleet and POSTed to /admin/reload: each is a 422, no worker dies, every request succeeds.
    Before, one bad SIGHUP killed both workers, and their restarts exited 2 on the same file."""
    config = tmp_path / "fleet.toml"
    config.write_text(good(upstream))
    upstream.set("a", frames=6, pause=0.05)
    failures: list[str] = []
    done = {"requests": 0, "streams": 0}
    refusals: list[tuple[str, int, str]] = []
    with ServeProcess(config, "--workers", "2", env=KEYS) as gateway:
        workers = _two_workers(gateway)
        shapes = bad_shapes(upstream)

        async def load(client: httpx.AsyncClient, stop: trio.Event, stream: bool) -> None:
            body = {"model": "model-a", "messages": HI, "stream": stream}
            while not stop.is_set():
                try:
                    if stream:
                        async with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                                                 headers=AUTH) as r:
                            text = (await r.aread()).decode()
                        ok = r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
                    else:
                        r = await client.post(f"{gateway.url}/v1/chat/completions", json=body, headers=AUTH)
                        ok = r.status_code == 200 and r.json()["relayline"]["served"] == "a/model-a"
                except httpx.HTTPError as exc:
                    ok, text = False, repr(exc)
                if not ok:
                    failures.append(f"stream={stream}: {r.status_code} {r.text[:200] if not stream else text[:200]}")
                done["streams" if stream else "requests"] += 1

        async def reloads(client: httpx.AsyncClient, stop: trio.Event) -> None:
            try:
                for _ in range(2):
                    for name, make_bad, says in shapes:
                        make_bad(config)
                        gateway.signal(signal.SIGHUP)
                        await trio.sleep(0.05)
                        r = await client.post(f"{gateway.url}/admin/reload", headers=AUTH)
                        refusals.append((name, r.status_code, r.text if says not in r.text else ""))
                        await trio.sleep(0.1)
                        _put(config, good(upstream).encode())
            finally:
                stop.set()

        async def drive() -> None:
            stop = trio.Event()
            limits = httpx.Limits(max_connections=32, max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client, trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(load, client, stop, i % 2 == 0)
                await trio.sleep(0.3)
                nursery.start_soon(reloads, client, stop)

        trio.run(drive)
        time.sleep(0.5)  # (a SIGHUP's reload still reading: it answers nobody, but must not kill)
        assert _children(gateway.proc.pid) == workers, "a worker died and was started again"
        assert "exited with" not in gateway.stderr and "Traceback" not in gateway.stderr
    assert failures == []
    assert [(name, status, wrong) for name, status, wrong in refusals if status != 422 or wrong] == []
    assert len(refusals) == 2 * len(shapes)
    assert done["requests"] > 20 and done["streams"] > 20, done


def test_a_worker_started_again_after_a_bad_reload_serves_the_last_good_config(tmp_path, upstream):
    """A worker that dies for its own reasons is started again on the last good config the
    fleet took, not on a file the fleet refused: before, its restart exited 2 on the bad file,
    again each second, and the fleet served one worker short for good."""
    config = tmp_path / "restart.toml"
    config.write_text(good(upstream))
    upstream.set("a", status=503)
    with ServeProcess(config, "--workers", "2", env=KEYS) as gateway:
        workers = _two_workers(gateway)
        config.write_text(good(upstream, chain=("a", "c")))  # a good file: the fleet takes it
        gateway.signal(signal.SIGHUP)
        _wait_for(lambda: gateway.stderr.count("config_reloaded") == 2)
        config.write_bytes(b'active = "\xff"\n')  # then a bad one: refused
        gateway.signal(signal.SIGHUP)
        _wait_for(lambda: gateway.stderr.count("config_reload_rejected") == 2)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        _wait_for(lambda: len(_children(gateway.proc.pid) - workers) == 1 and victim not in _children(gateway.proc.pid))
        # (the supervisor's line and each worker's: the new worker's is the fourth)
        _wait_for(lambda: gateway.stderr.count("relayline gateway listening") == 4, 30)
        # every connection, to either worker, is served on the chain a -> c
        for _ in range(12):
            r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "model-a", "messages": HI},
                           headers={**AUTH, "connection": "close"}, timeout=20)
            assert r.status_code == 200 and r.json()["relayline"]["served"] == "c/model-c", r.text
        time.sleep(1.5)  # (a restart that failed would have been retried by now)
        assert gateway.stderr.count("exited with") == 1, gateway.stderr[-3000:]
        assert len(_children(gateway.proc.pid)) == 2


def big_config(upstream, profiles: int) -> str:
    """A valid file of `profiles` extra profiles (about 230 bytes each) beside the chain a -> b."""
    extra = "\n".join(f'[providers."pad{i}"]\nfamily = "openai"\nbase_url = "{upstream.base_url("a")}"\n'
                      f'model = "m{i}"\napi_key = "sk-fleet-test"\nprice = {{ input_per_mtok = 1.0, output_per_mtok = 2.0 }}'
                      for i in range(profiles))
    return good(upstream) + extra + "\n"


def test_a_large_good_file_is_reloaded_while_a_stream_in_flight_keeps_flowing(tmp_path, upstream):
    """A reload reads, parses and validates its file off the event loop: a stream in flight goes
    on while a 7 MB file is read. Before, the loop stood still for the whole parse (seconds
    here, ~15 s for a 17 MB file), so streams stalled and healthy breakers opened."""
    config = tmp_path / "big.toml"
    config.write_text(good(upstream))
    large = big_config(upstream, 40_000)
    assert len(large) > 7_000_000
    upstream.set("a", frames=120, pause=0.05)  # a stream of ~6 s, a chunk every 50 ms
    with ServeProcess(config, env=KEYS) as gateway:
        gaps: list[float] = []
        reloaded_at: list[float] = []

        async def stream(client: httpx.AsyncClient) -> None:
            async with client.stream("POST", f"{gateway.url}/v1/chat/completions", headers=AUTH,
                                     json={"model": "model-a", "messages": HI, "stream": True}) as r:
                assert r.status_code == 200
                last = time.monotonic()
                async for _ in r.aiter_raw():
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

        async def reload(client: httpx.AsyncClient) -> None:
            await trio.sleep(0.5)
            config.write_text(large)
            r = await client.post(f"{gateway.url}/admin/reload", headers=AUTH)
            assert r.status_code == 200 and len(r.json()["profiles"]) == 40_002, r.text[:300]
            reloaded_at.append(time.monotonic())

        async def drive() -> None:
            async with httpx.AsyncClient(timeout=120) as client, trio.open_nursery() as nursery:
                nursery.start_soon(stream, client)
                nursery.start_soon(reload, client)

        started = time.monotonic()
        trio.run(drive)
    assert reloaded_at, "the reload did not answer"
    assert max(gaps) < 1.0, f"the stream stood still {max(gaps):.2f} s during the reload"
    assert reloaded_at[0] - started > 1.0  # (the parse took long enough for a stall to show)
    assert len(gaps) > 50  # (the stream sent its chunks as they came)


SIM_TWO = """active = "sim.a"
[providers."sim.a"]
family = "sim"
model = "m1"
fallbacks = ["sim.b"]
[providers."sim.b"]
family = "sim"
model = "m2"
"""


class _RewrittenInPlace:
    """Another process rewriting the config file in place (opened with truncation, written)
    while relayline reads it: each read of the file finds the next of `versions` written over it
    just then, as a writer caught mid-way leaves it; once all are written the writer is done."""

    def __init__(self, path: Path, versions: list[str]) -> None:
        self.path, self.versions, self.reads = path, versions, 0
        self._fdopen = os.fdopen

    def fdopen(self, fd, *args, **kwargs):
        file = self._fdopen(fd, *args, **kwargs)
        if self.reads < len(self.versions):
            self.path.write_text(self.versions[self.reads])
        self.reads += 1
        return file


async def test_a_reload_rereads_a_file_rewritten_in_place_while_read_and_takes_the_whole_one(tmp_path, monkeypatch):
    from relayline.adapters import Relay, configfile
    from relayline.adapters.gateway import Gateway
    from relayline.adapters.gateway.reload import Reloader

    path = tmp_path / "r.toml"
    path.write_text(SIM_TWO)
    gateway = Gateway(Relay.from_file(path, env={}))
    whole = SIM_TWO + '[gateway]\ndrain_s = 7\n'
    # the first read lands mid-write: the new file cut after its profiles, still valid TOML
    writer = _RewrittenInPlace(path, [SIM_TWO.replace("[providers.\"sim.b\"]\nfamily = \"sim\"\nmodel = \"m2\"\n",
                                                      "").replace('fallbacks = ["sim.b"]\n', ""), whole])
    monkeypatch.setattr(configfile.os, "fdopen", writer.fdopen)
    report = await Reloader(gateway, path, env={}).reload()
    assert report.ok and report.profiles == ("sim.a", "sim.b"), report
    assert gateway.settings.drain_s == 7 and writer.reads >= 2


async def test_a_reload_of_a_file_that_keeps_changing_while_read_is_refused_and_changes_nothing(
        tmp_path, monkeypatch):
    from relayline.adapters import Relay, configfile
    from relayline.adapters.gateway import Gateway
    from relayline.adapters.gateway.reload import Reloader

    path = tmp_path / "r.toml"
    path.write_text(SIM_TWO)
    relay = Relay.from_file(path, env={})
    gateway = Gateway(relay)
    cut = SIM_TWO.split("[providers.\"sim.b\"]")[0].replace('fallbacks = ["sim.b"]\n', "")
    writer = _RewrittenInPlace(path, [cut + f"# write {i}\n" * i for i in range(1, 50)])
    monkeypatch.setattr(configfile.os, "fdopen", writer.fdopen)
    report = await Reloader(gateway, path, env={}).reload()
    assert not report.ok and gateway.relay is relay, "a file read while it changed is never taken"
    assert "changed while it was read" in report.problems[0] and "rename it over" in report.problems[0]
    assert writer.reads == configfile.READ_ATTEMPTS
