"""Chapter 02, pipeline bubbles measured: GPipe and 1F1B, how long each stage waits, against theory.

    code/run_w_torchrun.sh 2 ch02_model_parallel/pipeline_bench.py --json /tmp/bubbles.json

With p stages and m micro-batches, if every stage takes the same time per micro-batch, each
stage idles a fraction (p-1)/(m+p-1) of the step: the pipeline fills and drains once per step.
This script measures it. Each stage notes when it computes a forward or a backward (the
schedules' send and receive happen between those spans), for every schedule and micro-batch
count, over several repeats in turn; a stage's idle fraction is the time outside its spans over
the whole step. The stages get enough work per micro-batch (--layers, --hidden, --mb-size) that
the milliseconds of sending and waking up are small beside it. Then:
- peak activation memory per stage (what autograd keeps for backward), GPipe vs 1F1B;
- unbalanced stages (--unbalanced layers per stage): the slowest stage sets the pace.
The weights are not updated (no optimizer step): each step does the same work.
"""
import argparse
import os
import statistics

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from distkit import int_list, print0, seed_everything, setup, teardown, write_json
from distkit.pipe import (LlamaStage, SavedActivations, Timeline, idle_fractions, lm_loss,
                          split_layers, timed_stage)
from distkit.toy import tiny_llama

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--microbatches", type=int_list, default=[1, 2, 4, 8],
                    help="micro-batch counts m to sweep (1F1B runs those >= the stage count)")
parser.add_argument("--schedules", default="gpipe,1f1b", help=", ".join(SCHEDULES))
parser.add_argument("--layers", type=int, default=8, help="decoder layers, split evenly")
parser.add_argument("--hidden", type=int, default=256)
parser.add_argument("--mb-size", type=int, default=4, help="sequences per micro-batch")
parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
parser.add_argument("--repeats", type=int, default=5,
                    help="timed steps per setting (the fastest is kept)")
parser.add_argument("--unbalanced", type=int_list, default=[6, 2],
                    help="layers per stage for the unbalanced run (1F1B, largest m); '' to skip")
