"""`make site`: the course as a static website in build/site/, from the notebooks' stored outputs.

Nothing is executed: nbconvert (already pinned for the notebooks) turns each notebook into HTML
with its outputs, plots included (a cell's consecutive stream outputs merged into one block, as
JupyterLab shows them), and latex2mathml turns every $...$ and $$...$$ into MathML, which
browsers render by themselves (MathML Core), so no page loads anything from the network. A
formula it would garble (an environment it does not know leaves a literal & or a line break
MathML Core ignores) is rewritten into one it knows, or reported as not converted.

The home page (index.html) is a learner's start page: who the course is for, how to start (with
the `git clone` command when the repository's address is known: see repository_url), and the
path, each chapter's promise and reading time read from its notebook's first cell by
distkit.course.chapters (the site never parses the README). The rest mirrors the repository:
notebooks/NN.ipynb -> notebooks/NN.html, any other file a page links to -> the same path + .html
(highlighted; Markdown rendered; README.md -> README.html), images copied. So every relative
link in the notebooks and the README works as it does on GitHub; in the Markdown pages a chapter
named by its number (the glossary's "Chapter 03.") links to its page too.

Outputs wrap their lines, as in JupyterLab, except the rows of a table (aligned columns: see
table_rows), kept whole (their block scrolls); printed, nothing is cut (site.css, @media print).

    PYTHONPATH=code python -m distkit.course.site [OUT]      # default build/site
"""
import html
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import nbformat
from latex2mathml.converter import convert as latex_to_mathml
from nbconvert.exporters import HTMLExporter
from nbconvert.preprocessors import CoalesceStreamsPreprocessor
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_for_filename
from pygments.util import ClassNotFound

from distkit.course import chapters as chapter_meta

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = Path(__file__).with_name("site_template")
COURSE = "Distributed training with PyTorch"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg"}
# A LaTeX command the converter did not know survives as text in its MathML, e.g. <mi>\foo</mi>
# or <mtext>R\&amp;D</mtext>.
UNCONVERTED = re.compile(r">[^<]*\\(?:[A-Za-z]+|[^A-Za-z\s\\])[^<]*<")
# What latex2mathml (3.81) makes of an environment it does not know: each & a literal <mi>&</mi>
# and each \\ a <mspace linebreak="newline"/>, which MathML Core (Chromium) ignores: the rows run
# together on one line. Such a formula is garbled, not converted.
GARBLED = [(re.compile(r"<m[ion]>\s*&(amp;)?\s*</m[ion]>"), "a literal & (an alignment mark)"),
           (re.compile(r'linebreak="newline"'), "a line break (\\\\) browsers ignore"),
           (re.compile(r">[^<]*\\\\[^<]*<"), "a literal \\\\")]
# Environments latex2mathml does not know, as ones it does (the same layout): aligned is align*
# without its own display; the one-column ones are a centred array.
ENVIRONMENTS = {"aligned": ("align*", ""), "alignedat": ("align*", r"\{\d+\}"),
                "alignat": ("align*", r"\{\d+\}"), "alignat*": ("align*", r"\{\d+\}"),
                "gathered": ("array", ""), "gather": ("array", ""), "gather*": ("array", ""),
                "multline": ("array", ""), "multline*": ("array", ""), "dcases": ("cases", ""),
                "eqnarray": ("array", ""), "eqnarray*": ("array", "")}
ARRAY_COLUMNS = {"gathered": "{c}", "gather": "{c}", "gather*": "{c}", "multline": "{c}",
                 "multline*": "{c}", "eqnarray": "{rcl}", "eqnarray*": "{rcl}"}


# latex2mathml keeps the escapes of \text{} and \texttt{} as they are (<mtext>all\_reduce</mtext>):
# the characters they stand for.
TEXT_ESCAPE = re.compile(r"\\([_%&#$ {}])")


class MathError(ValueError):
    pass


