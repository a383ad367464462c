"""Context and expert parallelism at real sizes, simulated on a laptop; the planner checked.

    PYTHONPATH=code python code/ch09_long_context_moe/simulate_cp_ep.py --json /tmp/sim.json

As chapter 03's simulate_fsdp.py: torch's fake process group plays every rank's collectives
(they return at once, nothing is sent) and FakeTensorMode gives tensors shapes but no memory, so
rank 0 of a real-size job trains two steps while FSDPMemTracker counts its bytes by category and
distkit.comm.CollectiveLog its collectives. Two jobs, each the first --layers decoder layers of
a published model (every layer is the same, so the planner is evaluated at that depth):
- cp: Llama 3.1 8B, --cp-seq tokens per sequence, FSDP2 (bf16 compute, fp32 reduction, full
  activation checkpointing) over --cp-gpus GPUs = dp x cp, attention by Ulysses' all-to-alls
  over cp (distkit.cp; the ring's point-to-point sends are not collectives the fake group
  plays). Against distkit.cpep.cp_memory and cp_bytes.
- ep: Mixtral 8x7B, --ep-seq tokens, FSDP2 over --ep-gpus GPUs, for each expert-parallel degree
  of --ep: each GPU holds E/ep experts (distkit.moe.ExpertParallel), FSDP-sharded over the
  gpus/ep GPUs that hold the same ones (torchtitan's layout; distkit.moe.apply_ep_fsdp, whose
  gradients moe_ep.py checks with real tensors). Fake tensors hold no values, so
  the router's choices cannot be counted: the simulation assumes they are spread evenly. Against
  distkit.cpep.moe_plan: the states, the gathered layer and every byte communicated.
Limits (printed): CPU code paths (no CUDA streams or allocator); even routing; torch's private
trackers (torch.distributed._tools).
"""
import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from distkit import int_list
from distkit.comm import CollectiveLog
from distkit.cp import ulysses_attention
from distkit.cpep import MOE_CONFIGS, cp_bytes, cp_memory, moe_plan
from distkit.memory import LLAMA_CONFIGS
from distkit.moe import apply_ep_fsdp

LIMITS = ("CPU code paths (no CUDA streams, no allocator caching), the router's choices assumed "
          "even (fake tensors hold no values), torch's private trackers")
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--parts", default="cp,ep", help="comma list of cp, ep")
parser.add_argument("--layers", type=int, default=2, help="decoder layers simulated")
parser.add_argument("--cp-gpus", type=int, default=32, help="GPUs of the CP job (dp x cp)")
parser.add_argument("--cp", type=int, default=8, help="context-parallel degree")
parser.add_argument("--cp-seq", type=int, default=131072, help="tokens per sequence (CP job)")
parser.add_argument("--ep-gpus", type=int, default=16, help="GPUs of the MoE job")
parser.add_argument("--ep", type=int_list, default=[1, 8], help="expert-parallel degrees")
parser.add_argument("--ep-seq", type=int, default=4096, help="tokens per GPU (MoE job)")
parser.add_argument("--json", help="write the simulated and planned bytes here")
args = parser.parse_args()
parts = args.parts.split(",")
if set(parts) - {"cp", "ep"} or args.layers < 1:
    parser.error("--parts: a comma list of cp, ep; --layers >= 1")
if "cp" in parts and (args.cp_gpus % args.cp or args.cp_seq % args.cp or 8 % args.cp):
    parser.error("--cp must divide --cp-gpus, --cp-seq and Llama 8B's 8 key/value heads")
if "ep" in parts and any(args.ep_gpus % e or 8 % e for e in args.ep):
    parser.error("each --ep must divide --ep-gpus and Mixtral's 8 experts")

with warnings.catch_warnings():  # transformers imports tqdm, which may warn about ipywidgets
    warnings.simplefilter("ignore")
    from transformers import LlamaConfig, MixtralConfig, AttentionInterface, \
        LlamaForCausalLM, MixtralForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_error()  # "use_cache=True is incompatible with gradient checkpointing"
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def category(key) -> str:
    return str(getattr(key, "value", key))


def step(model, tokens, positions=None) -> dict:
    """Two training steps (AdamW's state exists from the second); the second one measured."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=tokens, position_ids=positions, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((tokens,))
    with CollectiveLog(profile=True) as log, tracker:  # profile: the FSDP unit of each
        model(input_ids=tokens, position_ids=positions, labels=tokens).loss.backward()
        optimizer.step()
        after = tracker.get_tracker_snapshot("current")
        optimizer.zero_grad()
    (device,) = after
    peak = tracker.get_tracker_snapshot("peak")[device]
    return {"peak": {category(k): v for k, v in peak.items()},
            "after_step": {category(k): v for k, v in after[device].items()},
            "collectives": [(c.op, len(c.ranks), c.dtype[6:], c.nbytes, c.unit)
                            for c in log.collectives]}


def sent(collectives, op=None) -> float:
    """Bytes rank 0 sends in a ring: (n-1)/n of each collective's logged size."""
    return sum(nbytes * (n - 1) / n for o, n, _, nbytes, _ in collectives if op in (None, o))


