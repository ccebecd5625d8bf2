"""A real headless browser for the console tests and the console benchmark: Debian's chromium,
driven over the DevTools protocol (a websocket, spoken with wsproto, a dev
dependency). Every wait is bounded; the browser is a child process that is always killed.

    with Chromium(tmp_path) as browser:
        page = browser.page()
        page.navigate(url)
        page.wait_for("document.body.dataset.ready === 'yes'")
        page.screenshot(tmp_path / "console.png")
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import Request as HTTPRequest
from urllib.request import urlopen

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, NAMES) if path), None)


class BrowserError(RuntimeError):
    pass


class Page:
    """One tab over one DevTools websocket: commands by id, events kept for inspection."""

    def __init__(self, ws_url: str, timeout: float = 20.0) -> None:
        url = urlparse(ws_url)
        self.timeout = timeout
        self.sock = socket.create_connection((url.hostname, url.port), timeout=timeout)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(self.ws.send(Request(host=url.netloc, target=url.path)))
        self.events: list[dict] = []
        self._ids = itertools.count(1)
        self._replies: dict[int, dict] = {}
        self._text: list[str] = []
        self._open = False
        deadline = time.monotonic() + timeout
        while not self._open:
            self._pump(deadline)

    def _pump(self, deadline: float) -> None:
        self.sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            raise BrowserError("the browser did not answer in time") from None
        self.ws.receive_data(data or None)
        for event in self.ws.events():
            if isinstance(event, AcceptConnection):
                self._open = True
            elif isinstance(event, RejectConnection | CloseConnection):
                raise BrowserError(f"the DevTools websocket closed: {event!r}")
            elif isinstance(event, Ping):
                self.sock.sendall(self.ws.send(event.response()))
            elif isinstance(event, TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    message = json.loads("".join(self._text))
                    self._text.clear()
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)

    def call(self, method: str, **params):
        ident = next(self._ids)
        self.sock.sendall(self.ws.send(TextMessage(json.dumps({"id": ident, "method": method, "params": params}))))
        deadline = time.monotonic() + self.timeout
        while ident not in self._replies:
            if time.monotonic() > deadline:
                raise BrowserError(f"{method} got no answer within {self.timeout} s")
            self._pump(deadline)
        reply = self._replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout: float = 10.0, every: float = 0.05) -> float:
        """Poll until `expression` is truthy (a throw counts as not yet: the page may still be
        loading); return how long that took (seconds)."""
        started = time.monotonic()
        while True:
            try:
                if self.evaluate(expression):
                    return time.monotonic() - started
            except BrowserError:
                pass
            if time.monotonic() - started > timeout:
                raise BrowserError(f"still false after {timeout} s: {expression}")
            time.sleep(every)

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML")

    def screenshot(self, path: Path, width: int = 1400, height: int | None = None) -> Path:
        """The whole page, or its top `height` pixels."""
        if height is None:
            height = min(int(self.evaluate("Math.ceil(document.documentElement.scrollHeight)") or 900), 6000)
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        shot = self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def problems(self) -> list[str]:
        """Exceptions, console errors and browser log errors (a CSP violation is one) seen so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(params["exceptionDetails"].get("exception", {}).get("description", "exception"))
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def close(self) -> None:
        try:
            self.sock.sendall(self.ws.send(CloseConnection(code=1000)))
        except Exception:  # the browser may be gone already
            pass
        self.sock.close()


class Chromium:
    """A headless chromium with a DevTools port, in a throwaway profile under `workdir`."""

    def __init__(self, workdir: Path, executable: str | None = None) -> None:
        self.executable = executable or find_chromium()
        if self.executable is None:
            raise BrowserError("no chromium on PATH: install chromium (`make test` does, as root with apt-get)")
        self.profile = Path(workdir) / "chromium-profile"
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.pages: list[Page] = []

    def __enter__(self) -> Chromium:
        self.profile.mkdir(parents=True, exist_ok=True)
        port_file = self.profile / "DevToolsActivePort"
        port_file.unlink(missing_ok=True)  # a reused profile keeps the last run's port
        self.proc = subprocess.Popen(
            [self.executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", f"--user-data-dir={self.profile}",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--metrics-recording-only", "--mute-audio",
             "--window-size=1400,1000", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise BrowserError("chromium did not open its DevTools port within 30 s")
            time.sleep(0.05)
        self.port = int(port_file.read_text().split()[0])
        return self

    def page(self) -> Page:
        # a new tab; recent chromium takes PUT only for /json/new
        request = HTTPRequest(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urlopen(request, timeout=10) as answer:
            target = json.load(answer)
        page = Page(target["webSocketDebuggerUrl"])
        for domain in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            page.call(domain)
        self.pages.append(page)
        return page

    def __exit__(self, *exc_info) -> None:
        for page in self.pages:
            page.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
