"""`make site`: the course as a static website, built from the notebooks' stored outputs.

One build (in a temporary folder) serves every check: its time, every internal link and picture,
every formula converted to MathML and none garbled, each output one block, the home page a
learner's start page read from the notebooks (never the README), each chapter page's header,
pager and exercises, the licence footer, nothing fetched from the network, tables' rows kept
whole, the glossary's chapters linked. Then headless Chromium (tests/chromium.py; skipped where it
is missing) opens the home page and chapters 03 and 06, checks that the math is typeset and not
cut off and the pictures loaded, and screenshots chapter 03's per-rank bytes formula and chapter
06's `--help` output into build/site-screenshots/; and checks the pages at a phone's 400 px (no
sideways scrolling), chapter 10's schedule table (rows whole) and printing (nothing cut).
Without a build: where the home page finds the address to clone from.
"""
import html
import os
import re
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import yaml

from chromium import Chromium, needs_browser
from conftest import ROOT
from distkit.course import chapters as chapter_meta
from distkit.course import site

BUILD_CPU_S = 60  # `make site` must take under a minute; CPU-s, as wall time here is shared
SCREENSHOTS = ROOT / "build" / "site-screenshots"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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


metas: dict = {}  # notebook name -> distkit.course.chapters.Chapter, filled by `built`


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    # What distkit.course.chapters reads from each notebook, just before the build (the tests
    # compare the pages with it; read later, a notebook being edited meanwhile would differ).
    metas.update({p.name: chapter_meta.read(p)
                  for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))})
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
    assert not failed, "latex2mathml could not convert, or garbled:\n" + "\n".join(failed)


def test_every_environment_the_course_uses_is_typeset_as_rows(built):
    """Each \\begin{env} in a formula of the site (notebooks, README, docs), and the usual ones
    besides, becomes a MathML table with one row per line; none leaves a literal & or a line
    break browsers ignore."""
    _, result, _ = built
    used = {env for f in result.formulas for env in re.findall(r"\\begin\{([A-Za-z*]+)\}", f.tex)}
    assert "aligned" in used  # chapter 03's per-rank bytes
    known = {"aligned", "align*", "split", "gathered", "cases", "array", "matrix", "pmatrix",
             "bmatrix", "vmatrix", "alignedat", "eqnarray"}
    assert used <= known, f"an environment no test has typeset: {used - known} (add it here)"
    for env in sorted(known):
        arg = {"array": "{rl}", "alignedat": "{2}"}.get(env, "")
        tex = rf"\begin{{{env}}}{arg} a & = b + c \\ d & = e \end{{{env}}}"
        mathml = site.tex_to_mathml(tex, display=True)
        assert mathml.count("<mtr") == 2 and "&" not in re.sub(r"&#x[0-9A-F]+;", "", mathml), \
            (env, mathml)


def test_a_formula_the_converter_cannot_convert_or_would_garble_is_reported(monkeypatch):
    with pytest.raises(site.MathError, match="unknown command"):
        site.tex_to_mathml(r"\notacommand{x}", display=False)
    assert "<mfrac>" in site.tex_to_mathml(r"\frac{N-1}{N}", display=True)
    # latex2mathml's own output for an environment it does not know: a literal & and a line
    # break that MathML Core ignores (chapter 03's formula read "DDP: &(2+2+K)Ψ ZeRO-1..." so).
    monkeypatch.setattr(site, "ENVIRONMENTS", {})
    with pytest.raises(site.MathError, match="garbled: a literal &"):
        site.tex_to_mathml(r"\begin{aligned} a &= b \\ c &= d \end{aligned}", display=True)
    with pytest.raises(site.MathError, match="garbled: a line break"):
        site.tex_to_mathml(r"\begin{gathered} a = b \\ c = d \end{gathered}", display=True)
    assert "<mi>&#x00026;</mi>" in site.tex_to_mathml(r"a \& b", display=False)  # a written &
    # In \text{} and \texttt{}, an escaped character is that character (not a backslash).
    assert "<mtext>R&amp;D all_reduce</mtext>" in site.tex_to_mathml(
        r"\text{R\&D all\_reduce}", display=False).replace("&#x000A0;", " ")
    with pytest.raises(site.MathError, match="unknown command"):
        site.tex_to_mathml(r"\text{a \b}", display=False)


