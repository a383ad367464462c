"""`make site`: the course as a static website in build/site/, from the notebooks' stored outputs.

Nothing is executed: nbconvert (already pinned for the notebooks) turns each notebook into HTML
with its outputs, plots included, and latex2mathml turns every $...$ and $$...$$ into MathML,
which browsers render by themselves (MathML Core), so no page loads anything from the network.

The site mirrors the repository: README.md -> index.html, notebooks/NN.ipynb -> notebooks/NN.html,
any other file a page links to -> the same path + .html (highlighted; Markdown rendered), images
copied. So every relative link in the notebooks and the README works as it does on GitHub.

    PYTHONPATH=code python -m distkit.course.site [OUT]      # default build/site
"""
import html
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import nbformat
from latex2mathml.converter import convert as latex_to_mathml
from nbconvert.exporters import HTMLExporter
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_for_filename
from pygments.util import ClassNotFound

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = Path(__file__).with_name("site_template")
COURSE = "Distributed training with PyTorch"
SUMMARY_LINES = 5
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg"}
# A LaTeX command the converter did not know survives as text in its MathML, e.g. <mi>\foo</mi>.
UNCONVERTED = re.compile(r">[^<]*\\[A-Za-z]+[^<]*<")


class MathError(ValueError):
    pass


def tex_to_mathml(tex: str, display: bool) -> str:
    """MathML for one formula; MathError when latex2mathml cannot convert all of it."""
    try:
        mathml = latex_to_mathml(tex, display="block" if display else "inline")
    except Exception as e:  # the converter raises its own types (and IndexError on bad braces)
        raise MathError(f"{type(e).__name__}: {e}") from None
    if UNCONVERTED.search(mathml):
        raise MathError("unknown command " + UNCONVERTED.search(mathml).group(0)[1:-1].strip())
    return mathml


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

    def block_math(self, body: str) -> str:
        return self._math(body, True)

    def inline_math(self, body: str) -> str:
        return self._math(body, False)

    def latex_environment(self, name: str, body: str) -> str:
        return self._math(f"\\begin{{{name}}}{body}\\end{{{name}}}", True)


def markdown(text: str, formulas: list, source: str) -> str:
    return MarkdownWithMath(renderer=MathRenderer(formulas, source)).render(text)


class Exporter(HTMLExporter):
    """HTMLExporter's 'basic' template (cells only: the page around them is ours), our math."""

    def __init__(self, formulas: list, source: str):
        super().__init__(template_name="basic", exclude_input_prompt=True,
                         exclude_output_prompt=True)
        self.formulas, self.source = formulas, source

    @jinja2.pass_context  # as HTMLExporter's own: the context holds the cell's attachments
    def markdown2html(self, context, source):
        attachments = context.get("cell", {}).get("attachments", {})
        return MarkdownWithMath(renderer=MathRenderer(
            self.formulas, self.source, attachments=attachments,
            anchor_link_text=self.anchor_link_text)).render(source)


@dataclass
class Chapter:
    path: str  # notebooks/NN_topic.ipynb
    num: str
    title: str
    diagram: str  # repository path of its first picture ("" if none)
    diagram_alt: str
    summary: list  # up to SUMMARY_LINES lines of Markdown: what the chapter measures
    exercises: list = field(default_factory=list)  # (starter, solution) repository paths

    @property
    def plain_title(self) -> str:  # for <title> and links: without Markdown's marks
        return re.sub(r"`|\*\*", "", self.title)


def site_path(repo_path: str) -> str:
    """Where a repository file's page (or copy) lies in the site."""
    if repo_path == "README.md":
        return "index.html"
    p = Path(repo_path)
    if p.suffix in IMAGE_SUFFIXES | {".html"}:  # pictures are copied; .html: the site's own
        return repo_path
    if p.suffix in (".ipynb", ".md"):
        return str(p.with_suffix(".html"))
    return repo_path + ".html"


def split_top_level(text: str, sep: str = ";") -> list:
    """Split at `sep` outside parentheses and backticks."""
    parts, depth, code, start = [], 0, False, 0
    for i, ch in enumerate(text):
        code ^= ch == "`"
        depth += (ch == "(") - (ch == ")") if not code else 0
        if ch == sep and depth == 0 and not code:
            parts.append(text[start:i].strip())
            start = i + 1
    return [p for p in parts + [text[start:].strip()] if p]


