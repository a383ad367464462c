"""A chapter's shape (COURSE.md): outcomes, prerequisites and a computed reading time first; at
most ~3,500 core words (outside <details> "Deeper" blocks); "What to remember" and "Check
yourself" last; and the README's path table in step with the notebooks."""
import pytest

from distkit.course import chapters

CHAPTERS = chapters.all_chapters()


def _table() -> str:
    return "\n".join(f"{c.number}: {c.core_words:,} core words, {c.deeper_words:,} in <details>, "
                     f"{c.minutes} min" for c in CHAPTERS)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.number)
def test_chapter_has_the_course_shape(chapter):
    gaps = chapter.gaps()
    assert not gaps, f"{chapter.path.name}: " + "; ".join(gaps) + "\nevery chapter:\n" + _table()


def test_readme_path_table_is_generated_from_the_notebooks():
    text = chapters.README.read_text()
    assert chapters.TABLE_BEGIN in text, "README.md has no generated chapter table"
    start = text.index(chapters.TABLE_BEGIN)
    end = text.index(chapters.TABLE_END) + len(chapters.TABLE_END)
    assert text[start:end] == chapters.readme_table(CHAPTERS), (
        "README.md's chapter table is out of step: python -m distkit.course.chapters --write")


def test_first_cell_fields_are_read_whole(tmp_path):
    """The parser itself, on a made-up chapter: every outcome of the list (a `$` under re.M once
    cut it after the first), a promise and prerequisites wrapped over two lines, the stated
    reading time; core words exclude <details>, and the last sections are counted."""
    import nbformat

    first = ("# 42 · A made-up chapter\n\n"
             "**In one line:** a promise that is long enough\nto wrap onto a second line.\n\n"
             "**You will be able to**\n1. one;\n2. two,\n   wrapped;\n3. three;\n4. four.\n\n"
             "**Prerequisites:** chapter 00 and\nchapter 01.\n\n"
             "**Reading time:** about 5 minutes (...).\n")
    remember = "## What to remember\n- a\n- b\n"
    check = ("## Check yourself\n\n1. Predict the number.\n\n<details>\n<summary>Answer</summary>"
             "\n\n42\n\n</details>\n\n2. Why?\n\n<details>\n<summary>Answer</summary>\n\nBecause."
             "\n\n</details>\n\n3. How?\n\n<details>\n<summary>Answer</summary>\n\nSo.\n\n"
             "</details>\n")
    deeper = "<details>\n<summary>Deeper: x</summary>\n\n" + "word " * 100 + "\n\n</details>\n"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(s)
                                         for s in (first, deeper, remember, check)])
    path = tmp_path / "42_made_up.ipynb"
    nbformat.write(nb, path)
    c = chapters.read(path)
    assert c.promise == "a promise that is long enough to wrap onto a second line."
    assert c.outcomes == ["one;", "two, wrapped;", "three;", "four."]
    assert c.prerequisites == "chapter 00 and chapter 01."
    assert c.stated_minutes == 5 and c.minutes == 5
    assert c.deeper_words >= 100 and c.remember == ["- a", "- b"]
    assert len(c.questions) == 3 and c.answers == 3
    assert c.gaps() == []
    # the code the core shows is read too (issue 45: a 250-line diff is part of the chapter):
    # 150 words of code and 450 of output at CODE_RATE add 5 minutes, stated beside the text's
    cell = nbformat.v4.new_code_cell("x = 1 " * 50)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="out " * 450)]
    nb.cells.insert(1, cell)
    nbformat.write(nb, path)
    c = chapters.read(path)
    assert (c.code_words, c.text_minutes, c.code_minutes, c.minutes) == (600, 5, 5, 10)
    assert "10 minutes: 5 of text" in c.reading_line()
    assert "5 of code and outputs (600 words" in c.reading_line()
    # the line itself is no reading: a longer line leaves the core words as they were
    words = c.core_words
    first = nb.cells[0]
    first.source = first.source.replace("about 5 minutes (...)", "about 5 minutes " + "x " * 50)
    nbformat.write(nb, path)
    assert chapters.read(path).core_words == words