def test_chapter_03s_per_rank_bytes_are_four_aligned_rows(built):
    out, _, _ = built
    text = (out / "notebooks" / "03_zero_memory_math.html").read_text(encoding="utf-8")
    formula = next((m for m in re.findall(r'<math display="block".*?</math>', text, re.S)
                    if "ZeRO-3" in m), "")
    assert formula, "chapter 03's per-rank bytes formula (DDP and ZeRO-1/2/3) is not MathML"
    rows = re.findall(r"<mtr>(.*?)</mtr>", formula, re.S)
    assert [re.search(r"DDP|ZeRO-\d", r).group(0) for r in rows] == [
        "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"], formula[:500]
    assert all(r.count("<mtd") == 2 for r in rows)  # label | bytes, aligned at the &


def stream_runs(page: str) -> list[str]:
    """Each output block of a page: its consecutive outputs, as 'stdout', 'stderr' or other."""
    runs = []
    for block in page.split('<div class="output_wrapper">')[1:]:
        kinds = re.findall(r'<div class="([^"]*\boutput_subarea\b[^"]*)"', block.split(
            '<div class="cell ', 1)[0])
        runs.append([re.search(r"output_(stdout|stderr)", k).group(1)
                     if "output_stream" in k else "other" for k in kinds])
    return runs


def test_each_cells_printed_output_is_one_block(built):
    """A launch stores each line it flushed as an output of its own; the site shows a cell's
    consecutive stream outputs as one block, as JupyterLab does (62 cells were stacks of
    one-line boxes, 92 boxes for chapter 06's --help)."""
    out, result, _ = built
    split = []
    for chapter in result.chapters:
        page = (out / site.site_path(chapter.path)).read_text(encoding="utf-8")
        for i, kinds in enumerate(stream_runs(page)):
            if any(a == b != "other" for a, b in zip(kinds, kinds[1:])):
                split.append(f"{chapter.path}: output {i}: {kinds}")
    assert not split, "outputs shown as several blocks:\n" + "\n".join(split)
    # The notebooks do store split outputs (so the check above has something to catch).
    nb = nbformat.read(ROOT / "notebooks" / "06_capstone_llama_fsdp2.ipynb", as_version=4)
    assert max(len(c.get("outputs", [])) for c in nb.cells) > 10


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


def test_home_page_is_a_learners_start_page_from_the_notebooks(built):
    out, result, pages = built
    home = (out / "index.html").read_text(encoding="utf-8")
    text = " ".join("".join(pages["index.html"].text).split())
    for heading in ("Who it is for", "How to start", "The path"):
        assert f"<h2>{heading}</h2>" in home, heading
    for command in ("make check", "make lab", "make workspace"):
        assert command in home, command
    # The path: every chapter, in order, linked, with its promise and reading time as
    # distkit.course.chapters reads them from the notebook's first cell.
    rows = re.findall(r"<tr><td>(\d\d)</td><td><a href=\"([^\"]+)\">.*?</td>\s*<td>(.*?)</td>"
                      r"<td>(\d+)&nbsp;min</td></tr>", home, re.S)
    chapters = [metas[Path(c.path).name] for c in result.chapters]
    assert [(n, h, int(m)) for n, h, _, m in rows] == [
        (c.number, site.site_path(str(c.path.relative_to(ROOT))), c.minutes) for c in chapters]
    for (_, _, promise, _), meta in zip(rows, chapters):
        words = re.sub(r"<[^>]+>", "", html.unescape(promise)).split()
        assert bool(words) == bool(meta.promise) and words[:3] == re.sub(
            r"[`*]", "", meta.promise).split()[:3], (promise, meta.promise)
    assert f"About {sum(c.minutes for c in chapters)} minutes of reading" in text
    # Not the maintainers' page: no test-suite timings.
    for noise in ("CPU-s", "make stress", "nbval", "passed"):
        assert noise not in text, f"the home page mentions {noise!r}"


