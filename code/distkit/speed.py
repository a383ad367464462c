"""How long a training step takes: chapter 08's time model, from FLOPs, bytes and a few constants.

A step of FSDP2 training (HSDP, tensor and pipeline parallelism optional: a `Layout`) costs on
each GPU, per micro-step (`step_time`):
- compute: the hardware FLOPs of its share (model FLOPs, plus what activation checkpointing
  recomputes, less what a causal flash kernel skips; `hardware_flops`) at a fraction `eta` of
  the GPU's dense bf16 peak, split into the forward and the backward;
- FSDP's collectives, phase by phase: the forward all-gathers (bf16) hide behind the forward's
  compute, the backward's all-gathers and fp32 reduce-scatters behind the backward's (and its
  recompute); each collective is alpha-beta (`collective_time`: a latency per ring step, NCCL's
  own tuning constants by default, plus bytes over the bus bandwidth, a stated fraction of the
  line rate: NVLink inside a node; across nodes NCCL spreads a ring's channels over all the
  node's NICs, so a ring with k GPUs in each node gets k NICs, `ring_bandwidth`); what the
  compute cannot cover shows, and so do the first gather and the last reduce-scatter, which
  nothing covers;
- HSDP (`replicate` > 1): the shard group's collectives as above, plus one all-reduce of the
  gradient shards across the replicas in the last micro-step of an optimizer step;
- tensor parallelism: its all-reduces (or, with sequence parallelism, all-gathers and
  reduce-scatters: the same bytes) in the layer's critical path, on NVLink; without the
  vocabulary-parallel root (`sequence_parallel`) every tp rank runs the whole LM head;
- pipeline parallelism (1F1B): (m + p - 1) micro-batch slots for m micro-batches on p stages,
  the bubble (p - 1) / (m + p - 1), a point-to-point send of the activations per boundary;
- memory-bound work no FLOP count sees (review F7, "the H200 lesson"): FSDP2's copies around
  each collective every micro-step and AdamW's step once per optimizer step, bytes over the
  GPU's HBM bandwidth (`memory_bound_seconds`); with CPU offload, the host's copies and step.
Tokens/s per GPU, MFU ([PaLM] appendix B: model FLOPs per token x tokens/s / peak, the formula
`distkit.memory.flops_per_token`, the same as torchtitan's get_num_flop_per_token) and days
follow. Left out: stragglers, data loading, kernel-level interference between overlapped
streams (eta absorbs what it can), NCCL's tree/NVLS algorithms (a ring's bytes, its latency).

`count_flops` counts a step's FLOPs with torch's own FlopCounterMode on a fake model (no memory,
no hand count); the rest is plain arithmetic, no torch import.

Sources:
- NVIDIA H100 Tensor Core GPU datasheet (2023, SXM5): BF16 Tensor Core 1,979 TFLOPS "with
  sparsity" (dense: half, 989), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (both directions).
- NVIDIA H200 Tensor Core GPU datasheet (2024, SXM): BF16 1,979 TFLOPS with sparsity, 141 GB
  HBM3e at 4.8 TB/s, NVLink 900 GB/s.
- NVIDIA A100 Tensor Core GPU datasheet (2021, 80GB SXM): BF16 312 TFLOPS dense, 80 GB HBM2e at
  2,039 GB/s, NVLink 600 GB/s.
- Memory as `nvidia-smi` reports it (MiB): "NVIDIA H100 80GB HBM3" 81,559; "NVIDIA
  A100-SXM4-80GB" 81,920; "NVIDIA H200" 143,771 (the course's own run, README "CPU vs GPU").
- torchtitan benchmarks/llama3_h100_202412_torchtitan.md (b5bcd76): its H100s have 96 GB HBM2e
  at 2.4 TB/s and run at 500 W ("the actual peak TFLOPs number is between SXM and NVL").
- NVIDIA ConnectX-7 datasheet: 400 Gb/s (NDR InfiniBand or Ethernet/RoCE) per port; DGX/HGX H100
  and H200 nodes give each GPU one such port. ConnectX-6: 200 Gb/s (HDR), A100-era nodes.
- NCCL 2.30.7 (github.com/NVIDIA/nccl, src/graph/tuning.cc, ncclTunerConstantsDefaults): ring,
  Simple protocol: a base latency of 8.4 us per collective, 3.4 us per ring step over NVLink,
  14 us per step between nodes (its model: latency = base + steps inside nodes x 3.4 + steps
  between nodes x 14, steps = ranks - 1 for an all-gather or reduce-scatter, twice that for an
  all-reduce). Order-of-magnitude defaults: measure yours (chapter 00's allreduce_bench.py).
  Its bandwidth model (tuning.cc: busBw = nChannels x bw per channel) is the whole node's: a
  ring's channels go out through different NICs. NVIDIA measures 192 GB/s all-reduce bus
  bandwidth between DGX A100s with 8 x 200 Gb/s NICs (github.com/NVIDIA/nccl issue 812), eight
  times one NIC's 25 GB/s, and expects 46-48 GB/s per 400 Gb/s NIC (NVIDIA/nccl-tests issue 290).
- torch 2.13 torch/optim/adam.py `_multi_tensor_adam` (AdamW's foreach step, counted in
  `ADAMW_BYTES`); torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py (FSDP2's copy-in
  before an all-gather, copy-out after it, the reduce-scatter's copy-in; `FSDP_COPY_BYTES`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from distkit.memory import (flops_per_token, llama_layer_saved, llama_parts, llama_training_bytes,
                            matmul_params)


@dataclass(frozen=True)
class GPU:
    name: str
    peak: float              # dense bf16 tensor-core FLOP/s (the datasheet's sparse figure / 2)
    memory_gib: float | None  # total memory as nvidia-smi reports it (MiB / 1024); None: unknown
    hbm: float               # HBM bandwidth, bytes/s (datasheet)
    nvlink: float            # bytes/s one way (the datasheet's bidirectional figure / 2)
    source: str
    arch: str = ""           # the generation ("hopper", "ampere"): its matmuls' efficiency


# The course's one table of dense bf16 tensor-core peaks (no 2:4 sparsity), FLOP/s per GPU, from
# the vendors' datasheets, by a name torch.cuda.get_device_name() contains: the longest such name
# wins ("NVIDIA L40S" is an L40S, not an L4). None: a GPU whose peak the course does not know but
# whose name holds another entry's (AWS's A10G is not an A10): MFU n/a, give --peak-tflops.
PEAK_BF16 = {"H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
             "GH200": 989e12, "H200 NVL": 835e12, "H200": 989e12, "GB200": 2500e12,
             "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L40": 181e12,
             "L4": 121e12, "A10G": None, "A10": 125e12, "MI300X": 1307e12}


def peak_bf16(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (torch.cuda.get_device_name()), or None (not in
    the table, or, as AWS's A10G, a name another entry would match with the wrong peak)."""
    names = [k for k in PEAK_BF16 if k in device_name]
    return PEAK_BF16[max(names, key=len)] if names else None


