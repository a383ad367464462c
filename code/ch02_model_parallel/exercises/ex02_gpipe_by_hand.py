# Yours to fill in (generated from ../solutions/ex02_gpipe_by_hand.py).
"""Exercise 02.1: GPipe by hand, naive_split.py with micro-batches, over send/recv.

    code/run_w_torchrun.sh 2 ch02_model_parallel/solutions/ex02_gpipe_by_hand.py --microbatches 4

Cut every batch into m micro-batches. All forwards first: each stage runs micro-batch i and
sends its activations on with isend (not send: the stage goes on with micro-batch i+1 while
they travel), keeping every micro-batch's input and output for the backward. Then all
backwards, in the same order, each one sending its input gradient back. The loss of the step
is the mean of the micro-batches' losses, so each micro-batch's loss is divided by m before its
backward: the accumulated gradients are then those of the whole batch's mean loss, and the
losses match train_single.py's. It is what ScheduleGPipe does (pipeline.py), written out.
Fill in the TODO(you) parts, replacing each todo(...) call with your code; naive_split.py has
the forward and backward of one batch. Run the script at any time: it stops at the first
todo() left and says what is missing.
`make exercise EX=02.1` checks it at 2 and 3 ranks (--layers 3 at 3). Solution, with the answers
to the questions below: ../solutions/ex02_gpipe_by_hand.py.

Predict, then measure (the --json file holds every rank's compute spans):
1. At --microbatches 1 this is naive_split.py. At 4, what fraction of the step should each of
   the 2 ranks idle, by the formula? Why does this tiny model idle far more than that?
2. Make the forward sends blocking (dist.send instead of isend). Does it still train the same?
   What does rank 0 now wait for before it can start the next micro-batch?
3. Drop the division by m. How far do the losses move from train_single.py's with AdamW, and
   why would plain SGD show it at once?
4. How many micro-batches' activations does stage 0 hold just before its first backward? What
   would let it hold fewer (see Schedule1F1B)?
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler

from distkit import print0, seed_everything, setup, teardown, todo, write_json
from distkit.dist import grad_norms
from distkit.pipe import LlamaStage, Timeline, lm_loss, split_layers
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers (train_single.py's: 2)")
parser.add_argument("--json", help="write per-step losses and every rank's compute spans here")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))
if args.batch_size < 1 or args.samples < args.batch_size:
    parser.error("need 1 <= --batch-size <= --samples")
if args.layers < 1 or args.layers % world:
    parser.error(f"--layers {args.layers} must split evenly into N={world} processes")
if args.microbatches < 1 or args.batch_size % args.microbatches:
    parser.error(f"--microbatches must be >= 1 and divide --batch-size {args.batch_size}")

env = setup()
seed_everything(args.seed)
model = tiny_llama(layers=args.layers)
first, last = split_layers(model.config.num_hidden_layers, env.world_size)[env.rank]
stage = LlamaStage(model, first, last).to(env.device)
is_first, is_last = env.rank == 0, env.rank == env.world_size - 1
optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
data = counting_data(args.samples)
shuffle = torch.Generator()
sampler = RandomSampler(data, generator=shuffle)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
m = args.microbatches
mb_shape = (args.batch_size // m, data.tensors[0].shape[1], model.config.hidden_size)

timeline = Timeline(cuda=env.device.type == "cuda")
timeline.start()
losses = []
for epoch in range(args.epochs):
    shuffle.manual_seed(args.seed + epoch)
    for step, (tokens,) in enumerate(loader):
        micro = tokens.to(env.device).chunk(m)  # m micro-batches of batch_size/m sequences
        inputs, outputs, sends = [], [], []
        for i in range(m):  # all forwards
            # TODO(you): naive_split.py's forward, for micro-batch i: a stage's input comes from the
            # previous stage (a buffer of shape mb_shape, whose gradient the backward must produce)
            # unless it is the first; the last stage ends with its loss, scaled so that the m micro-
            # batches add up to the batch's mean; the output goes on without blocking (keep the Work
            # in `sends`). Time the compute in timeline.span("F", i); keep each input and output for
            # the backward. Look up: dist.isend, Tensor.requires_grad_.
            todo("the forward of micro-batch i")
        for i in range(m):  # all backwards, in the same order
            # TODO(you): naive_split.py's backward, for micro-batch i: the last stage starts from
            # its loss, the others from the output gradient the next stage sends; every stage but
            # the first sends its input's gradient back. Time it in timeline.span("B", i). Look up:
            # Tensor.backward's gradient argument.
            todo("the backward of micro-batch i")
        for work in sends:  # a buffer must not be freed before its send is done
            work.wait()
        if epoch == step == 0:  # step 1's gradients, every stage's: AdamW hides a constant factor
            grads = grad_norms(model, gather=True)
        optimizer.step()
        optimizer.zero_grad()
        if is_last:
            losses.append(sum(out.item() for out in outputs))
    epoch_loss = torch.tensor(losses[-1] if is_last else 0.0, device=env.device)
    dist.broadcast(epoch_loss, src=env.world_size - 1)
    print0(f"epoch {epoch}  step {(epoch + 1) * len(loader):3d}  loss {epoch_loss.item():.3f}")

spans = timeline.gather()
box = [losses]
dist.broadcast_object_list(box, src=env.world_size - 1)
write_json(args.json, {"losses": box[0], "microbatches": m, "spans": spans,
                       "grad_norms": grads})
teardown()
