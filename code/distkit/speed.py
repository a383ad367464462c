"""How long a training step takes: chapter 08's speed model, from FLOPs and bytes.

A step of data-parallel (FSDP2) training, optionally with tensor parallelism, costs on each GPU
- compute: the hardware FLOPs of its share of the step (model FLOPs, plus what activation
  checkpointing recomputes, less what a causal flash kernel skips) at a stated fraction `eff` of
  the GPU's dense bf16 peak;
- FSDP's collectives (all-gather the bf16 parameters twice, reduce-scatter the fp32 gradients:
  `distkit.memory.communication_bytes`) at the link's bandwidth; they run on their own stream,
  so only what the compute cannot cover shows: the first layer's all-gather, the last
  reduce-scatter, and whatever exceeds the compute;
- tensor parallelism's all-reduces (two per layer forward, two backward; Megatron without
  sequence parallelism) on NVLink, in the layer's critical path: not hidden.
Tokens/s per GPU, MFU ([PaLM] appendix B: model FLOPs per token x tokens/s / peak, the formula
`distkit.memory.flops_per_token`, the same as torchtitan's get_num_flop_per_token) and days
follow. What it leaves out: the optimizer step and FSDP's copy-in/out (memory-bound, a few % of
a step), stragglers, data loading, and kernel-level overlap slow-downs: `eff` absorbs them,
which is why it is given as a range, not a number.

`count_flops` counts a step's FLOPs with torch's own FlopCounterMode on a fake model (no memory,
no hand count); the rest is plain arithmetic, no torch import.

Sources:
- NVIDIA H100 Tensor Core GPU datasheet (2023, SXM5): BF16 Tensor Core 1,979 TFLOPS "with
  sparsity" (dense: half, 989), 80 GB HBM3, NVLink 900 GB/s (both directions).
- NVIDIA H200 Tensor Core GPU datasheet (2024, SXM): BF16 1,979 TFLOPS with sparsity, 141 GB
  HBM3e, NVLink 900 GB/s.
- NVIDIA A100 Tensor Core GPU datasheet (2021, 80GB SXM): BF16 312 TFLOPS dense, 80 GB HBM2e,
  NVLink 600 GB/s.
- NVIDIA ConnectX-7 datasheet: 400 Gb/s (NDR InfiniBand or Ethernet/RoCE) per port; DGX/HGX H100
  and H200 nodes give each GPU one such port. ConnectX-6: 200 Gb/s (HDR), A100-era nodes.
- torchtitan (github.com/pytorch/torchtitan), torchtitan/utils.py at 9dec370, get_peak_flops:
  the same dense peaks (A100 312e12, H100 SXM 989e12) for its MFU.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from distkit.memory import communication_bytes, flops_per_token, llama_parts, llama_training_bytes


@dataclass(frozen=True)
class GPU:
    name: str
    peak: float        # dense bf16 tensor-core FLOP/s (the datasheet's sparse figure / 2)
    memory_gb: float   # HBM, as the datasheet names it
    nvlink: float      # bytes/s one way (the datasheet's bidirectional figure / 2)
    source: str


# The course's one table of dense bf16 tensor-core peaks (no 2:4 sparsity), FLOP/s per GPU, from
# the vendors' datasheets, by the name torch.cuda.get_device_name() contains: the first match wins
# (more specific names first). The capstone's MFU and the planner both read it.
PEAK_BF16 = {"H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
             "H200 NVL": 835e12, "H200": 989e12, "GH200": 989e12, "GB200": 2500e12,
             "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12,
             "L4": 121e12, "A10": 125e12, "MI300X": 1307e12}  # GB200 before B200


def peak_bf16(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (torch.cuda.get_device_name()), or None."""
    return next((v for k, v in PEAK_BF16.items() if k in device_name), None)


GPUS = {
    "H100 SXM": GPU("H100 SXM", PEAK_BF16["H100"], 80, 450e9, "NVIDIA H100 datasheet (2023)"),
    "A100 80GB SXM": GPU("A100 80GB SXM", PEAK_BF16["A100"], 80, 300e9,
                         "NVIDIA A100 datasheet (2021)"),
    "H200 SXM": GPU("H200 SXM", PEAK_BF16["H200"], 141, 450e9, "NVIDIA H200 datasheet (2024)"),
}
# bytes/s one way per GPU between nodes (one NIC per GPU)
LINKS = {"IB NDR / RoCE 400G": 400e9 / 8, "IB HDR 200G": 200e9 / 8}
GPUS_PER_NODE = 8
# The fraction of the dense peak that a whole step's hardware FLOPs run at (matmuls near 0.7 of
# peak on large shapes, the rest of the step's ops far less): an assumption, stated as a range.
EFF = (0.4, 0.5, 0.6)


