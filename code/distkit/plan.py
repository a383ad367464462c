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

import functools
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
    """distkit.speed.peak_bytes for a layout: with accumulation and without
    sync_every_microbatch, every fp32 gradient unsharded (train_llama.py's default); with
    pp > 1, the schedule played rank by rank (`pipeline_peak_bytes`)."""
    if layout.pp > 1:
        return pipeline_peak_bytes(config, layout)["peak"]
    return peak_bytes(config, gpus=layout.gpus, seq=layout.seq, batch=layout.batch, tp=layout.tp,
                      ac=layout.ac, attn=layout.attn, pp=layout.pp, replicate=layout.replicate,
                      sequence_parallel=layout.sequence_parallel,
                      cpu_offload=layout.cpu_offload, loss_chunks=layout.loss_chunks,
                      unsharded_grads=layout.accumulation > 1
                      and not layout.sync_every_microbatch,
                      accumulated=layout.accumulation > 1 and layout.sync_every_microbatch)


def pipeline_peak_bytes(config, layout: Layout) -> dict:
    """Allocated peak per GPU under pipeline parallelism, the largest over the pipeline's ranks
    (what torchtitan's benchmarks publish: "we take the maximum across all GPUs"), by playing
    each rank's action list: one (stage chunk, micro-batch) of activations lives from its
    forward to its backward (B, or W in the zero-bubble schedules); FSDP2's unsharded fp32
    gradient buffers of a chunk appear at that chunk's first backward and stay to the step's end
    (set_requires_gradient_sync(False) until pipelining's REDUCE_GRAD; review expert_ch10 F7).
    1F1B's lists are its runtime loop (distkit.schedules.one_f_one_b), the others torch's own
    (distkit.schedules.actions). The rest of the peak (the states, the gathered stage, the
    loss's tensors on the last stage, the temporaries) is llama_training_bytes' for one
    micro-batch in flight, less its one micro-batch of activations and its whole stage of
    gradients, which the play replaces. Returns {"peak", "rank", "in flight"}."""
    from distkit.memory import llama_layer_saved
    from distkit.schedules import one_f_one_b
    lay, p, v, m = layout, layout.pp, layout.virtual, layout.accumulation
    one = peak_bytes(config, gpus=lay.gpus, seq=lay.seq, batch=lay.batch, tp=lay.tp, ac=lay.ac,
                     attn=lay.attn, pp=p, replicate=lay.replicate,
                     sequence_parallel=lay.sequence_parallel, cpu_offload=lay.cpu_offload,
                     loss_chunks=lay.loss_chunks, in_flight=1)
    layers = config["num_hidden_layers"] // p / v  # per chunk (llama_training_bytes' L // pp)
    unit = layers * sum(llama_layer_saved(config, lay.seq, lay.batch, precision="bf16",
                                          attn=lay.attn, ac=lay.ac, tensor_parallel=lay.tp,
                                          sequence_parallel=lay.sequence_parallel).values())
    grad = layers * llama_parts(config)["layer"] / lay.tp * 4
    lists = one_f_one_b(p, m) if lay.schedule == "1F1B" else _lists(lay.schedule, p, m, v)
    best = (0.0, 0, 0)
    for rank, mine in enumerate(lists):
        deferred = any(k == "W" for _, k, _ in mine)
        live, seen, peak, most = 0, set(), 0.0, 0
        for stage, kind, _ in mine:
            if kind == "F":
                live += 1
            elif kind in "BI":
                seen.add(stage)
            peak = max(peak, live * unit + len(seen) * grad)
            most = max(most, live)
            if kind == "W" or (kind == "B" and not deferred):
                live -= 1
        if peak > best[0]:
            best = (peak, rank, most)
    return {"peak": one - v * unit - v * grad + best[0], "rank": best[1],
            "in flight": best[2] / v}


