"""The course's explanatory diagrams, drawn in code: one function per picture in images/.

Each function returns a matplotlib Figure; `DIAGRAMS` maps an image name to its function, and
`main()` saves every one as `images/<name>.png`. To fix a diagram, edit its function here and
regenerate them all (from the repo root; `make images` does the same):

    PYTHONPATH=code .venv/bin/python -m distkit.diagrams [--out DIR]

Measured pictures (timelines, memory bars) are not here: notebook cells draw those from a run's
JSON with `distkit.plots`. These diagrams explain what a technique does.

Every figure is laid out on axes whose data units are inches (see `_canvas`), so sizes and
positions below read as inches on the page; fonts are >= 9 pt at ~1000 px wide.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from distkit.memory import GB, MIXED_ADAMW, STAGES, communication_bytes, model_state_bytes
from distkit.plots import RANK_COLORS, STATE_COLORS

IMAGES = Path(__file__).resolve().parents[2] / "images"
DPI = 110
FONT = 10          # body text, points
SMALL = 9          # the smallest text in any diagram
MONO = "DejaVu Sans Mono"
INK = "0.15"       # text and outlines
FAINT = "0.6"      # the optional multi-node part of the torchrun picture
SHARED = "0.82"    # grey: the same on every rank (as in distkit.plots: grey = a sum)
STORE_FACE, STORE_EDGE, STORE_INK = "#fff4d6", "#b8860b", "#8a6508"  # the store, all-reduce
RING_CELL, RING_GAP = 0.62, 0.3  # ring_allreduce: chunk width, and the gap arrows cross


# --- small helpers ------------------------------------------------------------------------

def _canvas(width: float, height: float):
    """One axes filling the figure, in inches: (0, 0) bottom left, (width, height) top right."""
    fig = plt.figure(figsize=(width, height), facecolor="white")
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def _tint(color, amount: float = 0.3):
    """`color` mixed with white: amount 1 = the colour itself, 0 = white."""
    r, g, b, _ = to_rgba(color)
    return (1 - amount * (1 - r), 1 - amount * (1 - g), 1 - amount * (1 - b))


def _box(ax, x, y, w, h, text="", *, face="white", edge=INK, lw=1.0, ls="-", size=FONT,
         color=INK, round_=0.06, zorder=1):
    """A rounded box with lower-left corner (x, y), and `text` centred in it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={round_}",
                                facecolor=face, edgecolor=edge, linewidth=lw, linestyle=ls,
                                zorder=zorder))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
                color=color, zorder=zorder + 1, linespacing=1.3)


def _arrow(ax, start, end, text="", *, color=INK, lw=1.3, ls="-", style="-|>", rad=0.0,
           size=FONT, text_at=None, mutation=12, zorder=3):
    """An arrow from `start` to `end` (curved if rad != 0), with an optional label at `text_at`."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=mutation,
                                 connectionstyle=f"arc3,rad={rad}", color=color, linewidth=lw,
                                 linestyle=ls, shrinkA=0, shrinkB=0, zorder=zorder))
    if text:
        if text_at is None:
            text_at = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(*text_at, text, ha="center", va="center", fontsize=size, color=color,
                zorder=zorder + 1, linespacing=1.3)


def _title(ax, x, y, text, size=12.5):
    ax.text(x, y, text, ha="center", va="center", fontsize=size, fontweight="bold", color=INK)


# --- torchrun -----------------------------------------------------------------------------

def _env(rank, local_rank, world_size, local_world_size=None):
    """The variables torchrun sets for one worker (MASTER_* only where there is room)."""
    env = [("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size)]
    if local_world_size:
        env += [("LOCAL_WORLD_SIZE", local_world_size), ("MASTER_ADDR", "localhost"),
                ("MASTER_PORT", "<free port>")]
    return env


def _worker(ax, x, y, w, h, rank, env, *, faint=False):
    """One worker process: a header in its rank's colour, then its environment variables."""
    color = RANK_COLORS[rank % 10]
    edge = FAINT if faint else color
    _box(ax, x, y, w, h, face=_tint(color, 0.08 if faint else 0.14), edge=edge,
         lw=1.0 if faint else 1.6, ls="--" if faint else "-")
    ax.text(x + 0.12, y + h - 0.2, f"rank {rank}", fontsize=FONT + 1, fontweight="bold",
            color=_tint(color, 0.55) if faint else color, va="center")
    ax.text(x + w - 0.12, y + h - 0.2, "python script.py", fontsize=SMALL, family=MONO,
            color=FAINT if faint else INK, va="center", ha="right")
    ax.text(x + 0.12, y + h - 0.42, "\n".join(f"{k}={v}" for k, v in env), fontsize=SMALL,
            family=MONO, color=FAINT if faint else INK, va="top", linespacing=1.35)


def torchrun():
    """What `torchrun --standalone --nproc-per-node 2 script.py` starts, and how they connect."""
    fig, ax = _canvas(9.0, 6.5)
    _title(ax, 4.5, 6.22, "What  torchrun --standalone --nproc-per-node 2 script.py  starts")

    # node 0: the agent, its store, two workers
    _box(ax, 0.15, 0.75, 6.0, 5.05, face="0.97", edge="0.55", round_=0.12, zorder=0)
    ax.text(0.32, 5.6, "node 0 (this machine)", fontsize=FONT, color="0.35", va="center")
    _box(ax, 0.4, 3.75, 5.5, 1.65, face="white", edge=INK, lw=1.4)
    ax.text(0.55, 5.17, "torchrun agent", fontsize=FONT + 1, fontweight="bold", va="center")
    ax.text(2.05, 5.17, "(one process per node)", fontsize=FONT, va="center", color="0.3")
    ax.text(0.55, 4.82, "spawns the workers with their env vars, then monitors them:\n"
            "if one fails, it stops the others and exits non-zero", fontsize=FONT,
            va="center", color="0.2", linespacing=1.3)
    _box(ax, 1.75, 3.88, 2.8, 0.55, "rendezvous + TCP store\non MASTER_ADDR:MASTER_PORT",
         face=STORE_FACE, edge=STORE_EDGE, size=SMALL + 0.5)
    wy, wh, ww = 1.35, 1.75, 2.2
    _worker(ax, 0.4, wy, ww, wh, 0, _env(0, 0, 2, 2))
    _worker(ax, 3.7, wy, ww, wh, 1, _env(1, 1, 2, 2))
    # spawn (agent -> worker) on the outside, connect (worker -> store) on the inside
    top = wy + wh
    for x in (0.75, 5.55):
        _arrow(ax, (x, 3.75), (x, top), color="0.35")
    ax.text(0.85, 3.42, "spawn", fontsize=SMALL, color="0.35", va="center")
    ax.text(5.45, 3.42, "spawn", fontsize=SMALL, color="0.35", va="center", ha="right")
    for x in (2.25, 3.95):
        _arrow(ax, (x, top), (x, 3.88), ls="--", color=STORE_INK)
    ax.text(3.1, 3.47, "init_process_group():\nregister, wait for all", fontsize=SMALL,
            ha="center", va="center", color=STORE_INK, linespacing=1.25)
    # the backend: workers talk to each other directly
    _arrow(ax, (2.6, 2.05), (3.7, 2.05), style="<|-|>", lw=2.4, color="0.25", mutation=14)
    ax.text(3.15, 2.25, "tensors", fontsize=SMALL, ha="center", color="0.25")
    ax.text(3.15, 1.05, "collectives go rank to rank, not through the agent: the backend moves "
            "the bytes\ngloo over TCP (tensors on CPU)  ·  NCCL over NVLink / InfiniBand "
            "(on GPU)", fontsize=FONT, ha="center", va="center", color="0.2", linespacing=1.35)

    # faint node 1: the same command with --nnodes 2 joins one rendezvous
    _box(ax, 6.35, 0.75, 2.5, 5.05, face="white", edge=FAINT, ls="--", round_=0.12, zorder=0)
    ax.text(6.5, 5.6, "node 1 (if --nnodes 2)", fontsize=FONT, color=FAINT, va="center")
    _box(ax, 6.55, 4.35, 2.1, 1.05, "torchrun agent", face="white", edge=FAINT, ls="--",
         color=FAINT, size=FONT + 1)
    _arrow(ax, (6.55, 4.6), (4.55, 4.16), ls="--", color=FAINT, rad=0.25)
    ax.text(7.6, 4.0, "c10d rendezvous:\njoins node 0's store", fontsize=SMALL, color=FAINT,
            ha="center", va="top", linespacing=1.25)
    for i, y in enumerate((2.35, 1.0)):
        _worker(ax, 6.55, y, 2.1, 1.05, 2 + i, _env(2 + i, i, 4), faint=True)
    ax.text(4.5, 0.38, "RANK: id in the whole job.   LOCAL_RANK: id on its node "
            "(on a GPU node it picks cuda:LOCAL_RANK).", fontsize=FONT, ha="center",
            va="center", color="0.3")
    return fig


# --- ring all-reduce ----------------------------------------------------------------------

def ring_schedule(n: int):
    """Per phase, per step: {rank: (chunk sent to the right neighbour, chunk received)}.

    The schedule of code/ch00_collectives/ring_allreduce.py: reduce-scatter step s, rank r sends
    chunk (r - s) mod n and adds the arriving chunk (r - s - 1) mod n; all-gather step s, rank r
    sends chunk (r - s + 1) mod n and copies the arriving chunk (r - s) mod n.
    """
    rs = [{r: ((r - s) % n, (r - s - 1) % n) for r in range(n)} for s in range(n - 1)]
    ag = [{r: ((r - s + 1) % n, (r - s) % n) for r in range(n)} for s in range(n - 1)]
    return rs, ag


def _ring_states(n: int):
    """The ranks whose data each (rank, chunk) holds, before every step and at the end."""
    held = [[[r] for _ in range(n)] for r in range(n)]  # held[rank][chunk]: list of ranks
    states = []
    for phase, steps in zip(("rs", "ag"), ring_schedule(n)):
        for moves in steps:
            states.append(([[list(c) for c in row] for row in held], moves))
            incoming = {(r + 1) % n: (send, list(held[r][send])) for r, (send, _) in moves.items()}
            for r, (chunk, data) in incoming.items():
                held[r][chunk] = data + held[r][chunk] if phase == "rs" else data
        states.append(([[list(c) for c in row] for row in held], None))
    return states


def _ring_panel(ax, x0, y0, held, moves, n, title, *, labels: bool):
    """One step: ranks as columns (left to right = around the ring), chunks as rows."""
    cw, ch, gap, vgap = RING_CELL, 0.3, RING_GAP, 0.06
    ax.text(x0 + (n * cw + (n - 1) * gap) / 2, y0 + 0.5 + n * (ch + vgap), title,
            ha="center", va="center", fontsize=FONT, fontweight="bold", color=INK)
    top = y0 + n * (ch + vgap)
    for r in range(n):
        x = x0 + r * (cw + gap)
        ax.text(x + cw / 2, top + 0.17, f"rank {r}", ha="center", va="center", fontsize=SMALL,
                color=RANK_COLORS[r], fontweight="bold")
        for c in range(n):
            y = top - (c + 1) * (ch + vgap)
            ranks = held[r][c]
            if len(ranks) == 1:
                face, text, tc = _tint(RANK_COLORS[ranks[0]], 0.35), str(ranks[0]), INK
            elif len(ranks) < n:
                face, text, tc = SHARED, "+".join(map(str, ranks)), INK
            else:
                face, text, tc = "0.3", "sum", "white"
            sending = moves is not None and moves[r][0] == c
            ax.add_patch(Rectangle((x, y), cw, ch, facecolor=face, zorder=2,
                                   edgecolor="black" if sending else "0.45",
                                   linewidth=2.0 if sending else 0.6))
            ax.text(x + cw / 2, y + ch / 2, text, ha="center", va="center", fontsize=SMALL,
                    color=tc, zorder=3, fontweight="bold" if len(ranks) == n else "normal")
            if labels and r == 0:
                ax.text(x0 - 0.2, y + ch / 2, f"chunk {c}", ha="right", va="center",
                        fontsize=SMALL, color="0.3")
    if moves is None:
        return
    for r, (c, _) in moves.items():  # each rank sends one chunk to its right neighbour
        y = top - (c + 1) * (ch + vgap) + ch / 2
        x = x0 + r * (cw + gap) + cw
        if r < n - 1:
            _arrow(ax, (x + 0.02, y), (x + gap - 0.02, y), lw=1.6, mutation=11)
        else:  # rank n-1 -> rank 0: round the back of the ring, under the panel
            bottom, right, left = y0 - 0.12, x + 0.14, x0 - 0.1
            ax.plot([x + 0.02, right, right, left, left], [y, y, bottom, bottom, y],
                    color=INK, lw=1.1, ls=(0, (3, 2)), zorder=3)
            _arrow(ax, (left, y), (x0 - 0.02, y), lw=1.1, mutation=11)


def ring_allreduce(n: int = 4):
    """Ring all-reduce on n ranks: reduce-scatter, then all-gather, one panel per step."""
    pw = n * RING_CELL + (n - 1) * RING_GAP       # panel width
    ph = n * 0.36 + 0.88                          # panel height, title included
    rows = n                                      # n-1 steps + the result, per phase
    width, left = 2 * pw + 2.2, 0.9
    height = rows * ph + 2.25
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, f"Ring all-reduce on N = {n} ranks: "
           f"{n - 1} steps of reduce-scatter, then {n - 1} of all-gather")
    states = _ring_states(n)
    col_x = (left, left + pw + 1.0)
    heads = (("reduce-scatter: add what arrives", "rank r sends chunk (r − s) mod N"),
             ("all-gather: copy what arrives", "rank r sends chunk (r − s + 1) mod N"))
    for col, (head, rule) in enumerate(heads):
        ax.text(col_x[col] + pw / 2, height - 0.72, head, ha="center", va="center",
                fontsize=FONT + 1, color=INK, fontweight="bold")
        ax.text(col_x[col] + pw / 2, height - 0.98, f"step s: {rule}", ha="center",
                va="center", fontsize=SMALL + 0.5, color="0.3")
        for i in range(n):
            held, moves = states[col * n + i]
            y0 = height - 1.1 - (i + 1) * ph + 0.12
            if moves is not None:
                title = f"step s = {i}"
            elif col == 0:
                title = "after reduce-scatter: rank r holds the sum of chunk r+1"
            else:
                title = "after all-gather: every rank holds the whole sum"
            _ring_panel(ax, col_x[col], y0, held, moves, n, title, labels=col == 0)
    handles = [Patch(facecolor=_tint(RANK_COLORS[0], 0.35), edgecolor="0.45",
                     label="one rank's own data (its number)"),
               Patch(facecolor=SHARED, edgecolor="0.45", label="partial sum (ranks added so far)"),
               Patch(facecolor="0.3", edgecolor="0.45", label="full sum of all N ranks"),
               Patch(facecolor="white", edgecolor="black", linewidth=2.0,
                     label="sent to the right neighbour this step")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=SMALL, frameon=False,
               bbox_to_anchor=(0.5, 0.5 / height))
    ax.text(width / 2, 0.22, f"Each rank sends 2(N-1) = {2 * (n - 1)} chunks of S/N bytes "
            "(S: size of the tensor), 2(N-1)/N · S in all: under 2S for any N", ha="center",
            va="center", fontsize=FONT, color=INK)
    return fig


# --- DDP ----------------------------------------------------------------------------------

