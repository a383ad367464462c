"""Exercise checks for chapter 10 (float8, schedules, 3-D); see distkit/course/checks/__init__.py.

The reference numbers come from the lesson layer the chapter teaches with: distkit.fp8 (torchao's
scale rule) for 10.1, distkit.schedules (the same timeline, and the bubble formulas) for 10.2.
"""
from distkit.course.exercise import exercise


def _fp8_reference() -> dict:
    """The numbers a right to_float8 gives on exercise 10.1's cases, from distkit.fp8."""
    import torch

    from distkit.fp8 import E4M3, E5M2, from_float8, relative_error, to_float8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    out = {}
    for name, dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
        x8, scale = to_float8(x, dtype)
        out[f"gaussian {name}"] = {"scale": scale.item(),
                                   "error": relative_error(from_float8(x8, scale), x)}
    outlier = x.clone()
    outlier[0, 7] = -1e5
    for name, dim, dtype in (("per tensor", None, E4M3), ("per row", 1, E4M3),
                             ("per column e5m2", 0, E5M2)):
        x8, scale = to_float8(outlier, dtype, dim=dim)
        back = from_float8(x8, scale)
        out[f"outlier {name}"] = {"scale": scale.reshape(-1)[0].item(),
                                  "scale shape": list(scale.shape),
                                  "error rest": relative_error(back[1:], outlier[1:]),
                                  "zeros rest": (x8[1:].float() == 0).float().mean().item()}
    zero_row = x.clone()
    zero_row[3] = 0
    x8, scale = to_float8(zero_row, E4M3, dim=1)
    out["zero row per row"] = {"error": relative_error(from_float8(x8, scale), zero_row)}
    return out


def _close(a, b, rel=1e-4) -> bool:
    return abs(a - b) <= rel * abs(b)


@exercise("10.1", "ch10_float8_3d/exercises/ex10_float8_scale.py", nprocs=(1,))
def float8_scale(run):
    """Scales and round-trip errors against distkit.fp8's (torchao's rule), one case at a time,
    each failure naming the likely mistake."""
    res, ref = run(), _fp8_reference()
    got, want = res["gaussian e4m3"]["scale"], ref["gaussian e4m3"]["scale"]
    yield (_close(got, want), f"scale of a gaussian tensor = 448 / amax(|x|) = {want:.4g}",
           f"scale of a gaussian tensor is {got:.4g}, not 448 / amax(|x|) = {want:.4g}"
           + (": inverted (amax / 448)?" if _close(got * want, 1.0, 1e-3) else
              ": is amax taken of |x| (the most negative value counts too)?" if got > want
              else ""))
    # e5m2's own maximum (57344): 448 in e5m2's scale is off by exactly 2^7, which no round
    # trip error shows (the same mantissas, 7 binades lower)
    got, want = res["gaussian e5m2"]["scale"], ref["gaussian e5m2"]["scale"]
    yield (_close(got, want), f"e5m2's scale = 57344 / amax(|x|) = {want:.4g}",
           f"e5m2's scale is {got:.4g}, not 57344 / amax(|x|) = {want:.4g}"
           + (": 448 is e4m3's largest value; take the format's own, "
              "torch.finfo(dtype).max" if _close(got, want * 448 / 57344) else ""))
    for fmt in ("e4m3", "e5m2"):
        got, want = res[f"gaussian {fmt}"]["error"], ref[f"gaussian {fmt}"]["error"]
        yield (_close(got, want, 1e-3), f"{fmt} round trip of a gaussian tensor: "
               f"{100 * want:.1f} % error",
               f"{fmt} round trip of a gaussian tensor: {100 * got:.1f} % error, expected "
               f"{100 * want:.1f} %")
    got, want = res["outlier per tensor"]["scale"], ref["outlier per tensor"]["scale"]
    yield (_close(got, want), "a negative outlier of -1e5 sets the scale: 448 / 1e5",
           f"with an outlier of -1e5 the scale is {got:.4g}, not 448 / 1e5 = {want:.4g}: "
           "is amax taken of |x| (a negative value is a magnitude too)?")
    if "outlier per column e5m2" not in res or "zero row per row" not in res:
        yield (False, "", "this file does not run the per-column and zero-row cases: copy them "
               "from the current starter (git diff shows them)")
        return
    shape = res["outlier per tensor"]["scale shape"]
    yield (shape == [], "per tensor: one scale, a 0-dim tensor",
           f"per tensor: a scale of shape {shape}, not a 0-dim tensor (dim None: amax over "
           "everything, no keepdim)")
    shape = res["outlier per row"]["scale shape"]
    yield (shape == [64, 1], "per row: one scale per row, shape [64, 1]",
           f"per row: scales of shape {shape}, expected [64, 1] (amax over dim 1, keepdim)")
    shape = res["outlier per column e5m2"]["scale shape"]
    yield (shape == [1, 256], "per column (dim 0): one scale per column, shape [1, 256]",
           f"per column (dim 0): scales of shape {shape}, expected [1, 256]: is the amax taken "
           "over `dim`, whatever it is (keepdim=True), not over a fixed dimension?")
    got = res["outlier per column e5m2"]["scale column 0"]
    want = ref["outlier per column e5m2"]["scale"]
    yield (_close(got, want), f"per column, e5m2: column 0's scale = 57344 / its amax = "
           f"{want:.4g}", f"per column, e5m2: column 0's scale is {got:.4g}, not 57344 / its "
           f"amax = {want:.4g}")
    for name in ("outlier per tensor", "outlier per row", "outlier per column e5m2"):
        got, want = res[name]["error rest"], ref[name]["error rest"]
        yield (_close(got, want, 1e-3), f"{name}: the other rows' error {100 * want:.1f} %",
               f"{name}: the other rows' error is {100 * got:.1f} %, expected {100 * want:.1f} %")
    row = res["zero row per row"]
    yield (row["scales finite"] and row["back finite"] and row["row back all zero"]
           and _close(row["error"], ref["zero row per row"]["error"], 1e-3),
           "per row with a row of zeros: finite scales, that row's zeros back",
           "per row with a row of zeros: " + (
               "an infinite scale" if not row["scales finite"] else "inf or nan back"
               if not row["back finite"] else "non-zeros back in the zero row"
               if not row["row back all zero"] else
               f"{100 * row['error']:.1f} % error, expected "
               f"{100 * ref['zero row per row']['error']:.1f} %")
           + ": floor every slice's amax at EPS, per row too, before dividing")
    zeros = res["zeros"]
    yield (zeros["scale finite"] and zeros["back all zero"],
           "an all-zero tensor: a finite scale, zeros back",
           "an all-zero tensor gives " + ("an infinite scale" if not zeros["scale finite"] else
                                          "non-zeros back") + ": floor amax at EPS before dividing")
    stale = res["stale scale e5m2"]
    yield (stale["finite"] and stale["largest"] == 57344.0,
           "a stale scale and large gradients: saturated at 57344 in e5m2, no inf",
           f"a stale scale and large gradients: largest {stale['largest']:g} in e5m2 "
           "(inf: clamp to +-fp8_max before the cast; e5m2 overflows to inf)")


