"""Chapter 02, pipeline parallelism: naive_split.py with micro-batches and a pipeline schedule.

    code/run_w_torchrun.sh 2 ch02_model_parallel/pipeline.py --schedules 1f1b --json /tmp/p.json

The same stages as naive_split.py, but each batch is cut into --microbatches micro-batches,
so that stage r can work on micro-batch i+1 while stage r+1 works on micro-batch i.
torch.distributed.pipelining does the sends and receives and the order of the work: GPipe runs
every forward, then every backward; 1F1B alternates one forward and one backward as soon as it
can. Each schedule trains from the same initial weights, and both must match train_single.py,
losses and step 1's gradients: the loss is a mean over the batch, and the schedule averages the
micro-batches' gradients (scale_grads=True), which is the gradient of that mean when the
micro-batches are equal in size (with scale_grads=False they would sum: m times too large,
which AdamW's losses hide and the gradients show).
New lines against naive_split.py say # NEW.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader, RandomSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_norms
from distkit.pipe import LlamaStage, lm_loss, split_layers
from distkit.toy import counting_data, tiny_llama

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # NEW

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")  # NEW
parser.add_argument("--schedules", default="gpipe,1f1b",  # NEW
                    help=f"comma-separated, each trained in turn: {', '.join(SCHEDULES)}")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses per schedule here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
schedules = args.schedules.split(",")
if args.batch_size < 1 or args.samples < args.batch_size:
    parser.error("need 1 <= --batch-size <= --samples")
if world < 2 or args.layers < 1 or args.layers % world:
    parser.error(f"--layers {args.layers} must split evenly into N >= 2 processes, got N={world}")
if unknown := sorted(set(schedules) - set(SCHEDULES)):  # NEW
    parser.error(f"unknown schedule(s) {', '.join(unknown)}; choose from {', '.join(SCHEDULES)}")
min_m = world if "1f1b" in schedules else 1  # NEW: 1F1B warms up with one per stage
if args.microbatches < min_m or args.batch_size % args.microbatches:  # NEW
    parser.error(f"--microbatches must be >= N={world} for 1F1B (one per stage), >= 1 for GPipe, "
                 f"and divide --batch-size {args.batch_size}")

env = setup()
is_first, is_last = env.rank == 0, env.rank == env.world_size - 1


def train(schedule_name: str) -> tuple[list[float], dict]:
    """train_single.py's training, pipelined with one schedule: its losses, and step 1's
    gradient norms (every stage's parameters)."""
    seed_everything(args.seed)
    model = tiny_llama(layers=args.layers)
    first, last = split_layers(model.config.num_hidden_layers, env.world_size)[env.rank]
    stage = LlamaStage(model, first, last).to(env.device)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
    # NEW: the library's stage and schedule replace naive_split.py's send/recv by hand
    pipe_stage = PipelineStage(stage, env.rank, env.world_size, env.device)
    schedule = SCHEDULES[schedule_name](pipe_stage, n_microbatches=args.microbatches,
                                        loss_fn=lm_loss)
    data = counting_data(args.samples)
    shuffle = torch.Generator()
    sampler = RandomSampler(data, generator=shuffle)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    losses, grads = [], None
    for epoch in range(args.epochs):
        shuffle.manual_seed(args.seed + epoch)  # a different order every epoch, the same every run
        for (tokens,) in loader:
            tokens = tokens.to(env.device)
            # NEW: one call runs the whole step's forwards and backwards, split into micro-batches
            if is_first:
                schedule.step(tokens)  # the input
            elif is_last:
                mb_losses = []
                # the labels; return_outputs=False: don't keep every micro-batch's logits
                schedule.step(target=tokens, losses=mb_losses, return_outputs=False)
                losses.append(torch.stack(mb_losses).mean().item())  # = the batch's mean loss
            else:
                schedule.step()  # a middle stage only passes activations and gradients on
            if grads is None:  # step 1's gradients, every stage's, for the parity check
                grads = grad_norms(model, gather=True)
            optimizer.step()
            optimizer.zero_grad()
        epoch_loss = torch.tensor(losses[-1] if is_last else 0.0, device=env.device)
        dist.broadcast(epoch_loss, src=env.world_size - 1)
        print0(f"{schedule_name:5s} epoch {epoch}  step {(epoch + 1) * len(loader):3d}  "
               f"loss {epoch_loss.item():.3f}")
    box = [losses]
    dist.broadcast_object_list(box, src=env.world_size - 1)
    return box[0], grads


results = {name: train(name) for name in schedules}
write_json(args.json, {"microbatches": args.microbatches,
                       "losses": {name: losses for name, (losses, _) in results.items()},
                       "grad_norms": {name: grads for name, (_, grads) in results.items()}})
teardown()
