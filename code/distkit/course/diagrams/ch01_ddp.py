"""Chapter 01, data parallelism: what DDP replicates and what it splits."""
from __future__ import annotations

from matplotlib.patches import Rectangle

from distkit.course.diagrams.shapes import (FONT, INK, MONO, SHARED, SMALL, STORE_EDGE, STORE_FACE,
                                            arrow, box, canvas, tint, title)
from distkit.course.plots import RANK_COLORS


def ddp(n: int = 2):
    """Data parallelism: one batch split over n ranks, a full model replica on each."""
    lane_h, lane_gap = 1.05, 0.6
    height = 2.45 + n * lane_h + (n - 1) * lane_gap
    fig, ax = canvas(9.0, height)
    title(ax, 4.5, height - 0.3, f"DDP on N = {n} ranks: a whole model on every rank, "
          "a slice of the batch each")
    lanes_top = height - 0.95
    lane_y = [lanes_top - (r + 1) * lane_h - r * lane_gap for r in range(n)]  # lane bottoms
    lanes_bottom = lane_y[-1]

    # the global batch, cut into n slices by DistributedSampler
    bx, bw = 0.15, 1.0
    ax.text(bx + bw / 2, lanes_top + 0.25, "global batch\n(B samples)", ha="center",
            va="center", fontsize=FONT, fontweight="bold", color=INK, linespacing=1.2)
    for r, y in enumerate(lane_y):
        box(ax, bx, y, bw, lane_h, f"slice {r}\nB/{n} samples", round_=0.02,
            face=tint(RANK_COLORS[r], 0.35), edge=RANK_COLORS[r], lw=1.4)
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
        box(ax, x_of("model"), y, cols["model"][1], lane_h,
            "model replica\nweights W", face=SHARED, edge=INK)
        box(ax, x_of("act"), y, cols["act"][1], lane_h, "activations\nand loss",
            face=tint(color, 0.35), edge=color, lw=1.4)
        box(ax, x_of("grad"), y, cols["grad"][1], lane_h, f"local grads\n$g_{r}$",
            face=SHARED, edge=color, lw=1.4)
        box(ax, x_of("step"), y, cols["step"][1], lane_h, "optimizer\n.step()\nsame update",
            face=SHARED, edge=INK)
        arrow(ax, (bx + bw, mid), (x_of("model"), mid), color=color, lw=1.8)
        arrow(ax, (end("model"), mid), (x_of("act"), mid), "forward",
              text_at=((end("model") + x_of("act")) / 2, mid + 0.15), size=SMALL)
        arrow(ax, (end("act"), mid), (x_of("grad"), mid), "backward",
              text_at=((end("act") + x_of("grad")) / 2, mid + 0.15), size=SMALL)
        arrow(ax, (end("grad"), mid), (x_of("reduce"), mid), color=color, lw=1.8)
        arrow(ax, (end("reduce"), mid), (x_of("step"), mid), lw=1.8)
    # one all-reduce over every rank
    box(ax, x_of("reduce"), lanes_bottom, cols["reduce"][1], lanes_top - lanes_bottom,
        "all-reduce\n(average)\n\nbucket by\nbucket,\nduring\nbackward", face=STORE_FACE,
        edge=STORE_EDGE, lw=1.4)
    ax.text(x_of("reduce") + cols["reduce"][1] / 2, lanes_bottom - 0.22,
            r"every rank gets $\bar g$ = mean of the $g_r$", ha="center", va="center",
            fontsize=SMALL, color=INK)
    # broadcast at construction: every replica starts from rank 0's weights
    mx = x_of("model") + cols["model"][1] / 2
    for r in range(1, n):
        arrow(ax, (mx, lane_y[r - 1]), (mx, lane_y[r] + lane_h), lw=1.8, color=RANK_COLORS[0])
    ax.text(mx + 0.12, (lane_y[0] + lane_y[1] + lane_h) / 2,
            "broadcast W from rank 0\n(once, in DDP(model))", fontsize=SMALL, va="center",
            color=RANK_COLORS[0], linespacing=1.2)

    # what is replicated, what is split
    ky = lanes_bottom - 1.4
    keys = [(0.15, [SHARED], "Replicated: a full copy on every rank",
             "parameters, gradients (equal after the all-reduce),\n"
             "optimizer state: memory per rank does not shrink with N"),
            (4.6, [tint(RANK_COLORS[r], 0.35) for r in range(n)],
             "Split: different on every rank",
             f"the data (B/{n} samples each), and so the\nactivations and the loss")]
    for x, swatches, head, body in keys:
        box(ax, x, ky, 4.3, 0.98, face="white", edge="0.55", round_=0.04)
        for i, face in enumerate(swatches):
            ax.add_patch(Rectangle((x + 0.15 + 0.25 * i, ky + 0.64), 0.2, 0.2, facecolor=face,
                                   edgecolor="0.45", linewidth=0.8))
        ax.text(x + 0.25 + 0.25 * len(swatches), ky + 0.74, head, fontsize=FONT,
                fontweight="bold", va="center", color=INK)
        ax.text(x + 0.15, ky + 0.32, body, fontsize=SMALL + 0.5, va="center", color=INK,
                linespacing=1.3)
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (ddp,)