@exercise("10.2", "ch10_float8_3d/exercises/ex10_bubble.py", nprocs=(1,))
def bubble(run):
    """Each case's idle units per rank against distkit.schedules' timeline of torch's lists, and
    the bubble fraction against the formula."""
    from distkit.schedules import bubble_formula, idle, one_f_one_b, simulate, actions
    for case in run()["cases"]:
        s, p, m = case["schedule"], case["pp"], case["m"]
        lists = one_f_one_b(p, m) if s == "1F1B" else actions(s, p, m)
        timeline = simulate(lists)
        want = idle(timeline)
        idle_want, step_want = [i for i, _ in want], want[0][1]
        ends_want = [max((end for *_, end in rank), default=0) for rank in timeline]
        name = f"{s} p={p} m={m}"
        hint = ""
        if case.get("ends") == ends_want and case["step"] != step_want:
            # the timeline is right, the step is not: one rank's end taken for everyone's
            hint = (f": your step lasts {case['step']}, but the ranks end at {ends_want}: the "
                    "step ends when the LAST rank ends, for every rank")
        elif not any(case["idle"]):
            hint = ": no rank ever waits; does an action wait for its inputs to end?"
        elif case["step"] != step_want:
            hint = f" (your step lasts {case['step']}, expected {step_want}: the costs?)"
        elif len(set(case["idle"])) > 1 and len(set(idle_want)) == 1:
            hint = ": the step ends for every rank when the last one ends"
        yield (case["idle"] == idle_want, f"{name}: idle {idle_want} units of {step_want}",
               f"{name}: idle {case['idle']} units, expected {idle_want}{hint}")
        frac, formula = idle_want[0] / step_want, bubble_formula(s, p, m)
        yield (abs(case["idle"][0] / case["step"] - frac) < 1e-9,
               f"{name}: bubble {frac:.3f} = formula {float(formula):.3f}",
               f"{name}: bubble {case['idle'][0] / case['step']:.3f}, the formula says "
               f"{float(formula):.3f}")