def test_tables_keep_their_rows_and_the_glossary_links_its_chapters(built):
    """A table's rows (aligned columns) each in one <span class="row">, kept whole by site.css
    (chapter 10's schedule table wrapped every row in two); a traceback or a sentence is no
    table and wraps. The glossary's "Chapter 03." links to chapter 03's page."""
    out, _, _ = built
    ch10 = (out / "notebooks" / "10_float8_schedules_3d.html").read_text(encoding="utf-8")
    rows = re.findall(r'<span class="row">(ZBVZeroBubble .*?)</span>', ch10)
    assert any("peak micro-batches in flight per rank [" in r for r in rows), rows
    ch07 = (out / "notebooks" / "07_when_things_go_wrong.html").read_text(encoding="utf-8")
    assert "File &quot;" in ch07 or 'File "' in ch07  # tracebacks are there, and none is a row:
    assert not re.search(r'<span class="row">[^<]*(File &quot;|File "|Traceback)', ch07)
    assert site.table_rows(["a   b   c", "dd  e   f", "g   h   i", "a sentence."]) == {0, 1, 2}
    assert site.table_rows(['[rank0]:   File "x.py", line 1'] * 5) == set()  # one gap: no table
    css = (out / "site.css").read_text()
    assert re.search(r"\.output_area pre \.row \{ white-space: pre; \}", css)
    glossary = (out / "docs" / "glossary.html").read_text(encoding="utf-8")
    linked = re.findall(r'<a href="\.\./notebooks/(\d\d)_[^"]+\.html">(?:[Cc]hapters? )?\d\d</a>',
                        glossary)
    plain = re.findall(r"[Cc]hapters? \d\d", re.sub(r"<a [^>]*>.*?</a>|<code>.*?</code>", "",
                                                    glossary, flags=re.S))
    assert len(linked) > 50 and not plain, plain
    assert '<code>chapter 03</code>' in site.link_chapters(
        "<code>chapter 03</code>", lambda n: "x")  # never inside code


def test_exercises_page_lists_each_exercise_by_its_id(built):
    """The exercises page in the ids' order, each id the one `make exercise EX=...` takes for that
    starter (the checker's registry), with the instructor's guide's minutes; chapter pages name
    the ids too. (It listed files by name without ids: 00's first row was exercise 00.3.)"""
    from distkit.course.exercise import load_registry
    out, result, _ = built
    page = (out / "exercises.html").read_text(encoding="utf-8")
    rows = re.findall(r'<tr><td>([^<]*)</td><td><a href="[^"]*">\d\d</a></td><td><a href="[^"]*">'
                      r'<code>([^<]+)</code></a></td><td>.*?</td><td>(\d*)</td>', page)
    registry = {ex.id: Path(ex.starter).name for ex in load_registry().values()}
    assert [(ex_id, name) for ex_id, name, _ in rows] == sorted(registry.items())
    minutes = dict(re.findall(r"^\| (\d\d\.\d+) \|[^|]*\| (\d+) \|", (
        ROOT / "docs" / "workshop.md").read_text(), re.M))
    assert minutes and all(m == minutes.get(ex_id, "") for ex_id, _, m in rows), rows
    ch00 = (out / "notebooks" / "00_torchrun_and_collectives.html").read_text(encoding="utf-8")
    assert re.search(r"Exercises:\s*00\.1 <a [^>]*><code>ex00_naive_allreduce\.py</code>", ch00)


def test_the_address_to_clone_from(tmp_path):
    """CITATION.cff's repository-code, else the GitHub Actions run that builds the published site,
    else the clone's origin; as an https address without credentials; "" when none says."""
    assert site.public_url("git@github.com:me/course.git") == "https://github.com/me/course"
    assert site.public_url("https://me:token@github.com/me/course.git/") == \
        "https://github.com/me/course"  # a credential in a remote never reaches a page
    assert site.public_url("/srv/git/course") == "" and site.public_url("") == ""
    cff = tmp_path / "CITATION.cff"
    cff.write_text('cff-version: 1.2.0\n# repository-code: "https://github.com/OWNER/REPO"\n')
    assert site.repository_url(tmp_path, {}) == ""  # a comment is no address, and no git here
    actions = {"GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "me/course"}
    assert site.repository_url(tmp_path, actions) == "https://github.com/me/course"
    git = ["git", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["remote", "add", "origin", "git@example.org:me/course.git"], check=True)
    assert site.repository_url(tmp_path, {}) == "https://example.org/me/course"
    cff.write_text('cff-version: 1.2.0\nrepository-code: "https://github.com/us/course"\n')
    assert site.repository_url(tmp_path, actions) == "https://github.com/us/course"  # it wins


def test_home_page_shows_the_clone_command_when_the_address_is_known(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(FIRST_CELL)])
    nbformat.write(nb, tmp_path / "notebooks" / "42_full.ipynb")
    (tmp_path / "CITATION.cff").write_text('repository-code: "https://github.com/us/course"\n')
    site.build(tmp_path / "site", root=tmp_path)
    home = (tmp_path / "site" / "index.html").read_text()
    assert "<code>git clone https://github.com/us/course\ncd course\nmake check" in home
    chapter = (tmp_path / "site" / "notebooks" / "42_full.html").read_text()
    assert 'repository: <a href="https://github.com/us/course">' in chapter.split("<footer>")[1]
    (tmp_path / "CITATION.cff").unlink()  # no address anywhere: the sentence without it
    for name in ("GITHUB_REPOSITORY", "GITHUB_SERVER_URL"):
        monkeypatch.delenv(name, raising=False)
    site.build(tmp_path / "site", root=tmp_path)
    home = (tmp_path / "site" / "index.html").read_text()
    assert "git clone" not in home and "in a clone of the course's repository" in home


