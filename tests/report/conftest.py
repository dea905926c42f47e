"""A real headless Chromium for the report page's tests, driven through the DevTools protocol over a pipe.

``chromium`` (Debian's package) is started with ``--remote-debugging-pipe``: it reads commands on fd 3 and writes
answers and events on fd 4, each a JSON message ended by a NUL byte. ``Browser.load`` opens a page and returns
what a test needs to judge it: every console message and error, every network request the page made, a PNG
screenshot of the whole page and the DOM as loaded. Where there is no chromium, tests skip as needing a system
component, naming the package (a failure in CI: tests/conftest.py).

Also here: ``grid``, the session's finished runs (tests/conftest.py's ``finished_runs``) under this folder's
name for them.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

BROWSER_TIMEOUT = 60.0


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _high_fd(fd: int) -> int:
    """``fd`` moved to a number of 10 or more, so placing the child's 3 and 4 cannot overwrite it."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless Chromium and one page, spoken to over the DevTools pipe."""

    def __init__(self, executable: str, profile: Path):
        to_browser_read, to_browser_write = (_high_fd(fd) for fd in os.pipe())
        from_browser_read, from_browser_write = (_high_fd(fd) for fd in os.pipe())

        def place_pipes() -> None:  # in the child: the browser reads fd 3 and writes fd 4
            os.dup2(to_browser_read, 3)
            os.dup2(from_browser_write, 4)

        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=place_pipes, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._write, self._read = to_browser_write, from_browser_read
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed its DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + BROWSER_TIMEOUT
        while True:
            answer = self._receive(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]
            self.events.append(answer)

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + BROWSER_TIMEOUT
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._receive(deadline))

    def load(self, url: str, width: int = 1100, measure: str | None = None) -> dict[str, Any]:
        """Open ``url``; (console messages, errors, requested urls, screenshot PNG bytes, DOM, and the value of the
        JavaScript expression ``measure`` evaluated in the loaded page, as JSON)."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session)
        self.call("Emulation.setDeviceMetricsOverride", session, width=width, height=900, deviceScaleFactor=1,
                  mobile=False)
        self.events.clear()
        self.call("Page.navigate", session, url=url)
        self.wait_for("Page.loadEventFired")
        shot = self.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True)
        dom = self.call("Runtime.evaluate", session, expression="document.documentElement.outerHTML",
                        returnByValue=True)["result"]["value"]
        measured = (self.call("Runtime.evaluate", session, expression=measure, returnByValue=True)["result"]
                    .get("value") if measure else None)
        mine = [e for e in self.events if e.get("sessionId") == session]
        return {
            "console": [e["params"] for e in mine if e.get("method") == "Runtime.consoleAPICalled"],
            "errors": [e["params"] for e in mine if e.get("method") == "Runtime.exceptionThrown"
                       or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")],
            "requests": [e["params"]["request"]["url"] for e in mine if e.get("method") == "Network.requestWillBeSent"],
            "png": base64.b64decode(shot["data"]),
            "dom": dom,
            "measured": measured,
        }

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._write)
        os.close(self._read)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    executable = chromium_path()
    if executable is None:
        pytest.skip("needs a system component: chromium (Debian: apt-get install -y chromium); the page is not opened")
    started = Browser(executable, tmp_path_factory.mktemp("chromium-profile"))
    yield started
    started.close()


@pytest.fixture(scope="module")
def grid(finished_runs) -> dict[str, Path]:
    """The session's finished runs (tests/conftest.py): an agent arm with the heuristic backend among fixed ones,
    two seeds, 60 updates; read-only for the tests."""
    return finished_runs
