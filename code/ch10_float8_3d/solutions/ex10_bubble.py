"""Exercise 10.2: a pipeline schedule's bubble, counted from its action lists.

    PYTHONPATH=code python code/ch10_float8_3d/exercises/ex10_bubble.py --schedule Interleaved1F1B

Solution: ../solutions/ex10_bubble.py

torch publishes what each rank of a pipeline computes, in order: (stage, kind, micro-batch)
with kind "F" (forward), "B" (whole backward), "I" (backward to the input only) or "W" (the
weight gradients); distkit.schedules.actions reads those lists from torch. Play them on an ideal
machine, where a forward takes 1 unit, a backward 2 (I and W 1 each) and sending costs nothing:
each rank runs its list in order, and an action starts once its rank is free *and* its inputs
exist (`needs`). A rank's idle time is the step (first start to last end over all ranks) minus
the time it computed. `make exercise EX=10.2` checks your counts on several schedules against
distkit.schedules and the formulas of notebook 10, section 5.

Predict, then measure:
1. Interleaved1F1B with p = 4 ranks, 2 stages each, m = 8 micro-batches: each rank's idle units,
   and the bubble fraction? (1F1B's is (p-1)/(m+p-1) = 3/11.)
2. InterleavedZeroBubble at the same p and m: how many units of rank 0's idle time does moving
   the weight gradients (W) into the gaps remove?
"""
import argparse
import json

from distkit import todo
from distkit.schedules import SCHEDULES, actions, bubble_formula, one_f_one_b

COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}  # units of time per stage and micro-batch
# the cases `make exercise` checks: (schedule, ranks p, micro-batches m)
CASES = [("GPipe", 4, 8), ("1F1B", 4, 8), ("Interleaved1F1B", 2, 4), ("Interleaved1F1B", 4, 8),
         ("InterleavedZeroBubble", 4, 8), ("ZBVZeroBubble", 2, 4), ("DualPipeV", 2, 4)]


def needs(stage: int, kind: str, mb: int, last_stage: int) -> list[list[tuple]]:
    """What must have ended before (stage, kind, mb) can start: a list of groups, any one action
    of a group will do. A forward needs the previous stage's forward of the same micro-batch; a
    backward (B or I) its own forward and the next stage's backward (B or I); W its own I."""
    if kind == "F":
        return [] if stage == 0 else [[(stage - 1, "F", mb)]]
    if kind == "W":
        return [[(stage, "I", mb)]]
    own = [[(stage, "F", mb)]]
    return own if stage == last_stage else own + [[(stage + 1, "B", mb), (stage + 1, "I", mb)]]


def timeline(action_lists: list) -> list[list[tuple]]:
    """Each rank's (start, end) for each of its actions, in its list's order."""
    last_stage = max(stage for rank in action_lists for stage, _, _ in rank)
    done = {}                        # (stage, kind, micro-batch) -> when it ended
    free = [0] * len(action_lists)   # when each rank is next free
    spans = [[] for _ in action_lists]
    queues = [list(rank) for rank in action_lists]
    while any(queues):
        progressed = False
        for r, queue in enumerate(queues):
            while queue:
                stage, kind, mb = queue[0]
                ### BEGIN SOLUTION: start this rank's next action once its inputs have ended
                ### HINT For each group of needs(...), the earliest end among its actions that are
                ### HINT done; if a group has none yet, stop here and let the other ranks move.
                ### HINT The action starts when the rank is free and every group is ready.
                ready = [min((done[a] for a in group if a in done), default=None)
                         for group in needs(stage, kind, mb, last_stage)]
                if None in ready:
                    break  # an input is not computed yet: the other ranks first
                start = max([free[r], *ready])
                ### END SOLUTION
                free[r] = done[(stage, kind, mb)] = start + COSTS[kind]
                spans[r].append((start, free[r]))
                queue.pop(0)
                progressed = True
        if not progressed:
            raise ValueError("no rank can move: the lists wait for each other")
    return spans


def idle_units(spans: list) -> tuple[list, float]:
    """(each rank's idle time, the step's length)."""
    ### BEGIN SOLUTION: the step, and each rank's time in it without work
    ### HINT The step ends when the last rank ends, for every rank.
    step = max(end for rank in spans for _, end in rank)
    return [step - sum(end - start for start, end in rank) for rank in spans], step
    ### END SOLUTION


def lists(schedule: str, pp: int, m: int) -> list:
    """torch's action lists (1F1B: as its runtime loop runs it; notebook 10 shows why)."""
    return one_f_one_b(pp, m) if schedule == "1F1B" else actions(schedule, pp, m)


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--schedule", choices=SCHEDULES, help="one schedule (default: every case)")
parser.add_argument("--pp", type=int, default=4, help="ranks")
parser.add_argument("--microbatches", type=int, default=8)
parser.add_argument("--json", help="write each case's idle units here")
args = parser.parse_args()
if args.pp < 2 or args.microbatches < 1:
    parser.error("need --pp >= 2 and --microbatches >= 1")
cases = [(args.schedule, args.pp, args.microbatches)] if args.schedule else CASES
results = []
for schedule, pp, m in cases:
    spans = timeline(lists(schedule, pp, m))
    idle, step = idle_units(spans)
    formula = bubble_formula(schedule, pp, m)
    print(f"{schedule:22s} p={pp} m={m}: idle units per rank {idle} of a step of {step}; "
          f"bubble {idle[0] / step:.3f}, formula {float(formula):.3f}")
    results.append({"schedule": schedule, "pp": pp, "m": m, "idle": idle, "step": step,
                    "ends": [max((end for _, end in rank), default=0) for rank in spans]})
if args.json:
    with open(args.json, "w") as f:
        json.dump({"cases": results}, f, indent=1)
### BEGIN SOLUTION
# Answers: 1. 9 units on every rank of a 57-unit step: 3/19 = 0.158, (p-1)/(v m + p-1) with v = 2,
# where 1F1B idles 9 of 33. 2. 6 of the 9: rank 0 idles 3 units of 51; (p-1) forwards' worth remain.
### END SOLUTION
