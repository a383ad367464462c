"""Chapter 10's exercises through their checker: each solution passes, and plausible wrong answers
fail with a line that names the mistake (tests/test_exercises.py checks every starter's first
TODO and that starters are generated). One process per check (about 4 CPU-s each: importing
torch), all at once: the solutions and one wrong answer each in `make test`, the others in
`make test-nproc`."""
import pytest

exercise = pytest.importorskip("distkit.course.exercise")  # the checker (make exercise)

AMAX = "amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)"
SCALE = "scale = (top / amax.double().clamp(min=EPS)).float()"
WRONG = {
    # 10.1: the scale inverted, amax of x instead of |x|, no floor under amax, no clamp
    "inverted": ("10.1", ("scale = (top / amax.double().clamp(min=EPS)).float()",
                          "scale = (amax.double().clamp(min=EPS) / top).float()")),
    "no abs": ("10.1", ("amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, "
                        "keepdim=True)",
                        "amax = x.amax() if dim is None else x.amax(dim=dim, keepdim=True)")),
    "no eps": ("10.1", ("scale = (top / amax.double().clamp(min=EPS)).float()",
                        "scale = (top / amax.double()).float()")),
    "no clamp": ("10.1", ("x8 = (x * scale).clamp(-top, top).to(dtype)",
                          "x8 = (x * scale).to(dtype)")),
    # 10.1, each passing every check before the e5m2 scale, the per-column and zero-row cases
    # (planted against the previous checker: all PASS): e4m3's 448 written into the scale
    # (e5m2's scale off by exactly 2^7, its round trip error unchanged); the amax over dim 1
    # whatever dim is; the EPS floor on the per-tensor amax only; keepdim on the whole tensor too
    "448 in the scale": ("10.1", (SCALE, "scale = (448.0 / amax.double().clamp(min=EPS))"
                                         ".float()")),
    "dim 1 fixed": ("10.1", (AMAX, "amax = x.abs().amax() if dim is None else "
                                   "x.abs().amax(dim=1, keepdim=True)")),
    "eps per tensor only": ("10.1", [(AMAX, "amax = x.abs().amax().clamp(min=EPS) if dim is "
                                            "None else x.abs().amax(dim=dim, keepdim=True)"),
                                     (SCALE, "scale = (top / amax.double()).float()")]),
    "keepdim always": ("10.1", (AMAX, "amax = x.abs().amax(dim=dim, keepdim=True)")),
    # 10.2: actions that never wait for their inputs; each rank's own end as its step; B = F
    "no waiting": ("10.2", ("start = max([free[r], *ready])", "start = free[r]")),
    "own end": ("10.2", ("return [step - sum(end - start for start, end in rank) for rank in "
                         "spans], step",
                         "return [rank[-1][1] - sum(end - start for start, end in rank) "
                         "for rank in spans], step")),
    # the step taken as rank 0's end (its last backward): right for four schedules, not ZBV
    # (once named "no rank ever waits; does an action wait for its inputs?": expert_ch10 F10)
    "rank 0's end": ("10.2", ("step = max(end for rank in spans for _, end in rank)",
                              "step = spans[0][-1][1]")),
    "B costs 1": ("10.2", ('COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}',
                           'COSTS = {"F": 1, "B": 1, "I": 1, "W": 1}')),
}
EXPECT = {"inverted": "inverted (amax / 448)?", "no abs": "is amax taken of |x|",
          "no eps": "amax at EPS", "no clamp": "clamp to +-fp8_max",
          "448 in the scale": "448 is e4m3's largest value; take the format's own",
          "dim 1 fixed": "not over a fixed dimension?",
          "eps per tensor only": "an infinite scale: floor every slice's amax at EPS, per row",
          "keepdim always": "per tensor: a scale of shape [1, 1], not a 0-dim tensor",
          "no waiting": "does an action wait for its inputs",
          "own end": "the step ends for every rank when the last one ends",
          "rank 0's end": "the step ends when the LAST rank ends, for every rank",
          "B costs 1": "the costs?"}


HEADLINE = ("inverted", "no waiting")  # make test; the other wrong answers: make test-nproc


def test_solutions_pass_and_headline_wrong_answers_fail(tmp_path):
    jobs = {"10.1": ("10.1", None), "10.2": ("10.2", None),
            **{name: WRONG[name] for name in HEADLINE}}
    runs = exercise.check_at_once(jobs, tmp_path, nprocs=(1,))
    for ex in ("10.1", "10.2"):
        ok, lines, _ = runs[ex]
        assert ok, lines
    for name in HEADLINE:
        ok, lines, _ = runs[name]
        assert not ok and EXPECT[name] in lines[-1], (name, lines)


@pytest.mark.second_nproc
def test_other_wrong_answers_fail(tmp_path):
    runs = exercise.check_at_once({n: w for n, w in WRONG.items() if n not in HEADLINE},
                                  tmp_path, nprocs=(1,))
    for name, (ok, lines, _) in runs.items():
        assert not ok and EXPECT[name] in lines[-1], (name, lines)

