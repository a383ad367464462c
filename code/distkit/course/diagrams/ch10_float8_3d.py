"""Chapter 10: the two float8 formats and what a scale does; a 4-D device mesh and which
collectives cross each of its dimensions."""
from __future__ import annotations

import math

from matplotlib.patches import Rectangle

from distkit.course.diagrams.shapes import (FONT, INK, MONO, RIGHT, SMALL, STORE_EDGE, STORE_FACE,
                                            WRONG, arrow, box, canvas, tint, title)
from distkit.course.plots import RANK_COLORS

FIELD_COLORS = {"sign": "#c0392b", "exponent": "#2e7d32", "mantissa": "#1f5fa8"}


def _bits(value: float, dtype) -> tuple[str, float]:
    """The 8 bits of `value` cast to a float8 dtype (sign first) and the value kept."""
    import torch
    t = torch.tensor(value).to(dtype)
    return format(int(t.view(torch.uint8).item()), "08b"), t.float().item()


def float8_scaling():
    """e4m3fn and e5m2: bit layouts, ranges (torch.finfo) and casts; and per-tensor scaling:
    a tensor's amax mapped onto 448, and what one outlier does to the other values."""
    import torch

    from distkit.fp8 import E4M3, E5M2, from_float8, to_float8
    width, height = 10.6, 8.4
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "float8: two 1-byte formats, and the scale that makes "
          "them usable")
    formats = (("e4m3fn", E4M3, "4 exponent bits, 3 mantissa: precision (forward)"),
               ("e5m2", E5M2, "5 exponent bits, 2 mantissa: range (gradients)"))
    bw, bh, bx = 0.42, 0.42, 1.6
    for i, (name, dtype, what) in enumerate(formats):
        f = torch.finfo(dtype)
        mant = round(-math.log2(f.eps))
        y = height - 1.3 - i * 1.05
        ax.text(0.2, y + bh / 2 + 0.08, name, fontsize=FONT + 3, fontweight="bold",
                va="center", color=INK)
        ax.text(0.2, y - 0.17, what, fontsize=SMALL, va="center", color="0.3")
        bits, kept = _bits(math.pi, dtype)
        fields = ["sign"] + ["exponent"] * (7 - mant) + ["mantissa"] * mant
        for k, (bit, field) in enumerate(zip(bits, fields)):
            color = FIELD_COLORS[field]
            ax.add_patch(Rectangle((bx + k * (bw + 0.04), y), bw, bh,
                                   facecolor=tint(color, 0.35), edgecolor=color, lw=0.9))
            ax.text(bx + k * (bw + 0.04) + bw / 2, y + bh / 2, bit, ha="center", va="center",
                    fontsize=FONT, family=MONO, color=INK)
        saturated = torch.tensor([500.0, 1e5]).to(dtype).float().tolist()
        lines = (f"π → {kept:g}   max {f.max:g}   smallest normal 2^{round(math.log2(f.tiny))}"
                 f"   eps 2^-{mant}",
                 f"500 → {saturated[0]:g}    1e5 → {saturated[1]:g}"
                 + ("  (saturates: no inf)" if name == "e4m3fn" else "  (overflows to inf)"))
        ax.text(bx + 8 * (bw + 0.04) + 0.25, y + bh / 2 + 0.13, lines[0], fontsize=SMALL + 0.5,
                va="center", family=MONO, color=INK)
        ax.text(bx + 8 * (bw + 0.04) + 0.25, y + bh / 2 - 0.17, lines[1], fontsize=SMALL + 0.5,
                va="center", family=MONO, color=WRONG if name == "e5m2" else INK)

    # the ranges of positive values on a log axis, bf16's for scale
    lo, hi = -6, 6
    x0, x1 = 1.6, width - 0.4
    to_x = lambda v: x0 + (math.log10(v) - lo) / (hi - lo) * (x1 - x0)  # noqa: E731
    ry = height - 3.55
    ax.text(0.2, ry + 0.45, "Positive values each format holds (log scale): light = subnormal,"
            " dark = normal", fontsize=FONT, fontweight="bold", va="center", color=INK)
    for i, (name, dtype) in enumerate((("e4m3fn", E4M3), ("e5m2", E5M2),
                                       ("bf16", torch.bfloat16))):
        f = torch.finfo(dtype)
        sub, top = max(f.tiny * f.eps, 10.0 ** lo), min(f.max, 10.0 ** hi)
        tiny = max(f.tiny, 10.0 ** lo)
        y = ry - i * 0.32
        ax.text(0.2, y, name, fontsize=FONT, fontweight="bold", va="center", color=INK)
        color = FIELD_COLORS["exponent"]
        ax.add_patch(Rectangle((to_x(sub), y - 0.09), to_x(tiny) - to_x(sub), 0.18,
                               facecolor=tint(color, 0.25), edgecolor="none"))
        ax.add_patch(Rectangle((to_x(tiny), y - 0.09), to_x(top) - to_x(tiny), 0.18,
                               facecolor=tint(color, 0.7), edgecolor="none"))
        if name == "bf16":  # far wider than the axis: 1e-41 to 3e38
            ax.text(x1 + 0.02, y, "…", fontsize=FONT, va="center", color="0.3")
            ax.text(x0 - 0.05, y, "…", fontsize=FONT, va="center", ha="right", color="0.3")
    base = ry - 2 * 0.32 - 0.25
    ax.plot([x0, x1], [base, base], color="0.35", lw=1.0)
    for e in range(lo, hi + 1):
        ax.plot([to_x(10.0 ** e)] * 2, [base, base - 0.06], color="0.35", lw=1.0)
        ax.text(to_x(10.0 ** e), base - 0.2, f"$10^{{{e}}}$", ha="center", va="center",
                fontsize=SMALL, color="0.3")

    # scaling: x * scale puts amax on 448; an outlier pushes the rest below the normal range
    sy = base - 0.85
    ax.text(0.2, sy, "Per-tensor scaling: scale = 448 / amax(|x|), x8 = cast(x × scale), "
            "x ≈ x8 / scale", fontsize=FONT, fontweight="bold", va="center", color=INK)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    cases = (("a gaussian tensor (amax ≈ 4.6)", x),
             ("the same with one outlier of 1e5", x.clone().index_put_((torch.tensor(0),
                                                                       torch.tensor(7)),
                                                                      torch.tensor(1e5))))
    for i, (label, t) in enumerate(cases):
        t8, scale = to_float8(t)
        back = from_float8(t8, scale)
        rest = slice(1, None)
        zeros = (t8[rest].float() == 0).float().mean().item()
        err = ((back[rest] - t[rest]).norm() / t[rest].norm()).item()
        y = sy - 0.55 - i * 0.75
        ok = err < 0.05
        box(ax, 0.2, y - 0.3, 3.5, 0.6, f"{label}\nthe other values: error {100 * err:.0f} %, "
            f"{100 * zeros:.0f} % flushed to 0", face="white", edge=RIGHT if ok else WRONG,
            size=SMALL + 0.5, color=RIGHT if ok else WRONG)
        # where the scaled values land: the typical |x| x scale, and amax x scale = 448
        typical = t[rest].abs().median().item() * scale.item()
        ax.add_patch(Rectangle((to_x(2.0 ** -9), y - 0.04), to_x(448) - to_x(2.0 ** -9), 0.08,
                               facecolor=tint(FIELD_COLORS["exponent"], 0.5), edgecolor="none"))
        ax.plot([to_x(typical)] * 2, [y - 0.2, y + 0.2], color=RANK_COLORS[0], lw=2.2)
        ax.plot([to_x(448)] * 2, [y - 0.2, y + 0.2], color=WRONG, lw=2.2)
        ax.text(to_x(typical), y + 0.3, "typical |x| × scale", ha="center", va="center",
                fontsize=SMALL, color=RANK_COLORS[0])
        ax.text(to_x(448), y - 0.3, "amax → 448", ha="center", va="center", fontsize=SMALL,
                color=WRONG)
    box(ax, 0.15, 0.12, width - 0.3, 0.72, face=STORE_FACE, edge=STORE_EDGE, round_=0.06)
    ax.text(width / 2, 0.48, "One scale per tensor fits e4m3's ~18 powers of two to its largest "
            "value; one scale per row (row-wise) keeps\nan outlier's damage to its own row. "
            "Matmuls take the inverse scales: (a8 / s_a) @ (b8 / s_b), accumulated in fp32.",
            ha="center", va="center", fontsize=SMALL + 1, color=INK, linespacing=1.4)
    return fig