def rewrite_environments(tex: str) -> str:
    """`tex` with each environment latex2mathml does not know replaced by one it does."""
    for name, (new, argument) in ENVIRONMENTS.items():
        begin = re.compile(re.escape(rf"\begin{{{name}}}") + argument)
        tex = begin.sub(lambda _: rf"\begin{{{new}}}" + ARRAY_COLUMNS.get(name, ""), tex)
        tex = tex.replace(rf"\end{{{name}}}", rf"\end{{{new}}}")
    return tex


def tex_to_mathml(tex: str, display: bool) -> str:
    """MathML for one formula; MathError when latex2mathml cannot convert all of it, or would
    garble it (a literal &, rows run together)."""
    try:
        mathml = latex_to_mathml(rewrite_environments(tex),
                                 display="block" if display else "inline")
    except Exception as e:  # the converter raises its own types (and IndexError on bad braces)
        raise MathError(f"{type(e).__name__}: {e}") from None
    mathml = re.sub(r"(<mtext[^>]*>)(.*?)(</mtext>)", lambda m: m.group(1) + TEXT_ESCAPE.sub(
        lambda e: html.escape(e.group(1)), m.group(2)) + m.group(3), mathml, flags=re.S)
    if UNCONVERTED.search(mathml):
        raise MathError("unknown command " + UNCONVERTED.search(mathml).group(0)[1:-1].strip())
    for pattern, what in GARBLED:
        if pattern.search(mathml):
            raise MathError(f"garbled: {what} in the MathML")
    return mathml


