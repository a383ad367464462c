"""Every model family trained with FSDP2 on masked labels equals one process: losses and gradients.

    code/run_w_torchrun.sh 2 ch06_capstone/family_parity.py --json /tmp/family_parity.json

For each family (families.py: Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Qwen3-MoE,
Mixtral, each as a tiny config), the capstone's path from nothing to a sharded model: full
weights in host memory (every rank builds them here: they are also the one-process reference),
a skeleton on the meta device; fully_shard each decoder
layer, then the root (embedding, final norm, lm_head: one unit, so tied embeddings stay tied);
to_empty, rank 0's weights handed out shard by shard, the buffers no state dict holds refilled
(restore_buffers). Then two AdamW steps on a batch whose labels are masked as in chat
fine-tuning: sequence j's first 2 + 3j labels are -100, so the ranks, and each rank's two
micro-batches, hold unequal numbers of valid tokens.

The loss (distkit.tokens): each micro-batch's sum of token losses divided by the valid tokens of
the whole step (every rank, every micro-batch), and FSDP told to sum the ranks' gradients
(divide factor 1). It must equal one process training on the whole batch: the loss of both
steps and every parameter's gradient after step 1 (AdamW hides a constant factor on the
gradients: the gradients do not). And each resumes: a Distributed Checkpoint after step 1,
loaded into a freshly built sharded model (no weights from rank 0), gives step 2 bit for bit.
Two wrong answers run on one family (--wrong-on), and must fail:
"mean" (each micro-batch's mean / micro-batches, FSDP averaging the ranks: the mean of means)
and "no-factor" (the global loss, but FSDP still divides by the ranks: gradients 1/N of one
process's).
"""
import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # families.py, next to this file
import families  # noqa: E402
from distkit import print0, setup, teardown, write_json  # noqa: E402
from distkit.ckpt import AppState  # noqa: E402
from distkit.tokens import (IGNORE, global_token_loss, global_valid_tokens,  # noqa: E402
                            sum_gradients)

# Float32; only the order of additions differs from one process (two micro-batches, two ranks'
# gradients reduce-scattered). Measured on 2 gloo ranks, every family: losses and gradients
# within ~1e-7 (see the test). The wrong answers are off by 1e-3 or more.
LOSS_TOL, GRAD_TOL = 1e-5, 1e-6
NORMALISATIONS = ("global", "mean", "no-factor")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--families", default=",".join(families.FAMILIES),
                    help="comma list of families (default: all)")
parser.add_argument("--wrong", default="mean,no-factor",
                    help="wrong normalisations to run on --wrong-on's family (comma list of "
                         "mean, no-factor; '' for none)")
parser.add_argument("--wrong-on", default="qwen2", metavar="FAMILY",
                    help="the family the wrong answers run on (default %(default)s: tied "
                         "embeddings)")
parser.add_argument("--batch-size", type=int, default=8,
                    help="sequences per step, all ranks (2 micro-batches per rank)")
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--json", metavar="PATH", help="write the results here (rank 0)")
args = parser.parse_args()
names = [f for f in args.families.split(",") if f]
wrong = [w for w in args.wrong.split(",") if w]
if unknown := [f for f in names if f not in families.FAMILIES]:
    parser.error(f"--families: unknown {', '.join(unknown)}; choose from "
                 f"{', '.join(families.FAMILIES)}")
if bad := [w for w in wrong if w not in NORMALISATIONS[1:]]:
    parser.error(f"--wrong: unknown {', '.join(bad)}; choose from mean, no-factor")
if not names:
    parser.error("--families: name at least one")
if wrong and args.wrong_on not in names:
    parser.error(f"--wrong-on {args.wrong_on} is not in --families")
world = int(__import__("os").environ.get("WORLD_SIZE", 1))
if args.batch_size % (2 * world) or 2 + 3 * (args.batch_size - 1) >= args.seq:
    parser.error(f"--batch-size must be a multiple of 2 x {world} ranks, and --seq more than "
                 "2 + 3 x (batch-size - 1) (every sequence keeps a valid label)")

env = setup()
N, rank = env.world_size, env.rank
VOCAB, S, G = 96, args.seq, args.batch_size

# One batch per step, the same on every rank; labels shifted (labels[t] = tokens[t + 1]) and
# masked: sequence j's first 2 + 3j labels are a "prompt" (-100)
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, VOCAB, (2, G, S + 1), generator=gen)
inputs, labels = tokens[..., :-1], tokens[..., 1:].clone()
for j in range(G):
    labels[:, j, :2 + 3 * j] = IGNORE
mine = slice(rank * G // N, (rank + 1) * G // N)  # this rank's sequences: 2 micro-batches


def grads_of(model) -> dict:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters()}