FIRST_CELL = """# 42 · A chapter in full

**In one line:** shard `everything` and prove it.

**You will be able to**
1. shard a model;
2. prove it trains the same;
3. say what it costs.

**Prerequisites:** chapter 41.

**Reading time:** about 5 minutes (the rate).

The chapter's introduction starts here.
"""


def test_a_site_from_notebooks_alone_without_the_readme(tmp_path):
    """The site needs no README: a repository with two notebooks, one whose first cell has the
    labelled parts and one with only a title, builds; the header shows what each cell has and
    the body keeps the rest."""
    (tmp_path / "notebooks").mkdir()
    for name, first in [("42_full", FIRST_CELL), ("43_bare", "# 43 · Only a title\n\nIntro.")]:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(first),
                                             nbformat.v4.new_code_cell("print(1)")])
        nbformat.write(nb, tmp_path / "notebooks" / f"{name}.ipynb")
    out = tmp_path / "site"
    result = site.build(out, root=tmp_path)
    assert not (tmp_path / "README.md").exists() and "README.html" not in result.pages
    full = (out / "notebooks" / "42_full.html").read_text()
    head, body = full.split("</section>", 1)
    assert '<p class="promise">shard <code>everything</code> and prove it.</p>' in head
    assert len(re.findall(r"<li>", head)) == 3 and "chapter 41" in head
    assert "In one line" not in body and "The chapter's introduction starts here." in body
    bare = (out / "notebooks" / "43_bare.html").read_text()
    head, body = bare.split("</section>", 1)
    assert "<h1>43 · Only a title</h1>" in head and "promise" not in head and "<li>" not in head
    minutes = chapter_meta.read(tmp_path / "notebooks" / "43_bare.ipynb").minutes
    assert "Intro." in body and f"about {minutes} minutes" in head
    home = (out / "index.html").read_text()
    assert "42_full.html" in home and "43_bare.html" in home


def test_chapter_pages_open_with_their_first_cell_diagram_and_pager(built):
    out, result, pages = built
    assert [Path(c.path).name for c in result.chapters] == list(metas)  # every notebook
    for i, chapter in enumerate(result.chapters):
        name = site.site_path(chapter.path)
        text = (out / name).read_text(encoding="utf-8")
        head, body = text.split('<section class="chapter-head">', 1)[1].split("</section>", 1)
        meta = metas[Path(chapter.path).name]
        assert f"about {meta.minutes} minutes" in head, name
        assert ('class="promise"' in head) == bool(meta.promise), name
        assert len(re.findall(r"<li>", head)) == len(meta.outcomes), name
        first_cell = body.split('<div class="cell ', 2)[1]
        for key in chapter.shown:  # what the header shows, the body does not repeat
            label = site.LABELS[key].strip("*")
            assert label not in first_cell, f"{name}: {label} in the header and the body"
        picture = Path(chapter.diagram).name
        assert chapter.diagram and f'src="../images/{picture}"' in head, name
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


