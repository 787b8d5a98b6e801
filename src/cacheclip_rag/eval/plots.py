"""PNG plots for bench results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def quality_vs_ratio(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Average needle score vs recompute ratio per mode (as the paper's Figure 6, left);
    modes without a ratio are horizontal lines."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for length in sorted({r["length"] for r in rows}):
        sel = [r for r in rows if r["length"] == length]
        for mode in sorted({r["mode"] for r in sel}):
            pts = sorted((r["ratio"], 100 * r["avg"]) for r in sel if r["mode"] == mode)
            if mode in ("full", "reuse", "ape"):
                ax.axhline(pts[0][1], linestyle="--" if mode == "full" else ":", linewidth=1,
                           label=f"{mode} ({length})", color={"full": "black", "reuse": "grey", "ape": "tab:brown"}[mode])
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} ({length})")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel("average needle score (x100)")
    ax.set_ylim(0, 105)
    ax.set_title(title or "Quality vs recompute ratio")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ttft_breakdown(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Stacked median TTFT per mode: selection, load, assemble, recompute, other."""
    plt = _plt()
    parts = ["selection", "load", "assemble", "recompute"]
    labels = [f"{r['label']} {r['length']}" for r in rows]
    fig, ax = plt.subplots(figsize=(min(16.0, max(6.4, 0.45 * len(rows))), 4.8))
    bottom = [0.0] * len(rows)
    for part in parts:
        vals = [r[part] for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    other = [max(0.0, r["ttft"] - b) for r, b in zip(rows, bottom)]
    ax.bar(labels, other, bottom=bottom, label="other")
    ax.set_ylabel("median TTFT (s)")
    ax.set_title(title or "TTFT breakdown per mode")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), fontsize=7, rotation=60, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_curve(points: list[tuple[int, str, float, float]], path: str | Path, ylabel: str, title: str) -> None:
    """(length, mode, ratio, value) points as one line per (mode, length)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for length, mode in sorted({(p[0], p[1]) for p in points}):
        pts = sorted((p[2], p[3]) for p in points if (p[0], p[1]) == (length, mode))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} ({length})")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
