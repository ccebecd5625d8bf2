"""The embedding examples, run as their users run them: the FastAPI app under uvicorn with a
real HTTP client over loopback, the synchronous script as a process; both against scripted
sim upstreams over loopback HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from helpers import sim_config, to_toml
from relayline.adapters.sim.background import BackgroundUpstreams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import fastapi_app  # noqa: E402  (the example is a script folder, not a package)

CONFIG = sim_config("m1", "m2", reliability={"provider_retries": 0})


def write_config(tmp_path: Path, upstreams: BackgroundUpstreams) -> Path:
    path = tmp_path / "relayline.toml"
    path.write_text(to_toml(upstreams.wire(CONFIG)))
    return path


class Served:
    """The example app under uvicorn on a loopback port, on a thread of its own."""

    def __init__(self, config: Path) -> None:
        self.app = fastapi_app.create_app(str(config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.results: list = []

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.app.state.relay.observers.append(self.results.append)
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def wait_for_results(self, n: int, within: float = 10.0) -> list:
        deadline = time.monotonic() + within
        while len(self.results) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.results


def sse_events(lines) -> list[tuple[str, dict]]:
    events, name = [], "message"
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            name = "message"
    return events


HI = {"messages": [{"role": "user", "content": "hi"}]}


def test_fastapi_app_answers_falls_back_and_streams(tmp_path):
    replies = [{"provider": "sim.a", "script": [{"status": 503}, {"text": "streamed answer"}]},
               {"provider": "sim.b", "script": [{"text": "from b"}]}]
    with BackgroundUpstreams(replies) as up, Served(write_config(tmp_path, up)) as served:
        with httpx.Client(base_url=served.url, timeout=10) as client:
            reply = client.post("/chat", json=HI).json()
            assert (reply["text"], reply["served"], reply["requested"]) == ("from b", "sim.b/m2", "sim.a/m1")
            with client.stream("POST", "/chat/stream", json=HI) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                events = sse_events(response.iter_lines())
    assert events == [("message", {"kind": "text", "value": "streamed"}),
                      ("message", {"kind": "text", "value": " answer"}),
                      ("done", {"served": "sim.a/m1", "notice": None})]
    assert [r.outcome for r in served.results] == ["ok", "ok"]


def test_fastapi_app_maps_turn_errors(tmp_path):
    replies = [{"provider": "sim.a", "script": [{"status": 400, "error": "context_length_exceeded"},
                                                {"frames": [{"role": True}, {"text": "part"},
                                                            {"error": "overloaded_error"}]}]}]
    with BackgroundUpstreams(replies) as up, Served(write_config(tmp_path, up)) as served:
        with httpx.Client(base_url=served.url, timeout=10) as client:
            response = client.post("/chat", json=HI)
            assert response.status_code == 400 and response.json()["detail"]["reason"] == "context_window"
            with client.stream("POST", "/chat/stream", json=HI) as response:
                events = sse_events(response.iter_lines())
    assert events == [("message", {"kind": "text", "value": "part"}),
                      ("error", {"reason": "interrupted", "partial_text": "part"})]
    assert up.sim.calls == 2  # the interrupted stream was not replayed


def test_a_client_leaving_mid_stream_cancels_the_turn_and_nothing_is_retried(tmp_path):
    replies = [{"provider": "sim.a", "script": [{"frames": [{"role": True}, {"text": "first"}, {"wait": 3},
                                                            {"text": " never"}, {"done": True}]}]}]
    with BackgroundUpstreams(replies) as up, Served(write_config(tmp_path, up)) as served:
        with httpx.Client(base_url=served.url, timeout=10) as client:
            with client.stream("POST", "/chat/stream", json=HI) as response:
                first = next(line for line in response.iter_lines() if line.startswith("data: "))
            # leaving the block closed the connection while the upstream pauses
        results = served.wait_for_results(1)
        assert json.loads(first[6:]) == {"kind": "text", "value": "first"}
        assert [(r.outcome, r.partial_text) for r in results] == [("cancelled", "first")]
        assert [a.outcome for a in results[0].attempts] == ["cancelled"]
        assert up.sim.calls == 1  # no retry, no fallback


@pytest.mark.parametrize("flags, expected", [([], "plain answer\n[served by sim.a/m1]\n"),
                                             (["--stream"], "streamed words\n[served by sim.a/m1]\n")])
def test_sync_script(tmp_path, flags, expected):
    text = "streamed words" if flags else "plain answer"
    with BackgroundUpstreams([{"provider": "sim.a", "script": [{"text": text}]}]) as up:
        config = write_config(tmp_path, up)
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "sync_script.py"), str(config), "hi", *flags],
                              capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, expected), done.stderr


def test_sync_script_reports_a_turn_that_did_not_answer(tmp_path):
    with BackgroundUpstreams([{"provider": p, "script": [{"status": 503}]} for p in ("sim.a", "sim.b")]) as up:
        config = write_config(tmp_path, up)
        done = subprocess.run([sys.executable, str(ROOT / "examples" / "sync_script.py"), str(config), "hi"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("[no answer: exhausted]")
