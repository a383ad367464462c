"""Chapter 02, model parallelism (1 of 2): naive model parallelism, and weight staleness in
an asynchronous pipeline."""
from __future__ import annotations

from matplotlib.patches import Rectangle

from distkit.course.diagrams.shapes import (FONT, INK, RIGHT, SMALL, WRONG, arrow, box, canvas,
                                     rank_region, slot, tint, title)
from distkit.course.plots import RANK_COLORS


def model_parallel():
    """Naive model parallelism on 2 ranks: the layers split in two, one rank busy at a time."""
    width, height = 10.6, 6.1
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Naive model parallelism on 2 ranks: "
          "each rank holds some of the layers")

    # the model, cut in two: rank 0 runs the first layers, rank 1 the rest and the loss
    ry, rh, bh = height - 2.75, 1.95, 0.8     # regions: bottom, height; layer boxes: height
    regions = ((0, 0.15, 3.7, ("embedding", "layer 0", "layer 1")),
               (1, 5.75, 4.7, ("layer 2", "layer 3", "norm", "head\n+ loss")))
    by = ry + 0.45
    ends = {}
    for rank, x0, w, layers in regions:
        color = RANK_COLORS[rank]
        rank_region(ax, x0, ry, w, rh, rank, f"rank {rank}",
                    "its layers' weights, grads, optimizer state")
        bw, gap = 0.95, (w - 0.3 - len(layers) * 0.95) / (len(layers) - 1)
        xs = [x0 + 0.15 + i * (bw + gap) for i in range(len(layers))]
        for i, (x, name) in enumerate(zip(xs, layers)):
            box(ax, x, by, bw, bh, name, face=tint(color, 0.35), edge=color, lw=1.4)
            if i:
                arrow(ax, (xs[i - 1] + bw, by + bh / 2), (x, by + bh / 2), mutation=10)
        ends[rank] = (xs[0], xs[-1] + bw)
        # what comes in from the data loader: the inputs on rank 0, the labels on rank 1
        feed = "input ids [B,S]" if rank == 0 else "labels [B,S]"
        fx = xs[0] + bw / 2 if rank == 0 else xs[-1] + bw / 2
        arrow(ax, (fx, ry - 0.35), (fx, by), color="0.35")
        ax.text(fx + 0.1, ry - 0.22, feed, fontsize=SMALL, color="0.3", va="center")
    # between the ranks: activations forward, their gradients backward (point to point)
    x0, x1 = ends[0][1], ends[1][0]
    mid = (x0 + x1) / 2
    fy, gy = by + bh * 0.72, by + bh * 0.28
    arrow(ax, (x0, fy), (x1, fy), color=RANK_COLORS[0], lw=2.0)
    arrow(ax, (x1, gy), (x0, gy), color=RANK_COLORS[1], lw=2.0)
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
            slot(ax, tx + t0 * unit + 0.02, y, (t1 - t0) * unit - 0.04, lane_h, kind, rank,
                 text, size=SMALL if kind == "step" else FONT)
    # the two messages of the step: activations at t = 1, gradients at t = 4
    arrow(ax, (tx + unit, l0), (tx + unit, l1 + lane_h), color=RANK_COLORS[0], lw=1.6,
          mutation=10)
    arrow(ax, (tx + 4 * unit, l1 + lane_h), (tx + 4 * unit, l0), color=RANK_COLORS[1], lw=1.6,
          mutation=10)
    end = tx + 6.45 * unit
    arrow(ax, (tx, 0.52), (end + 0.1, 0.52), color="0.35", lw=1.0, mutation=9)
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
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Weight staleness in a 2-stage pipeline: "
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
                    slot(ax, x, y, sw - 0.04, lane_h, "idle", stage, "idle", size=SMALL)
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
                slot(ax, x, y, sw - 0.04, lane_h, kind, stage, text, bold=m == 2,
                     size=SMALL)
        if mode == "sync":                    # the optimizer step after the flush
            box(ax, gx + (slots - 1) * sw + 0.02, l1, sw - 0.04, l0 + lane_h - l1,
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
    arrow(ax, (gx, ay), (gx + slots * sw, ay), color="0.35", lw=1.0, mutation=9)
    for t in range(slots):
        ax.text(gx + (t + 0.5) * sw, ay + 0.13, str(t + 1), ha="center", va="center",
                fontsize=SMALL, color="0.3")
    ax.text(gx, ay - 0.22, "time slot →  (schematic: F = forward, B = backward of micro-batch "
            "k, one slot each; bold: micro-batch 2)", fontsize=SMALL, color="0.3",
            va="center")
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (model_parallel, pipedream_staleness)
