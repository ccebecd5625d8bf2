"""The operator's console (GET /admin/): its data over HTTP and server-sent events, and the page
itself in a real headless chromium against a gateway in front of loopback sim upstreams while
a scripted outage opens a breaker. Screenshots go under the test's tmp_path for the reviewer;
RELAYLINE_CONSOLE_SCREENSHOT=path also copies the outage screenshot there (the README's)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import threading
import time

import h11
import httpx
import pytest
import trio
from browser import Chromium, find_chromium

from relayline.adapters.gateway.console import CSP, MERMAID
from relayline.adapters.gateway.turn_views import turn_view
from relayline.adapters.sim.background import BackgroundGateway
from relayline.machines.ledger import LedgerRow
from relayline.machines.turn import AttemptRecord, TurnResult

PROMPT = "PROMPT-CANARY the quarterly numbers for Zanzibar"
ANSWER = "ANSWER-CANARY forty two"
POOL = ("sk-console-pool-AAAA1111", "sk-console-pool-BBBB2222")
BACKUP_KEY = "sk-console-backup-CCCC3333"
CLIENT_KEY = "gw-console-client-DDDD4444"
ADMIN_KEY = "gw-console-admin-EEEE5555"
SECRETS = (*POOL, BACKUP_KEY, CLIENT_KEY, ADMIN_KEY)
# what a browser sends once its user typed the admin key into the login prompt
BASIC = {"authorization": "Basic " + base64.b64encode(f"operator:{ADMIN_KEY}".encode()).decode()}


def outage_config() -> dict:
    return {
        "active": "sim.primary",
        "reliability": {"provider_retries": 0},
        "breaker": {"failure_threshold": 2, "window_s": 60, "open_s": 30},
        "providers": {
            "sim.primary": {"family": "sim", "model": "prime-1", "fallbacks": ["sim.backup"], "api_keys": list(POOL),
                            "price": {"input_per_mtok": 3.0, "output_per_mtok": 15.0}},
            "sim.backup": {"family": "sim", "model": "backup-1", "api_key_env": "BACKUP_KEY",
                           "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}},
        },
        "routes": [{"hint": "fast", "provider": "sim.backup", "model": "backup-1"}],
    }


# the primary answers twice, then is down for good; the backup always answers
OUTAGE = [{"provider": "sim.primary", "script": [{"text": ANSWER}, {"text": ANSWER}, {"status": 503}]},
          {"provider": "sim.backup", "script": [{"text": ANSWER}]}]


def chat(gw, *, key: str | None = CLIENT_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(f"{gw.url}/v1/chat/completions", headers=headers, timeout=20,
                        json={"model": "prime-1", "messages": [{"role": "user", "content": PROMPT}]})
    assert answer.status_code == 200, answer.text
    return answer


class EventTap:
    """The console's event stream, read raw (h11 over a socket) in a thread for as long as the
    test runs: polled in short reads, so it stops the moment the test is done with it."""

    def __init__(self, url: str, headers: dict) -> None:
        self.url = httpx.URL(url)
        self.headers = [("host", f"{self.url.host}:{self.url.port}"), *headers.items()]
        self.data = bytearray()
        self.status: int | None = None
        self.content_type = ""
        self.ended = threading.Event()  # the gateway ended the response cleanly
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = h11.Connection(h11.CLIENT)
        with socket.create_connection((self.url.host, self.url.port), timeout=10) as sock:
            sock.sendall(client.send(h11.Request(method="GET", target=self.url.raw_path, headers=self.headers)))
            sock.settimeout(0.1)
            while not self._stop.is_set():
                event = client.next_event()
                if event is h11.NEED_DATA:
                    try:
                        client.receive_data(sock.recv(65536))
                    except TimeoutError:
                        continue
                elif isinstance(event, h11.Response):
                    self.status = event.status_code
                    self.content_type = dict(event.headers).get(b"content-type", b"").decode()
                elif isinstance(event, h11.Data):
                    self.data += event.data
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    self.ended.set()
                    return

    def __enter__(self) -> EventTap:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)

    def events(self, name: str) -> list[str]:
        return re.findall(rf"event: {name}\ndata: (.*)\n\n", self.data.decode())


def assert_clean(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"a credential leaked into {where}"
    for canary in (PROMPT, "PROMPT-CANARY", ANSWER, "ANSWER-CANARY", "Zanzibar"):
        assert canary not in text, f"prompt or completion text leaked into {where}"


@pytest.fixture
def browser(tmp_path):
    if find_chromium() is None:
        pytest.skip("no chromium on PATH: install chromium (`make test` does, as root with apt-get)")
    with Chromium(tmp_path) as chromium:
        yield chromium


def health_row(page, profile: str, attribute: str) -> str:
    return page.evaluate(f"document.querySelector('#health tr[data-profile=\"{profile}\"]')?.dataset.{attribute}")


def test_the_page_follows_an_outage_live(browser, tmp_path):
    auth = {"authorization": f"Bearer {ADMIN_KEY}"}
    with BackgroundGateway(outage_config(), OUTAGE, api_keys={CLIENT_KEY}, admin_keys={ADMIN_KEY},
                           ledger_path=str(tmp_path / "ledger.sqlite3"), env={"BACKUP_KEY": BACKUP_KEY}) as gw, \
            EventTap(f"{gw.url}/admin/console/events", auth) as tap:
        page = browser.page()
        page.call("Network.setExtraHTTPHeaders", headers=BASIC)
        page.navigate(f"{gw.url}/admin/")
        page.wait_for("document.body.dataset.ready === 'yes'", timeout=20)
        page.wait_for("document.getElementById('live').dataset.state === 'live'")
        page.wait_for("document.body.dataset.diagrams === 'yes'", timeout=20)
        assert health_row(page, "sim.primary", "breaker") == "closed"
        assert page.evaluate("document.querySelector('#routes [data-route=\"default:default\"] li').dataset.skip") == ""
        opened_before = int(page.evaluate(
            "document.querySelector('#life-breaker tr[data-edge=\"closed:failure:open\"] .count').textContent"))
        walked_before = int(page.evaluate("document.getElementById('life-walk').dataset.fired"))
        page.screenshot(tmp_path / "console-1-healthy.png")

        chat(gw)
        chat(gw)
        page.wait_for("document.querySelectorAll('#turns .turn').length === 2")
        chat(gw)  # the primary fails once: a fallback
        chat(gw)  # and again: the breaker opens
        opened_at = time.monotonic()
        page.wait_for("document.querySelector('#health tr[data-profile=\"sim.primary\"]').dataset.breaker === 'open'",
                      timeout=5)
        seen_open_after = time.monotonic() - opened_at
        assert seen_open_after < 2.0
        assert float(page.evaluate(
            "parseFloat(document.querySelector('#health tr[data-profile=\"sim.primary\"] .breaker-left').textContent)")) > 20
        # the chain shows the primary skipped, and why
        page.wait_for("document.querySelector('#routes [data-route=\"default:default\"] li').dataset.skip === 'breaker'",
                      timeout=2)
        served = chat(gw)  # the next turn skips the primary without calling it
        assert served.headers["x-relayline-served"] == "sim.backup/backup-1"
        page.wait_for("document.querySelectorAll('#turns .turn').length === 5")
        newest = page.evaluate("document.querySelector('#turns .turn').innerText")
        assert "sim.primary/prime-1 skipped: breaker" in newest and "sim.backup/backup-1 · complete · ok" in newest
        fallback = page.evaluate("document.querySelectorAll('#turns .turn')[1].innerText")
        assert "sim.primary/prime-1 · complete · retryable" in fallback and "fallback" in fallback
        assert re.search(r"10 in / \d+ out", fallback)
        # transition counts rise, in the tables and on the drawn diagrams
        page.wait_for("Number(document.getElementById('life-walk').dataset.fired) >= "
                      f"{walked_before + 5}", timeout=3)
        opened = int(page.evaluate(
            "document.querySelector('#life-breaker tr[data-edge=\"closed:failure:open\"] .count').textContent"))
        assert opened >= opened_before + 1
        page.wait_for(f"document.querySelector('#life-breaker .diagram svg').textContent.includes('×{opened}')",
                      timeout=5)
        # filtering by outcome
        page.evaluate("document.querySelector('#turn-filter [data-outcome=\"fallback\"]').click()")
        assert page.evaluate("document.querySelectorAll('#turns .turn').length") == 3
        page.evaluate("document.querySelector('#turn-filter [data-outcome=\"error\"]').click()")
        assert page.evaluate("document.querySelectorAll('#turns .turn').length") == 0
        page.evaluate("document.querySelector('#turn-filter [data-outcome=\"all\"]').click()")
        # cost from the ledger, as a chart (pushed at most every few seconds)
        page.wait_for("document.querySelector('#cost-table tr[data-profile=\"sim.backup\"]') !== null", timeout=10)
        assert page.evaluate("document.querySelectorAll('#cost svg rect').length") >= 2
        page.screenshot(tmp_path / "console-2-breaker-open.png")
        shot = page.screenshot(tmp_path / "console-2-breaker-open-top.png", height=1180)
        dom = page.dom()
        state = httpx.get(f"{gw.url}/admin/console/state", headers=auth).text
        assert page.problems() == []
    if os.environ.get("RELAYLINE_CONSOLE_SCREENSHOT"):
        shutil.copy(shot, os.environ["RELAYLINE_CONSOLE_SCREENSHOT"])
    assert tap.status == 200 and tap.content_type == "text/event-stream"
    assert tap.events("turn") and '"breaker":"open"' in "".join(tap.events("health"))
    for where, text in (("the page", dom), ("the state", state), ("the event stream", tap.data.decode())):
        assert_clean(where, text)


def test_the_page_degrades_without_a_ledger_and_with_an_empty_one(browser, tmp_path):
    page = browser.page()
    with BackgroundGateway(outage_config(), OUTAGE, env={"BACKUP_KEY": BACKUP_KEY}) as gw:
        page.navigate(f"{gw.url}/admin/")
        page.wait_for("document.body.dataset.ready === 'yes'", timeout=20)
        assert "No ledger is configured" in page.evaluate("document.getElementById('cost').innerText")
        assert "no turns since the gateway started" in page.evaluate("document.getElementById('turns').innerText")
        assert page.problems() == []
        page.navigate("about:blank")  # close its event stream before this gateway stops
        page.wait_for("location.href === 'about:blank'")
    with BackgroundGateway(outage_config(), OUTAGE, env={"BACKUP_KEY": BACKUP_KEY},
                           ledger_path=str(tmp_path / "empty.sqlite3")) as gw:
        page.navigate(f"{gw.url}/admin/")
        page.wait_for("document.body.dataset.ready === 'yes'", timeout=20)
        assert "No billable attempts in the last 1h" in page.evaluate("document.getElementById('cost').innerText")
        page.screenshot(tmp_path / "console-empty-ledger.png")
        assert page.problems() == []


# -- over HTTP, without a browser ------------------------------------------------------------


def test_the_page_and_its_assets_are_served_from_package_data():
    with BackgroundGateway(outage_config(), OUTAGE, env={"BACKUP_KEY": BACKUP_KEY}) as gw:
        page = httpx.get(f"{gw.url}/admin/")
        assets = {name: httpx.get(f"{gw.url}/admin/console/{name}")
                  for name in ("console.js", "console.css", MERMAID, "mermaid-LICENSE.txt")}
        missing = httpx.get(f"{gw.url}/admin/console/../app.py")
        unknown = httpx.get(f"{gw.url}/admin/console/nothing.js")
        post = httpx.post(f"{gw.url}/admin/console/state")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP and "default-src 'none'" in CSP
    assert all(answer.status_code == 200 for answer in assets.values())
    assert assets[MERMAID].headers["content-type"].startswith("text/javascript")
    assert "immutable" in assets[MERMAID].headers["cache-control"]
    assert "MIT License" in assets["mermaid-LICENSE.txt"].text
    assert missing.status_code == 404 and unknown.status_code == 404
    assert post.status_code == 405 and post.headers["allow"] == "GET"
    # nothing the page loads points elsewhere
    for text in (page.text, assets["console.js"].text, assets["console.css"].text):
        assert not re.search(r"(src|href)=\"(https?:)?//", text) and "url(http" not in text
        assert "fetch(\"http" not in text and "EventSource(\"http" not in text


def test_the_console_needs_the_admin_key_and_a_browser_can_send_it():
    with BackgroundGateway(outage_config(), OUTAGE, api_keys={CLIENT_KEY}, admin_keys={ADMIN_KEY},
                           env={"BACKUP_KEY": BACKUP_KEY}) as gw:
        refused = [httpx.get(f"{gw.url}{path}").status_code
                   for path in ("/admin/", "/admin/console/state", "/admin/console/events", f"/admin/console/{MERMAID}")]
        page = httpx.get(f"{gw.url}/admin/")
        client_key = httpx.get(f"{gw.url}/admin/", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        wrong_password = httpx.get(f"{gw.url}/admin/", auth=("operator", CLIENT_KEY))
        garbled = httpx.get(f"{gw.url}/admin/", headers={"authorization": "Basic %%%"})
        allowed = [httpx.get(f"{gw.url}/admin/console/state", headers=h).status_code
                   for h in (BASIC, {"authorization": f"Bearer {ADMIN_KEY}"})]
    assert refused == [401, 401, 401, 401]
    # the page's 401 makes a browser ask for the key; API clients still see the Bearer scheme
    assert page.headers.get_list("www-authenticate") == ["Bearer", 'Basic realm="relayline admin", charset="UTF-8"']
    assert client_key.status_code == wrong_password.status_code == garbled.status_code == 401
    assert allowed == [200, 200]


def test_admin_without_the_slash_leads_a_browser_to_the_login_prompt():
    with BackgroundGateway(outage_config(), OUTAGE, api_keys={CLIENT_KEY}, admin_keys={ADMIN_KEY},
                           env={"BACKUP_KEY": BACKUP_KEY}) as gw:
        moved = httpx.get(f"{gw.url}/admin?tab=health")
        followed = httpx.get(f"{gw.url}/admin", follow_redirects=True)
        signed_in = httpx.get(f"{gw.url}/admin", auth=("operator", ADMIN_KEY), follow_redirects=True)
    assert moved.status_code == 308 and moved.headers["location"] == "/admin/?tab=health"
    assert followed.status_code == 401 and 'Basic realm="relayline admin", charset="UTF-8"' in \
        followed.headers.get_list("www-authenticate")
    assert signed_in.status_code == 200 and "text/html" in signed_in.headers["content-type"]


def test_the_event_stream_pushes_a_turn_and_only_what_changed(tmp_path):
    with BackgroundGateway(outage_config(), OUTAGE, env={"BACKUP_KEY": BACKUP_KEY},
                           ledger_path=str(tmp_path / "ledger.sqlite3")) as gw, \
            EventTap(f"{gw.url}/admin/console/events", {}) as tap:
        deadline = time.monotonic() + 5
        while not tap.events("counts") and time.monotonic() < deadline:
            time.sleep(0.02)
        chat(gw, key=None)
        deadline = time.monotonic() + 5
        while not tap.events("turn") and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.5)  # more than a tick: nothing changed, nothing is re-sent
        turns = tap.events("turn")
        state = httpx.get(f"{gw.url}/admin/console/state").json()
        errors = httpx.get(f"{gw.url}/admin/console/turns", params={"outcome": "error"}).json()
        # a draining gateway ends the stream, rather than wait for the console to go away
        trio.from_thread.run_sync(setattr, gw.gateway, "draining", True, trio_token=gw._token)
        assert tap.ended.wait(5)
        refused = httpx.get(f"{gw.url}/admin/console/events")
    assert refused.status_code == 503
    assert len(turns) == 1 and '"outcome":"ok"' in turns[0] and '"served":"sim.primary/prime-1"' in turns[0]
    assert len(tap.events("routes")) == 1 and len(tap.events("counts")) == 2  # at start, after the turn
    assert len(tap.events("health")) == 2
    assert [t["outcome"] for t in state["turns"]] == ["ok"] and errors == {"turns": []}
    assert_clean("the event stream", tap.data.decode())


def test_attempts_are_paired_with_their_ledger_rows():
    records = (AttemptRecord("a", "m", "stream", "stream_failed", "overloaded", 10.0, 0, ended=10.25),
               AttemptRecord("a", "m", "stream", "interrupted", "timeout", 10.5, 1, ended=11.0),
               AttemptRecord("b", "n", "stream", "ok", None, 11.0, None, ended=11.5))
    rows = (LedgerRow("a", "m", False, 12, 3, 0.002, "interrupted", "stream"),
            LedgerRow("b", "n", True, 12, 9, 0.001, "ok", "stream"))
    result = TurnResult("ok", None, None, "a/m", None, ANSWER, "", (), None, None, True, records, (), rows)
    view = turn_view(7, "t-1", result, 1.6, 12.0, 1_000.0)
    assert [(a.billed, a.input_tokens, a.output_tokens, a.latency_ms) for a in view.attempts] == [
        (False, 0, 0, 250.0), (True, 12, 3, 500.0), (True, 12, 9, 500.0)]
    assert view.cost_usd == pytest.approx(0.003) and view.latency_ms == 1600.0
    assert ANSWER not in repr(view.as_json())



def test_the_console_diagrams_show_what_entering_a_state_does():
    """The console draws each lifecycle's entry actions from its spec, as `relayline diagram`
    does: the turn's, the walk's, the breaker's, the stream's and the cancellation's."""
    from relayline.machines.engine import load_spec

    with BackgroundGateway(outage_config(), OUTAGE, env={"BACKUP_KEY": BACKUP_KEY}) as gw:
        state = httpx.get(f"{gw.url}/admin/console/state").json()
    drawn = {life["name"]: life["mermaid"] for life in state["lifecycles"]}
    for name in ("turn", "walk", "breaker", "stream", "cancellation"):
        spec = load_spec(name)
        entries = [f"  {s.name} : entry / {', '.join(s.enter)}" for s in spec.states.values() if s.enter]
        assert entries, name
        assert [line for line in drawn[name].splitlines() if " : entry / " in line] == entries, name
