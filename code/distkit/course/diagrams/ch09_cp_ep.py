"""Chapter 09's diagrams: ring attention and its causal balance, Ulysses' all-to-all, and expert
parallelism's dispatch and combine."""
from __future__ import annotations

import math

from distkit.course.diagrams.shapes import (FAINT, FONT, INK, SHARED, SMALL, arrow, box, canvas,
                                            tint, title)
from distkit.course.plots import RANK_COLORS
from distkit.cp import causal_work, contiguous, head_tail, pair_kind


def _score_grid(ax, x0, y0, size, layout, heading):
    """The causal score matrix of a sequence in chunks (queries down, keys across): each
    needed chunk pair in the colour of the rank that owns its queries (a triangle on the
    diagonal), the pairs above the diagonal left blank; each rank's work beside its rows."""
    chunks = sum(len(c) for c in layout)
    cell = size / chunks
    owner = {c: r for r, cs in enumerate(layout) for c in cs}
    ax.text(x0 + size / 2, y0 + size + 0.3, heading, ha="center", fontsize=FONT,
            fontweight="bold", color=INK)
    ax.text(x0 + size / 2, y0 + size + 0.08, "keys (chunks) →", ha="center", fontsize=SMALL,
            color=INK)
    ax.text(x0 - 0.35, y0 + size / 2, "← queries (chunks)", ha="right", va="center",
            rotation=90, fontsize=SMALL, color=INK)
    for q in range(chunks):
        color = RANK_COLORS[owner[q]]
        y = y0 + size - (q + 1) * cell
        for k in range(chunks):
            x = x0 + k * cell
            kind = pair_kind(q, k, causal=True)
            if kind == "full":
                box(ax, x, y, cell, cell, face=tint(color, 0.55), edge="white", lw=0.8,
                    round_=0.0)
            elif kind == "diagonal":
                ax.fill([x, x, x + cell], [y + cell, y, y], color=tint(color, 0.55), lw=0)
        ax.text(x0 - 0.03, y + cell / 2, f"r{owner[q]}", ha="right", va="center",
                fontsize=SMALL - 1, color=color, fontweight="bold")
    box(ax, x0, y0, size, size, face="none", edge=INK, lw=1.0, round_=0.0)
    work = causal_work(layout, 8192)
    shares = "   ".join(f"rank {r}: {100 * w / sum(work):.0f} %" for r, w in enumerate(work))
    ax.text(x0 + size / 2, y0 - 0.22, "share of the causal scores each rank computes:",
            ha="center", fontsize=SMALL, color=INK)
    ax.text(x0 + size / 2, y0 - 0.45, shares, ha="center", fontsize=SMALL, color=INK)


def cp_ring_attention(n: int = 4):
    """Ring attention on N ranks: the K/V blocks travel round the ring while each rank's
    queries stay; under a causal mask, contiguous chunks leave the last rank most of the work,
    torch's head-tail order (rank r: chunks r and 2N-1-r) evens it."""
    width, height = 12.4, 5.0
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.28, f"Ring attention on N = {n} ranks, and its causal "
          "balance")
    # (a) the ring
    cx, cy, radius = 2.1, 2.5, 1.45
    spots = [(cx + radius * math.sin(2 * math.pi * r / n), cy + radius * math.cos(
        2 * math.pi * r / n)) for r in range(n)]
    for r, (x, y) in enumerate(spots):
        color = RANK_COLORS[r]
        box(ax, x - 0.55, y - 0.32, 1.1, 0.64, f"rank {r}\nQ{r} stays\nK/V from r{(r - 1) % n}",
            face=tint(color, 0.25), edge=color, lw=1.4, size=SMALL - 0.5)
    for r in range(n):
        (x0, y0), (x1, y1) = spots[r], spots[(r + 1) % n]
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        dx, dy = x1 - x0, y1 - y0
        length = math.hypot(dx, dy)
        ux, uy = dx / length, dy / length
        arrow(ax, (mx - 0.3 * ux, my - 0.3 * uy), (mx + 0.3 * ux, my + 0.3 * uy),
              color=INK, mutation=12, lw=1.4)
    ax.text(cx, 0.3, "each step: compute with the K/V block I hold, pass it on;\nN blocks, N - 1 "
            "transfers, merged by the online softmax", ha="center", fontsize=SMALL, color=INK)
    # (b) and (c): who computes which scores
    _score_grid(ax, 5.0, 1.05, 3.0, contiguous(n), "contiguous chunks")
    _score_grid(ax, 9.05, 1.05, 3.0, head_tail(n), "head-tail (torch's default)")
    return fig


