"""Headless Chromium for the browser tests (test_site.py, test_lab.py): Debian's package
`chromium` (.ci/run installs it), or SITE_BROWSER; a test skips where there is none.

Driven over its DevTools pipe (the protocol Playwright speaks: JSON messages ended by a NUL byte,
commands on fd 3, replies and events on fd 4), so a test can evaluate JavaScript in a page and
screenshot one element of it.
"""
import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import time

import pytest

SKIP_REASON = "no Chromium (Debian: apt-get install chromium): the browser tests skip"


def browser() -> str:
    """Chromium: SITE_BROWSER (the GitHub workflow's), else Debian's package on PATH."""
    names = (os.environ.get("SITE_BROWSER", ""), "chromium", "chromium-browser", "google-chrome")
    return next(filter(None, map(shutil.which, filter(None, names))), "")


needs_browser = pytest.mark.skipif(not browser(), reason=SKIP_REASON)


class Chromium:
    """One headless Chromium; `open(url)` gives a page session to send commands to."""

    def __init__(self, profile, stderr, size=(1280, 1000)):
        to_chromium, self.commands = os.pipe()
        self.replies, from_chromium = os.pipe()
        # Moved to fds >= 5, so placing them at 3 and 4 in the child overwrites neither.
        ends = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5) for fd in (to_chromium, from_chromium)]
        for fd in (to_chromium, from_chromium):
            os.close(fd)

        def pipe_at_3_and_4():  # in the child, before exec
            os.dup2(ends[0], 3)
            os.dup2(ends[1], 4)

        self.proc = subprocess.Popen(
            [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size={},{}".format(*size), f"--user-data-dir={profile}",
             "--no-first-run", "--remote-debugging-pipe", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=stderr, close_fds=False, start_new_session=True,
            preexec_fn=pipe_at_3_and_4)
        for fd in ends:
            os.close(fd)
        self.buffer, self.last_id = b"", 0

    def send(self, method, session=None, timeout=30, **params):
        """The result of one DevTools command (events that arrive meanwhile are dropped)."""
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params}
        if session:  # a command to one page (attached with flatten=True), not to the browser
            message["sessionId"] = session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.last_id:
                    assert "error" not in reply, f"Chromium: {method}: {reply['error']}"
                    return reply["result"]
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self.replies], [], [], left)[0], \
                f"Chromium: no reply to {method} within {timeout} s"
            chunk = os.read(self.replies, 1 << 20)
            assert chunk, f"Chromium exited ({self.proc.wait()}) during {method}"
            self.buffer += chunk

    def open(self, url: str) -> str:
        """A new page at `url`; returns its session id."""
        target = self.send("Target.createTarget", url=url)
        return self.send("Target.attachToTarget", targetId=target["targetId"],
                         flatten=True)["sessionId"]

    def evaluate(self, session, expression, timeout=30):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        result = self.send("Runtime.evaluate", session, timeout=timeout, expression=expression,
                           returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, f"in the page: {result['exceptionDetails']}"
        return result["result"].get("value")

    def wait_for(self, session, expression, timeout, what):
        """Poll a JavaScript expression until it is truthy; its value. A hang fails, bounded."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(session, expression)):
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
            time.sleep(0.2)
        return value

    def screenshot(self, session, clip=None) -> bytes:
        """PNG of the viewport, or of `clip` ({x, y, width, height} in page coordinates)."""
        params = {"captureBeyondViewport": True, "clip": {**clip, "scale": 1}} if clip else {}
        return base64.b64decode(self.send("Page.captureScreenshot", session, **params)["data"])

    def close(self):
        """Close the browser; kill its process group if it does not go."""
        try:
            if self.proc.poll() is None:
                self.send("Browser.close", timeout=10)
                self.proc.wait(timeout=10)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            for fd in (self.commands, self.replies):
                os.close(fd)
