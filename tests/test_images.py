"""images/ holds the diagrams drawn by distkit.course.diagrams, and the notebooks show only
those."""
import os
import re
import subprocess
import sys

import nbformat
import pytest

from conftest import CODE, ROOT
from distkit.course.diagrams import CHAPTERS, DIAGRAMS, main

IMAGES = ROOT / "images"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# ![alt](path "title") and <img ... src="path">, in markdown cells
MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)")
HTML_IMAGE = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def notebook_images():
    """(notebook name, image reference) for every image a notebook's markdown shows."""
    refs = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                for ref in MD_IMAGE.findall(cell.source) + HTML_IMAGE.findall(cell.source):
                    refs.append((path.name, ref))
    return refs


def test_module_writes_every_diagram(tmp_path):
    # ~15 CPU-s; the limit only stops a hang (a 2-core machine under load took 111 s)
    proc = subprocess.run([sys.executable, "-m", "distkit.course.diagrams", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(CODE), "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.png" for n in DIAGRAMS)
    for name in DIAGRAMS:
        path = tmp_path / f"{name}.png"
        assert str(path) in proc.stdout
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC), f"{name}.png is not a PNG"
        assert len(data) > 10_000, f"{name}.png is only {len(data)} bytes"


def test_draws_one_chapter_or_one_diagram(tmp_path, capsys):
    assert [n for names in CHAPTERS.values() for n in names] == list(DIAGRAMS)  # each once
    main(["--out", str(tmp_path), "ch05", "ddp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_resume.png", "ddp.png"]
    assert capsys.readouterr().out.split() == [str(tmp_path / f"{n}.png")
                                               for n in CHAPTERS["ch05"] + ["ddp"]]


def test_unknown_diagram_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "nope"])
    assert exit_.value.code == 2 and "unknown diagram(s) nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("notebook,ref", notebook_images() or [pytest.param(
    None, None, marks=pytest.mark.skip(reason="no notebook shows an image yet"))])
def test_notebook_images_are_drawn_by_code(notebook, ref):
    if re.match(r"(https?|attachment|data):", ref):
        pytest.fail(f"{notebook} shows {ref}: course images live in images/, drawn by code")
    path = (ROOT / "notebooks" / ref).resolve()
    assert path.parent == IMAGES and path.suffix == ".png", \
        f"{notebook} shows {ref}: expected ../images/<name>.png"
    assert path.stem in DIAGRAMS, f"{notebook} shows {ref}, which no diagram in DIAGRAMS draws"
    assert path.is_file(), f"{notebook} shows {ref}: missing; run `make images`"


def test_images_folder_holds_exactly_the_drawn_diagrams():
    committed = {p.stem for p in IMAGES.glob("*.png")}
    assert not committed - set(DIAGRAMS), (
        "images not drawn by distkit.course.diagrams (hand-made?): "
        f"{sorted(committed - set(DIAGRAMS))}")
    assert not set(DIAGRAMS) - committed, \
        f"diagrams missing from images/ (run `make images`): {sorted(set(DIAGRAMS) - committed)}"
