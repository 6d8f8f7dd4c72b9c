"""Draws docs/recovery.png: the recovery flow of one step, and where each rank's snapshot is replicated.

The flow is the engine's (``ncclguard/recovery/transaction.py``: commit, rebuild, join, heal or
restore, redo). The buddies are not drawn by hand: they are what ``recovery/snapshots/placement.py``
computes for 2 hosts of 4 ranks, the placement every rank computes at run time.

Usage: python docs/examples/recovery_picture.py [OUT.png]   (default: docs/recovery.png)
"""

from __future__ import annotations

import sys
from pathlib import Path

from ncclguard.recovery.snapshots.placement import buddies

HOSTS = [0, 0, 0, 0, 1, 1, 1, 1]  # two hosts of four ranks, as torchrun numbers them
FLOW = [
    ("the step runs on every rank", "#dfe9f5"),
    ("commit: every rank says ok or not\n(should_commit, one round in the store)", "#dfe9f5"),
    ("rebuild_world: the live ranks meet;\na dead rank's supervisor restarts it", "#fbe3c8"),
    ("the restarted rank stood in (a world of one),\nthen joins in its old place", "#fbe3c8"),
    ("DDP: healed from a live peer\nsharded: its buddy's replica, every rank\nback to the newest snapshot", "#fbe3c8"),
    ("the step is redone on the full world", "#dcefdc"),
]


def draw(path: Path) -> list[int]:
    """Writes the picture to ``path``.

    Returns:
        The buddy of each rank, as drawn (``placement.buddies`` for :data:`HOSTS`).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    buddy = buddies(HOSTS)
    fig = Figure(figsize=(11, 5.2))
    FigureCanvasAgg(fig)
    flow, place = fig.add_axes((0.01, 0.02, 0.47, 0.9)), fig.add_axes((0.52, 0.02, 0.47, 0.9))
    for ax, title in ((flow, "one step, when a rank fails in it"), (place, "where each rank's snapshot goes")):
        ax.set_xlim(0, 10)
        ax.set_ylim(0, 10)
        ax.axis("off")
        ax.set_title(title, fontsize=11)
    step = 10 / len(FLOW)
    for i, (text, color) in enumerate(FLOW):
        y = 10 - (i + 0.5) * step
        flow.add_patch(FancyBboxPatch((1, y - 0.55), 8, 1.1, boxstyle="round,pad=0.05", fc=color, ec="#555"))
        flow.text(5, y, text, ha="center", va="center", fontsize=8)
        if i:
            flow.add_patch(FancyArrowPatch((5, y + step - 0.6), (5, y + 0.6), arrowstyle="-|>", mutation_scale=12))
    flow.text(9.3, 10 - 1.5 * step, "all ok:\napplied", fontsize=7, ha="left", va="center", color="#2a7a2a")
    xs = {0: 2.5, 1: 7.5}
    at: dict[int, tuple[float, float]] = {}
    for h, x in xs.items():
        place.add_patch(FancyBboxPatch((x - 1.6, 0.8), 3.2, 8.2, boxstyle="round,pad=0.1", fc="#f3f3f3", ec="#888"))
        place.text(x, 9.3, f"host {'AB'[h]}", ha="center", fontsize=10)
        for i, r in enumerate(r for r, hr in enumerate(HOSTS) if hr == h):
            at[r] = (x, 8 - i * 2)
            place.add_patch(
                FancyBboxPatch((x - 0.7, at[r][1] - 0.4), 1.4, 0.8, boxstyle="round", fc="white", ec="#333")
            )
            place.text(x, at[r][1], f"rank {r}", ha="center", va="center", fontsize=9)
    for r, b in enumerate(buddy):
        (x0, y0), (x1, y1) = at[r], at[b]
        bend = 0.25 if HOSTS[r] == 0 else -0.25  # A to B above, B to A below: the two directions apart
        start, end = (x0 + (0.7 if x1 > x0 else -0.7), y0), (x1 + (-0.7 if x1 > x0 else 0.7), y1)
        place.add_patch(
            FancyArrowPatch(
                start, end, connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>", mutation_scale=10, color="#1f5fa8"
            )
        )
    place.text(
        5, 0.25, "an arrow: the rank that keeps its replica (the same place on the next host)", ha="center", fontsize=8
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return buddy


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "recovery.png"
    print(f"{out}: buddies {draw(out)}")
