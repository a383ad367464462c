"""Chapter 10: every pipeline schedule of torch 2.13, one training step each, against one process.

    code/run_w_torchrun.sh 2 ch10_float8_3d/schedules.py --json build/ch10/schedules.json

Each rank builds the same seeded tiny Llama and computes, alone, the loss and gradients of the
whole batch (the reference). Then, for each schedule, the model is cut into stages (chapter 02's
distkit.pipe.LlamaStage) and placed as the schedule wants:
- GPipe, 1F1B: one stage per rank;
- Interleaved1F1B, LoopedBFS, InterleavedZeroBubble: 2 stages per rank, looped (rank r holds
  stages r and r + p);
- ZBVZeroBubble, DualPipeV: 2 stages per rank in a V (rank r holds r and 2p-1-r: the last
  stage sits on rank 0, beside the first).
One step of each schedule must give the reference's loss and every parameter's gradient; and
each rank notes what it computed, in order (distkit.schedules.recording_stage): "F" a forward,
"B" a whole backward, "I" a backward to the stage's input only, "W" the weight gradients. The
notebook compares those with the action lists torch publishes for the schedule.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.pipe import LlamaStage, lm_loss, split_layers
from distkit.plan3d import startup
from distkit.schedules import SCHEDULES, SINGLE, recording_stage, stages_of
from distkit.toy import counting_data, tiny_llama

imported = startup()  # seconds from process start to here: mostly importing torch
GRAD_TOL = 1e-5  # float32; the micro-batches only change the order of additions (measured ~1e-8)

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--schedules", default=",".join(SCHEDULES),
                    help="comma list of " + ", ".join(SCHEDULES))
parser.add_argument("--microbatches", type=int, default=4,
                    help="micro-batches per step (DualPipeV needs at least 2 x processes)")
parser.add_argument("--batch-size", type=int, default=8, help="sequences (of 32 tokens) a step")
parser.add_argument("--layers", type=int, default=4,
                    help="decoder layers, a multiple of 2 x processes (2 stages per rank)")
parser.add_argument("--json", help="write losses, errors and what each rank ran here")
args = parser.parse_args()
pp = int(os.environ.get("WORLD_SIZE", 1))
schedules = args.schedules.split(",")
if unknown := [s for s in schedules if s not in SCHEDULES]:
    parser.error(f"--schedules: unknown {','.join(unknown)}; choose from {','.join(SCHEDULES)}")
if pp < 2:
    parser.error("a pipeline needs at least 2 processes")
if args.layers < 2 * pp or args.layers % (2 * pp):
    parser.error(f"--layers {args.layers} must be a multiple of 2 x {pp} processes")
if args.microbatches < 1 or args.batch_size % args.microbatches:
    parser.error(f"--batch-size {args.batch_size} must split into --microbatches "
                 f"{args.microbatches} equal micro-batches")
if "DualPipeV" in schedules and args.microbatches < 2 * pp:
    parser.error(f"DualPipeV needs --microbatches >= {2 * pp} (its stages)")
if "1F1B" in schedules and args.microbatches < pp:
    parser.error(f"1F1B needs --microbatches >= {pp} (its stages)")

env = setup()
joined = startup()  # ... plus joining the process group
(tokens,) = counting_data(args.batch_size)[:]
tokens = tokens.to(env.device)


def build():
    seed_everything(0)  # the same weights on every rank, for every schedule and the reference
    return tiny_llama(layers=args.layers).to(env.device)


reference = build()  # one process, the whole batch: the loss and gradients to match
ref_loss = lm_loss(reference(input_ids=tokens).logits, tokens)
ref_loss.backward()
ref_grads = {name: p.grad for name, p in reference.named_parameters()}

results = {}
for name in schedules:
    model = build()
    per_rank = 1 if name in SINGLE else 2
    num_stages = pp * per_rank
    bounds = split_layers(args.layers, num_stages)
    mine = stages_of(name, env.rank, pp)
    ran = []  # (stage, kind, micro-batch), in the order this rank computed them
    Stage = recording_stage(PipelineStage, ran)
    stages = [Stage(LlamaStage(model, *bounds[s]), s, num_stages, env.device) for s in mine]
    schedule = get_schedule_class(name)(stages[0] if per_rank == 1 else stages,
                                        n_microbatches=args.microbatches, loss_fn=lm_loss)
    inputs = (tokens,) if 0 in mine else ()  # the first stage's rank feeds the tokens ...
    losses = []                              # ... the last stage's the labels
    labels = dict(target=tokens, losses=losses) if num_stages - 1 in mine else {}
    start = time.perf_counter()
    schedule.step(*inputs, **labels)
    seconds = time.perf_counter() - start
    # this rank's part of the check: its stages' gradients against the reference's
    names = {id(p): n for n, p in model.named_parameters()}
    grad_err = max((p.grad - ref_grads[names[id(p)]]).abs().max().item()
                   for st in stages for p in st.submod.parameters())
    loss_err = abs(torch.stack(losses).mean().item() - ref_loss.item()) if losses else None
    parts = [None] * pp
    dist.all_gather_object(parts, {"ran": ran, "grad_err": grad_err, "loss_err": loss_err,
                                   "stages": mine, "seconds": seconds})
    results[name] = {"stages_per_rank": per_rank, "ranks": parts,
                     "grad_err": max(p["grad_err"] for p in parts),
                     "loss_err": next(p["loss_err"] for p in parts if p["loss_err"] is not None)}

times = [None] * pp
dist.all_gather_object(times, {"imported": imported, "joined": joined})
print0(f"{pp} ranks, {args.layers} layers, {args.microbatches} micro-batches of "
       f"{args.batch_size // args.microbatches} sequences; one step of each schedule vs one "
       "process on the whole batch")
print0(f"{'schedule':22s} {'stages':>6s}  {'loss = 1 process':>16s}  "
       f"{'every gradient < ' + format(GRAD_TOL, 'g'):>24s}  actions per rank")
for name, r in results.items():
    counts = " / ".join(str(len(p["ran"])) for p in r["ranks"])
    print0(f"{name:22s} {r['stages_per_rank'] * pp:6d}  {str(r['loss_err'] < 1e-6):>16s}  "
           f"{str(r['grad_err'] < GRAD_TOL):>24s}  {counts}")
write_json(args.json, {"pp": pp, "layers": args.layers, "microbatches": args.microbatches,
                       "batch": args.batch_size, "grad_tol": GRAD_TOL, "schedules": results,
                       "startup": times})
teardown()
