"""Plan a training job: chapter 08's planner, on top of distkit.memory and distkit.speed.

A plan answers what a budget holder asks before renting GPUs, for one `Layout`
(distkit.speed): the memory per GPU (allocated, and what the device must hold: the caching
allocator's reserve and the CUDA context, `reserved_bytes`), the step time and tokens/s, the
days, GPU-hours and money for a token budget, the interruptions to expect and the goodput left
after checkpoints and restarts (chapter 05's Young interval), and how much of it moves when
eta and the links move within their measured spread (`sensitivity`).

The efficiency comes from evidence: `load_runs` reads code/ch08_plan/public_runs.json (public
runs, each with its source), `fit_efficiency` fits distkit.speed.Efficiency on the rows marked
"fit", and `predict` gives any row's tokens/s from its settings alone, so the held-out rows test
the model on runs it never saw.

API (small on purpose; chapters 09 and 10 build on it):
- `plan(config, layout, gpu=, link=, eta=, tokens=, price=) -> dict` and `show(plan) -> str`;
- `reserved_bytes(allocated)`, `fits(allocated, gpu_gib)`: the memory budget rule;
- `goodput(gpus, step_s, params)`: interruptions, Young's interval, goodput;
- `load_runs()`, `run_setup(run, runs)`, `fit_efficiency(runs)`, `predict(run, runs, eff)`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from distkit.speed import (FABRIC, GPUS, GPUS_PER_NODE, LINKS, Efficiency, Fabric, Layout, days,
                           hardware_flops, peak_bytes, step_time)
from distkit.memory import GiB, flops_per_token, llama_parts, llama_training_bytes

RUNS = Path(__file__).resolve().parents[1] / "ch08_plan" / "public_runs.json"

# --- memory: from allocated to what the device must hold ----------------------------------------
# The caching allocator reserves more than tensors hold (cached blocks, fragmentation), and the
# CUDA context and NCCL's buffers sit outside torch's counts. The ratio is the largest
# max_memory_reserved / max_memory_allocated the course measured on a GPU (public_runs.json,
# rows with both), without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (which maps memory
# in growable segments; on the course's H200 step it changed the ratio by 0.001: 1.213 / 1.214).
# CONTEXT_GIB is an assumption (CUDA context ~0.5 GiB, NCCL's buffers ~1 GiB per communicator
# group at its defaults), to be replaced by what gpu_step.py prints for your GPU.
CONTEXT_GIB = 2.0


def load_runs(path: Path = RUNS) -> dict:
    """The public runs table: {"models": {name: {"config", "source"}}, "runs": [...]}."""
    return json.loads(Path(path).read_text())


def measured_reserved_ratio(runs: dict | None = None) -> float:
    """The largest reserved / allocated ratio among runs that published both."""
    runs = runs or load_runs()
    return max(r["reserved_gib"] / r["memory_gib"] for r in runs["runs"] if "reserved_gib" in r)


RESERVED_RATIO = measured_reserved_ratio()


def reserved_bytes(allocated: float, ratio: float = RESERVED_RATIO,
                   context_gib: float = CONTEXT_GIB) -> float:
    """What a GPU must hold for a step that allocates `allocated` bytes at its peak: the
    allocator's reserve (allocated x ratio) and the CUDA context and NCCL (context_gib)."""
    return allocated * ratio + context_gib * GiB


def fits(allocated: float, gpu_gib: float, **kwargs) -> bool:
    """Whether the reserved-equivalent fits a GPU of gpu_gib GiB (as nvidia-smi reports it)."""
    return reserved_bytes(allocated, **kwargs) <= gpu_gib * GiB


def layout_peak_bytes(config, layout: Layout) -> float:
    """distkit.speed.peak_bytes for a layout (1F1B: the first stage holds min(pp, m) micro-batches
    of activations)."""
    return peak_bytes(config, gpus=layout.gpus, seq=layout.seq, batch=layout.batch, tp=layout.tp,
                      ac=layout.ac, attn=layout.attn, pp=layout.pp, replicate=layout.replicate,
                      sequence_parallel=layout.sequence_parallel,
                      cpu_offload=layout.cpu_offload, loss_chunks=layout.loss_chunks,
                      in_flight=min(layout.pp, layout.accumulation))


