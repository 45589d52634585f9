"""The doctor against the faults users and other tools write, on the real target (SmolLM2-135M) and the
shipped reference draft: each fault is rebuilt from eaglewire's own exports (llama.cpp's converter for the
GGUF, edited with gguf-py; JSON and safetensors edited as a user would), ``eaglewire doctor`` runs on it as a
user runs it, one at a time, and the verdict, the checks that FAILed (or the error line) and the wall time
are recorded.

    python benchmarks/experiments/doctor/doctor_faults.py --work /tmp/doctor-faults --threads 2 --out benchmarks/experiments/doctor/doctor_faults.json

The faults that need another target (a Qwen2-VL wrapper, a DFlash draft) or a capture to import are the
tests named in ``TESTED_ELSEWHERE``; their wall time is the test's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from eaglewire.core.machine import summary_line

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from gguf_edit import rewrite_gguf  # noqa: E402

EAGLEWIRE = [sys.executable, "-m", "eaglewire.cli"]
TESTED_ELSEWHERE = {
    "post-norm last state imported as pre-norm (import-data)": "tests/test_label_state.py",
    "pre-norm state in a SpecForge capture": "tests/test_label_state.py",
    "Qwen2-VL target, --engine vllm/sglang, no --engine-config": "tests/test_doctor_fixes_applied.py",
    "export of a Qwen2-VL draft": "tests/test_doctor_fixes_applied.py",
    "DFlash draft, ids one off in its vLLM config (sweep fix keys)": "tests/test_doctor_dflash.py",
}


@dataclass
class Fault:
    name: str
    expect: str  # "pass", "fail", "warn" or "error" (one error: line, exit 2)
    args: list[str]
    verdict: str = ""
    failed: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0


def run(cmd: list[str], threads: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def exports(work: Path, threads: int) -> dict[str, Path]:
    """The reference draft exported once per engine (kept between runs)."""
    out = {}
    for to in ("vllm", "sglang", "llamacpp"):
        d = work / f"reference-{to}"
        if not d.exists():
            extra = ["--target-outtype", "none"] if to == "llamacpp" else []
            r = run([*EAGLEWIRE, "export", "--draft", "reference", "--to", to, "--out", str(d), *extra], threads)
            if r.returncode:
                raise SystemExit(f"export --to {to} failed:\n{r.stderr[-2000:]}")
        out[to] = d
    return out


def edited_config(src: Path, dst: Path, **changes) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def faults(work: Path, ex: dict[str, Path]) -> list[Fault]:
    from safetensors.torch import load_file, save_file
    import torch

    from eaglewire.engines.llamacpp.served import NORM_BEFORE_FC_TENSOR, read_served

    gguf = next(ex["llamacpp"].glob("draft-*.gguf"))
    served = read_served(gguf)
    rows = served.own_embedding.numpy()  # [V, H]
    permuted = rows[np.random.default_rng(0).permutation(rows.shape[0])]  # [V, H] another model's rows
    width = 3 * served.served.target_hidden_size
    perm_gguf = rewrite_gguf(gguf, work / "perm.gguf", tensors={"token_embd.weight": permuted})
    nbf_gguf = rewrite_gguf(gguf, work / "nbf.gguf", fields={"eagle3.norm_before_fc": True},
                            tensors={NORM_BEFORE_FC_TENSOR: np.ones(width, np.float32)})
    vllm, sglang = ex["vllm"] / "config.json", ex["sglang"] / "config.json"
    shifted = edited_config(ex["vllm"], work / "vllm-shifted", eagle_aux_hidden_state_layer_ids=[0, 2, 15])
    sg_nbf = edited_config(ex["sglang"], work / "sglang-nbf", eagle_config={"norm_before_fc": True})
    no_nbr = edited_config(ex["vllm"], work / "vllm-no-nbr", norm_before_residual=None)
    other_emb = edited_config(ex["vllm"], work / "vllm-other-embedding")
    state = load_file(str(other_emb / "model.safetensors"))
    emb = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = emb[torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(0))]
    save_file(state, str(other_emb / "model.safetensors"))
    cut = edited_config(ex["vllm"], work / "vllm-cut")
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    listed = edited_config(ex["vllm"], work / "vllm-list")
    (listed / "config.json").write_text("[1, 2, 3]")
    traffic = work / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}], "temperature": 0.7}) + "\n"
                               for p in ("Write a haiku about rain.", "What does a CPU do?",
                                         "Give me two tips for better sleep.", "Why is the sky blue?")))

    def spec(model: Path, n: int | None = 3) -> str:
        body = {"method": "eagle3", "model": str(model), **({} if n is None else {"num_speculative_tokens": n})}
        return f"--speculative-config '{json.dumps(body)}'"

    d = ["doctor", "--draft", "reference", "--no-tune"]
    return [
        Fault("control: llama.cpp GGUF export", "pass", [*d, "--engine", "llamacpp", "--engine-config", str(gguf)]),
        Fault("GGUF token_embd: another model's rows", "fail",
              [*d, "--engine", "llamacpp", "--engine-config", str(perm_gguf)]),
        Fault("GGUF eagle3.norm_before_fc true + its norm tensor", "fail",
              [*d, "--engine", "llamacpp", "--engine-config", str(nbf_gguf)]),
        Fault("control: vLLM export", "pass", [*d, "--engine", "vllm", "--engine-config", str(vllm)]),
        Fault("vLLM: faulty config named only by --speculative-config", "fail",
              [*d, "--engine", "vllm", "--engine-flags", spec(shifted)]),
        Fault("vLLM: num_speculative_tokens 0", "fail", [*d, "--engine", "vllm", "--engine-flags", spec(ex["vllm"], 0)]),
        Fault("vLLM: config omits norm_before_residual", "fail",
              [*d, "--engine", "vllm", "--engine-config", str(no_nbr / "config.json")]),
        Fault("control: SGLang export", "pass", [*d, "--engine", "sglang", "--engine-config", str(sglang)]),
        Fault("SGLang: flags without --speculative-algorithm", "fail",
              [*d, "--engine", "sglang", "--engine-flags", f"--speculative-draft-model-path {ex['sglang']}"]),
        Fault("SGLang: eagle_config.norm_before_fc true", "fail",
              [*d, "--engine", "sglang", "--engine-config", str(sg_nbf / "config.json")]),
        Fault("users sample at temperature 0.7 (--traffic)", "warn", [*d, "--traffic", str(traffic)]),
        Fault("--traffic with --engine-flags, ordinary requests", "warn",  # its requests sample at 0.7
              [*d, "--engine", "vllm", "--engine-flags", spec(ex["vllm"]), "--traffic", str(traffic)]),
        Fault("foreign draft with another embed_tokens", "error", ["doctor", "--draft", str(other_emb), "--no-tune"]),
        Fault("... with the --allow-target-mismatch it names", "fail",
              ["doctor", "--draft", str(other_emb), "--no-tune", "--allow-target-mismatch", "weights_sha256",
               "--engine", "vllm", "--engine-config", str(other_emb / "config.json")]),
        Fault("foreign draft: cut model.safetensors", "error", ["doctor", "--draft", str(cut), "--no-tune"]),
        Fault("foreign draft: config.json holds a list", "error", ["doctor", "--draft", str(listed), "--no-tune"]),
        Fault("--engine-config a directory", "error", [*d, "--engine", "vllm", "--engine-config", str(ex["vllm"])]),
        Fault("--engine-config a JSON string", "error", [*d, "--engine", "vllm", "--engine-config", '{"a": 1}']),
    ]


def judge(fault: Fault, proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout
    fault.failed = [" ".join(line.split()[1:3]) for line in out.splitlines() if line.startswith("FAIL ")]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if proc.returncode == 2 and errors:
        fault.verdict, fault.error = "error", errors[0][:160]
    elif proc.returncode == 0:
        fault.verdict = "warn" if any(line.startswith("WARN ") for line in out.splitlines()) else "pass"
    elif proc.returncode == 1 and fault.failed:
        fault.verdict = "fail"
    else:
        fault.verdict = f"crash (exit {proc.returncode})"
        fault.error = (proc.stderr.strip().splitlines() or [""])[-1][:160]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/doctor-faults")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--only", default=None, help="run the faults whose name contains this")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ex = exports(work, args.threads)
    results = []
    for fault in faults(work, ex):
        if args.only and args.only not in fault.name:
            continue
        start = time.perf_counter()
        proc = run([*EAGLEWIRE, "--threads", str(args.threads), *fault.args], args.threads)
        fault.seconds = round(time.perf_counter() - start, 1)
        judge(fault, proc)
        (work / "logs").mkdir(exist_ok=True)
        (work / "logs" / f"{len(results):02d}.txt").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
        results.append(fault)
        mark = "" if fault.verdict == fault.expect else "   <-- expected " + fault.expect
        print(f"{fault.name:58s} {fault.verdict:6s} {fault.seconds:6.1f}s  {', '.join(fault.failed) or fault.error}{mark}",
              flush=True)
    print(summary_line())
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": summary_line(), "threads": args.threads,
                                              "faults": [asdict(f) for f in results],
                                              "tested_elsewhere": TESTED_ELSEWHERE}, indent=1) + "\n")


if __name__ == "__main__":
    main()
