"""The course's explanatory diagrams, drawn in code: one function per picture in images/.

One module per chapter (ch00_collectives.py ... ch08_plan.py; chapter 02 has two), each
drawing its chapter's pictures with the primitives of shapes.py. Each function returns a
matplotlib Figure; `DIAGRAMS` maps an image name to its function, and `main()` saves them as
`images/<name>.png`. To fix a diagram, edit its function and redraw (from the repo root;
`make images` draws them all):

    PYTHONPATH=code .venv/bin/python -m distkit.course.diagrams [--out DIR] [NAME | CHAPTER ...]

e.g. `... -m distkit.course.diagrams ddp` (one diagram) or `... -m distkit.course.diagrams ch02`
(a chapter's).

Measured pictures (timelines, memory bars) are not here: notebook cells draw those from a run's
JSON with `distkit.course.plots`. These diagrams explain what a technique does.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt

from distkit.course.diagrams import (ch00_collectives, ch01_ddp, ch02_pipeline, ch02_tensor,
                                     ch03_zero, ch04_fsdp2, ch05_checkpoint, ch06_capstone,
                                     ch07_debugging, ch08_plan, ch09_cp_ep, ch10_float8_3d)

IMAGES = Path(__file__).resolve().parents[4] / "images"
DPI = 110
CHAPTER_MODULES = (ch00_collectives, ch01_ddp, ch02_pipeline, ch02_tensor, ch03_zero, ch04_fsdp2,
                   ch05_checkpoint, ch06_capstone, ch07_debugging, ch08_plan, ch09_cp_ep,
                   ch10_float8_3d)
DIAGRAMS = {draw.__name__: draw for module in CHAPTER_MODULES for draw in module.DIAGRAMS}
# "ch02" -> the names of chapter 02's diagrams (from the module names: chNN_topic)
CHAPTERS: dict[str, list[str]] = {}
for _module in CHAPTER_MODULES:
    CHAPTERS.setdefault(_module.__name__.rsplit(".", 1)[1][:4], []).extend(
        draw.__name__ for draw in _module.DIAGRAMS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distkit.course.diagrams",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=IMAGES,
                        help=f"folder for the PNGs (default: {IMAGES})")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"only these diagrams, or a chapter's ({', '.join(CHAPTERS)}); "
                             f"default: all of {', '.join(DIAGRAMS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(DIAGRAMS) - set(CHAPTERS))
    if unknown:
        parser.error(f"unknown diagram(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(DIAGRAMS)}, or a chapter: {', '.join(CHAPTERS)}")
    names = [n for name in args.names for n in CHAPTERS.get(name, [name])] or list(DIAGRAMS)
    plt.switch_backend("Agg")  # files only: no window, whatever the default backend is
    args.out.mkdir(parents=True, exist_ok=True)
    for name in dict.fromkeys(names):  # each once, in the order asked
        fig = DIAGRAMS[name]()
        path = args.out / f"{name}.png"
        fig.savefig(path, dpi=DPI, facecolor="white", bbox_inches="tight", pad_inches=0.1)
        plt.close(fig)
        print(path)