def sharded(config, normalisation: str, full_state: dict | None):
    """The capstone's path: skeleton, fully_shard units, divide factor, to_empty, rank 0's
    weights (if given: else the caller loads a checkpoint), the buffers."""
    model = families.skeleton(config)
    for unit in families.fsdp_units(model):  # the layers, then the root (embed + lm_head)
        fully_shard(unit)
    if normalisation == "global":  # NEW: the loss is divided by the global count: FSDP
        sum_gradients(model)  # must sum the ranks' gradients (divide factor 1), not average
    model.to_empty(device="cpu")
    if full_state is not None:
        # rank 0's weights, shard by shard (a copy of the dict: the broadcast writes into the
        # dict it is given, and a second load from the same dict failed)
        set_model_state_dict(model, dict(full_state) if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True))
    families.restore_buffers(model, config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optimizer, step: int, normalisation: str):
    """One step on this rank's share: 2 micro-batches, then AdamW. Returns (the step's loss,
    this rank's valid labels per micro-batch, the gradients before the update)."""
    x, y = inputs[step, mine], labels[step, mine]
    micro = list(zip(x.split(G // N // 2), y.split(G // N // 2)))
    count = global_valid_tokens([b for _, b in micro])  # NEW: every rank, every micro-batch
    share = torch.zeros(())
    for xb, yb in micro:
        logits = model(input_ids=xb).logits
        if normalisation == "mean":  # wrong: this micro-batch's mean, averaged
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), yb.flatten(), ignore_index=IGNORE) / len(micro)
        else:
            loss = global_token_loss(logits, yb, count)
        loss.backward()
        share += loss.detach()
    grads = grads_of(model)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(share)  # the shares add up to the step's loss; for "mean", N x the mean
    return share.item() / (N if normalisation == "mean" else 1), \
        [int((b != IGNORE).sum()) for _, b in micro], grads


def weights(model) -> dict:
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


ckpt_root = [tempfile.mkdtemp(prefix="family_parity-") if rank == 0 else None]
dist.broadcast_object_list(ckpt_root)  # one folder for every rank (one machine here)
results = {}
for family in names:
    config = families.tiny_config(family, vocab_size=VOCAB, seq_len=S)
    # The reference: one process, the whole batch, one mean over its valid tokens
    torch.manual_seed(0)  # every rank builds it (families.build does the same on rank 0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full_state = {n: t.clone() for n, t in reference.state_dict().items()}
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    single = []
    for step in range(2):
        loss = global_token_loss(reference(input_ids=inputs[step]).logits, labels[step],
                                 (labels[step] != IGNORE).sum())  # this process's count only
        loss.backward()
        if step == 0:
            single_grads = grads_of(reference)
        optimizer.step()
        optimizer.zero_grad()
        single.append(loss.item())

    results[family] = {"tied": families.parts(reference).tied}
    for normalisation in ["global"] + (wrong if family == args.wrong_on else []):
        model, optimizer = sharded(config, normalisation, full_state)
        parts = families.parts(model)
        first, valid, grads = train_step(model, optimizer, 0, normalisation)
        errors = {n: (g - single_grads[n]).abs().max().item() for n, g in grads.items()}
        scale = (torch.cat([g.flatten() for g in grads.values()]).norm()
                 / torch.cat([g.flatten() for g in single_grads.values()]).norm()).item()
        if normalisation == "global":  # a checkpoint after step 1, resumed by a fresh model
            folder = f"{ckpt_root[0]}/{family}"
            dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=folder)
        second = train_step(model, optimizer, 1, normalisation)[0]
        losses = [first, second]
        per_rank = [None] * N
        dist.all_gather_object(per_rank, valid)
        loss_diff = max(abs(a - b) for a, b in zip(losses, single))
        grad_diff = max(errors.values())
        results[family][normalisation] = {
            "losses": losses, "single": single, "max_loss_diff": loss_diff,
            "max_grad_diff": grad_diff, "grad_scale": scale,
            "valid_tokens_per_rank_and_micro_batch": per_rank,
            "still_tied": parts.lm_head.weight is parts.embed.weight,
            "parity": loss_diff < LOSS_TOL and grad_diff < GRAD_TOL}
        if normalisation == "global":  # resume: step 2 again, from the checkpoint
            resumed, resumed_opt = sharded(config, normalisation, None)
            dcp.load({"app": AppState(resumed, resumed_opt)}, checkpoint_id=folder)
            again = train_step(resumed, resumed_opt, 1, normalisation)[0]
            after, after_resumed = weights(model), weights(resumed)
            results[family]["global"]["resumed_bit_identical"] = again == second and all(
                torch.equal(after[n], after_resumed[n]) for n in after)
if rank == 0:
    shutil.rmtree(ckpt_root[0], ignore_errors=True)

print0(f"{N} ranks x 2 micro-batches; valid labels of step 1 per rank and micro-batch: "
       f"{results[names[0]]['global']['valid_tokens_per_rank_and_micro_batch']} (one process: "
       f"{int((labels[0] != IGNORE).sum())})")
print0(f"{'family':12} {'normalisation':10} {'tied':>5} {'loss diff':>10} {'grad diff':>10} "
       f"{'grad scale':>10}  parity")
def shown(value: float, tol: float) -> str:
    """A gap within the tolerance as the bound (its digits are float noise: they change with
    the CPU), one above it to 2 digits (far above the noise)."""
    return f"< {tol:.0e}" if value < tol else f"{value:.1e}"


for family, res in results.items():
    for normalisation in NORMALISATIONS:
        if r := res.get(normalisation):
            print0(f"{family:12} {normalisation:10} {str(res['tied']):>5} "
                   f"{shown(r['max_loss_diff'], LOSS_TOL):>10} "
                   f"{shown(r['max_grad_diff'], GRAD_TOL):>10} {r['grad_scale']:10.3f}  "
                   f"{r['parity']}")
ok = all(r["parity"] == (n == "global") for res in results.values()
         for n, r in res.items() if n in NORMALISATIONS)
ok = ok and all(res["global"]["still_tied"] == res["tied"] for res in results.values())
resumed = all(res["global"]["resumed_bit_identical"] for res in results.values())
print0(f"every family resumed from step 1's checkpoint: step 2 bit-identical: {resumed}")
ok = ok and resumed
print0(f"every family equals one process, every wrong answer fails: {ok}")
write_json(args.json, {"world_size": N, "families": results, "ok": ok,
                       "tolerances": {"loss": LOSS_TOL, "grad": GRAD_TOL}})
teardown()