parser.add_argument("--json", help="write the measurements here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
schedules = args.schedules.split(",")
if world < 2 or args.layers < 1 or args.layers % world:
    parser.error(f"--layers {args.layers} must split evenly into N >= 2 processes, got N={world}")
if unknown := sorted(set(schedules) - set(SCHEDULES)):
    parser.error(f"unknown schedule(s) {', '.join(unknown)}; choose from {', '.join(SCHEDULES)}")
if min(args.microbatches) < 1 or min(args.hidden, args.mb_size, args.seq, args.repeats) < 1:
    parser.error("--microbatches, --hidden, --mb-size, --seq and --repeats must be >= 1")
if args.hidden % 64:
    parser.error("--hidden must be a multiple of 64 (heads of 64 features)")
if args.unbalanced and (len(args.unbalanced) != world or sum(args.unbalanced) != args.layers
                        or min(args.unbalanced) < 1):
    parser.error(f"--unbalanced needs {world} stage sizes >= 1 adding up to --layers {args.layers}")

env = setup()
seed_everything(0)
model = tiny_llama(hidden=args.hidden, layers=args.layers, heads=args.hidden // 64,
                   seq_len=args.seq).to(env.device)
timeline = Timeline(cuda=env.device.type == "cuda")
clock = f"{env.device.type.upper()}/{env.backend}"  # what the times were measured on
even = [args.layers // world] * world


def timed_loss(logits, tokens):  # the last stage's loss is computing time too
    with timeline.span("L"):
        return lm_loss(logits, tokens)


def make_step(schedule_name: str, m: int, split: list[int]):
    """A pipeline of this rank's layers under one schedule; returns a function doing one step."""
    first, last = split_layers(args.layers, split)[env.rank]
    stage = timed_stage(PipelineStage, timeline)(LlamaStage(model, first, last), env.rank,
                                                 world, env.device)
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=m, loss_fn=timed_loss)
    tokens = torch.randint(0, model.config.vocab_size, (m * args.mb_size, args.seq),
                           generator=torch.Generator().manual_seed(m)).to(env.device)

    def step():
        if env.rank == 0:
            schedule.step(tokens)
        elif env.rank == world - 1:
            schedule.step(target=tokens, return_outputs=False)  # keep no logits
        else:
            schedule.step()
        model.zero_grad(set_to_none=True)
    return step


settings = [(s, m, even) for s in schedules for m in args.microbatches
            if s == "gpipe" or m >= world]
if args.unbalanced:
    settings.append(("1f1b" if "1f1b" in schedules else schedules[0], max(args.microbatches),
                     args.unbalanced))
steps = {}
for setting in settings:
    steps[setting[:2] + (tuple(setting[2]),)] = step = make_step(*setting)
    step()  # warm-up: the first step also works out the shapes to send between stages

# Repeats in turn over all settings, so a slow moment of the machine hits every setting alike.
runs = {key: [] for key in steps}
for _ in range(args.repeats):
    for key, step in steps.items():
        timeline.start()
        step()
        spans = timeline.gather()
        if env.rank == 0:
            end = max(s[3] for ranks in spans for s in ranks)
            begin = min(s[2] for ranks in spans for s in ranks)
            runs[key].append({"idle": idle_fractions(spans), "step_s": end - begin,
                              "spans": spans})

results = []
print0(f"{world} stages, {args.layers} layers, hidden {args.hidden}, micro-batch "
       f"{args.mb_size}x{args.seq} tokens; fastest of {args.repeats} steps ({clock})")
for (name, m, split), reps in runs.items():
    if env.rank:
        continue
    # The fastest step: the one the rest of the machine disturbed least (noise only adds time,
    # as timeit's docs say of taking the minimum). Its spans are the timeline to draw.
    best = min(reps, key=lambda r: r["step_s"])
    # The formula's idle share per stage, with a stage's time per micro-batch T proportional to
    # its layers: the step lasts m T_max (the slowest stage works all the time) plus the other
    # stages' fill and drain (the sum of their T), and stage r computes m T_r of it. An even
    # split gives (p-1)/(m+p-1) on every stage.
    span = m * max(split) + sum(split) - max(split)
    theory_stages = [1 - m * t / span for t in split]
    theory = (world - 1) / (m + world - 1) if len(set(split)) == 1 else \
        statistics.mean(theory_stages)
    results.append({"schedule": name, "m": m, "split": list(split), "idle": best["idle"],
                    "idle_mean": statistics.mean(best["idle"]), "theory": theory,
                    "theory_stages": theory_stages,
                    "step_s": best["step_s"], "spans": best["spans"],
                    "step_s_all": [r["step_s"] for r in reps]})
    print0(f"{name:5s} m={m}  split {'+'.join(map(str, split))}  idle "
           + " ".join(f"{x:.2f}" for x in best["idle"])
           + "  (theory " + " ".join(f"{x:.2f}" for x in theory_stages) + ")")

# Peak activation memory per stage: what autograd keeps for backward, during one step of each
# schedule at the largest m; and for one micro-batch alone (m=1, GPipe = no pipelining).
memory = {}
for name, m in [("gpipe", 1)] + [(s, max(args.microbatches)) for s in schedules
                                  if s == "gpipe" or max(args.microbatches) >= world]:
    if (name, m, tuple(even)) not in steps:
        steps[(name, m, tuple(even))] = make_step(name, m, even)
        steps[(name, m, tuple(even))]()  # warm-up (shape inference), not measured
    with SavedActivations(model) as saved:
        steps[(name, m, tuple(even))]()
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, saved.peak)
    memory[f"{name} m={m}"] = {"schedule": name, "m": m, "peak_activation_bytes": peaks}
    print0(f"{name:5s} m={m}  peak activation memory per stage (MiB): "
           + " ".join(f"{p / 2**20:.1f}" for p in peaks))

write_json(args.json, {"world_size": world, "clock": clock, "layers": args.layers,
                       "hidden": args.hidden,
                       "mb_size": args.mb_size, "seq": args.seq, "repeats": args.repeats,
                       "runs": results, "memory": memory})
teardown()