def github_slug(heading_html: str) -> str:
    """GitHub's anchor for a heading: its text in lower case, without punctuation but - and _,
    spaces as -."""
    text = html.unescape(re.sub(r"<[^>]+>", "", heading_html)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def public_url(url: str) -> str:
    """A git remote as the https address a learner can open and clone: ssh forms
    (git@host:owner/repo.git, ssh://git@host/owner/repo) made https, any user:password@ and a
    trailing .git or / dropped; "" for a local path or anything else."""
    url = url.strip()
    if m := re.fullmatch(r"(?:ssh://)?[\w.-]+@([\w.-]+)[:/](?!/)(.+?)", url):
        url = f"https://{m.group(1)}/{m.group(2)}"
    m = re.fullmatch(r"https?://(?:[^@/]*@)?([\w.-]+(?::\d+)?/[^\s?#]+?)(?:\.git)?/?", url)
    return f"https://{m.group(1)}" if m else ""


def repository_url(root: Path = ROOT, environ=None) -> str:
    """Where a learner clones the course from: CITATION.cff's `repository-code`, else the GitHub
    Actions run that builds the published site (GITHUB_SERVER_URL/GITHUB_REPOSITORY), else the
    clone's `origin` remote; "" when none says."""
    environ = os.environ if environ is None else environ
    cff = Path(root) / "CITATION.cff"
    if cff.is_file():
        m = re.search(r"^repository-code:\s*[\"']?([^\"'\s#]+)", cff.read_text(), re.M)
        if m and public_url(m.group(1)):
            return public_url(m.group(1))
    if environ.get("GITHUB_REPOSITORY"):
        return public_url(f"{environ.get('GITHUB_SERVER_URL') or 'https://github.com'}/"
                          f"{environ['GITHUB_REPOSITORY']}")
    try:
        origin = subprocess.run(["git", "-C", str(root), "remote", "get-url", "origin"],
                                capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return public_url(origin)


def table_rows(lines: list) -> set:
    """The indices of the lines that are rows of a table: 3 or more consecutive lines with 3 or
    more columns padded apart (two spaces or more between two words), 3 of them starting a column
    at the same place (not a traceback's "[rank0]:   File ..."). Wrapped, such a row breaks in two
    and its columns no longer line up (chapter 10's schedules); a sentence or an error line has
    no such columns, and wraps."""
    starts = [{m.end() for m in re.finditer(r"\S {2,}(?=\S)", line)} for line in lines]
    starts = [cols if len(cols) >= 2 else set() for cols in starts]  # 3 columns or more
    rows, group = set(), []
    for i, cols in enumerate(starts + [set()]):  # a sentinel ends the last group
        if cols:
            group.append(i)
            continue
        if len(group) >= 3 and any(sum(c in starts[j] for j in group) >= 3
                                   for c in set().union(*(starts[j] for j in group))):
            rows.update(group)
        group = []
    return rows


OUTPUT_PRE = re.compile(r'(<div class="[^"]*\boutput_text\b[^"]*">\s*)<pre>([^<]*)</pre>')


def mark_tables(body: str) -> str:
    """In each plain text output with a table (table_rows), each row in a <span class="row">
    and the block <pre class="table">: site.css keeps the rows whole (the block scrolls) while
    its other lines wrap."""
    def one(m):
        lines = m.group(2).split("\n")
        rows = table_rows([html.unescape(line) for line in lines])
        if not rows:
            return m.group(0)
        text = "\n".join(f'<span class="row">{line}</span>' if i in rows else line
                         for i, line in enumerate(lines))
        return f'{m.group(1)}<pre class="table">{text}</pre>'
    return OUTPUT_PRE.sub(one, body)


# "Chapter 03", "chapters 02, 04 and 06", "chapter 08's": the numbers of chapters in a text.
CHAPTER_REF = re.compile(r"\b([Cc]hapters?)(\s+)(\d\d(?:(?:,\s*|\s+and\s+|\s*-\s*|\s+to\s+)\d\d)*)"
                         r"(?!\d)")
NO_LINKS_IN = ("a", "code", "pre", "math", "h1", "h2", "h3", "h4", "h5", "h6")


def link_chapters(text: str, href) -> str:
    """HTML `text` with each chapter named by number ("Chapter 03") a link to `href(num)` (None:
    no such chapter, left as it is); never inside a link, code, math or a heading. One number
    links the whole phrase, a list each number."""
    out, skip = [], 0
    for part in re.split(r"(<[^>]+>)", text):
        tag = re.match(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)", part)
        if tag and tag.group(2).lower() in NO_LINKS_IN:
            skip = max(0, skip + (-1 if tag.group(1) else 1))
        if part.startswith("<") or skip or not part:  # a tag, a comment, or text not to link
            out.append(part)
            continue

        def one(m):
            nums = re.findall(r"\d\d", m.group(3))
            if len(nums) == 1:
                url = href(nums[0])
                return f'<a href="{url}">{m.group(0)}</a>' if url else m.group(0)
            return m.group(1) + m.group(2) + re.sub(
                r"\d\d", lambda n: f'<a href="{href(n.group(0))}">{n.group(0)}</a>'
                if href(n.group(0)) else n.group(0), m.group(3))
        out.append(CHAPTER_REF.sub(one, part))
    return "".join(out)


@dataclass
class Formula:
    source: str  # the repository file it is in
    tex: str
    display: bool
    error: str = ""  # why it was not converted ("" when it was)


class MathRenderer(IPythonRenderer):
    """nbconvert's Markdown renderer, with formulas as MathML instead of $-text for MathJax."""

    def __init__(self, formulas: list, source: str, **kw):
        super().__init__(escape=False, **kw)
        self.formulas, self.source = formulas, source

    def _math(self, tex: str, display: bool) -> str:
        formula = Formula(self.source, tex.strip(), display)
        self.formulas.append(formula)
        try:
            return tex_to_mathml(formula.tex, display)
        except MathError as e:  # shown as code, never as raw $-text; the tests list these
            formula.error = str(e)
            return f'<code class="tex">{html.escape(formula.tex)}</code>'

    def heading(self, text: str, level: int, **attrs) -> str:
        """nbconvert's heading, with its id (JupyterLab's: "(b)-FSDP-options-..."), and an
        anchor with GitHub's id for it ("b-fsdp-options-..."): the docs' links are written for
        GitHub (tests/test_docs_links.py), and must work on the site too."""
        out = super().heading(text, level, **attrs)
        slug = github_slug(text)
        if slug and f'id="{slug}"' not in out:
            out = re.sub(r"\A(<h\d[^>]*>)", rf'\1<a id="{slug}"></a>', out)
        return out

    def block_math(self, body: str) -> str:
        return self._math(body, True)

    def inline_math(self, body: str) -> str:
        return self._math(body, False)

    def latex_environment(self, name: str, body: str) -> str:
        return self._math(f"\\begin{{{name}}}{body}\\end{{{name}}}", True)


def markdown(text: str, formulas: list, source: str) -> str:
    return MarkdownWithMath(renderer=MathRenderer(formulas, source)).render(text)


class Exporter(HTMLExporter):
    """HTMLExporter's 'basic' template (cells only: the page around them is ours), our math, and
    a cell's consecutive stream outputs merged into one (a launch stores each line it flushed as
    an output of its own: without this, a stack of one-line boxes)."""

    def __init__(self, formulas: list, source: str):
        super().__init__(template_name="basic", exclude_input_prompt=True,
                         exclude_output_prompt=True)
        self.register_preprocessor(CoalesceStreamsPreprocessor, enabled=True)
        self.formulas, self.source = formulas, source

    @jinja2.pass_context  # as HTMLExporter's own: the context holds the cell's attachments
    def markdown2html(self, context, source):
        attachments = context.get("cell", {}).get("attachments", {})
        return MarkdownWithMath(renderer=MathRenderer(
            self.formulas, self.source, attachments=attachments,
            anchor_link_text=self.anchor_link_text)).render(source)


# The labelled paragraphs of a chapter's first cell (COURSE.md), by the Chapter field that holds
# each: the page's header shows them, so the body does not repeat them.
LABELS = {"promise": "**In one line:**", "outcomes": "**You will be able to**",
          "prerequisites": "**Prerequisites:**", "stated_minutes": "**Reading time:**"}


@dataclass
class Chapter:
    path: str  # notebooks/NN_topic.ipynb
    num: str
    title: str
    minutes: int  # the reading time (distkit.course.chapters): text_minutes + code_minutes
    text_minutes: int = 0  # the core text's
    code_minutes: int = 0  # the code cells' and outputs' the core shows
    promise: str = ""  # Markdown, "" when the first cell has none
    outcomes: list = field(default_factory=list)
    prerequisites: str = ""
    shown: list = field(default_factory=list)  # the LABELS the header shows
    diagram: str = ""  # repository path of its first picture ("" if none)
    diagram_alt: str = ""
    exercises: list = field(default_factory=list)  # (starter, solution) repository paths
    exercise_ids: list = field(default_factory=list)  # each one's id ("03.1"), "" if unknown

    @property
    def plain_title(self) -> str:  # for <title> and links: without Markdown's marks
        return re.sub(r"`|\*\*", "", self.title)

    @property
    def name(self) -> str:  # the title without its number: "04 · FSDP2: ..." -> "FSDP2: ..."
        return re.sub(r"^\d\d\s*·\s*", "", self.title)


def site_path(repo_path: str) -> str:
    """Where a repository file's page (or copy) lies in the site."""
    p = Path(repo_path)
    if p.suffix in IMAGE_SUFFIXES | {".html"}:  # pictures are copied; .html: the site's own
        return repo_path
    if p.suffix in (".ipynb", ".md"):
        return str(p.with_suffix(".html"))
    return repo_path + ".html"


def chapters(root: Path) -> list:
    """Every notebook, with what its first cell says (distkit.course.chapters), its diagram
    (first picture) and its exercises. A first cell without the labelled parts gives a chapter
    with its title (or file name) only."""
    out, ids = [], exercise_ids(root)
    for nb_path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        meta = chapter_meta.read(nb_path)
        nb = nbformat.read(nb_path, as_version=4)
        md = [c.source for c in nb.cells if c.cell_type == "markdown"]
        picture = next((m for s in md for m in re.finditer(r"!\[([^\]]*)\]\(([^)\s]+)\)", s)), None)
        num = nb_path.name[:2]
        chapter = Chapter(
            str(nb_path.relative_to(root)), num, meta.title, meta.minutes,
            getattr(meta, "text_minutes", meta.minutes), getattr(meta, "code_minutes", 0),
            meta.promise, list(meta.outcomes), meta.prerequisites,
            shown=[k for k in LABELS if getattr(meta, k)],
            diagram=os.path.normpath(os.path.join("notebooks", picture.group(2))) if picture
            else "",
            diagram_alt=picture.group(1) if picture else "")
        found = []
        for code_dir in sorted((root / "code").glob(f"ch{num}_*")):
            for starter in sorted((code_dir / "exercises").glob("*.py")):
                solution = code_dir / "solutions" / starter.name
                found.append((ids.get(str(starter.relative_to(root / "code")), ""),
                              str(starter.relative_to(root)),
                              str(solution.relative_to(root)) if solution.exists() else ""))
        # in the order of their ids (make exercise EX=NN.k), those without one last
        for ex_id, starter, solution in sorted(found, key=lambda f: (not f[0], f[0], f[1])):
            chapter.exercises.append((starter, solution))
            chapter.exercise_ids.append(ex_id)
        out.append(chapter)
    return out


EXERCISE = re.compile(r"""@exercise\(\s*["'](\d\d\.\d+)["']\s*,\s*["']([^"']+)["']""")


def exercise_ids(root: Path) -> dict:
    """Each registered exercise's id by its starter (relative to code/), read from the checker's
    registrations (`@exercise("03.1", "ch03_zero/exercises/...")` in distkit/course/checks/)
    without importing them (they import torch)."""
    return {path: ex_id for f in sorted((root / "code" / "distkit" / "course" / "checks")
                                        .glob("ch*.py"))
            for ex_id, path in EXERCISE.findall(f.read_text(encoding="utf-8"))}


def workshop_table(root: Path) -> dict:
    """The instructor's guide's exercise table (docs/workshop.md: | EX | file | minutes | the
    point |): {id: (minutes, point)}; empty without the guide."""
    guide = Path(root) / "docs" / "workshop.md"
    rows = re.findall(r"^\|\s*(\d\d\.\d+)\s*\|[^|\n]*\|\s*(\d+)\s*\|\s*(.+?)\s*\|\s*$",
                      guide.read_text(encoding="utf-8") if guide.is_file() else "", re.M)
    return {ex_id: (int(minutes), point) for ex_id, minutes, point in rows}


def without_header(first_cell: str, chapter: Chapter) -> str:
    """A chapter's first cell less what its page's header shows: the title, the diagram, and
    each labelled paragraph the header shows (the others stay, so nothing is lost)."""
    text = re.sub(r"\A\s*#\s+.+\n?", "", first_cell)
    if chapter.diagram:
        text = re.sub(r"!\[[^\]]*\]\(" + re.escape(os.path.relpath(chapter.diagram, "notebooks"))
                      + r"\)\n?", "", text)
    labels = tuple(LABELS[k] for k in chapter.shown)
    paragraphs = re.split(r"\n\s*\n", text)
    return "\n\n".join(p for p in paragraphs if not (labels and p.lstrip().startswith(labels)))


LINK = re.compile(r'(\s(?:href|src)=")([^"#]*)(#[^"]*)?(")')


class Site:
    def __init__(self, out: Path, root: Path = ROOT):
        self.out, self.root = Path(out), Path(root)
        self.formulas: list = []
        self.pages: list = []  # site paths written
        self.queue: list = []  # repository paths still to write
        self.done: set = set()
        self.chapters = chapters(self.root)
        self.repo_url = repository_url(self.root)
        self.exporter = Exporter(self.formulas, "")
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False,
                                 keep_trailing_newline=True)
        self.templates = {name: env.get_template(f"{name}.html.j2")
                          for name in ("page", "chapter", "home")}

    # -- links: every relative href/src names a repository file; point it at that file's page
    def want(self, repo_path: str) -> None:
        if repo_path not in self.done and (self.root / repo_path).is_file():
            self.done.add(repo_path)
            self.queue.append(repo_path)

    def relink(self, text: str, repo_path: str) -> str:
        here = os.path.dirname(repo_path)

        def one(m):
            url = m.group(2)
            if not url or re.match(r"[a-z][a-z0-9+.-]*:", url, re.I) or url.startswith("/"):
                return m.group(0)  # a fragment only, another site, data:, mailto:
            target = os.path.normpath(os.path.join(here, url))
            if not (self.root / target).is_file():
                return m.group(0)  # left as it is: the link test reports it
            self.want(target)
            new = os.path.relpath(site_path(target), os.path.dirname(site_path(repo_path)))
            return m.group(1) + new + (m.group(3) or "") + m.group(4)

        return LINK.sub(one, text)

    def inline(self, text: str, source: str) -> str:
        """One line of Markdown as HTML, without the paragraph around it."""
        html_text = markdown(text, self.formulas, source).strip()
        return re.sub(r"\A<p>(.*)</p>\Z", r"\1", html_text, flags=re.S)

    def write(self, repo_path: str, title: str, body: str, chapter: Chapter = None) -> None:
        dest = site_path(repo_path)
        depth = dest.count("/")
        i = self.chapters.index(chapter) if chapter else -1
        pager = {"prev": self.chapters[i - 1] if i > 0 else None,
                 "next": self.chapters[i + 1] if 0 <= i < len(self.chapters) - 1 else None}
        page = self.templates["page"].render(
            course=COURSE, title=title, body=body, root="../" * depth, current=dest,
            chapters=self.chapters, site_path=site_path, repo_url=self.repo_url,
            **(pager if chapter else {}))
        # The template's links are repository paths too (chapters, LICENSE): relink them all.
        (self.out / dest).parent.mkdir(parents=True, exist_ok=True)
        (self.out / dest).write_text(self.relink(page, repo_path), encoding="utf-8")
        self.pages.append(dest)

    # -- one writer per kind of file
    def home(self) -> None:
        """index.html: who the course is for, how to start, the path (from the notebooks)."""
        rows = [{"chapter": c, "name": self.inline(c.name, c.path),
                 "promise": self.inline(c.promise, c.path) if c.promise else ""}
                for c in self.chapters]
        docs = {name: (self.root / "docs" / f"{name}.md").is_file()
                for name in ("handout", "workshop", "glossary", "cluster")}
        docs["readme"] = (self.root / "README.md").is_file()
        body = self.templates["home"].render(
            course=COURSE, rows=rows, minutes=sum(c.minutes for c in self.chapters),
            rate=chapter_meta.RATE, code_rate=getattr(chapter_meta, "CODE_RATE", 0), docs=docs,
            repo_url=self.repo_url,
            repo_dir=self.repo_url.rstrip("/").rsplit("/", 1)[-1])
        self.write("index.html", COURSE, body)

    def notebook(self, chapter: Chapter) -> None:
        nb = nbformat.read(self.root / chapter.path, as_version=4)
        first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
        if first is not None:  # the page's own header shows the title, diagram and labels
            first.source = without_header(first.source, chapter)
        self.exporter.source = chapter.path  # the file each formula is reported in
        body, _ = self.exporter.from_notebook_node(nb)
        here = os.path.dirname(chapter.path)
        header = self.templates["chapter"].render(
            chapter=chapter, title=self.inline(chapter.title, chapter.path),
            promise=self.inline(chapter.promise, chapter.path) if chapter.promise else "",
            outcomes=[self.inline(o, chapter.path) for o in chapter.outcomes],
            prerequisites=(self.inline(chapter.prerequisites, chapter.path)
                           if chapter.prerequisites else ""),
            rate=chapter_meta.RATE, code_rate=getattr(chapter_meta, "CODE_RATE", 0),
            diagram=os.path.relpath(chapter.diagram, here) if chapter.diagram else "",
            exercises=[[os.path.relpath(p, here) if p else "" for p in pair]
                       for pair in chapter.exercises])
        self.write(chapter.path, chapter.plain_title, header + mark_tables(body), chapter)

    def markdown_file(self, repo_path: str) -> None:
        text = (self.root / repo_path).read_text(encoding="utf-8")
        by_num = {c.num: c.path for c in self.chapters}
        here = os.path.dirname(repo_path)
        href = lambda num: os.path.relpath(by_num[num], here) if num in by_num else None  # noqa: E731
        self.write(repo_path, repo_path,
                   link_chapters(markdown(text, self.formulas, repo_path), href))

    def text_file(self, repo_path: str) -> None:
        text = (self.root / repo_path).read_text(encoding="utf-8")
        try:
            lexer = get_lexer_for_filename(repo_path, text)
        except ClassNotFound:
            lexer = TextLexer()
        rel = lambda p: os.path.relpath(p, os.path.dirname(repo_path))  # noqa: E731
        pair = ""
        for chapter in self.chapters:  # a starter links to its solution and back
            for starter, solution in chapter.exercises:
                if solution and repo_path in (starter, solution):
                    kind, other = (("solution", solution) if repo_path == starter
                                   else ("starter", starter))
                    pair = (f'<p class="pair">An exercise of <a href="{rel(chapter.path)}">'
                            f'chapter {chapter.num}</a>: see its <a href="{rel(other)}">{kind}'
                            "</a>.</p>")
        body = (f"<h1><code>{html.escape(repo_path)}</code></h1>{pair}"
                + highlight(text, lexer, HtmlFormatter(linenos="inline", cssclass="highlight")))
        self.write(repo_path, repo_path, body)

    def exercises_page(self) -> None:
        """Every exercise in id order (the EX of `make exercise EX=NN.k`), with the instructor's
        guide's minutes and point where it has them."""
        guide = workshop_table(self.root)
        rows = []
        for c in self.chapters:
            for ex_id, (s, sol) in zip(c.exercise_ids, c.exercises):
                minutes, point = guide.get(ex_id, ("", ""))
                rows.append(
                    f'<tr><td>{ex_id or "-"}</td><td><a href="{c.path}">{c.num}</a></td>'
                    f'<td><a href="{s}"><code>{os.path.basename(s)}</code></a></td><td>'
                    + (f'<a href="{sol}">solution</a>' if sol else "") + f"</td><td>{minutes}</td>"
                    f"<td>{self.inline(point, 'docs/workshop.md') if point else ''}</td></tr>")
        body = ("<h1>Exercises</h1><p>Each starter has TODOs; its solution is the tested answer."
                " Check yours with <code>make exercise EX=NN.k</code>, NN.k from the first column"
                " (minutes: the instructor's estimate, check included).</p>"
                "<table><tr><th>EX</th><th>chapter</th><th>starter</th><th>solution</th>"
                f"<th>minutes</th><th>the point</th></tr>{''.join(rows)}</table>")
        self.write("exercises.html", "Exercises", body)

    def build(self) -> None:
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        css = (TEMPLATES / "site.css").read_text() + HtmlFormatter().get_style_defs(".highlight")
        (self.out / "site.css").write_text(css)
        for image in sorted((self.root / "images").glob("*")):
            self.want(str(image.relative_to(self.root)))
        for repo_path in ["README.md", "docs/handout.md", "LICENSE", "CITATION.cff"] + [
                p for c in self.chapters for pair in c.exercises for p in pair if p]:
            self.want(repo_path)
        by_path = {c.path: c for c in self.chapters}
        self.done.update(by_path)
        self.home()
        for chapter in self.chapters:
            self.notebook(chapter)
        self.exercises_page()
        while self.queue:  # files the pages link to, and the files those link to
            repo_path = self.queue.pop(0)
            suffix = Path(repo_path).suffix
            if suffix in IMAGE_SUFFIXES:
                (self.out / repo_path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.root / repo_path, self.out / repo_path)
            elif suffix == ".md":
                self.markdown_file(repo_path)
            else:
                self.text_file(repo_path)


def build(out: Path, root: Path = ROOT) -> Site:
    site = Site(out, root)
    site.build()
    return site


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m distkit.course.site [OUT]   (default: build/site)", file=sys.stderr)
        return 2
    out = Path(argv[0]) if argv else ROOT / "build" / "site"
    t0, c0 = time.perf_counter(), time.process_time()
    site = build(out)
    failed = [f for f in site.formulas if f.error]
    print(f"site: {len(site.pages)} pages, {len(site.formulas)} formulas as MathML "
          f"({len(failed)} not converted) in {out} "
          f"({time.perf_counter() - t0:.1f} s, {time.process_time() - c0:.1f} CPU-s)")
    for f in failed:
        print(f"site: WARN {f.source}: could not convert ${f.tex}$ ({f.error})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
