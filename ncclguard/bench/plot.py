"""busbw against size, one line per mode (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_busbw"]


def plot_busbw(path: Path, rows: Sequence[dict[str, Any]], title: str) -> None:
    """Saves a PNG (or any format matplotlib infers from ``path``) of busbw against size, log2 x axis.

    Raises:
        ImportError: matplotlib is not installed; install ``ncclguard[plot]``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a training node
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'ncclguard[plot]'") from exc

    from ncclguard.bench.sizes import format_bytes

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine], marker="o", markersize=3, label=mode)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: format_bytes(int(x)) if x >= 1 else ""))
    ax.set_xlabel("message size (bytes, log2)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.autofmt_xdate(rotation=45)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