def count_flops(config, seq: int, batch: int = 1, *, attn: str = "eager", ac: str = "none") -> dict:
    """FLOPs of one training step (forward + backward) of a transformers LlamaForCausalLM with
    `config` (a dict such as LLAMA_CONFIGS["8b"]) on `batch` x `seq` tokens, counted by torch's
    FlopCounterMode (torch/utils/flop_counter.py) on a model built under FakeTensorMode: shapes
    only, so 70B costs nothing. Returns FLOPs by operator ({"aten.mm": ..., ...}).

    Counted on 1 and on 2 decoder layers and extrapolated to the config's layers (every layer has
    the same shapes, so FLOPs are linear in the layer count: L x (F2 - F1) + (2 F1 - F2)).
    Attention runs as "eager" (its two matmuls visible to the counter, over the whole s x s, as
    the convention counts) and, for hardware FLOPs, as "sdpa": torch counts no CPU flash kernel,
    so this gives the CPU operators torch's formulas for the CUDA flash kernel (sdpa_flop,
    sdpa_backward_flop: the backward recomputes the scores, 2.5x the forward). `ac` "full"
    reruns each layer's forward in the backward, which the counter sees.
    """
    import warnings

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils import flop_counter as fc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import LlamaConfig, LlamaForCausalLM
    aten = torch.ops.aten
    for cpu, cuda in ((aten._scaled_dot_product_flash_attention_for_cpu,
                       aten._scaled_dot_product_flash_attention),
                      (aten._scaled_dot_product_flash_attention_for_cpu_backward,
                       aten._scaled_dot_product_flash_attention_backward)):
        fc.flop_registry.setdefault(cpu, fc.flop_registry[cuda])
    counts = []
    for layers in (1, 2):
        cfg = LlamaConfig(**{**config, "num_hidden_layers": layers}, max_position_embeddings=seq,
                          attn_implementation=attn)
        with FakeTensorMode():
            model = LlamaForCausalLM(cfg)
            if ac == "full":
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
            with fc.FlopCounterMode(display=False) as counter:
                model(input_ids=tokens, labels=tokens).loss.backward()
        counts.append({str(k): v for k, v in counter.get_flop_counts()["Global"].items()})
    L = config["num_hidden_layers"]
    return {op: L * (counts[1].get(op, 0) - counts[0].get(op, 0))
            + 2 * counts[0].get(op, 0) - counts[1].get(op, 0) for op in counts[1]}


def attention_flops(config, seq: int, batch: int = 1) -> int:
    """The attention's scores and weighted sum over the whole s x s, forward and backward:
    12 L a d s per token ([PaLM]), the part of `flops_per_token` that is not 6 x weights."""
    c = SimpleNamespace(**config)
    return 12 * c.num_hidden_layers * c.hidden_size * seq * seq * batch


