"""`make site`: the course as a static website, built from the notebooks' stored outputs.

One build (in a temporary folder) serves every check: its time, every internal link and picture,
every formula converted to MathML, each chapter page's diagram, summary and pager, the licence
footer, nothing fetched from the network; then headless Chromium (Debian's package; skipped
where it is missing) opens two pages, checks that the math is typeset and the pictures loaded,
and saves screenshots in build/site-screenshots/.
"""
import html
import json
import os
import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from distkit.course import site

BUILD_CPU_S = 60  # `make site` must take under a minute; CPU-s, as wall time here is shared
BROWSER_PAGES = ["notebooks/01_data_parallel_ddp.html", "notebooks/03_zero_memory_math.html"]
SCREENSHOTS = ROOT / "build" / "site-screenshots"


class Page(HTMLParser):
    """The links, ids and text outside code of one page."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.links, self.ids, self.text, self.tags, self.in_code = [], set(), [], [], 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        self.in_code += tag in ("code", "pre", "math")
        self.ids.update(v for k, v in attrs.items() if k in ("id", "name") and v)
        self.links += [(tag, k, v) for k, v in attrs.items() if k in ("href", "src") and v]

    def handle_endtag(self, tag):
        self.in_code -= tag in ("code", "pre", "math") and self.in_code > 0

    def handle_data(self, data):
        if not self.in_code:
            self.text.append(data)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    t0, c0 = time.perf_counter(), time.process_time()
    result = site.build(out)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"site built: {len(result.pages)} pages in {wall:.1f} s ({cpu:.1f} CPU-s)")
    assert cpu < BUILD_CPU_S, f"make site took {cpu:.0f} CPU-s (limit {BUILD_CPU_S})"
    pages = {p: Page((out / p).read_text(encoding="utf-8")) for p in result.pages}
    return out, result, pages


def test_every_formula_converts_to_mathml(built):
    _, result, _ = built
    assert len(result.formulas) > 100  # the notebooks' $...$ and $$...$$ were all seen
    failed = [f"{f.source}: ${f.tex}$ ({f.error})" for f in result.formulas if f.error]
    assert not failed, "latex2mathml could not convert:\n" + "\n".join(failed)


def test_a_formula_latex2mathml_cannot_convert_is_reported():
    with pytest.raises(site.MathError, match="unknown command"):
        site.tex_to_mathml(r"\notacommand{x}", display=False)
    assert "<mfrac>" in site.tex_to_mathml(r"\frac{N-1}{N}", display=True)


def test_every_internal_link_and_picture_resolves(built):
    out, _, pages = built
    broken = []
    for name, page in pages.items():
        for tag, attr, url in page.links:
            if re.match(r"[a-z][a-z0-9+.-]*:", url):
                # Nothing is loaded from elsewhere (no CDN): only plain links leave the site.
                if tag != "a" and not url.startswith("data:"):
                    broken.append(f"{name}: <{tag} {attr}> loads {url}")
                continue
            path, _, fragment = url.partition("#")
            target = (out / name).parent / path if path else out / name
            rel = os.path.relpath(target, out)
            if not target.is_file():
                broken.append(f"{name}: {url} (no {rel})")
            elif fragment and rel in pages and fragment not in pages[rel].ids:
                broken.append(f"{name}: {url} (no id {fragment!r} in {rel})")
    assert not broken, "\n".join(broken)


def test_no_raw_math_and_code_is_monospace(built):
    out, _, pages = built
    raw = [name for name, page in pages.items() if "$$" in "".join(page.text)]
    assert not raw, f"raw $$ left in the text of {raw}"
    css = (out / "site.css").read_text()
    assert re.search(r"code, pre[^{]*\{[^}]*monospace", css)


def test_every_page_has_the_licence_footer_and_navigation(built):
    out, _, pages = built
    for name, page in pages.items():
        footer = (out / name).read_text(encoding="utf-8").split("<footer>", 1)[-1]
        assert "MIT licence" in footer and "CC BY 4.0" in footer, f"{name}: no licence footer"
        assert re.search(r'href="(\.\./)*LICENSE\.html"', footer), name
        links = {v for _, _, v in page.links}
        assert any(v.endswith("index.html") for v in links), f"{name}: no link home"


def test_chapter_pages_open_with_diagram_summary_and_pager(built):
    out, result, pages = built
    assert len(result.chapters) == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
    for i, chapter in enumerate(result.chapters):
        name = site.site_path(chapter.path)
        text = (out / name).read_text(encoding="utf-8")
        head = text.split('<section class="chapter-head">', 1)[1].split("</section>", 1)[0]
        picture = Path(chapter.diagram).name
        assert chapter.diagram and f'src="../images/{picture}"' in head, name
        assert head.index("<img") < head.index("What you will see measured")
        lines = re.findall(r"<li>(.*?)</li>", head, re.S)
        assert 3 <= len(lines) <= site.SUMMARY_LINES, f"{name}: {len(lines)} summary lines"
        # Prev/next in course order, and every exercise's starter and solution linked.
        rels = {v for _, _, v in pages[name].links}
        for j in (i - 1, i + 1):
            if 0 <= j < len(result.chapters):
                assert Path(site.site_path(result.chapters[j].path)).name in rels, name
        for starter, solution in chapter.exercises:
            assert "../" + site.site_path(starter) in rels, f"{name}: no link to {starter}"
            assert "../" + site.site_path(solution) in rels, f"{name}: no link to {solution}"


def test_exercise_files_are_pages_with_highlighted_code(built):
    out, result, _ = built
    pairs = [pair for c in result.chapters for pair in c.exercises]
    assert pairs
    for starter, solution in pairs:
        for path in (starter, solution):
            page = (out / site.site_path(path)).read_text(encoding="utf-8")
            assert re.search(r'<span class="kn?">(import|def)</span>', page), f"{path}: plain"
            code = page.split('<div class="highlight">', 1)[1].split("</div>", 1)[0]
            code = re.sub(r'<span class="linenos">.*?</span>|<[^>]+>', "", code)
            assert html.unescape(code).strip() == (ROOT / path).read_text().strip(), path


def browser() -> str:
    """Chromium: SITE_BROWSER (the GitHub workflow's), else Debian's package on PATH."""
    names = (os.environ.get("SITE_BROWSER", ""), "chromium", "chromium-browser", "google-chrome")
    return next(filter(None, map(shutil.which, filter(None, names))), "")


# Run in the page once it has loaded: what the checks need, written into the DOM for --dump-dom.
CHECK_SCRIPT = """<script>
window.addEventListener("load", () => {
  const maths = [...document.querySelectorAll("math")];
  const prose = document.body.cloneNode(true);
  prose.querySelectorAll("pre, code, math, script").forEach(e => e.remove());
  const result = {
    math: maths.length,
    typeset: maths.filter(m => m instanceof MathMLElement && m.getBoundingClientRect().height > 0).length,
    raw_dollars: prose.textContent.includes("$$"),
    images: document.images.length,
    broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
                                .map(i => i.src.slice(0, 80)),
  };
  const pre = document.createElement("pre");
  pre.id = "site-check";
  pre.textContent = JSON.stringify(result);
  document.body.appendChild(pre);
});
</script>"""


@pytest.mark.skipif(not browser(), reason="no Chromium (Debian: apt-get install chromium): "
                    "the site's browser test skips")
def test_browser_shows_typeset_math_and_every_picture(built):
    out, _, _ = built
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name in BROWSER_PAGES:
        page = out / name
        probe = page.with_name("_check_" + page.name)  # same folder: relative URLs still work
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", CHECK_SCRIPT
                                                                 + "</body>"), encoding="utf-8")
        shot = SCREENSHOTS / (page.stem + ".png")
        proc = subprocess.run(
            [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size=1280,1600", "--virtual-time-budget=10000", f"--screenshot={shot}",
             "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
        found = re.search(r'<pre id="site-check">(.*?)</pre>', proc.stdout)
        assert found, f"{name}: no result from Chromium (rc {proc.returncode}): {proc.stderr[-500:]}"
        result = json.loads(html.unescape(found.group(1)))
        assert result["math"] > 10 and result["typeset"] == result["math"], (name, result)
        assert not result["raw_dollars"], name
        assert result["images"] >= 2 and not result["broken"], (name, result)
        assert shot.stat().st_size > 10_000, f"{shot}: no screenshot"


def test_make_site_and_ci_publish_it():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "-n", "-o", ".venv/.installed", "site"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout.splitlines()[-1] == ".venv/bin/python -m distkit.course.site build/site"
    # .ci/run installs Debian's chromium (when root with apt-get) before the tests run.
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("apt-get install -y -qq chromium") < ci.index("make test")
    # The Pages workflow builds with `make site` and deploys build/site in a job of its own.
    jobs = yaml.safe_load((ROOT / ".github" / "workflows" / "pages.yml").read_text())["jobs"]
    build = jobs["build"]["steps"]
    assert [s["run"] for s in build if "run" in s] == ["make site"]
    assert [s["with"]["path"] for s in build if "upload-pages-artifact" in s.get("uses", "")] == [
        "build/site"]
    assert jobs["deploy"]["needs"] == "build"
    assert jobs["deploy"]["permissions"] == {"pages": "write", "id-token": "write"}
    assert [s["uses"].split("@")[0] for s in jobs["deploy"]["steps"]] == ["actions/deploy-pages"]
