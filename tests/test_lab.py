"""`make lab` shows every diagram. The server `make lab` starts (one for this module, on a free
port) answers 200 for each image a notebook references (it served notebooks/, so ../images/ lay
outside its root: every image 404). And headless Chromium (as in test_site.py; skipped where it
is missing), driven over its DevTools pipe, opens one notebook in that JupyterLab and finds every
image loaded, with the links resolved by JupyterLab itself; a screenshot is saved in
build/lab-screenshots/. Opening the notebook starts no kernel and saves nothing.
"""
import base64
import http.client
import json
import os
import posixpath
import secrets
import shlex
import socket
import subprocess
import time
from urllib.parse import quote, unquote, urlsplit

import pytest

from conftest import ROOT
from test_images import PNG_MAGIC, notebook_images
from chromium import Chromium, needs_browser

START_TIMEOUT = 60   # s for the server to answer: ~7 CPU-s to start here, far more under load
STOP_TIMEOUT = 20    # s to shut down after /api/shutdown
RENDER_TIMEOUT = 90  # s for JupyterLab to show the notebook's images: ~10 s here; stops a hang
NOTEBOOK = "02_model_parallelism.ipynb"  # the most diagrams (5), and plots among them
SCREENSHOTS = ROOT / "build" / "lab-screenshots"
# JupyterLab's user settings for the test's server (a folder of its own, so a learner's
# ~/.jupyter is neither read nor written): no autosave (the test never writes a notebook) and no
# news pop-up over the screenshot.
SETTINGS = {"docmanager-extension/plugin": {"autosave": False},
            "apputils-extension/notification": {"fetchNews": "false"}}


