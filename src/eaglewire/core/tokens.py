"""Tokenizer facts every command shares: which token ids end a reply."""

from __future__ import annotations

from typing import Any

__all__ = ["END_OF_TURN_TOKENS", "stop_token_ids"]

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """EOS (tokenizer's and the model's generation config's) and any known end-of-turn token."""
    eos = [tokenizer.eos_token_id]
    if model is not None and getattr(model, "generation_config", None) is not None:
        gen_eos = model.generation_config.eos_token_id
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    vocab = tokenizer.get_vocab()
    ids = [i for i in eos if i is not None] + [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    return list(dict.fromkeys(ids))