def ddp(n: int = 2):
    """Data parallelism: one batch split over n ranks, a full model replica on each."""
    lane_h, lane_gap = 1.05, 0.6
    height = 2.45 + n * lane_h + (n - 1) * lane_gap
    fig, ax = _canvas(9.0, height)
    _title(ax, 4.5, height - 0.3, f"DDP on N = {n} ranks: a whole model on every rank, "
           "a slice of the batch each")
    lanes_top = height - 0.95
    lane_y = [lanes_top - (r + 1) * lane_h - r * lane_gap for r in range(n)]  # lane bottoms
    lanes_bottom = lane_y[-1]

    # the global batch, cut into n slices by DistributedSampler
    bx, bw = 0.15, 1.0
    ax.text(bx + bw / 2, lanes_top + 0.25, "global batch\n(B samples)", ha="center",
            va="center", fontsize=FONT, fontweight="bold", color=INK, linespacing=1.2)
    for r, y in enumerate(lane_y):
        _box(ax, bx, y, bw, lane_h, f"slice {r}\nB/{n} samples", round_=0.02,
             face=_tint(RANK_COLORS[r], 0.35), edge=RANK_COLORS[r], lw=1.4)
    ax.text(bx + bw / 2, lanes_bottom - 0.22, "DistributedSampler", ha="center", va="center",
            fontsize=SMALL, family=MONO, color="0.3")

    # per rank: replica -> activations -> local grads;  all-reduce across;  optimizer step
    cols = {"model": (1.55, 1.15), "act": (3.3, 1.0), "grad": (5.0, 1.0),
            "reduce": (6.4, 1.0), "step": (7.75, 1.2)}
    x_of = lambda k: cols[k][0]  # noqa: E731
    end = lambda k: cols[k][0] + cols[k][1]  # noqa: E731
    for r, y in enumerate(lane_y):
        color = RANK_COLORS[r]
        mid = y + lane_h / 2
        ax.text(x_of("model"), y + lane_h + 0.13, f"rank {r}", fontsize=FONT, color=color,
                fontweight="bold", va="center")
        _box(ax, x_of("model"), y, cols["model"][1], lane_h,
             "model replica\nweights W", face=SHARED, edge=INK)
        _box(ax, x_of("act"), y, cols["act"][1], lane_h, "activations\nand loss",
             face=_tint(color, 0.35), edge=color, lw=1.4)
        _box(ax, x_of("grad"), y, cols["grad"][1], lane_h, f"local grads\n$g_{r}$",
             face=SHARED, edge=color, lw=1.4)
        _box(ax, x_of("step"), y, cols["step"][1], lane_h, "optimizer\n.step()\nsame update",
             face=SHARED, edge=INK)
        _arrow(ax, (bx + bw, mid), (x_of("model"), mid), color=color, lw=1.8)
        _arrow(ax, (end("model"), mid), (x_of("act"), mid), "forward",
               text_at=((end("model") + x_of("act")) / 2, mid + 0.15), size=SMALL)
        _arrow(ax, (end("act"), mid), (x_of("grad"), mid), "backward",
               text_at=((end("act") + x_of("grad")) / 2, mid + 0.15), size=SMALL)
        _arrow(ax, (end("grad"), mid), (x_of("reduce"), mid), color=color, lw=1.8)
        _arrow(ax, (end("reduce"), mid), (x_of("step"), mid), lw=1.8)
    # one all-reduce over every rank
    _box(ax, x_of("reduce"), lanes_bottom, cols["reduce"][1], lanes_top - lanes_bottom,
         "all-reduce\n(average)\n\nbucket by\nbucket,\nduring\nbackward", face=STORE_FACE,
         edge=STORE_EDGE, lw=1.4)
    ax.text(x_of("reduce") + cols["reduce"][1] / 2, lanes_bottom - 0.22,
            r"every rank gets $\bar g$ = mean of the $g_r$", ha="center", va="center",
            fontsize=SMALL, color=INK)
    # broadcast at construction: every replica starts from rank 0's weights
    mx = x_of("model") + cols["model"][1] / 2
    for r in range(1, n):
        _arrow(ax, (mx, lane_y[r - 1]), (mx, lane_y[r] + lane_h), lw=1.8, color=RANK_COLORS[0])
    ax.text(mx + 0.12, (lane_y[0] + lane_y[1] + lane_h) / 2,
            "broadcast W from rank 0\n(once, in DDP(model))", fontsize=SMALL, va="center",
            color=RANK_COLORS[0], linespacing=1.2)

    # what is replicated, what is split
    ky = lanes_bottom - 1.4
    keys = [(0.15, [SHARED], "Replicated: a full copy on every rank",
             "parameters, gradients (equal after the all-reduce),\n"
             "optimizer state: memory per rank does not shrink with N"),
            (4.6, [_tint(RANK_COLORS[r], 0.35) for r in range(n)],
             "Split: different on every rank",
             f"the data (B/{n} samples each), and so the\nactivations and the loss")]
    for x, swatches, head, body in keys:
        _box(ax, x, ky, 4.3, 0.98, face="white", edge="0.55", round_=0.04)
        for i, face in enumerate(swatches):
            ax.add_patch(Rectangle((x + 0.15 + 0.25 * i, ky + 0.64), 0.2, 0.2, facecolor=face,
                                   edgecolor="0.45", linewidth=0.8))
        ax.text(x + 0.25 + 0.25 * len(swatches), ky + 0.74, head, fontsize=FONT,
                fontweight="bold", va="center", color=INK)
        ax.text(x + 0.15, ky + 0.32, body, fontsize=SMALL + 0.5, va="center", color=INK,
                linespacing=1.3)
    return fig


# --- chapter 02: model parallelism --------------------------------------------------------

F_AMOUNT, B_AMOUNT = 0.3, 0.7  # timelines: the rank's colour, light for F and dark for B
WRONG, RIGHT = "#b22222", "#2e7d32"  # pipedream_staleness: a wrong gradient, a consistent one


def _rank_region(ax, x, y, w, h, rank, head, note=""):
    """A rank's part of a picture: a faint box in its colour, with 'rank r' and a note on top."""
    color = RANK_COLORS[rank % 10]
    _box(ax, x, y, w, h, face=_tint(color, 0.1), edge=color, lw=1.4, round_=0.1, zorder=0)
    ax.text(x + 0.12, y + h - 0.2, head, fontsize=FONT + 1, fontweight="bold", color=color,
            va="center")
    if note:
        ax.text(x + w - 0.12, y + h - 0.2, note, fontsize=SMALL, color="0.3", va="center",
                ha="right")


def _slot(ax, x, y, w, h, kind, rank, text, *, bold=False, size=FONT):
    """One block of a schematic timeline: F (light), B (dark), idle (dashed) or a step."""
    color = RANK_COLORS[rank % 10]
    if kind == "idle":
        _box(ax, x, y, w, h, text, face="white", edge=FAINT, ls="--", color="0.45",
             size=size, round_=0.03)
        return
    face = {"F": _tint(color, F_AMOUNT), "B": _tint(color, B_AMOUNT), "step": "white"}[kind]
    tc = "white" if kind == "B" else INK
    _box(ax, x, y, w, h, text, face=face, edge="black" if bold else color,
         lw=2.4 if bold else 1.0, color=tc, size=size, round_=0.03)


def model_parallel():
    """Naive model parallelism on 2 ranks: the layers split in two, one rank busy at a time."""
    width, height = 10.6, 6.1
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Naive model parallelism on 2 ranks: "
           "each rank holds some of the layers")

    # the model, cut in two: rank 0 runs the first layers, rank 1 the rest and the loss
    ry, rh, bh = height - 2.75, 1.95, 0.8     # regions: bottom, height; layer boxes: height
    regions = ((0, 0.15, 3.7, ("embedding", "layer 0", "layer 1")),
               (1, 5.75, 4.7, ("layer 2", "layer 3", "norm", "head\n+ loss")))
    by = ry + 0.45
    ends = {}
    for rank, x0, w, layers in regions:
        color = RANK_COLORS[rank]
        _rank_region(ax, x0, ry, w, rh, rank, f"rank {rank}",
                     "its layers' weights, grads, optimizer state")
        bw, gap = 0.95, (w - 0.3 - len(layers) * 0.95) / (len(layers) - 1)
        xs = [x0 + 0.15 + i * (bw + gap) for i in range(len(layers))]
        for i, (x, name) in enumerate(zip(xs, layers)):
            _box(ax, x, by, bw, bh, name, face=_tint(color, 0.35), edge=color, lw=1.4)
            if i:
                _arrow(ax, (xs[i - 1] + bw, by + bh / 2), (x, by + bh / 2), mutation=10)
        ends[rank] = (xs[0], xs[-1] + bw)
        # what comes in from the data loader: the inputs on rank 0, the labels on rank 1
        feed = "input ids [B,S]" if rank == 0 else "labels [B,S]"
        fx = xs[0] + bw / 2 if rank == 0 else xs[-1] + bw / 2
        _arrow(ax, (fx, ry - 0.35), (fx, by), color="0.35")
        ax.text(fx + 0.1, ry - 0.22, feed, fontsize=SMALL, color="0.3", va="center")
    # between the ranks: activations forward, their gradients backward (point to point)
    x0, x1 = ends[0][1], ends[1][0]
    mid = (x0 + x1) / 2
    fy, gy = by + bh * 0.72, by + bh * 0.28
    _arrow(ax, (x0, fy), (x1, fy), color=RANK_COLORS[0], lw=2.0)
    _arrow(ax, (x1, gy), (x0, gy), color=RANK_COLORS[1], lw=2.0)
    ax.text(mid, fy + 0.38, "forward:\nactivations [B,S,h]\nsend → recv", ha="center",
            va="center", fontsize=SMALL, color=RANK_COLORS[0], linespacing=1.25)
    ax.text(mid, gy - 0.38, "backward:\ntheir gradients [B,S,h]\nrecv ← send", ha="center",
            va="center", fontsize=SMALL, color=RANK_COLORS[1], linespacing=1.25)

    # one step on a schematic timeline: F then B, one rank at a time
    unit, tx = 1.2, 1.15                      # inches per forward; where time 0 is
    lane_h, l0, l1 = 0.5, 1.45, 0.8           # lane height; lane bottoms of rank 0, rank 1
    ax.text(width / 2, 2.35, "One training step on a timeline (schematic, not measured): "
            "one rank always idles", ha="center", va="center", fontsize=FONT + 1,
            fontweight="bold", color=INK)
    plan = {0: [("F", 0, 1, "F"), ("idle", 1, 4, "idle: waits for rank 1"), ("B", 4, 6, "B"),
                ("step", 6, 6.45, "step")],
            1: [("idle", 0, 1, "idle"), ("F", 1, 2, "F"), ("B", 2, 4, "B"),
                ("step", 4, 4.45, "step"), ("idle", 4.45, 6.45, "idle: its part is done")]}
    for rank, y in ((0, l0), (1, l1)):
        ax.text(tx - 0.15, y + lane_h / 2, f"rank {rank}", ha="right", va="center",
                fontsize=FONT, fontweight="bold", color=RANK_COLORS[rank])
        for kind, t0, t1, text in plan[rank]:
            _slot(ax, tx + t0 * unit + 0.02, y, (t1 - t0) * unit - 0.04, lane_h, kind, rank,
                  text, size=SMALL if kind == "step" else FONT)
    # the two messages of the step: activations at t = 1, gradients at t = 4
    _arrow(ax, (tx + unit, l0), (tx + unit, l1 + lane_h), color=RANK_COLORS[0], lw=1.6,
           mutation=10)
    _arrow(ax, (tx + 4 * unit, l1 + lane_h), (tx + 4 * unit, l0), color=RANK_COLORS[1], lw=1.6,
           mutation=10)
    end = tx + 6.45 * unit
    _arrow(ax, (tx, 0.52), (end + 0.1, 0.52), color="0.35", lw=1.0, mutation=9)
    ax.text(tx, 0.3, "time →  (schematic: backward ≈ 2 × forward; F = forward, B = backward, "
            "step = optimizer on its own layers)", fontsize=SMALL, color="0.3", va="center")
    ax.text(end + 0.3, (l0 + l1 + lane_h) / 2, "each rank is busy\n~1/2 of the step;\n"
            "N equal stages:\nbusy 1/N, idle (N−1)/N", fontsize=SMALL + 0.5, va="center",
            color=INK, linespacing=1.3)
    return fig


def _async_1f1b(slots: int):
    """2-stage 1F1B without flushes (PipeDream): {stage: {slot: (kind, micro-batch)}}."""
    plan = {0: {0: ("F", 1), 1: ("F", 2)}, 1: {}}   # stage 0 warms up with 2 forwards
    m_f, m_b = 3, 1
    for t in range(3, slots):            # then, from slot 3: B1, F3, B2, F4, B3, ...
        if t % 2:
            plan[0][t], m_b = ("B", m_b), m_b + 1
        else:
            plan[0][t], m_f = ("F", m_f), m_f + 1
    for t in range(1, slots):            # stage 1: F1, B1, F2, B2, ... (one slot behind)
        plan[1][t] = ("F" if t % 2 else "B", (t + 1) // 2)
    return plan


def pipedream_staleness():
    """Weight staleness in an asynchronous pipeline, weight stashing, and the synchronous fix."""
    slots, sw, gx = 11, 0.78, 1.45           # time slots, slot width, grid's left edge
    lane_h, band_h = 0.46, 0.24
    panel_h = 2.3
    width, height = gx + slots * sw + 0.25, 0.75 + 3 * panel_h + 0.7
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Weight staleness in a 2-stage pipeline: "
           "which weights does micro-batch 2's backward use?")
    async_plan = _async_1f1b(slots)
    sync_plan = {0: {0: ("F", 1), 1: ("F", 2), 3: ("B", 1), 4: ("F", 3), 5: ("B", 2),
                     6: ("F", 4), 7: ("B", 3), 9: ("B", 4)},
                 1: {1: ("F", 1), 2: ("B", 1), 3: ("F", 2), 4: ("B", 2), 5: ("F", 3),
                     6: ("B", 3), 7: ("F", 4), 8: ("B", 4)}}
    panels = [  # heading, schedule, mode, (note in colour, note in grey)
        ("1   Asynchronous 1F1B (PipeDream), no stashing: "
         "each stage updates its weights after every backward", async_plan, "async",
         ("micro-batch 2: forward with W1, backward with W2 → wrong gradient "
          "(activations of W1, weights of W2)", WRONG,
          "Stage 1 (the last) runs each B right after its F: no update in between. "
          "No flush: no idle slot after the warm-up")),
        ("2   Weight stashing (PipeDream): keep the version each forward used, "
         "for that micro-batch's backward", async_plan, "stash",
         ("B2 uses the stashed W1 → consistent gradient, applied to the newest weights "
          "(one update late)", RIGHT,
          "Memory: one weight copy per in-flight micro-batch (2 on stage 0 here)")),
        ("3   GPipe / 1F1B, synchronous: flush at the end of the step, then one update",
         sync_plan, "sync",
         ("every micro-batch of the step sees W1 (gradients accumulate): no staleness", RIGHT,
          "The price: idle slots (the bubble). Drawn: 1F1B; GPipe (all F, then all B) "
          "follows the same rule")),
    ]
    for p, (head, plan, mode, (note, note_color, more)) in enumerate(panels):
        top = height - 0.75 - p * panel_h
        ax.text(0.15, top - 0.05, head, fontsize=FONT, fontweight="bold", color=INK,
                va="center")
        band_y = top - 0.45
        l0 = band_y - 0.06 - lane_h          # stage 0 lane bottom
        l1 = l0 - 0.08 - lane_h              # stage 1 lane bottom
        # stage 0's weight version over time: a new version after each of its backwards
        version, versions = 1, []
        for t in range(slots):
            versions.append(version)
            kind = plan[0].get(t, ("", 0))[0]
            if kind == "B" and mode != "sync":
                version += 1
        stashed = {}                          # micro-batch -> version its forward used
        ax.text(gx - 0.1, band_y + band_h / 2, "stage 0 weights", ha="right", va="center",
                fontsize=SMALL, color="0.3")
        start = 0
        last = slots - 1 if mode == "sync" else slots
        for t in range(1, last + 1):
            if t == last or versions[t] != versions[start]:
                face = "0.9" if versions[start] % 2 else "0.78"
                ax.add_patch(Rectangle((gx + start * sw + 0.02, band_y), (t - start) * sw - 0.04,
                                       band_h, facecolor=face, edgecolor="none", zorder=1))
                ax.text(gx + (start + t) * sw / 2, band_y + band_h / 2, f"W{versions[start]}",
                        ha="center", va="center", fontsize=SMALL, color=INK, zorder=2)
                start = t
        for stage, y in ((0, l0), (1, l1)):
            ax.text(gx - 0.1, y + lane_h / 2, f"stage {stage} (rank {stage})", ha="right",
                    va="center", fontsize=SMALL + 0.5, fontweight="bold",
                    color=RANK_COLORS[stage])
            for t in range(slots):
                x = gx + t * sw + 0.02
                if mode == "sync" and t == slots - 1:
                    continue
                if t not in plan[stage]:
                    _slot(ax, x, y, sw - 0.04, lane_h, "idle", stage, "idle", size=SMALL)
                    continue
                kind, m = plan[stage][t]
                text = f"{kind}{m}"
                if stage == 0:
                    if mode == "stash" and kind == "F":
                        stashed[m] = versions[t]
                        text += f"\nstash W{versions[t]}"
                    elif mode == "stash":
                        text += f"\nW{stashed[m]}"
                    else:
                        text += f"\nW{versions[t]}"
                _slot(ax, x, y, sw - 0.04, lane_h, kind, stage, text, bold=m == 2,
                      size=SMALL)
        if mode == "sync":                    # the optimizer step after the flush
            _box(ax, gx + (slots - 1) * sw + 0.02, l1, sw - 0.04, l0 + lane_h - l1,
                 "optim.\nstep\nW1→W2", face="white", edge=INK, lw=1.4, size=SMALL)
        # the mark on micro-batch 2's backward on stage 0
        b2 = next(t for t, km in plan[0].items() if km == ("B", 2))
        ax.text(gx + (b2 + 1) * sw - 0.06, l0 + lane_h - 0.02,
                "✗" if mode == "async" else "✓", ha="right", va="top", fontsize=FONT + 2,
                fontweight="bold", color=note_color, zorder=5)
        ax.text(gx, l1 - 0.2, note, fontsize=SMALL + 0.5, color=note_color, va="center")
        ax.text(gx, l1 - 0.45, more, fontsize=SMALL + 0.5, color="0.3", va="center")
    # the time axis
    ay = 0.55
    _arrow(ax, (gx, ay), (gx + slots * sw, ay), color="0.35", lw=1.0, mutation=9)
    for t in range(slots):
        ax.text(gx + (t + 0.5) * sw, ay + 0.13, str(t + 1), ha="center", va="center",
                fontsize=SMALL, color="0.3")
    ax.text(gx, ay - 0.22, "time slot →  (schematic: F = forward, B = backward of micro-batch "
            "k, one slot each; bold: micro-batch 2)", fontsize=SMALL, color="0.3",
            va="center")
    return fig


