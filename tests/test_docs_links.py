"""Every relative link in the README, CONTRIBUTING.md, docs/ and the notebooks' markdown leads
somewhere: a file or folder of the repository, and for a `#anchor` into a markdown page, one of
its headings or anchors (the glossary's `<a id="term">`). And the map of the helper package's two
layers holds: the docstrings of distkit and distkit.course name every module, and nothing a
learner reads (lesson scripts, distkit's lesson layer) imports the course's tooling."""
import ast
import importlib
import pkgutil
import re

import nbformat
import pytest

from conftest import CODE, ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page) -> set:
    """GitHub's anchors for a markdown page's headings, and its HTML anchors (`<a id="x">`)."""
    text = page.read_text()
    return ({re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.*)$", text, re.M)}
            | set(re.findall(r"<a id=\"([^\"]+)\"", text)))


def markdown_of(page) -> str:
    if page.suffix == ".ipynb":
        cells = nbformat.read(page, as_version=4).cells
        return "\n".join(c.source for c in cells if c.cell_type == "markdown")
    return page.read_text()


@pytest.mark.parametrize("page", PAGES + NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", markdown_of(page), flags=re.S)  # not inside code blocks
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("package", ["distkit", "distkit.course"])
def test_package_docstring_names_every_module(package):
    """Each module and subpackage is named in its package's docstring (`distkit.toy`, or in
    distkit.course `notebook`, `checks/`), so a new one does not go unlisted. distkit.dist is
    the package's own functions (`from distkit import setup`), listed by name instead."""
    pkg = importlib.import_module(package)  # the docstrings only: nothing imports torch
    named = {m.name for m in pkgutil.iter_modules(pkg.__path__)
             if re.search(rf"`(?:{re.escape(package)}\.)?{m.name}/?`", pkg.__doc__)}
    missing = {m.name for m in pkgutil.iter_modules(pkg.__path__)} - named - {"dist"}
    assert not missing, f"{package}'s docstring does not name: {sorted(missing)}"


def test_no_lesson_code_imports_the_course_tooling():
    """Lesson scripts (code/chNN_*/, exercises and solutions too) and distkit's lesson layer
    never import distkit.course: a learner who copies a script needs only distkit."""
    found = []
    for path in sorted(CODE.rglob("*.py")):
        if (CODE / "distkit" / "course") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # `from .course import x` in distkit too
                module = ("distkit." if node.level else "") + (node.module or "")
                names = [f"{module}.{a.name}".replace("distkit..", "distkit.")
                         for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for name in names
                      if name == "distkit.course" or name.startswith("distkit.course.")]
    assert not found, f"lesson code imports distkit.course: {found}"
