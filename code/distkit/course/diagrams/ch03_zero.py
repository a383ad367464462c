"""Chapter 03, ZeRO memory math: what each ZeRO stage shards, and the floating-point
formats behind the bytes per parameter."""
from __future__ import annotations

import math

from matplotlib.patches import Rectangle

from distkit.course.diagrams.shapes import (FONT, INK, MONO, RIGHT, SMALL, STORE_EDGE, STORE_FACE,
                                            WRONG, box, canvas, tint, title)
from distkit.memory import GB, MIXED_ADAMW, STAGES, communication_bytes, model_state_bytes
from distkit.course.plots import RANK_COLORS, STATE_COLORS

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
            ax.add_patch(Rectangle((x, y), sw, h, facecolor=tint(color, 0.45),
                                   edgecolor=color, linewidth=1.0, zorder=2))
            ax.text(x + sw / 2, y + h / 2, text, ha="center", va="center", fontsize=SMALL,
                    color=INK, zorder=3)
        else:                       # sharded: 1/n of it, slice `rank`
            ax.add_patch(Rectangle((x, y), sw, h, facecolor="white",
                                   edgecolor=tint(color, 0.5), linewidth=0.9,
                                   linestyle=(0, (3, 2)), zorder=1))
            for i in range(1, n):
                ax.plot([x + i * sw / n] * 2, [y, y + h], color=tint(color, 0.35), lw=0.6,
                        ls=(0, (2, 2)), zorder=1)
            ax.add_patch(Rectangle((x + rank * sw / n, y), sw / n, h,
                                   facecolor=tint(color, 0.45), edgecolor=color,
                                   linewidth=1.0, zorder=2))
            if sw / n > 0.5:
                ax.text(x + (rank + 0.5) * sw / n, y + h / 2, f"{text}/N", ha="center",
                        va="center", fontsize=SMALL, color=INK, zorder=3)
        x += sw + gap


def _text_width(ax, text_artist) -> float:
    """The width of a drawn text, in inches (the data units of a `canvas`)."""
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
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, f"ZeRO: what each of N = {n} data-parallel ranks "
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
            ax.add_patch(Rectangle((lx, ly - 0.09), 0.3, 0.18, facecolor=tint(color, 0.45),
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
        box(ax, 0.15, by, width - 0.3, block_h, face="0.975", edge="0.6", round_=0.06,
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
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "fp32, fp16 and bf16: where the bits go, "
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
            ax.add_patch(Rectangle((x, y), bw, bh, facecolor=tint(color, 0.35),
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
                               0.2, facecolor=tint(color, 0.25), edgecolor="none"))
        ax.add_patch(Rectangle((to_x(d["normal"]), y - 0.1), to_x(d["max"]) - to_x(d["normal"]),
                               0.2, facecolor=tint(color, 0.7), edgecolor="none"))
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
    box(ax, 0.15, 0.12, width - 0.3, 1.0, face=STORE_FACE, edge=STORE_EDGE, round_=0.06)
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


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (zero_stages, float_formats)
