"""Compared outputs that hold on every CPU: the rule, checked on the stored notebooks.

nbval compares a cell's stored output with a fresh run on the learner's machine. The last bits of
a float depend on that machine: the vector width of torch's kernels (AVX2, AVX-512, AMX and
AVX512-FP16 on newer Xeons, NEON/SVE on ARM), the thread count and the order of a reduction. So a
compared output prints integers, booleans, bounds ("< 1e-05: True") and floats rounded far above
their noise (CONTRIBUTING.md, "Adding a compared cell"). This module finds the floats that break
the rule in a notebook's stored, compared outputs; tests/test_portability.py runs it on every
notebook, and on a planted unrounded float to see it fail.

    python -m distkit.course.portable notebooks/*.ipynb     # one line per offending output

Two kinds of float are refused (a constant printed in full, e.g. bf16's max 3.38953e+38, has at
most 6 significant digits and passes):
- seven or more significant digits (`3.1972846`, `0.0012345678`): noise shows from the 7th digit
  of a float32 on;
- a tiny number in scientific notation (`5.2e-07`, exponent -5 or below) that is not a bound: a
  parity error printed as a value. After `<`, `<=`, `within`, `tol`, `lr` or `=` it is a bound or
  a setting, and passes.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# A number with its mantissa and optional exponent; not part of a word or of a longer number.
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:[eE]([-+]?\d+))?(?![\w.])")
# What may stand before a tiny number for it to be a bound or a setting, not a measured value.
BOUND_BEFORE = re.compile(r"(<=?|within|tol|lr|=|\()\s*$")
MAX_DIGITS = 6


def significant_digits(mantissa: str) -> int:
    """Digits that carry information: leading zeros don't ("0.000977" has 3), and neither do
    trailing ones (a whole number printed as a float, "1000000000000.0", has 1)."""
    return len(mantissa.replace(".", "").strip("0")) or 1


def noisy_floats(text: str) -> list[str]:
    """The floats in `text` that break the rule (module docstring), each as printed."""
    found = []
    for m in NUMBER.finditer(text):
        mantissa, exponent = m.group(1), m.group(2)
        if "." not in mantissa and exponent is None:
            continue  # an integer
        if "." in mantissa and significant_digits(mantissa) > MAX_DIGITS:
            found.append(m.group(0))
        elif exponent is not None and int(exponent) <= -5 and not BOUND_BEFORE.search(
                text[max(0, m.start() - 12):m.start()]):
            found.append(m.group(0))
    return found


def compared_outputs(notebook: Path):
    """(cell index, output text) of each code cell nbval compares (not tagged nbval-ignore-output
    or nbval-skip): its streams and text/plain results."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    for i, cell in enumerate(cells):
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.get("cell_type") != "code" or {"nbval-ignore-output", "nbval-skip"} & set(tags):
            continue
        text = "".join("".join(out.get("text", "")) + "".join(out.get("data", {}).get(
            "text/plain", "")) for out in cell.get("outputs", []))
        if text:
            yield i, text


def check(notebook: Path) -> list[str]:
    """One line per compared cell of `notebook` that prints a float breaking the rule."""
    return [f"{Path(notebook).name} cell {i}: {', '.join(bad[:3])} (round it, or print a bound)"
            for i, text in compared_outputs(notebook) if (bad := noisy_floats(text))]


def cpu_features() -> str:
    """The CPU features that change which kernels torch runs, for a test report's header."""
    import platform
    machine = platform.machine()
    try:
        flags = next(line.split(":", 1)[1].split() for line in
                     Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        return machine
    wanted = ("amx_tile", "avx512_fp16", "avx512_bf16", "avx512f", "avx2", "sve", "asimd")
    return " ".join([machine, *(f for f in wanted if f in flags)])


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m distkit.course.portable NOTEBOOK...", file=sys.stderr)
        return 2
    lines = [line for nb in argv for line in check(Path(nb))]
    print("\n".join(lines) or f"{len(argv)} notebook(s): every compared float is portable")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
