"""The report of ``eaglewire bench``: terminal table, bench.md, bench.json and two PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from eaglewire.bench.bench_command import BenchResult, Row, position_acceptance, same_output_across_engines, same_output_as_plain, \
    speedup, tau_per_request, tau_pooled, time_split, verified_per_pass
from eaglewire.core.locks import directory_lock

HEADERS = ["config", "method", "tok/s", "speedup", "τ pooled", "τ per-request", "verified/pass",
           "acceptance by position", "draft s", "verify s", "prefill s", "other s", "new tokens", "same as plain"]

TAU_NOTE = ("τ: tokens per target verify pass, bonus token included (1.0 = plain decoding). "
            "τ pooled = all verify-pass tokens / all verify passes; τ per-request = mean over requests of "
            "each request's τ. Verified/pass: tokens the target checked per pass (root included), the cost "
            "side of τ. Speedup: tokens/s over the plain (steps 0) config of this run. "
            "Acceptance by position: share of verify passes that accepted the draft token at depth 1, 2, ... "
            "Same as plain (greedy only): prompts whose output equals the plain config's token for token; "
            "speculation is lossless, so a shortfall means numerics (ties, bf16) or a bug. "
            "llamacpp rows: llama-server started by the bench (threads pinned, greedy, no prompt cache); τ from "
            "its own counters (1 + timings.draft_n_accepted / verify steps from /metrics), speedup and same-as-plain "
            "against llama.cpp's own plain row; its time is prompt + generation as llama.cpp times them, no draft/verify split.")


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def row_dict(row: Row, rows: list[Row], greedy: bool) -> dict:
    """The numbers of one row; None where a quantity does not apply (τ of an HF baseline, output
    equality when sampling)."""
    split = time_split(row.stats)
    same = same_output_as_plain(row, rows) if greedy else None
    return {
        "name": row.name, "engine": row.engine_name, "method": row.method, "dtype": row.dtype or None,
        "prompts": len(row.stats),
        "new_tokens": row.new_tokens,
        "tokens_per_second": round(row.tokens_per_second, 2), "speedup": _round(speedup(row, rows), 3),
        "tau_pooled": _round(tau_pooled(row.stats) if row.engine else None, 3),
        "tau_per_request_mean": _round(tau_per_request(row.stats) if row.engine else None, 3),
        "target_verify_passes": sum(s.rounds for s in row.stats) if row.engine else None,
        "verified_per_pass": _round(verified_per_pass(row.stats) if row.engine else None, 3),
        "position_acceptance": [round(a, 3) for a in position_acceptance(row.stats)],
        "seconds": {k: round(v, 3) for k, v in split.items()} if row.engine else {"total": round(split["total"], 3)},
        "same_output_as_plain": same,
        "same_output_as_eaglewire_plain": same_output_across_engines(row, rows) if greedy else None,
        "per_request": [{"new_tokens": s.new_tokens, "verify_passes": s.rounds if row.engine else None,
                         "tau": round(s.accept_length, 3) if row.engine and s.rounds else None,
                         "seconds": round(s.total_seconds, 3), "finish_reason": s.finish_reason} for s in row.stats],
    }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def table_cells(result: BenchResult) -> list[list[str]]:
    """One list of strings per row, in HEADERS order."""
    cells = []
    for row in result.rows:
        d = row_dict(row, result.rows, result.config.temperature == 0)
        sec = d["seconds"]
        same = d["same_output_as_plain"]
        cells.append([
            d["name"], d["method"], _num(d["tokens_per_second"], 1),
            "-" if d["speedup"] is None else f"{d['speedup']:.2f}x",
            _num(d["tau_pooled"]), _num(d["tau_per_request_mean"]), _num(d["verified_per_pass"]),
            " ".join(f"{a:.2f}" for a in d["position_acceptance"]) or "-",
            *(_num(sec.get(k)) for k in ("draft", "verify", "prefill", "other")),
            str(d["new_tokens"]), "-" if same is None else f"{same}/{d['prompts']}",
        ])
    return cells


def terminal_table(result: BenchResult) -> str:
    """Aligned plain-text table with a header line naming the run."""
    cells = [HEADERS] + table_cells(result)
    widths = [max(len(r[c]) for r in cells) for c in range(len(HEADERS))]
    left = {0, 1, HEADERS.index("acceptance by position")}  # text columns; numbers align right
    lines = ["  ".join(v.ljust(w) if c in left else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([_title(result), ""] + lines)


def _title(result: BenchResult) -> str:
    c = result.config
    return (f"bench: {c.target} + {c.draft or 'no draft'} on {c.dataset} ({len(result.prompts)} prompts, "
            f"max {c.max_new_tokens} new tokens, temperature {c.temperature:g})")


def markdown(result: BenchResult) -> str:
    """bench.md: the command line, the table and what the columns mean."""
    def line(values: list[str]) -> str:
        return "| " + " | ".join(values) + " |"

    table = [line(HEADERS), line(["---"] * len(HEADERS))] + [line(r) for r in table_cells(result)]
    return "\n".join([f"# {_title(result)}", "", "```", result.command, "```", "", *table, "", TAU_NOTE, ""])


def to_json(result: BenchResult) -> dict:
    c = result.config
    return {"command": result.command, "target": c.target, "draft": c.draft, "dataset": c.dataset,
            "prompts": [p.id for p in result.prompts], "max_new_tokens": c.max_new_tokens,
            "temperature": c.temperature, "seed": c.seed, "engines": list(c.engine), "note": TAU_NOTE,
            "rows": [row_dict(r, result.rows, c.temperature == 0) for r in result.rows]}


def plot_acceptance(result: BenchResult, png: Path) -> Path:
    """Per-position acceptance, one line per speculative config."""
    from eaglewire.core.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in result.rows:
        acc = position_acceptance(row.stats)
        if row.engine and row.method != "plain" and acc:
            ax.plot(range(1, len(acc) + 1), acc, "o-", label=row.name)
    ax.set(xlabel="draft position (depth)", ylabel="acceptance rate", ylim=(0, 1),
           title=f"per-position acceptance on {result.config.dataset}")
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title="batch,steps,topk,draft tokens", fontsize=8)
    return _save(plt, fig, png)


def plot_throughput(result: BenchResult, png: Path) -> Path:
    """tokens/s per config, baselines included."""
    from eaglewire.core.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(result.rows) + 2), 4))
    names = [r.name for r in result.rows]
    values = [r.tokens_per_second for r in result.rows]
    bars = ax.bar(names, values, color=["C0" if r.engine else "C1" for r in result.rows])
    ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], fontsize=8)
    ax.set(xlabel="config (batch,steps,topk,draft tokens) or baseline", ylabel="tokens/s",
           title=f"throughput on {result.config.dataset}")
    return _save(plt, fig, png)


def _save(plt, fig, png: Path) -> Path:
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def write_report(result: BenchResult, out: str | Path) -> list[Path]:
    """bench.json, bench.md, acceptance.png and throughput.png in ``out``."""
    out = Path(out)
    with directory_lock(out, what=f"--out {out}"):
        return _write_report(result, out)


def _write_report(result: BenchResult, out: Path) -> list[Path]:
    (out / "bench.json").write_text(json.dumps(to_json(result), indent=2, ensure_ascii=False))
    (out / "bench.md").write_text(markdown(result))
    return [out / "bench.json", out / "bench.md", plot_acceptance(result, out / "acceptance.png"),
            plot_throughput(result, out / "throughput.png")]