def simulate_cp() -> dict:
    config = dict(LLAMA_CONFIGS["8b"], num_hidden_layers=args.layers)
    n, cp, seq = args.cp_gpus, args.cp, args.cp_seq
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    mesh = init_device_mesh("cpu", (n // cp, cp), mesh_dim_names=("dp", "cp"))
    fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")

    def ulysses(module, q, k, v, mask, scaling=None, dropout=0.0, **kwargs):
        return ulysses_attention(q, k, v, mesh.get_group("cp")).transpose(1, 2), None
    AttentionInterface.register("cp_ulysses", ulysses)
    AttentionMaskInterface.register("cp_ulysses", lambda *a, **k: None)
    with FakeTensorMode():
        model = LlamaForCausalLM(LlamaConfig(**config, max_position_embeddings=seq,
                                             attn_implementation="cp_ulysses"))
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh, mp_policy=POLICY)
        fully_shard(model, mesh=fsdp_mesh, mp_policy=POLICY)
        tokens = torch.randint(0, config["vocab_size"], (1, seq // cp))
        out = step(model, tokens, torch.arange(seq // cp).unsqueeze(0))
    dist.destroy_process_group()
    out["plan"] = cp_memory(config, gpus=n, cp=cp, seq=seq)
    out["plan all-to-all"] = cp_bytes(config, cp=cp, seq=seq, method="ulysses")
    out["all-to-all"] = sent(out["collectives"], "all_to_all")
    out.update(gpus=n, cp=cp, seq=seq, layers=args.layers)
    return out


def simulate_ep(ep: int) -> dict:
    config = dict(MOE_CONFIGS["mixtral-8x7b"], num_hidden_layers=args.layers)
    config.pop("model_type")
    n, seq = args.ep_gpus, args.ep_seq
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    mesh = init_device_mesh("cpu", (n // ep, ep), mesh_dim_names=("efsdp", "ep"))
    everyone = mesh["efsdp", "ep"]._flatten("all")
    with FakeTensorMode():
        model = MixtralForCausalLM(MixtralConfig(**config, max_position_embeddings=seq))
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
        # E/ep experts per GPU (ExpertParallel over ep), FSDP2 over efsdp for them and over all
        # GPUs for the rest; the experts' gradients divided by N (distkit.moe.apply_ep_fsdp;
        # moe_ep.py checks that layout with real tensors against one process)
        apply_ep_fsdp(model, mesh, everyone, mp_policy=POLICY, even=True)
        tokens = torch.randint(0, config["vocab_size"], (1, seq))
        out = step(model, tokens)
    dist.destroy_process_group()
    out["plan"] = moe_plan(config, gpus=n, ep=ep, seq=seq)
    # a decoder layer's weights as gathered for its forward: its own unit and its experts'
    layer0 = ("model.layers.0", "model.layers.0.mlp.experts")
    out["gathered layer"] = sum(next(nb for op, _, _, nb, unit in out["collectives"]
                                     if op == "all_gather" and unit == u) for u in layer0)
    out["fsdp"] = sent([c for c in out["collectives"] if c[0] != "all_to_all"])
    out["all-to-all"] = sent(out["collectives"], "all_to_all")
    out.update(gpus=n, ep=ep, seq=seq, layers=args.layers)
    return out


results, GiB = {}, 2**30
if "cp" in parts:
    r = results["cp"] = simulate_cp()
    print(f"CP: Llama 3.1 8B (first {r['layers']} layers), {r['seq']:,} tokens, {r['gpus']} GPUs "
          f"= dp {r['gpus'] // r['cp']} x cp {r['cp']}, Ulysses, bf16, full checkpointing")
    print(f"  peak per GPU: simulated {r['peak']['Total'] / GiB:.2f} GiB, planned "
          f"{r['plan']['Total'] / GiB:.2f} GiB; all-to-all sent per step: simulated "
          f"{r['all-to-all'] / GiB:.2f} GiB, planned {r['plan all-to-all'] / GiB:.2f} GiB")
if "ep" in parts:
    for ep in args.ep:
        r = results[f"ep{ep}"] = simulate_ep(ep)
        p = r["plan"]
        states = sum(r["after_step"].get(k, 0) for k in ("Sharded Param", "Sharded Grad",
                                                          "OptState"))
        print(f"EP: Mixtral 8x7B (first {r['layers']} layers), {r['seq']:,} tokens per GPU, "
              f"{r['gpus']} GPUs, ep {ep}: states {states / GiB:.2f} GiB (planned "
              f"{p['states'] / GiB:.2f}), gathered layer {r['gathered layer'] / GiB:.2f} GiB "
              f"({p['gathered layer'] / GiB:.2f}), FSDP sent {r['fsdp'] / GiB:.2f} GiB "
              f"({(p['fsdp dense'] + p['fsdp experts']) / GiB:.2f}), all-to-all "
              f"{r['all-to-all'] / GiB:.2f} GiB ({p['all-to-all'] / GiB:.2f}); peak "
              f"{r['peak']['Total'] / GiB:.2f} GiB")
print(f"limits: {LIMITS}")
if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=code python code/ch09_long_context_moe/simulate_cp_ep.py " \
        + " ".join(sys.argv[1:])
    Path(args.json).write_text(json.dumps({"command": command, "torch": torch.__version__,
                                           "limits": LIMITS, "results": results}, indent=1))
