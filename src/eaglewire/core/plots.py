"""PNG figures for reports (matplotlib, headless)."""

from __future__ import annotations

import json
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(metrics_path: str | Path, png_path: str | Path) -> Path:
    """Loss and per-step accuracy curves (train and validation) from a metrics.jsonl."""
    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [r for r in rows if not r.get("eval")]
    evals = [r for r in rows if r.get("eval")]
    plt = _pyplot()
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="weighted TTT loss", title="loss")
    ax_loss.legend()
    steps = sorted({int(k.split("_")[-1]) for r in train + evals for k in r if k.startswith(("acc_", "val_acc_"))})
    for j in steps[:4]:
        line, = ax_acc.plot([r["step"] for r in train if f"acc_{j}" in r],
                            [r[f"acc_{j}"] for r in train if f"acc_{j}" in r], alpha=0.5, label=f"acc@{j} train")
        if evals:
            ax_acc.plot([r["step"] for r in evals], [r[f"val_acc_{j}"] for r in evals], "o-",
                        color=line.get_color(), label=f"acc@{j} held-out")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="draft accuracy per TTT step", ylim=(0, 1))
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return Path(png_path)