# --- failures, checkpoints, goodput (chapter 05, section 9) -------------------------------------
# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on up to 16,384 GPUs (The
# Llama 3 Herd of Models, 2024, section 3.3.4; chapter 05 quotes the same). As a rate per GPU,
# assuming failures scale with the GPU count (most were GPU or host faults).
FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
WRITE_BW = 20e9        # bytes/s, the file system's aggregate write bandwidth (chapter 05's)
RESTART_S = 10 * 60    # reschedule, load, warm up (chapter 05's assumption)
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two moments


def goodput(gpus: int, step_s: float, params: float, *, write_bw: float = WRITE_BW,
            restart_s: float = RESTART_S,
            failures_per_gpu_hour: float = FAILURES_PER_GPU_HOUR) -> dict:
    """Chapter 05's waste w(tau) = delta / tau + (tau / 2 + R) / M at Young's interval
    tau* = sqrt(2 delta M), with M the job's mean time between failures (1 / (gpus x rate)),
    delta a blocking save of 12 bytes per parameter at write_bw, R the restart; the interval
    rounded to whole steps (at least one). goodput = 1 - w."""
    mtbf = 1 / (gpus * failures_per_gpu_hour) * 3600
    delta = CHECKPOINT_BYTES_PER_PARAM * params / write_bw
    tau = max(step_s, round(math.sqrt(2 * delta * mtbf) / step_s) * step_s)
    waste = delta / tau + (tau / 2 + restart_s) / mtbf
    return {"mtbf h": mtbf / 3600, "save s": delta, "interval s": tau,
            "interval steps": round(tau / step_s), "waste": waste, "goodput": 1 - waste}


# --- a plan -------------------------------------------------------------------------------------

def plan(config, layout: Layout, *, gpu, link: float, eta, tokens: float, price: float,
         fabric: Fabric = FABRIC, optimizer: str = "foreach", eta_spread: float = 0.0,
         gpu_gib: float | None = None) -> dict:
    """Everything a budget holder asks of one layout: memory (allocated, reserved-equivalent,
    fits; with CPU offload the host RAM the states take), global batch and accumulation, tokens
    per step, step time, tokens/s per GPU and per job, days, GPU-hours and cost for `tokens` at
    `price` per GPU-hour, expected interruptions and goodput (the days and cost include the
    waste), and a sensitivity line: tokens/s with eta at +-eta_spread (relative) and with the
    links at 70 % and 90 % of line rate."""
    gpu_gib = gpu.memory_gib if gpu_gib is None else gpu_gib
    allocated = layout_peak_bytes(config, layout)
    t = step_time(config, layout, gpu=gpu, link=link, eta=eta, fabric=fabric,
                  optimizer=optimizer)
    params = sum(v * (config["num_hidden_layers"] if k == "layer" else 1)
                 for k, v in llama_parts(config).items())
    g = goodput(layout.gpus, t["step s"], params)
    ideal = days(tokens, t["tokens/s/GPU"], layout.gpus)
    wall = ideal / g["goodput"]

    def speed(**change):
        kw = dict(gpu=gpu, link=link, eta=eta, fabric=fabric, optimizer=optimizer) | change
        return step_time(config, layout, **kw)["tokens/s/GPU"]

    def scaled(factor):
        if isinstance(eta, Efficiency):
            return Efficiency(eta.matmul * factor, eta.passes / factor)
        return eta * factor
    sens = {"eta -": speed(eta=scaled(1 - eta_spread)), "eta +": speed(eta=scaled(1 + eta_spread)),
            "links 70 %": speed(fabric=Fabric(**{**fabric.__dict__, "bus_efficiency": 0.7})),
            "links 90 %": speed(fabric=Fabric(**{**fabric.__dict__, "bus_efficiency": 0.9}))}
    # CPU offload moves the states to the host: fp32 shards, gradients and AdamW's two moments,
    # 16 bytes per parameter this GPU owns, in pinned memory (the node's RAM must hold 8 GPUs')
    host = 16 * params / (layout.tp * layout.pp * layout.shard) if layout.cpu_offload else 0.0
    return {"layout": layout, "allocated": allocated, "reserved": reserved_bytes(allocated),
            "host": host,
            "gpu_gib": gpu_gib, "fits": fits(allocated, gpu_gib) if gpu_gib else None,
            "time": t, "tokens/s/job": t["tokens/s/GPU"] * layout.gpus, "days ideal": ideal,
            "days": wall, "gpu hours": wall * 24 * layout.gpus,
            "cost": wall * 24 * layout.gpus * price, "price": price, "tokens": tokens,
            "failures": wall * 24 * layout.gpus * FAILURES_PER_GPU_HOUR, "goodput": g,
            "sensitivity": sens, "eta_spread": eta_spread}


