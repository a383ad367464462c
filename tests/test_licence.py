"""The course can be reused and credited: a licence and a citation file that tools can read."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_licence_names_both_licences():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "CC BY 4.0" in text and "creativecommons.org/licenses/by/4.0" in text


def test_citation_file_has_what_cff_requires():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    # the keys CFF 1.2.0 requires; GitHub's "Cite this repository" reads them
    assert {"cff-version", "message", "title", "authors"} <= cff.keys()
    assert cff["cff-version"] == "1.2.0" and cff["authors"]
    assert cff["license"] == "MIT"
