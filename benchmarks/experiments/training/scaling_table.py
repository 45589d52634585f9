"""The data-scaling table of ``benchmarks/experiments/training/data_scaling.sh``: one row per trained draft.

Reads RUNS/NAME/config.json (the training summary) and RUNS/NAME.json (``doctor --json`` on the
held-out set of the target's own replies) for every NAME that has both, and prints markdown.

    python benchmarks/experiments/training/scaling_table.py runs/scaling
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(draft_dir: Path, doctor_json: Path) -> dict:
    training = json.loads((draft_dir / "config.json").read_text())["training"]
    doctor = json.loads(doctor_json.read_text())
    source = json.loads((Path(training["data"]) / "manifest.json").read_text())["source"]
    return {"name": draft_dir.name, "data": "target's replies" if source.get("regenerated") else "ShareGPT's replies",
            "tokens": training["train_tokens"], "steps": training["steps"], "seconds": training["seconds"],
            "val_acc": (training.get("final_eval") or {}).get("val_acc_0"), "heldout": doctor["accuracy"]}


def table(rows: list[dict]) -> str:
    deepest = max(len(r["heldout"]) for r in rows)
    cond = [f"cond acc@{j}" for j in range(1, deepest)]
    lines = ["| draft | replies trained on | training tokens | steps | wall | own val acc@0 | held-out acc@0 | "
             + " | ".join(cond) + " |", "|---" * (7 + len(cond)) + "|"]
    for r in sorted(rows, key=lambda r: (r["data"], r["tokens"])):
        val = "-" if r["val_acc"] is None else f"{r['val_acc']:.3f}"
        lines.append(f"| {r['name']} | {r['data']} | {r['tokens'] / 1e6:.2f}M | {r['steps']} | {r['seconds'] / 60:.0f} min "
                     f"| {val} | **{r['heldout']['acc@0']:.3f}** | "
                     + " | ".join(f"{r['heldout'].get(c, float('nan')):.3f}" for c in cond) + " |")
    return "\n".join(lines)


def main() -> None:
    runs = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/scaling")
    rows = [row(d, runs / f"{d.name}.json") for d in sorted(runs.iterdir())
            if (d / "config.json").is_file() and (runs / f"{d.name}.json").is_file()]
    if not rows:
        sys.exit(f"no trained draft with a doctor report under {runs}")
    print(table(rows))


if __name__ == "__main__":
    main()
