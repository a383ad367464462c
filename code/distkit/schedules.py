"""Pipeline schedules as data: each rank's action list, a timeline computed from it, its bubble.

torch.distributed.pipelining describes a schedule by what each rank computes, in order: "F"
(a micro-batch's forward through one stage), "B" (its whole backward), or, in the zero-bubble
schedules, "I" (the backward to the stage's input, which the previous stage waits for) and "W"
(the weight gradients, which nobody waits for). This module
- reads those lists from torch (`actions`, via torch's own `get_schedule_ops`, which needs no
  process group), or builds 1F1B's from its runtime loop (`one_f_one_b`);
- plays them on an idealised machine (`simulate`): each action starts when its rank is free and
  its inputs exist (a forward needs the previous stage's forward, a backward the next stage's),
  takes a fixed time per kind (COSTS: F 1, B 2 = I 1 + W 1), and sends cost nothing;
- counts each rank's idle time in that timeline (`idle`) for comparison with the bubble
  formulas (`bubble_formula`), and the micro-batches whose activations a rank holds at its peak
  (`in_flight`).
`recording_stage` wraps PipelineStage so that a real run notes what each rank ran, to compare
with the lists. Chapter 10 (code/ch10_float8_3d/schedules.py) uses all of them.

Sources: torch 2.13, torch/distributed/pipelining/schedules.py (the schedule classes, their
`pipeline_order`, `_PipelineScheduleRuntime._step_microbatches`, which runs an OVERLAP_F_B
action's sub-actions one after the other) and _schedule_visualizer.py (`get_schedule_ops`);
Narayanan et al. 2021 (interleaved 1F1B: bubble (p-1)(t_f+t_b)/v); Qi et al., "Zero Bubble
Pipeline Parallelism", ICLR 2024 (B split into I and W; ZB-H1's bubble (p-1)(t_F+t_B-t_W)).
"""
from __future__ import annotations

from fractions import Fraction

COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}  # a backward ~ 2 forwards: input grad + weight grad
SINGLE = ("GPipe", "1F1B")                 # one stage per rank
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")  # rank r: stages r, r+p, ...
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r: stages r and 2p-1-r
SCHEDULES = SINGLE + LOOPED + V_SHAPED
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def stages_of(schedule: str, rank: int, pp: int, per_rank: int = 2) -> list[int]:
    """The stage indices rank `rank` holds: r (single), r, r+p, r+2p... (looped), r and 2p-1-r
    (V: the model goes down the ranks and comes back up, so the last stage sits on rank 0)."""
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]


