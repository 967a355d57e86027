"""``report.png``: reward, KL, entropy and response length over steps."""

from __future__ import annotations

import os

from rljax.trace.metrics import read_metrics

PANELS = (
    ("critic/score/mean", "val/score/mean", "reward"),
    ("actor/ppo_kl", "actor/kl_loss", "KL"),
    ("actor/entropy", None, "entropy"),
    ("response_length/mean", None, "response length"),
)


def plot_report(run_dir: str, path: str | None = None) -> str:
    """Draw the four panels from ``metrics.jsonl``; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    path = path or os.path.join(run_dir, "report.png")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (main, extra, title) in zip(axes.flat, PANELS):
        for name, style in ((main, "-"), (extra, "o--")):
            if name is None:
                continue
            pts = [(r["step"], r[name]) for r in records if r.get(name) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style, label=name, markersize=4)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
