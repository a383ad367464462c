"""Chapter 04, FSDP2: the life of one fully_shard unit through a training step."""
from __future__ import annotations

from distkit.course.diagrams.shapes import (FAINT, FONT, INK, MONO, SMALL, STORE_INK, arrow, box,
                                            canvas, comm, key_boxes, rank_region, tint, title)
from distkit.course.plots import STATE_COLORS


def _life_bar(ax, x0, x1, y, h, text, *, face, edge, ls="-", lw=1.0, color=INK):
    """One buffer's lifetime in a memory row: a bar from x0 to x1 (dashed: optional)."""
    box(ax, x0, y, x1 - x0, h, text, face=face, edge=edge, ls=ls, lw=lw, size=SMALL,
        color=color, round_=0.03, zorder=2)


def fsdp_unit_life(n: int = 2):
    """One FSDP2 unit (a decoder layer under fully_shard) through one training step on n ranks:
    the collectives, the compute, and which of its buffers exist when (torch 2.13's
    FSDPParamGroup.pre_forward / post_forward / pre_backward / post_backward)."""
    width, height = 10.5, 8.95
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, f"FSDP2 on N = {n} ranks: the life of one unit "
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
        comm(ax, x_of(c) + pad, cols[c][2] - 2 * pad, cy, ch, text, size=SMALL)
    # the backward all-gather is issued early: by layer i+1's pre_backward (prefetch)
    ax.text(x_of(GAP, 0.5), cy + ch / 2 + 0.12, "prefetched by\nlayer i+1's\n"
            "pre_backward", ha="center", va="center", fontsize=SMALL,
            color=STORE_INK, linespacing=1.25)
    arrow(ax, (x_of(GAP, 0.1), cy + 0.1), (x_of(AG2) + pad, cy + 0.1), color=STORE_INK,
          lw=1.2, mutation=10)
    for c, text in ((FWD, "forward\nlayer i"), (BWD, "backward\nlayer i"),
                    (STEP, "optim.\nstep()")):
        box(ax, x_of(c) + pad, ky, cols[c][2] - 2 * pad, kh, text,
            face="white", edge=INK, lw=1.4, size=SMALL + 0.5, round_=0.04)
    box(ax, x_of(GAP) + pad, ky, cols[GAP][2] - 2 * pad, kh,
        "layers after i:\nforward, loss,\ntheir backward", face="white", edge=FAINT,
        ls="--", color="0.4", size=SMALL, round_=0.04)
    for c in (RS1, RS2):
        box(ax, x_of(c) + pad, ky, cols[c][2] - 2 * pad, kh,
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
        rank_region(ax, 0.15, top - region_h, width - 0.3, region_h, rank,
                    f"rank {rank}", f"memory of layer i; its own 1/{n} of the batch")
        ys = [top - head_h - (k + 1) * row_h - k * row_gap for k in range(len(rows))]
        for y, label in zip(ys, rows):
            ax.text(0.3, y + row_h / 2, label, va="center", fontsize=SMALL + 0.5, color=INK)
        shard, full, fgrad, gshard = ys
        # the shard: always there (the DTensor the module holds), updated by the step
        _life_bar(ax, x_of(REST), x_of(STEP), shard, row_h,
                  f"its shard of every weight: {halves[rank]} (DTensor, Shard(0))",
                  face=tint(params, 0.45), edge=params)
        _life_bar(ax, x_of(STEP), x_of(STEP, 1), shard, row_h, "updated",
                  face=tint(params, 0.45), edge=INK, lw=1.8)
        # the full parameters: from the all-gather to the reshard, twice
        _life_bar(ax, x_of(AG1, 0.55), x_of(RS1, 0.5), full, row_h, "same on all ranks",
                  face=tint(params, 0.2), edge=params)
        _life_bar(ax, x_of(RS1, 0.5), x_of(AG2, 0.6), full, row_h,
                  "kept if reshard_after_forward=False", face="white", edge=params,
                  ls=(0, (3, 2)), color="0.4")
        _life_bar(ax, x_of(AG2, 0.6), x_of(RS2, 0.5), full, row_h, "same on all ranks",
                  face=tint(params, 0.2), edge=params)
        # the full gradients: from backward until the reduce-scatter is done with them
        _life_bar(ax, x_of(BWD, 0.15), x_of(RS2, 0.85), fgrad, row_h, "from its own batch",
                  face=tint(grads, 0.2), edge=grads)
        # the gradient shard: the mean over ranks of its rows, kept until zero_grad()
        _life_bar(ax, x_of(RS2, 0.55), x_of(STEP, 1), gshard, row_h, "mean, its rows",
                  face=tint(grads, 0.45), edge=grads)
    bottom = region_top - n * region_h - (n - 1) * 0.1
    # faint column lines through every lane
    for x in xs[1:-1]:
        ax.plot([x, x], [bottom + 0.05, hy - 0.38], color="0.85", lw=0.7, ls=(0, (2, 2)),
                zorder=0.5)

    # the time axis
    ay = bottom - 0.2
    arrow(ax, (left, ay), (right + 0.1, ay), color="0.35", lw=1.0, mutation=9)
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
    key_boxes(ax, keys, by, bh, w=5.05, head_dy=0.2)
    ax.text(width / 2, 0.15, "P: parameters of the unit (elements: × 4 bytes in fp32, × 2 "
            f"in bf16);  d: a weight's first dimension;  N = {n} ranks", ha="center",
            va="center", fontsize=SMALL + 0.5, color="0.3")
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (fsdp_unit_life,)
