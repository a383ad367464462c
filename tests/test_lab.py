"""`make lab` shows every diagram: the server it starts answers 200 for each image a notebook
references (served from notebooks/, ../images/ lay outside the server's root: every image 404)."""
import http.client
import os
import posixpath
import secrets
import shlex
import socket
import subprocess
import time
from urllib.parse import quote, urlsplit

from conftest import ROOT
from test_images import PNG_MAGIC, notebook_images

START_TIMEOUT = 60  # s for the server to answer: ~7 CPU-s to start here, far more under load
STOP_TIMEOUT = 20   # s to shut down after /api/shutdown


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


def test_lab_serves_every_image_the_notebooks_show(tmp_path):
    refs = notebook_images()
    assert refs, "no notebook references an image"
    port, token = free_port(), secrets.token_hex(16)
    command = lab_command() + ["--port", str(port), "--ServerApp.port_retries=0", "--no-browser",
                               f"--IdentityProvider.token={token}"]
    log = tmp_path / "lab.log"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_it_answers(proc, port, token, log)
        status, headers, _ = get(port, "/", token)  # what a browser opens: notebooks/
        assert (status, urlsplit(headers["Location"]).path) == (302, "/lab/tree/notebooks"), \
            (status, headers["Location"])
        for notebook, ref in refs:
            path = posixpath.normpath(posixpath.join("notebooks", ref))  # as JupyterLab resolves it
            status, headers, body = get(port, f"/files/{quote(path)}", token)
            assert status == 200, f"{notebook} shows {ref}: GET /files/{path} answered {status}"
            assert body.startswith(PNG_MAGIC) and body == (ROOT / path).read_bytes(), \
                f"{notebook} shows {ref}: /files/{path} is not the PNG in {path}"
        assert get(port, "/api/shutdown", token, method="POST")[0] == 200
        assert proc.wait(timeout=STOP_TIMEOUT) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:  # a failure above: stop it all the same
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
