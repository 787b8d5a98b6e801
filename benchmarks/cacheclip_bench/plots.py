"""PNG plots for bench results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _interval(row: dict) -> tuple[float, float]:
    """Distances (x100) from a row's average down and up to its 95% interval (0 when absent)."""
    if "avg_ci95" not in row:
        return 0.0, 0.0
    return 100 * (row["avg"] - row["avg_ci95"][0]), 100 * (row["avg_ci95"][1] - row["avg"])


def quality_vs_ratio(rows: list[dict], path: str | Path, title: str = "") -> None:
    """Average needle score per mode with 95% intervals as error bars. Against the recompute ratio
    (as the paper's Figure 6, left) when some mode ran at several ratios, else one point per mode
    side by side; modes without a ratio (full, reuse, ape) are horizontal lines."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lengths = sorted({r["length"] for r in rows})
    rows = [r for r in rows if not isinstance(r["ratio"], str)]  # "auto" has no place on a ratio axis
    ratio_rows = [r for r in rows if r["mode"] not in ("full", "reuse", "ape")]
    sweep = any(len({r["ratio"] for r in ratio_rows if r["mode"] == m}) > 1 for m in {r["mode"] for r in ratio_rows})
    labels = sorted({r["label"] for r in ratio_rows})
    for j, length in enumerate(lengths):
        sel = [r for r in rows if r["length"] == length]
        for mode in sorted({r["mode"] for r in sel}):
            mine = sorted((r for r in sel if r["mode"] == mode), key=lambda r: r["ratio"])
            if mode in ("full", "reuse", "ape"):
                ax.axhline(100 * mine[0]["avg"], linestyle="--" if mode == "full" else ":", linewidth=1,
                           label=f"{mode} ({length})", color={"full": "black", "reuse": "grey", "ape": "tab:brown"}[mode])
                continue
            if sweep:
                xs = [r["ratio"] for r in mine]
            else:  # one ratio: modes side by side, lengths offset
                xs = [labels.index(r["label"]) + 0.15 * (j - (len(lengths) - 1) / 2) for r in mine]
            err = list(zip(*(_interval(r) for r in mine)))
            ax.errorbar(xs, [100 * r["avg"] for r in mine], yerr=err, marker="o", capsize=3, linestyle="-" if sweep else "",
                        label=f"{mode} ({length})")
    if sweep:
        ax.set_xlabel("recompute ratio")
    else:
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
    ax.set_ylabel("average needle score (x100), 95% interval")
    ax.set_ylim(0, 105)
    ax.set_title(title or ("Quality vs recompute ratio" if sweep else "Quality per mode"))
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
