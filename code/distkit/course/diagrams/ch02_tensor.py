"""Chapter 02, model parallelism (2 of 2): tensor and sequence parallelism, and how DP, PP
and TP combine on a device mesh."""
from __future__ import annotations

from distkit.course.diagrams.shapes import (FONT, INK, MONO, SHARED, SMALL, STORE_EDGE, STORE_FACE,
                                     STORE_INK, arrow, box, canvas, comm, key_boxes, tint,
                                     title)
from distkit.course.plots import RANK_COLORS


def _lanes(ax, x, w, lanes, texts, *, size=SMALL + 0.5, face_amount=0.3):
    """One box per rank lane at x, in the rank's colour (different on every rank)."""
    for rank, ((y, h), text) in enumerate(zip(lanes, texts)):
        color = RANK_COLORS[rank]
        box(ax, x, y, w, h, text, face=tint(color, face_amount), edge=color, lw=1.4,
            size=size)


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
    box(ax, x_in[0], bottom, x_in[1], height, in_text, face=SHARED, size=SMALL + 0.5)
    box(ax, x_norm[0], bottom, x_norm[1], height, "RMSNorm\n\nthe same\non every\nrank",
        face=SHARED, size=SMALL + 0.5)
    comm(ax, x_f[0], x_f[1], bottom, height, "f", forward=False, size=FONT + 4)
    comm(ax, x_g[0], x_g[1], bottom, height, "g", size=FONT + 4)
    box(ax, x_out[0], bottom, x_out[1], height, out_text, face=SHARED, size=SMALL + 0.5)
    for rank, (y, h) in enumerate(lanes):
        ax.text(x_col[0], y + h + label_h / 2, lane_heads[rank], fontsize=SMALL + 0.5,
                fontweight="bold", color=RANK_COLORS[rank], va="center")
    for (x, w), text in zip((x_col, x_op, x_row), texts):
        _lanes(ax, x, w, lanes, text)
    arrow(ax, (x_in[0] + x_in[1], mid), (x_norm[0], mid), mutation=10)
    arrow(ax, (x_norm[0] + x_norm[1], mid), (x_f[0], mid), mutation=10)
    arrow(ax, (x_g[0] + x_g[1], mid), (x_out[0], mid), mutation=10)
    for y, h in lanes:
        m = y + h / 2
        for (xa, wa), (xb, _) in zip((x_f, x_col, x_op, x_row), (x_col, x_op, x_row, x_g)):
            arrow(ax, (xa + wa, m), (xb, m), color=INK, mutation=10)
    return x_out[0], bottom, x_out[1], height