GPUS = {
    "H100 SXM": GPU("H100 SXM", PEAK_BF16["H100"], 81559 / 1024, 3.35e12, 450e9,
                    "NVIDIA H100 datasheet (2023)", "hopper"),
    "A100 80GB SXM": GPU("A100 80GB SXM", PEAK_BF16["A100"], 81920 / 1024, 2.039e12, 300e9,
                         "NVIDIA A100 datasheet (2021)", "ampere"),
    "H200 SXM": GPU("H200 SXM", PEAK_BF16["H200"], 143771 / 1024, 4.8e12, 450e9,
                    "NVIDIA H200 datasheet (2024)", "hopper"),
    # torchtitan's benchmark GPUs: the SXM's peak stands for theirs (between SXM and NVL, not
    # published), so eta fitted on them is a fraction of 989 TFLOP/s
    "H100 500W HBM2e": GPU("H100 500W HBM2e", PEAK_BF16["H100"], None, 2.4e12, 450e9,
                           "torchtitan benchmarks/llama3_h100_202412_torchtitan.md", "hopper"),
}
# bytes/s one way per GPU between nodes: one NIC per GPU (DGX/HGX); a node with fewer NICs than
# GPUs: its NICs' bandwidth / its GPUs. A ring with k GPUs in each node uses k of them
# (`ring_bandwidth`).
LINKS = {"IB NDR / RoCE 400G": 400e9 / 8, "IB HDR 200G": 200e9 / 8}
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Fabric:
    """The collectives' constants: NCCL's ring latencies (Simple protocol, tuning.cc) and the
    achieved fraction of the line rate (bus bandwidth / line rate; nccl-tests' "busbw"), the
    same for NVLink and the NIC. Measure both on your cluster (chapter 00's allreduce_bench.py:
    the latency at small sizes, the bus bandwidth at large ones) and put them here."""
    base: float = 8.4e-6      # s per collective
    nvlink_step: float = 3.4e-6  # s per ring step inside a node
    net_step: float = 14e-6   # s per ring step between nodes
    bus_efficiency: float = 0.8  # an assumption (review F5: 70-90 % typical); measure it


