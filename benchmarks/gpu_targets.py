"""The random-weight targets the GPU harness and probes build on the device: a real model's decoder shape, no
weights to carry (the device tool carries at most 64 MiB).

Imported by benchmarks/gpu_harness.py (run as a script from this folder, which python puts on the path) and the
probes in benchmarks/experiments/gpu/ (which put this folder on the path).
"""

from __future__ import annotations

SHAPES = {  # LlamaConfig fields; the vocabulary is SmolLM2's tokenizer's
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=2048),
}
VOCAB = 49152  # SmolLM2's tokenizer


def random_target(shape: str, device):
    """An eaglewire ``Target`` around a random-weight Llama of ``shape`` made on ``device`` in its dtype (bf16 on
    CUDA, fp32 elsewhere): no fp32 copy of an 8B model first, and RoPE's frequencies stay fp32 as a loaded
    checkpoint's do (a ``.to(bf16)`` afterwards would round them)."""
    import torch
    import transformers

    from eaglewire.model.target import Target

    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    config = transformers.LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, **SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=None, spec=f"random {shape}")
