"""Chapter 05, distributed checkpoint: checkpoint, crash, restart, resume."""
from __future__ import annotations

from matplotlib.patches import Rectangle

from distkit.course.diagrams.shapes import (CKPT_EDGE, CKPT_FACE, FAINT, FONT, INK, MONO, RIGHT,
                                            SMALL, STORE_INK, WRONG, arrow, box, canvas, step_mark,
                                            tint, title)
from distkit.course.plots import RANK_COLORS


def _ckpt_mark(ax, x, y0, y1, label):
    """A committed checkpoint on the timeline: a bar between two steps, its folder on top."""
    step_mark(ax, x, y0 - 0.04, y1 + 0.04, CKPT_EDGE, width=0.09)
    ax.text(x, y1 + 0.15, label, ha="center", va="center", fontsize=SMALL, family=MONO,
            color=STORE_INK)


def checkpoint_resume():
    """Fault-tolerant training with Distributed Checkpoint (DCP) on 2 ranks: a run under
    `torchrun --max-restarts 1` loses a rank and resumes from its newest valid checkpoint;
    how one checkpoint is committed atomically; how the resume picks its folder."""
    width, height = 10.5, 8.4
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Fault-tolerant training with DCP on 2 ranks: "
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
                                       facecolor=tint(color, 0.3), edgecolor=color,
                                       linewidth=0.8, zorder=2))
        return ys

    # attempt 0: steps 1..13 done, 14 never finishes; checkpoints after 5 and 10
    a0 = lanes(num_y - 0.32, 1, 13, "attempt 0")
    for rank, y in enumerate(a0):               # step 14: rank 1 killed, rank 0 cut off
        ax.add_patch(Rectangle((x_at(13) + 0.02, y), sw / 2, lane_h, facecolor=tint(
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
    arrow(ax, (x_at(10), a0[1] - 0.08), (x_at(10), a1[0] + lane_h + 0.02),
          color=STORE_INK, lw=1.6, mutation=11)
    ax.text(x_at(10) - 0.08, (a0[1] + a1[0] + lane_h) / 2, "load", ha="right", va="center",
            fontsize=SMALL + 0.5, color=STORE_INK, fontweight="bold")
    for y in a1:                                 # steps 11..13 again: the work lost
        ax.add_patch(Rectangle((x_at(10) + 0.02, y), 3 * sw - 0.04, lane_h,
                               facecolor="none", edgecolor=tint(WRONG, 0.7), hatch="////",
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
    arrow(ax, (gx, ay), (x_at(steps) + 0.1, ay), color="0.35", lw=1.0, mutation=9)
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
    box(ax, fx, ftop - fh, fw, fh, face="0.97", edge="0.45", lw=1.2, round_=0.06)
    ax.text(fx + 0.1, ftop - 0.18, "step_000015.tmp/", fontsize=SMALL + 0.5, family=MONO,
            fontweight="bold", color=INK, va="center")
    ys = [ftop - 0.36 - (k + 1) * row for k in range(len(files))]
    for (order, rank, name, note), y in zip(files, ys):
        color, yc = RANK_COLORS[rank], y + row / 2
        box(ax, wx, y + 0.05, ww, row - 0.1, f"{order} rank {rank}", face=tint(color, 0.14),
            edge=color, lw=1.4, size=SMALL + 0.5, color=color, round_=0.04)
        arrow(ax, (wx + ww, yc), (fx + 0.12, yc), color=color, lw=1.1, mutation=9)
        box(ax, fx + 0.12, y + 0.05, fw - 0.24, row - 0.1, face=tint(color, 0.14),
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
    box(ax, fx + 0.25, cy - 0.19, fw - 0.5, 0.38, face=CKPT_FACE, edge=CKPT_EDGE, lw=1.6)
    ax.text(cx, cy, "step_000015/", ha="center", va="center", fontsize=SMALL + 0.5,
            family=MONO, color=STORE_INK)
    arrow(ax, (cx, ftop - fh), (cx, cy + 0.19), color=INK, lw=1.4, mutation=11)
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
    box(ax, lx - 0.1, ltop - 0.36 - len(folders) * lrow - 0.08, width - lx - 0.05,
        0.36 + len(folders) * lrow + 0.08, face="0.97", edge="0.45", lw=1.2, round_=0.06,
        zorder=0)
    ax.text(lx + 0.05, ltop - 0.18, "checkpoints/", fontsize=SMALL + 0.5, family=MONO,
            fontweight="bold", color=INK, va="center")
    ax.text(width - 0.3, ltop - 0.18, "checked newest first ↓", fontsize=SMALL, color="0.3",
            va="center", ha="right")
    for k, (name, verdict, vcolor, face, edge) in enumerate(folders):
        y = ltop - 0.36 - (k + 1) * lrow
        gone = k == len(folders) - 1
        box(ax, lx + 0.05, y + 0.07, lw_, lrow - 0.14, face=face, edge=edge,
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


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (checkpoint_resume,)
