"""``dflash eval --plot``: a PNG of the accepted-length histogram and the per-position acceptance curve."""

from __future__ import annotations

from pathlib import Path

from dflash_staged.errors import DflashError
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
    hist = report["accept_length_histogram"]
    rates = report["per_position_acceptance"]
    B = report["block_size"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    total = max(1, sum(hist))
    ax1.bar(range(1, B + 1), [h / total for h in hist], color="tab:blue")
    ax1.set_xticks(range(1, B + 1))
    ax1.set_xlabel("tokens committed per verify step")
    ax1.set_ylabel("share of verify steps")
    ax1.set_title(
        f"accepted lengths (tau {report.get('tau_per_prompt_mean', report['tau']):.3f} per-prompt mean, "
        f"{report['tau']:.3f} pooled, {report['steps']} steps)"
    )
    ax2.plot(range(1, B), rates, marker="o", color="tab:orange")
    ax2.set_xticks(range(1, B))
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("draft position in the block")
    ax2.set_ylabel("acceptance rate")
    ax2.set_title("per-position acceptance")
    ax2.grid(alpha=0.3)
    fig.suptitle(f"{Path(report.get('drafter', '')).name} on {report.get('target', '')}", fontsize=9)
    fig.tight_layout()
    return write_figure_atomic(path, fig)
