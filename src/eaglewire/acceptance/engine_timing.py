"""Timing an engine: a plain run and chains of 1..N drafted tokens on the same prompts.

Each probe also returns the plain run's outputs: the engine's own text, along which the draft's
acceptance is traced (a quantized llama.cpp target picks its own tokens, and the draft must
match those, not eaglewire's fp32 target's).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.sampling import SamplingParams
from eaglewire.acceptance.costs import ChainProbe, PlainProbe

WARMUP_TOKENS = 32  # the first request of a fresh server runs several times slower

Progress = Callable[[str], None]


@dataclass
class ProbeResult:
    plain: PlainProbe
    chains: list[ChainProbe]
    outputs: list[list[int]]  # the plain run's new tokens per prompt


def _no_progress(_: str) -> None:
    pass


def probe_eaglewire(target, draft, contract, prompts: list[list[int]], *, steps: list[int], max_new_tokens: int,
                    temperature: float = 0.0, seed: int = 0, stop_ids: set[int] | None = None,
                    progress: Progress = _no_progress) -> ProbeResult:
    """eaglewire's engine, prompt-major (each prompt runs every shape back to back, so drift on a
    shared machine hits all shapes alike). A chain of n runs n - 1 draft forwards per round; its
    first drafted token comes with the previous round's context update, which the fit keeps on
    the verify side."""
    decoders = [(0, SpecDecoder(target))] + [(n, SpecDecoder(target, draft, contract, SpecConfig.chain(n)))
                                              for n in steps]
    for _, decoder in decoders:
        decoder.generate(prompts[0], max_new_tokens=min(16, max_new_tokens), stop_token_ids=stop_ids)
    plain_tokens, plain_seconds, outputs = 0, 0.0, []
    acc = {n: [0, 0.0, 0.0] for n in steps}  # n -> rounds, decode seconds, draft seconds
    for i, ids in enumerate(prompts):
        progress(f"eaglewire: prompt {i + 1}/{len(prompts)}")
        sampling = SamplingParams(temperature=temperature, seed=seed + i)
        for n, decoder in decoders:
            out, st = decoder.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=stop_ids)
            decode = st.total_seconds - st.prefill_seconds
            if n == 0:
                plain_tokens += max(st.new_tokens - 1, 0)  # the first token comes with the prefill
                plain_seconds += decode
                outputs.append(out)
            else:
                acc[n][0] += st.rounds
                acc[n][1] += decode
                acc[n][2] += st.draft_seconds
    chains = [ChainProbe(n=n, rounds=r, decode_seconds=d, draft_seconds=g, steps_per_round=n - 1)
              for n, (r, d, g) in acc.items()]
    return ProbeResult(PlainProbe(plain_tokens, plain_seconds), chains, outputs)


# ------------------------------------------------------------------ DFlash in eaglewire's engine

BLOCK_REPEATS = 5  # timings per round length; the median is kept


@dataclass
class BlockTimes:
    """A DFlash round's parts timed at one context: verify(k) (the target over k tokens, its head,
    the states to the draft's context) per k, and one block pass (the draft + the target's lm_head)."""

    verify: dict[int, float]
    draft_pass: float


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms caches up and is dropped
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return times[len(times) // 2]


def time_block_round(target, draft, boundaries: list[int], context: list[int], *, repeats: int = BLOCK_REPEATS
                     ) -> BlockTimes:
    """Time a DFlash round's parts after ``context`` with the engine's own target runner and the draft's
    own forward (``draft_block``): verify(k) for k = 1 .. block_size (a round verifies the root and up
    to block_size - 1 drafted tokens) and one block pass."""
    import torch

    from eaglewire.decode.runner import make_runner
    from eaglewire.model.dflash_blocks import draft_lm_head, mask_embedding

    bs, P = draft.config.block_size, len(context)
    runner = make_runner(target, boundaries)
    runner.reset()
    ids = torch.tensor(context)
    with torch.no_grad():
        _, aux = runner.forward(ids, torch.arange(P), None)  # [P, k*H]
        runner.commit(list(range(P)))
        ctx_kv = draft.context_kv(draft.fuse(aux[None].float()), torch.arange(P)[None])
        lm_head, mask_emb = draft_lm_head(target, draft), mask_embedding(draft, target.embed_tokens, target.device)
        anchor = target.embed_tokens(ids[-1:].to(target.device)).float()  # [1, H]

    def verify(k: int) -> None:
        with torch.no_grad():
            last, got = runner.forward(ids[-k:], torch.arange(P, P + k), None)  # [k, H], [k, k*H]
            runner.head(last).argmax(-1)
            draft.context_kv(draft.fuse(got[None].float()), torch.arange(P, P + k)[None])
            runner.commit([])  # nothing kept: the next timing starts from the same context

    def block_pass() -> None:
        with torch.no_grad():
            lm_head(draft.draft_block(anchor, mask_emb, P, ctx_kv)[0]).argmax(-1)

    times = {k: _median_seconds(lambda: verify(k), repeats) for k in range(1, bs + 1)}
    return BlockTimes(verify=times, draft_pass=_median_seconds(block_pass, repeats))


def probe_eaglewire_blocks(target, draft, contract, prompts: list[list[int]], *, max_new_tokens: int,
                           temperature: float = 0.0, seed: int = 0, stop_ids: set[int] | None = None,
                           progress: Progress = _no_progress) -> tuple[ProbeResult, BlockTimes]:
    """A DFlash draft in eaglewire's engine: the plain run (its outputs and plain step), and a round's
    parts timed directly (``time_block_round``) halfway through the first prompt's output, the
    context a round sees on average."""
    plain = probe_eaglewire(target, None, None, prompts, steps=[], max_new_tokens=max_new_tokens,
                            temperature=temperature, seed=seed, stop_ids=stop_ids, progress=progress)
    progress("eaglewire: timing a DFlash round's verify and block pass")
    first = prompts[0] + plain.outputs[0][:len(plain.outputs[0]) // 2]
    return plain, time_block_round(target, draft, list(contract.aux_boundaries), first)


# ------------------------------------------------------------------ an engine that runs here as a server

def probe_server(engine, files, settings, prompts: list[list[int]], *, steps: list[int], max_new_tokens: int,
                 temperature: float = 0.0, seed: int = 0, log_dir: Path | None = None,
                 progress: Progress = _no_progress) -> ProbeResult:
    """One server per shape of ``engine`` (an ``engines.EngineSpec`` with a runtime): plain, then chains of
    1..N drafted tokens (no probability stop), each warmed up with one request; the rounds and the draft time
    come from the engine's own account (``RunningServer.draft_totals``; an engine that does not time its drafting
    apart leaves it on the verify side)."""
    from eaglewire.engines.interface import Shape

    runtime = engine.runtime
    log_dir = Path(log_dir or ".")

    def run(n: int):
        shape = Shape(n_max=n)
        with runtime.serve(files, shape, settings, log_path=log_dir / f"{engine.name}-tune-{n}.log",
                           draft_timing=True) as server:
            server.generate(prompts[0], max_new_tokens=WARMUP_TOKENS, temperature=temperature, seed=seed)
            before = server.draft_totals()
            answers = []
            for i, ids in enumerate(prompts):
                progress(f"{runtime.label} {shape.label()}: prompt {i + 1}/{len(prompts)}")
                answers.append(server.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                               seed=seed + i))
            after = server.draft_totals()
        if n and (before is None or after is None):
            raise RuntimeError(f"{runtime.label} gave no account of its drafting at {shape.label()}; see "
                               f"{log_dir / f'{engine.name}-tune-{n}.log'}")
        return answers, before, after

    def decode_seconds(answers) -> float:
        return sum(a.stats.total_seconds - a.stats.prefill_seconds for a in answers)

    answers, _, _ = run(0)
    tokens = sum(max(a.stats.new_tokens - 1, 0) for a in answers)  # the first token comes with the prefill
    plain = PlainProbe(tokens, decode_seconds(answers))
    outputs = [a.tokens for a in answers]
    chains = []
    for n in steps:
        answers, before, after = run(n)
        drafted = (after.draft_seconds - before.draft_seconds) if after.draft_seconds is not None else 0.0
        chains.append(ChainProbe(n=n, rounds=after.rounds - before.rounds, decode_seconds=decode_seconds(answers),
                                 draft_seconds=drafted, steps_per_round=runtime.draft_steps(n, files.family)))
    return ProbeResult(plain, chains, outputs)
