"""Chapter 07, when distributed training goes wrong: collectives meet by order, not by name."""
from __future__ import annotations

from matplotlib.patches import Rectangle

from distkit.course.diagrams.shapes import (FONT, INK, MONO, RIGHT, SMALL, WRONG, arrow, box,
                                            canvas, tint, title)
from distkit.course.plots import RANK_COLORS


def collective_mismatch():
    """Why ch07_debugging/buggy_train.py --bug save hangs: the backend pairs the k-th collective
    of every rank, whatever its name. Each step all-reduces the gradients (676 floats: the
    16-32-4 MLP), then the loss; after step 2 only rank 0 saves, and saving ends in a barrier."""
    width, height = 10.3, 3.55
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.25, "Collectives meet by order, not by name")
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
            box(ax, x, y, w, lane_h, face=tint(color, 0.25), edge=WRONG if bad else color,
                lw=2.0 if bad else 1.4, round_=0.04)
            ax.text(x + w / 2, y + lane_h * 0.66, f"#{k} {op}", ha="center", va="center",
                    fontsize=SMALL + 0.5, family=MONO, color=INK,
                    fontweight="bold" if bad else "normal")
            ax.text(x + w / 2, y + lane_h * 0.28, what, ha="center", va="center",
                    fontsize=SMALL, color="0.3")
        # then nothing: each rank waits in its #5 until the process group's timeout
        wx, wend = xs[4] + bw5 + gap, width - 0.55
        ax.add_patch(Rectangle((wx, y), wend - wx, lane_h, facecolor="white",
                               edgecolor=tint(WRONG, 0.45), hatch="////", linewidth=1.0,
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
    arrow(ax, (x0, ay), (tx, ay), color="0.35", lw=1.0, mutation=9)
    ax.text(x0, ay - 0.2, "time →  (the order of each rank's collective calls; "
            "ch07_debugging/buggy_train.py --bug save on 2 ranks)", fontsize=SMALL,
            color="0.3", va="center")
    ax.text(0.15, 0.2, "The backend pairs the k-th collective of every rank; a different op, "
            "shape or count at the same k = a hang\n(or, with TORCH_DISTRIBUTED_DEBUG=DETAIL, "
            "an error at once)", fontsize=SMALL + 0.5, color=INK, va="center",
            linespacing=1.3)
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (collective_mismatch,)
