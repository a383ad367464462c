"""The drawing primitives every diagram shares: a canvas in inches, the course's colours and
fonts, boxes, arrows, and the few shapes that more than one chapter draws.

Every figure is laid out on axes whose data units are inches (see `canvas`), so sizes and
positions read as inches on the page; fonts are >= 9 pt at ~1000 px wide.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from distkit.course.plots import RANK_COLORS

FONT = 10          # body text, points
SMALL = 9          # the smallest text in any diagram
MONO = "DejaVu Sans Mono"
INK = "0.15"       # text and outlines
FAINT = "0.6"      # what is optional or gone: the multi-node part of torchrun, an idle slot
SHARED = "0.82"    # grey: the same on every rank (as in distkit.course.plots: grey = a sum)
STORE_FACE, STORE_EDGE, STORE_INK = "#fff4d6", "#b8860b", "#8a6508"  # the store, all-reduce
CKPT_FACE, CKPT_EDGE = STORE_FACE, STORE_EDGE  # a committed checkpoint: the store's yellow
WRONG, RIGHT = "#b22222", "#2e7d32"  # a wrong result (a stale gradient, a hang), a right one
F_AMOUNT, B_AMOUNT = 0.3, 0.7  # timelines: the rank's colour, light for F and dark for B


# --- the canvas and its basic shapes ---------------------------------------------------------

def canvas(width: float, height: float):
    """One axes filling the figure, in inches: (0, 0) bottom left, (width, height) top right."""
    fig = plt.figure(figsize=(width, height), facecolor="white")
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax


def tint(color, amount: float = 0.3):
    """`color` mixed with white: amount 1 = the colour itself, 0 = white."""
    r, g, b, _ = to_rgba(color)
    return (1 - amount * (1 - r), 1 - amount * (1 - g), 1 - amount * (1 - b))


def box(ax, x, y, w, h, text="", *, face="white", edge=INK, lw=1.0, ls="-", size=FONT,
        color=INK, round_=0.06, zorder=1):
    """A rounded box with lower-left corner (x, y), and `text` centred in it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=f"round,pad=0,rounding_size={round_}",
                                facecolor=face, edgecolor=edge, linewidth=lw, linestyle=ls,
                                zorder=zorder))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
                color=color, zorder=zorder + 1, linespacing=1.3)


def arrow(ax, start, end, text="", *, color=INK, lw=1.3, ls="-", style="-|>", rad=0.0,
          size=FONT, text_at=None, mutation=12, zorder=3):
    """An arrow from `start` to `end` (curved if rad != 0), with an optional label at `text_at`."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=mutation,
                                 connectionstyle=f"arc3,rad={rad}", color=color, linewidth=lw,
                                 linestyle=ls, shrinkA=0, shrinkB=0, zorder=zorder))
    if text:
        if text_at is None:
            text_at = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        ax.text(*text_at, text, ha="center", va="center", fontsize=size, color=color,
                zorder=zorder + 1, linespacing=1.3)


def title(ax, x, y, text, size=12.5):
    """A diagram's title, bold and centred on (x, y)."""
    ax.text(x, y, text, ha="center", va="center", fontsize=size, fontweight="bold", color=INK)


# --- shapes that several chapters draw -------------------------------------------------------

def rank_region(ax, x, y, w, h, rank, head, note=""):
    """A rank's part of a picture: a faint box in its colour, with 'rank r' and a note on top."""
    color = RANK_COLORS[rank % 10]
    box(ax, x, y, w, h, face=tint(color, 0.1), edge=color, lw=1.4, round_=0.1, zorder=0)
    ax.text(x + 0.12, y + h - 0.2, head, fontsize=FONT + 1, fontweight="bold", color=color,
            va="center")
    if note:
        ax.text(x + w - 0.12, y + h - 0.2, note, fontsize=SMALL, color="0.3", va="center",
                ha="right")


def slot(ax, x, y, w, h, kind, rank, text, *, bold=False, size=FONT):
    """One block of a schematic timeline: F (light), B (dark), idle (dashed) or a step."""
    color = RANK_COLORS[rank % 10]
    if kind == "idle":
        box(ax, x, y, w, h, text, face="white", edge=FAINT, ls="--", color="0.45",
            size=size, round_=0.03)
        return
    face = {"F": tint(color, F_AMOUNT), "B": tint(color, B_AMOUNT), "step": "white"}[kind]
    tc = "white" if kind == "B" else INK
    box(ax, x, y, w, h, text, face=face, edge="black" if bold else color,
        lw=2.4 if bold else 1.0, color=tc, size=size, round_=0.03)


def comm(ax, x, w, y, h, text, *, forward=True, size=FONT):
    """A communication op spanning the lanes: yellow when it moves bytes in the forward pass,
    white with a dashed yellow edge when it is the identity forward (it moves bytes backward)."""
    if forward:
        box(ax, x, y, w, h, text, face=STORE_FACE, edge=STORE_EDGE, lw=1.6, color=STORE_INK,
            size=size)
    else:
        box(ax, x, y, w, h, text, face="white", edge=STORE_EDGE, lw=1.6, ls="--",
            color=STORE_INK, size=size)


def step_mark(ax, x, y0, y1, color, *, width=0.08):
    """Work done between two steps (a checkpoint, an evaluation, a metrics line): a bar from y0
    to y1 on the step boundary x of a timeline."""
    ax.add_patch(Rectangle((x - width / 2, y0), width, y1 - y0, facecolor=color,
                           edgecolor="none", zorder=4))


def key_boxes(ax, keys, y, h, *, w, head_dy):
    """The row of boxes under a diagram that say what it costs and what it saves:
    `keys` = ((x, heading, body), ...); the heading `head_dy` below each box's top."""
    for x, head, body in keys:
        box(ax, x, y, w, h, face="white", edge="0.55", round_=0.04)
        ax.text(x + 0.15, y + h - head_dy, head, fontsize=FONT, fontweight="bold",
                va="center", color=INK)
        ax.text(x + 0.15, y + 0.5, body, fontsize=SMALL + 0.5, va="center", color=INK,
                linespacing=1.3)