def show(p: dict, name: str = "") -> str:
    """A plan as the lines a notebook prints (rounded far above the model's error)."""
    lay, t = p["layout"], p["time"]
    g, s = p["goodput"], p["sensitivity"]
    lines = [
        f"{name}{lay.gpus} GPUs: {lay.describe()}",
        f"  memory: {p['allocated'] / GiB:.1f} GiB allocated, {p['reserved'] / GiB:.1f} GiB "
        f"reserved-equivalent of {p['gpu_gib']:.1f}: fits {p['fits']}"
        + (f"; host RAM (CPU offload) {p['host'] / GiB:,.0f} GiB per GPU, "
           f"{GPUS_PER_NODE * p['host'] / GiB:,.0f} per node, pinned" if p.get("host") else ""),
        f"  global batch {lay.dp * lay.batch * lay.accumulation} sequences = "
        f"{t['tokens/step'] / 2**20:.2f} M tokens/step ({lay.dp} data-parallel ranks x "
        f"{lay.batch} x {lay.accumulation} accumulation)",
        f"  step {t['step s']:.2f} s (compute {t['compute s']:.2f}, FSDP exposed "
        f"{t['fsdp exposed s']:.2f}, TP {t['tp comm s']:.2f}, bubble {t['pp bubble s']:.2f}, "
        f"optimizer + copies {t['optimizer s'] + t['copies s']:.2f}), eta {t['eta']:.2f}",
        f"  {t['tokens/s/GPU']:,.0f} tokens/s/GPU, {p['tokens/s/job']:,.0f} tokens/s for the job, "
        f"MFU {100 * t['mfu']:.0f} %",
        f"  {p['tokens'] / 1e9:,.0f} B tokens: {p['days']:.1f} days ({p['days ideal']:.1f} "
        f"without failures), {p['gpu hours']:,.0f} GPU-hours, ${p['cost']:,.0f} at "
        f"${p['price']:.2f}/GPU-hour",
        f"  failures: {p['failures']:.1f} interruptions expected (the job's mean time between "
        f"them {g['mtbf h']:,.0f} h); save every {g['interval s'] / 60:.0f} min "
        f"({g['save s']:.0f} s each), goodput {100 * g['goodput']:.1f} %",
        f"  sensitivity: eta +-{100 * p['eta_spread']:.0f} %: {s['eta -']:,.0f} to "
        f"{s['eta +']:,.0f} tokens/s/GPU; links at 70 / 90 % of line rate: "
        f"{s['links 70 %']:,.0f} / {s['links 90 %']:,.0f}"]
    return "\n".join(lines)


# --- the efficiency, from public runs ----------------------------------------------------------

def run_setup(run: dict, runs: dict) -> tuple:
    """(config, Layout, extra_flops, rerun) of a throughput or tflops row. torchtitan's
    checkpointing modes, which the course's `ac` values do not name:
    - "tt-op" (selective_ac_option "op", parallelize_llama.py at 9dec370 and 1d5815c4b: in each
      layer every matmul's output saved *but every second one*: of q, k, v, o, gate, up, down it
      reruns k, o, up): the course's "selective" plus those three matmuls' FLOPs again;
    - "tt-layer" (an integer option: every second layer fully checkpointed): no checkpointing
      plus half of full checkpointing's rerun.
    A "tflops" row's accumulation follows from its tokens per batch."""
    config = runs["models"][run["model"]]["config"]
    c, T = config, run["seq"] * run["batch"]
    ac, extra, rerun = run["ac"], 0.0, None
    if ac == "tt-op":
        h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
        ac, extra = "selective", 2 * (h * kv + h * h + h * i) * T * L
    elif ac == "tt-layer":
        ac, rerun = "none", 0.5
        extra = hardware_flops(config, run["seq"], run["batch"], ac="full")["recompute"] / 2
    gpus, tp, pp = run["gpus"], run["tp"], run["pp"]
    accumulation = run.get("accumulation", 1)
    if "accumulation_tokens" in run:
        accumulation = run["accumulation_tokens"] // (gpus // (tp * pp) * T)
    layout = Layout(gpus=gpus, seq=run["seq"], batch=run["batch"], accumulation=accumulation,
                    tp=tp, pp=pp, replicate=run.get("replicate", 1), ac=ac,
                    sequence_parallel=run.get("sequence_parallel", False))
    return config, layout, extra, rerun