def _lanes(ax, x, w, lanes, texts, *, size=SMALL + 0.5, face_amount=0.3):
    """One box per rank lane at x, in the rank's colour (different on every rank)."""
    for rank, ((y, h), text) in enumerate(zip(lanes, texts)):
        color = RANK_COLORS[rank]
        _box(ax, x, y, w, h, text, face=_tint(color, face_amount), edge=color, lw=1.4,
             size=size)


def _comm(ax, x, w, y, h, text, *, forward=True, size=FONT):
    """A communication op spanning the lanes: yellow when it moves bytes in the forward pass,
    white with a dashed yellow edge when it is the identity forward (it moves bytes backward)."""
    if forward:
        _box(ax, x, y, w, h, text, face=STORE_FACE, edge=STORE_EDGE, lw=1.6, color=STORE_INK,
             size=size)
    else:
        _box(ax, x, y, w, h, text, face="white", edge=STORE_EDGE, lw=1.6, ls="--",
             color=STORE_INK, size=size)


def _tp_block(ax, top, head, lane_heads, cols, texts, in_text, out_text):
    """One tensor-parallel block on 2 ranks: replicated input, norm, f, column-parallel,
    the op in between, row-parallel, g, replicated output. Returns the output box's
    (x, y, w, h)."""
    lane_h, label_h = 0.85, 0.24
    ax.text(cols[1][0], top, head, fontsize=FONT, fontweight="bold", color=INK, va="center")
    y0 = top - 0.2 - label_h - lane_h                 # rank 0's lane bottom
    y1 = y0 - label_h - lane_h                        # rank 1's lane bottom
    lanes = ((y0, lane_h), (y1, lane_h))
    bottom, height = y1, y0 + lane_h - y1
    mid = bottom + height / 2
    x_in, x_norm, x_f, x_col, x_op, x_row, x_g, x_out = cols
    _box(ax, x_in[0], bottom, x_in[1], height, in_text, face=SHARED, size=SMALL + 0.5)
    _box(ax, x_norm[0], bottom, x_norm[1], height, "RMSNorm\n\nthe same\non every\nrank",
         face=SHARED, size=SMALL + 0.5)
    _comm(ax, x_f[0], x_f[1], bottom, height, "f", forward=False, size=FONT + 4)
    _comm(ax, x_g[0], x_g[1], bottom, height, "g", size=FONT + 4)
    _box(ax, x_out[0], bottom, x_out[1], height, out_text, face=SHARED, size=SMALL + 0.5)
    for rank, (y, h) in enumerate(lanes):
        ax.text(x_col[0], y + h + label_h / 2, lane_heads[rank], fontsize=SMALL + 0.5,
                fontweight="bold", color=RANK_COLORS[rank], va="center")
    for (x, w), text in zip((x_col, x_op, x_row), texts):
        _lanes(ax, x, w, lanes, text)
    _arrow(ax, (x_in[0] + x_in[1], mid), (x_norm[0], mid), mutation=10)
    _arrow(ax, (x_norm[0] + x_norm[1], mid), (x_f[0], mid), mutation=10)
    _arrow(ax, (x_g[0] + x_g[1], mid), (x_out[0], mid), mutation=10)
    for y, h in lanes:
        m = y + h / 2
        for (xa, wa), (xb, _) in zip((x_f, x_col, x_op, x_row), (x_col, x_op, x_row, x_g)):
            _arrow(ax, (xa + wa, m), (xb, m), color=INK, mutation=10)
    return x_out[0], bottom, x_out[1], height


def tensor_parallel():
    """Megatron-style tensor parallelism of a transformer layer on 2 ranks."""
    width, height = 10.5, 8.1
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Tensor parallelism (Megatron-LM) on N = 2 ranks: "
           "one transformer layer")
    # (x, width) of: input, norm, f, column-parallel, op, row-parallel, g, output
    cols = ((0.15, 0.95), (1.35, 0.85), (2.45, 0.42), (3.15, 1.65), (5.12, 1.3),
            (6.74, 1.55), (8.6, 0.42), (9.3, 1.05))
    out = _tp_block(
        ax, height - 0.8, "Attention block:  q, k, v column-parallel (each rank computes "
        "H/N of the H heads),  o_proj row-parallel",
        ("rank 0:  heads 0 … H/2−1", "rank 1:  heads H/2 … H−1"), cols,
        (["q, k, v proj\ncolumn-parallel\nW: h × h/N each\n→ [B,S,h/N]"] * 2,
         ["attention\non its H/N\nheads\n→ [B,S,h/N]"] * 2,
         ["o_proj\nrow-parallel\nW: h/N × h\n→ partial [B,S,h]"] * 2),
        "x\n[B,S,h]\n\nthe same\non every\nrank", "[B,S,h]\n\nsummed:\nthe same\non every\n"
        "rank\n\n+ residual")
    mlp_top = height - 3.75
    _tp_block(
        ax, mlp_top, "MLP block:  gate, up column-parallel (h_ff/N output features each),  "
        "down row-parallel (those h_ff/N inputs)",
        ("rank 0:  features 0 … h_ff/2−1", "rank 1:  features h_ff/2 … h_ff−1"), cols,
        (["gate, up proj\ncolumn-parallel\nW: h × h_ff/N each\n→ [B,S,h_ff/N]"] * 2,
         ["SiLU(gate) · up\nelementwise:\nno comm\n→ [B,S,h_ff/N]"] * 2,
         ["down_proj\nrow-parallel\nW: h_ff/N × h\n→ partial [B,S,h]"] * 2),
        "[B,S,h]\n\nthe same\non every\nrank", "[B,S,h]\n\nsummed:\nthe same\non every\n"
        "rank\n\n+ residual")
    # the attention block's output is the MLP block's input
    x, y, w, _ = out
    turn = mlp_top + 0.27
    ax.plot([x + w / 2, x + w / 2], [y, turn], color="0.45", lw=1.1, ls="--")
    ax.plot([x + w / 2, cols[0][0] + cols[0][1] / 2], [turn, turn], color="0.45", lw=1.1,
            ls="--")
    _arrow(ax, (cols[0][0] + cols[0][1] / 2, turn), (cols[0][0] + cols[0][1] / 2,
           mlp_top - 0.44 + 0.0), color="0.45", lw=1.1, ls="--", mutation=10)

    # what f and g do, and what they cost
    ky, kh = 0.55, 1.05
    keys = ((0.15, False, "f  before each block",
             "forward: identity (x is already on every rank)\n"
             "backward: all-reduce, sums the ranks'\ngradients of x  [B,S,h]"),
            (5.3, True, "g  after each block",
             "forward: all-reduce, sums the partial\noutputs  [B,S,h]  (row-parallel: "
             "y = y₀ + y₁)\nbackward: identity (the gradient is replicated)"))
    for x, fwd, head, body in keys:
        _box(ax, x, ky, 5.05, kh, face="white", edge="0.55", round_=0.04)
        _comm(ax, x + 0.15, 0.3, ky + kh - 0.38, 0.26, "", forward=fwd)
        ax.text(x + 0.6, ky + kh - 0.25, head, fontsize=FONT, fontweight="bold",
                va="center", color=INK)
        ax.text(x + 0.15, ky + 0.36, body, fontsize=SMALL + 0.5, va="center", color=INK,
                linespacing=1.3)
    ax.text(width / 2, 0.3, "Per block: exactly one all-reduce of [B,S,h] in the forward (g) "
            "and one in the backward (f); per layer (attention + MLP): 2 + 2", ha="center",
            va="center", fontsize=FONT, color=INK, fontweight="bold")
    ax.text(width / 2, 0.05, "B batch,  S sequence,  h hidden,  h_ff MLP hidden,  H heads,  "
            "N ranks;  W in y = xW.  Grey: the same on every rank;  colour: different per rank",
            ha="center", va="center", fontsize=SMALL + 0.5, color="0.3")
    return fig


def sequence_parallel():
    """Sequence parallelism around a tensor-parallel MLP block on 2 ranks."""
    width, height = 10.5, 6.1
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Sequence parallelism (Korthikanti et al. 2022) around "
           "a tensor-parallel block, N = 2")
    # (x, width) of: input, norm, all-gather, full input, column-par., row-par., reduce-scatter, out
    c_in, c_norm, c_ag, c_full, c_col, c_row, c_rs, c_out = (
        (0.25, 0.95), (1.45, 1.0), (2.72, 0.78), (3.77, 0.95), (5.0, 1.5), (6.77, 1.4),
        (8.44, 0.78), (9.47, 0.88))
    lane_h, label_h = 0.9, 0.24
    region_top = height - 0.75
    y0 = region_top - 0.55 - label_h - lane_h
    y1 = y0 - label_h - lane_h
    lanes = ((y0, lane_h), (y1, lane_h))
    bottom, span = y1, y0 + lane_h - y1
    mid = bottom + span / 2
    # the regions: split along the sequence outside, tensor-parallel inside
    reg_bottom = bottom - 0.75
    for (xa, _), (xb, wb), label in (
            (c_in, c_norm, "sequence-parallel region:\n[B,S/N,h] per rank, split along S"),
            (c_full, c_row, "tensor-parallel region (as without SP):\nweights split, "
             "input on every rank"),
            (c_out, c_out, "sequence-\nparallel")):
        _box(ax, xa - 0.1, reg_bottom, xb + wb - xa + 0.2, region_top - reg_bottom,
             face="0.965", edge="0.7", round_=0.08, zorder=0)
        ax.text((xa + xb + wb) / 2, region_top - 0.27, label, ha="center", va="center",
                fontsize=SMALL + 0.5, color="0.3", linespacing=1.25)
    tokens = ("tokens 0 … S/2−1", "tokens S/2 … S−1")
    for rank, (y, h) in enumerate(lanes):
        color = RANK_COLORS[rank]
        ax.text(c_in[0], y + h + label_h / 2, f"rank {rank}:  {tokens[rank]}",
                fontsize=SMALL + 0.5, fontweight="bold", color=color, va="center")
        ax.text(c_col[0], y + h + label_h / 2, f"rank {rank}:  {('first', 'second')[rank]} "
                "h_ff/N features", fontsize=SMALL + 0.5, fontweight="bold", color=color,
                va="center")
    _lanes(ax, *c_in, lanes, [f"x\n[B,S/N,h]\n{t.split(' ', 1)[1]}" for t in tokens])
    _lanes(ax, *c_norm, lanes, ["RMSNorm\non its S/N\ntokens"] * 2)
    _comm(ax, *c_ag, bottom, span, "all-\ngather\nalong S")
    _box(ax, *c_full[:1], bottom, c_full[1], span, "[B,S,h]\n\nall S\ntokens,\nthe same\n"
         "on every\nrank", face=SHARED, size=SMALL + 0.5)
    _lanes(ax, *c_col, lanes, ["gate, up proj\ncolumn-parallel\n+ SiLU(gate) · up\n"
                               "→ [B,S,h_ff/N]"] * 2)
    _lanes(ax, *c_row, lanes, ["down_proj\nrow-parallel\n→ partial\n[B,S,h]"] * 2)
    _comm(ax, *c_rs, bottom, span, "reduce-\nscatter\nalong S")
    _lanes(ax, *c_out, lanes, ["[B,S/N,h]\ndropout\n+ residual"] * 2)
    _arrow(ax, (c_ag[0] + c_ag[1], mid), (c_full[0], mid), mutation=10)
    for y, h in lanes:
        m = y + h / 2
        for (xa, wa), (xb, _) in ((c_in, c_norm), (c_norm, c_ag), (c_full, c_col),
                                  (c_col, c_row), (c_row, c_rs), (c_rs, c_out)):
            _arrow(ax, (xa + wa, m), (xb, m), mutation=10)
    notes = (((c_in[0], c_norm[0] + c_norm[1] - c_in[0]),
              "norm, dropout: token by token,\nso no communication"),
             (c_ag, "replaces f\n(backward:\nreduce-scatter)"),
             (c_rs, "replaces g\n(backward:\nall-gather)"))
    for (x, w), text in notes:
        ax.text(x + w / 2, bottom - 0.1, text, ha="center", va="top", fontsize=SMALL,
                color=STORE_INK if text.startswith("repl") else "0.3", linespacing=1.25)

    # what it costs and what it saves
    ky, kh = 0.15, 1.25
    keys = ((0.15, "Communication: the same bytes",
             "TP: g all-reduces [B,S,h] (M bytes): a ring sends\n"
             "2(N−1)/N · M per rank. TP + SP: a reduce-scatter\n"
             "and an all-gather, (N−1)/N · M each: the same sum,\n"
             "since an all-reduce = reduce-scatter + all-gather"),
            (5.35, "Activations outside the TP region: 1/N",
             "TP: the norm, dropout and residual inputs are\n"
             "[B,S,h], a full copy on every rank.\n"
             "TP + SP: [B,S/N,h] per rank, split along the\n"
             "sequence: 1/N of the memory each"))
    for x, head, body in keys:
        _box(ax, x, ky, 5.0, kh, face="white", edge="0.55", round_=0.04)
        ax.text(x + 0.15, ky + kh - 0.22, head, fontsize=FONT, fontweight="bold",
                va="center", color=INK)
        ax.text(x + 0.15, ky + 0.5, body, fontsize=SMALL + 0.5, va="center", color=INK,
                linespacing=1.3)
    return fig


def _layer_column(ax, x, y, w, layers, rank, *, face=None, text="layer {}"):
    """A stack of layer boxes, layer 0 at the bottom; `layers` = which layers (None: a gap)."""
    h, gap = 0.3, 0.07
    color = RANK_COLORS[rank]
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        _box(ax, x, y + i * (h + gap), w, h, text.format(layer), size=SMALL,
             face=face or _tint(color, 0.35), edge=INK if face else color, lw=1.2, round_=0.04)
    return [y + i * (h + gap) for i in range(len(layers))], h