def mesh_4d():
    """A 4-D mesh of 16 ranks (pp 2, dp_shard 2, cp 2, tp 2) as torchtitan lays it out: rank 0's
    group on each dimension, and the communication that crosses it."""
    from distkit.plan3d import Composed
    layout = Composed(pp=2, dp_shard=2, cp=2, tp=2, microbatches=2)
    width, height = 10.6, 6.6
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "A 4-D mesh: pp × dp_shard × cp × tp = 2 × 2 × 2 × 2 = 16 "
          "ranks (tp innermost, pp outermost)")
    dims = {"tp": RANK_COLORS[0], "cp": RANK_COLORS[1], "dp_shard": RANK_COLORS[2],
            "pp": RANK_COLORS[3]}
    gw, gh, pad = 1.15, 0.62, 0.2
    place = {}
    for rank in range(layout.gpus):
        c = layout.coords(rank)
        node_x = 0.35 + c["pp"] * 3.35  # a node per stage; in it tp across, (dp, cp) down
        x = node_x + 0.2 + c["tp"] * (gw + pad)
        y = height - 1.55 - (c["dp_shard"] * 2 + c["cp"]) * (gh + pad)
        place[rank] = (x, y)
    for p in range(2):
        node_x = 0.35 + p * 3.35
        box(ax, node_x, height - 1.55 - 3 * (gh + pad) - 0.2, 2 * gw + pad + 0.4,
            4 * (gh + pad) + 0.55, face=tint(dims["pp"], 0.07), edge=dims["pp"], lw=1.3,
            round_=0.1, zorder=0)
        ax.text(node_x + 0.15, height - 0.62, f"pipeline stage {p}: node {p}, 8 GPUs",
                fontsize=FONT, fontweight="bold", color=dims["pp"], va="center")
    zero_groups = {d: set(layout.group(0, d)) for d in dims}
    for rank, (x, y) in place.items():
        c = layout.coords(rank)
        edge = INK if rank == 0 else "0.55"
        box(ax, x, y, gw, gh, f"rank {rank}\npp{c['pp']} dp{c['dp_shard']} cp{c['cp']} "
            f"tp{c['tp']}", face="white" if rank else tint(RIGHT, 0.2), edge=edge,
            lw=1.8 if rank == 0 else 0.9, size=SMALL - 0.5, zorder=2)
    # rank 0's group on each dimension: a line from rank 0 to its partner
    x0, y0 = place[0]
    for d, color in dims.items():
        (other,) = zero_groups[d] - {0}
        x, y = place[other]
        arrow(ax, (x0 + gw / 2, y0 + gh / 2), (x + gw / 2, y + gh / 2), color=color, lw=2.6,
              style="-", rad=0.3 if d in ("pp", "dp_shard") else 0.0, zorder=1.5)
    rows = (("tp", "tensor parallel: all-gather / reduce-scatter of activations in every layer "
             "(sequence parallel); inside a node, NVLink"),
            ("cp", "context parallel: keys and values exchanged in every attention (all-gather"
             " or ring); FSDP shards over dp_shard × cp"),
            ("dp_shard", "FSDP: all-gather the weights, reduce-scatter the gradients "
             "(torchtitan: over the flattened dp_shard_cp)"),
            ("pp", "pipeline: send/recv of one micro-batch's activations to the next stage, "
             "gradients back; between nodes"))
    ty = 1.75
    ax.text(7.35, height - 0.95, "rank 0's partner on each dimension", fontsize=FONT,
            fontweight="bold", color=INK, va="center")
    for i, (d, text) in enumerate(rows):
        y = height - 1.35 - i * 0.42
        ax.plot([7.35, 7.75], [y, y], color=dims[d], lw=2.6)
        ax.text(7.85, y, f"{d}: ranks {sorted(zero_groups[d])}", fontsize=SMALL + 0.5,
                family=MONO, va="center", color=INK)
    for i, (d, text) in enumerate(rows):
        y = ty - i * 0.36
        ax.text(0.35, y, f"{d:9s}", fontsize=SMALL + 0.5, family=MONO, fontweight="bold",
                color=dims[d], va="center")
        ax.text(1.35, y, text, fontsize=SMALL + 0.5, va="center", color=INK)
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (float8_scaling, mesh_4d)