@functools.lru_cache(maxsize=32)
def _lists(schedule: str, pp: int, m: int, v: int) -> list:
    from distkit.schedules import actions
    return actions(schedule, pp, m, v)


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
         gpu_gib: float | None = None, write_bw: float = WRITE_BW,
         restart_s: float = RESTART_S, cpu_floor_s: float = 0.0) -> dict:
    """Everything a budget holder asks of one layout: memory (allocated, reserved-equivalent,
    fits; with CPU offload the host RAM the states take), global batch and accumulation, tokens
    per step, step time, tokens/s per GPU and per job, days, GPU-hours and cost for `tokens` at
    `price` per GPU-hour, expected interruptions and goodput (the days and cost include the
    waste), and a sensitivity line: tokens/s with eta at +-eta_spread (relative) and with the
    links at 70 % and 90 % of line rate. `write_bw` (bytes/s) and `restart_s` set the goodput's
    checkpoint and restart costs. `cpu_floor_s`: seconds of CPU work per decoder layer and
    micro-batch that bound the step from below when the GPU is faster (train_llama.py's
    selective checkpointing: `SELECTIVE_CPU_S`)."""
    gpu_gib = gpu.memory_gib if gpu_gib is None else gpu_gib
    allocated = layout_peak_bytes(config, layout)
    t = cpu_bound(step_time(config, layout, gpu=gpu, link=link, eta=eta, fabric=fabric,
                            optimizer=optimizer), config, layout, cpu_floor_s)
    params = sum(v * (config["num_hidden_layers"] if k == "layer" else 1)
                 for k, v in llama_parts(config).items())
    g = goodput(layout.gpus, t["step s"], params, write_bw=write_bw, restart_s=restart_s)
    ideal = days(tokens, t["tokens/s/GPU"], layout.gpus)
    wall = ideal / g["goodput"]

    def speed(**change):
        kw = dict(gpu=gpu, link=link, eta=eta, fabric=fabric, optimizer=optimizer) | change
        return cpu_bound(step_time(config, layout, **kw), config, layout,
                         cpu_floor_s)["tokens/s/GPU"]

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
            "sensitivity": sens, "eta_spread": eta_spread, "write_bw": write_bw,
            "restart_s": restart_s}


def cpu_bound(t: dict, config, layout: Layout, floor_s: float) -> dict:
    """A step_time result with each micro-step at least `floor_s` x this GPU's decoder layers
    (the CPU's time to dispatch them: when the GPU is faster, it waits for the CPU)."""
    if not floor_s:
        return t
    layers = math.ceil(config["num_hidden_layers"] / layout.pp)
    extra = layout.accumulation * max(0.0, floor_s * layers - t["micro-step s"])
    if not extra:
        return t
    step = t["step s"] + extra
    return {**t, "step s": step, "cpu wait s": extra,
            "tokens/s/GPU": t["tokens/s/GPU"] * t["step s"] / step,
            "mfu": t["mfu"] * t["step s"] / step}


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
        f"({g['save s']:.0f} s each at {p.get('write_bw', WRITE_BW) / 1e9:g} GB/s, restart "
        f"{p.get('restart_s', RESTART_S):g} s), goodput {100 * g['goodput']:.1f} %",
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


# --- the planning command (code/ch08_plan/plan.py): presets, GPUs, the capstone's rules ----------
GPU_NAMES = {"h100-sxm": "H100 SXM", "h200-sxm": "H200 SXM", "a100-80gb": "A100 80GB SXM"}
# board power (W) of the GPUs the CLI knows, and of the parts each generation's efficiency was
# fitted on (torchtitan's 500 W HBM2e H100s; A100 SXM at 400 W)
POWER_W = {"H100 SXM": 700, "H200 SXM": 700, "A100 80GB SXM": 400, "H100 500W HBM2e": 500}
FITTED_POWER_W = {"hopper": 500, "ampere": 400}
CAPSTONE_PRESETS = {"1b": "llama-1b", "8b": "llama-8b"}  # train_llama.py's --preset names
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")


def presets(runs: dict | None = None) -> dict:
    """The model names --model takes: distkit.memory.LLAMA_CONFIGS and Llama 3.1 405B."""
    runs = runs or load_runs()
    from distkit.memory import LLAMA_CONFIGS
    return {**LLAMA_CONFIGS, "405b": runs["models"]["llama3.1-405b"]["config"]}


