"""`make lab` shows every diagram, and opening a notebook leaves it unmodified.

The server `make lab` starts (one for this module, on a free port) answers 200 for each image a
notebook references (it served notebooks/, so ../images/ lay outside its root: every image 404).
Headless Chromium (tests/chromium.py; skipped where it is missing) opens one notebook in that
JupyterLab and finds every image loaded, with the links resolved by JupyterLab itself; a
screenshot is saved in build/lab-screenshots/.

Notebooks open clean: JupyterLab, when it opens a notebook, stores its kernel's kernelspec and
language_info in it; a notebook that stored other values is modified before a cell runs, and a
room of clones is dirty (git pull refuses). Through the server's API, each notebook is read,
given the metadata of a kernel the server started, and saved (to a copy): no byte may change.
And in the browser, JupyterLab itself opens each copy on that kernel and saves it: not marked
modified, no byte changed; a control copy with the old "Python 3" display name must come out
modified (so the check can fail). The copies lie in build/ and are removed.
"""
import asyncio
import base64
import http.client
import json
import os
import posixpath
import secrets
import shlex
import shutil
import socket
import subprocess
import time
import uuid
from urllib.parse import quote, unquote, urlsplit

import nbformat
import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from chromium import Chromium, needs_browser
from conftest import ROOT
from test_images import PNG_MAGIC, notebook_images

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