def lab_command() -> list[str]:
    """The command `make lab` runs, from the Makefile (not a copy of it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "-s", "--no-print-directory", "print-LAB_COMMAND"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=30, check=True)
    return shlex.split(proc.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path, token, method="GET"):
    """(status, headers, body) of one request to the server, without following redirects."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"token {token}"})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def wait_until_it_answers(proc, port, token, log):
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited ({proc.returncode}) before it answered:\n"
                                 + log.read_text()[-3000:])
        try:
            if get(port, "/api/status", token)[0] == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.25)
    raise AssertionError(f"JupyterLab did not answer on port {port} within {START_TIMEOUT} s:\n"
                         + log.read_text()[-3000:])


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(port, token) of the server `make lab` starts, on a free port; stopped afterwards,
    whatever the tests did (SIGTERM also shuts its kernels down)."""
    tmp = tmp_path_factory.mktemp("lab")
    for name, values in SETTINGS.items():
        path = tmp / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    # Opening a notebook starts no kernel (none is needed to show it; none can be left behind):
    # JupyterLab's page option notebookStartsKernel, read from labconfig/page_config.json.
    (tmp / "config" / "labconfig").mkdir(parents=True)
    (tmp / "config" / "labconfig" / "page_config.json").write_text(
        json.dumps({"notebookStartsKernel": "false"}))
    port, token = free_port(), secrets.token_hex(16)
    command = lab_command() + ["--port", str(port), "--ServerApp.port_retries=0", "--no-browser",
                               f"--IdentityProvider.token={token}"]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
           "JUPYTER_CONFIG_PATH": os.pathsep.join(filter(None, [
               str(tmp / "config"), os.environ.get("JUPYTER_CONFIG_PATH")]))}
    log = tmp / "lab.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_it_answers(proc, port, token, log)
        yield port, token
        assert get(port, "/api/shutdown", token, method="POST")[0] == 200
        assert proc.wait(timeout=STOP_TIMEOUT) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:  # a failure above: stop it all the same
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_lab_serves_every_image_the_notebooks_show(lab):
    port, token = lab
    refs = notebook_images()
    assert refs, "no notebook references an image"
    status, headers, _ = get(port, "/", token)  # what a browser opens: notebooks/
    assert (status, urlsplit(headers["Location"]).path) == (302, "/lab/tree/notebooks"), \
        (status, headers["Location"])
    for notebook, ref in refs:
        path = posixpath.normpath(posixpath.join("notebooks", ref))  # as JupyterLab resolves it
        status, headers, body = get(port, f"/files/{quote(path)}", token)
        assert status == 200, f"{notebook} shows {ref}: GET /files/{path} answered {status}"
        assert body.startswith(PNG_MAGIC) and body == (ROOT / path).read_bytes(), \
            f"{notebook} shows {ref}: /files/{path} is not the PNG in {path}"


# Every <img> of the open notebook: the markdown's diagrams and the outputs' plots.
IMAGES = """[...document.querySelectorAll(".jp-NotebookPanel .jp-Notebook img")].map(i => ({
  src: i.src, alt: i.alt, complete: i.complete, width: i.naturalWidth,
  markdown: !!i.closest(".jp-MarkdownCell")}))"""


@needs_browser
def test_jupyterlab_shows_a_notebooks_diagrams(lab, tmp_path):
    port, token = lab
    expected = sorted(posixpath.normpath(posixpath.join("notebooks", ref))
                      for name, ref in notebook_images() if name == NOTEBOOK)
    assert expected, f"{NOTEBOOK} shows no diagram"
    stored = (ROOT / "notebooks" / NOTEBOOK).read_bytes()
    with open(tmp_path / "chromium.log", "w") as log:
        chromium = Chromium(tmp_path / "profile", log)
    try:
        target = chromium.send("Target.createTarget",
                               url=f"http://127.0.0.1:{port}/lab/tree/notebooks/{NOTEBOOK}"
                                   f"?token={token}")
        session = chromium.send("Target.attachToTarget", targetId=target["targetId"],
                                flatten=True)["sessionId"]

        def shown():
            """(every <img>, the repository paths of the markdown's) of the open notebook."""
            images = chromium.send("Runtime.evaluate", session, expression=IMAGES,
                                   returnByValue=True)["result"].get("value") or []
            diagrams = [unquote(urlsplit(i["src"]).path) for i in images if i["markdown"]]
            return images, sorted(p.removeprefix("/files/") for p in diagrams)

        # JupyterLab renders asynchronously: wait until every diagram is in the page with its
        # link resolved to /files/ (JupyterLab's own resolution) and every image has finished
        # loading or failing; then judge. Bounded, as a hang must fail, not stall the tests.
        deadline = time.monotonic() + RENDER_TIMEOUT
        images, diagrams = shown()
        while not (len(diagrams) >= len(expected)
                   and all(i["complete"] for i in images)
                   and all(urlsplit(i["src"]).path.startswith("/files/")
                           for i in images if i["markdown"])):
            assert time.monotonic() < deadline, \
                f"{NOTEBOOK} in JupyterLab: not every diagram loaded within {RENDER_TIMEOUT} s: " \
                f"{[(i['src'][:80], i['complete'], i['width']) for i in images]}"
            time.sleep(0.2)
            images, diagrams = shown()
        # The screenshot before the checks, so a failure shows what a learner would see.
        chromium.send("Runtime.evaluate", session, expression=(
            'document.querySelector(".jp-MarkdownCell img").scrollIntoView({block: "center"})'))
        png = base64.b64decode(chromium.send("Page.captureScreenshot", session)["data"])
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        (SCREENSHOTS / (NOTEBOOK.removesuffix(".ipynb") + ".png")).write_bytes(png)
    finally:
        chromium.close()
    broken = [f"{i['src'][:80]} (shows its alt text: {i['alt'][:60]!r})"
              for i in images if i["width"] == 0]
    assert not broken, f"{NOTEBOOK} in JupyterLab: images that did not load:\n" + "\n".join(broken)
    assert diagrams == expected, (diagrams, expected)
    assert len(images) > len(diagrams)  # the stored plots too (data: URLs)
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000, "no screenshot"
    assert json.loads(get(port, "/api/kernels", token)[2]) == [], "opening it started a kernel"
    assert (ROOT / "notebooks" / NOTEBOOK).read_bytes() == stored, "JupyterLab saved the notebook"
