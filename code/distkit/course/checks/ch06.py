"""Exercise checks for chapter 06 (the capstone); see distkit/course/checks/__init__.py."""
import math
from pathlib import Path

from distkit.course.exercise import exercise
from distkit.course.checks import losses_match

REPLICATE = 2  # the script's default: two "nodes"


def expected_groups(N: int, R: int) -> list[dict]:
    """Each rank's groups on a row-major R x N/R mesh: its row (shard), its column (replicate)."""
    S = N // R
    return [{"replicate": list(range(r % S, N, S)), "shard": list(range(r - r % S, r - r % S + S))}
            for r in range(N)]


@exercise("06.1", "ch06_capstone/exercises/ex06_hsdp_guard.py", nprocs=(2, 4))
def hsdp_guard(run):
    N, R = run.nproc, REPLICATE
    S = N // R
    ckpt = Path(run.tmp) / f"ckpt{N}"
    res = run("--replicate", R, "--ckpt-dir", ckpt)
    shape, names = res["mesh_shape"], res["mesh_dim_names"]
    yield ((shape, names) == ([R, S], ["replicate", "shard"]),
           f"the mesh is {R} x {S}, named (replicate, shard)",
           f"the mesh is {' x '.join(map(str, shape))} named {tuple(names)}, not {R} x {S} "
           "named ('replicate', 'shard')")
    want = ["('Replicate()', 'Shard(dim=0)')"]
    yield (res["placements"] == want, "every parameter is placed (Replicate(), Shard(dim=0))",
           f"parameters are placed {', '.join(res['placements'])}; HSDP's are "
           "(Replicate(), Shard(dim=0)): is every unit sharded on the 2-D mesh?")
    groups = expected_groups(N, R)
    got = [r["groups"] for r in res["ranks"]]
    bad = next((i for i in range(N) if got[i] != groups[i]), None)
    rows = sorted({tuple(g["shard"]) for g in groups})
    yield (bad is None, f"rows = consecutive ranks: shard groups {list(map(list, rows))}",
           f"rank {bad}'s groups are {got[bad]}, expected {groups[bad]} (row-major: a row is a "
           "node's consecutive ranks)" if bad is not None else "")
    for r, (rank, g) in enumerate(zip(res["ranks"], groups)):
        want = {("all_reduce", tuple(g["replicate"]))} | (
            {("all_gather", tuple(g["shard"])), ("reduce_scatter", tuple(g["shard"]))}
            if S > 1 else set())
        seen = {(op, tuple(ranks)) for op, ranks in rank["step1_collectives"]}
        if seen != want:
            yield (False, "", f"rank {r}'s collectives in step 1 span {sorted(seen)}, expected "
                   f"{sorted(want)}: gathers and reduce-scatters within its row, the gradient "
                   "all-reduce down its column")
    yield (True, "all-gathers and reduce-scatters within a row, gradient all-reduces down a "
           "column (step 1, every rank)", "")
    held, whole = [r["param_bytes_held"] for r in res["ranks"]], res["param_bytes"]
    yield (held == [whole // S] * N, f"each rank holds 1/{S} of the parameters: {held[0]:,} "
           f"bytes of {whole:,}", f"parameter bytes held per rank {held}, expected "
           f"{whole // S:,} each (1/{S} of {whole:,})")
    K = res["fault_step"]
    stopped = [r["stopped_at"] for r in res["ranks"]]
    ok, passed, failed = losses_match(res["losses"], res["single_losses"][:len(res["losses"])],
                                      res["tolerance"], "one process's on the whole batch",
                                      scaled="is the all-reduced loss divided by the N ranks?")
    if not ok and not all(math.isfinite(x) for x in res["losses"]) and stopped != [K] * N:
        # a NaN loss after the corrupted step: the guard let the optimizer step on it
        failed += (f"; the ranks stopped at steps {stopped} (None: ran to the end), not at step "
                   f"{K}, where a gradient was corrupted: does the verdict read the gradient "
                   "norm, not only the loss?")
    yield ok, passed, failed
    yield (not res["problem"], "the guard's verdict is the same on every rank at every step",
           f"{res['problem']}: ranks {[r for r, v in enumerate(res['verdicts'][-1]) if v]} "
           f"would stop, ranks {[r for r, v in enumerate(res['verdicts'][-1]) if not v]} go on "
           "(a real job parts there): decide on values every rank shares"
           if res["problem"] else "")
    guard = [r["share_collectives"] for r in res["ranks"]]
    yield (guard == [[["all_reduce", list(range(N))]]] * N,
           f"share(): one all-reduce over all {N} ranks",
           f"share()'s collectives per rank: {guard}; expected one all_reduce over ranks "
           f"{list(range(N))}")
    yield (stopped == [K] * N, f"every rank stopped at step {K}, the corrupted one",
           f"the ranks stopped at steps {stopped} (None: ran to the end), not at step {K}, "
           "where a gradient was corrupted")
    finite = [r["weights_finite"] for r in res["ranks"]]
    yield (all(finite), "no weight is NaN: the optimizer did not step",
           f"weights hold a NaN on ranks {[r for r, f in enumerate(finite) if not f]}: the "
           "optimizer stepped on the corrupted gradient")
    on_disk = sorted(int(p.name[5:]) for p in ckpt.glob("step_*"))
    before = list(range(res["save_every"], K, res["save_every"]))
    yield (on_disk == before, f"checkpoints on disk: steps {before}, none of step {K} or later",
           f"checkpoints on disk: steps {on_disk}, expected {before} (none from step {K} on)")
    yield (run.returncode != 0 and "(exit code 3)" in run.stdout,
           f"the job failed: exit status {run.returncode}, the ranks' 3",
           f"the launch ended with exit status {run.returncode} after the guard stopped it"
           + ("" if run.returncode else ": a scheduler would call the run a success")
           + ("" if "(exit code 3)" in run.stdout else "; the ranks' status is not 3"))
