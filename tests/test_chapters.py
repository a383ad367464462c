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