def published_speed(run: dict, runs: dict) -> float:
    """A row's published throughput in tokens/s per GPU (tflops rows: model TFLOP/s over
    flops_per_token, the PaLM convention Meta's MFU uses)."""
    if run["kind"] == "tflops":
        config = runs["models"][run["model"]]["config"]
        return run["model_tflops_per_gpu"] * 1e12 / flops_per_token(config, run["seq"])
    return run["tokens_per_s_per_gpu"]


def efficiency(eff: dict, gpu, compiled: bool) -> Efficiency:
    """The fitted Efficiency for a GPU (by its generation) and a compiled or eager step."""
    return Efficiency(eff["matmul"][gpu.arch],
                      eff["passes compiled"] if compiled else eff["passes eager"])


def predict(run: dict, runs: dict, eff: dict, fabric: Fabric = FABRIC) -> dict:
    """step_time for a row from its settings alone, with the fitted efficiency `eff`
    (`fit_efficiency`; compile unknown: eager's passes)."""
    config, layout, extra, rerun = run_setup(run, runs)
    gpu = GPUS[run["gpu"]]
    return step_time(config, layout, gpu=gpu, link=LINKS[run["link"]],
                     eta=efficiency(eff, gpu, bool(run.get("compile"))), fabric=fabric,
                     extra_flops=extra, rerun=rerun)


ARCHS = ("hopper", "ampere")


def fit_efficiency(runs: dict, use: str = "fit") -> dict:
    """Four numbers fitted on the rows marked `use`: each GPU generation's matmul fraction of
    its peak (ARCHS), and the passes over the activations of an eager and of a compiled step
    (the same on every GPU: the memory-bound work is the model's and the compiler's, not the
    chip's). They minimise the squared log error of tokens/s: a pattern search (halving steps
    from a fixed start in a fixed order, so the same answer on every machine). Returns them and
    the fitted rows' rms log error."""
    rows = [r for r in runs["runs"] if r["use"] == use]

    def unpack(x):
        return {"matmul": dict(zip(ARCHS, x[:2])), "passes eager": x[2],
                "passes compiled": x[3]}

    def loss(x):
        return sum(math.log(predict(r, runs, unpack(x))["tokens/s/GPU"]
                            / published_speed(r, runs)) ** 2 for r in rows)
    x, step = [0.6, 0.6, 10.0, 5.0], [0.1, 0.1, 4.0, 4.0]
    best = loss(x)
    while max(step[0], step[1]) > 1e-5:
        improved = False
        for i in range(len(x)):
            for sign in (1, -1):
                y = list(x)
                y[i] = min(1.0 if i < 2 else math.inf, max(1e-3, y[i] + sign * step[i]))
                value = loss(y)
                if value < best - 1e-15:
                    x, best, improved = y, value, True
        if not improved:
            step = [s / 2 for s in step]
    eff = unpack(x)
    eff["rows"] = [r["id"] for r in rows]
    eff["rms log error"] = math.sqrt(best / len(rows))
    return eff


def run_memory(run: dict, runs: dict) -> float:
    """Allocated peak for a row, as distkit.speed.peak_bytes (torchtitan's "op" mode keeps k, o
    and up's outputs less than the course's selective: 2 (kv + h + i) bytes per token and layer;
    split by tp as the layer is)."""
    config, layout, _, _ = run_setup(run, runs)
    m = llama_training_bytes(config, ranks=layout.shard, seq=layout.seq, batch=layout.batch,
                             precision="bf16", ac=layout.ac, tensor_parallel=layout.tp,
                             sequence_parallel=layout.sequence_parallel)
    backward = m["Total"]
    if run["ac"] == "tt-op":
        c = config
        kv = c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
        backward -= 2 * (kv + c["hidden_size"] + c["intermediate_size"]) \
            * layout.seq * layout.batch * c["num_hidden_layers"] // layout.tp
    return max(backward, 3 * m["Sharded Param"] + m["OptState"])


__all__ = ["ARCHS", "CONTEXT_GIB", "FAILURES_PER_GPU_HOUR", "RESERVED_RATIO", "RUNS",
           "efficiency", "fit_efficiency", "fits", "goodput", "layout_peak_bytes", "load_runs",
           "measured_reserved_ratio", "plan", "predict", "published_speed", "reserved_bytes",
           "run_memory", "run_setup", "show"]
