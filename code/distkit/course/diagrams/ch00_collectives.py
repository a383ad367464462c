"""Chapter 00, torchrun and collectives: what torchrun starts; a ring all-reduce step by step;
an asynchronous all-reduce on a GPU's streams."""
from __future__ import annotations

from matplotlib.patches import Patch, Rectangle

from distkit.course.diagrams.shapes import (FAINT, FONT, INK, MONO, SHARED, SMALL, STORE_EDGE,
                                            STORE_FACE, STORE_INK, WRONG, arrow, box, canvas,
                                            tint, title)
from distkit.course.plots import RANK_COLORS

RING_CELL, RING_GAP = 0.62, 0.3  # ring_allreduce: chunk width, and the gap arrows cross


# --- torchrun --------------------------------------------------------------------------------

def _env(rank, local_rank, world_size, local_world_size=None):
    """The variables torchrun sets for one worker (MASTER_* only where there is room)."""
    env = [("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size)]
    if local_world_size:
        env += [("LOCAL_WORLD_SIZE", local_world_size), ("MASTER_ADDR", "localhost"),
                ("MASTER_PORT", "<free port>")]
    return env


def _worker(ax, x, y, w, h, rank, env, *, faint=False):
    """One worker process: a header in its rank's colour, then its environment variables."""
    color = RANK_COLORS[rank % 10]
    edge = FAINT if faint else color
    box(ax, x, y, w, h, face=tint(color, 0.08 if faint else 0.14), edge=edge,
        lw=1.0 if faint else 1.6, ls="--" if faint else "-")
    ax.text(x + 0.12, y + h - 0.2, f"rank {rank}", fontsize=FONT + 1, fontweight="bold",
            color=tint(color, 0.55) if faint else color, va="center")
    ax.text(x + w - 0.12, y + h - 0.2, "python script.py", fontsize=SMALL, family=MONO,
            color=FAINT if faint else INK, va="center", ha="right")
    ax.text(x + 0.12, y + h - 0.42, "\n".join(f"{k}={v}" for k, v in env), fontsize=SMALL,
            family=MONO, color=FAINT if faint else INK, va="top", linespacing=1.35)


def torchrun():
    """What `torchrun --standalone --nproc-per-node 2 script.py` starts, and how they connect."""
    fig, ax = canvas(9.0, 6.5)
    title(ax, 4.5, 6.22, "What  torchrun --standalone --nproc-per-node 2 script.py  starts")

    # node 0: the agent, its store, two workers
    box(ax, 0.15, 0.75, 6.0, 5.05, face="0.97", edge="0.55", round_=0.12, zorder=0)
    ax.text(0.32, 5.6, "node 0 (this machine)", fontsize=FONT, color="0.35", va="center")
    box(ax, 0.4, 3.75, 5.5, 1.65, face="white", edge=INK, lw=1.4)
    ax.text(0.55, 5.17, "torchrun agent", fontsize=FONT + 1, fontweight="bold", va="center")
    ax.text(2.05, 5.17, "(one process per node)", fontsize=FONT, va="center", color="0.3")
    ax.text(0.55, 4.82, "spawns the workers with their env vars, then monitors them:\n"
            "if one fails, it stops the others and exits non-zero", fontsize=FONT,
            va="center", color="0.2", linespacing=1.3)
    # two stores, two ports (torch 2.13, dynamic_rendezvous.py, next_rendezvous): the agents meet
    # in the rendezvous store; node 0's agent then opens the workers' store on a free port
    box(ax, 1.55, 3.88, 3.2, 0.55, "rendezvous store: RDZV_ENDPOINT\n"
        "workers' store: MASTER_ADDR:MASTER_PORT", face=STORE_FACE, edge=STORE_EDGE,
        size=SMALL + 0.5)
    wy, wh, ww = 1.35, 1.75, 2.2
    _worker(ax, 0.4, wy, ww, wh, 0, _env(0, 0, 2, 2))
    _worker(ax, 3.7, wy, ww, wh, 1, _env(1, 1, 2, 2))
    # spawn (agent -> worker) on the outside, connect (worker -> store) on the inside
    top = wy + wh
    for x in (0.75, 5.55):
        arrow(ax, (x, 3.75), (x, top), color="0.35")
    ax.text(0.85, 3.42, "spawn", fontsize=SMALL, color="0.35", va="center")
    ax.text(5.45, 3.42, "spawn", fontsize=SMALL, color="0.35", va="center", ha="right")
    for x in (2.25, 3.95):
        arrow(ax, (x, top), (x, 3.88), ls="--", color=STORE_INK)
    ax.text(3.1, 3.47, "init_process_group():\nconnect to MASTER_PORT", fontsize=SMALL,
            ha="center", va="center", color=STORE_INK, linespacing=1.25)
    # the backend: workers talk to each other directly
    arrow(ax, (2.6, 2.05), (3.7, 2.05), style="<|-|>", lw=2.4, color="0.25", mutation=14)
    ax.text(3.15, 2.25, "tensors", fontsize=SMALL, ha="center", color="0.25")
    ax.text(3.15, 1.05, "collectives go rank to rank, not through the agent: the backend moves "
            "the bytes\ngloo over TCP (tensors on CPU)  ·  NCCL over NVLink / InfiniBand "
            "(on GPU)", fontsize=FONT, ha="center", va="center", color="0.2", linespacing=1.35)

    # faint node 1: the same command with --nnodes 2 joins one rendezvous
    box(ax, 6.35, 0.75, 2.5, 5.05, face="white", edge=FAINT, ls="--", round_=0.12, zorder=0)
    ax.text(6.5, 5.6, "node 1 (if --nnodes 2)", fontsize=FONT, color=FAINT, va="center")
    box(ax, 6.55, 4.35, 2.1, 1.05, "torchrun agent", face="white", edge=FAINT, ls="--",
        color=FAINT, size=FONT + 1)
    arrow(ax, (6.55, 4.6), (4.55, 4.16), ls="--", color=FAINT, rad=0.25)
    ax.text(7.6, 4.0, "joins the rendezvous\n(RDZV_ENDPOINT); its\nworkers: MASTER_PORT",
            fontsize=SMALL, color=FAINT,
            ha="center", va="top", linespacing=1.25)
    for i, y in enumerate((2.35, 1.0)):
        _worker(ax, 6.55, y, 2.1, 1.05, 2 + i, _env(2 + i, i, 4), faint=True)
    ax.text(4.5, 0.38, "RANK: id in the whole job.   LOCAL_RANK: id on its node "
            "(on a GPU node it picks cuda:LOCAL_RANK).", fontsize=FONT, ha="center",
            va="center", color="0.3")
    return fig


# --- ring all-reduce ----------------------------------------------------------------------

def ring_schedule(n: int):
    """Per phase, per step: {rank: (chunk sent to the right neighbour, chunk received)}.

    The schedule of code/ch00_collectives/ring_allreduce.py: reduce-scatter step s, rank r sends
    chunk (r - s) mod n and adds the arriving chunk (r - s - 1) mod n; all-gather step s, rank r
    sends chunk (r - s + 1) mod n and copies the arriving chunk (r - s) mod n.
    """
    rs = [{r: ((r - s) % n, (r - s - 1) % n) for r in range(n)} for s in range(n - 1)]
    ag = [{r: ((r - s + 1) % n, (r - s) % n) for r in range(n)} for s in range(n - 1)]
    return rs, ag


def _ring_states(n: int):
    """The ranks whose data each (rank, chunk) holds, before every step and at the end."""
    held = [[[r] for _ in range(n)] for r in range(n)]  # held[rank][chunk]: list of ranks
    states = []
    for phase, steps in zip(("rs", "ag"), ring_schedule(n)):
        for moves in steps:
            states.append(([[list(c) for c in row] for row in held], moves))
            incoming = {(r + 1) % n: (send, list(held[r][send])) for r, (send, _) in moves.items()}
            for r, (chunk, data) in incoming.items():
                held[r][chunk] = data + held[r][chunk] if phase == "rs" else data
        states.append(([[list(c) for c in row] for row in held], None))
    return states


def _ring_panel(ax, x0, y0, held, moves, n, heading, *, labels: bool):
    """One step: ranks as columns (left to right = around the ring), chunks as rows."""
    cw, ch, gap, vgap = RING_CELL, 0.3, RING_GAP, 0.06
    ax.text(x0 + (n * cw + (n - 1) * gap) / 2, y0 + 0.5 + n * (ch + vgap), heading,
            ha="center", va="center", fontsize=FONT, fontweight="bold", color=INK)
    top = y0 + n * (ch + vgap)
    for r in range(n):
        x = x0 + r * (cw + gap)
        ax.text(x + cw / 2, top + 0.17, f"rank {r}", ha="center", va="center", fontsize=SMALL,
                color=RANK_COLORS[r], fontweight="bold")
        for c in range(n):
            y = top - (c + 1) * (ch + vgap)
            ranks = held[r][c]
            if len(ranks) == 1:
                face, text, tc = tint(RANK_COLORS[ranks[0]], 0.35), str(ranks[0]), INK
            elif len(ranks) < n:
                face, text, tc = SHARED, "+".join(map(str, ranks)), INK
            else:
                face, text, tc = "0.3", "sum", "white"
            sending = moves is not None and moves[r][0] == c
            ax.add_patch(Rectangle((x, y), cw, ch, facecolor=face, zorder=2,
                                   edgecolor="black" if sending else "0.45",
                                   linewidth=2.0 if sending else 0.6))
            ax.text(x + cw / 2, y + ch / 2, text, ha="center", va="center", fontsize=SMALL,
                    color=tc, zorder=3, fontweight="bold" if len(ranks) == n else "normal")
            if labels and r == 0:
                ax.text(x0 - 0.2, y + ch / 2, f"chunk {c}", ha="right", va="center",
                        fontsize=SMALL, color="0.3")
    if moves is None:
        return
    for r, (c, _) in moves.items():  # each rank sends one chunk to its right neighbour
        y = top - (c + 1) * (ch + vgap) + ch / 2
        x = x0 + r * (cw + gap) + cw
        if r < n - 1:
            arrow(ax, (x + 0.02, y), (x + gap - 0.02, y), lw=1.6, mutation=11)
        else:  # rank n-1 -> rank 0: round the back of the ring, under the panel
            bottom, right, left = y0 - 0.12, x + 0.14, x0 - 0.1
            ax.plot([x + 0.02, right, right, left, left], [y, y, bottom, bottom, y],
                    color=INK, lw=1.1, ls=(0, (3, 2)), zorder=3)
            arrow(ax, (left, y), (x0 - 0.02, y), lw=1.1, mutation=11)


def ring_allreduce(n: int = 4):
    """Ring all-reduce on n ranks: reduce-scatter, then all-gather, one panel per step."""
    pw = n * RING_CELL + (n - 1) * RING_GAP       # panel width
    ph = n * 0.36 + 0.88                          # panel height, title included
    rows = n                                      # n-1 steps + the result, per phase
    width, left = 2 * pw + 2.2, 0.9
    height = rows * ph + 2.25
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, f"Ring all-reduce on N = {n} ranks: "
          f"{n - 1} steps of reduce-scatter, then {n - 1} of all-gather")
    states = _ring_states(n)
    col_x = (left, left + pw + 1.0)
    heads = (("reduce-scatter: add what arrives", "rank r sends chunk (r − s) mod N"),
             ("all-gather: copy what arrives", "rank r sends chunk (r − s + 1) mod N"))
    for col, (head, rule) in enumerate(heads):
        ax.text(col_x[col] + pw / 2, height - 0.72, head, ha="center", va="center",
                fontsize=FONT + 1, color=INK, fontweight="bold")
        ax.text(col_x[col] + pw / 2, height - 0.98, f"step s: {rule}", ha="center",
                va="center", fontsize=SMALL + 0.5, color="0.3")
        for i in range(n):
            held, moves = states[col * n + i]
            y0 = height - 1.1 - (i + 1) * ph + 0.12
            if moves is not None:
                heading = f"step s = {i}"
            elif col == 0:
                heading = "after reduce-scatter: rank r holds the sum of chunk r+1"
            else:
                heading = "after all-gather: every rank holds the whole sum"
            _ring_panel(ax, col_x[col], y0, held, moves, n, heading, labels=col == 0)
    handles = [Patch(facecolor=tint(RANK_COLORS[0], 0.35), edgecolor="0.45",
                     label="one rank's own data (its number)"),
               Patch(facecolor=SHARED, edgecolor="0.45", label="partial sum (ranks added so far)"),
               Patch(facecolor="0.3", edgecolor="0.45", label="full sum of all N ranks"),
               Patch(facecolor="white", edgecolor="black", linewidth=2.0,
                     label="sent to the right neighbour this step")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=SMALL, frameon=False,
               bbox_to_anchor=(0.5, 0.5 / height))
    ax.text(width / 2, 0.22, f"Each rank sends 2(N-1) = {2 * (n - 1)} chunks of S/N bytes "
            "(S: size of the tensor), 2(N-1)/N · S in all: under 2S for any N", ha="center",
            va="center", fontsize=FONT, color=INK)
    return fig


# --- async_streams ---------------------------------------------------------------------------

def async_streams():
    """An asynchronous all-reduce on a GPU: the CPU only queues work; NCCL's kernel runs on its
    own stream beside the compute stream; wait() makes the compute stream wait, not the CPU."""
    width, height = 11.0, 4.6
    fig, ax = canvas(width, height)
    title(ax, width / 2, height - 0.3, "dist.all_reduce(x, async_op=True) on a GPU: "
          "the CPU queues work, the streams run it")
    lanes = {"CPU (your Python)": 3.35, "compute stream": 2.25, "NCCL's stream": 1.15}
    left, h = 2.2, 0.62
    for name, y in lanes.items():
        ax.text(left - 0.15, y + h / 2, name, ha="right", va="center", fontsize=FONT + 0.5,
                fontweight="bold", color=INK)
        ax.plot([left, width - 0.3], [y - 0.12, y - 0.12], color=FAINT, lw=0.8, zorder=0)
    cpu, comp, nccl = lanes.values()
    gpu_face, gpu_edge = tint(RANK_COLORS[0], 0.35), RANK_COLORS[0]
    # the CPU: short calls that queue kernels, one that blocks
    calls = [(2.3, 1.35, "all_reduce(x,\nasync_op=True)"),
             (3.75, 1.6, "more backward:\nqueue kernels"),
             (5.45, 0.95, "work.wait()"), (6.5, 1.0, "y = x.sum()")]
    for x, w, text in calls:
        box(ax, x, cpu, w, h, text, face="white", edge=INK, size=SMALL + 0.5)
    box(ax, 7.6, cpu, 3.0, h, ".item(): the CPU waits for the stream", face=tint(WRONG, 0.15),
        edge=WRONG, size=SMALL + 0.5)
    # the compute stream: backward kernels, then a wait for NCCL's event, then the sum
    box(ax, 3.0, comp, 3.4, h, "backward kernels (queued earlier and now)", face=gpu_face,
        edge=gpu_edge, size=SMALL + 0.5)
    box(ax, 6.4, comp, 1.9, h, "waits for NCCL", face="white", edge=FAINT, ls="--",
        color="0.4", size=SMALL + 0.5)
    box(ax, 8.3, comp, 1.2, h, "x.sum()", face=gpu_face, edge=gpu_edge, size=SMALL + 0.5)
    # NCCL's stream: the all-reduce kernel, from its launch to its end
    box(ax, 2.9, nccl, 5.4, h, "all-reduce kernel: bytes over NVLink / the network",
        face=STORE_FACE, edge=STORE_EDGE, color=STORE_INK, size=SMALL + 0.5)
    arrow(ax, (2.95, cpu - 0.02), (2.95, nccl + h + 0.02), color=STORE_EDGE, lw=1.1, mutation=10)
    ax.text(3.05, nccl + h + 0.2, "queued", fontsize=SMALL, color=STORE_INK, va="center")
    arrow(ax, (5.9, cpu - 0.02), (6.45, comp + h + 0.02), color=INK, lw=1.1, mutation=10)
    ax.text(5.75, comp + h + 0.2, "wait(): returns at once", fontsize=SMALL, color=INK,
            va="center", ha="right")
    arrow(ax, (8.3, nccl + h), (8.3, comp), color=STORE_EDGE, lw=1.4, mutation=11)
    ax.text(8.4, nccl + h + 0.2, "done: the compute stream goes on", fontsize=SMALL,
            color=STORE_INK, va="center")
    arrow(ax, (9.5, comp + h + 0.02), (9.5, cpu - 0.02), color=WRONG, lw=1.1, mutation=10)
    ax.text(width / 2, 0.45, "Until wait(), x belongs to the collective: read it or write it and "
            "you race with the bytes being sent. On gloo, wait() blocks the CPU instead.",
            ha="center", va="center", fontsize=FONT, color=INK)
    arrow(ax, (left, 0.85), (width - 0.3, 0.85), "", color="0.5", lw=1.0, mutation=10)
    ax.text(width - 0.3, 0.72, "time", ha="right", va="center", fontsize=SMALL, color="0.4")
    return fig


# this chapter's pictures, in the order `make images` draws them
DIAGRAMS = (torchrun, ring_allreduce, async_streams)
