"""Prove a llama-server runs on this machine before it is declared installed.

The smoke run serves a tiny random Llama GGUF whose matrices are Q8_0 (the type ggml's AMX
kernels take, and whose kernels trapped on an Intel Xeon with AMX, issue 38), with every
dimension a multiple of 32 so the quantized kernels accept them, on two threads (the trap was in
the worker threads), and asks it for a completion of a 64-token prompt (a batch large enough
for the tiled kernels). A server that dies is reported with its exit signal and log line.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from eaglewire.engines.llamacpp.failure import LlamaCppError, exit_cause
from eaglewire.engines.llamacpp.server import LlamaServer, ServerConfig, complete

SMOKE_THREADS = 2
SMOKE_PROMPT_TOKENS = 64
SMOKE_NEW_TOKENS = 4
HIDDEN, FFN, LAYERS, HEADS, VOCAB = 64, 128, 2, 4, 288  # every matrix dimension a multiple of 32 (Q8_0 blocks)


class SmokeFailed(LlamaCppError):
    """The built llama-server died or did not answer on the smoke GGUF."""


def write_smoke_gguf(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer random Llama (hidden 64, vocab 288) with Q8_0 matrices and a byte-level BPE
    vocabulary, written with gguf-py."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    rng = np.random.default_rng(seed)
    tokens = sorted(ByteLevel.alphabet()) + ["ĠĠ", "<|endoftext|>"]  # GPT-2's 256 byte symbols: any text tokenizes
    tokens += [f"<|unused{i}|>" for i in range(VOCAB - len(tokens))]
    types = [gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * (VOCAB - 257)
    eos = tokens.index("<|endoftext|>")

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("eaglewire smoke")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)

    def matrix(name: str, rows: int, cols: int) -> None:
        weight = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05  # (out, in), as gguf stores it
        writer.add_tensor(name, gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        for proj in ("q", "k", "v", "output"):
            matrix(f"blk.{i}.attn_{proj}.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    matrix("output.weight", VOCAB, HIDDEN)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def smoke_run(binary: Path, *, log_path: Path | None = None, threads: int = SMOKE_THREADS,
              startup_timeout: float = 120.0) -> str:
    """Serve the smoke GGUF with ``binary`` and complete one prompt; what it did, or SmokeFailed
    naming how the server died and its last log lines."""
    with tempfile.TemporaryDirectory(prefix="eaglewire-smoke-") as tmp:
        model = write_smoke_gguf(Path(tmp) / "smoke-q8_0.gguf")
        config = ServerConfig(model=model, threads=threads, ctx_size=256)
        server = LlamaServer(binary, config, log_path=log_path, startup_timeout=startup_timeout)
        prompt = [int(t) for t in np.arange(SMOKE_PROMPT_TOKENS) % 256]
        try:
            with server:
                answer = complete(server.url, prompt, n_predict=SMOKE_NEW_TOKENS)
        except LlamaCppError as e:
            cause = exit_cause(server.returncode)
            raise SmokeFailed(f"{binary} failed its smoke run ({cause}) serving a Q8_0 GGUF on {threads} threads; "
                              f"log {log_path}:\n{server.log_tail(8)}\n{e}") from None
        made = len(answer.get("tokens") or [])
        if made != SMOKE_NEW_TOKENS:
            raise SmokeFailed(f"{binary} answered the smoke prompt with {made} tokens, not {SMOKE_NEW_TOKENS}: "
                              f"{str(answer)[:300]}")
    return f"served a Q8_0 GGUF on {threads} threads, {SMOKE_PROMPT_TOKENS}-token prompt, {made} tokens"