def hardware_flops(config, seq: int, batch: int = 1, *, ac: str = "none") -> dict:
    """What the GPU computes in one step, beside the model FLOPs that MFU counts:
    - model: 6 per matmul weight and token + attention over the whole s x s (flops_per_token);
    - recompute: full checkpointing reruns the decoder layers' forward (2 per weight and token,
      a third of the attention) up to the last tensor the backward needs: torch's non-reentrant
      checkpoint stops early (torch/utils/checkpoint.py, set_checkpoint_early_stop), so the
      MLP's down projection, whose output no backward needs, is not rerun; selective
      (distkit.memory.SAC_POLICY) saves every matmul's output: no matmul reruns;
    - flash: a flash kernel's backward recomputes the scores: + 1/6 of the attention;
    - causal: the kernel skips the blocks above the diagonal: about half the attention.
    `hardware` = model + recompute + flash - causal."""
    from distkit.memory import matmul_params
    tokens, attn = seq * batch, attention_flops(config, seq, batch)
    out = {"model": flops_per_token(config, seq) * tokens,
           # the decoder layers' forward again but the MLP's down projection (the LM head is not
           # checkpointed; torch stops recomputing at the last tensor the backward needs)
           "recompute": 2 * (matmul_params(config) - config["vocab_size"] * config["hidden_size"]
                             - config["num_hidden_layers"] * config["hidden_size"]
                             * config["intermediate_size"]) * tokens + attn // 3
           if ac == "full" else 0,
           "flash backward recompute": attn // 6}
    ran = attn + out["flash backward recompute"] + (attn // 3 if ac == "full" else 0)
    out["causal skip"] = -(ran // 2)  # of all the attention that ran
    out["hardware"] = sum(out.values())
    return out


def step_time(config, *, gpu: GPU, link: float, gpus: int, seq: int, batch: int,
              ac: str = "none", tp: int = 1, eff: float = EFF[1], extra_flops: float = 0) -> dict:
    """Seconds of one step on `gpus` GPUs (FSDP over gpus / tp, tensor parallel over tp within
    a node), each data-parallel group on `batch` sequences of `seq` tokens; and what follows:
    tokens/s per GPU, MFU. Bandwidths: NVLink when every FSDP rank sits in one node, else the
    `link` between nodes (a ring across nodes runs at the per-GPU NIC's speed). `extra_flops`:
    hardware FLOPs per data-parallel rank the model does not know of (e.g. torchtitan's
    selective checkpointing recomputing every second matmul)."""
    if tp > GPUS_PER_NODE or gpus % tp:
        raise ValueError(f"tp {tp}: at most {GPUS_PER_NODE} (one node), dividing {gpus} GPUs")
    dp = gpus // tp
    c = SimpleNamespace(**config)
    flops = hardware_flops(config, seq, batch, ac=ac)
    compute = (flops["hardware"] + extra_flops) / tp / (eff * gpu.peak)
    parts = llama_parts(config)
    params = c.num_hidden_layers * parts["layer"] / tp + parts["root"]
    fsdp_bytes = communication_bytes(params, dp, 3, param_bytes=2, reduce_bytes=4,
                                     gathered_once=parts["root"]) if dp > 1 else 0
    fsdp_bw = gpu.nvlink if gpus <= GPUS_PER_NODE else link  # else its ring crosses nodes
    fsdp = fsdp_bytes / fsdp_bw
    # one layer's gather before the first compute and one reduce-scatter after the last
    exposed = max(0.0, fsdp - compute) + fsdp / c.num_hidden_layers
    # tensor parallel: 4 all-reduces of the layer's bf16 activations per layer (6 with full
    # checkpointing: the rerun forward's two), each 2 (tp - 1) / tp of its bytes, on NVLink
    reduces = 6 if ac == "full" else 4
    tp_bytes = (reduces * c.num_hidden_layers * 2 * (tp - 1) / tp * 2 * seq * batch * c.hidden_size
                if tp > 1 else 0)
    tp_time = tp_bytes / gpu.nvlink
    total = compute + exposed + tp_time
    tokens = seq * batch * dp
    tps = tokens / total / gpus
    return {"step s": total, "compute s": compute, "fsdp comm s": fsdp,
            "fsdp exposed s": exposed, "tp comm s": tp_time, "fsdp bytes": fsdp_bytes,
            "tp bytes": tp_bytes, "tokens/s/GPU": tps,
            "mfu": flops_per_token(config, seq) * tps / gpu.peak, "hardware flops": flops}


def peak_bytes(config, *, gpus: int, seq: int, batch: int = 1, tp: int = 1, ac: str = "full",
               attn: str = "sdpa") -> float:
    """Bytes one GPU needs at the step's peak for planning: the larger of two moments that never
    overlap. The backward's peak, `llama_training_bytes` (bf16 FSDP2 over gpus / tp ranks, tensor
    parallel over tp; gradients are set to None, so none exist in the forward); and CUDA AdamW's
    step, after every activation is freed: the fp32 sharded parameters, their fp32 gradients,
    AdamW's two moments, and the foreach path's temporary (`torch._foreach_sqrt` of exp_avg_sq,
    one fp32 value per sharded parameter; torch/optim/adam.py, the CPU simulation takes the
    single-tensor path and cannot see it): 4 + 4 + 8 + 4 = 20 bytes per sharded parameter.
    Not counted: the CUDA context, NCCL's buffers and the caching allocator's cached and
    fragmented blocks (compare with a fraction of the GPU's memory)."""
    m = llama_training_bytes(config, ranks=gpus // tp, seq=seq, batch=batch, precision="bf16",
                             attn=attn, ac=ac, tensor_parallel=tp)
    return max(m["Total"], optimizer_step_bytes(m))


def optimizer_step_bytes(m: dict) -> float:
    """AdamW's step on CUDA (foreach): parameters, gradients and the temporary are each one fp32
    value per sharded parameter ("Sharded Param" bytes), plus the two moments ("OptState")."""
    return 3 * m["Sharded Param"] + m["OptState"]


def days(total_tokens: float, tokens_per_s_per_gpu: float, gpus: int) -> float:
    """Days to train on `total_tokens` at this throughput (no restarts, no evaluation)."""
    return total_tokens / (tokens_per_s_per_gpu * gpus) / 86400
