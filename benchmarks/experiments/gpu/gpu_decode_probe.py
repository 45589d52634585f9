"""Decoding on a GPU against its memory roofline: eager steps beside CUDA-graph steps, in one process.

Builds a random-weight Llama of a real model's decoder shape directly on the device (no weights travel),
then measures side by side, each after a 512-token prefill:

- the device's copy bandwidth and the roofline step (weight bytes / bandwidth);
- transformers' eager step (DynamicCache), the lean runner's eager step and its graph-replayed step;
- a verify of 1..8 tokens (a chain) both ways; a random EAGLE-3 draft's step both ways;
- greedy speculative decoding (chain of 3) against plain greedy decoding with graphs: whether the outputs
  match in bf16 (a batched verify may round differently from a one-token step) and where they part;
- a random DFlash draft's block pass (5 layers, block of 16, after the same context) with its growing context
  against the static context replayed from a graph, and the block pass's kernels;
- the speed-up a draft would give at a stated tau of 3 with a chain of 3 (what ``tune`` predicts from the
  same costs: tau * plain step / (verify of 4 + 3 draft steps)).

    python benchmarks/experiments/gpu/gpu_decode_probe.py --device cuda --shape llama-3.1-8b   # ~1 minute on an H200
    python benchmarks/experiments/gpu/gpu_decode_probe.py --device cpu --shape tiny            # a rehearsal

Prints one JSON line (and writes it to ``--out`` when given); every part catches its own error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_targets import SHAPES, VOCAB, random_target  # noqa: E402

PREFILL = 512
VERIFY_SIZES = (1, 2, 4, 8)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of ``fn`` (mean of ``reps`` after two warm-ups)."""
    for _ in range(2):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a device-to-device copy of 1 GiB."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() / seconds


def step_costs(target, boundaries: list[int], static: bool, device: torch.device, reps: int,
               compiled: bool = False) -> dict:
    """The lean runner's forward of N chain tokens after the prefill, N in VERIFY_SIZES: ms each. ``compiled``:
    the static forward through torch.compile (inductor's fused kernels) before the graph captures it."""
    from eaglewire.decode.runner import LeanRunner
    from eaglewire.decode.step_graphs import StepGraphs

    runner = LeanRunner(target, boundaries, max_length=PREFILL + 64, static=static)
    if compiled:
        runner.graphs = StepGraphs(torch.compile(runner._static_forward, dynamic=False))
    ids = torch.randint(0, VOCAB, (PREFILL + 8,), generator=torch.Generator().manual_seed(1))
    runner.forward(ids[:PREFILL], torch.arange(PREFILL), None)
    runner.commit(list(range(PREFILL)))
    out = {}
    for n in VERIFY_SIZES:
        block, pos = ids[PREFILL:PREFILL + n], torch.arange(PREFILL, PREFILL + n)
        mask = None
        if n > 1:
            mask = torch.ones(n, PREFILL + n, dtype=torch.bool)
            mask[:, PREFILL:] = torch.ones(n, n, dtype=torch.bool).tril()

        def call():
            last, _ = runner.forward(block, pos, mask)
            runner.head(last)

        out[n] = round(1e3 * timed(call, device, reps), 3)  # the block is never committed: same columns each call
    if runner.graphs is not None:
        out["graphs"] = len(runner.graphs)
    return out


def hf_step(target, device: torch.device, reps: int) -> float:
    """transformers' eager forward of one token after the prefill (DynamicCache), ms."""
    from transformers import DynamicCache

    model = target.model
    ids = torch.randint(0, VOCAB, (1, PREFILL), device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        one = ids[:, :1]

        def call():
            model(input_ids=one, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the token again: the same cache length each call

        return round(1e3 * timed(call, device, reps), 3)


def random_fingerprint(target, dtype: torch.dtype):
    from eaglewire.core.contract import TargetFingerprint

    return TargetFingerprint(architecture="LlamaForCausalLM", num_layers=target.num_layers,
                             hidden_size=target.hidden_size, vocab_size=target.vocab_size, tokenizer_sha256="random",
                             chat_template_sha256="random", weights_sha256="random", dtype=str(dtype)[6:])


def random_draft(target, boundaries: list[int], dtype: torch.dtype):
    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    V = target.vocab_size
    fingerprint = random_fingerprint(target, dtype)
    torch.manual_seed(1)
    Vd = min(32000, V)
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(boundaries), draft_vocab_size=Vd,
                                                vocab_size=V))
    draft.set_vocab(torch.arange(Vd) * 0, torch.arange(V) < Vd)  # d2t offsets 0: draft ids are target ids < Vd
    return draft.to(dtype).to(target.device), HiddenStateContract(aux_boundaries=tuple(boundaries), target=fingerprint)