def actions(schedule: str, pp: int, microbatches: int, per_rank: int | None = None) -> list:
    """Each rank's compute actions in order, as (stage, kind, micro-batch) tuples, from torch's
    own lists (`get_schedule_ops`, no process group needed). Idle slots (None) and bookkeeping
    (REDUCE_GRAD) are dropped; an OVERLAP_F_B action (DualPipeV) becomes its sub-actions, which
    torch 2.13 runs one after the other unless a custom function is registered for it."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I",
            "BACKWARD_WEIGHT": "W"}
    ops = get_schedule_ops(schedule, pp, microbatches, per_rank)
    out = []
    for rank_ops in ops:
        mine = []
        for a in rank_ops:
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                name = sub.computation_type.name
                if name in kind:
                    mine.append((sub.stage_index, kind[name], sub.microbatch_index))
        out.append(mine)
    return out


def one_f_one_b(pp: int, microbatches: int) -> list:
    """1F1B's actions as torch 2.13 runs them (Schedule1F1B._step_microbatches): stage r runs
    min(m, p - r) warm-up forwards, then alternates one backward and one forward, then the
    remaining backwards. (Its `pipeline_order`, which get_schedule_ops reads, is only a
    description, and its last stage's is off by one micro-batch: see chapter 10.)"""
    out = []
    for r in range(pp):
        warm = min(microbatches, pp - r)
        mine = [(r, "F", i) for i in range(warm)]
        for i in range(microbatches):
            mine.append((r, "B", i))
            if warm + i < microbatches:
                mine.append((r, "F", warm + i))
        out.append(mine)
    return out


def simulate(action_lists: list, costs: dict | None = None) -> list:
    """Play the lists on an ideal machine; returns each rank's spans (stage, kind, micro-batch,
    start, end). A forward of stage s waits for stage s-1's forward of the same micro-batch; a
    backward (B or I) for stage s+1's (B or I) and for its own forward; W for its own I. Raises
    ValueError naming an action that can never run (its input is never produced, or two ranks
    wait for each other)."""
    costs = {**COSTS, **(costs or {})}
    stages = 1 + max(s for rank in action_lists for s, _, _ in rank)
    done = {}  # (stage, kind, micro-batch) -> when it ended
    spans = [[] for _ in action_lists]
    free = [0] * len(action_lists)
    todo = [list(rank) for rank in action_lists]

    def inputs(stage, kind, mb):  # each entry: any one of these will do
        if kind == "F":
            return [] if stage == 0 else [[(stage - 1, "F", mb)]]
        if kind == "W":
            return [[(stage, "I", mb)]]
        own = [[(stage, "F", mb)]]
        return own if stage == stages - 1 else own + [[(stage + 1, "B", mb),
                                                       (stage + 1, "I", mb)]]
    moved = True
    while moved:
        moved = False
        for r, queue in enumerate(todo):
            while queue:
                action = queue[0]
                ready = [min(done[k] for k in alts if k in done) if any(k in done for k in alts)
                         else None for alts in inputs(*action)]
                if None in ready:
                    break  # not yet: another rank must run first
                start = max([free[r], *ready])
                free[r] = done[action] = start + costs[action[1]]
                spans[r].append((*action, start, free[r]))
                queue.pop(0)
                moved = True
    stuck = [(r, q[0]) for r, q in enumerate(todo) if q]
    if stuck:
        listed = {a for rank in action_lists for a in rank}
        for r, action in stuck:  # the root cause: an input that no list ever produces
            missing = [alts for alts in inputs(*action) if not listed & set(alts)]
            if missing:
                s, k, mb = missing[0][0]
                raise ValueError(f"rank {r} can never run {''.join(map(str, action))}: it needs "
                                 f"{s}{k}{mb}, which no rank's list holds")
        raise ValueError("the ranks wait for each other: " + ", ".join(
            f"rank {r} at {''.join(map(str, a))}" for r, a in stuck))
    return spans


def idle(spans: list) -> list[tuple]:
    """Per rank: (idle time, step time), the step being first start to last end over all ranks,
    so that a rank which finishes early idles until the others are done."""
    step = max(s[4] for rank in spans for s in rank) - min(s[3] for rank in spans for s in rank)
    return [(step - sum(s[4] - s[3] for s in rank), step) for rank in spans]


def bubble_formula(schedule: str, pp: int, microbatches: int, per_rank: int = 2) -> Fraction:
    """The idle fraction of a step the literature gives, with t_F = 1, t_B = 2 (t_I = t_W = 1)
    per stage and micro-batch, v stages per rank of L/(p v) layers each:
    - GPipe, 1F1B: (p-1)/(m+p-1) (fill and drain of p-1 stages, each t_F + t_B);
    - Interleaved1F1B, LoopedBFS: idle (p-1)(t_F+t_B) out of v m (t_F+t_B) + that, i.e.
      (p-1)/(v m + p-1): the fill and drain shrink by v, because a stage is v times smaller;
    - the zero-bubble schedules: what is left when W fills the drain, (p-1) t_F at equal costs
      (ZB-H1's (p-1)(t_F + t_I - t_W) = (p-1)), out of 3 v m: (p-1)/(3 v m + p-1);
    - except ZBVZeroBubble with few micro-batches: rank 0's second stage (the last, 2p-1) can
      start only once micro-batch 0 has gone down the V and up again, 2p-1 forwards, so with
      m < 2p-1 rank 0 idles 2p-1-m units before it and as many at the end (the last backward
      comes back the same way): idle max(p-1, 2(2p-1-m)), i.e. the formula above only from
      m >= (3p-1)/2; at torchtitan's old default m = p = 8, 7/31 instead of 7/55. (DualPipeV,
      the other V, refuses m < 2p in torch 2.13.)
    Each equals the idle time counted from torch 2.13's lists (tests/test_ch10_distkit.py)."""
    p, m, v = pp, microbatches, (1 if schedule in SINGLE else per_rank)
    if schedule in SINGLE:
        return Fraction(p - 1, m + p - 1)
    if schedule == "ZBVZeroBubble":
        wait = max(p - 1, 2 * (2 * p - 1 - m))
        return Fraction(wait, 3 * v * m + wait)
    if schedule in ZERO_BUBBLE:
        return Fraction(p - 1, 3 * v * m + p - 1)
    return Fraction(p - 1, v * m + p - 1)


def in_flight(action_lists: list) -> list[int]:
    """Per rank, the most (stage, micro-batch) forwards whose activations it holds at once: kept
    from F until that micro-batch's B (or W, whose weight gradient still needs the stage's
    inputs). In units of one stage's activations for one micro-batch."""
    peaks = []
    for rank in action_lists:
        live = peak = 0
        for _, kind, _ in rank:
            live += {"F": 1, "B": -1, "W": -1}.get(kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def recording_stage(stage_cls, log: list):
    """A subclass of a pipelining stage class that appends (stage, kind, micro-batch) to `log`
    for every forward, backward (B, or I when the weight gradients are deferred) and
    weight-gradient chunk it computes: what this rank really ran, in order."""

    class Recording(stage_cls):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            log.append((self.stage_index, "F", fwd_chunk_id))
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, full_backward=True, **kwargs):
            log.append((self.stage_index, "B" if full_backward else "I", bwd_chunk_id))
            return super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward,
                                              **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            log.append((self.stage_index, "W", bwd_chunk_id))
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    Recording.__name__ = f"Recording{stage_cls.__name__}"
    return Recording