FABRIC = Fabric()
# Bytes AdamW's step moves through HBM per fp32 parameter. foreach (torch's CUDA default):
# counted in torch 2.13's _multi_tensor_adam, decoupled weight decay, no amsgrad: mul_(p) 8,
# lerp_(m, g) 12, mul_(v) 8, addcmul_(v, g, g) 12, sqrt(v) -> tmp 8, div_(tmp) 8, add_(tmp) 8,
# addcdiv_(p, m, tmp) 16 = 80. fused (AdamW(fused=True)): read p, g, m, v, write p, m, v = 28.
ADAMW_BYTES = {"foreach": 80, "fused": 28}
# FSDP2's copies per micro-step, bytes per parameter (bf16 compute, fp32 shards and reduction):
# each all-gather casts the fp32 shard into its bf16 input (read 4, write 2: per *sharded*
# parameter, 2 gathers) and copies the gathered bf16 buffer out into the parameters (read 2,
# write 2: per *unsharded* parameter, 2 gathers); the reduce-scatter copies the bf16 gradients
# into its fp32 input (read 2, write 4 per unsharded parameter).
FSDP_COPY_BYTES = {"sharded": 2 * 6, "unsharded": 2 * 4 + 6}
# CPU offload (FSDP2's CPUOffloadPolicy): shards cross PCIe every gather (fp32 in) and every
# reduce-scatter (fp32 out), and AdamW steps on the host. Assumed, not measured: PCIe Gen5 x16 is
# 64 GB/s each way on paper (about half of it achieved), and a host's memory bandwidth shared by
# its GPUs. A rough term, to rank offload against more GPUs; measure before you plan on it.
PCIE = 25e9        # bytes/s per GPU, host <-> device (assumed)
HOST_BW = 30e9     # bytes/s of host memory bandwidth per GPU for AdamW on the CPU (assumed)


def ring_bandwidth(ranks: int, per_node: int, intra: float, inter: float) -> float:
    """Line rate per rank of a ring over `ranks` ranks, `per_node` of them in each node: NVLink
    (`intra`) inside one node. Across nodes every ring step moves the same bytes on every hop,
    and NCCL lays the ring's channels out through different NICs, so the per_node GPUs of a node
    share per_node NICs (`inter` each: one per GPU): per_node x inter, at most NVLink's rate
    (each rank also sends all its bytes over NVLink). FSDP over whole nodes: the node's NICs;
    with tp 8 innermost (one rank of each FSDP group per node), or HSDP's replicas: one NIC."""
    per_node = max(1, min(per_node, ranks))
    return intra if ranks <= per_node else min(intra, per_node * inter)