def speculative(target, draft, contract, device: torch.device, static: bool, tokens: int) -> dict:
    """Greedy plain and chain-of-3 decoding of one prompt with the static (graph) or dynamic runner; the chain's
    rounds drafted whole (one graph a round on CUDA) and, beside it, a level at a time."""
    from eaglewire.decode.runner import LeanRunner
    from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder

    prompt = torch.randint(0, VOCAB, (PREFILL,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {}
    results = {}
    for name in ("plain", "chain3", "chain3_levels"):
        decoder = SpecDecoder(target) if name == "plain" else SpecDecoder(target, draft, contract, SpecConfig.chain(3))
        if name == "chain3_levels":
            decoder.drafter.whole_rounds = False
        decoder._target_runner = LeanRunner(target, decoder.boundaries, static=static)
        decoder.generate(prompt, max_new_tokens=8)  # warm-up: captures
        sync(device)
        start = time.perf_counter()
        tokens_out, stats = decoder.generate(prompt, max_new_tokens=tokens)
        sync(device)
        seconds = time.perf_counter() - start
        results[name] = tokens_out
        row = {"ms_per_token": round(1e3 * seconds / len(tokens_out), 3), "rounds": stats.rounds,
               "verify_ms_per_round": round(1e3 * stats.verify_seconds / max(stats.rounds, 1), 3)}
        if name != "plain":  # per round: the context update and 2 tree levels (3 draft forwards)
            row["draft_ms_per_forward"] = round(1e3 * stats.draft_seconds / max(3 * stats.rounds, 1), 3)
            row["accept_length"] = round(stats.accept_length, 3)
        out[name] = row
    a = results["plain"]
    out["same_as_plain"] = a == results["chain3"]
    out["first_difference"] = next((i for i, (x, y) in enumerate(zip(a, results["chain3"])) if x != y), None)
    out["whole_rounds_same_as_levels"] = results["chain3"] == results["chain3_levels"]
    return out


def draft_forward(draft, target, contract, device: torch.device, dtype: torch.dtype, reps: int) -> float:
    """One draft forward of one token after a 512-token context (its KV cache), ms: the draft step itself."""
    from eaglewire.decode.gemm import pack_linears

    packed = pack_linears(draft.eval())
    H, k = target.hidden_size, len(contract.aux_boundaries)
    with torch.no_grad():
        hidden = packed.fuse(torch.randn(1, PREFILL, k * H, device=device, dtype=dtype))  # [1, P, H]
        emb = target.embed_tokens(torch.randint(0, VOCAB, (1, PREFILL), device=device)).to(dtype)
        _, past_k, past_v = packed.forward_cached(emb, hidden, torch.arange(PREFILL, device=device)[None], None,
                                                  None, None)
        pos = torch.tensor([[PREFILL]], device=device)

        def call():
            out, _, _ = packed.forward_cached(emb[:, :1], hidden[:, :1], pos, past_k, past_v, None)
            torch.log_softmax(packed.logits(out).float(), dim=-1).topk(1)

        return round(1e3 * timed(call, device, reps), 3)


def draft_graph_forward(draft, target, contract, device: torch.device, dtype: torch.dtype, reps: int) -> float:
    """A drafted level as the decoder runs it on CUDA (its fixed-width cache, one replayed graph holding the step
    and its head's log-probabilities and top-k), ms."""
    _, call = _draft_level(draft, target, contract, device, dtype)
    with torch.no_grad():
        return round(1e3 * timed(call, device, reps), 3)


def _draft_level(draft, target, contract, device: torch.device, dtype: torch.dtype, *, graphs: bool = True):
    """(the draft's static cache after a PREFILL-token context, a call drafting one level of one token)."""
    from eaglewire.decode.gemm import pack_linears
    from eaglewire.decode.kv_cache import StaticDraftCache

    packed = pack_linears(draft.eval())
    H, k = target.hidden_size, len(contract.aux_boundaries)
    cache = StaticDraftCache(packed, PREFILL + 64, device, dtype, graphs=graphs)
    with torch.no_grad():
        hidden = packed.fuse(torch.randn(1, PREFILL, k * H, device=device, dtype=dtype))  # [1, P, H]
        emb = target.embed_tokens(torch.randint(0, VOCAB, (1, PREFILL), device=device)).to(dtype)
        cache.forward(packed, emb, hidden, torch.arange(PREFILL, device=device)[None], None)
        cache.commit()
    pos = torch.tensor([[PREFILL]], device=device)

    def call():
        cache.forward_top(packed, emb[:, :1], hidden[:, :1], pos, None, 1)
        cache.rollback()

    return cache, call


def profile_kernels(call, device: torch.device) -> dict:
    """``call`` run eagerly under the profiler: how many kernels, their summed GPU time, and the largest by time --
    what a replayed graph of it still pays (its kernels) against the roofline (its bytes). Elsewhere (the CPU
    rehearsal) the same figures of its top-level aten ops."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with torch.no_grad():
        call()  # warm: no first-call allocations in the trace
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            call()
            sync(device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"] if cuda else \
        [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:60], []).append(e.cpu_time_total if not cuda else e.device_time_total
                                                    if hasattr(e, "device_time_total") else e.cuda_time_total)
    total_us = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {"kernels": len(kernels), "kernel_ms": round(total_us / 1e3, 3),
            "top": [{"name": n, "count": len(v), "ms": round(sum(v) / 1e3, 3)} for n, v in top]}


def kernel_breakdown(target, boundaries: list[int], device: torch.device) -> dict:
    """One static target step (N = 1), eagerly: ``profile_kernels``."""
    from eaglewire.decode.runner import LeanRunner

    runner = LeanRunner(target, boundaries, max_length=PREFILL + 64, static=True)
    runner.graphs = None  # eager: the profiler sees each kernel
    runner.forward(torch.randint(0, VOCAB, (PREFILL,)), torch.arange(PREFILL), None)
    runner.commit(list(range(PREFILL)))
    one, pos = torch.tensor([5]), torch.tensor([PREFILL])
    return profile_kernels(lambda: runner.forward(one, pos, None), device)


def draft_kernel_breakdown(draft, target, contract, device: torch.device, dtype: torch.dtype) -> dict:
    """One drafted level (step, head, log-softmax, top-k), eagerly: ``profile_kernels``."""
    _, call = _draft_level(draft, target, contract, device, dtype, graphs=False)
    return profile_kernels(call, device)


DFLASH_LAYERS, DFLASH_BLOCK = 5, 16  # the shape of z-lab's published DFlash drafts for 8B targets


def dflash_block_costs(target, boundaries: list[int], device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """A random DFlash draft's block pass after a PREFILL-token context, ms: the growing context (the CPU's path,
    eager) and the static one (CUDA's, its graph replayed), and the static pass's kernels run eagerly."""
    from eaglewire.decode.dflash_drafter import DFlashDrafter
    from eaglewire.model.dflash import DFlashConfig, DFlashDraft

    V = target.vocab_size
    torch.manual_seed(3)
    config = DFlashConfig.from_target(target.text_config, num_aux=len(boundaries), vocab_size=V,
                                      num_layers=DFLASH_LAYERS, block_size=DFLASH_BLOCK, mask_token_id=V - 1)
    with torch.device(device):  # initialised where it runs: ~1.1 B parameters at the 8B shape
        draft = DFlashDraft(config).to(dtype).eval()
    aux = torch.randn(PREFILL, len(boundaries) * target.hidden_size, device=device, dtype=dtype)  # [P, k*H]
    out: dict = {"layers": DFLASH_LAYERS, "block_size": DFLASH_BLOCK}
    for name, static in (("growing_eager_ms", False), ("static_graph_ms", True)):
        drafter = DFlashDrafter(target, draft, num_steps=DFLASH_BLOCK - 1, topk=1, num_draft_tokens=DFLASH_BLOCK,
                                min_score=float("-inf"), steps_flag="--speculative-num-steps", static=static)
        drafter.start(aux, capacity=PREFILL + 64)
        out[name] = round(1e3 * timed(lambda: drafter.block_logprobs(5, PREFILL), device, reps), 3)
    drafter.graphs = None  # the static pass eagerly: the profiler sees each kernel
    out["static_kernels"] = profile_kernels(lambda: drafter.block_logprobs(5, PREFILL), device)
    return out


def part(results: dict, name: str, fn) -> None:
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as err:  # one part failing must not lose the others
        results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
    print(f"  {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens of the speculative comparison")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile", action="store_true",
                        help="only the graph steps, with the static forward compiled first (inductor)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "shape": args.shape, "dtype": str(dtype)[6:], "prefill": PREFILL}
    start = time.perf_counter()
    target = random_target(args.shape, device)
    results["build_seconds"] = round(time.perf_counter() - start, 1)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    results["weight_gb"] = round(weight_bytes / 1e9, 3)
    L = target.num_layers
    boundaries = [2, L // 2, L - 3]
    if device.type == "cuda":
        part(results, "copy_tb_s", lambda: round(copy_bandwidth(device) / 1e12, 3))
        if isinstance(results["copy_tb_s"], float):
            results["roofline_step_ms"] = round(1e3 * weight_bytes / (results["copy_tb_s"] * 1e12), 3)
    if args.compile:
        part(results, "lean_graph_ms", lambda: step_costs(target, boundaries, True, device, args.reps))
        part(results, "lean_compiled_graph_ms", lambda: step_costs(target, boundaries, True, device, args.reps,
                                                                   compiled=True))
        print(json.dumps(results), flush=True)
        return 0
    part(results, "hf_eager_step_ms", lambda: hf_step(target, device, args.reps))
    part(results, "lean_eager_ms", lambda: step_costs(target, boundaries, False, device, args.reps))
    part(results, "lean_graph_ms", lambda: step_costs(target, boundaries, True, device, args.reps))
    part(results, "step_kernels", lambda: kernel_breakdown(target, boundaries, device))
    draft = contract = None
    try:
        draft, contract = random_draft(target, boundaries, dtype)
    except Exception as err:
        results["draft"] = {"error": f"{type(err).__name__}: {err}"}
    if draft is not None:
        part(results, "draft_forward_ms", lambda: draft_forward(draft, target, contract, device, dtype, args.reps))
        part(results, "draft_graph_ms", lambda: draft_graph_forward(draft, target, contract, device, dtype, args.reps))
        part(results, "draft_level_kernels", lambda: draft_kernel_breakdown(draft, target, contract, device, dtype))
        part(results, "dflash_block", lambda: dflash_block_costs(target, boundaries, device, dtype, args.reps))
        part(results, "spec_eager", lambda: speculative(target, draft, contract, device, False, args.tokens))
        part(results, "spec_graph", lambda: speculative(target, draft, contract, device, True, args.tokens))
    graph = results.get("lean_graph_ms")
    spec = results.get("spec_graph")
    if isinstance(graph, dict) and 1 in graph and 4 in graph and isinstance(spec, dict) and "chain3" in spec:
        plain, verify4 = graph[1], graph[4]
        draft_ms = spec["chain3"]["draft_ms_per_forward"]
        results["verify8_over_step"] = round(graph[8] / plain, 3)
        results["draft_over_step"] = round(draft_ms / plain, 3)
        results["predicted_speedup_tau3_chain3"] = round(3 * plain / (verify4 + 3 * draft_ms), 3)
    results["total_seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps(results)
    print(line, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