def parallelisms():
    """What DP, PP and TP each split, and how they combine on a 2 x 2 x 2 device mesh."""
    width, height = 10.5, 8.8
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Three ways to split training over ranks, "
           "and how they combine")
    # --- top: one panel per technique, each on 2 ranks --------------------------------------
    pw, ph, ptop = 3.3, 4.4, height - 0.65
    col_w, stack_y = 0.95, ptop - 2.2
    panels = (
        ("Data parallel (DP)", "the batch", "the whole model\n(grey: the same on both)",
         "all-reduce of gradients,\nonce per step, during\nthe backward"),
        ("Pipeline parallel (PP)", "the layers, into stages", "its consecutive layers",
         "send/recv of activations\nand of their gradients,\nneighbouring stages only"),
        ("Tensor parallel (TP)", "each layer's weights", "a slice of every layer",
         "all-reduce of activations\nin every block, both ways:\nthe most traffic"))
    for p, (head, splits, holds, comm) in enumerate(panels):
        px = 0.15 + p * (pw + 0.15)
        _box(ax, px, ptop - ph, pw, ph, face="white", edge="0.55", round_=0.06, zorder=0)
        ax.text(px + pw / 2, ptop - 0.25, head, ha="center", va="center", fontsize=FONT + 1,
                fontweight="bold", color=INK)
        x0, x1 = px + 0.2, px + pw - 0.2 - col_w
        gap_x, gap_w = x0 + col_w + 0.08, x1 - x0 - col_w - 0.16   # between the columns
        for rank, x in enumerate((x0, x1)):
            ax.text(x + col_w / 2, stack_y + 1.62, f"rank {rank}", ha="center", va="center",
                    fontsize=SMALL + 0.5, fontweight="bold", color=RANK_COLORS[rank])
        feed_y = stack_y - 0.5
        if p == 0:     # DP: the same 4 layers on both ranks, half of the batch each
            for rank, x in enumerate((x0, x1)):
                _layer_column(ax, x, stack_y, col_w, range(4), rank, face=SHARED)
                _box(ax, x, feed_y, col_w, 0.32, f"batch half {rank}", size=SMALL,
                     face=_tint(RANK_COLORS[rank], 0.35), edge=RANK_COLORS[rank], round_=0.04)
                _arrow(ax, (x + col_w / 2, feed_y + 0.32), (x + col_w / 2, stack_y),
                       mutation=9)
            _comm(ax, gap_x + 0.05, gap_w - 0.1, stack_y, 1.41, "all-\nreduce\ngrads",
                  size=SMALL)
        elif p == 1:   # PP: layers 0-1 on rank 0, layers 2-3 on rank 1
            ys, h = _layer_column(ax, x0, stack_y, col_w, (0, 1, None, None), 0)
            _layer_column(ax, x1, stack_y, col_w, (None, None, 2, 3), 1)
            _box(ax, x0, feed_y, col_w, 0.32, "micro-batches", size=SMALL, face=SHARED,
                 round_=0.04)
            _arrow(ax, (x0 + col_w / 2, feed_y + 0.32), (x0 + col_w / 2, stack_y), mutation=9)
            _arrow(ax, (x0 + col_w + 0.05, ys[1] + h / 2), (x1 - 0.05, ys[2] + h / 2),
                   style="<|-|>", color=INK, lw=1.6, mutation=11)
            ax.text(gap_x + gap_w / 2, ys[1] - 0.08, "send/recv", ha="center", va="center",
                    fontsize=SMALL, color=INK)
        else:          # TP: half of every layer on each rank, an all-reduce per block
            for rank, x in enumerate((x0, x1)):
                ys, h = _layer_column(ax, x, stack_y, col_w, range(4), rank,
                                      text="½ of layer {}")
            for y in ys:
                _comm(ax, gap_x, gap_w, y + 0.02, h - 0.04, "all-reduce", size=SMALL)
            _box(ax, x0, feed_y, x1 + col_w - x0, 0.32, "the whole batch, on both ranks",
                 size=SMALL, face=SHARED, round_=0.04)
            for x in (x0, x1):
                _arrow(ax, (x + col_w / 2, feed_y + 0.32), (x + col_w / 2, stack_y),
                       mutation=9)
        ty = feed_y - 0.22
        for label, text in (("splits:", splits), ("each rank:", holds), ("talks:", comm)):
            ax.text(px + 0.15, ty, label, fontsize=SMALL + 0.5, fontweight="bold", va="top",
                    color=INK)
            ax.text(px + 1.05, ty, text, fontsize=SMALL + 0.5, va="top", color=INK,
                    linespacing=1.25)
            ty -= 0.2 * (text.count("\n") + 1) + 0.1
    # --- bottom: 8 ranks on a (pp, dp, tp) = (2, 2, 2) mesh -------------------------------
    mtop = ptop - ph - 0.3
    ax.text(0.15, mtop - 0.1, "Combined: 8 ranks on a 2 (PP) × 2 (DP) × 2 (TP) device mesh,  "
            "rank = 4·pp + 2·dp + tp", fontsize=FONT + 1, fontweight="bold", color=INK,
            va="center")
    cell_w, cell_h, pad = 0.7, 0.4, 0.08
    pill_w, pill_h, stage_w, stage_h = 2 * cell_w + 3 * pad, cell_h + 2 * pad, 2.5, 2.2
    stage_x = (0.15, 0.15 + stage_w + 0.85)
    stage_y = mtop - 0.4 - stage_h
    cells, pills = {}, {}
    for pp, sx in enumerate(stage_x):
        _box(ax, sx, stage_y, stage_w, stage_h, face="0.97", edge="0.55", round_=0.08, zorder=0)
        ax.text(sx + stage_w / 2, stage_y + stage_h - 0.22,
                f"pp = {pp}: layers {('0 … L/2−1', 'L/2 … L−1')[pp]}", ha="center",
                va="center", fontsize=SMALL + 0.5, fontweight="bold", color=INK)
        # the pills face each other across the gap between the stages, the labels outside
        qx = sx + stage_w - pill_w - 0.12 if pp == 0 else sx + 0.12
        lx = sx + 0.12 if pp == 0 else qx + pill_w + 0.12
        for dp in range(2):
            py = stage_y + stage_h - 0.5 - pill_h - dp * (pill_h + 0.45)
            ax.text(lx, py + pill_h / 2, f"dp = {dp}\nbatch\nhalf {dp}", fontsize=SMALL,
                    va="center", color="0.3", linespacing=1.15)
            _box(ax, qx, py, pill_w, pill_h, face=STORE_FACE, edge=STORE_EDGE, lw=1.2,
                 round_=0.1)
            pills[pp, dp] = (qx, py)
            for tp in range(2):
                rank = 4 * pp + 2 * dp + tp
                cx = qx + pad + tp * (cell_w + pad)
                _box(ax, cx, py + pad, cell_w, cell_h, f"rank {rank}", size=SMALL + 0.5,
                     face="white", edge=INK, lw=1.0, round_=0.04, zorder=2)
                cells[rank] = (cx, py + pad)
    # DP: matching ranks of the two replicas all-reduce gradients (vertical arrows);
    # PP: matching ranks of the two stages send/recv (horizontal arrows)
    for rank in (0, 1, 4, 5):
        (x, y), (_, y2) = cells[rank], cells[rank + 2]
        _arrow(ax, (x + cell_w / 2, y - pad - 0.02), (x + cell_w / 2, y2 + cell_h + pad + 0.02),
               style="<|-|>", color=STORE_EDGE, lw=1.4, mutation=9)
    for dp in range(2):
        (qx0, py), (qx1, _) = pills[0, dp], pills[1, dp]
        _arrow(ax, (qx0 + pill_w + 0.02, py + pill_h / 2), (qx1 - 0.02, py + pill_h / 2),
               style="<|-|>", color=INK, lw=1.4, mutation=9)
        ax.text((qx0 + pill_w + qx1) / 2, py + pill_h / 2 + 0.16, "send/recv", ha="center",
                va="center", fontsize=SMALL, color=INK)
    # the legend: which ranks form each group, what it splits, what it sends
    lx, ly = stage_x[1] + stage_w + 0.35, mtop - 0.55
    groups = (
        ("tp", "tp, innermost: {0,1} {2,3} {4,5} {6,7}",
         "splits each layer's weights; an all-reduce in\nevery block: neighbouring ranks, "
         "one node,\nthe fastest links (NVLink)"),
        ("dp", "dp: {0,2} {1,3} {4,6} {5,7}",
         "splits the batch; all-reduce of gradients once\nper step (FSDP: all-gather + "
         "reduce-scatter)"),
        ("pp", "pp, outermost: {0,4} {1,5} {2,6} {3,7}",
         "splits the layers; point-to-point send/recv of\nboundary activations and their "
         "gradients:\nlittle data, fine across nodes"))
    for kind, head, body in groups:
        if kind == "tp":
            _box(ax, lx, ly - 0.1, 0.26, 0.2, face=STORE_FACE, edge=STORE_EDGE, lw=1.2,
                 round_=0.05)
        elif kind == "dp":
            _arrow(ax, (lx + 0.13, ly - 0.13), (lx + 0.13, ly + 0.13), style="<|-|>",
                   color=STORE_EDGE, lw=1.4, mutation=8)
        else:
            _arrow(ax, (lx, ly), (lx + 0.26, ly), style="<|-|>", color=INK, lw=1.4,
                   mutation=8)
        ax.text(lx + 0.38, ly, head, fontsize=SMALL + 0.5, fontweight="bold", va="center",
                color=INK)
        ax.text(lx + 0.38, ly - 0.17, body, fontsize=SMALL + 0.5, va="top", color=INK,
                linespacing=1.25)
        ly -= 0.36 + 0.19 * (body.count("\n") + 1)
    ax.text(0.15, stage_y - 0.28, 'init_device_mesh("cuda", (2, 2, 2), '
            'mesh_dim_names=("pp", "dp", "tp"))', fontsize=SMALL, family=MONO, va="center",
            color=INK)
    ax.text(0.15, stage_y - 0.56, "Dimension order as in torchtitan and Megatron-LM: TP "
            "innermost (its all-reduces stay inside a node), PP outermost, DP in between.",
            fontsize=SMALL + 0.5, va="center", color="0.3")
    return fig

# --- chapter 03: ZeRO memory math ---------------------------------------------------------

# float_formats: sign, exponent and mantissa bits
FIELD_COLORS = {"sign": "#c0504d", "exponent": "#4f8a3c", "mantissa": "#4a72a8"}


def _state_bar(ax, x, y, w, h, rank, n, stage, recipe):
    """One rank's model states as a bar, bytes to scale: where a state is sharded, a faint
    dashed outline of the whole and the rank's 1/n slice filled."""
    parts = (("params", recipe.param, f"{recipe.param}Ψ", 3),
             ("grads", recipe.grad, f"{recipe.grad}Ψ", 2),
             ("optimizer", recipe.optimizer, "KΨ", 1))      # sharded from that stage on
    gap = 0.05
    unit = (w - gap * (len(parts) - 1)) / recipe.total
    for key, nbytes, text, from_stage in parts:
        color, sw = STATE_COLORS[key], nbytes * unit
        if stage < from_stage:      # replicated: the whole state on this rank
            ax.add_patch(Rectangle((x, y), sw, h, facecolor=_tint(color, 0.45),
                                   edgecolor=color, linewidth=1.0, zorder=2))
            ax.text(x + sw / 2, y + h / 2, text, ha="center", va="center", fontsize=SMALL,
                    color=INK, zorder=3)
        else:                       # sharded: 1/n of it, slice `rank`
            ax.add_patch(Rectangle((x, y), sw, h, facecolor="white",
                                   edgecolor=_tint(color, 0.5), linewidth=0.9,
                                   linestyle=(0, (3, 2)), zorder=1))
            for i in range(1, n):
                ax.plot([x + i * sw / n] * 2, [y, y + h], color=_tint(color, 0.35), lw=0.6,
                        ls=(0, (2, 2)), zorder=1)
            ax.add_patch(Rectangle((x + rank * sw / n, y), sw / n, h,
                                   facecolor=_tint(color, 0.45), edgecolor=color,
                                   linewidth=1.0, zorder=2))
            if sw / n > 0.5:
                ax.text(x + (rank + 0.5) * sw / n, y + h / 2, f"{text}/N", ha="center",
                        va="center", fontsize=SMALL, color=INK, zorder=3)
        x += sw + gap


def _text_width(ax, text_artist) -> float:
    """The width of a drawn text, in inches (the data units of a `_canvas`)."""
    fig = ax.figure
    return text_artist.get_window_extent(fig.canvas.get_renderer()).width / fig.dpi


def zero_stages(n: int = 4, psi: float = 7.5e9, paper_n: int = 64):
    """The ZeRO paper's Figure 1 redrawn: per-rank model states under DDP and ZeRO stages 1-3."""
    recipe = MIXED_ADAMW
    width = 10.5
    bar_h, bar_gap, pad = 0.22, 0.08, 0.14
    block_h = n * bar_h + (n - 1) * bar_gap + 2 * pad
    block_gap = 0.14
    height = 2.0 + 4 * block_h + 3 * block_gap + 0.5
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, f"ZeRO: what each of N = {n} data-parallel ranks "
           "keeps of the model states (ZeRO paper, Figure 1)")
    # the legend: one swatch per state, with its bytes per parameter
    ly = height - 0.78
    legend = ((STATE_COLORS["params"], f"parameters (fp16): {recipe.param}Ψ bytes"),
              (STATE_COLORS["grads"], f"gradients (fp16): {recipe.grad}Ψ"),
              (STATE_COLORS["optimizer"], "optimizer states (fp32): KΨ"),
              (None, "sharded: held by other ranks"))
    lx = 0.2
    for color, text in legend:
        if color is None:
            ax.add_patch(Rectangle((lx, ly - 0.09), 0.3, 0.18, facecolor="white",
                                   edgecolor="0.55", linewidth=0.9, linestyle=(0, (3, 2))))
        else:
            ax.add_patch(Rectangle((lx, ly - 0.09), 0.3, 0.18, facecolor=_tint(color, 0.45),
                                   edgecolor=color, linewidth=1.0))
        t = ax.text(lx + 0.4, ly, text, fontsize=FONT, va="center", color=INK)
        lx += 0.4 + _text_width(ax, t) + 0.45
    ax.text(0.2, ly - 0.33, f"Ψ: number of parameters.  K = {recipe.optimizer} bytes per "
            "parameter in mixed-precision Adam: fp32 master weights 4 + momentum 4 + variance 4.",
            fontsize=SMALL + 0.5, va="center", color="0.3")
    ax.text(0.2, ly - 0.56, f"Bars: bytes per rank for N = {n}, to scale.  Sharded: "
            "each rank keeps 1/N of the state, rank r the slice r (the filled one).",
            fontsize=SMALL + 0.5, va="center", color="0.3")

    bar_x, bar_w = 2.4, 5.05
    fx = bar_x + bar_w + 0.35                   # the formula column
    top = height - 1.72
    ax.text(fx, top + 0.1, f"per rank, Ψ = {psi / 1e9:g} B, N = {paper_n}",
            fontsize=FONT, fontweight="bold", va="center", color=INK)
    heads = (("DDP", "baseline"), ("ZeRO-1", "$P_{os}$"), ("ZeRO-2", "$P_{os+g}$"),
             ("ZeRO-3", "$P_{os+g+p}$"))             # the paper's names
    formulas = ("(2 + 2 + K) Ψ", "2Ψ + 2Ψ + KΨ / N", "2Ψ + (2 + K) Ψ / N",
                "(2 + 2 + K) Ψ / N")                  # section 5.1, per rank
    ddp_total = model_state_bytes(psi, paper_n, 0, recipe)["total"]
    for stage in range(4):
        by = top - 0.1 - (stage + 1) * block_h - stage * block_gap
        _box(ax, 0.15, by, width - 0.3, block_h, face="0.975", edge="0.6", round_=0.06,
             zorder=0)
        what = STAGES[stage].split(": ", 1)[-1] if stage else "no sharding"
        head, paper = heads[stage]
        ax.text(0.3, by + block_h - 0.28, head, fontsize=FONT + 2, fontweight="bold",
                va="center", color=INK)
        ax.text(0.3, by + block_h - 0.56, paper, fontsize=FONT, va="center", color=INK)
        ax.text(0.3, by + block_h - 0.76, what.replace(" sharded", "\nsharded"),
                fontsize=SMALL + 0.5, va="top", color="0.3", linespacing=1.2)
        for rank in range(n):
            y = by + block_h - pad - bar_h - rank * (bar_h + bar_gap)
            ax.text(bar_x - 0.1, y + bar_h / 2, f"rank {rank}", ha="right", va="center",
                    fontsize=SMALL + 0.5, fontweight="bold", color=RANK_COLORS[rank])
            _state_bar(ax, bar_x, y, bar_w, bar_h, rank, n, stage, recipe)
        b = model_state_bytes(psi, paper_n, stage, recipe)
        mid = by + block_h / 2
        ax.text(fx, mid + 0.3, formulas[stage], fontsize=FONT + 0.5, va="center", color=INK)
        ax.text(fx, mid, f"= {b['total'] / GB:.3g} GB", fontsize=FONT + 4, fontweight="bold",
                va="center", color=INK)
        parts = " + ".join(f"{b[k] / GB:.3g}" for k in ("params", "grads", "optimizer"))
        ax.text(fx, mid - 0.28, f"= {parts}", fontsize=SMALL + 0.5, va="center", color="0.3")
        if stage:
            ax.text(fx, mid - 0.48, f"{ddp_total / b['total']:.3g}× less than DDP",
                    fontsize=SMALL + 0.5, va="center", color="0.3")
    comm = [communication_bytes(psi, paper_n, s) / communication_bytes(psi, paper_n, 0)
            for s in range(4)]
    same = " and ".join(f"ZeRO-{s}" for s in range(1, 4) if comm[s] == 1)
    ax.text(0.2, 0.22, f"Activations, buffers and fragmentation come on top.  Communication "
            f"per step: {same} send what DDP sends, ZeRO-3 {comm[3]:g}×.",
            fontsize=SMALL + 0.5, va="center", color="0.3")
    return fig