def load_config(model: str) -> dict:
    """A preset's config, or a Hugging Face config.json of a dense Llama-family decoder (the
    fields the memory and time models read). Raises ValueError with one line otherwise."""
    known = presets()
    if model in known:
        return dict(known[model])
    path = Path(model)
    if not path.is_file():
        raise ValueError(f"--model {model}: neither a preset ({', '.join(known)}) nor a "
                         f"config.json file")
    try:
        c = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model {model}: not JSON ({e.__class__.__name__})") from None
    if not isinstance(c, dict):
        raise ValueError(f"--model {model}: not a config.json (no object at the top)")
    arch = c.get("architectures") or []
    if c.get("is_encoder_decoder") or (arch and not any(a.endswith("ForCausalLM")
                                                        for a in arch)):
        raise ValueError(f"--model {model}: {', '.join(arch) or 'an encoder-decoder'} is not a "
                         f"decoder language model (architectures must end in ForCausalLM)")
    missing = [k for k in REQUIRED if not isinstance(c.get(k), int)]
    if missing:
        raise ValueError(f"--model {model}: not a Llama-family decoder config (no "
                         f"{', '.join(missing)})")
    if any(c.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise ValueError(f"--model {model}: a mixture of experts; the planner models dense "
                         f"decoders (chapter 09 plans experts)")
    out = {k: c[k] for k in REQUIRED}
    out["num_key_value_heads"] = c.get("num_key_value_heads") or c["num_attention_heads"]
    out["tie_word_embeddings"] = bool(c.get("tie_word_embeddings", False))
    if c.get("head_dim") and c["head_dim"] * c["num_attention_heads"] != c["hidden_size"]:
        raise ValueError(f"--model {model}: head_dim {c['head_dim']} x heads != hidden size; "
                         f"the memory model assumes hidden = heads x head_dim")
    if out["hidden_size"] % out["num_attention_heads"] or \
            out["num_attention_heads"] % out["num_key_value_heads"]:
        raise ValueError(f"--model {model}: hidden size, heads and key/value heads do not divide")
    return out


def capstone_refuses(layout: Layout, compiled: bool) -> str | None:
    """Why train_llama.py cannot run this layout, or None: it has FSDP2 and HSDP (--replicate),
    --ac none|selective|full, --compile only without --ac, --cpu-offload; no tensor or pipeline
    parallelism, no chunked loss."""
    if layout.tp > 1 or layout.pp > 1:
        return "train_llama.py has no tensor or pipeline parallelism (torchtitan has)"
    if layout.loss_chunks > 1:
        return "train_llama.py has no chunked loss"
    if compiled and layout.ac != "none":
        return "train_llama.py refuses --compile with --ac selective/full"
    return None


def _gpu_step_runs() -> list:
    path = RUNS.parent / "results" / "gpu_step_h200.json"
    return json.loads(path.read_text())["runs"]


def selective_cpu_seconds() -> tuple:
    """train_llama.py's selective checkpointing runs through a Python dispatch mode
    (torch.utils.checkpoint's selective policy): on the H200 (gpu_step.py, Llama 3.2 1B, 2 x
    2048 tokens) its forward + backward took 189-244 ms where the GPU work is modelled at 105:
    the GPU waits for the CPU. As seconds per decoder layer and micro-batch (the CPU's cost
    grows with the operators, not the tokens): (lowest, median, highest) of the runs."""
    one = presets()["1b"]["num_hidden_layers"]
    xs = sorted(r["fwd_bwd_s"] / one for r in _gpu_step_runs() if r["ac"] == "selective")
    return xs[0], xs[len(xs) // 2], xs[-1]


@functools.lru_cache(maxsize=1)
def fitted() -> tuple:
    """(runs, efficiency fit, spread): the fit on public_runs.json's "fit" rows and the band
    the plans carry: the largest held-out |miss| of the throughput rows but the course's
    Python-dispatched selective checkpointing (modelled by its CPU floor instead) and another
    stack's tflops rows (Meta's) - notebook 08 section 5 prints both."""
    runs = load_runs()
    eff = fit_efficiency(runs)
    spread = max(abs(predict(r, runs, eff)["tokens/s/GPU"] / published_speed(r, runs) - 1)
                 for r in runs["runs"] if r["use"] == "held-out" and r["kind"] == "throughput"
                 and r["ac"] != "selective")
    return runs, eff, spread


def power_efficiency(eff: dict, gpu, compiled: bool, power_w: float | None) -> tuple:
    """The fitted Efficiency for `gpu`, and a note when its power differs from the parts the fit
    saw: below it, the matmuls are scaled by power / fitted power (the worst case, clock and
    power proportional: an assumption); above it, nothing is added (the course's 700 W H200
    ran full checkpointing 13 % faster than this fit predicts: the band's upper side)."""
    e = efficiency(eff, gpu, compiled)
    fit_w = FITTED_POWER_W.get(gpu.arch)
    w = power_w or POWER_W.get(gpu.name)
    if not fit_w or not w or w == fit_w:
        return e, ""
    if w < fit_w:
        return (Efficiency(e.matmul * w / fit_w, e.passes),
                f"power {w:g} W < the fitted parts' {fit_w} W: matmuls scaled by "
                f"{w / fit_w:.2f} (an assumption: clock proportional to power)")
    return e, (f"power {w:g} W > the fitted parts' {fit_w} W: the plan may be pessimistic "
               f"(the course's 700 W H200 ran full checkpointing 13 % faster than predicted)")


def search(config, *, gpus: int, seq: int, gpu, link: float, eff: dict, global_tokens: int,
           capstone: bool = True, tps: tuple = (1,), power_w: float | None = None,
           acs: tuple = ("none", "selective", "full")) -> list:
    """Every layout of `gpus` GPUs that fits (the one rule, `fits`) with one micro-batch size,
    checkpointing, FSDP or HSDP (one replica per node), eager or compiled, accumulating to
    `global_tokens` tokens per step, and the gradient sync that fits: without
    --sync-every-microbatch if that fits (train_llama.py's default: fewer reduce-scatters),
    else with it. capstone=True keeps only what train_llama.py runs (`capstone_refuses`);
    `tps`: tensor-parallel degrees (with sequence parallelism). Sorted fastest first: a list of
    {"layout", "compiled", "eta", "cpu floor s", "other sync"} ("other sync": the allocated
    peak with the other choice of gradient sync, None without accumulation)."""
    out = []
    floor = selective_cpu_seconds()[1] if capstone else 0.0
    for tp in tps:
        dp = gpus // tp
        if gpus % tp or dp < 1:
            continue
        reps = sorted({1, gpus // GPUS_PER_NODE} - {0}) if tp == 1 else [1]
        for replicate in reps:
            if dp % replicate:
                continue
            for b in (1, 2, 4, 8, 16):
                if global_tokens % (dp * seq * b):
                    continue
                accumulation = global_tokens // (dp * seq * b)
                for ac in acs:
                    for compiled in (False, True):
                        kw = dict(gpus=gpus, seq=seq, batch=b, tp=tp, replicate=replicate,
                                  ac=ac, accumulation=accumulation, sequence_parallel=tp > 1)
                        both = [Layout(**kw, sync_every_microbatch=sync)
                                for sync in ((False, True) if accumulation > 1 else (True,))]
                        if capstone and capstone_refuses(both[0], compiled):
                            continue
                        peaks = [layout_peak_bytes(config, lay) for lay in both]
                        ok = [lay for lay, peak in zip(both, peaks) if fits(peak, gpu.memory_gib)]
                        if not ok:
                            continue
                        lay = ok[0]
                        e, _ = power_efficiency(eff, gpu, compiled, power_w)
                        other = peaks[1] if lay is both[0] and len(both) > 1 else \
                            peaks[0] if len(both) > 1 else None
                        out.append({"layout": lay, "compiled": compiled, "eta": e,
                                    "cpu floor s": floor if ac == "selective" else 0.0,
                                    "other sync": other})
    def speed(x):
        t = step_time(config, x["layout"], gpu=gpu, link=link, eta=x["eta"])
        return cpu_bound(t, config, x["layout"], x["cpu floor s"])["tokens/s/GPU"]
    return sorted(out, key=speed, reverse=True)


def capstone_command(model: str, layout: Layout, compiled: bool, tokens: float,
                     config: dict) -> str:
    """The sbatch line that runs this plan with train_llama.py (options after the script's name
    override the template's: --replicate, --ac, the batch; --max-steps from the tokens)."""
    nodes = max(1, layout.gpus // GPUS_PER_NODE)
    if model in CAPSTONE_PRESETS:
        what = f"--preset {CAPSTONE_PRESETS[model]} --vocab-size {config['vocab_size']}"
    elif model.endswith(".json"):
        what = f"--model-path {Path(model).parent or '.'}"
    else:
        what = f"--model-path YOUR/{model.upper()}/FOLDER"
    steps = math.ceil(tokens / layout.tokens_per_step)
    opts = [what, f"--seq-len {layout.seq}",
            f"--batch-size {layout.dp * layout.batch * layout.accumulation}",
            f"--micro-batch {layout.batch}", f"--replicate {layout.replicate}",
            f"--ac {layout.ac}", f"--max-steps {steps}"]
    if layout.accumulation > 1 and layout.sync_every_microbatch:
        opts.append("--sync-every-microbatch")
    if compiled:
        opts.append("--compile")
    if layout.cpu_offload:
        opts.append("--cpu-offload")
    return (f"sbatch --nodes {nodes} --gpus-per-node {min(layout.gpus, GPUS_PER_NODE)} "
            f"code/ch06_capstone/train_llama.sbatch " + " ".join(opts))


# --- all-in: what whole runs cost beyond the steady state ----------------------------------------

def all_in(runs: dict | None = None, eff: dict | None = None) -> dict:
    """The all-in factor: a model card's published GPU-hours over the plan's steady-state
    GPU-hours (failures and checkpoints included, as `plan` counts them) for the same tokens,
    on the layout each card row names ("plan": GPUs, tp, pp, schedule, ...; the cards publish no
    layout but Meta's 405B: the others are assumptions stated in the row). Fitted (geometric
    mean, lowest and highest) on the rows marked "all-in fit"; judged on the "all-in held-out"
    rows: their predicted all-in GPU-hours (central and range) against the card's."""
    runs = runs or load_runs()
    eff = eff or fit_efficiency(runs)
    rows = []
    for r in runs["runs"]:
        if r["kind"] != "gpu_hours":
            continue
        config = runs["models"][r["model"]]["config"]
        lay = Layout(**r["plan"])
        gpu = GPUS[r["gpu"]]
        p = plan(config, lay, gpu=gpu, link=LINKS["IB NDR / RoCE 400G"],
                 eta=efficiency(eff, gpu, False), tokens=r["tokens"], price=1.0)
        rows.append({"id": r["id"], "use": r["use"], "steady gpu hours": p["gpu hours"],
                     "published": r["gpu_hours"], "factor": r["gpu_hours"] / p["gpu hours"],
                     "fits": p["fits"]})
    fit = [x["factor"] for x in rows if x["use"] == "all-in fit"]
    central = math.exp(sum(math.log(f) for f in fit) / len(fit))
    for x in rows:
        x["predicted"] = x["steady gpu hours"] * central
        x["miss"] = x["predicted"] / x["published"] - 1
        x["inside"] = min(fit) <= x["factor"] <= max(fit)
    return {"central": central, "low": min(fit), "high": max(fit), "rows": rows}


ALL_IN_CONTAINS = ("what whole published runs spent beyond their steady state: failures and "
                   "restarts beyond the plan's, evaluation, ramp-up of batch and sequence, "
                   "long-context and annealing phases, stragglers, idle reservations")


__all__ = ["ALL_IN_CONTAINS", "ARCHS", "CAPSTONE_PRESETS", "CONTEXT_GIB",
           "FAILURES_PER_GPU_HOUR", "FITTED_POWER_W", "GPU_NAMES", "POWER_W", "RESERVED_RATIO",
           "RESTART_S", "RUNS", "WRITE_BW", "all_in", "capstone_command", "capstone_refuses",
           "cpu_bound", "efficiency", "fit_efficiency", "fits", "fitted", "goodput",
           "layout_peak_bytes", "load_config", "load_runs", "measured_reserved_ratio",
           "pipeline_peak_bytes", "plan", "power_efficiency", "predict", "presets",
           "published_speed", "reserved_bytes", "run_memory", "run_setup", "search",
           "selective_cpu_seconds", "show"]
