"""Chapter 08's diagram: what of FSDP's communication a step's compute hides."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle


def _lane(ax, y, spans, color, label=None):
    for i, (x0, x1, text) in enumerate(spans):
        ax.add_patch(Rectangle((x0, y), x1 - x0, 0.6, facecolor=color, edgecolor="black",
                               linewidth=0.6, label=label if i == 0 else None))
        ax.text((x0 + x1) / 2, y + 0.3, text, ha="center", va="center", fontsize=7)


def _step(ax, y, compute, comm, title):
    """Four layers forward then backward, as FSDP2 orders them: a layer's all-gather is issued
    when the layer before it starts computing (prefetch, one ahead), a layer computes once its
    gather is done, its gradients reduce-scatter once its backward is done; the collectives
    share one link, one at a time."""
    link, t_comp, exposed = 0.0, 0.0, []
    comp_spans, comm_spans = [], []

    def send(ready, text):
        nonlocal link
        start = max(link, ready)
        comm_spans.append((start, start + comm, text))
        link = start + comm
        return link

    order = [("F", j, 1.0) for j in range(4)] + [("B", j, 2.0) for j in range(3, -1, -1)]
    gathered = send(0.0, "AG0")
    for k, (phase, j, work) in enumerate(order):
        start = max(t_comp, gathered)
        if start > t_comp:
            exposed.append((t_comp, start))
        if k + 1 < len(order):  # prefetch the next layer's weights while this one computes
            gathered = send(start, f"AG{order[k + 1][1]}")
        comp_spans.append((start, start + compute * work, f"{phase}{j}"))
        t_comp = start + compute * work
        if phase == "B":  # this layer's gradients, once its backward is done
            send(t_comp, f"RS{j}")
    if link > t_comp:
        exposed.append((t_comp, link))
    t_comm = link
    _lane(ax, y + 0.8, comp_spans, "#9ecae1", "compute stream" if y == 0 else None)
    _lane(ax, y, comm_spans, "#fdd0a2", "communication stream" if y == 0 else None)
    for x0, x1 in exposed:
        ax.add_patch(Rectangle((x0, y - 0.1), x1 - x0, 1.6, facecolor="red", alpha=0.18,
                               edgecolor="none", label="exposed: nothing computes"
                               if y == 0 and (x0, x1) == exposed[0] else None))
    ax.text(-0.3, y + 0.7, title, ha="right", va="center", fontsize=9)
    ax.text(max(t_comm, t_comp) + 0.2, y + 0.7, f"step = {max(t_comm, t_comp):.1f}",
            va="center", fontsize=8)


def step_overlap():
    """FSDP2's collectives hide behind compute when a layer's compute outlasts its gather; the
    first gather and the last reduce-scatter never hide. Top: compute-bound (a big micro-batch);
    bottom: communication-bound (few tokens per GPU, or a slow link between nodes)."""
    fig, ax = plt.subplots(figsize=(11, 3.6))
    _step(ax, 2.4, compute=1.0, comm=0.6, title="many tokens per GPU")
    _step(ax, 0, compute=0.5, comm=1.0, title="few tokens per GPU")
    ax.set_xlim(-3.2, 15.5)
    ax.set_ylim(-0.4, 4.2)
    ax.set_yticks([])
    ax.set_xlabel("time (one unit = a layer's forward in the top row)")
    ax.set_title("FSDP2 step: AG = all-gather a layer's weights, F/B = its forward/backward, "
                 "RS = reduce-scatter its gradients", fontsize=10)
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


DIAGRAMS = [step_overlap]
