"""Chapter 06, the capstone: one optimizer step of train_llama.py and the work around it,
and how a job starts on many nodes."""
from __future__ import annotations

import math

from distkit.course.diagrams.shapes import (CKPT_EDGE, FAINT, FONT, INK, MONO, RIGHT, SHARED, SMALL,
                                     STORE_EDGE, STORE_FACE, STORE_INK, WRONG, arrow, box, canvas,
                                     comm, slot, step_mark, tint, title)
from distkit.course.plots import RANK_COLORS

EVAL_COLOR = RIGHT  # capstone_step: an evaluation of the held-out loss


def _lr_at(step: int, steps: int, warmup: int, peak: float, low: float) -> float:
    """ch06_capstone/train_llama.py's lr_at(): linear warm-up to `peak` over `warmup` steps,
    then cosine decay to `low` at the end (step `steps`)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * min(1.0, progress)))


def capstone_step():
    """One optimizer step of ch06_capstone/train_llama.py on 2 ranks, 2 micro-batches each,
    with FSDP2's collectives (torch 2.13: FSDPParamGroup's pre_forward, post_forward,
    pre_backward, post_backward with reduce_grads off until the last micro-batch); and the
    work around the steps: learning rate, evaluation, checkpoints, metrics, a stop signal."""
    width, height = 10.5, 9.6
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "One optimizer step of train_llama.py on 2 ranks:  "
          "--batch-size 16  --micro-batch 4")

    # --- 1: the step, left to right ------------------------------------------------------
    top = height - 0.75
    ax.text(0.15, top, "1   The step: 16 sequences, 8 per rank, run as 2 micro-batches of 4; "
            "gradients accumulate, then one reduce-scatter", fontsize=FONT, fontweight="bold",
            color=INK, va="center")
    cols = {"batch": (0.15, 1.15), "f0": (1.5, 0.9), "b0": (2.58, 1.1), "f1": (3.93, 0.9),
            "b1": (5.01, 1.1), "clip": (6.31, 1.15), "adam": (7.64, 1.05), "end": (8.87, 1.48)}
    x_of = lambda k: cols[k][0]  # noqa: E731
    end = lambda k: cols[k][0] + cols[k][1]  # noqa: E731
    heads = (("batch", "batch", "global batch", "batch_of(step)"),
             ("f0", "b0", "micro-batch 0", "no gradient sync"),
             ("f1", "b1", "micro-batch 1 (the last)", "gradient sync"),
             ("clip", "clip", "clip", "--clip 1.0"),
             ("adam", "adam", "AdamW", "lr = lr_at(step)"),
             ("end", "end", "end of the step", ""))
    for a, b, head, sub in heads:
        mid = (x_of(a) + end(b)) / 2
        ax.text(mid, top - 0.36, head, ha="center", va="center", fontsize=FONT,
                fontweight="bold", color=INK)
        if sub:
            ax.text(mid, top - 0.58, sub, ha="center", va="center", fontsize=SMALL,
                    family=MONO if "(" in sub or "--" in sub else None, color="0.35")
    lane_h, comm_h, gap = 0.85, 0.78, 0.1
    l0 = top - 0.75 - lane_h
    cm = l0 - gap - comm_h
    l1 = cm - gap - lane_h
    # per rank: its slice of the batch, the micro-batches, clip, AdamW, the end of the step
    for rank, y in enumerate((l0, l1)):
        color = RANK_COLORS[rank]
        x, w = cols["batch"]
        box(ax, x, y, w, lane_h, face=tint(color, 0.12), edge=color, lw=1.4)
        ax.text(x + w / 2, y + lane_h - 0.17, f"rank {rank}", ha="center", va="center",
                fontsize=FONT, fontweight="bold", color=color)
        ax.text(x + w / 2, y + lane_h - 0.37, f"sequences {8 * rank}–{8 * rank + 7}",
                ha="center", va="center", fontsize=SMALL, color=INK)
        for m in range(2):
            box(ax, x + 0.08 + m * (w - 0.16) / 2 + 0.02 * m, y + 0.08, (w - 0.2) / 2, 0.28,
                f"mb {m}", face=tint(color, 0.35), edge=color, size=SMALL, round_=0.03)
        mid = y + lane_h / 2
        texts = {"f0": "forward:\neach layer;\nloss ÷ 2",
                 "b0": "backward:\nfull grads,\nkept",
                 "f1": "forward:\neach layer;\nloss ÷ 2",
                 "b1": "backward:\nfull grads,\nadded",
                 "clip": "its grad shard\n× min(1, c/‖g‖)",
                 "adam": "AdamW on\nits shard:\n½ the params\nand its m, v",
                 "end": ("metrics line\n→ metrics.jsonl" if rank == 0 else
                         "its loss, memory\n→ rank 0's line")}
        for key, text in texts.items():
            kind = key[0]
            if kind in "fb":
                slot(ax, x_of(key), y, cols[key][1], lane_h, "F" if kind == "f" else "B",
                     rank, text, size=SMALL + 0.5)
            else:
                box(ax, x_of(key), y, cols[key][1], lane_h, text, face="white", edge=INK,
                    lw=1.2, size=SMALL + 0.5)
        order = ("batch", "f0", "b0", "f1", "b1", "clip", "adam", "end")
        for a, b in zip(order, order[1:]):
            arrow(ax, (end(a) + 0.01, mid), (x_of(b) - 0.01, mid), mutation=9, lw=1.1)
    # the collectives, between the ranks' lanes: yellow moves bytes, dashed white does not
    ax.text(x_of("batch") + cols["batch"][1] / 2, cm + comm_h / 2,
            "collectives\n(both ranks)", ha="center", va="center", fontsize=SMALL + 0.5,
            fontweight="bold", color=STORE_INK, linespacing=1.3)
    for key in ("f0", "f1"):
        comm(ax, x_of(key), cols[key][1], cm, comm_h, "all-gather\neach layer's\nweights",
             size=SMALL + 0.5)
    split = 0.32                                   # the backward columns: all-gather on top
    for key, last in (("b0", False), ("b1", True)):
        x, w = cols[key]
        comm(ax, x, w, cm + comm_h - split, split, "all-gather ¹", size=SMALL + 0.5)
        comm(ax, x, w, cm, comm_h - split - 0.05,
             "reduce-scatter\n→ grad shard" if last else "no reduce-\nscatter",
             forward=last, size=SMALL + 0.5)
    comm(ax, x_of("clip"), cols["clip"][1], cm, comm_h, "all-reduce:\n‖g‖ over all\nshards",
         size=SMALL + 0.5)
    # agree(): the loss, the norm and the stop flag are all-reduced BEFORE optimizer.step(), so
    # a non-finite step stops every rank before it reaches the weights (issue 45)
    comm(ax, x_of("adam"), cols["adam"][1], cm, comm_h, "first:\nall-reduce\nloss, stop flag",
         size=SMALL + 0.5)
    comm(ax, x_of("end"), cols["end"][1], cm, comm_h, "all-gather:\nmemory (on\nlogging steps)",
         size=SMALL + 0.5)
    ny = l1 - 0.22
    for i, note in enumerate((
            "model.set_requires_gradient_sync(i == accum − 1): micro-batch 0's backward keeps "
            "each layer's full gradients (P per layer); the last",
            "micro-batch adds to them and reduce-scatters them (mean over ranks), layer by layer "
            "as its backward goes.   ‖g‖: the norm of the whole gradient.",
            "¹ --reshard-after-forward 1 (the default, ZeRO-3): a layer's full weights are freed "
            "after its forward and gathered again for backward;",
            "  0 (ZeRO-2) keeps them from forward to backward: no second all-gather, more "
            "memory.   P: one layer's parameters.")):
        ax.text(0.15, ny - i * 0.21, note, fontsize=SMALL, color="0.3", va="center")

    # --- 2: around the steps ---------------------------------------------------------------
    steps, warmup, stop_at, eval_every, save_every = 20, 4, 17, 5, 10
    sec = ny - 3 * 0.21 - 0.45
    ax.text(0.15, sec, f"2   Around the steps:  --max-steps {steps}  --warmup {warmup}  "
            f"--eval-every {eval_every}  --save-every {save_every},  a SIGTERM during step "
            f"{stop_at}", fontsize=FONT, fontweight="bold", color=INK, va="center")
    gx, sw = 2.0, 0.385
    x_at = lambda s: gx + s * sw  # noqa: E731  (the boundary after step s)

    def label(y, head, sub=""):
        ax.text(0.15, y + (0.09 if sub else 0), head, fontsize=SMALL + 0.5, fontweight="bold",
                color=INK, va="center")
        if sub:
            ax.text(0.15, y - 0.11, sub, fontsize=SMALL, color="0.35", va="center")

    # the learning rate of each step
    band_top, band_bot = sec - 0.3, sec - 1.12
    peak, low = 1.0, 0.1
    y_of = lambda lr: band_bot + lr / peak * (band_top - band_bot)  # noqa: E731
    label((band_top + band_bot) / 2, "learning rate", "lr_at(step)")
    for lr, name in ((peak, "--lr"), (low, "--min-lr")):
        ax.plot([gx, x_at(steps)], [y_of(lr)] * 2, color="0.7", lw=0.8, ls=(0, (2, 2)),
                zorder=1)
        ax.text(x_at(steps) + 0.06, y_of(lr), name, fontsize=SMALL, family=MONO, color="0.35",
                va="center")
    ax.plot([gx, x_at(steps)], [band_bot] * 2, color="0.35", lw=0.8)
    lrs = [_lr_at(s, steps, warmup, peak, low) for s in range(steps)]
    ax.plot([x_at(s + 0.5) for s in range(steps)], [y_of(v) for v in lrs], color=INK, lw=1.4,
            marker="o", markersize=3.5, zorder=3)
    ax.text(x_at(warmup - 0.6), y_of(0.3), "linear\nwarm-up", ha="center", va="center",
            fontsize=SMALL, color="0.3", linespacing=1.2)
    ax.text(x_at(7), y_of(0.2), "cosine decay to --min-lr at the end",
            ha="left", va="center", fontsize=SMALL, color="0.3")

    # the steps: done, stopped, done again after --resume
    sy, sh = band_bot - 0.42, 0.3
    label(sy + sh / 2, "optimizer step", "section 1")
    for s in range(1, steps + 1):
        later = s > stop_at
        box(ax, x_at(s - 1) + 0.02, sy, sw - 0.04, sh, str(s), size=SMALL,
            face="white" if later else SHARED, edge=FAINT if later else "0.45",
            ls="--" if later else "-", color="0.45" if later else INK, round_=0.03)
    # a stop signal during step 17: the flag rides on the all-reduce before AdamW
    gy = sy - 0.3
    arrow(ax, (x_at(stop_at - 0.5), gy - 0.06), (x_at(stop_at - 0.5), sy), color=WRONG,
          lw=1.6, mutation=10)
    ax.text(x_at(stop_at - 0.5) - 0.12, gy, "SIGTERM (Slurm, before its time limit) or SIGUSR1: "
            "the handler sets a flag; the all-reduce before AdamW tells every rank", ha="right",
            va="center", fontsize=SMALL, color=WRONG)
    ax.text(x_at(stop_at + 1.5), gy, "run again\nwith --resume", ha="center", va="center",
            fontsize=SMALL, color="0.35", linespacing=1.15)
    rows = {"metrics": gy - 0.37, "eval": gy - 0.77, "ckpt": gy - 1.17}
    label(rows["metrics"], "metrics line", "every step, rank 0")
    label(rows["eval"], "evaluation", f"every {eval_every} steps")
    label(rows["ckpt"], "checkpoint (DCP)", f"every {save_every}, and on a stop")
    mh = 0.22
    for s in range(1, steps + 1):
        step_mark(ax, x_at(s), rows["metrics"] - mh / 2, rows["metrics"] + mh / 2,
                  "0.55" if s <= stop_at else "0.82")
    for s in [0] + [s for s in range(1, steps + 1) if s % eval_every == 0 or s == steps]:
        step_mark(ax, x_at(s), rows["eval"] - mh / 2, rows["eval"] + mh / 2,
                  EVAL_COLOR if s <= stop_at else tint(EVAL_COLOR, 0.4))
    for s in sorted({s for s in range(1, steps + 1) if s % save_every == 0} | {stop_at}):
        step_mark(ax, x_at(s), rows["ckpt"] - mh / 2, rows["ckpt"] + mh / 2,
                  CKPT_EDGE if s <= stop_at else tint(CKPT_EDGE, 0.4))
        ax.text(x_at(s) - 0.1, rows["ckpt"], f"step_{s:06d}", ha="right", va="center",
                fontsize=SMALL, family=MONO, color=STORE_INK)
    ky = rows["ckpt"] - 0.38
    for i, note in enumerate((
            "evaluation: the held-out loss, each rank on its share of the held-out sequences, "
            "the sums all-reduced; also before step 1 and after the last.",
            "checkpoint: dcp.save, each rank writes its own shards in parallel, rank 0 commits "
            "the folder (chapter 05); after the stop signal: save, then exit.",
            "metrics line: loss, lr, grad_norm, tokens/s, memory per rank (MFU on GPU) → "
            "metrics.jsonl, and TensorBoard with --tensorboard.")):
        ax.text(0.15, ky - i * 0.21, note, fontsize=SMALL, color="0.3", va="center")
    return fig


def _process(ax, x, y, w, h, rank, lines, *, device):
    """One worker process started by torchrun: 'rank r' in its colour, its device, env vars."""
    color = RANK_COLORS[rank % 10]
    box(ax, x, y, w, h, face=tint(color, 0.14), edge=color, lw=1.4, round_=0.05)
    ax.text(x + 0.1, y + h - 0.17, f"rank {rank}", fontsize=FONT, fontweight="bold",
            color=color, va="center")
    ax.text(x + w - 0.1, y + h - 0.17, device, fontsize=SMALL, family=MONO, color="0.35",
            va="center", ha="right")
    ax.text(x + 0.1, y + h - 0.33, "\n".join(lines), fontsize=SMALL, family=MONO, color=INK,
            va="top", linespacing=1.3)


def multinode_launch():
    """How a job starts on many nodes (Slurm: sbatch, srun, one torchrun per node, a c10d
    rendezvous, ranks, processes; torch 2.13's DynamicRendezvousHandler numbers the nodes in
    sorted order of their names), and its rehearsal on one machine with two torchruns."""
    width, height = 10.5, 9.9
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "Starting a job on many nodes: sbatch, srun, "
          "one torchrun per node, one c10d rendezvous")
    nodes, gpus = 2, 4

    # --- 1: on a cluster -----------------------------------------------------------------
    top = height - 0.75
    ax.text(0.15, top, f"1   On a cluster (Slurm): {nodes} nodes with {gpus} GPUs each",
            fontsize=FONT, fontweight="bold", color=INK, va="center")
    # the batch script
    sx, sw, stop = 0.15, 3.0, top - 0.3
    script = ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --signal=TERM@300",
              "head=$(scontrol show hostnames \\", '  "$SLURM_JOB_NODELIST" | head -n1)',
              "srun ... torchrun \\", '  --nnodes "$SLURM_NNODES" \\',
              '  --nproc-per-node "$GPUS_PER_NODE" \\', "  --rdzv-backend c10d \\",
              '  --rdzv-endpoint "$head:29500" \\', '  --rdzv-id "$SLURM_JOB_ID" \\',
              "  code/ch06_capstone/train_llama.py")
    sh = 0.5 + len(script) * 0.175
    box(ax, sx, stop - sh, sw, sh, face="0.97", edge="0.45", lw=1.2)
    ax.text(sx + 0.12, stop - 0.2, "① sbatch train_llama.sbatch", fontsize=FONT,
            fontweight="bold", color=INK, va="center")
    ax.text(sx + 0.12, stop - 0.4, "\n".join(script), fontsize=SMALL, family=MONO, color=INK,
            va="top", linespacing=1.38, parse_math=False)
    ax.text(sx + 0.12, stop - sh - 0.17, "an excerpt (the file: 8 GPUs a node)",
            fontsize=SMALL, color="0.35", va="center")
    steps = ("① Slurm runs the script on the first node",
             "② srun: the same torchrun on every node",
             "③ each joins the rendezvous and waits\n    until all --nnodes are there",
             "④ nodes ranked by sorted name; torchrun\n    sets RANK, LOCAL_RANK, WORLD_SIZE",
             "⑤ each starts one process per GPU")
    ly = stop - sh - 0.45
    for text in steps:
        ax.text(sx, ly, text, fontsize=SMALL + 0.5, color=INK, va="top", linespacing=1.3)
        ly -= 0.2 * (text.count("\n") + 1) + 0.08

    # the nodes: srun's bus on top, an agent each, the store on the head node, the processes
    bus = top - 0.38
    ntop, nw, nx = top - 0.6, 3.4, (3.3, 6.95)
    agent_h = 0.9
    wh, wgap = 0.72, 0.1                        # a process box's height, the gap between
    agent_top = ntop - 0.4
    agent_y = agent_top - agent_h
    rank_y = agent_y - 0.3                      # ④: the node's rank
    rows_top = rank_y - 0.35
    nbottom = rows_top - 2 * wh - wgap - 0.15
    names = ("node001  (= $head)", "node002")
    ax.plot([sx + sw, nx[1] + 2.7], [bus, bus], color=INK, lw=1.3)
    ax.text((nx[0] + nw + nx[1]) / 2, bus + 0.13, "② srun: one task per node", ha="center",
            va="center", fontsize=SMALL + 0.5, color=INK, fontweight="bold")
    store = None
    for node, x0 in enumerate(nx):
        box(ax, x0, nbottom, nw, ntop - nbottom, face="0.97", edge="0.55", round_=0.1,
            zorder=0)
        ax.text(x0 + 0.15, ntop - 0.2, names[node], fontsize=FONT, color="0.3",
                va="center")
        arrow(ax, (x0 + 2.7, bus), (x0 + 2.7, agent_top), mutation=10, lw=1.3)
        box(ax, x0 + 0.15, agent_y, nw - 0.3, agent_h, face="white", edge=INK, lw=1.4)
        ax.text(x0 + 0.3, agent_top - 0.2, "torchrun agent", fontsize=FONT, fontweight="bold",
                color=INK, va="center")
        if node == 0:                           # the head node's agent hosts the store
            store = (x0 + 0.3, agent_y + 0.1, 2.2, 0.46)
            box(ax, *store, "c10d rendezvous store\n$head:29500, id = job id",
                face=STORE_FACE, edge=STORE_EDGE, color=STORE_INK, size=SMALL + 0.5)
        else:
            ax.text(x0 + 0.3, agent_y + 0.33, "connects to\n$head:29500", fontsize=SMALL,
                    color="0.3", va="center", linespacing=1.25)
        ranks = f"{node * gpus} … {node * gpus + gpus - 1}"
        ax.text(x0 + 0.15, rank_y, f"④ node rank {node}:  RANK {ranks}", fontsize=SMALL + 0.5,
                fontweight="bold", color=INK, va="center")
        for local in range(gpus):
            rank = node * gpus + local
            col, row = local % 2, local // 2
            px = x0 + 0.15 + col * (nw - 0.3 + 0.1) / 2
            py = rows_top - (row + 1) * wh - row * wgap
            _process(ax, px, py, (nw - 0.4) / 2, wh, rank,
                     (f"RANK={rank}", f"LOCAL_RANK={local}"), device=f"cuda:{local}")
        # ⑤ the agent starts its processes: a line from it, fanning out to the columns
        fan, pw = rows_top + 0.12, (nw - 0.4) / 2
        centres = [x0 + 0.15 + col * (pw + 0.1) + pw / 2 for col in range(2)]
        ax.plot([x0 + nw - 0.35, x0 + nw - 0.35, centres[0]], [agent_y, fan, fan], color=INK,
                lw=1.3, zorder=3)
        for cx in centres:
            arrow(ax, (cx, fan), (cx, rows_top), mutation=9, lw=1.3)
        ax.text(x0 + nw - 0.45, rank_y, "⑤", ha="right", va="center", fontsize=SMALL + 0.5,
                fontweight="bold", color=INK)
    # ③ node 1's agent joins the store on node 0
    sx1 = store[0] + store[2]
    arrow(ax, (nx[1] + 0.3 + 0.05, agent_y + 0.33), (sx1 + 0.03, agent_y + 0.33),
          color=STORE_INK, ls="--", lw=1.4, mutation=11)
    ax.text((sx1 + nx[0] + nw - 0.15) / 2, agent_y + 0.5, "③ join", ha="center",
            va="center", fontsize=SMALL + 0.5, color=STORE_INK, fontweight="bold")
    ny = nbottom - 0.25
    ax.text(nx[0], ny, f"WORLD_SIZE = nodes × GPUs per node = {nodes} × {gpus} = "
            f"{nodes * gpus};  RANK = node rank × {gpus} + LOCAL_RANK", fontsize=SMALL + 0.5,
            color=INK, va="center")
    ax.text(nx[0], ny - 0.22, "then init_process_group(\"nccl\") at MASTER_ADDR:MASTER_PORT "
            "(node rank 0's, via the store)", fontsize=SMALL + 0.5, color="0.3", va="center")

    # --- 2: the rehearsal on one machine -------------------------------------------------
    top2 = min(ny - 0.75, ly - 0.3)
    ax.text(0.15, top2, "2   The rehearsal on one machine: two torchruns on 127.0.0.1 stand "
            "in for the two nodes", fontsize=FONT, fontweight="bold", color=INK, va="center")
    ax.text(0.15, top2 - 0.3, "NNODES=2 RDZV_ENDPOINT=127.0.0.1:$PORT code/run_w_torchrun.sh 1 "
            "ch06_capstone/train_llama.py ...    # twice, at once", fontsize=SMALL,
            family=MONO, color=INK, va="center", parse_math=False)
    ax.text(0.15, top2 - 0.5, "  = torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d "
            "--rdzv-endpoint 127.0.0.1:$PORT --rdzv-id rehearsal$PORT", fontsize=SMALL,
            family=MONO, color="0.35", va="center", parse_math=False)
    mtop, mh, mx, mw = top2 - 0.75, 2.05, 0.15, 6.3
    box(ax, mx, mtop - mh, mw, mh, face="0.97", edge="0.55", round_=0.1, zorder=0)
    ax.text(mx + 0.15, mtop - 0.2, "this machine (laptop, CPU)", fontsize=FONT, color="0.3",
            va="center")
    aw, ah = 2.2, 0.5
    ay = mtop - 0.4 - ah
    agent_x = (mx + 0.2, mx + mw - 0.2 - aw)
    for i, x in enumerate(agent_x):
        box(ax, x, ay, aw, ah, f"torchrun  (\"node\" {i})", face="white", edge=INK, lw=1.4,
            size=FONT)
        arrow(ax, (x + aw / 2, ay), (x + aw / 2, ay - 0.2), mutation=10, lw=1.3)
        _process(ax, x, ay - 0.2 - 0.85, aw, 0.85, i,
                 (f"RANK={i}  LOCAL_RANK=0", "WORLD_SIZE=2  gloo"), device="cpu")
    cx0, cx1 = agent_x[0] + aw + 0.12, agent_x[1] - 0.12
    box(ax, cx0, ay - 0.05, cx1 - cx0, ah + 0.1, "store\n127.0.0.1:$PORT", face=STORE_FACE,
        edge=STORE_EDGE, color=STORE_INK, size=SMALL)
    ax.text((cx0 + cx1) / 2, ay - 0.3, "hosted by the\nfirst to bind it;\nthe other joins",
            ha="center", va="top", fontsize=SMALL, color=STORE_INK, linespacing=1.25)
    # the mapping: what stands in for what
    tx, c1, c2 = 6.7, 6.8, 8.6
    rows = (("cluster", "rehearsal"), ("a node", "a torchrun"),
            ("$head:29500", "127.0.0.1:$PORT"), ("--rdzv-id $SLURM_JOB_ID", "rehearsal$PORT"),
            ("4 GPUs, NCCL", "1 CPU process, gloo"), ("WORLD_SIZE 8", "WORLD_SIZE 2"))
    box(ax, tx, mtop - mh, width - 0.15 - tx, mh + 0.0, face="white", edge="0.55",
        round_=0.06, zorder=0)
    for i, (a, b) in enumerate(rows):
        y = mtop - 0.22 - i * 0.32
        weight = "bold" if i == 0 else "normal"
        ax.text(c1, y, a, fontsize=SMALL + 0.5, fontweight=weight, color=INK, va="center")
        ax.text(c2, y, b, fontsize=SMALL + 0.5, fontweight=weight, color=INK, va="center")
        if i == 0:
            ax.plot([c1, width - 0.3], [y - 0.16, y - 0.16], color="0.6", lw=0.8)
    for i, note in enumerate((
            "The same path as on the cluster: rendezvous, node ranks, RANK, one process group "
            "over both \"nodes\"; only the links differ (loopback TCP).",
            "In a notebook, distkit.course.notebook.launch_nodes(2, 1, "
            "\"ch06_capstone/train_llama.py\", "
            "...) starts both at once, then prints their output node by node.")):
        ax.text(0.15, mtop - mh - 0.25 - i * 0.21, note, fontsize=SMALL, color="0.3",
                va="center")
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (capstone_step, multinode_launch)
