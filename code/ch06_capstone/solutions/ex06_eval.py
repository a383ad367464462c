"""Exercise 06.1 solution: evaluate a sharded model on any number of ranks.

    code/run_w_torchrun.sh 3 ch06_capstone/solutions/ex06_eval.py

The capstone measures its held-out loss with the model sharded by FSDP2 over however many ranks
the job has, and that number must not depend on how many: it is the mean next-token
cross-entropy over every held-out token, on 1, 2 or 3 ranks alike (up to float rounding). This
script builds the capstone's cpu-tiny Llama (seed 0: the weights the capstone starts from, so
the loss is its step-0 eval_loss), shards it (each decoder layer, then the root), and evaluates
it on the corpus's held-out sequences with evaluate(). Rank 0 computes the same loss on an
unsharded copy in one process: the reference.
Three traps wait at 3 ranks: (1) the held-out sequences (the first 50 are used) do not
divide by 3, so the shares differ (17, 17, 16) and none may be dropped or counted twice;
(2) FSDP2 all-gathers each layer's parameters inside forward, with every rank, so every rank
must run the same number of forwards: a rank whose share is used up runs a padding batch whose
loss is not counted; (3) a mean of the ranks' mean losses weighs 16 sequences like 17: add up
token losses and token counts instead, and all-reduce the two sums. The capstone's own
evaluate() is one answer. The starter is ../exercises/ex06_eval.py.

Predict, then measure:
1. On 4 ranks with --micro-batch 4, how many forwards does each rank run, and which ranks run
   a padding batch? On 64 ranks?
2. Return the mean of the ranks' mean losses instead: by how much does it miss on 3 ranks? Why
   would 2 ranks never have shown it, and 5 not either?
3. Let a rank skip its padding batch: what happens, after how long (COURSE_TIMEOUT_S), and on
   which ranks? Could the padding batch have 1 sequence while the others have 8?
4. Here every sequence has 127 scored tokens. With sequences padded to a common length (their
   padding labelled -100), what would your two sums have to count?
"""
import argparse
import copy
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # corpus.py
import corpus  # noqa: E402
from distkit import print0, seed_everything, setup, teardown, write_json  # noqa: E402

# The capstone's cpu-tiny Llama (train_llama.py: PRESETS["cpu-tiny"], default --vocab-size and
# --seq-len, --seed 0): the model and data its first evaluation sees.
CPU_TINY = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0,
            "tie_word_embeddings": True}
VOCAB_SIZE, SEQ_LEN, SEED, HELDOUT = 2048, 128, 0, 50
# Against one process: float32 rounding differs (other batches, other sums); a sequence dropped
# or counted twice, or a mean of means, misses by 1e-4 or more here.
LOSS_TOL = 1e-5
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data-dir", default="build/ch06/data",
                    help="the capstone's tokenizer and token cache (built if missing)")
parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward, per rank")
parser.add_argument("--json", help="write both losses and the forwards per rank here (rank 0)")
args = parser.parse_args()
if args.micro_batch < 1:
    parser.error("need --micro-batch >= 1")

env = setup()
# built by the first rank of each node, read by the others
folder = corpus.prepare_on_ranks(env.local_rank, args.data_dir, VOCAB_SIZE, SEQ_LEN)
_, heldout = corpus.load(folder)  # int32, (sequences, SEQ_LEN): every rank holds all of them
# The first 50 (their number varies a little with the Python version, whose docs are the text):
# 50 on 3 ranks gives shares of 17, 17 and 16 on every machine.
if len(heldout) < HELDOUT:
    sys.exit(f"ex06_eval.py: only {len(heldout)} held-out sequences, {HELDOUT} needed")
heldout = heldout[:HELDOUT]

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

config = LlamaConfig(vocab_size=corpus.facts(folder)["vocab_size"],
                     max_position_embeddings=SEQ_LEN, rms_norm_eps=1e-5, **CPU_TINY)
# The same weights on every rank (seeded); rank 0 keeps an unsharded copy for the reference.
seed_everything(SEED)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(env.device).eval()
reference = copy.deepcopy(model) if env.rank == 0 else None
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)  # the root: embeddings, final norm, lm_head (tied to the embeddings)

forwards = 0  # this rank's forwards of the sharded model: counted by a hook, printed below


def count_forward(module, inputs):
    global forwards
    forwards += 1


model.register_forward_pre_hook(count_forward)


def loss_and_tokens(model, x) -> torch.Tensor:
    """[summed cross-entropy, tokens scored] of a batch of sequences x, as float64 (to add up
    and all-reduce): each token predicts the next, so every token but a sequence's first is
    scored."""
    x = x.long().to(env.device)
    logits = model(input_ids=x).logits.float()
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
    return torch.stack([loss.double(), loss.new_tensor(x[:, 1:].numel(), dtype=torch.float64)])


@torch.no_grad()
def evaluate(model, heldout) -> float:
    """The mean next-token cross-entropy over every sequence of heldout, the same on every rank
    whatever the number of ranks. A collective: every rank calls it."""
    # (1) every sequence on exactly one rank: 50 on 3 ranks gives shares of 17, 17 and 16
    mine = heldout[env.rank::env.world_size]
    # (2) as many forwards on every rank as the largest share needs: FSDP2's all-gathers
    largest = math.ceil(len(heldout) / env.world_size)
    total = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, tokens
    for b in range(math.ceil(largest / args.micro_batch)):
        x = mine[b * args.micro_batch:(b + 1) * args.micro_batch]
        if len(x) == 0:  # this rank's share is used up: a padding batch, not counted
            loss_and_tokens(model, heldout[:1])
            continue
        total += loss_and_tokens(model, x)
    # (3) sums, not means: a rank with 16 sequences weighs 16/50, not 1/3
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


start = time.perf_counter()
loss = evaluate(model, heldout)
seconds = time.perf_counter() - start
counts = [None] * env.world_size
dist.all_gather_object(counts, forwards)

# The reference: one process, the unsharded copy, every sequence; sent to every rank so that
# all of them agree on the verdict below.
one_process = torch.zeros(1, dtype=torch.float64, device=env.device)
if env.rank == 0:
    with torch.no_grad():
        sums = sum(loss_and_tokens(reference, x) for x in heldout.split(args.micro_batch))
    one_process[0] = sums[0] / sums[1]
dist.broadcast(one_process, src=0)
one_process = one_process.item()
same = abs(loss - one_process) < LOSS_TOL

print0(f"{len(heldout)} held-out sequences of {SEQ_LEN} tokens on {env.world_size} ranks, "
       f"micro-batches of {args.micro_batch}")
print0(f"forwards per rank: {counts}")
print0(f"held-out loss: {loss:.3f} (a uniform guess over {config.vocab_size} tokens: "
       f"{math.log(config.vocab_size):.3f})")
print0(f"sharded == one process: {same}")
write_json(args.json, {
    "world_size": env.world_size, "heldout_sequences": len(heldout), "seq_len": SEQ_LEN,
    "micro_batch": args.micro_batch, "forwards": counts, "config": CPU_TINY,
    "sharded_loss": loss, "one_process_loss": one_process, "tolerance": LOSS_TOL,
    "same": same, "seconds": seconds})
assert same, (f"the sharded loss {loss:.6f} is not one process's {one_process:.6f}: is every "
              f"sequence counted once (none dropped, none twice, no padding batch counted), and "
              f"are the token-loss and token-count sums all-reduced, not the ranks' means?")
teardown()