def _float_bits(value, dtype):
    """The bits of `value` stored as `dtype` (a string of 0/1, sign first) and the value kept."""
    import torch

    t = torch.tensor(value, dtype=torch.float64).to(dtype)
    bits = torch.finfo(dtype).bits
    raw = int(t.view(torch.int32 if bits == 32 else torch.int16).item()) % (1 << bits)
    return format(raw, f"0{bits}b"), t.item()


def _power(value: float) -> str:
    """A value as mathtext m × 10^e (3 significant figures), or as an integer if it is one."""
    if value == int(value) and value < 1e6:
        return f"{int(value)}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"${mantissa} \\times 10^{{{int(exponent)}}}$"


def _short(value: float) -> str:
    """4 significant figures, exponents without a leading zero: 1e-8, 1.001e-8, 0."""
    return f"{value:.4g}".replace("e-0", "e-").replace("e+0", "e+")


def float_formats():
    """fp32, fp16 and bf16: bit layouts, ranges and precision (from torch.finfo)."""
    import torch  # here, not at the top: the other diagrams do not need it

    formats = (("fp32", torch.float32, "IEEE single"), ("fp16", torch.float16, "IEEE half"),
               ("bf16", torch.bfloat16, "brain float"))
    info = {}
    for name, dtype, _ in formats:
        f = torch.finfo(dtype)
        mant = round(-math.log2(f.eps))                 # eps = 2^-(mantissa bits)
        info[name] = dict(bits=f.bits, mant=mant, exp=f.bits - 1 - mant, max=f.max,
                          normal=f.smallest_normal, sub=f.tiny * f.eps, eps=f.eps,
                          digits=math.log10(2 / f.eps))  # (mantissa + 1) bits, in decimal
    width, height = 10.5, 9.0
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "fp32, fp16 and bf16: where the bits go, "
           "and what range and precision that buys")

    # the bit layouts, with the bits of π in each format
    bx, bw, bgap, bh = 1.55, 0.19, 0.025, 0.34
    value_x = bx + 32 * (bw + bgap) + 0.3
    row_top = height - 0.95
    ax.text(bx, row_top + 0.12, "the bits of π = 3.14159265… rounded to each format",
            fontsize=SMALL + 0.5, va="center", color="0.3")
    ax.text(value_x, row_top + 0.12, "value kept", fontsize=SMALL + 0.5, va="center",
            color="0.3")
    for i, (name, dtype, long) in enumerate(formats):
        d = info[name]
        y = row_top - bh - 0.08 - i * 0.9
        ax.text(0.2, y + bh / 2 + 0.08, name, fontsize=FONT + 3, fontweight="bold",
                va="center", color=INK)
        ax.text(0.2, y + bh / 2 - 0.19, long, fontsize=SMALL, va="center", color="0.3")
        bits, kept = _float_bits(math.pi, dtype)
        fields = ["sign"] + ["exponent"] * d["exp"] + ["mantissa"] * d["mant"]
        for k, (bit, field) in enumerate(zip(bits, fields)):
            color = FIELD_COLORS[field]
            x = bx + k * (bw + bgap)
            ax.add_patch(Rectangle((x, y), bw, bh, facecolor=_tint(color, 0.35),
                                   edgecolor=color, linewidth=0.9))
            ax.text(x + bw / 2, y + bh / 2, bit, ha="center", va="center", fontsize=SMALL,
                    family=MONO, color=INK)
        spans = (("sign", 0, 1), (f"exponent: {d['exp']} bits", 1, 1 + d["exp"]),
                 (f"mantissa: {d['mant']} bits", 1 + d["exp"], d["bits"]))
        for (text, a, b), field in zip(spans, FIELD_COLORS):
            x0, x1 = bx + a * (bw + bgap), bx + b * (bw + bgap) - bgap
            ax.plot([x0, x0, x1, x1], [y - 0.04, y - 0.09, y - 0.09, y - 0.04],
                    color=FIELD_COLORS[field], lw=1.0)
            ax.text((x0 + x1) / 2 if a else x1, y - 0.22, text, ha="center" if a else "right",
                    va="center", fontsize=SMALL, color=FIELD_COLORS[field])
        ax.text(value_x, y + bh / 2, f"{kept:.9g}", fontsize=FONT, family=MONO, va="center",
                color=INK)
    ax.text(bx + 16 * (bw + bgap) + 0.15, row_top - bh - 0.08 - 2 * 0.9 + bh / 2,
            "= fp32's first 16 bits, rounded", fontsize=SMALL + 0.5, va="center", color="0.3")

    # the numbers, from torch.finfo
    ty = row_top - 3 * 0.9 - 0.25
    cols = ((1.55, "largest finite", "finfo.max"),
            (3.55, "smallest normal", "finfo.smallest_normal"),
            (5.75, "smallest subnormal", "finfo.tiny × finfo.eps"),
            (7.85, "precision", "finfo.eps; digits: log₁₀(2/eps)"))
    for x, head, source in cols:
        ax.text(x, ty, head, fontsize=FONT, fontweight="bold", va="center", color=INK)
        ax.text(x, ty - 0.21, source, fontsize=SMALL, family=MONO, va="center", color="0.35")
    ax.plot([0.2, width - 0.2], [ty - 0.37, ty - 0.37], color="0.6", lw=0.8)
    for i, (name, _, _) in enumerate(formats):
        d = info[name]
        y = ty - 0.6 - i * 0.3
        ax.text(0.2, y, name, fontsize=FONT, fontweight="bold", va="center", color=INK)
        values = (_power(d["max"]), _power(d["normal"]), _power(d["sub"]),
                  f"$2^{{-{d['mant']}}}$ = {_power(d['eps'])}:  {d['digits']:.1f} digits")
        for (x, _, _), text in zip(cols, values):
            ax.text(x, y, text, fontsize=FONT, va="center", color=INK)

    # the ranges on a log axis: fp16's is narrow, bf16's is fp32's
    lo, hi = -46, 40
    ax_x0, ax_x1 = 1.55, width - 0.35
    to_x = lambda v: ax_x0 + (math.log10(v) - lo) / (hi - lo) * (ax_x1 - ax_x0)  # noqa: E731
    ry = ty - 2.35
    ax.text(0.2, ry + 0.55, "Range of positive values, set by the exponent bits (log scale): "
            " light = subnormal (fewer significant bits),  dark = normal", fontsize=FONT,
            fontweight="bold", va="center", color=INK)
    grad = 1e-8
    color = FIELD_COLORS["exponent"]
    for i, (name, dtype, _) in enumerate(formats):
        d = info[name]
        y = ry - i * 0.36
        ax.text(0.2, y, name, fontsize=FONT, fontweight="bold", va="center", color=INK)
        ax.add_patch(Rectangle((to_x(d["sub"]), y - 0.1), to_x(d["normal"]) - to_x(d["sub"]),
                               0.2, facecolor=_tint(color, 0.25), edgecolor="none"))
        ax.add_patch(Rectangle((to_x(d["normal"]), y - 0.1), to_x(d["max"]) - to_x(d["normal"]),
                               0.2, facecolor=_tint(color, 0.7), edgecolor="none"))
        kept = torch.tensor(grad).to(dtype).item()
        ax.text(to_x(grad) - 0.1, y, f"1e-8 → {_short(kept)}", fontsize=SMALL + 0.5,
                va="center", ha="right", color=RIGHT if kept else WRONG, fontweight="bold",
                zorder=5, bbox=dict(boxstyle="round,pad=0.15", facecolor="white",
                                    edgecolor="none"))
        if name == "fp16":
            ax.text(to_x(d["max"]) + 0.08, y, f"max {d['max']:.0f}", fontsize=SMALL,
                    va="center", color="0.3")
    base = ry - 2 * 0.36 - 0.3
    ax.plot([ax_x0, ax_x1], [base, base], color="0.35", lw=1.0)
    for e in range(-40, hi + 1, 10):
        ax.plot([to_x(10.0 ** e)] * 2, [base, base - 0.06], color="0.35", lw=1.0)
        ax.text(to_x(10.0 ** e), base - 0.22, f"$10^{{{e}}}$", ha="center", va="center",
                fontsize=SMALL + 0.5, color="0.3")
    ax.plot([to_x(grad)] * 2, [base, ry + 0.2], color=WRONG, lw=1.2, ls=(0, (4, 2)), zorder=4)
    ax.text(to_x(grad), ry + 0.24, "a gradient of 1e-8", ha="center", va="bottom",
            fontsize=SMALL + 0.5, color=WRONG)

    # the point of the chapter, checked: fp16 rounds 1e-8 to 0, bf16 keeps it
    tiny_grad = torch.tensor(grad)
    assert tiny_grad.half() == 0 and tiny_grad.bfloat16() != 0, "the annotation no longer holds"
    sub = _short(float(f"{info['fp16']['sub']:.0e}"))
    scale = 2 ** 16
    back = (torch.tensor(grad) * scale).half().float().item() / scale
    _box(ax, 0.15, 0.12, width - 0.3, 1.0, face=STORE_FACE, edge=STORE_EDGE, round_=0.06)
    ax.text(width / 2, 0.86, "bf16 keeps fp32's exponent range: gradients of 1e-8 survive; "
            f"fp16 stops at ~{sub} and rounds them to 0, hence loss scaling",
            ha="center", va="center", fontsize=FONT + 0.5, fontweight="bold", color=INK)
    normal = _short(float(f"{torch.finfo(torch.float16).smallest_normal:.1e}"))
    ax.text(width / 2, 0.44, "loss scaling (torch.amp.GradScaler): multiply the loss by S (2¹⁶ to "
            f"start) to lift backward's fp16 values into the normal range (> {normal});\nthen "
            f"divide the gradients by S before the step.  1e-8 × 2¹⁶ in fp16, divided back by 2¹⁶: "
            f"{_short(back)}", ha="center", va="center", fontsize=SMALL + 0.5, color="0.25",
            linespacing=1.4)
    return fig


# --- chapter 04: FSDP2 --------------------------------------------------------------------

def _life_bar(ax, x0, x1, y, h, text, *, face, edge, ls="-", lw=1.0, color=INK):
    """One buffer's lifetime in a memory row: a bar from x0 to x1 (dashed: optional)."""
    _box(ax, x0, y, x1 - x0, h, text, face=face, edge=edge, ls=ls, lw=lw, size=SMALL,
         color=color, round_=0.03, zorder=2)


def fsdp_unit_life(n: int = 2):
    """One FSDP2 unit (a decoder layer under fully_shard) through one training step on n ranks:
    the collectives, the compute, and which of its buffers exist when (torch 2.13's
    FSDPParamGroup.pre_forward / post_forward / pre_backward / post_backward)."""
    width, height = 10.5, 8.95
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, f"FSDP2 on N = {n} ranks: the life of one unit "
           "(decoder layer i under fully_shard) in one training step")
    # the columns of the timeline: (header, FSDP hook or what runs, width)
    cols = (("at rest", "", 0.6), ("pre-forward", "pre_forward", 1.0),
            ("forward", "", 0.86), ("post-forward", "post_forward", 1.02),
            ("other layers", "", 1.34), ("pre-backward", "pre_backward", 1.06),
            ("backward", "", 0.92), ("post-backward", "post_backward", 1.14),
            ("step", "", 0.8))
    left = 1.55
    xs = [left]
    for _, _, w in cols:
        xs.append(xs[-1] + w)
    x_of = lambda c, f=0.0: xs[c] + f * cols[c][2]  # noqa: E731  (f: fraction of column c)
    REST, AG1, FWD, RS1, GAP, AG2, BWD, RS2, STEP = range(len(cols))
    right = xs[-1]

    # headers: the phase, and the FSDPParamGroup method that runs it
    hy = height - 0.78
    for c, (head, hook, _) in enumerate(cols):
        ax.text(x_of(c, 0.5), hy, head, ha="center", va="center", fontsize=SMALL + 0.5,
                fontweight="bold", color=INK)
        if hook:
            ax.text(x_of(c, 0.5), hy - 0.24, hook, ha="center", va="center", fontsize=SMALL,
                    family=MONO, color="0.35")
    ax.text(left - 0.12, hy - 0.24, "FSDP hook", ha="right", va="center", fontsize=SMALL,
            color="0.35")

    # lane 1: communication (one collective over both ranks)
    cy, ch = height - 1.95, 0.8
    ky, kh = cy - 0.1 - 0.6, 0.6                     # lane 2: compute
    ax.text(0.2, cy + ch / 2, "communication\n(in, out: per rank)", va="center", fontsize=FONT,
            fontweight="bold", color=INK, linespacing=1.25)
    ax.text(0.2, ky + kh / 2, "compute", va="center", fontsize=FONT, fontweight="bold",
            color=INK)
    pad = 0.05
    for c, text in ((AG1, "all-gather\nin: P/N\nout: P"),
                    (AG2, "all-gather\nin: P/N\nout: P"),
                    (RS2, "reduce-scatter\nin: P\nout: P/N, mean")):
        _comm(ax, x_of(c) + pad, cols[c][2] - 2 * pad, cy, ch, text, size=SMALL)
    # the backward all-gather is issued early: by layer i+1's pre_backward (prefetch)
    ax.text(x_of(GAP, 0.5), cy + ch / 2 + 0.12, "prefetched by\nlayer i+1's\n"
            "pre_backward", ha="center", va="center", fontsize=SMALL,
            color=STORE_INK, linespacing=1.25)
    _arrow(ax, (x_of(GAP, 0.1), cy + 0.1), (x_of(AG2) + pad, cy + 0.1), color=STORE_INK,
           lw=1.2, mutation=10)
    for c, text in ((FWD, "forward\nlayer i"), (BWD, "backward\nlayer i"),
                    (STEP, "optim.\nstep()")):
        _box(ax, x_of(c) + pad, ky, cols[c][2] - 2 * pad, kh, text,
             face="white", edge=INK, lw=1.4, size=SMALL + 0.5, round_=0.04)
    _box(ax, x_of(GAP) + pad, ky, cols[GAP][2] - 2 * pad, kh,
         "layers after i:\nforward, loss,\ntheir backward", face="white", edge=FAINT,
         ls="--", color="0.4", size=SMALL, round_=0.04)
    for c in (RS1, RS2):
        _box(ax, x_of(c) + pad, ky, cols[c][2] - 2 * pad, kh,
             "reshard:\nfree full\nparams", face="white", edge=FAINT, ls="--",
             color="0.3", size=SMALL, round_=0.04)

    # memory, per rank: one row per buffer of the unit, a bar while it exists
    rows = ("param shard  P/N", "full params  P", "full grads  P", "grad shard  P/N")
    row_h, row_gap, head_h = 0.27, 0.08, 0.36
    region_h = head_h + len(rows) * (row_h + row_gap) + 0.08
    params, grads = STATE_COLORS["params"], STATE_COLORS["grads"]
    halves = (f"rows 0 … d/{n}−1", f"rows d/{n} … d−1")
    region_top = ky - 0.16
    for rank in range(n):
        top = region_top - rank * (region_h + 0.1)
        _rank_region(ax, 0.15, top - region_h, width - 0.3, region_h, rank,
                     f"rank {rank}", f"memory of layer i; its own 1/{n} of the batch")
        ys = [top - head_h - (k + 1) * row_h - k * row_gap for k in range(len(rows))]
        for y, label in zip(ys, rows):
            ax.text(0.3, y + row_h / 2, label, va="center", fontsize=SMALL + 0.5, color=INK)
        shard, full, fgrad, gshard = ys
        # the shard: always there (the DTensor the module holds), updated by the step
        _life_bar(ax, x_of(REST), x_of(STEP), shard, row_h,
                  f"its shard of every weight: {halves[rank]} (DTensor, Shard(0))",
                  face=_tint(params, 0.45), edge=params)
        _life_bar(ax, x_of(STEP), x_of(STEP, 1), shard, row_h, "updated",
                  face=_tint(params, 0.45), edge=INK, lw=1.8)
        # the full parameters: from the all-gather to the reshard, twice
        _life_bar(ax, x_of(AG1, 0.55), x_of(RS1, 0.5), full, row_h, "same on all ranks",
                  face=_tint(params, 0.2), edge=params)
        _life_bar(ax, x_of(RS1, 0.5), x_of(AG2, 0.6), full, row_h,
                  "kept if reshard_after_forward=False", face="white", edge=params,
                  ls=(0, (3, 2)), color="0.4")
        _life_bar(ax, x_of(AG2, 0.6), x_of(RS2, 0.5), full, row_h, "same on all ranks",
                  face=_tint(params, 0.2), edge=params)
        # the full gradients: from backward until the reduce-scatter is done with them
        _life_bar(ax, x_of(BWD, 0.15), x_of(RS2, 0.85), fgrad, row_h, "from its own batch",
                  face=_tint(grads, 0.2), edge=grads)
        # the gradient shard: the mean over ranks of its rows, kept until zero_grad()
        _life_bar(ax, x_of(RS2, 0.55), x_of(STEP, 1), gshard, row_h, "mean, its rows",
                  face=_tint(grads, 0.45), edge=grads)
    bottom = region_top - n * region_h - (n - 1) * 0.1
    # faint column lines through every lane
    for x in xs[1:-1]:
        ax.plot([x, x], [bottom + 0.05, hy - 0.38], color="0.85", lw=0.7, ls=(0, (2, 2)),
                zorder=0.5)

    # the time axis
    ay = bottom - 0.2
    _arrow(ax, (left, ay), (right + 0.1, ay), color="0.35", lw=1.0, mutation=9)
    ax.text(left, ay - 0.2, "time →  (schematic, one step; the grad shard lives on until "
            "optimizer.zero_grad())", fontsize=SMALL, color="0.3", va="center")

    # what it costs, what it saves
    by, bh = 0.4, 1.3
    keys = ((0.15, "Communication per rank, per step",
             "all-gather × 2: in P/N, out P (forward, backward);\n"
             "reduce-scatter × 1: in P, out P/N (ReduceOp.AVG).\n"
             f"Each sends (N−1)/N · P = P/{n}: 3 × P/{n} per step, 1.5× DDP.\n"
             "reshard_after_forward=False (the root unit's default):\n"
             "no 2nd all-gather, 2 collectives as in DDP"),
            (5.3, "Memory of this unit, per rank",
             "the shards: P/N params, P/N grads (after backward),\n"
             "the optimizer state of its shard (Adam: 2P/N);\n"
             "+ P full params from all-gather to reshard;\n"
             "+ P full grads from backward to reduce-scatter.\n"
             "Unit by unit: ~2 layers' full params at a time"))
    for x, head, body in keys:
        _box(ax, x, by, 5.05, bh, face="white", edge="0.55", round_=0.04)
        ax.text(x + 0.15, by + bh - 0.2, head, fontsize=FONT, fontweight="bold", va="center",
                color=INK)
        ax.text(x + 0.15, by + 0.5, body, fontsize=SMALL + 0.5, va="center", color=INK,
                linespacing=1.3)
    ax.text(width / 2, 0.15, "P: parameters of the unit (elements: × 4 bytes in fp32, × 2 "
            f"in bf16);  d: a weight's first dimension;  N = {n} ranks", ha="center",
            va="center", fontsize=SMALL + 0.5, color="0.3")
    return fig


