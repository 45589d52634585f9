"""How long the data stage takes here per conversation: the target's batched regeneration and its capture, timed
on synthetic tokens in the precision and on the device the stage runs in (seconds, before any data is read).

The quickstart sizes its slice with it (``train/plan.py``): a fixed cost per conversation measured on one CPU was
wrong by 5x on another (126 conversations planned from a bf16 training speed, then regenerated in fp32 at 32 tok/s).
"""

from __future__ import annotations

import time

import torch

from eaglewire.core.device import synchronize
from eaglewire.model.capture import capture
from eaglewire.model.target import Target

PROMPT_TOKENS = 136  # a ShareGPT first turn through SmolLM2's chat template, on average (the quickstart's data)
PROBE_STEPS = 16  # decoding steps timed; the slope over them is one step's cost


def data_seconds_per_conversation(target: Target, *, batch_size: int, reply_tokens: float, sequence_tokens: float
                                  ) -> dict[str, float]:
    """Seconds the data stage spends on one conversation here: regenerating ``reply_tokens`` in batches of
    ``batch_size`` (a prefill of the prompts, then one batched step per token) and capturing ``sequence_tokens``.
    Returns the parts and their sum (``seconds``)."""
    from eaglewire.decode.batched import BatchedDecoder
    from eaglewire.decode.runner import has_lean_forward

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.vocab_size, (batch_size, PROMPT_TOKENS), generator=g).tolist()  # [B, P]

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        if has_lean_forward(target):
            decoder.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
        else:  # HF generate, as regenerate falls back to
            ids = torch.tensor(prompts, device=target.device)  # [B, P]
            target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        synchronize(target.device)
        return time.perf_counter() - start

    decoder = BatchedDecoder(target) if has_lean_forward(target) else None
    with torch.inference_mode():
        timed(2)  # warm-up: kernels, allocator
        prefill = timed(1)
        step = max(timed(1 + PROBE_STEPS) - prefill, 0.0) / PROBE_STEPS  # one batched step, seconds
        ids = torch.randint(0, target.vocab_size, (batch_size, int(sequence_tokens)), generator=g)  # [B, T]
        start = time.perf_counter()
        capture(target, ids.to(target.device), [target.num_layers // 2])
        synchronize(target.device)
        captured = time.perf_counter() - start
    regenerate = (prefill + reply_tokens * step) / batch_size
    return {"regenerate": regenerate, "capture": captured / batch_size, "seconds": regenerate + captured / batch_size}