# Every page's checks, in the page: math typeset (a MathML element with a height), none with an
# alignment & as a symbol or a backslash in its text, none wider than its column (cut off, or a
# scroll bar); no output line cut at its column (they wrap, as in JupyterLab; only a table's rows
# are kept whole, and scroll); pictures loaded.
PAGE_CHECKS = r"""(() => {
  const maths = [...document.querySelectorAll("math")];
  const prose = document.body.cloneNode(true);
  prose.querySelectorAll("pre, code, math, script").forEach(e => e.remove());
  return {
    math: maths.length,
    typeset: maths.filter(m => m instanceof MathMLElement
                               && m.getBoundingClientRect().height > 0).length,
    garbled: maths.filter(m => m.textContent.includes("\\")
                               || [...m.querySelectorAll("mi, mo, mn")]
                                  .some(t => t.textContent.trim() === "&"))
                  .map(m => m.textContent.slice(0, 80)),
    cut_off: maths.filter(m => m.getAttribute("display") === "block"
                               && m.scrollWidth > m.clientWidth + 1)
                  .map(m => m.textContent.slice(0, 60)),
    outputs_cut: [...document.querySelectorAll(".output_area pre")]
                 .filter(p => p.scrollWidth > p.clientWidth + 1
                              && ![...p.querySelectorAll(".row")]  // a table's row scrolls
                                  .some(r => r.getBoundingClientRect().width > p.clientWidth
                                        - parseFloat(getComputedStyle(p).paddingLeft)
                                        - parseFloat(getComputedStyle(p).paddingRight) - 1))
                 .map(p => p.textContent.slice(0, 60)),
    raw_dollars: prose.textContent.includes("$$"),
    images: document.images.length,
    broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0))
                                .map(i => i.src.slice(0, 80)),
  };
})()"""
# The rectangle (page coordinates) of an element, found by a JavaScript expression.
RECT = """(() => {{ const e = {}; if (!e) return null; e.scrollIntoView({{block: "center"}});
  const r = e.getBoundingClientRect();
  return {{x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height}}; }})()"""
FORMULA_03 = ('[...document.querySelectorAll("math[display=block]")].find('
              'm => m.textContent.includes("ZeRO-3"))')
HELP_06 = ('[...document.querySelectorAll(".code_cell")].find(c => c.querySelector(".input")'
           '.textContent.includes(\'"--help"\'))')


def padded(rect, pad=8):
    return {"x": max(0, rect["x"] - pad), "y": max(0, rect["y"] - pad),
            "width": rect["width"] + 2 * pad, "height": rect["height"] + 2 * pad}


@needs_browser
def test_browser_shows_typeset_math_one_block_outputs_and_every_picture(built, tmp_path):
    out, _, _ = built
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "chromium.log", "w") as log:
        chromium = Chromium(tmp_path / "profile", log, size=(1280, 1000))
    try:
        results = {}
        for name in ["index.html", "notebooks/03_zero_memory_math.html",
                     "notebooks/06_capstone_llama_fsdp2.html"]:
            url = (out / name).as_uri()
            session = chromium.open(url)
            chromium.wait_for(session, f'location.href === "{url}" && document.readyState === '
                                       '"complete"', 60, f"{name} loading")
            results[name] = chromium.evaluate(session, PAGE_CHECKS)
            if "03_" in name:  # the per-rank bytes of DDP and ZeRO-1/2/3: four typeset rows
                rect = chromium.evaluate(session, RECT.format(FORMULA_03))
                assert rect, "chapter 03: no block formula with ZeRO-3"
                rows = chromium.evaluate(session, f"{FORMULA_03}.querySelectorAll('mtr').length")
                line = chromium.evaluate(session, "document.querySelector('math')"
                                                  ".getBoundingClientRect().height")
                shot = chromium.screenshot(session, padded(rect))
                (SCREENSHOTS / "03_per_rank_bytes.png").write_bytes(shot)
                results["formula"] = (rows, rect, line, len(shot))
            if "06_" in name:  # the --help cell: one output block with the whole usage text
                output = HELP_06 + '.querySelector(".output")'
                rect = chromium.evaluate(session, RECT.format(output))
                assert rect, "chapter 06: no code cell running --help"
                blocks = chromium.evaluate(session, f"{HELP_06}.querySelectorAll("
                                                    "'.output_area').length")
                text = chromium.evaluate(session, f"{output}.textContent")
                shot = chromium.screenshot(session, padded(rect))
                (SCREENSHOTS / "06_help_output.png").write_bytes(shot)
                results["help"] = (blocks, text, rect, len(shot))
    finally:
        chromium.close()
    for name in ("notebooks/03_zero_memory_math.html", "notebooks/06_capstone_llama_fsdp2.html"):
        result = results[name]
        assert result["math"] > 10 and result["typeset"] == result["math"], (name, result)
        assert not result["raw_dollars"] and result["images"] >= 1, (name, result)
    for name, result in results.items():
        if name.endswith(".html"):
            assert not result["garbled"], f"{name}: math with a literal & or \\\\: {result}"
            assert not result["cut_off"], f"{name}: math wider than its column: {result}"
            assert not result["outputs_cut"], f"{name}: output lines cut at the column: {result}"
            assert not result["broken"], f"{name}: pictures that did not load: {result}"
    rows, rect, line, size = results["formula"]
    assert rows == 4 and rect["height"] > 3 * line, \
        f"chapter 03's formula: {rows} rows, {rect['height']:.0f} px high (one line: {line:.0f})"
    assert size > 5_000, "no screenshot of chapter 03's formula"
    blocks, text, rect, size = results["help"]
    assert blocks == 1, f"chapter 06's --help output shows as {blocks} blocks"
    assert "\nusage: train_llama.py" in text and text.count("\n") > 20, text[:200]
    assert size > 10_000, "no screenshot of chapter 06's --help output"


