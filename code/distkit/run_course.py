"""`make course`: execute every notebook in order with papermill, headless, into build/.

Prints a table (notebook, pass/fail, seconds) and exits non-zero if any notebook failed; the
executed copy of a failing notebook stays in build/ for inspection.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import papermill

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="default: notebooks/*.ipynb in order")
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="executed copies")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="papermill parameter for every notebook, e.g. -p NPROC=4")
    args = parser.parse_args(argv)
    params = {}
    for p in args.param:
        name, sep, value = p.partition("=")
        if not sep:
            parser.error(f"--param wants NAME=VALUE, got {p!r}")
        params[name] = int(value) if value.lstrip("-").isdigit() else value
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    for nb in notebooks:
        t0 = time.perf_counter()
        try:
            papermill.execute_notebook(nb, args.out / nb.name, parameters=params,
                                       cwd=nb.resolve().parent, progress_bar=False)
            status = "pass"
        except Exception as e:  # papermill raises PapermillExecutionError with the cell's error
            status = "FAIL"
            print(f"{nb.name}: {type(e).__name__}: {str(e).strip().splitlines()[-1]}",
                  file=sys.stderr)
        rows.append((nb.name, status, time.perf_counter() - t0))

    width = max([len(n) for n, _, _ in rows] + [8])
    print(f"\n{'notebook':<{width}}  result  seconds")
    for name, status, secs in rows:
        print(f"{name:<{width}}  {status:<6}  {secs:7.1f}")
    print(f"{'total':<{width}}  {'':<6}  {sum(s for _, _, s in rows):7.1f}")
    failed = [n for n, s, _ in rows if s != "pass"]
    if failed:
        print(f"failed: {', '.join(failed)} (executed copies in {args.out})", file=sys.stderr)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
