"""Inside a mixture-of-experts layer: a tiny transformers Mixtral taken apart, in one process.

    PYTHONPATH=code python code/ch09_long_context_moe/moe_anatomy.py --json /tmp/anatomy.json

The same tiny Mixtral (and global batch) as moe_ep.py. Shown and checked, for its first layer:
the MoE block's parameters (a router and the experts as two 3-D tensors); the router's choices
(top-k of a softmax, renormalised); distkit.moe.moe, the layer written by hand as one grouped
GEMM, against transformers' block; transformers' three ways to run the experts ("eager": a loop
over the experts hit, "grouped_mm", "batched_mm") giving the same loss; the grouped GEMM's two
CPU limits; how many (token, expert) pairs each expert gets, what a capacity factor would drop,
and the load-balancing loss against transformers' own. Last, the same tensors in three other
MoE families transformers builds offline (Qwen3-MoE, DeepSeek-V3, GPT-OSS).
"""
import argparse
import warnings

import torch
import torch.nn.functional as F

from distkit import seed_everything, write_json
from distkit.cpep import moe_params
from distkit.moe import capacity, dropped, expert_load, load_balancing_loss, moe, route, \
    topk_margin
from distkit.toy import counting_data

# Float32: the hand-written layer adds the experts' outputs in another order than transformers'
# grouped_mm path (measured <= 1.2e-6 on outputs of ~1, native and scalar kernels); the three
# experts implementations gave the same loss (difference 0.0). Bounds about 10x above.
TOL = 1e-5
FACTORS = (1.0, 1.25, 1.5, 2.0)
# The counts below (loads, drops) are portable only if no token sits near a tie between its k-th
# and (k+1)-th expert: rounding moves logits of ~0.3-3 by ~1e-7 from one CPU kind to another.
# Measured closest calls: 1.6e-3 (this router), 1.2e-4 (the skewed one). Required: 1e-5.
MARGIN = 1e-5

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--experts", type=int, default=4, help="experts per layer (E)")
parser.add_argument("--top-k", type=int, default=2, help="experts per token (k)")
parser.add_argument("--sequences", type=int, default=4, help="sequences in the batch")
parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
parser.add_argument("--json", help="write what was measured here")
args = parser.parse_args()
if min(args.experts, args.top_k, args.sequences, args.seq) < 1 or args.top_k > args.experts:
    parser.error("need --experts, --top-k, --sequences, --seq >= 1 and --top-k <= --experts")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_error()

E, k = args.experts, args.top_k
config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                       num_experts_per_tok=k, max_position_embeddings=args.seq,
                       tie_word_embeddings=False)
(tokens,) = counting_data(args.sequences, seq_len=args.seq)[:]
seed_everything(0)
model = MixtralForCausalLM(config)
block = model.model.layers[0].mlp
seen = {}

print("1. the MoE block of layer 0 (transformers' MixtralSparseMoeBlock):")
for name, p in block.named_parameters():
    print(f"   mlp.{name:20s} {tuple(p.shape)}")
counted = sum(p.numel() for p in model.parameters())
params = moe_params(config.to_dict())
seen["params"] = {"model": counted, **params}
print(f"   parameters: {counted:,} in all = distkit.cpep.moe_params: {counted == params['total']}; "
      f"a token's forward uses {params['active']:,} (top-{k} of {E} experts)")

# layer 0's input: the embeddings, through the layer's attention and its second norm
inputs = {}
block.register_forward_pre_hook(lambda m, a: inputs.setdefault("x", a[0].detach()))
with torch.no_grad():
    model(input_ids=tokens)
x = inputs["x"].reshape(-1, config.hidden_size)
logits, weights, chosen = route(x, block.gate.weight, k)
load = expert_load(chosen, E)
seen["load"], seen["tokens"] = load, x.shape[0]
print(f"2. the router on {x.shape[0]} tokens: logits {tuple(logits.shape)}; tokens 0-3 go to "
      f"experts {chosen[:4].tolist()}; each token's {k} weights sum to 1: "
      f"{bool(torch.allclose(weights.sum(-1), torch.ones(x.shape[0])))}")
print(f"   (token, expert) pairs per expert: {load} (of {x.shape[0] * k}; even: "
      f"{x.shape[0] * k // E} each)")
