"""``dflash eval --plot``: a PNG of the accepted-length histogram and the per-position acceptance curve,
one series per sampling setting (greedy, or T with its top-p/top-k/seed)."""

from __future__ import annotations

from pathlib import Path

from dflash_staged.errors import DflashError
from dflash_staged.evaluate.sampling import label_of
from dflash_staged.fsutil import write_figure_atomic


def plot_eval(report: dict, path: str | Path) -> Path:
    """Draw the eval ``report`` (see :func:`dflash_staged.evaluate.run_eval`) to ``path``, atomically."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DflashError("--plot needs matplotlib: pip install matplotlib (or the dev/demo extra)") from None
    path = Path(path)
    runs = report.get("runs") or [report]
    B = len(report["accept_length_histogram"])  # drafts a step + 1: tau's ceiling
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    width = 0.8 / len(runs)
    taus = []
    for i, run in enumerate(runs):
        hist = run["accept_length_histogram"]
        total = max(1, sum(hist))
        offset = (i - (len(runs) - 1) / 2) * width
        label = label_of(run.get("sampling"))
        ax1.bar([k + offset for k in range(1, B + 1)], [h / total for h in hist], width, label=label)
        ax2.plot(range(1, B), run["per_position_acceptance"], marker="o", label=label)
        taus.append(
            f"{label}: tau {run.get('tau_per_prompt_mean', run['tau']):.3f} per-prompt mean, "
            f"{run['tau']:.3f} pooled, {run['steps']} steps"
        )
    ax1.set_xticks(range(1, B + 1))
    ax1.set_xlabel("tokens committed per verify step")
    ax1.set_ylabel("share of verify steps")
    ax1.set_title("accepted lengths", fontsize=10)
    ax2.set_xticks(range(1, B))
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("draft position in the block")
    ax2.set_ylabel("acceptance rate")
    ax2.set_title("per-position acceptance", fontsize=10)
    ax2.grid(alpha=0.3)
    if len(runs) > 1:
        ax1.legend(fontsize=8)
        ax2.legend(fontsize=8)
    head = f"{Path(report.get('drafter', '')).name} on {report.get('target', '')} (block {B})"
    fig.suptitle("\n".join([head, *taus]), fontsize=9)
    fig.tight_layout()
    return write_figure_atomic(path, fig)
