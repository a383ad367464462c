"""Chapter 03: activation bytes per Llama layer, measured, against the formula that counts them.

    PYTHONPATH=code python code/ch03_zero/activations.py --json build/ch03/activations.json

One process, no process group: activations do not depend on how the model states are sharded,
only on the micro-batch each rank runs. For a small transformers Llama in Llama 3's shape
(grouped-query attention with a quarter of the heads for keys and values, a SwiGLU MLP 3.5x as
wide as the model, RMSNorm) with 1, 2 and 4 decoder layers, torch's MemTracker counts the bytes
the forward leaves alive for the backward ("Activation") at the end of the forward. The slope
over the layer count is what one layer keeps; the intercept is the embeddings, the logits and
the loss. Each slope is printed beside distkit.memory.llama_layer_saved, which counts the same
bytes tensor by tensor. Settings swept:
- attention: "sdpa" (a fused kernel that saves only its inputs, output and a log-sum-exp) or
  "eager" (the s x s attention probabilities materialised and saved);
- activation checkpointing (transformers' activation_checkpointing_enable): none or every layer;
- precision: fp32; bf16 (the model cast with .to(), what FSDP2's MixedPrecisionPolicy computes
  in); amp (fp32 weights under torch.autocast(bfloat16), PyTorch AMP).
"""
import argparse
import json
import warnings
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from distkit import seed_everything
from distkit.memory import by_category, llama_layer_saved

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
parser.add_argument("--hidden", type=int, default=64, help="model width h")
parser.add_argument("--heads", type=int, default=4, help="attention heads a")
parser.add_argument("--kv-heads", type=int, help="key/value heads (default a / 4, as Llama 3 8B)")
parser.add_argument("--intermediate", type=int, help="MLP width (default 3.5 h, as Llama 3 8B)")
parser.add_argument("--json", help="write every measurement here")
args = parser.parse_args()
kv_heads = args.kv_heads or max(1, args.heads // 4)
intermediate = args.intermediate or int(3.5 * args.hidden)
if min(args.seq, args.batch, args.heads, kv_heads, intermediate) < 1 or args.seq < 2 \
        or args.hidden % args.heads or args.heads % kv_heads:
    parser.error("need --seq >= 2, --batch >= 1, --hidden a multiple of --heads and --heads a "
                 "multiple of --kv-heads")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
logging.set_verbosity_error()  # "use_cache=True is incompatible with gradient checkpointing"

LAYERS = [1, 2, 4]
SHAPE = dict(vocab_size=128, hidden_size=args.hidden, intermediate_size=intermediate,
             num_attention_heads=args.heads, num_key_value_heads=kv_heads)
# (precision, attention, checkpointing): checkpointing keeps one input per layer whatever the rest
SETTINGS = [("fp32", "sdpa", False), ("fp32", "sdpa", True), ("fp32", "eager", False),
            ("bf16", "sdpa", False), ("bf16", "eager", False), ("amp", "sdpa", False)]


def measure(layers: int, attention: str, checkpoint: bool, precision: str) -> dict:
    """Bytes by category at the end of the forward, and after the backward, of one micro-batch."""
    seed_everything(0)
    config = LlamaConfig(**SHAPE, num_hidden_layers=layers, max_position_embeddings=args.seq,
                         attn_implementation=attention)
    model = LlamaForCausalLM(config).train()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if checkpoint:  # each layer keeps only its input; its forward runs again in backward
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "amp"):
            loss = model(input_ids=tokens, labels=tokens).loss
        forward = tracker.get_tracker_snapshot("current")
        loss.backward()
        backward = tracker.get_tracker_snapshot("current")
    (device,) = forward
    return {"layers": layers, "attention": attention, "checkpoint": checkpoint,
            "dtype": precision, "end_of_forward": by_category(forward, device),
            "after_backward": by_category(backward, device)}


runs = [measure(n, attention, checkpoint, precision)
        for precision, attention, checkpoint in SETTINGS for n in LAYERS]
s, b, h, a = args.seq, args.batch, args.hidden, args.heads
print(f"activation bytes per decoder layer (s={s}, b={b}, h={h}, a={a}, key/value heads "
      f"{kv_heads}, intermediate {intermediate}); s*b*h = {s * b * h:,}")
print(f"{'precision':9s} {'attention':9s} {'checkpointing':13s} {'bytes/layer':>11s} "
      f"{'bytes/(sbh)':>11s} {'llama_layer_saved':>17s} {'equal':>5s}")
for i in range(0, len(runs), len(LAYERS)):
    group = runs[i:i + len(LAYERS)]
    first, last = group[0], group[-1]
    per_layer = (last["end_of_forward"]["Activation"] - first["end_of_forward"]["Activation"]) \
        // (last["layers"] - first["layers"])
    # every point on one line: the intercept is the same from each layer count
    straight = len({r["end_of_forward"]["Activation"] - r["layers"] * per_layer
                    for r in group}) == 1
    model = sum(llama_layer_saved(SHAPE, s, b, precision=first["dtype"],
                                  attn=first["attention"],
                                  ac="full" if first["checkpoint"] else "none").values())
    for r in group:
        r.update(per_layer=per_layer, model_per_layer=model, straight=straight)
    print(f"{first['dtype']:9s} {first['attention']:9s} "
          f"{'every layer' if first['checkpoint'] else 'none':13s} {per_layer:11,d} "
          f"{per_layer / (s * b * h):11.2f} {model:17,d} "
          f"{str(per_layer == model and straight):>5s}")
if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"seq": s, "batch": b, "hidden": h, "heads": a,
                                           "kv_heads": kv_heads, "intermediate": intermediate,
                                           "config": SHAPE, "runs": runs}, indent=1))
