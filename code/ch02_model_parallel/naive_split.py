"""Chapter 02, naive model parallelism: train_single.py's model cut into N pieces, one per process.

    code/run_w_torchrun.sh 2 ch02_model_parallel/naive_split.py --json /tmp/naive.json

Rank r holds a contiguous slice of the layers; rank 0 also holds the embedding, the last rank
the final norm, the LM head and the loss. Activations go forward with send/recv, and their
gradients come back the same way. Otherwise this is chapter 01's train_single.py, step for step
(new lines say # NEW), so its losses must match train_single.py's up to float rounding (on
1 process it *is* train_single.py: one stage holds everything and sends nothing). With
--reference, rank 0 first runs train_single.py itself, inside its own process (no second
Python): the one-process run to compare with comes from the same launch. Each rank notes when
it computes, and the timeline shows the catch: one rank works at a time.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, RandomSampler

from distkit import print0, seed_everything, setup, teardown, write_json
from distkit.dist import grad_norms, one_process_reference
from distkit.pipe import LlamaStage, Timeline, lm_loss, split_layers
from distkit.toy import counting_data, tiny_llama

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=256, help="sequences in the data set")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--layers", type=int, default=2, help="decoder layers")
parser.add_argument("--json", help="write per-step losses, step 1's gradient norms and every "
                    "rank's compute spans here")
parser.add_argument("--reference", action="store_true",  # NEW
                    help="rank 0 first runs train_single.py (one process: the reference), its "
                    "losses and gradient norms to the JSON")
args = parser.parse_args()
world = int(os.environ.get("WORLD_SIZE", 1))  # NEW: one slice of the layers per process
if args.batch_size < 1 or args.samples < args.batch_size:
    parser.error("need 1 <= --batch-size <= --samples")
if args.layers < 1 or args.layers % world:
    parser.error(f"--layers {args.layers} must split evenly into N={world} processes")

env = setup()  # NEW
# NEW: the one-process run to compare with, in this launch: rank 0 runs train_single.py itself
reference = args.reference and one_process_reference(
    "ch01_ddp/train_single.py", "--batch-size", args.batch_size, "--epochs", args.epochs,
    "--samples", args.samples, "--lr", args.lr, "--seed", args.seed, "--layers", args.layers)
seed_everything(args.seed)
model = tiny_llama(layers=args.layers)
# NEW: every rank builds the whole (tiny) model from the same seed, so the weights are those of
# train_single.py, and keeps only its own layers. A model too big for one device is built on
# the meta device instead (chapter 04).
first, last = split_layers(model.config.num_hidden_layers, env.world_size)[env.rank]
stage = LlamaStage(model, first, last).to(env.device)
is_first, is_last = env.rank == 0, env.rank == env.world_size - 1
optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)  # NEW: only my parameters
data = counting_data(args.samples)
shuffle = torch.Generator()
sampler = RandomSampler(data, generator=shuffle)
# NEW: every rank reads the same batches: the first needs the tokens as input, the last as labels
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
hidden_shape = (args.batch_size, data.tensors[0].shape[1], model.config.hidden_size)

timeline = Timeline(cuda=env.device.type == "cuda")  # NEW: when this rank computes (CUDA events)
timeline.start()
sent = 0  # NEW: bytes this rank sends to its neighbours
losses, grads = [], None
for epoch in range(args.epochs):
    shuffle.manual_seed(args.seed + epoch)  # a different order every epoch, the same every run
    for step, (tokens,) in enumerate(loader):
        tokens = tokens.to(env.device)
        # NEW, forward: take the previous stage's activations, run my layers, pass them on
        if is_first:
            x = tokens
        else:
            x = torch.empty(hidden_shape, device=env.device)
            dist.recv(x, src=env.rank - 1)
            x.requires_grad_()  # we want d(loss)/dx, to send back
        with timeline.span("F", step):
            out = stage(x)
            if is_last:
                loss = lm_loss(out, tokens)  # mean cross-entropy, next token
        if not is_last:
            dist.send(out.detach(), dst=env.rank + 1)
            sent += out.nbytes
        # NEW, backward: the last stage starts it from the loss; the others from the gradient
        # of their output, which the next stage sends back
        if is_last:
            with timeline.span("B", step):
                loss.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=env.rank + 1)
            with timeline.span("B", step):
                out.backward(grad)
        if not is_first:
            dist.send(x.grad, dst=env.rank - 1)
            sent += x.grad.nbytes
        if grads is None:  # step 1's gradients, every stage's, for the parity check
            grads = grad_norms(model, gather=True)
        with timeline.span("step", step):  # every rank updates its own layers, all at once
            optimizer.step()
            optimizer.zero_grad()
        if is_last:
            losses.append(loss.item())
    # NEW: only the last rank has the loss; print on rank 0 as everywhere in the course
    epoch_loss = torch.tensor(losses[-1] if is_last else 0.0, device=env.device)
    dist.broadcast(epoch_loss, src=env.world_size - 1)
    # 3 decimals: further digits differ in the last float bits between CPUs and world sizes
    print0(f"epoch {epoch}  step {(epoch + 1) * len(loader):3d}  loss {epoch_loss.item():.3f}")

spans = timeline.gather()  # NEW: every rank's compute spans, to draw the timeline
box, sent_per_rank = [losses], [None] * env.world_size
dist.broadcast_object_list(box, src=env.world_size - 1)
dist.all_gather_object(sent_per_rank, sent // len(box[0]))
write_json(args.json, {"losses": box[0], "grad_norms": grads, "spans": spans,
                       "sent_bytes_per_step": sent_per_rank,
                       "activation_bytes": args.batch_size * hidden_shape[1] * hidden_shape[2] * 4,
                       "layers": split_layers(args.layers, env.world_size),
                       "reference": reference or None})
teardown()