# --- chapter 05: distributed checkpoint ---------------------------------------------------

CKPT_FACE, CKPT_EDGE = STORE_FACE, STORE_EDGE  # a committed checkpoint: the store's yellow


def _ckpt_mark(ax, x, y0, y1, label):
    """A committed checkpoint on the timeline: a bar between two steps, its folder on top."""
    ax.add_patch(Rectangle((x - 0.045, y0 - 0.04), 0.09, y1 - y0 + 0.08, facecolor=CKPT_EDGE,
                           edgecolor="none", zorder=4))
    ax.text(x, y1 + 0.15, label, ha="center", va="center", fontsize=SMALL, family=MONO,
            color=STORE_INK)


def checkpoint_resume():
    """Fault-tolerant training with Distributed Checkpoint (DCP) on 2 ranks: a run under
    `torchrun --max-restarts 1` loses a rank and resumes from its newest valid checkpoint;
    how one checkpoint is committed atomically; how the resume picks its folder."""
    width, height = 10.5, 8.4
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Fault-tolerant training with DCP on 2 ranks: "
           "checkpoint, crash, restart, resume")

    # --- 1: the timeline of optimizer steps ----------------------------------------------
    steps, sw, gx = 20, 0.43, 1.55          # steps, step width, grid's left edge
    lane_h, lane_gap = 0.3, 0.06
    ax.text(0.15, height - 0.75, "1   torchrun --max-restarts 1, 2 ranks, a checkpoint every "
            "5 steps: rank 1 is killed after step 13", fontsize=FONT, fontweight="bold",
            color=INK, va="center")
    x_at = lambda s: gx + s * sw            # noqa: E731  (the boundary after step s)
    num_y = height - 1.08
    for s in range(1, steps + 1):
        ax.text(x_at(s - 0.5), num_y, str(s), ha="center", va="center", fontsize=SMALL,
                color="0.3")

    def lanes(top, first, last, head):
        """Both ranks' lanes for one attempt: steps first..last; returns the lanes' y."""
        ys = (top - lane_h, top - 2 * lane_h - lane_gap)
        ax.text(0.15, (ys[0] + ys[1] + lane_h) / 2, head, va="center", fontsize=FONT,
                fontweight="bold", color=INK, linespacing=1.3)
        for rank, y in enumerate(ys):
            color = RANK_COLORS[rank]
            ax.text(gx - 0.1, y + lane_h / 2, f"rank {rank}", ha="right", va="center",
                    fontsize=SMALL + 0.5, fontweight="bold", color=color)
            for s in range(first, last + 1):
                ax.add_patch(Rectangle((x_at(s - 1) + 0.02, y), sw - 0.04, lane_h,
                                       facecolor=_tint(color, 0.3), edgecolor=color,
                                       linewidth=0.8, zorder=2))
        return ys

    # attempt 0: steps 1..13 done, 14 never finishes; checkpoints after 5 and 10
    a0 = lanes(num_y - 0.32, 1, 13, "attempt 0")
    for rank, y in enumerate(a0):               # step 14: rank 1 killed, rank 0 cut off
        ax.add_patch(Rectangle((x_at(13) + 0.02, y), sw / 2, lane_h, facecolor=_tint(
            RANK_COLORS[rank], 0.3), edgecolor=RANK_COLORS[rank], linewidth=0.8,
            ls="--", zorder=2))
    ax.text(x_at(13) + 0.02, a0[1] + lane_h / 2, "✗", ha="center", va="center",
            fontsize=FONT + 6, fontweight="bold", color=WRONG, zorder=5)
    for s in (5, 10):
        _ckpt_mark(ax, x_at(s), a0[1], a0[0] + lane_h, f"step_{s:06d}")
    ax.text(x_at(14) + 0.1, a0[1] + lane_h / 2, "rank 1: SIGKILL after step 13",
            va="center", fontsize=SMALL + 0.5, color=WRONG, fontweight="bold")
    ax.text(x_at(14) + 0.1, a0[0] + lane_h / 2, "rank 0: peer gone (error, or SIGTERM)",
            va="center", fontsize=SMALL + 0.5, color="0.3")

    # between the attempts: torchrun restarts the whole group
    mid = a0[1] - 0.3
    ax.text(x_at(14) + 0.1, mid, "torchrun: stops rank 0, restarts both",
            va="center", fontsize=SMALL + 0.5, color=INK)
    # attempt 1: load step_000010, redo 11..13, go on to 20
    a1 = lanes(mid - 0.38, 11, steps, "attempt 1")
    ax.text(gx + 0.05, (a1[0] + a1[1] + lane_h) / 2,
            "TORCHELASTIC_RESTART_COUNT=1\nboth ranks: dcp.load(step_000010)",
            va="center", fontsize=SMALL, family=MONO, color=INK, linespacing=1.35)
    _arrow(ax, (x_at(10), a0[1] - 0.08), (x_at(10), a1[0] + lane_h + 0.02),
           color=STORE_INK, lw=1.6, mutation=11)
    ax.text(x_at(10) - 0.08, (a0[1] + a1[0] + lane_h) / 2, "load", ha="right", va="center",
            fontsize=SMALL + 0.5, color=STORE_INK, fontweight="bold")
    for y in a1:                                 # steps 11..13 again: the work lost
        ax.add_patch(Rectangle((x_at(10) + 0.02, y), 3 * sw - 0.04, lane_h,
                               facecolor="none", edgecolor=_tint(WRONG, 0.7), hatch="////",
                               linewidth=0, zorder=3))
    for s in (15, 20):
        _ckpt_mark(ax, x_at(s), a1[1], a1[0] + lane_h, f"step_{s:06d}")
    by = a1[1] - 0.12                            # a bracket under the redone steps
    ax.plot([x_at(10) + 0.04, x_at(10) + 0.04, x_at(13) - 0.04, x_at(13) - 0.04],
            [by + 0.06, by, by, by + 0.06], color=WRONG, lw=1.2)
    ax.text(x_at(11.5), by - 0.18, "work lost: redone", ha="center", va="center",
            fontsize=SMALL + 0.5, color=WRONG, fontweight="bold")
    ax.text(x_at(steps), by - 0.25, "final loss and weights: bit-identical\n"
            "to an uninterrupted run", ha="right", va="center", fontsize=SMALL + 0.5,
            color=RIGHT, fontweight="bold", linespacing=1.3)
    # the step axis and a key
    ay = by - 0.6
    _arrow(ax, (gx, ay), (x_at(steps) + 0.1, ay), color="0.35", lw=1.0, mutation=9)
    ax.text(gx, ay - 0.2, "optimizer step →", fontsize=SMALL, color="0.3", va="center")
    ax.add_patch(Rectangle((x_at(7), ay - 0.27), 0.09, 0.14, facecolor=CKPT_EDGE,
                           edgecolor="none"))
    ax.text(x_at(7) + 0.17, ay - 0.2, "checkpoint committed after that step (folder name "
            "= step)", fontsize=SMALL, color="0.3", va="center")

    # --- 2: one checkpoint, written atomically --------------------------------------------
    top = ay - 0.6
    ax.text(0.15, top, "2   One checkpoint, written atomically", fontsize=FONT,
            fontweight="bold", color=INK, va="center")
    ax.text(5.65, top, "3   Where to resume: the newest valid folder (an example)",
            fontsize=FONT, fontweight="bold", color=INK, va="center")
    wx, ww = 0.2, 0.95                           # the writer boxes
    fx, fw, row = 1.45, 2.5, 0.38                # the folder box: x, width, file row height
    ftop = top - 0.3
    files = (("①", 0, "__0_0.distcp", "in parallel"),   # (order, writer, file, note)
             ("①", 1, "__1_0.distcp", "in parallel"),
             ("②", 0, ".metadata", "after all ranks"),
             ("③", 0, "manifest.json", "size, sha256"))
    fh = 0.36 + len(files) * row + 0.06
    _box(ax, fx, ftop - fh, fw, fh, face="0.97", edge="0.45", lw=1.2, round_=0.06)
    ax.text(fx + 0.1, ftop - 0.18, "step_000015.tmp/", fontsize=SMALL + 0.5, family=MONO,
            fontweight="bold", color=INK, va="center")
    ys = [ftop - 0.36 - (k + 1) * row for k in range(len(files))]
    for (order, rank, name, note), y in zip(files, ys):
        color, yc = RANK_COLORS[rank], y + row / 2
        _box(ax, wx, y + 0.05, ww, row - 0.1, f"{order} rank {rank}", face=_tint(color, 0.14),
             edge=color, lw=1.4, size=SMALL + 0.5, color=color, round_=0.04)
        _arrow(ax, (wx + ww, yc), (fx + 0.12, yc), color=color, lw=1.1, mutation=9)
        _box(ax, fx + 0.12, y + 0.05, fw - 0.24, row - 0.1, face=_tint(color, 0.14),
             edge=color, round_=0.03, zorder=2)
        ax.text(fx + 0.22, yc, name, fontsize=SMALL + 0.5, family=MONO, color=INK,
                va="center", zorder=3)
        ax.text(fx + fw - 0.2, yc, note, ha="right", va="center", fontsize=SMALL,
                color="0.35", zorder=3)
    # dcp.save = the first three files: a bracket on the right
    bx = fx + fw + 0.08
    ax.plot([bx, bx + 0.08, bx + 0.08, bx], [ys[0] + row - 0.05, ys[0] + row - 0.05,
            ys[2] + 0.05, ys[2] + 0.05], color=INK, lw=1.1)
    ax.text(bx + 0.15, (ys[0] + ys[2] + row) / 2, "dcp.save", fontsize=SMALL + 0.5,
            family=MONO, color=INK, va="center")
    # the commit: one rename
    cx = fx + fw / 2
    cy = ftop - fh - 0.62
    _box(ax, fx + 0.25, cy - 0.19, fw - 0.5, 0.38, face=CKPT_FACE, edge=CKPT_EDGE, lw=1.6)
    ax.text(cx, cy, "step_000015/", ha="center", va="center", fontsize=SMALL + 0.5,
            family=MONO, color=STORE_INK)
    _arrow(ax, (cx, ftop - fh), (cx, cy + 0.19), color=INK, lw=1.4, mutation=11)
    ax.text(cx + 0.1, ftop - fh - 0.22, "④ rank 0: rename = the commit",
            fontsize=SMALL + 0.5, color=INK, va="center", fontweight="bold")
    ax.text(0.2, cy - 0.5, "A crash before ④ leaves only step_000015.tmp/: the next\nstart "
            "removes it (or commits it, if its manifest checks out)", fontsize=SMALL + 0.5,
            color=WRONG, va="center", linespacing=1.3)

    # --- 3: choosing the folder to resume from --------------------------------------------
    lx, lw_ = 5.75, 1.85
    folders = (("step_000020.tmp/", "incomplete → removed", WRONG, "white", FAINT),
               ("step_000015/", "sha256 mismatch → skipped", WRONG, CKPT_FACE, CKPT_EDGE),
               ("step_000010/", "manifest OK → resume here ✓", RIGHT, CKPT_FACE, CKPT_EDGE),
               ("step_000005/", "already deleted (keep last K = 2)", FAINT, "white", FAINT))
    ltop, lrow = top - 0.35, 0.46
    _box(ax, lx - 0.1, ltop - 0.36 - len(folders) * lrow - 0.08, width - lx - 0.05,
         0.36 + len(folders) * lrow + 0.08, face="0.97", edge="0.45", lw=1.2, round_=0.06,
         zorder=0)
    ax.text(lx + 0.05, ltop - 0.18, "checkpoints/", fontsize=SMALL + 0.5, family=MONO,
            fontweight="bold", color=INK, va="center")
    ax.text(width - 0.3, ltop - 0.18, "checked newest first ↓", fontsize=SMALL, color="0.3",
            va="center", ha="right")
    for k, (name, verdict, vcolor, face, edge) in enumerate(folders):
        y = ltop - 0.36 - (k + 1) * lrow
        gone = k == len(folders) - 1
        _box(ax, lx + 0.05, y + 0.07, lw_, lrow - 0.14, face=face, edge=edge,
             ls="--" if face == "white" else "-", lw=1.0 if gone else 1.4, round_=0.03,
             zorder=2)
        ax.text(lx + 0.15, y + lrow / 2, name, fontsize=SMALL + 0.5, family=MONO,
                color=FAINT if gone else INK, va="center", zorder=3)
        if gone:                                 # struck through
            ax.plot([lx + 0.12, lx + lw_ - 0.02], [y + lrow / 2] * 2, color=FAINT, lw=1.0,
                    zorder=4)
        ax.text(lx + lw_ + 0.2, y + lrow / 2, verdict, fontsize=SMALL + 0.5, color=vcolor,
                va="center", fontweight="normal" if gone else "bold")
    ny = ltop - 0.36 - len(folders) * lrow - 0.38
    ax.text(lx - 0.1, ny, "Keep last K = 2: after each commit, rank 0 deletes\nthe older "
            "step folders (step_000005/ went when 15 was committed)", fontsize=SMALL + 0.5,
            color="0.3", va="top", linespacing=1.3)
    return fig


