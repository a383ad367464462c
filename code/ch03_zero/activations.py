"""Chapter 03: activation bytes per layer, with and without checkpointing, fp32 and bf16, measured.

    PYTHONPATH=code python code/ch03_zero/activations.py --json build/ch03/activations.json

One process, no process group: activations do not depend on how the model states are sharded,
only on the micro-batch each rank runs. For a small transformers Llama with 1, 2 and 4 decoder
layers, torch's MemTracker counts the bytes the forward leaves alive for the backward
("Activation") at the end of the forward. The slope over the layer count is what one layer
keeps; the intercept is the embeddings, the logits and the loss. Settings swept:
- attention: "sdpa" (a fused kernel that saves only its inputs, output and a log-sum-exp) or
  "eager" (the s x s attention probabilities materialised and saved: the 5 a s / h term of the
  formula in distkit.memory);
- activation checkpointing (transformers' activation_checkpointing_enable): none or every layer;
- parameters and activations in fp32 or bf16 (the model cast with .to(), no autocast).
Also the parameter and gradient bytes in fp32 and bf16.
"""
import argparse
import json
import warnings
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from distkit import seed_everything

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
parser.add_argument("--hidden", type=int, default=64, help="model width")
parser.add_argument("--heads", type=int, default=4, help="attention heads")
parser.add_argument("--json", help="write every measurement here")
args = parser.parse_args()
if min(args.seq, args.batch, args.heads) < 1 or args.hidden % args.heads or args.seq < 2:
    parser.error("need --seq >= 2, --batch >= 1 and --hidden a multiple of --heads")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
logging.set_verbosity_error()  # "use_cache=True is incompatible with gradient checkpointing"

LAYERS = [1, 2, 4]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (dtype, attention, checkpointing): checkpointing keeps one input per layer whatever the rest
SETTINGS = [("fp32", "sdpa", False), ("fp32", "sdpa", True), ("fp32", "eager", False),
            ("bf16", "sdpa", False), ("bf16", "eager", False)]


def measure(layers: int, attention: str, checkpoint: bool, dtype: str) -> dict:
    """Bytes by category at the end of the forward, and after the backward, of one micro-batch."""
    seed_everything(0)
    config = LlamaConfig(vocab_size=128, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=args.seq, attn_implementation=attention)
    model = LlamaForCausalLM(config).to(DTYPES[dtype]).train()
    if checkpoint:  # each layer keeps only its input; its forward runs again in backward
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=tokens, labels=tokens).loss
        forward = tracker.get_tracker_snapshot("current")
        loss.backward()
        backward = tracker.get_tracker_snapshot("current")
    (device,) = forward

    def by_name(snapshot):
        return {str(getattr(k, "value", k)): v for k, v in snapshot[device].items()}
    return {"layers": layers, "attention": attention, "checkpoint": checkpoint, "dtype": dtype,
            "end_of_forward": by_name(forward), "after_backward": by_name(backward)}


runs = [measure(n, attention, checkpoint, dtype) for dtype, attention, checkpoint in SETTINGS
        for n in LAYERS]
s, b, h, a = args.seq, args.batch, args.hidden, args.heads
print(f"activation bytes per decoder layer (s={s}, b={b}, h={h}, a={a}); "
      f"one layer's input is s*b*h = {s * b * h:,} values")
print(f"{'dtype':5s} {'attention':9s} {'checkpointing':13s} {'bytes/layer':>11s} "
      f"{'values/(sbh)':>12s}")
for i in range(0, len(runs), len(LAYERS)):
    first, last = runs[i], runs[i + len(LAYERS) - 1]
    per_layer = (last["end_of_forward"]["Activation"] - first["end_of_forward"]["Activation"]) \
        / (last["layers"] - first["layers"])
    size = torch.finfo(DTYPES[first["dtype"]]).bits // 8
    for r in runs[i:i + len(LAYERS)]:
        r["per_layer"] = per_layer
    print(f"{first['dtype']:5s} {first['attention']:9s} "
          f"{'every layer' if first['checkpoint'] else 'none':13s} {per_layer:11,.0f} "
          f"{per_layer / (s * b * h * size):12.2f}")
if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"seq": s, "batch": b, "hidden": h, "heads": a,
                                           "runs": runs}, indent=1))