def tensor_parallel():
    """Megatron-style tensor parallelism of a transformer layer on 2 ranks."""
    width, height = 10.5, 8.1
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Tensor parallelism (Megatron-LM) on N = 2 ranks: "
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
    arrow(ax, (cols[0][0] + cols[0][1] / 2, turn), (cols[0][0] + cols[0][1] / 2,
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
        box(ax, x, ky, 5.05, kh, face="white", edge="0.55", round_=0.04)
        comm(ax, x + 0.15, 0.3, ky + kh - 0.38, 0.26, "", forward=fwd)
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
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Sequence parallelism (Korthikanti et al. 2022) around "
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
        box(ax, xa - 0.1, reg_bottom, xb + wb - xa + 0.2, region_top - reg_bottom,
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
    comm(ax, *c_ag, bottom, span, "all-\ngather\nalong S")
    box(ax, *c_full[:1], bottom, c_full[1], span, "[B,S,h]\n\nall S\ntokens,\nthe same\n"
        "on every\nrank", face=SHARED, size=SMALL + 0.5)
    _lanes(ax, *c_col, lanes, ["gate, up proj\ncolumn-parallel\n+ SiLU(gate) · up\n"
                               "→ [B,S,h_ff/N]"] * 2)
    _lanes(ax, *c_row, lanes, ["down_proj\nrow-parallel\n→ partial\n[B,S,h]"] * 2)
    comm(ax, *c_rs, bottom, span, "reduce-\nscatter\nalong S")
    _lanes(ax, *c_out, lanes, ["[B,S/N,h]\ndropout\n+ residual"] * 2)
    arrow(ax, (c_ag[0] + c_ag[1], mid), (c_full[0], mid), mutation=10)
    for y, h in lanes:
        m = y + h / 2
        for (xa, wa), (xb, _) in ((c_in, c_norm), (c_norm, c_ag), (c_full, c_col),
                                  (c_col, c_row), (c_row, c_rs), (c_rs, c_out)):
            arrow(ax, (xa + wa, m), (xb, m), mutation=10)
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
    key_boxes(ax, keys, ky, kh, w=5.0, head_dy=0.22)
    return fig


def _layer_column(ax, x, y, w, layers, rank, *, face=None, text="layer {}"):
    """A stack of layer boxes, layer 0 at the bottom; `layers` = which layers (None: a gap)."""
    h, gap = 0.3, 0.07
    color = RANK_COLORS[rank]
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        box(ax, x, y + i * (h + gap), w, h, text.format(layer), size=SMALL,
            face=face or tint(color, 0.35), edge=INK if face else color, lw=1.2, round_=0.04)
    return [y + i * (h + gap) for i in range(len(layers))], h


def parallelisms():
    """What DP, PP and TP each split, and how they combine on a 2 x 2 x 2 device mesh."""
    width, height = 10.5, 8.8
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Three ways to split training over ranks, "
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
    for p, (head, splits, holds, talks) in enumerate(panels):
        px = 0.15 + p * (pw + 0.15)
        box(ax, px, ptop - ph, pw, ph, face="white", edge="0.55", round_=0.06, zorder=0)
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
                box(ax, x, feed_y, col_w, 0.32, f"batch half {rank}", size=SMALL,
                    face=tint(RANK_COLORS[rank], 0.35), edge=RANK_COLORS[rank], round_=0.04)
                arrow(ax, (x + col_w / 2, feed_y + 0.32), (x + col_w / 2, stack_y),
                      mutation=9)
            comm(ax, gap_x + 0.05, gap_w - 0.1, stack_y, 1.41, "all-\nreduce\ngrads",
                 size=SMALL)
        elif p == 1:   # PP: layers 0-1 on rank 0, layers 2-3 on rank 1
            ys, h = _layer_column(ax, x0, stack_y, col_w, (0, 1, None, None), 0)
            _layer_column(ax, x1, stack_y, col_w, (None, None, 2, 3), 1)
            box(ax, x0, feed_y, col_w, 0.32, "micro-batches", size=SMALL, face=SHARED,
                round_=0.04)
            arrow(ax, (x0 + col_w / 2, feed_y + 0.32), (x0 + col_w / 2, stack_y), mutation=9)
            arrow(ax, (x0 + col_w + 0.05, ys[1] + h / 2), (x1 - 0.05, ys[2] + h / 2),
                  style="<|-|>", color=INK, lw=1.6, mutation=11)
            ax.text(gap_x + gap_w / 2, ys[1] - 0.08, "send/recv", ha="center", va="center",
                    fontsize=SMALL, color=INK)
        else:          # TP: half of every layer on each rank, an all-reduce per block
            for rank, x in enumerate((x0, x1)):
                ys, h = _layer_column(ax, x, stack_y, col_w, range(4), rank,
                                      text="½ of layer {}")
            for y in ys:
                comm(ax, gap_x, gap_w, y + 0.02, h - 0.04, "all-reduce", size=SMALL)
            box(ax, x0, feed_y, x1 + col_w - x0, 0.32, "the whole batch, on both ranks",
                size=SMALL, face=SHARED, round_=0.04)
            for x in (x0, x1):
                arrow(ax, (x + col_w / 2, feed_y + 0.32), (x + col_w / 2, stack_y),
                      mutation=9)
        ty = feed_y - 0.22
        for label, text in (("splits:", splits), ("each rank:", holds), ("talks:", talks)):
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
        box(ax, sx, stage_y, stage_w, stage_h, face="0.97", edge="0.55", round_=0.08, zorder=0)
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
            box(ax, qx, py, pill_w, pill_h, face=STORE_FACE, edge=STORE_EDGE, lw=1.2,
                round_=0.1)
            pills[pp, dp] = (qx, py)
            for tp in range(2):
                rank = 4 * pp + 2 * dp + tp
                cx = qx + pad + tp * (cell_w + pad)
                box(ax, cx, py + pad, cell_w, cell_h, f"rank {rank}", size=SMALL + 0.5,
                    face="white", edge=INK, lw=1.0, round_=0.04, zorder=2)
                cells[rank] = (cx, py + pad)
    # DP: matching ranks of the two replicas all-reduce gradients (vertical arrows);
    # PP: matching ranks of the two stages send/recv (horizontal arrows)
    for rank in (0, 1, 4, 5):
        (x, y), (_, y2) = cells[rank], cells[rank + 2]
        arrow(ax, (x + cell_w / 2, y - pad - 0.02), (x + cell_w / 2, y2 + cell_h + pad + 0.02),
              style="<|-|>", color=STORE_EDGE, lw=1.4, mutation=9)
    for dp in range(2):
        (qx0, py), (qx1, _) = pills[0, dp], pills[1, dp]
        arrow(ax, (qx0 + pill_w + 0.02, py + pill_h / 2), (qx1 - 0.02, py + pill_h / 2),
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
            box(ax, lx, ly - 0.1, 0.26, 0.2, face=STORE_FACE, edge=STORE_EDGE, lw=1.2,
                round_=0.05)
        elif kind == "dp":
            arrow(ax, (lx + 0.13, ly - 0.13), (lx + 0.13, ly + 0.13), style="<|-|>",
                  color=STORE_EDGE, lw=1.4, mutation=8)
        else:
            arrow(ax, (lx, ly), (lx + 0.26, ly), style="<|-|>", color=INK, lw=1.4,
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


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (tensor_parallel, sequence_parallel, parallelisms)