def cp_ulysses(n: int = 2, heads: int = 4):
    """Ulysses on N ranks: an all-to-all turns "all heads of my S/N tokens" into "my H/N heads of
    all S tokens"; attention runs per head; a second all-to-all turns it back."""
    width, height = 11.6, 3.7
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.28, f"Ulysses on N = {n} ranks: {heads} heads, the tokens "
          f"in {n} chunks")
    cell_w, cell_h, y0 = 0.6, 0.4, 0.85

    def grid(x0, rank, cells, label):
        """cells: the (head, chunk) pairs this rank holds, at their place in the H x N grid."""
        top = y0 + heads * cell_h
        ax.text(x0 + n * cell_w / 2, top + 0.42, f"rank {rank}", ha="center",
                fontsize=FONT, fontweight="bold", color=RANK_COLORS[rank])
        ax.text(x0 + n * cell_w / 2, top + 0.15, label, ha="center", fontsize=SMALL,
                color=INK)
        for h in range(heads):
            for c in range(n):
                held = (h, c) in cells
                box(ax, x0 + c * cell_w, y0 + (heads - 1 - h) * cell_h, cell_w, cell_h,
                    f"h{h} t{c}" if held else "", face=tint(RANK_COLORS[c], 0.45) if held
                    else "white", edge=INK if held else FAINT, lw=0.8, round_=0.0,
                    size=SMALL - 1, ls="-" if held else ":")
    for r in range(n):
        before = {(h, r) for h in range(heads)}
        lo, hi = r * heads // n, (r + 1) * heads // n
        after = {(h, c) for h in range(lo, hi) for c in range(n)}
        grid(0.4 + r * 2.0, r, before, f"tokens t{r}, all heads")
        grid(7.6 + r * 2.0, r, after, f"heads {lo}-{hi - 1}, all tokens")
    mid = y0 + heads * cell_h / 2
    box(ax, 4.55, mid - 0.55, 2.5, 1.1, "one all-to-all\nper tensor\n(q, k and v)",
        face=SHARED, size=SMALL)
    arrow(ax, (3.75, mid), (4.55, mid), mutation=12)
    arrow(ax, (7.05, mid), (7.55, mid), mutation=12)
    ax.text(width / 2, 0.38, "then attention per head over the whole sequence, and one more "
            "all-to-all takes the output back to the token layout (left)", ha="center",
            fontsize=SMALL, color=INK)
    ax.text(width / 2, 0.12, "colour = the token chunk; each all-to-all sends (N-1)/N of its "
            "tensor; the heads and the key/value heads must divide by N", ha="center",
            fontsize=SMALL, color=INK)
    return fig


def moe_expert_parallel():
    """Expert parallelism on 2 ranks, 4 experts, top-2: route, sort by expert, exchange the
    counts, dispatch (uneven), the local experts as one grouped GEMM, return, combine."""
    width, height = 12.6, 4.6
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.28, "Expert parallelism on 2 ranks: 4 experts, each token "
          "to its top 2")
    steps = [("tokens\n(this rank's)", 0.2, 1.15), ("router:\ntop-2 experts\nand weights",
                                                      1.6, 1.3),
             ("sort pairs\nby expert\n(= by rank)", 3.15, 1.25),
             ("all-to-all\nthe counts\n(host waits)", 4.65, 1.25),
             ("all-to-all\nthe rows\n(uneven)", 6.15, 1.25),
             ("my experts:\none grouped\nGEMM", 7.65, 1.35),
             ("all-to-all\nthe outputs\nback", 9.25, 1.25),
             ("combine:\nunsort, x weight,\nsum the 2", 10.75, 1.6)]
    for rank, y in ((0, 2.45), (1, 0.85)):
        color = RANK_COLORS[rank]
        ax.text(0.2, y + 1.12, f"rank {rank}" + ("  (experts 0, 1)" if rank == 0 else
                                                 "  (experts 2, 3)"),
                fontsize=FONT, fontweight="bold", color=color)
        for i, (text, x, w) in enumerate(steps):
            comm_step = text.startswith("all-to-all")
            box(ax, x, y, w, 0.95, text, face=SHARED if comm_step else tint(color, 0.3),
                edge=INK if comm_step else color, lw=1.2, size=SMALL)
            if i + 1 < len(steps):
                nxt = steps[i + 1][1]
                arrow(ax, (x + w, y + 0.47), (nxt, y + 0.47), mutation=10)
    for x in (4.65 + 0.62, 6.15 + 0.62, 9.25 + 0.62):  # the exchanges cross the ranks
        arrow(ax, (x - 0.2, 2.45), (x + 0.2, 1.8), color=INK, mutation=10, lw=1.0)
        arrow(ax, (x + 0.2, 1.8), (x - 0.2, 2.45), color=INK, mutation=10, lw=1.0, rad=0.0)
    ax.text(width / 2, 0.3, "backward: the same exchanges in reverse (the gradients of the "
            "rows and outputs); the experts stay on their rank, the tokens travel",
            ha="center", fontsize=SMALL, color=INK)
    return fig


DIAGRAMS = (cp_ring_attention, cp_ulysses, moe_expert_parallel)