def get(port, path, token, method="GET", body=None, timeout=10):
    """(status, headers, body) of one request to the server, without following redirects;
    `body` is sent as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Authorization": f"token {token}"})
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
    # Opening a notebook starts no kernel (none is needed to show it; the open-clean test gives
    # each notebook the one kernel it started): JupyterLab's page option notebookStartsKernel,
    # read from labconfig/page_config.json.
    (tmp / "config" / "labconfig").mkdir(parents=True)
    (tmp / "config" / "labconfig" / "page_config.json").write_text(
        json.dumps({"notebookStartsKernel": "false"}))
    port, token = free_port(), secrets.token_hex(16)
    # window.jupyterapp: JupyterLab's app object, for the test's JavaScript.
    command = lab_command() + ["--port", str(port), "--ServerApp.port_retries=0", "--no-browser",
                               f"--IdentityProvider.token={token}",
                               "--LabApp.expose_app_in_browser=True"]
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
    # What a browser opens: notebooks/, or workspace/ once `make workspace` made it.
    opens = "/lab/tree/" + ("workspace" if list(ROOT.glob("workspace/*.ipynb")) else "notebooks")
    status, headers, _ = get(port, "/", token)
    assert (status, urlsplit(headers["Location"]).path) == (302, opens), \
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


async def _kernel_info(port, token, kernel_id) -> dict:
    """The kernel's kernel_info reply, asked over the server's websocket (the legacy JSON
    protocol: one message a frame), as JupyterLab asks it when it connects."""
    session, msg_id = uuid.uuid4().hex, uuid.uuid4().hex
    ws = await websocket_connect(HTTPRequest(
        f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels?session_id={session}",
        headers={"Authorization": f"token {token}"}, request_timeout=30))
    try:
        await ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "username": "test", "session": session,
                       "msg_type": "kernel_info_request", "version": "5.3",
                       "date": "2026-01-01T00:00:00.000000Z"},
            "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell",
            "buffers": []}))
        while True:
            message = await asyncio.wait_for(ws.read_message(), 60)
            assert message is not None, "the kernel's websocket closed"
            message = json.loads(message)
            if message.get("parent_header", {}).get("msg_id") == msg_id and \
                    message["header"]["msg_type"] == "kernel_info_reply":
                return message["content"]
    finally:
        ws.close()


@pytest.fixture(scope="module")
def kernel(lab):
    """(kernel id, the notebook metadata JupyterLab writes for it): one python3 kernel the
    server started, its kernelspec as JupyterLab stores it and its language_info."""
    port, token = lab
    status, _, body = get(port, "/api/kernels", token, "POST", {"name": "python3"}, timeout=60)
    assert status == 201, (status, body)
    kernel_id = json.loads(body)["id"]
    try:
        spec = json.loads(get(port, "/api/kernelspecs", token)[2])["kernelspecs"]["python3"]
        info = asyncio.run(_kernel_info(port, token, kernel_id))
        yield kernel_id, {"kernelspec": {"name": "python3",
                                         "display_name": spec["spec"]["display_name"],
                                         "language": spec["spec"]["language"]},
                          "language_info": info["language_info"]}
    finally:
        get(port, f"/api/kernels/{kernel_id}", token, "DELETE", timeout=30)


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CONTROL = "control_python3.ipynb"  # a copy of the first notebook, display name "Python 3"


@pytest.fixture
def copies():
    """A folder in build/ (inside what the server serves) with a copy of every notebook and the
    control; removed afterwards, with nothing else."""
    folder = ROOT / "build" / f"lab-open-clean-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    try:
        for path in NOTEBOOKS:
            shutil.copyfile(path, folder / path.name)
        nb = nbformat.read(NOTEBOOKS[0], as_version=4)
        nb.metadata.kernelspec.display_name = "Python 3"
        nbformat.write(nb, folder / CONTROL)
        yield folder
    finally:
        shutil.rmtree(folder)


def test_every_notebook_stores_what_jupyterlab_writes_on_open(lab, kernel, copies):
    """Read through the contents API, given the kernel's metadata, saved through the API: the
    same bytes (and the control, with another display name, changes)."""
    port, token = lab
    _, metadata = kernel
    changed = []
    for path in [*(copies / p.name for p in NOTEBOOKS), copies / CONTROL]:  # copies: no race
        rel = path.relative_to(ROOT).as_posix()
        status, _, body = get(port, f"/api/contents/{quote(rel)}?type=notebook&content=1", token)
        assert status == 200, (rel, status)
        model = json.loads(body)
        model["content"]["metadata"].update(metadata)
        saved = copies / f"saved_{path.name}"
        target = saved.relative_to(ROOT).as_posix()
        status, _, body = get(port, f"/api/contents/{quote(target)}", token, "PUT",
                              {"type": "notebook", "format": "json",
                               "content": model["content"]}, timeout=60)
        assert status in (200, 201), (target, status, body[:300])
        if saved.read_bytes() != path.read_bytes():
            changed.append(path.name)
    assert changed == [CONTROL], (
        f"opening these in JupyterLab modifies them: {changed[:-1]}; store its metadata with "
        f"python -m distkit.course.record --metadata notebooks/*.ipynb ({metadata})")


def test_record_metadata_stores_what_jupyterlab_writes(kernel, copies):
    """The tool that normalises the notebooks (python -m distkit.course.record --metadata)
    turns the control (old display name) into exactly the bytes of a clean notebook, with the
    kernel metadata the server reported; a second run changes nothing."""
    from distkit.course import record
    _, metadata = kernel
    control = copies / CONTROL
    assert record.normalise_metadata([control], metadata) == [control]
    assert control.read_bytes() == (copies / NOTEBOOKS[0].name).read_bytes()
    assert record.normalise_metadata([control], metadata) == []


# In JupyterLab: open one notebook, give it the test's kernel (JupyterLab then stores that
# kernel's kernelspec and language_info, as when it starts one on open), save it, close it.
OPEN_AND_SAVE = """(async () => {
  const app = window.jupyterapp;
  const panel = await app.commands.execute("docmanager:open", {path: %s, factory: "Notebook"});
  await panel.context.ready;
  await panel.sessionContext.ready;
  await panel.sessionContext.changeKernel({id: %s});
  const kernel = panel.sessionContext.session.kernel;
  await kernel.spec;
  await kernel.info;
  await new Promise(done => setTimeout(done, 300));  // the panel's metadata updates
  const dirty = panel.model.dirty;
  const metadata = {kernelspec: panel.model.getMetadata("kernelspec"),
                    language_info: panel.model.getMetadata("language_info")};
  await panel.context.save();
  panel.dispose();
  return {dirty, metadata};
})()"""


@needs_browser
def test_jupyterlab_opens_and_saves_every_notebook_unchanged(lab, kernel, copies, tmp_path):
    port, token = lab
    kernel_id, metadata = kernel
    names = [CONTROL, *(p.name for p in NOTEBOOKS)]  # the control first: the wait suffices
    before = {name: (copies / name).read_bytes() for name in names}
    with open(tmp_path / "chromium.log", "w") as log:
        chromium = Chromium(tmp_path / "profile", log)
    try:
        session = chromium.open(f"http://127.0.0.1:{port}/lab?token={token}")
        chromium.wait_for(session, "!!window.jupyterapp && window.jupyterapp.restored"
                                   ".then(() => true)", RENDER_TIMEOUT, "JupyterLab starting")
        results = {}
        for name in names:
            path = (copies / name).relative_to(ROOT).as_posix()
            results[name] = chromium.evaluate(
                session, OPEN_AND_SAVE % (json.dumps(path), json.dumps(kernel_id)),
                timeout=RENDER_TIMEOUT)
    finally:
        chromium.close()
    control = results.pop(CONTROL)
    assert control["dirty"] and (copies / CONTROL).read_bytes() != before[CONTROL], \
        "the control (display name 'Python 3') was not modified: the check cannot fail"
    assert control["metadata"] == metadata  # JupyterLab wrote what the API test expects
    modified = [name for name, r in results.items() if r["dirty"]]
    rewritten = [name for name in results if (copies / name).read_bytes() != before[name]]
    assert not modified and not rewritten, (
        f"JupyterLab marks these modified on open: {modified}; saving rewrites {rewritten}; "
        "store its metadata with python -m distkit.course.record --metadata notebooks/*.ipynb")


def make_in(folder, *args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=30)


def test_make_workspace_copies_the_notebooks_and_keeps_a_learners_copies(tmp_path):
    """A participant's own copies, in a folder git ignores: the clone stays as it came. A copy
    they have (edited, run) is never replaced; `make lab` then opens workspace/."""
    shutil.copyfile(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "notebooks").mkdir()
    for name in ("00_a.ipynb", "01_b.ipynb"):
        (tmp_path / "notebooks" / name).write_text(f"{name}\n")
    assert "default_url=/lab/tree/notebooks" in make_in(tmp_path, "-s", "print-LAB_COMMAND").stdout
    proc = make_in(tmp_path, "workspace")
    assert proc.returncode == 0 and proc.stdout.splitlines() == [
        "make workspace: copied notebooks/00_a.ipynb",
        "make workspace: copied notebooks/01_b.ipynb"]
    (tmp_path / "workspace" / "00_a.ipynb").write_text("my work\n")
    (tmp_path / "workspace" / "01_b.ipynb").unlink()  # deleted: the course's version comes back
    proc = make_in(tmp_path, "workspace")
    assert proc.stdout.splitlines() == ["make workspace: kept your workspace/00_a.ipynb",
                                        "make workspace: copied notebooks/01_b.ipynb"]
    assert (tmp_path / "workspace" / "00_a.ipynb").read_text() == "my work\n"
    assert (tmp_path / "workspace" / "01_b.ipynb").read_text() == "01_b.ipynb\n"
    assert "default_url=/lab/tree/workspace" in make_in(tmp_path, "-s", "print-LAB_COMMAND").stdout
    # git ignores the copies (and a notebook that is run there changes nothing git tracks).
    ignored = subprocess.run(["git", "check-ignore", "-q", "workspace/00_torchrun.ipynb"],
                             cwd=ROOT, timeout=30)
    assert ignored.returncode == 0, "workspace/ is not in .gitignore"


def test_make_lab_turns_off_the_news_question(tmp_path):
    """JupyterLab's "get notified about Jupyter news?" toast covers the notebook's corner on a
    projector: make lab sets the environment's default to no news (overrides.json, which
    JupyterLab applies to its settings' defaults), once; a file already there is kept."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "jupyter").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "jupyter").chmod(0o755)
    proc = make_in(ROOT, "-o", f"{venv}/.installed", "lab", f"VENV={venv}")
    assert proc.returncode == 0, proc.stderr
    overrides = venv / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
    assert json.loads(overrides.read_text()) == {
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}}
    overrides.write_text("{}")
    assert make_in(ROOT, "-o", f"{venv}/.installed", "lab", f"VENV={venv}").returncode == 0
    assert overrides.read_text() == "{}"