def measured_column(root: Path) -> dict:
    """The README's chapter table: notebook path -> its 'what is measured' cell."""
    rows = {}
    for line in (root / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        link = re.search(r"\]\((notebooks/[^)]+\.ipynb)\)", line)
        if line.startswith("| ") and link and len(cells) >= 4:
            rows[link.group(1)] = cells[-1]
    return rows


def chapters(root: Path) -> list:
    """Every notebook, with its diagram (first picture), summary and exercises."""
    measured = measured_column(root)
    out = []
    for nb_path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        rel = str(nb_path.relative_to(root))
        nb = nbformat.read(nb_path, as_version=4)
        md = [c.source for c in nb.cells if c.cell_type == "markdown"]
        title = next((m.group(1) for m in (re.match(r"#\s+(.+)", s) for s in md[:1]) if m),
                     nb_path.stem)
        picture = next((m for s in md for m in re.finditer(r"!\[([^\]]*)\]\(([^)\s]+)\)", s)), None)
        diagram = os.path.normpath(os.path.join("notebooks", picture.group(2))) if picture else ""
        # What is measured: the README's column for it; else the first list of its first cell.
        summary = split_top_level(measured.get(rel, ""))
        if not summary and md:
            summary = re.findall(r"^\s*(?:\d+\.|[*-])\s+(.+)", md[0], re.M)
        num = nb_path.name[:2]
        chapter = Chapter(rel, num, title, diagram, picture.group(1) if picture else "",
                          summary[:SUMMARY_LINES])
        for code_dir in sorted((root / "code").glob(f"ch{num}_*")):
            for starter in sorted((code_dir / "exercises").glob("*.py")):
                solution = code_dir / "solutions" / starter.name
                chapter.exercises.append((str(starter.relative_to(root)),
                                          str(solution.relative_to(root)) if solution.exists()
                                          else ""))
        out.append(chapter)
    return out


LINK = re.compile(r'(\s(?:href|src)=")([^"#]*)(#[^"]*)?(")')


class Site:
    def __init__(self, out: Path, root: Path = ROOT):
        self.out, self.root = Path(out), Path(root)
        self.formulas: list = []
        self.pages: list = []  # site paths written
        self.queue: list = []  # repository paths still to write
        self.done: set = set()
        self.chapters = chapters(self.root)
        self.exporter = Exporter(self.formulas, "")
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=False,
                                 keep_trailing_newline=True)
        self.page_template = env.get_template("page.html.j2")
        self.chapter_template = env.get_template("chapter.html.j2")

    # -- links: every relative href/src names a repository file; point it at that file's page
    def want(self, repo_path: str) -> None:
        if repo_path not in self.done:
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

    def write(self, repo_path: str, title: str, body: str, chapter: Chapter = None) -> None:
        dest = site_path(repo_path)
        depth = dest.count("/")
        i = self.chapters.index(chapter) if chapter else -1
        pager = {"prev": self.chapters[i - 1] if i > 0 else None,
                 "next": self.chapters[i + 1] if 0 <= i < len(self.chapters) - 1 else None}
        page = self.page_template.render(
            course=COURSE, title=title, body=body, root="../" * depth, current=dest,
            chapters=self.chapters, site_path=site_path, **(pager if chapter else {}))
        # The template's links are repository paths too (chapters, LICENSE): relink them all.
        (self.out / dest).parent.mkdir(parents=True, exist_ok=True)
        (self.out / dest).write_text(self.relink(page, repo_path), encoding="utf-8")
        self.pages.append(dest)

    # -- one writer per kind of file
    def notebook(self, chapter: Chapter) -> None:
        nb = nbformat.read(self.root / chapter.path, as_version=4)
        first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
        if first is not None:  # the page's own header shows the title and the diagram
            first.source = re.sub(r"\A\s*#\s+.+\n?", "", first.source)
            first.source = re.sub(r"!\[[^\]]*\]\(" + re.escape(os.path.relpath(
                chapter.diagram, "notebooks")) + r"\)\n?", "", first.source)
        self.exporter.source = chapter.path  # the file each formula is reported in
        body, _ = self.exporter.from_notebook_node(nb)
        here = os.path.dirname(chapter.path)
        header = self.chapter_template.render(
            chapter=chapter, title=markdown(chapter.title, self.formulas, chapter.path)[3:-5],
            diagram=os.path.relpath(chapter.diagram, here) if chapter.diagram else "",
            summary=[markdown(s, self.formulas, "README.md").strip()[3:-4]
                     for s in chapter.summary],
            exercises=[[os.path.relpath(p, here) if p else "" for p in pair]
                       for pair in chapter.exercises])
        self.write(chapter.path, chapter.plain_title, header + body, chapter)

    def markdown_file(self, repo_path: str) -> None:
        text = (self.root / repo_path).read_text(encoding="utf-8")
        title = COURSE if repo_path == "README.md" else repo_path
        self.write(repo_path, title, markdown(text, self.formulas, repo_path))

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
        rows = "".join(
            f'<tr><td><a href="{c.path}">{c.num}</a></td><td><a href="{s}"><code>'
            f'{os.path.basename(s)}</code></a></td><td>'
            + (f'<a href="{sol}">solution</a>' if sol else "") + "</td></tr>"
            for c in self.chapters for s, sol in c.exercises)
        body = ("<h1>Exercises</h1><p>Each starter has TODOs; its solution is the tested answer."
                "</p><table><tr><th>chapter</th><th>starter</th><th>solution</th></tr>"
                f"{rows}</table>")
        self.write("exercises.html", "Exercises", body)

    def build(self) -> None:
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        css = (TEMPLATES / "site.css").read_text() + HtmlFormatter().get_style_defs(".highlight")
        (self.out / "site.css").write_text(css)
        for image in sorted((self.root / "images").glob("*")):
            self.want(str(image.relative_to(self.root)))
        for repo_path in ["README.md", "LICENSE", "CITATION.cff"] + [
                p for c in self.chapters for pair in c.exercises for p in pair if p]:
            self.want(repo_path)
        by_path = {c.path: c for c in self.chapters}
        self.done.update(by_path)
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