def collective_time(op: str, nbytes: float, ranks: int, per_node: int, intra: float,
                    inter: float, fabric: Fabric = FABRIC) -> float:
    """Seconds of one ring collective on a buffer of `nbytes` (an all-gather's output, a
    reduce-scatter's input, an all-reduce's buffer) over `ranks` ranks, `per_node` of them in
    each node: alpha-beta, alpha from NCCL's ring model (steps inside nodes at nvlink_step,
    between nodes at net_step, a base per collective), beta the (N-1)/N share of the bytes each
    rank sends at the ring's line rate (`ring_bandwidth`: NVLink `intra` inside one node, the
    node's NICs `inter` each across nodes) times the fabric's bus efficiency. "all_reduce" = a
    reduce-scatter then an all-gather."""
    if ranks <= 1:
        return 0.0
    if op not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"unknown collective {op!r}")
    per_node = max(1, min(per_node, ranks))
    nodes = math.ceil(ranks / per_node)
    steps, between = ranks - 1, nodes - 1
    times = 2 if op == "all_reduce" else 1
    latency = fabric.base + times * ((steps - between) * fabric.nvlink_step
                                     + between * fabric.net_step)
    bandwidth = ring_bandwidth(ranks, per_node, intra, inter) * fabric.bus_efficiency
    return latency + times * (ranks - 1) / ranks * nbytes / bandwidth


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
    `hardware` = model + recompute + flash - causal; `forward` is the forward's share of it
    (2 per weight and token, half the forward attention); the rest runs in the backward."""
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
    out["forward"] = 2 * matmul_params(config) * tokens + attn // 6
    return out


@dataclass(frozen=True)
class Efficiency:
    """How fast the compute runs, in two parts a GPU's datasheet separates: the matmuls (and the
    flash attention kernels) at `matmul` x its dense peak, and the memory-bound operators between
    them (norms, rotary, SwiGLU's pointwise ops, residual adds, the loss's log-softmax) as
    `passes` trips through the step's activation bytes (`activation_traffic`) at its HBM
    bandwidth. torch.compile fuses pointwise ops: fewer passes. A plain float eta instead says
    "every hardware FLOP at eta x peak": the single number the two give on one GPU and model
    (`effective_eta`)."""
    matmul: float
    passes: float


# What one rerun (in the backward) adds to the activation traffic: selective checkpointing
# (SAC_POLICY, torchtitan's "op") reruns the pointwise ops, full checkpointing all of them.
RERUN = {"none": 0.0, "selective": 1.0, "full": 1.0}


def activation_traffic(config, seq: int, batch: int = 1, *, ac: str = "none", tp: int = 1,
                       sequence_parallel: bool = False, layers: int | None = None,
                       loss: bool = True, rerun: float | None = None) -> float:
    """Bytes of one micro-batch's activations on one GPU that the memory-bound operators read
    and write: a decoder layer's tensors as `llama_layer_saved` counts them without
    checkpointing (bf16, sdpa; split by tp as they are), once more for what checkpointing reruns
    (`rerun`, default RERUN[ac]), over `layers` layers (default: all), and the loss's fp32
    log-softmax and its two gradients, 12 T V (split by tp with the vocabulary-parallel loss)."""
    c = SimpleNamespace(**config)
    layer = sum(llama_layer_saved(config, seq, batch, precision="bf16", attn="sdpa",
                                  tensor_parallel=tp, sequence_parallel=sequence_parallel)
                .values())
    rerun = RERUN[ac] if rerun is None else rerun
    n = c.num_hidden_layers if layers is None else layers
    vp = tp if sequence_parallel else 1
    return n * layer * (1 + rerun) + (12 * seq * batch * c.vocab_size / vp if loss else 0)


@dataclass(frozen=True)
class Layout:
    """How a job lays out on its GPUs. Meshes follow torchtitan's order, [pp, replicate, shard,
    tp]: tensor parallelism innermost (inside a node), then FSDP's shard group, pipeline stages
    outermost.
    - gpus = pp x replicate x shard x tp; FSDP2 shards over `shard` ranks; HSDP keeps
      `replicate` copies of those shards (replicate 1: plain FSDP over all data-parallel ranks);
    - batch: sequences of `seq` tokens per data-parallel rank per micro-step (micro-batch);
    - accumulation: micro-steps per optimizer step (with pp > 1: the micro-batches m of 1F1B);
    - ac: activation checkpointing "none", "selective" (distkit.memory.SAC_POLICY) or "full";
    - sequence_parallel: with tp > 1, torchtitan's plan (SequenceParallel norms, a vocabulary-
      parallel embedding, LM head and loss); False: Megatron's plan on the decoder layers only,
      the root whole on every tp rank;
    - cpu_offload: FSDP2's CPUOffloadPolicy; loss_chunks: a chunked/fused cross-entropy;
    - sync_every_microbatch: with accumulation, reduce-scatter the gradients after every
      micro-batch (True: what the course's plans assumed, train_llama.py's
      --sync-every-microbatch, torchtitan's way) or only after the last (False: train_llama.py's
      default, FSDP2's set_requires_gradient_sync(False): fewer reduce-scatters, but every fp32
      gradient unsharded between micro-batches, 4 bytes per parameter on every GPU);
    - schedule, virtual: with pp > 1, the pipeline schedule (a name torch.distributed.pipelining
      and distkit.schedules know: "1F1B", "Interleaved1F1B", "InterleavedZeroBubble",
      "ZBVZeroBubble", ...) and its stages per rank (1 for 1F1B and GPipe, 2 for the V-shaped
      schedules, v >= 2 for the looped ones)."""
    gpus: int
    seq: int
    batch: int = 1
    accumulation: int = 1
    tp: int = 1
    pp: int = 1
    replicate: int = 1
    ac: str = "full"
    sequence_parallel: bool = False
    cpu_offload: bool = False
    loss_chunks: int = 1
    attn: str = "sdpa"
    sync_every_microbatch: bool = True
    schedule: str = "1F1B"
    virtual: int = 1

    def __post_init__(self):
        if min(self.gpus, self.seq, self.batch, self.accumulation, self.tp, self.pp,
               self.replicate, self.loss_chunks) < 1:
            raise ValueError(f"every size of a layout must be >= 1: {self}")
        if self.tp > GPUS_PER_NODE:
            raise ValueError(f"tp {self.tp}: at most {GPUS_PER_NODE} (one node)")
        if self.gpus % (self.tp * self.pp * self.replicate):
            raise ValueError(f"tp {self.tp} x pp {self.pp} x replicate {self.replicate} must "
                             f"divide {self.gpus} GPUs")
        from distkit.schedules import SCHEDULES, SINGLE, V_SHAPED
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}")
        want = 1 if self.schedule in SINGLE else 2 if self.schedule in V_SHAPED else None
        if (want and self.virtual != want) or (not want and self.virtual < 2):
            raise ValueError(f"{self.schedule} holds {want or '>= 2'} stages per rank, not "
                             f"virtual={self.virtual}")

    @property
    def dp(self) -> int:  # data-parallel ranks
        return self.gpus // (self.tp * self.pp)

    @property
    def shard(self) -> int:  # FSDP's shard group
        return self.dp // self.replicate

    @property
    def tokens_per_step(self) -> int:  # tokens per optimizer step (the global batch)
        return self.dp * self.batch * self.seq * self.accumulation

    def describe(self) -> str:
        parts = ([f"PP {self.pp}"] if self.pp > 1 else []) \
            + ([f"HSDP {self.replicate} x {self.shard}"] if self.replicate > 1
               else [f"FSDP {self.shard}"]) + ([f"TP {self.tp}" + (" + SP" if
                                               self.sequence_parallel else "")]
                                               if self.tp > 1 else [])
        extra = (", CPU offload" if self.cpu_offload else "") + (
            f", loss in {self.loss_chunks} chunks" if self.loss_chunks > 1 else "") + (
            f", {self.schedule}" + (f" (v {self.virtual})" if self.virtual > 1 else "")
            if self.pp > 1 else "") + (
            (", gradients synced every micro-batch" if self.sync_every_microbatch
             else ", fp32 gradients unsharded between micro-batches")
            if self.accumulation > 1 and self.pp == 1 else "")
        return f"{' x '.join(parts)}, {self.batch} x {self.seq} per rank, {self.ac} AC{extra}"


def memory_bound_seconds(params_sharded: float, params_unsharded: float, gpu: GPU, *,
                         optimizer: str = "foreach", fsdp: bool = True) -> dict:
    """Seconds of the memory-bound work FLOPs do not count, on one GPU: AdamW's step over the
    `params_sharded` fp32 parameters it updates (once per optimizer step), and FSDP2's copies
    around its collectives (every micro-step): bytes (ADAMW_BYTES, FSDP_COPY_BYTES) over HBM."""
    copies = (FSDP_COPY_BYTES["sharded"] * params_sharded
              + FSDP_COPY_BYTES["unsharded"] * params_unsharded) if fsdp else 0
    return {"optimizer s": ADAMW_BYTES[optimizer] * params_sharded / gpu.hbm,
            "copies s": copies / gpu.hbm}


def step_time(config, layout: Layout, *, gpu: GPU, link: float, eta: float | Efficiency,
              fabric: Fabric = FABRIC, optimizer: str = "foreach",
              extra_flops: float = 0, rerun: float | None = None) -> dict:
    """Seconds of one optimizer step of `layout` (module docstring: the terms), and what follows:
    tokens per step, tokens/s per GPU, MFU. `eta`: the fraction of the dense peak the compute
    runs at, or an `Efficiency` (matmuls at a fraction of the peak + memory-bound passes over
    the activations at HBM bandwidth; "eta" in the result is then what the two make). `extra_flops`:
    hardware FLOPs per micro-batch the model does not know of (e.g. torchtitan's selective
    checkpointing rerunning every second matmul), added to the backward; `rerun`: the
    activation traffic's rerun share, if not the layout's ac's (`activation_traffic`).
    Everything per GPU; with pp > 1 the slowest stage (its layers and the LM head)."""
    lay, c = layout, SimpleNamespace(**config)
    L, t, p, s = c.num_hidden_layers, lay.tp, lay.pp, lay.shard
    Lp = math.ceil(L / p)
    vp = t if lay.sequence_parallel else 1
    T = lay.seq * lay.batch  # tokens per micro-batch per data-parallel rank
    flops = hardware_flops(config, lay.seq, lay.batch, ac=lay.ac)
    head_f, head_b = 2 * c.vocab_size * c.hidden_size * T, 4 * c.vocab_size * c.hidden_size * T
    fwd = (flops["forward"] - head_f) / (t * p) + head_f / vp
    bwd = (flops["hardware"] - flops["forward"] - head_b + extra_flops) / (t * p) + head_b / vp
    if isinstance(eta, Efficiency):  # matmuls at a fraction of the peak, the rest at HBM speed
        traffic = activation_traffic(config, lay.seq, lay.batch, ac=lay.ac, tp=t,
                                     sequence_parallel=lay.sequence_parallel, layers=Lp,
                                     rerun=rerun)
        memory = eta.passes * traffic / gpu.hbm
        eta = (fwd + bwd) / gpu.peak / ((fwd + bwd) / (eta.matmul * gpu.peak) + memory)
    compute_f, compute_b = fwd / (eta * gpu.peak), bwd / (eta * gpu.peak)

    # FSDP over the shard group: tp innermost, so a node holds GPUS_PER_NODE // tp of its ranks
    parts = llama_parts(config)
    layer, root = parts["layer"] / t, (parts["root"] if p == 1 else
                                       c.vocab_size * c.hidden_size + c.hidden_size) / vp
    unsharded = Lp * layer + root  # parameters this GPU gathers (its stage, its tp share)
    per_node = max(1, GPUS_PER_NODE // t)

    def coll(op, nbytes, ranks=s, node=per_node):
        return collective_time(op, nbytes, ranks, node, gpu.nvlink, link, fabric)

    if s > 1:  # (with pp > 1 these run once per optimizer step, below)
        gather_f = Lp * coll("all_gather", 2 * layer) + coll("all_gather", 2 * root)
        gather_b = Lp * coll("all_gather", 2 * layer)
        scatter = Lp * coll("reduce_scatter", 4 * layer) + coll("reduce_scatter", 4 * root)
        first, last = coll("all_gather", 2 * layer), coll("reduce_scatter", 4 * root)
    else:
        gather_f = gather_b = scatter = first = last = 0.0
    comm_f, comm_b = gather_f, gather_b + scatter
    # HSDP: the gradient shards all-reduced across replicas (one rank per node in each of them),
    # layer by layer, in the last micro-step's backward
    hsdp = 0.0
    if lay.replicate > 1:
        across = max(1, GPUS_PER_NODE // (s * t))  # replicas that share a node
        hsdp = (Lp * coll("all_reduce", 4 * layer / s, lay.replicate, across)
                + coll("all_reduce", 4 * root / s, lay.replicate, across))
    # per phase: the compute covers what it can, the first gather and the last scatter show
    forward = max(compute_f, comm_f) + first
    backward = max(compute_b, comm_b) + last
    backward_last = max(compute_b, comm_b + hsdp) + last
    if not lay.sync_every_microbatch and lay.accumulation > 1:
        # gradients accumulate unsharded: the early micro-steps' backwards gather, no scatter
        backward = max(compute_b, gather_b)
    # tensor parallelism: per layer 2 all-reduces forward, 2 backward, 2 more in a full
    # checkpoint's rerun; with sequence parallelism each is a reduce-scatter + all-gather (the
    # same bytes); on NVLink, in the critical path
    reduces = 6 if lay.ac == "full" else 4
    tp_s = reduces * Lp * collective_time("all_reduce", 2 * T * c.hidden_size, t, t,
                                          gpu.nvlink, link, fabric) if t > 1 else 0.0
    # pipeline: the activations (bf16, split by tp under sequence parallelism) to the next stage
    # and their gradients back, between nodes
    p2p = 2 * (fabric.net_step + 2 * T * c.hidden_size / vp / (link * fabric.bus_efficiency)) \
        if p > 1 else 0.0
    mem = memory_bound_seconds(unsharded / s, unsharded, gpu, optimizer=optimizer, fsdp=True)
    offload = 0.0
    if lay.cpu_offload:  # shards in (fp32, every gather), gradients out (fp32); AdamW on the host
        offload = (2 * 4 + 4) * unsharded / s / PCIE
        mem["optimizer s"] = ADAMW_BYTES["foreach"] * unsharded / s / HOST_BW
    micro = forward + backward + tp_s + p2p + mem["copies s"] + offload
    micro_last = forward + backward_last + tp_s + p2p + mem["copies s"] + offload
    m = lay.accumulation
    if p > 1:  # m micro-batches through p stages: the schedule's bubble (distkit.schedules)
        # FSDP under PP gathers the stage once (behind the first micro-batch's forward) and
        # reduce-scatters once, after the last backward (torchtitan: reshard_after_forward=False
        # with PP; pipelining's REDUCE_GRAD action), all-reducing across replicas with it. A
        # looped or V schedule sends v times per micro-batch (each rank holds v stages).
        from distkit.schedules import bubble_formula
        micro = compute_f + compute_b + tp_s + lay.virtual * p2p
        exposed = max(0.0, comm_f - compute_f) + first + scatter + hsdp
        idle = float(bubble_formula(lay.schedule, p, m, lay.virtual))
        # 1F1B: (m + p - 1) slots of `micro`; in general m x micro is (1 - idle) of the step
        busy = m * micro / (1 - idle)
        step = busy + exposed + mem["copies s"] + mem["optimizer s"] + offload
        bubble = busy - m * micro
        copies = mem["copies s"]  # one gather and one reduce-scatter per step
    else:
        exposed = m * (forward + backward - compute_f - compute_b) + (backward_last - backward)
        copies, offload = m * mem["copies s"], m * offload
        step = (m - 1) * micro + micro_last + mem["optimizer s"]
        bubble = 0.0
    compute = m * (compute_f + compute_b)
    tokens = lay.tokens_per_step
    tps = tokens / step / lay.gpus
    return {"step s": step, "micro-step s": micro, "compute s": compute,
            "forward compute s": compute_f, "backward compute s": compute_b,
            "fsdp comm s": (comm_f + scatter if p > 1 else m * (comm_f + comm_b)),
            "fsdp exposed s": exposed, "hsdp all-reduce s": hsdp, "tp comm s": m * tp_s,
            "pp bubble s": bubble, "p2p s": m * p2p, "copies s": copies,
            "optimizer s": mem["optimizer s"], "offload s": offload,
            "tokens/step": tokens, "tokens/s/GPU": tps, "eta": eta,
            "mfu": flops_per_token(config, lay.seq) * tps / gpu.peak, "hardware flops": flops}


def implied_eta(config, layout: Layout, tokens_per_s_per_gpu: float, *, gpu: GPU, link: float,
                **kwargs) -> float:
    """The eta at which `step_time` gives this throughput (bisection: tokens/s rise with eta).
    NaN where no eta in (0, 1] reaches it: the rest of the step alone is slower."""
    def speed(eta):
        return step_time(config, layout, gpu=gpu, link=link, eta=eta, **kwargs)["tokens/s/GPU"]
    lo, hi = 1e-4, 1.0
    if speed(hi) < tokens_per_s_per_gpu:
        return float("nan")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speed(mid) < tokens_per_s_per_gpu else (lo, mid)
    return (lo + hi) / 2


def fsdp_threshold_tokens(eta: float, gpu: GPU, bandwidth: float, ac: str = "none", *,
                          alpha: float = 0.0, layer_params: float | None = None) -> float:
    """Tokens per GPU per micro-step below which FSDP's backward collectives outlast the
    backward's compute (F8's closed form, per phase): the backward moves 6 bytes per parameter
    (a bf16 gather, an fp32 reduce-scatter) and computes 4 FLOPs per parameter and token (6
    with full checkpointing's rerun), so its bytes hide while T >= 6 eta P / (4 B) (resp. / 6 B):
    independent of the model's size. `bandwidth`: the ring's bus bandwidth per GPU (line rate x
    efficiency: across whole nodes, the node's NICs; `ring_bandwidth`). With `alpha`, the
    latency of one of the ring's collectives (N - 1 steps: it grows with the GPUs), and
    `layer_params`, each layer's gather and reduce-scatter also wait 2 alpha: + 2 alpha eta P /
    (4 layer_params) tokens, larger for smaller layers. Leaves out the attention's FLOPs (more
    compute: a lower threshold) and the root's bytes (a higher one)."""
    flops_per_param = 6 if ac == "full" else 4
    latency = 2 * alpha * eta * gpu.peak / (flops_per_param * layer_params) if alpha else 0.0
    return 6 * eta * gpu.peak / (flops_per_param * bandwidth) + latency


def peak_bytes(config, *, gpus: int, seq: int, batch: int = 1, tp: int = 1, ac: str = "full",
               attn: str = "sdpa", pp: int = 1, replicate: int = 1,
               sequence_parallel: bool = False, cpu_offload: bool = False, loss_chunks: int = 1,
               in_flight: float = 1, unsharded_grads: bool = False,
               accumulated: bool = False) -> float:
    """Bytes one GPU allocates at the step's peak: the larger of two moments that never
    overlap. The backward's peak, `llama_training_bytes` (bf16 FSDP2 over the shard group,
    gpus / (tp pp replicate) ranks; gradients are set to None, so none exist in the forward);
    and CUDA AdamW's step, after every activation is freed: the fp32 sharded parameters, their
    fp32 gradients, AdamW's two moments, and the foreach path's temporary (`torch._foreach_sqrt`
    of exp_avg_sq, one fp32 value per sharded parameter; torch/optim/adam.py, the CPU simulation
    takes the single-tensor path and cannot see it): 4 + 4 + 8 + 4 = 20 bytes per sharded
    parameter (none on the GPU with CPU offload). This is *allocated* memory: the caching
    allocator reserves more, and the CUDA context and NCCL take their share outside torch
    (distkit.plan.reserved_bytes turns one into the other)."""
    m = llama_training_bytes(config, ranks=gpus // (tp * pp * replicate), seq=seq, batch=batch,
                             precision="bf16", attn=attn, ac=ac, tensor_parallel=tp,
                             pipeline_parallel=pp, sequence_parallel=sequence_parallel,
                             cpu_offload=cpu_offload, loss_chunks=loss_chunks,
                             in_flight=in_flight, unsharded_grads=unsharded_grads,
                             accumulated=accumulated)
    return max(m["Total"], 0 if cpu_offload else optimizer_step_bytes(m))


def optimizer_step_bytes(m: dict) -> float:
    """AdamW's step on CUDA (foreach): parameters, gradients and the temporary are each one fp32
    value per sharded parameter ("Sharded Param" bytes), plus the two moments ("OptState")."""
    return 3 * m["Sharded Param"] + m["OptState"]


def days(total_tokens: float, tokens_per_s_per_gpu: float, gpus: int) -> float:
    """Days to train on `total_tokens` at this throughput (no restarts, no evaluation)."""
    return total_tokens / (tokens_per_s_per_gpu * gpus) / 86400


__all__ = ["ADAMW_BYTES", "FABRIC", "FSDP_COPY_BYTES", "GPU", "GPUS", "GPUS_PER_NODE", "LINKS",
           "PEAK_BF16", "RERUN", "Efficiency", "Fabric", "Layout", "activation_traffic",
           "attention_flops", "collective_time", "count_flops",
           "days", "fsdp_threshold_tokens", "hardware_flops", "implied_eta",
           "memory_bound_seconds", "optimizer_step_bytes", "peak_bf16", "peak_bytes",
           "ring_bandwidth", "step_time"]
