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
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from distkit.plots import RANK_COLORS

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


DIAGRAMS = {"torchrun": torchrun, "ring_allreduce": ring_allreduce, "ddp": ddp}


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
