"""llama-server's EAGLE-3 acceptance with other requests in flight: tokens a drafting round (from its own
``spec_decode_num_drafts_total``) for MT-bench prompts A and B sent alone, then together in several mixes -- the same
prompt twice (identical sequences: a draft given another sequence's states would not notice), A with B, 4 x A,
A-D -- twice each. Greedy, 64 tokens a request, a chain of 3, one 4-slot server.

    OMP_NUM_THREADS=2 python benchmarks/experiments/llamacpp/llamacpp_load_acceptance.py [--export runs/load-llamacpp/llamacpp-export]

(--export: a directory holding target-f32.gguf and draft-q8_0.gguf; default: the reference exported into
runs/llamacpp-load-acceptance.)
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", help="a directory with target-f32.gguf and draft-q8_0.gguf")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    from eaglewire.acceptance.speed import encoded_prompts
    from eaglewire.core.machine import summary_line
    from eaglewire.engines import export_draft
    from eaglewire.engines.interface import RunSettings, ServedFiles, Shape
    from eaglewire.engines.llamacpp import RUNTIME
    from eaglewire.model.target import load_tokenizer

    settings = RunSettings(slots=4)
    if args.export:
        files = ServedFiles(Path(args.export) / "target-f32.gguf", Path(args.export) / "draft-q8_0.gguf")
    else:
        files = RUNTIME.files("reference", "smollm2-135m", Path("runs/llamacpp-load-acceptance"), settings,
                              export=export_draft)
    a, b, c, d = encoded_prompts(load_tokenizer("smollm2-135m"), "mt-bench", 0, 4)
    print(summary_line())

    def tau(server, prompts: list[list[int]]) -> float:
        """Tokens a round of ``prompts`` sent at once (each request's first token, the prefill's, not counted)."""
        before = server.spec_rounds()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda p: server.complete(p, max_new_tokens=args.tokens, temperature=0.0, seed=0),
                                 prompts))
        return sum(len(o) - 1 for o in outs) / (server.spec_rounds() - before)

    mixes = {"A alone": [a], "B alone": [b], "A + A together": [a, a], "A + B together": [a, b],
             "4 x A together": [a] * 4, "A, B, C, D together": [a, b, c, d]}
    with RUNTIME.serve(files, Shape(3), settings, log_path=Path("runs/llamacpp-load-acceptance.log")) as server:
        for name, prompts in mixes.items():
            print(f"{name:22} tokens a round: " + ", ".join(f"{tau(server, prompts):.3f}" for _ in range(2)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