# What a phone, a wide table and a printer see: the page's width, each table row's lines (one
# client rectangle: not wrapped), and whether any block hides part of its text behind a scroll bar.
PAGE_WIDTH = "document.documentElement.scrollWidth"
ROW_LINES = """(() => {
  const table = [...document.querySelectorAll(".output_area pre")].find(p =>
    p.textContent.includes("in flight per rank") && p.textContent.includes("ZBVZeroBubble"));
  return table ? [...table.querySelectorAll(".row")].map(r => r.getClientRects().length) : null;
})()"""
HIDDEN = """[...document.querySelectorAll("pre")].filter(p => p.scrollHeight > p.clientHeight + 1
              || p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.slice(0, 60))"""


@needs_browser
def test_browser_phone_width_table_rows_and_print(built, tmp_path):
    out, _, _ = built
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "chromium.log", "w") as log:
        chromium = Chromium(tmp_path / "profile", log, size=(1280, 1000))
    try:
        seen = {}
        for name in ["notebooks/03_zero_memory_math.html", "notebooks/06_capstone_llama_fsdp2.html",
                     "notebooks/10_float8_schedules_3d.html"]:
            url = (out / name).as_uri()
            session = chromium.open(url)
            chromium.wait_for(session, f'location.href === "{url}" && document.readyState === '
                                       '"complete"', 60, f"{name} loading")
            if "10_" in name:  # the schedule table, on a laptop's screen
                seen["rows"] = chromium.evaluate(session, ROW_LINES)
                rect = chromium.evaluate(session, RECT.format(
                    '[...document.querySelectorAll(".output_area pre")].find(p => p.textContent'
                    '.includes("in flight per rank"))'))
                (SCREENSHOTS / "10_schedule_table.png").write_bytes(
                    chromium.screenshot(session, padded(rect)))
            chromium.send("Emulation.setDeviceMetricsOverride", session, width=400, height=800,
                          deviceScaleFactor=1, mobile=True)
            seen[name, "phone"] = chromium.evaluate(session, PAGE_WIDTH)
            if "03_" in name:
                (SCREENSHOTS / "03_phone_400px.png").write_bytes(chromium.screenshot(session))
            chromium.send("Emulation.clearDeviceMetricsOverride", session)
            chromium.send("Emulation.setEmulatedMedia", session, media="print")
            seen[name, "print"] = chromium.evaluate(session, HIDDEN)
    finally:
        chromium.close()
    failed = []
    for (name, what), value in ((k, v) for k, v in seen.items() if isinstance(k, tuple)):
        if what == "phone" and value > 400:  # a long inline identifier made it 462 px wide
            failed.append(f"{name} is {value} px wide at a 400 px viewport: it scrolls sideways")
        if what == "print" and value:  # chapter 06's --help was cut at 32rem, behind a scroll bar
            failed.append(f"{name}, printed: blocks hiding part of their text: {value}")
    if not (seen["rows"] and all(n == 1 for n in seen["rows"])):
        failed.append(f"chapter 10's schedule table: lines per row {seen['rows']} (each row one)")
    assert not failed, "\n".join(failed)


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
