"""Pictures shared by the notebooks (matplotlib only)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

RANK_COLORS = plt.get_cmap("tab10").colors
REDUCTIONS = {"all_reduce", "reduce_scatter"}


def _cells(ax, values, x0, y, owner_of):
    for i, v in enumerate(values):
        owner = owner_of(v)
        face = "0.85" if owner is None else RANK_COLORS[owner % 10]
        ax.add_patch(Rectangle((x0 + i, y), 0.95, 0.8, facecolor=face, alpha=0.75,
                               edgecolor="black", linewidth=0.5))
        ax.text(x0 + i + 0.47, y + 0.4, str(v), ha="center", va="center", fontsize=8)


def plot_collectives(results: dict, ops: list[str] | None = None, cols: int = 3):
    """Before/after values of every rank for each collective (output of collectives.py --json).

    Cell colour = the rank the value came from (x = 10*rank + position); grey = a sum.
    """
    n = results["world_size"]
    ops = ops or list(results["ops"])
    rows = -(-len(ops) // cols)
    width = max(len(a) for op in ops for a in results["ops"][op]["after"])
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, (0.55 * n + 0.9) * rows),
                             squeeze=False)
    for ax, op in zip(axes.flat, ops):
        res = results["ops"][op]
        for r in range(n):
            y = n - 1 - r
            # reduce: the root holds the sum; the others hold their input or a partial sum
            summed = op in REDUCTIONS or (op == "reduce" and res["after"][r] != res["before"][r])
            _cells(ax, res["before"][r], 0, y, lambda v: v // 10)
            _cells(ax, res["after"][r], n + 1.2, y,
                   (lambda v: None) if summed else (lambda v: v // 10))
            ax.text(-0.2, y + 0.4, f"rank {r}", ha="right", va="center", fontsize=8)
            ax.annotate("", (n + 1.1, y + 0.4), (n + 0.1, y + 0.4),
                        arrowprops=dict(arrowstyle="->", color="0.4"))
        ax.set_xlim(-1.6, n + 1.3 + width)
        ax.set_ylim(-0.2, n)
        ax.set_title(op, fontsize=10)
        ax.axis("off")
    for ax in axes.flat[len(ops):]:
        ax.axis("off")
    fig.suptitle(f"{n} ranks, before -> after (colour: rank the value came from; grey: a sum)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def plot_ring_schedule(schedule: list[list[int]]):
    """Which chunk each rank sends at each step of a ring all-reduce (ring_allreduce.py --json)."""
    n = len(schedule)
    steps = len(schedule[0])
    fig, ax = plt.subplots(figsize=(1.0 * steps + 1.5, 0.5 * n + 1.2))
    for r, chunks in enumerate(schedule):
        for s, c in enumerate(chunks):
            ax.add_patch(Rectangle((s, n - 1 - r), 0.95, 0.85, facecolor=RANK_COLORS[c % 10],
                                   alpha=0.7, edgecolor="black", linewidth=0.5))
            ax.text(s + 0.47, n - 1 - r + 0.42, f"chunk {c}", ha="center", va="center",
                    fontsize=8)
    ax.axvline(steps / 2 - 0.025, color="black", linestyle="--", linewidth=1)
    ax.text(steps / 4, n + 0.1, "reduce-scatter: add what arrives", ha="center", fontsize=9)
    ax.text(3 * steps / 4, n + 0.1, "all-gather: copy what arrives", ha="center", fontsize=9)
    ax.set_xlim(0, steps)
    ax.set_ylim(0, n + 0.5)
    ax.set_xticks([s + 0.47 for s in range(steps)], [str(s + 1) for s in range(steps)])
    ax.set_yticks([n - 1 - r + 0.42 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xlabel("step (each rank sends one chunk of S/N bytes to its right neighbour)")
    ax.set_title(f"Ring all-reduce on {n} ranks: {steps} steps of S/N bytes = 2(N-1)/N * S")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


SPAN_STYLE = {"F": ("forward", "#4C9BE8"), "B": ("backward", "#F28E2B"),
              "L": ("loss", "#59A14F"), "step": ("optimizer step", "0.55")}


def plot_timeline(spans_per_rank, ax=None, title="", t_from=0.0, t_to=None, labels=True,
                  clock="CPU/gloo"):
    """A Gantt chart of what each rank computed when, from a run's spans (kind, micro-batch,
    start s, end s): one row per rank, blank = idle. Forward/backward boxes show the
    micro-batch number when they are wide enough."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 0.6 * len(spans_per_rank) + 1.2))
    t_to = t_to if t_to is not None else max(s[3] for spans in spans_per_rank for s in spans)
    scale = 1e3  # ms
    for r, spans in enumerate(spans_per_rank):
        y = len(spans_per_rank) - 1 - r
        for kind, mb, start, end in spans:
            if end < t_from or start > t_to:
                continue
            _, color = SPAN_STYLE.get(kind, (kind, "0.3"))
            x0, width = (start - t_from) * scale, (end - start) * scale
            ax.add_patch(Rectangle((x0, y + 0.1), width, 0.8, facecolor=color,
                                   edgecolor="black", linewidth=0.4))
            if labels and kind in ("F", "B") and width > 0.025 * (t_to - t_from) * scale:
                ax.text(x0 + width / 2, y + 0.5, str(mb), ha="center", va="center", fontsize=8)
    ax.set_xlim(0, (t_to - t_from) * scale)
    ax.set_ylim(0, len(spans_per_rank))
    ax.set_yticks([len(spans_per_rank) - 1 - r + 0.5 for r in range(len(spans_per_rank))],
                  [f"rank {r}" for r in range(len(spans_per_rank))])
    ax.set_xlabel(f"time (ms, {clock})")
    kinds = {s[0] for spans in spans_per_rank for s in spans}
    ax.legend(handles=[Rectangle((0, 0), 1, 1, facecolor=SPAN_STYLE[k][1], edgecolor="black",
                                 linewidth=0.4, label=SPAN_STYLE[k][0])
                       for k in SPAN_STYLE if k in kinds] +
              [Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", linewidth=0.4,
                         label="idle")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


def plot_bubbles(runs, stages: int, ax=None, clock="CPU/gloo"):
    """Measured idle fraction against the number of micro-batches m, for each schedule (a line
    through the mean over stages, a dash per stage), and the formula (p-1)/(m+p-1)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    ms = sorted({r["m"] for r in runs})
    grid = [m / 10 for m in range(10, 10 * max(ms) + 1)]
    ax.plot(grid, [(stages - 1) / (m + stages - 1) for m in grid], color="black",
            label=r"theory $(p-1)/(m+p-1)$")
    for i, schedule in enumerate(dict.fromkeys(r["schedule"] for r in runs)):
        mine = sorted((r for r in runs if r["schedule"] == schedule), key=lambda r: r["m"])
        color = RANK_COLORS[i]
        ax.plot([r["m"] for r in mine], [r["idle_mean"] for r in mine], "o-", color=color,
                label=f"{schedule}: measured, mean of stages")
        for r in mine:
            ax.scatter([r["m"]] * len(r["idle"]), r["idle"], color=color, marker="_", s=120)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches per step, m")
    ax.set_ylabel("idle fraction of the step")
    ax.set_ylim(0, max(0.6, (stages - 1) / stages + 0.1))
    ax.set_title(f"Pipeline bubble on {stages} stages: measured ({clock}) vs theory "
                 "(dashes: each stage)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


# The three model states, the same colours wherever they are drawn (not rank colours)
STATE_COLORS = {"params": "#7e57c2", "grads": "#1a9bab", "optimizer": "#c2477f"}


def plot_zero_measured(res: dict, categories: list[str], ax=None):
    """Chapter 03: bytes per parameter on rank 0, by strategy (groups) and category (bars):
    the formula as an outline, the trackers' measurement filled (zero_memory.py --json)."""
    ax = ax or plt.subplots(figsize=(11, 4))[1]
    per_rank0 = res["ranks"][0]
    strategies = list(per_rank0)
    colors = ["#9575cd", "#7e57c2", STATE_COLORS["grads"], STATE_COLORS["optimizer"]]
    width = 0.8 / len(categories)
    for j, cat in enumerate(categories):
        x = [i + (j - (len(categories) - 1) / 2) * width for i in range(len(strategies))]
        got = [per_rank0[s]["measured"][cat] / res["num_params"] for s in strategies]
        want = [res["predicted"][s][cat] / res["num_params"] for s in strategies]
        ax.bar(x, got, width * 0.9, color=colors[j % len(colors)], alpha=0.85,
               hatch="//" if cat == "params in use" else None, label=f"{cat} (measured)")
        ax.bar(x, want, width * 0.9, fill=False, edgecolor="black", linewidth=1.2,
               label="formula" if j == 0 else None)
    ax.set_xticks(range(len(strategies)), strategies)
    ax.set_ylabel("bytes per parameter, rank 0")
    ax.set_title(f"Model states per rank, {res['world_size']} ranks: measured (filled) "
                 "vs formula (outline)")
    ax.legend(ncols=3, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return ax


def plot_activations(act: dict, ax=None):
    """Chapter 03: activation bytes at the end of the forward vs decoder layers, one line per
    setting (activations.py --json); the slope is one layer's share."""
    ax = ax or plt.subplots(figsize=(7, 4))[1]
    settings = {}
    for r in act["runs"]:
        key = f"{r['dtype']}, {r['attention']}" + (", checkpointing" if r["checkpoint"] else "")
        settings.setdefault(key, []).append((r["layers"], r["end_of_forward"]["Activation"]))
    for key, points in settings.items():
        xs, ys = zip(*points)
        ax.plot(xs, [y / 2**20 for y in ys], "o-" if "checkpointing" not in key else "s--",
                label=key)
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("activation memory (MiB)")
    ax.set_xticks(sorted({r["layers"] for r in act["runs"]}))
    ax.set_title(f"Activations kept for backward (s={act['seq']}, b={act['batch']}, "
                 f"h={act['hidden']})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_memory_vs_ranks(sweeps: dict, formula, gpu_gib: float, ax=None):
    """Chapter 03: per-rank GiB vs simulated ranks, one colour per model: model states after
    the step (solid; the formula as crosses) and the step's peak (dashed, one line style per
    sweep), with a horizontal line at a GPU's memory. `sweeps`: label -> simulate_fsdp results;
    `formula(num_params, ranks)` gives the model states in bytes."""
    ax = ax or plt.subplots(figsize=(10, 4.5))[1]
    styles = ["--", ":", "-."]
    first = next(iter(sweeps.values()))
    models = list(dict.fromkeys(r["model"] for r in first))
    for i, model in enumerate(models):
        color = plt.get_cmap("tab10").colors[i]
        rows = [r for r in first if r["model"] == model]
        ranks = [r["ranks"] for r in rows]
        states = [sum(r["after_step"][k] for k in ("Sharded Param", "Sharded Grad", "OptState"))
                  for r in rows]
        ax.plot(ranks, [s / 2**30 for s in states], "-o", color=color,
                label=f"{model}: model states")
        ax.plot(ranks, [formula(r["num_params"], r["ranks"]) / 2**30 for r in rows], "x",
                color="black", markersize=7, label="formula" if i == 0 else None)
        for style, (label, sweep) in zip(styles, sweeps.items()):
            rows = [r for r in sweep if r["model"] == model]
            ax.plot([r["ranks"] for r in rows], [r["peak"]["Total"] / 2**30 for r in rows],
                    style, color=color, label=f"{model}: peak, {label}")
    ax.axhline(gpu_gib, color="red", linewidth=1)
    ax.text(ranks[0], gpu_gib * 1.08, f"{gpu_gib:g} GiB", color="red", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ranks, [str(n) for n in ranks])
    ax.set_xlabel("simulated ranks (FSDP2, fully_shard per layer)")
    ax.set_ylabel("GiB on rank 0")
    ax.set_title("One fp32 AdamW step, simulated: model states and peak per rank")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_fsdp_step(ranges: list, ax=None, title: str = ""):
    """Chapter 04: one FSDP2 training step on rank 0, one row per unit, from the FSDP ranges
    that torch's profiler recorded (inside_fsdp2.py --json: results[config]["ranges"]): the
    all-gathers (with their copy-out), the unit's forward and backward compute between FSDP's
    hooks, and the gradients' reduce-scatter. Each all-gather shows as two bars: the collective
    (FSDP::all_gather) and, when the unit needs its parameters, the copy-out that unpacks the
    gathered buffer into them (FSDP::all_gather_copy_out, a copy, no communication), drawn in a
    lighter colour. Times are CPU/gloo: only the order is portable."""
    ax = ax or plt.subplots(figsize=(11, 3))[1]
    units = list(dict.fromkeys(u for name, u, _, _ in ranges
                               if not name.endswith("_pre_forward") and "prefetch" not in name
                               and name != "root_post_backward_callback"))
    row = {u: i for i, u in enumerate(units)}
    colors = {"all-gather": "#f2a900", "all-gather copy-out (no communication)": "#fbe3a0",
              "forward": "#4c72b0", "backward": "#55a868", "reduce-scatter": "#c44e52"}
    spans = []  # (unit, kind, start, end)
    opened = {}
    for name, unit, start, end in ranges:
        if name == "all_gather":
            spans.append((unit, "all-gather", start, end))
        elif name == "all_gather_copy_out":
            spans.append((unit, "all-gather copy-out (no communication)", start, end))
        elif name == "post_backward_reduce":
            spans.append((unit, "reduce-scatter", start, end))
        if name in ("pre_forward", "pre_backward"):  # compute runs from the hook's end ...
            opened[unit, name] = end
        elif name == "post_forward" and (unit, "pre_forward") in opened:
            spans.append((unit, "forward", opened.pop((unit, "pre_forward")), start))
        elif name == "post_backward_accumulate" and (unit, "pre_backward") in opened:
            spans.append((unit, "backward", opened.pop((unit, "pre_backward")), start))
    for unit, kind, start, end in spans:  # ... to the next hook's start
        enclosing = unit == "" and kind in ("forward", "backward")  # the root's wraps the layers'
        ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (row[unit] - 0.35, 0.7),
                       color=colors[kind], alpha=0.3 if enclosing else 1)
    for kind, color in colors.items():
        ax.bar(0, 0, color=color, label=kind)
    ax.set_yticks(range(len(units)), [u or "root" for u in units])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (CPU/gloo, rank 0)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="x", alpha=0.3)
    return ax


def plot_peaks(results: dict, configs: list[str], ax=None):
    """Chapter 04: rank 0's peak during the first step, by the trackers' categories (stacked),
    one bar per configuration (inside_fsdp2.py --json)."""
    ax = ax or plt.subplots(figsize=(11, 4))[1]
    merge = {"Parameter": "params (replica)", "Sharded Param": "params (shards)",
             "Unsharded Param": "params (gathered)", "Gradient": "grads",
             "Sharded Grad": "grads", "Unsharded Grad": "grads (unsharded, kept)",
             "Optstate": "AdamW state", "OptState": "AdamW state", "Activation": "activations",
             "Buffer": "buffers"}
    colors = {"params (replica)": "#5e35b1", "params (shards)": "#9575cd",
              "params (gathered)": "#d1c4e9", "grads": STATE_COLORS["grads"],
              "grads (unsharded, kept)": "#e377c2", "AdamW state": STATE_COLORS["optimizer"],
              "activations": "#55a868", "buffers": "#7f7f7f", "temporary buffers": "#f2a900"}
    rows = []
    for config in configs:
        cats = {}
        for k, v in results[config]["peak"].items():
            if k != "Total" and v:
                name = merge.get(k, "temporary buffers")  # Temp, All-Gather, Reduce-Scatter, ...
                cats[name] = cats.get(name, 0) + v
        rows.append(cats)
    bottom = [0.0] * len(configs)
    for cat, color in colors.items():
        vals = [r.get(cat, 0) / 2**20 for r in rows]
        if any(vals):
            ax.bar(configs, vals, bottom=bottom, label=cat, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB on rank 0 at the step's peak")
    ax.set_title("Peak memory of the first step, by category (torch's memory trackers)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.tick_params(axis="x", rotation=20)
    ax.grid(axis="y", alpha=0.3)
    return ax


def plot_ring_bytes(runs: dict, ax=None):
    """Chapter 00: bytes each rank of the hand-written ring sent, over S, for each N
    (`runs`: N -> ring_allreduce.py's JSON), against 2(N-1)/N."""
    import numpy as np
    ax = ax or plt.subplots(figsize=(6.5, 3.4))[1]
    ticks, labels = [], []
    for i, (n, ring) in enumerate(sorted(runs.items())):
        S, sent = ring["bytes"], np.array(ring["sent"])
        xs = len(ticks) + i + np.arange(n)  # one gap between the groups
        ax.bar(xs, sent / S, color=f"C{i}", label=f"measured, N={n}")
        ax.hlines(ring["approx_sent"] / S, xs[0] - 0.4, xs[-1] + 0.4, color="black",
                  linestyle="--", label="2(N-1)/N" if i == 0 else None)
        ticks += list(xs)
        labels += [f"N={n}\nrank {r}" if n <= 4 else f"r{r}" for r in range(n)]
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("bytes sent / S")
    ax.set_title(f"Ring all-reduce of S = {S / 1e6:.0f} MB: bytes each rank sent")
    ax.legend(fontsize=8, loc="lower right")
    ax.figure.tight_layout()
    return ax


def plot_allreduce_times(bench: dict, ax=None) -> dict:
    """Chapter 00: all_reduce time against message size (allreduce_bench.py's JSON): the median
    with the middle half of the calls, the fastest and the slowest call per size, and a fit
    T = a + b S to the fastest calls, whose latency a and bus bandwidth B = 2(N-1)/N / b the
    legend gives. Returns {"a": seconds, "B": bytes/s}."""
    import numpy as np
    ax = ax or plt.subplots(figsize=(6.5, 4))[1]
    n, S = bench["world_size"], np.array(bench["sizes"])
    T = np.array(bench["samples"])  # T[i, k]: call k at size i, seconds
    fastest, q1, median, q3, slowest = np.percentile(T, [0, 25, 50, 75, 100], axis=1)
    b, a = np.polyfit(S, fastest, 1, w=1 / fastest)  # relative weights: small sizes count too
    B = 2 * (n - 1) / n / b
    ax.errorbar(S, median * 1e3, yerr=[(median - q1) * 1e3, (q3 - median) * 1e3], fmt="o",
                capsize=3, label=f"median; bars: middle half of {T.shape[1]} calls")
    ax.loglog(S, fastest * 1e3, "v-", color="C1", label="fastest call")
    ax.loglog(S, slowest * 1e3, "^:", color="C3", alpha=0.6, label="slowest call")
    ax.loglog(S, (a + b * S) * 1e3, "--", color="gray",
              label=f"fit a + b·S to the fastest: a = {a * 1e6:.0f} µs, B = {B / 1e9:.2f} GB/s")
    ax.set_xlabel("message size S (bytes)")
    ax.set_ylabel("all_reduce time (ms)")
    where = "CPU/gloo: not NVLink or InfiniBand" if bench["backend"] == "gloo" else bench["backend"]
    ax.set_title(f"all_reduce on {n} processes ({where}; a recorded run)", fontsize=9)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return {"a": a, "B": B}


def _hidden(share: float) -> str:
    """How much of what overlap could hide it did hide, in words: above 90 % the measured share
    is noise around 'all' (each variant's median comes from its own rounds), below 0 it cost."""
    if share >= 0.9:
        return "hid about all it could"
    return f"hid {share:.0%} of what it could" if share > 0 else "hid nothing: it cost time"


def plot_overlap(res: dict, ax=None):
    """Chapter 00: the all-reduce and two kinds of other work, alone, one after the other and
    overlapped (async_collectives.py's JSON, medians of the slowest rank), with what overlap hid
    for each kind of work."""
    t = res["times"]
    ax = ax or plt.subplots(figsize=(6.5, 3.2))[1]
    color = lambda k: ("C7" if "then" in k else "C2" if "during" in k
                       else "C0" if k == "all_reduce" else "C1")
    ax.barh(list(t)[::-1], [v * 1e3 for v in t.values()][::-1], color=[color(k) for k in t][::-1])
    for work in ("matmuls", "sleep"):
        sequential, overlapped = t[f"all_reduce, then {work}"], t[f"{work} during all_reduce"]
        perfect = max(t["all_reduce"], t[work])  # the shorter one hidden entirely
        y = list(t)[::-1].index(f"{work} during all_reduce")
        text = (_hidden((sequential - overlapped) / (sequential - perfect))
                if sequential > perfect else "nothing to hide (noise)")
        ax.text(overlapped * 1e3, y, f"  {text}", va="center", fontsize=8)
    ax.set_xlim(0, 1.6 * max(t.values()) * 1e3)
    ax.set_xlabel("time (ms): median of rounds, slowest rank")
    where = "CPU/gloo" if res["backend"] == "gloo" else res["backend"]
    ax.set_title(f"all_reduce of {res['bytes'] / 2**20:.3g} MiB and other work on "
                 f"{res['world_size']} processes ({where}, a recorded run)", fontsize=10)
    ax.figure.tight_layout()
    return ax


def plot_bucket_overlap(buckets: dict, cap_mb: float, step: int, ax=None):
    """Chapter 01: one DDP step's bucket all-reduces on rank 0's host clock against backward's
    computation (ddp_buckets.py's JSON, the setting with this bucket_cap_mb and
    find_unused_parameters=False), then a table of every such setting's medians after the
    rebuild: communication, the share that fell before backward's computation ended (hidden),
    and the time backward() then still waited (exposed). Host clocks: right for gloo only."""
    import numpy as np
    from distkit.ddp import overlap
    setting = next(s for s in buckets["settings"] if s["cap_mb"] == cap_mb and not s["find_unused"])
    start, end = setting["backwards"][step]
    calls = [c for c in setting["calls"] if c["backward"] == step]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.32 * len(calls) + 1.6))
    ax.barh(len(calls), (end - start) * 1e3, left=0, color="C0", label="backward computation")
    for i, c in enumerate(calls):
        ax.barh(len(calls) - 1 - i, (c["end"] - c["start"]) * 1e3, left=(c["start"] - start) * 1e3,
                color="C1", label="all-reduce of one bucket" if i == 0 else None)
    ax.axvline((end - start) * 1e3, color="C0", ls=":", lw=1)
    names = [f"bucket {c['bucket']} ({c['bytes'] // 1024} KiB)" for c in calls]
    ax.set_yticks([len(calls)] + [len(calls) - 1 - i for i in range(len(calls))],
                  ["backward"] + names)
    clock = "CPU/gloo" if buckets["backend"] == "gloo" else "host clock: launches, not transfers"
    ax.set_xlabel(f"ms since backward started (rank 0, {clock}; a recorded run)")
    ax.set_title(f"Step {step + 1}, bucket_cap_mb={cap_mb}: all-reduces launched during backward")
    ax.legend(loc="lower right", fontsize=8)
    ax.figure.tight_layout()
    plt.show()
    print(f"{'bucket_cap_mb':>13} {'calls':>5} {'backward ms':>11} {'comm ms':>8} {'hidden':>7} "
          f"{'exposed ms':>10} {'backward + exposed':>18}")
    for s in (s for s in buckets["settings"] if not s["find_unused"]):
        o = [overlap(s, b) for b in range(1, len(s["buckets_per_step"]))]  # after the rebuild
        med = {k: float(np.median([x[k] for x in o]))
               for k in ("backward", "comm", "hidden", "exposed")}
        print(f"{s['cap_mb']:>13} {o[0]['calls']:>5} {med['backward'] * 1e3:>11.1f} "
              f"{med['comm'] * 1e3:>8.1f} {med['hidden'] / med['comm']:>7.0%} "
              f"{med['exposed'] * 1e3:>10.1f} {(med['backward'] + med['exposed']) * 1e3:>18.1f}")


MEMORY_CATEGORIES = [("params", "parameters"), ("grads_and_buckets", "gradients + buckets"),
                     ("optimizer", "AdamW state")]


def plot_ddp_memory(mem: dict, batch: int, ax=None):
    """Chapter 01: DDP's model states per rank in bytes per parameter (ddp_memory.py's JSON, rank
    0, `batch` sequences per rank), with and without gradient_as_bucket_view, beside 4 + 4 + 8."""
    import numpy as np
    ax = ax or plt.subplots(figsize=(8, 3.6))[1]
    psi = mem["num_params"]
    for j, view in enumerate(("False", "True")):
        m = mem["settings"][str(batch)][view]
        ax.bar(np.arange(3) + 0.27 * j - 0.27, [m[c][0] / psi for c, _ in MEMORY_CATEGORIES],
               0.27, label=f"measured, gradient_as_bucket_view={view}")
    ax.bar(np.arange(3) + 0.27, [4, 4, 8], 0.27, color="0.6", label="formula 4 + 4 + 8")
    ax.set_xticks(range(3), [label for _, label in MEMORY_CATEGORIES])
    ax.set_ylabel("bytes per parameter, per rank")
    ax.set_title(f"DDP model states per rank ({batch} sequences each)")
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax


def plot_tp_bytes(tp: dict, ax=None):
    """Chapter 02: the bytes each rank sends per step, forward and backward, for each tensor-
    parallel plan of tensor_parallel.py's JSON (counted with CommDebugMode), beside Megatron's
    2 all-reduces per layer."""
    import numpy as np
    ax = ax or plt.subplots(figsize=(8, 3.4))[1]
    names = list(tp["plans"])
    x = np.arange(len(names))
    for i, way in enumerate(("forward", "backward")):
        ax.bar(x + (i - 0.5) * 0.38, [tp["plans"][n][f"{way}_ring_bytes"] / 1024 for n in names],
               0.36, label=way)
    n = tp["world_size"]
    ax.axhline(tp["megatron_count"] * tp["activation_bytes"] * 2 * (n - 1) / n / 1024,
               color="black", ls=":", lw=1, label="Megatron: 2 all-reduces per layer, ring bytes")
    ax.set_xticks(x, names)
    ax.set(ylabel="KiB each rank sends per step", title=f"Tensor parallelism on {n} ranks, "
           f"{tp['layers']} layers: bytes per plan (measured with CommDebugMode)")
    ax.legend(fontsize=8)
    return ax


def plot_calculator(points: list, ax=None):
    """Chapter 03: the calculator's peak (and, for the bf16 points, the first sketch's) against
    each simulated step's (`points`: (row, source) pairs of simulate_fsdp.py's JSON)."""
    from distkit.course.notebook import llama_calculator, llama_sketch
    from distkit.memory import GiB
    ax = ax or plt.subplots(figsize=(6, 5))[1]
    sim = [r["peak"]["Total"] / GiB for r, _ in points]
    ax.plot(sim, [llama_calculator(r)["Total"] / GiB for r, _ in points], "o",
            label="llama_training_bytes")
    bf = [r for r, _ in points if r.get("precision") == "bf16"]
    ax.plot([r["peak"]["Total"] / GiB for r in bf], [llama_sketch(r) / GiB for r in bf], "x",
            label="sketch: ZeRO states + Korthikanti (bf16 points)")
    ax.plot([1, 300], [1, 300], "k--", lw=0.8, label="equal")
    ax.set(xscale="log", yscale="log", xlabel="simulated peak per rank (GiB)",
           ylabel="predicted peak per rank (GiB)",
           title="Calculator vs FSDPMemTracker on fake ranks (1B, 8B, 70B; 8-64 ranks)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return ax


# --- Chapter 05 -----------------------------------------------------------------------------

def plot_save_bytes(tour: dict, nproc: int, ax=None):
    """Chapter 05: the bytes each rank wrote, torch.save from rank 0 after gathering everything
    against dcp.save (dcp_tour.py's JSON)."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    ranks, sizes = range(nproc), tour["dcp"]["files"]
    old = [tour["old_way"]["file_bytes"] if r == 0 else 0 for r in ranks]
    new = [sizes.get(f"__{r}_0.distcp", 0) for r in ranks]
    w = 0.38
    ax.bar([r - w / 2 for r in ranks], [b / 1e6 for b in old], w,
           label="torch.save from rank 0 (after gathering it all)")
    ax.bar([r + w / 2 for r in ranks], [b / 1e6 for b in new], w, label="dcp.save")
    ax.set_xticks(list(ranks), [f"rank {r}" for r in ranks])
    ax.set_ylabel("MB written by this rank")
    ax.set_title("Saving a sharded model: one rank does it all, or each does its part")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    return ax


def plot_resume(ref_losses: list, killed_losses: list, save_every: int, crash_step: int,
                ax=None):
    """Chapter 05: a run killed after `crash_step` and resumed from its last checkpoint, on the
    curve of the run that never stopped (train_ckpt.py's JSONs)."""
    ax = ax or plt.subplots(figsize=(8, 3.6))[1]
    last_save = crash_step // save_every * save_every
    steps = range(1, len(ref_losses) + 1)
    ax.plot(steps, ref_losses, linewidth=4, alpha=0.35, label="uninterrupted")
    ax.plot(steps[:last_save], killed_losses[:last_save], ".-", color="tab:red",
            label=f"killed run: attempt 0 (restored from step_{last_save:06d})")
    ax.plot(steps[last_save:], killed_losses[last_save:], "--", color="k",
            label="killed run: attempt 1")
    ax.axvspan(last_save + 0.5, crash_step + 0.5, color="tab:red", alpha=0.1,
               label="computed twice")
    for s in range(save_every, len(steps) + 1, save_every):
        ax.axvline(s, color="goldenrod", linewidth=1, alpha=0.7)
    ax.plot([], [], color="goldenrod", label="checkpoint committed")
    ax.annotate("SIGKILL", (crash_step, killed_losses[crash_step - 1]), xytext=(10, 25),
                textcoords="offset points", color="tab:red", arrowprops={"arrowstyle": "->"})
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(f"A rank killed after step {crash_step}: the run resumes on the same curve")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax


def plot_reshard_gaps(gaps: dict, from_step: int, nproc: int, ax=None):
    """Chapter 05: |loss - uninterrupted| after a checkpoint of `nproc` ranks was loaded on
    other numbers of ranks (`gaps`: ranks -> the gaps of the steps after the resume)."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    for n, g in gaps.items():
        ax.semilogy(range(from_step + 1, from_step + 1 + len(g)), [max(x, 1e-9) for x in g],
                    "o-", label=f"loaded on {n} rank(s)")
    ax.axhline(1e-5, color="k", linestyle=":", label="tolerance 1e-5")
    ax.set_xlabel("optimizer step after the resume")
    ax.set_ylabel("|loss - uninterrupted| (nats)")
    ax.set_title(f"Checkpoint of {nproc} ranks, training continued on other world sizes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_async_save(seconds: dict, staged_bytes: int, ax=None) -> dict:
    """Chapter 05: the time dcp.save and dcp.async_save block the loop, and async_save's upload
    in the background (dcp_tour.py's "seconds"); returns the medians in milliseconds."""
    ax = ax or plt.subplots(figsize=(7, 2.6))[1]
    t = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in seconds.items()}
    ax.barh(["dcp.save", "dcp.async_save"], [t["save"], t["async_save"]],
            color=["tab:red", "tab:green"], label="training loop blocked")
    ax.barh(["dcp.async_save"], [t["upload_done"] - t["async_save"]], left=[t["async_save"]],
            color="tab:green", alpha=0.3, label="upload in the background")
    ax.set_xlabel("milliseconds (CPU/gloo, median of the repetitions)")
    ax.set_title(f"Saving {staged_bytes / 1e6:.0f} MB per rank: time the loop waits")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    return t


def plot_checkpoint_waste(cases: dict, waste, best, ax=None):
    """Chapter 05: the share of training time lost against the checkpoint interval, for each
    case (name -> delta, the seconds a save blocks): `waste(tau, delta)` is the model, `best(delta)`
    the interval where it is smallest (Young's), drawn as a dot."""
    ax = ax or plt.subplots(figsize=(7, 3.2))[1]
    taus = [60 * 2 ** (k / 4) for k in range(0, 30)]
    for name, delta in cases.items():
        ax.semilogx([t / 60 for t in taus], [100 * waste(t, delta) for t in taus], label=name)
        ax.plot(best(delta) / 60, 100 * waste(best(delta), delta), "ko")
    ax.set_xlabel("checkpoint interval (minutes)")
    ax.set_ylabel("training time lost (%)")
    ax.set_title("Save often enough, not more: Young's interval (dots)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return ax


# --- Chapter 07 -----------------------------------------------------------------------------

def plot_divergence(res: dict):
    """Chapter 07: the gap between the ranks' weights per step, and each rank's model on the
    same batch (diverge.py's JSON)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in res["variants"].items():
        ax1.plot(r["weight_gap"], marker=".", label=name)
    ax1.set(xlabel="optimizer step", ylabel="max over weights of |w_rank0 - w_rank1|",
            title="Gap between the ranks' weights", ylim=(-0.05, None))
    ax1.legend()
    for name, color in (("seed-per-rank", "C0"), ("rng-drift", "C1"), ("broadcast", "C2")):
        for rank, losses in enumerate(res["variants"][name]["eval_loss"]):
            ax2.plot(losses, color=color, linestyle="-" if rank == 0 else "--",
                     label=f"{name}, rank {rank}")
    ax2.set(xlabel="optimizer step", ylabel="cross-entropy on a shared batch (nats)",
            title="Each rank's model on the same data")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_hogwild(res: dict):
    """Chapter 07: Hogwild against synchronous SGD per sample, and SGD with gradients tau steps
    stale at two learning rates (hogwild.py's JSON)."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for name, run in res["part1"].items():
        ax1.plot(run["samples"], run["heldout_loss"], marker=".",
                 label=f"{name}: {run['updates']} updates")
    ax1.axhline(res["ln_classes"], color="gray", linestyle=":", label="ln 10: a uniform guess")
    ax1.set(xlabel="training samples processed, all workers",
            ylabel="held-out cross-entropy (nats)",
            title=f"Hogwild with {res['workers']} processes vs synchronous SGD, lr {res['lr']}")
    ax1.legend()
    runs = res["part2"]["runs"]
    taus, top = sorted({r["tau"] for r in runs}), max(r["lr"] for r in runs)
    for r in runs:
        ax2.plot(r["loss"], color=f"C{taus.index(r['tau'])}",
                 linestyle="-" if r["lr"] == top else "--",
                 label=f"lr {r['lr']:g}, tau {r['tau']}")
    ax2.axhline(res["diverged_above"], color="gray", linestyle=":", label="diverged above")
    ax2.set_yscale("log")
    ax2.set(xlabel="SGD step", ylabel="held-out cross-entropy (nats, log scale)",
            title="Gradients tau steps stale (one process, seeded)")
    ax2.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    return fig


def plot_comm_hooks(res: dict):
    """Chapter 07: the loss and the bytes handed to all-reduce per step for each DDP
    communication hook (comm_hooks.py's JSON)."""
    style = {"none": "-", "fp16": "--", "bf16": ":", "powersgd": "-"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for hook, r in res["results"].items():
        ax1.plot(range(len(r["loss"])), r["loss"], style[hook], label=hook, lw=1.5)
        ax2.plot(range(1, len(r["bytes_per_step"]) + 1),
                 [b / 1024 for b in r["bytes_per_step"]], style[hook], marker=".", label=hook)
    ax1.axvline(res["powersgd_start"], color="grey", lw=0.8)
    ax1.set(xlabel="training step", ylabel="held-out cross-entropy (nats)",
            title=f"Loss; PowerSGD (rank {res['rank']}) compresses after step "
                  f"{res['powersgd_start']}")
    ax2.set(xlabel="training step", ylabel="KiB handed to all-reduce per step", ylim=(0, None),
            title="Bytes per step, measured (flight recorder)")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    return fig


def plot_sum_errors(errs: dict, ns: list, ax=None):
    """Chapter 07: the relative error of the averaged gradient when a 16-bit hook's all-reduce
    is replayed in ring order, against the number of ranks (comm_hooks.py's "sum_errors")."""
    ax = ax or plt.subplots(figsize=(7, 3.6))[1]
    for d, color in (("fp32", "C0"), ("fp16", "C1"), ("bf16", "C2")):
        ax.plot(ns, [errs[str(n)][d]["sum"] for n in ns], "o-", color=color,
                label=f"{d}: the ring's sum")
        if d != "fp32":  # fp32's inputs are exact
            ax.plot(ns, [errs[str(n)][d]["cast_only"] for n in ns], "x--", color=color,
                    label=f"{d}: the inputs' rounding only")
    ax.set(xscale="log", yscale="log", xlabel="ranks N",
           ylabel="relative error of the averaged gradient",
           title="The hooks' 16-bit all-reduce, replayed in ring order")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.figure.tight_layout()
    return ax


def plot_oom(oom: dict, ax=None):
    """Chapter 07: for each run under the memory cap, the calculator's model states and
    activations against the peak measured (oom.py's JSON)."""
    mib, runs = 2**20, oom["runs"]
    ax = ax or plt.subplots(figsize=(9, 3.6))[1]
    x = range(len(runs))
    states = [r["calculator"]["states"] / mib for r in runs]
    acts = [r["calculator"]["activations"] / mib for r in runs]
    ax.bar([i - 0.2 for i in x], states, 0.4, label="calculator: model states")
    ax.bar([i - 0.2 for i in x], acts, 0.4, bottom=states, label="calculator: activations")
    ax.bar([i + 0.2 for i in x], [r["peak_bytes"] / mib for r in runs], 0.4, color="grey",
           label="measured: peak under the cap\n(at the failure, if it failed)")
    ax.axhline(oom["budget_bytes"] / mib, color="red", label="the cap (budget)")
    ax.axhline(oom["headroom"] * oom["budget_bytes"] / mib, color="red", ls="--",
               label=f"{oom['headroom']:.0%} of it: 'fits'")
    ax.set_xticks(list(x), [f"{r['label']}\n" + ("ran" if r["ran"] else f"OOM in {r['phase']}")
                            for r in runs])
    ax.set_ylabel("MiB beyond what the\nprocess held before")
    ax.set_title(f"Calculator vs measured, each run under a {oom['budget_bytes'] / mib:g} MiB "
                 f"cap ({oom['device']})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.figure.tight_layout()
    return ax