# --- chapter 06: the capstone -------------------------------------------------------------

EVAL_COLOR = RIGHT  # capstone_step: an evaluation of the held-out loss


def _lr_at(step: int, steps: int, warmup: int, peak: float, low: float) -> float:
    """ch06_capstone/train_llama.py's lr_at(): linear warm-up to `peak` over `warmup` steps,
    then cosine decay to `low` at the end (step `steps`)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * min(1.0, progress)))


def _mark(ax, x, y0, y1, color):
    """Work done between two steps: a bar on the step boundary x (as in checkpoint_resume)."""
    ax.add_patch(Rectangle((x - 0.04, y0), 0.08, y1 - y0, facecolor=color, edgecolor="none",
                           zorder=4))


def capstone_step():
    """One optimizer step of ch06_capstone/train_llama.py on 2 ranks, 2 micro-batches each,
    with FSDP2's collectives (torch 2.13: FSDPParamGroup's pre_forward, post_forward,
    pre_backward, post_backward with reduce_grads off until the last micro-batch); and the
    work around the steps: learning rate, evaluation, checkpoints, metrics, a stop signal."""
    width, height = 10.5, 9.6
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "One optimizer step of train_llama.py on 2 ranks:  "
           "--batch-size 16  --micro-batch 4")

    # --- 1: the step, left to right ------------------------------------------------------
    top = height - 0.75
    ax.text(0.15, top, "1   The step: 16 sequences, 8 per rank, run as 2 micro-batches of 4; "
            "gradients accumulate, then one reduce-scatter", fontsize=FONT, fontweight="bold",
            color=INK, va="center")
    cols = {"batch": (0.15, 1.15), "f0": (1.5, 0.9), "b0": (2.58, 1.1), "f1": (3.93, 0.9),
            "b1": (5.01, 1.1), "clip": (6.31, 1.15), "adam": (7.64, 1.05), "end": (8.87, 1.48)}
    x_of = lambda k: cols[k][0]  # noqa: E731
    end = lambda k: cols[k][0] + cols[k][1]  # noqa: E731
    heads = (("batch", "batch", "global batch", "batch_of(step)"),
             ("f0", "b0", "micro-batch 0", "no gradient sync"),
             ("f1", "b1", "micro-batch 1 (the last)", "gradient sync"),
             ("clip", "clip", "clip", "--clip 1.0"),
             ("adam", "adam", "AdamW", "lr = lr_at(step)"),
             ("end", "end", "end of the step", ""))
    for a, b, head, sub in heads:
        mid = (x_of(a) + end(b)) / 2
        ax.text(mid, top - 0.36, head, ha="center", va="center", fontsize=FONT,
                fontweight="bold", color=INK)
        if sub:
            ax.text(mid, top - 0.58, sub, ha="center", va="center", fontsize=SMALL,
                    family=MONO if "(" in sub or "--" in sub else None, color="0.35")
    lane_h, comm_h, gap = 0.85, 0.78, 0.1
    l0 = top - 0.75 - lane_h
    cm = l0 - gap - comm_h
    l1 = cm - gap - lane_h
    # per rank: its slice of the batch, the micro-batches, clip, AdamW, the end of the step
    for rank, y in enumerate((l0, l1)):
        color = RANK_COLORS[rank]
        x, w = cols["batch"]
        _box(ax, x, y, w, lane_h, face=_tint(color, 0.12), edge=color, lw=1.4)
        ax.text(x + w / 2, y + lane_h - 0.17, f"rank {rank}", ha="center", va="center",
                fontsize=FONT, fontweight="bold", color=color)
        ax.text(x + w / 2, y + lane_h - 0.37, f"sequences {8 * rank}–{8 * rank + 7}",
                ha="center", va="center", fontsize=SMALL, color=INK)
        for m in range(2):
            _box(ax, x + 0.08 + m * (w - 0.16) / 2 + 0.02 * m, y + 0.08, (w - 0.2) / 2, 0.28,
                 f"mb {m}", face=_tint(color, 0.35), edge=color, size=SMALL, round_=0.03)
        mid = y + lane_h / 2
        texts = {"f0": "forward:\neach layer;\nloss ÷ 2",
                 "b0": "backward:\nfull grads,\nkept",
                 "f1": "forward:\neach layer;\nloss ÷ 2",
                 "b1": "backward:\nfull grads,\nadded",
                 "clip": "its grad shard\n× min(1, c/‖g‖)",
                 "adam": "AdamW on\nits shard:\n½ the params\nand its m, v",
                 "end": ("metrics line\n→ metrics.jsonl" if rank == 0 else
                         "its loss, memory\n→ rank 0's line")}
        for key, text in texts.items():
            kind = key[0]
            if kind in "fb":
                _slot(ax, x_of(key), y, cols[key][1], lane_h, "F" if kind == "f" else "B",
                      rank, text, size=SMALL + 0.5)
            else:
                _box(ax, x_of(key), y, cols[key][1], lane_h, text, face="white", edge=INK,
                     lw=1.2, size=SMALL + 0.5)
        order = ("batch", "f0", "b0", "f1", "b1", "clip", "adam", "end")
        for a, b in zip(order, order[1:]):
            _arrow(ax, (end(a) + 0.01, mid), (x_of(b) - 0.01, mid), mutation=9, lw=1.1)
    # the collectives, between the ranks' lanes: yellow moves bytes, dashed white does not
    ax.text(x_of("batch") + cols["batch"][1] / 2, cm + comm_h / 2,
            "collectives\n(both ranks)", ha="center", va="center", fontsize=SMALL + 0.5,
            fontweight="bold", color=STORE_INK, linespacing=1.3)
    for key in ("f0", "f1"):
        _comm(ax, x_of(key), cols[key][1], cm, comm_h, "all-gather\neach layer's\nweights",
              size=SMALL + 0.5)
    split = 0.32                                   # the backward columns: all-gather on top
    for key, last in (("b0", False), ("b1", True)):
        x, w = cols[key]
        _comm(ax, x, w, cm + comm_h - split, split, "all-gather ¹", size=SMALL + 0.5)
        _comm(ax, x, w, cm, comm_h - split - 0.05,
              "reduce-scatter\n→ grad shard" if last else "no reduce-\nscatter",
              forward=last, size=SMALL + 0.5)
    _comm(ax, x_of("clip"), cols["clip"][1], cm, comm_h, "all-reduce:\n‖g‖ over all\nshards",
          size=SMALL + 0.5)
    _comm(ax, x_of("adam"), cols["adam"][1], cm, comm_h, "none", forward=False,
          size=SMALL + 0.5)
    _comm(ax, x_of("end"), cols["end"][1], cm, comm_h, "all-reduce: loss,\nstop flag;\n"
          "all-gather: memory", size=SMALL + 0.5)
    ny = l1 - 0.22
    for i, note in enumerate((
            "model.set_requires_gradient_sync(i == accum − 1): micro-batch 0's backward keeps "
            "each layer's full gradients (P per layer); the last",
            "micro-batch adds to them and reduce-scatters them (mean over ranks), layer by layer "
            "as its backward goes.   ‖g‖: the norm of the whole gradient.",
            "¹ --reshard-after-forward 1 (the default, ZeRO-3): a layer's full weights are freed "
            "after its forward and gathered again for backward;",
            "  0 (ZeRO-2) keeps them from forward to backward: no second all-gather, more "
            "memory.   P: one layer's parameters.")):
        ax.text(0.15, ny - i * 0.21, note, fontsize=SMALL, color="0.3", va="center")

    # --- 2: around the steps ---------------------------------------------------------------
    steps, warmup, stop_at, eval_every, save_every = 20, 4, 17, 5, 10
    sec = ny - 3 * 0.21 - 0.45
    ax.text(0.15, sec, f"2   Around the steps:  --max-steps {steps}  --warmup {warmup}  "
            f"--eval-every {eval_every}  --save-every {save_every},  a SIGTERM during step "
            f"{stop_at}", fontsize=FONT, fontweight="bold", color=INK, va="center")
    gx, sw = 2.0, 0.385
    x_at = lambda s: gx + s * sw  # noqa: E731  (the boundary after step s)

    def label(y, head, sub=""):
        ax.text(0.15, y + (0.09 if sub else 0), head, fontsize=SMALL + 0.5, fontweight="bold",
                color=INK, va="center")
        if sub:
            ax.text(0.15, y - 0.11, sub, fontsize=SMALL, color="0.35", va="center")

    # the learning rate of each step
    band_top, band_bot = sec - 0.3, sec - 1.12
    peak, low = 1.0, 0.1
    y_of = lambda lr: band_bot + lr / peak * (band_top - band_bot)  # noqa: E731
    label((band_top + band_bot) / 2, "learning rate", "lr_at(step)")
    for lr, name in ((peak, "--lr"), (low, "--min-lr")):
        ax.plot([gx, x_at(steps)], [y_of(lr)] * 2, color="0.7", lw=0.8, ls=(0, (2, 2)),
                zorder=1)
        ax.text(x_at(steps) + 0.06, y_of(lr), name, fontsize=SMALL, family=MONO, color="0.35",
                va="center")
    ax.plot([gx, x_at(steps)], [band_bot] * 2, color="0.35", lw=0.8)
    lrs = [_lr_at(s, steps, warmup, peak, low) for s in range(steps)]
    ax.plot([x_at(s + 0.5) for s in range(steps)], [y_of(v) for v in lrs], color=INK, lw=1.4,
            marker="o", markersize=3.5, zorder=3)
    ax.text(x_at(warmup - 0.6), y_of(0.3), "linear\nwarm-up", ha="center", va="center",
            fontsize=SMALL, color="0.3", linespacing=1.2)
    ax.text(x_at(7), y_of(0.2), "cosine decay to --min-lr at the end",
            ha="left", va="center", fontsize=SMALL, color="0.3")

    # the steps: done, stopped, done again after --resume
    sy, sh = band_bot - 0.42, 0.3
    label(sy + sh / 2, "optimizer step", "section 1")
    for s in range(1, steps + 1):
        later = s > stop_at
        _box(ax, x_at(s - 1) + 0.02, sy, sw - 0.04, sh, str(s), size=SMALL,
             face="white" if later else SHARED, edge=FAINT if later else "0.45",
             ls="--" if later else "-", color="0.45" if later else INK, round_=0.03)
    # a stop signal during step 17: the flag rides on the end-of-step all-reduce
    gy = sy - 0.3
    _arrow(ax, (x_at(stop_at - 0.5), gy - 0.06), (x_at(stop_at - 0.5), sy), color=WRONG,
           lw=1.6, mutation=10)
    ax.text(x_at(stop_at - 0.5) - 0.12, gy, "SIGTERM (Slurm, before its time limit) or SIGUSR1: "
            "the handler sets a flag; the end-of-step all-reduce tells every rank", ha="right",
            va="center", fontsize=SMALL, color=WRONG)
    ax.text(x_at(stop_at + 1.5), gy, "run again\nwith --resume", ha="center", va="center",
            fontsize=SMALL, color="0.35", linespacing=1.15)
    rows = {"metrics": gy - 0.37, "eval": gy - 0.77, "ckpt": gy - 1.17}
    label(rows["metrics"], "metrics line", "every step, rank 0")
    label(rows["eval"], "evaluation", f"every {eval_every} steps")
    label(rows["ckpt"], "checkpoint (DCP)", f"every {save_every}, and on a stop")
    mh = 0.22
    for s in range(1, steps + 1):
        _mark(ax, x_at(s), rows["metrics"] - mh / 2, rows["metrics"] + mh / 2,
              "0.55" if s <= stop_at else "0.82")
    for s in [0] + [s for s in range(1, steps + 1) if s % eval_every == 0 or s == steps]:
        _mark(ax, x_at(s), rows["eval"] - mh / 2, rows["eval"] + mh / 2,
              EVAL_COLOR if s <= stop_at else _tint(EVAL_COLOR, 0.4))
    for s in sorted({s for s in range(1, steps + 1) if s % save_every == 0} | {stop_at}):
        _mark(ax, x_at(s), rows["ckpt"] - mh / 2, rows["ckpt"] + mh / 2,
              CKPT_EDGE if s <= stop_at else _tint(CKPT_EDGE, 0.4))
        ax.text(x_at(s) - 0.1, rows["ckpt"], f"step_{s:06d}", ha="right", va="center",
                fontsize=SMALL, family=MONO, color=STORE_INK)
    ky = rows["ckpt"] - 0.38
    for i, note in enumerate((
            "evaluation: the held-out loss, each rank on its share of the held-out sequences, "
            "the sums all-reduced; also before step 1 and after the last.",
            "checkpoint: dcp.save, each rank writes its own shards in parallel, rank 0 commits "
            "the folder (chapter 05); after the stop signal: save, then exit.",
            "metrics line: loss, lr, grad_norm, tokens/s, memory per rank (MFU on GPU) → "
            "metrics.jsonl, and TensorBoard with --tensorboard.")):
        ax.text(0.15, ky - i * 0.21, note, fontsize=SMALL, color="0.3", va="center")
    return fig


def _process(ax, x, y, w, h, rank, lines, *, device):
    """One worker process started by torchrun: 'rank r' in its colour, its device, env vars."""
    color = RANK_COLORS[rank % 10]
    _box(ax, x, y, w, h, face=_tint(color, 0.14), edge=color, lw=1.4, round_=0.05)
    ax.text(x + 0.1, y + h - 0.17, f"rank {rank}", fontsize=FONT, fontweight="bold",
            color=color, va="center")
    ax.text(x + w - 0.1, y + h - 0.17, device, fontsize=SMALL, family=MONO, color="0.35",
            va="center", ha="right")
    ax.text(x + 0.1, y + h - 0.33, "\n".join(lines), fontsize=SMALL, family=MONO, color=INK,
            va="top", linespacing=1.3)


def multinode_launch():
    """How a job starts on many nodes (Slurm: sbatch, srun, one torchrun per node, a c10d
    rendezvous, ranks, processes; torch 2.13's DynamicRendezvousHandler numbers the nodes in
    sorted order of their names), and its rehearsal on one machine with two torchruns."""
    width, height = 10.5, 9.9
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.3, "Starting a job on many nodes: sbatch, srun, "
           "one torchrun per node, one c10d rendezvous")
    nodes, gpus = 2, 4

    # --- 1: on a cluster -----------------------------------------------------------------
    top = height - 0.75
    ax.text(0.15, top, f"1   On a cluster (Slurm): {nodes} nodes with {gpus} GPUs each",
            fontsize=FONT, fontweight="bold", color=INK, va="center")
    # the batch script
    sx, sw, stop = 0.15, 3.0, top - 0.3
    script = ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --signal=TERM@300",
              "head=$(scontrol show hostnames \\", '  "$SLURM_JOB_NODELIST" | head -n1)',
              "srun ... torchrun \\", '  --nnodes "$SLURM_NNODES" \\',
              '  --nproc-per-node "$GPUS_PER_NODE" \\', "  --rdzv-backend c10d \\",
              '  --rdzv-endpoint "$head:29500" \\', '  --rdzv-id "$SLURM_JOB_ID" \\',
              "  code/ch06_capstone/train_llama.py")
    sh = 0.5 + len(script) * 0.175
    _box(ax, sx, stop - sh, sw, sh, face="0.97", edge="0.45", lw=1.2)
    ax.text(sx + 0.12, stop - 0.2, "① sbatch train_llama.sbatch", fontsize=FONT,
            fontweight="bold", color=INK, va="center")
    ax.text(sx + 0.12, stop - 0.4, "\n".join(script), fontsize=SMALL, family=MONO, color=INK,
            va="top", linespacing=1.38, parse_math=False)
    ax.text(sx + 0.12, stop - sh - 0.17, "an excerpt (the file: 8 GPUs a node)",
            fontsize=SMALL, color="0.35", va="center")
    steps = ("① Slurm runs the script on the first node",
             "② srun: the same torchrun on every node",
             "③ each joins the rendezvous and waits\n    until all --nnodes are there",
             "④ nodes ranked by sorted name; torchrun\n    sets RANK, LOCAL_RANK, WORLD_SIZE",
             "⑤ each starts one process per GPU")
    ly = stop - sh - 0.45
    for text in steps:
        ax.text(sx, ly, text, fontsize=SMALL + 0.5, color=INK, va="top", linespacing=1.3)
        ly -= 0.2 * (text.count("\n") + 1) + 0.08

    # the nodes: srun's bus on top, an agent each, the store on the head node, the processes
    bus = top - 0.38
    ntop, nw, nx = top - 0.6, 3.4, (3.3, 6.95)
    agent_h = 0.9
    wh, wgap = 0.72, 0.1                        # a process box's height, the gap between
    agent_top = ntop - 0.4
    agent_y = agent_top - agent_h
    rank_y = agent_y - 0.3                      # ④: the node's rank
    rows_top = rank_y - 0.35
    nbottom = rows_top - 2 * wh - wgap - 0.15
    names = ("node001  (= $head)", "node002")
    ax.plot([sx + sw, nx[1] + 2.7], [bus, bus], color=INK, lw=1.3)
    ax.text((nx[0] + nw + nx[1]) / 2, bus + 0.13, "② srun: one task per node", ha="center",
            va="center", fontsize=SMALL + 0.5, color=INK, fontweight="bold")
    store = None
    for node, x0 in enumerate(nx):
        _box(ax, x0, nbottom, nw, ntop - nbottom, face="0.97", edge="0.55", round_=0.1,
             zorder=0)
        ax.text(x0 + 0.15, ntop - 0.2, names[node], fontsize=FONT, color="0.3",
                va="center")
        _arrow(ax, (x0 + 2.7, bus), (x0 + 2.7, agent_top), mutation=10, lw=1.3)
        _box(ax, x0 + 0.15, agent_y, nw - 0.3, agent_h, face="white", edge=INK, lw=1.4)
        ax.text(x0 + 0.3, agent_top - 0.2, "torchrun agent", fontsize=FONT, fontweight="bold",
                color=INK, va="center")
        if node == 0:                           # the head node's agent hosts the store
            store = (x0 + 0.3, agent_y + 0.1, 2.2, 0.46)
            _box(ax, *store, "c10d rendezvous store\n$head:29500, id = job id",
                 face=STORE_FACE, edge=STORE_EDGE, color=STORE_INK, size=SMALL + 0.5)
        else:
            ax.text(x0 + 0.3, agent_y + 0.33, "connects to\n$head:29500", fontsize=SMALL,
                    color="0.3", va="center", linespacing=1.25)
        ranks = f"{node * gpus} … {node * gpus + gpus - 1}"
        ax.text(x0 + 0.15, rank_y, f"④ node rank {node}:  RANK {ranks}", fontsize=SMALL + 0.5,
                fontweight="bold", color=INK, va="center")
        for local in range(gpus):
            rank = node * gpus + local
            col, row = local % 2, local // 2
            px = x0 + 0.15 + col * (nw - 0.3 + 0.1) / 2
            py = rows_top - (row + 1) * wh - row * wgap
            _process(ax, px, py, (nw - 0.4) / 2, wh, rank,
                     (f"RANK={rank}", f"LOCAL_RANK={local}"), device=f"cuda:{local}")
        # ⑤ the agent starts its processes: a line from it, fanning out to the columns
        fan, pw = rows_top + 0.12, (nw - 0.4) / 2
        centres = [x0 + 0.15 + col * (pw + 0.1) + pw / 2 for col in range(2)]
        ax.plot([x0 + nw - 0.35, x0 + nw - 0.35, centres[0]], [agent_y, fan, fan], color=INK,
                lw=1.3, zorder=3)
        for cx in centres:
            _arrow(ax, (cx, fan), (cx, rows_top), mutation=9, lw=1.3)
        ax.text(x0 + nw - 0.45, rank_y, "⑤", ha="right", va="center", fontsize=SMALL + 0.5,
                fontweight="bold", color=INK)
    # ③ node 1's agent joins the store on node 0
    sx1 = store[0] + store[2]
    _arrow(ax, (nx[1] + 0.3 + 0.05, agent_y + 0.33), (sx1 + 0.03, agent_y + 0.33),
           color=STORE_INK, ls="--", lw=1.4, mutation=11)
    ax.text((sx1 + nx[0] + nw - 0.15) / 2, agent_y + 0.5, "③ join", ha="center",
            va="center", fontsize=SMALL + 0.5, color=STORE_INK, fontweight="bold")
    ny = nbottom - 0.25
    ax.text(nx[0], ny, f"WORLD_SIZE = nodes × GPUs per node = {nodes} × {gpus} = "
            f"{nodes * gpus};  RANK = node rank × {gpus} + LOCAL_RANK", fontsize=SMALL + 0.5,
            color=INK, va="center")
    ax.text(nx[0], ny - 0.22, "then init_process_group(\"nccl\") at MASTER_ADDR:MASTER_PORT "
            "(node rank 0's, via the store)", fontsize=SMALL + 0.5, color="0.3", va="center")

    # --- 2: the rehearsal on one machine -------------------------------------------------
    top2 = min(ny - 0.75, ly - 0.3)
    ax.text(0.15, top2, "2   The rehearsal on one machine: two torchruns on 127.0.0.1 stand "
            "in for the two nodes", fontsize=FONT, fontweight="bold", color=INK, va="center")
    ax.text(0.15, top2 - 0.3, "NNODES=2 RDZV_ENDPOINT=127.0.0.1:$PORT code/run_w_torchrun.sh 1 "
            "ch06_capstone/train_llama.py ...    # twice, at once", fontsize=SMALL,
            family=MONO, color=INK, va="center", parse_math=False)
    ax.text(0.15, top2 - 0.5, "  = torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
            "--rdzv-endpoint 127.0.0.1:$PORT --rdzv-id rehearsal$PORT", fontsize=SMALL,
            family=MONO, color="0.35", va="center", parse_math=False)
    mtop, mh, mx, mw = top2 - 0.75, 2.05, 0.15, 6.3
    _box(ax, mx, mtop - mh, mw, mh, face="0.97", edge="0.55", round_=0.1, zorder=0)
    ax.text(mx + 0.15, mtop - 0.2, "this machine (laptop, CPU)", fontsize=FONT, color="0.3",
            va="center")
    aw, ah = 2.2, 0.5
    ay = mtop - 0.4 - ah
    agent_x = (mx + 0.2, mx + mw - 0.2 - aw)
    for i, x in enumerate(agent_x):
        _box(ax, x, ay, aw, ah, f"torchrun  (\"node\" {i})", face="white", edge=INK, lw=1.4,
             size=FONT)
        _arrow(ax, (x + aw / 2, ay), (x + aw / 2, ay - 0.2), mutation=10, lw=1.3)
        _process(ax, x, ay - 0.2 - 0.85, aw, 0.85, i,
                 (f"RANK={i}  LOCAL_RANK=0", "WORLD_SIZE=2  gloo"), device="cpu")
    cx0, cx1 = agent_x[0] + aw + 0.12, agent_x[1] - 0.12
    _box(ax, cx0, ay - 0.05, cx1 - cx0, ah + 0.1, "store\n127.0.0.1:$PORT", face=STORE_FACE,
         edge=STORE_EDGE, color=STORE_INK, size=SMALL)
    ax.text((cx0 + cx1) / 2, ay - 0.3, "hosted by the\nfirst to bind it;\nthe other joins",
            ha="center", va="top", fontsize=SMALL, color=STORE_INK, linespacing=1.25)
    # the mapping: what stands in for what
    tx, c1, c2 = 6.7, 6.8, 8.6
    rows = (("cluster", "rehearsal"), ("a node", "a torchrun"),
            ("$head:29500", "127.0.0.1:$PORT"), ("--rdzv-id $SLURM_JOB_ID", "rehearsal$PORT"),
            ("4 GPUs, NCCL", "1 CPU process, gloo"), ("WORLD_SIZE 8", "WORLD_SIZE 2"))
    _box(ax, tx, mtop - mh, width - 0.15 - tx, mh + 0.0, face="white", edge="0.55",
         round_=0.06, zorder=0)
    for i, (a, b) in enumerate(rows):
        y = mtop - 0.22 - i * 0.32
        weight = "bold" if i == 0 else "normal"
        ax.text(c1, y, a, fontsize=SMALL + 0.5, fontweight=weight, color=INK, va="center")
        ax.text(c2, y, b, fontsize=SMALL + 0.5, fontweight=weight, color=INK, va="center")
        if i == 0:
            ax.plot([c1, width - 0.3], [y - 0.16, y - 0.16], color="0.6", lw=0.8)
    for i, note in enumerate((
            "The same path as on the cluster: rendezvous, node ranks, RANK, one process group "
            "over both \"nodes\"; only the links differ (loopback TCP).",
            "In a notebook, distkit.notebook.launch_nodes(2, 1, \"ch06_capstone/train_llama.py\", "
            "...) starts both at once, then prints their output node by node.")):
        ax.text(0.15, mtop - mh - 0.25 - i * 0.21, note, fontsize=SMALL, color="0.3",
                va="center")
    return fig


# --- chapter 07: when distributed training goes wrong -------------------------------------

def collective_mismatch():
    """Why ch07_debugging/buggy_train.py --bug save hangs: the backend pairs the k-th collective
    of every rank, whatever its name. Each step all-reduces the gradients (676 floats: the
    16-32-4 MLP), then the loss; after step 2 only rank 0 saves, and saving ends in a barrier."""
    width, height = 10.3, 3.55
    fig, ax = _canvas(width, height)
    _title(ax, width / 2, height - 0.25, "Collectives meet by order, not by name")
    x0, bw, gap, bw5 = 1.05, 1.22, 0.12, 1.6        # first box, box width, gap, width of #5
    lane_h, l0, l1 = 0.54, 2.13, 1.0                 # lane height; bottoms of rank 0, rank 1
    calls = [("all_reduce", "grads, 676 floats"), ("all_reduce", "loss, 1 float")] * 2
    lanes = {0: calls + [("barrier", "in save_checkpoint")],
             1: calls + [("all_reduce", "grads, step 3")]}
    xs = [x0 + k * (bw + gap) for k in range(5)]
    widths = [bw] * 4 + [bw5]
    for rank, y in ((0, l0), (1, l1)):
        color = RANK_COLORS[rank]
        ax.text(x0 - 0.15, y + lane_h / 2, f"rank {rank}", ha="right", va="center",
                fontsize=FONT + 1, fontweight="bold", color=color)
        for k, ((op, what), x, w) in enumerate(zip(lanes[rank], xs, widths), start=1):
            bad = k == 5
            _box(ax, x, y, w, lane_h, face=_tint(color, 0.25), edge=WRONG if bad else color,
                 lw=2.0 if bad else 1.4, round_=0.04)
            ax.text(x + w / 2, y + lane_h * 0.66, f"#{k} {op}", ha="center", va="center",
                    fontsize=SMALL + 0.5, family=MONO, color=INK,
                    fontweight="bold" if bad else "normal")
            ax.text(x + w / 2, y + lane_h * 0.28, what, ha="center", va="center",
                    fontsize=SMALL, color="0.3")
        # then nothing: each rank waits in its #5 until the process group's timeout
        wx, wend = xs[4] + bw5 + gap, width - 0.55
        ax.add_patch(Rectangle((wx, y), wend - wx, lane_h, facecolor="white",
                               edgecolor=_tint(WRONG, 0.45), hatch="////", linewidth=1.0,
                               zorder=1))
        ax.text((wx + wend) / 2, y + lane_h / 2, f"waiting in {lanes[rank][4][0]}\n"
                "… until the timeout", ha="center", va="center", fontsize=SMALL,
                color=WRONG, zorder=3, linespacing=1.25,
                bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))
    # the end of the wait: the timeout, then an error on every rank
    tx = width - 0.55
    ax.plot([tx, tx], [l1 - 0.08, l0 + lane_h + 0.08], color=WRONG, lw=2.0, zorder=4)
    ax.text(tx + 0.12, (l1 + l0 + lane_h) / 2, "timeout:\nerror on\nevery rank",
            ha="left", va="center", fontsize=SMALL, color=WRONG, linespacing=1.25)
    # which step each call belongs to (the same on both ranks up to #4)
    sy = l0 + lane_h + 0.2
    for label, a, b in (("step 1", 0, 1), ("step 2", 2, 3)):
        xa, xb = xs[a] + 0.04, xs[b] + bw - 0.04
        ax.plot([xa, xa, xb, xb], [sy - 0.06, sy, sy, sy - 0.06], color="0.55", lw=1.0)
        ax.text((xa + xb) / 2, sy + 0.13, label, ha="center", va="center", fontsize=SMALL,
                color="0.3")
    ax.text(xs[4] + bw5 / 2, sy + 0.07, "after step 2, rank 0 only:\nsave_checkpoint()",
            ha="center", va="center", fontsize=SMALL, color="0.3", linespacing=1.2)
    # the pairing: #k of rank 0 with #k of rank 1
    top, bottom = l0, l1 + lane_h
    mid = (top + bottom) / 2
    for k, (x, w) in enumerate(zip(xs, widths), start=1):
        cx = x + w / 2
        ok = k < 5
        ax.plot([cx, cx], [bottom, top], color=RIGHT if ok else WRONG, lw=1.8,
                ls="-" if ok else (0, (3, 2)), zorder=2)
        ax.text(cx, mid, "✓" if ok else "✗", ha="center", va="center",
                fontsize=FONT + 1 if ok else FONT + 3, fontweight="bold",
                color=RIGHT if ok else WRONG, zorder=3,
                bbox=dict(boxstyle="circle,pad=0.12", facecolor="white",
                          edgecolor=RIGHT if ok else WRONG, linewidth=1.0))
    ax.text(x0 - 0.15, mid, "#k meets #k", ha="right", va="center", fontsize=SMALL,
            color="0.3")
    ax.text(xs[4] + bw5 / 2 + 0.3, mid, "mismatch:\nbarrier vs all_reduce", ha="left",
            va="center", fontsize=FONT, fontweight="bold", color=WRONG, linespacing=1.2)
    # time, and the rule
    ay = l1 - 0.25
    _arrow(ax, (x0, ay), (tx, ay), color="0.35", lw=1.0, mutation=9)
    ax.text(x0, ay - 0.2, "time →  (the order of each rank's collective calls; "
            "ch07_debugging/buggy_train.py --bug save on 2 ranks)", fontsize=SMALL,
            color="0.3", va="center")
    ax.text(0.15, 0.2, "The backend pairs the k-th collective of every rank; a different op, "
            "shape or count at the same k = a hang\n(or, with TORCH_DISTRIBUTED_DEBUG=DETAIL, "
            "an error at once)", fontsize=SMALL + 0.5, color=INK, va="center",
            linespacing=1.3)
    return fig


DIAGRAMS = {"torchrun": torchrun, "ring_allreduce": ring_allreduce, "ddp": ddp,
            "model_parallel": model_parallel,
            "pipedream_staleness": pipedream_staleness,
            "tensor_parallel": tensor_parallel,
            "sequence_parallel": sequence_parallel,
            "parallelisms": parallelisms,
            "zero_stages": zero_stages, "float_formats": float_formats,
            "fsdp_unit_life": fsdp_unit_life,
            "checkpoint_resume": checkpoint_resume,
            "capstone_step": capstone_step, "multinode_launch": multinode_launch,
            "collective_mismatch": collective_mismatch}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=IMAGES,
                        help=f"folder for the PNGs (default: {IMAGES})")
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"only these diagrams (default: all of {', '.join(DIAGRAMS)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(DIAGRAMS))
    if unknown:
        parser.error(f"unknown diagram(s) {', '.join(unknown)}; choose from {', '.join(DIAGRAMS)}")
    plt.switch_backend("Agg")  # files only: no window, whatever the default backend is
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or DIAGRAMS:
        fig = DIAGRAMS[name]()
        path = args.out / f"{name}.png"
        fig.savefig(path, dpi=DPI, facecolor="white", bbox_inches="tight", pad_inches=0.1)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