seen["router_margin"] = topk_margin(logits, k)
print(f"   no near-tie: no token's choices no. {k} and {k + 1} lie within {MARGIN:.0e} in "
      f"logit (these counts are the same on any CPU): {seen['router_margin'] >= MARGIN}")

with torch.no_grad():
    by_hand = moe(x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, k)
    theirs = block(inputs["x"]).reshape(-1, config.hidden_size)
seen["by_hand_error"] = (by_hand - theirs).abs().max().item()
print(f"3. distkit.moe.moe (sort by expert, one grouped GEMM, combine) = transformers' block: "
      f"max |difference| < {TOL:.0e}: {seen['by_hand_error'] < TOL}")

losses = {}
for impl in ("eager", "grouped_mm", "batched_mm"):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        losses[impl] = model(input_ids=tokens, labels=tokens).loss.item()
seen["losses"] = losses
spread = max(losses.values()) - min(losses.values())
print(f"4. experts_implementation eager, grouped_mm, batched_mm: the same loss "
      f"({losses['eager']:.3f}) within {TOL:.0e}: {spread < TOL}")

traps = {}
w = torch.randn(3, 8, 16, requires_grad=True)
rows, offs = torch.randn(10, 8), torch.tensor([3, 7, 10], dtype=torch.int32)
for what, run in (("float64", lambda: F.grouped_mm(rows.double(), w.double(), offs=offs)),
                  (".sum().backward()", lambda: F.grouped_mm(rows, w, offs=offs).sum().backward())):
    try:
        run()
        traps[what] = None
    except RuntimeError as e:
        traps[what] = str(e).splitlines()[0]
seen["traps"] = traps
print("5. F.grouped_mm on a CPU (torch 2.13): float32 and bfloat16 run;")
for what, error in traps.items():
    print(f"   {what}: {error}")

print(f"6. capacity: each expert takes at most factor x {x.shape[0]} x {k} / {E} pairs; "
      "the rest are dropped")
seen["capacity"] = {}
for factor in FACTORS:
    cap = capacity(x.shape[0], E, k, factor)
    seen["capacity"][factor] = {"capacity": cap, "dropped": dropped(load, cap)}
    print(f"   factor {factor:4}: capacity {cap:3d}, dropped {dropped(load, cap):3d} of "
          f"{x.shape[0] * k} pairs")
ours = load_balancing_loss(logits, k).item()
theirs_aux = load_balancing_loss_func((logits,), E, k).item()
seen["aux_loss"], seen["aux_loss_transformers"] = ours, theirs_aux
skew = torch.zeros(E)
skew[0] = 3.0  # a router that favours expert 0: +3 on its logit
skewed = logits + skew
seen["skewed"] = {"load": expert_load(torch.topk(skewed, k, dim=-1)[1], E),
                  "aux_loss": load_balancing_loss(skewed, k).item(),
                  "router_margin": topk_margin(skewed, k)}
print(f"7. load-balancing loss (Switch Transformer's, x E): {ours:.2f}; transformers' "
      f"load_balancing_loss_func the same: {abs(ours - theirs_aux) < 1e-6}; even picks with "
      f"even probabilities give {k} (the top-k). A router favouring expert 0 (+3 on its "
      f"logit): loads {seen['skewed']['load']}, loss {seen['skewed']['aux_loss']:.2f}")

print("8. the same tensors elsewhere (layer 1 of tiny configs; transformers 5.23):")
others = {"qwen3_moe": dict(num_experts=E, moe_intermediate_size=32, head_dim=8),
          "deepseek_v3": dict(n_routed_experts=E, n_shared_experts=1, moe_intermediate_size=32,
                              first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                              topk_group=1, num_key_value_heads=4),
          "gpt_oss": dict(num_local_experts=E)}
seen["families"] = {}
for family, extra in others.items():
    extra = {"num_key_value_heads": 2, **extra}
    cfg = AutoConfig.for_model(family, vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_experts_per_tok=k, **extra)
    other = AutoModelForCausalLM.from_config(cfg)
    shapes = {n.removeprefix("model.layers.1."): list(p.shape)
              for n, p in other.named_parameters() if n.startswith("model.layers.1.mlp.")}
    seen["families"][family] = shapes
    print(f"   {type(other).__name__}: " + ", ".join(f"{n} {tuple(s)}" for n, s in shapes.items()))
write_json(args.json, {"experts": E, "top_k": k, **seen})
