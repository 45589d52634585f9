"""Tiny random targets built from configs, one per supported architecture."""

from __future__ import annotations

import transformers

from eaglewire.model.target import Target, target_from_config

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "deepseek_v3")


def tiny_config(arch: str, *, vocab_size: int = 256, num_layers: int = 8, hidden_size: int = 64,
                initializer_range: float = 0.02):
    """``initializer_range`` ~0.2 gives a target whose predictions depend on the context
    (at 0.02 a random model predicts nearly the same token everywhere)."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=initializer_range)
    head_dim = hidden_size // 4
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=head_dim)
    if arch == "mistral":
        return transformers.MistralConfig(**common)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=head_dim)
    if arch == "deepseek_v3":  # MLA: as many key/value heads as query heads
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def tiny_target(arch: str = "llama", *, seed: int = 0, tokenizer=None, **kwargs) -> Target:
    return target_from_config(tiny_config(arch, **kwargs), seed=seed, tokenizer=tokenizer)


def save_tiny_dir(path, arch: str = "llama", *, num_layers: int = 8, hidden_size: int = 64, vocab_size: int = 256):
    """A tiny random target saved as a model directory with a word-level tokenizer (a --target)."""
    from tokenizers import Tokenizer, models

    target = tiny_target(arch, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size,
                         initializer_range=0.2)
    target.model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tok.save_pretrained(path)
    return path


def save_random_draft(path, target: Target, aux_boundaries=(2, 4, 5), seed: int = 0, chat_template_kwargs=None):
    """A random EAGLE-3 draft over the target's whole vocabulary, saved as a native draft directory
    (``chat_template_kwargs``: the switches its contract says its data was rendered with)."""
    import torch

    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    V = target.vocab_size
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(aux_boundaries),
                                                draft_vocab_size=V, vocab_size=V))
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    save_draft(path, draft, HiddenStateContract(aux_boundaries=tuple(aux_boundaries), target=target.fingerprint,
                                                chat_template_kwargs=chat_template_kwargs))
    return path


def random_dflash_draft(target: Target, aux_boundaries=(2, 4, 5), *, block_size: int = 4, num_layers: int = 1,
                        mask_token_id: int | None = None, seed: int = 0, perturb_norms: bool = False):
    """A random DFlash draft for ``target`` (its vocabulary; the mask token defaults to the last id)
    and its contract -> (draft, contract). ``perturb_norms``: norm weights off ones, so that a wrong
    tensor mapping in a format shows."""
    import torch

    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.model.dflash import DFlashConfig, DFlashDraft

    V = target.vocab_size
    torch.manual_seed(seed)
    draft = DFlashDraft(DFlashConfig.from_target(
        target.text_config, num_aux=len(aux_boundaries), vocab_size=V, num_layers=num_layers, block_size=block_size,
        mask_token_id=V - 1 if mask_token_id is None else mask_token_id))
    if perturb_norms:
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    contract = HiddenStateContract(aux_boundaries=tuple(aux_boundaries), target=target.fingerprint, family="dflash")
    return draft.eval(), contract


def pruned_dflash_draft(draft, target_ids):
    """``draft``'s weights over a vocabulary of ``target_ids`` (ascending; a list or a tensor) only."""
    from dataclasses import replace

    import torch

    from eaglewire.model.dflash import DFlashDraft
    from eaglewire.model.vocab import vocab_maps

    ids = torch.as_tensor(target_ids)
    pruned = DFlashDraft(replace(draft.config, draft_vocab_size=len(ids)))
    pruned.load_state_dict(draft.state_dict(), strict=False)
    pruned.set_vocab(*vocab_maps(ids, draft.config.vocab_size))
    return pruned


def save_random_dflash_draft(path, target: Target, aux_boundaries=(2, 4, 6), seed: int = 0, *, num_layers: int = 1,
                             block_size: int = 4, mask_token_id: int | None = None):
    """``random_dflash_draft`` (norms perturbed) saved as a native draft directory."""
    from eaglewire.model.checkpoint import save_draft

    draft, contract = random_dflash_draft(target, aux_boundaries, block_size=block_size, num_layers=num_layers,
                                          mask_token_id=mask_token_id, seed=seed, perturb_norms=True)
    save_draft(path, draft, contract, {"target": target.spec})
    return path


# SmolLM2's chat template with Qwen3's thinking switch: enable_thinking false renders an empty
# <think></think> block before each assistant reply and in the generation prompt (the template's
# default, thinking on, renders none): the switch changes the text a draft is trained on.
THINKING_TEMPLATE = (
    "{% set off = enable_thinking is defined and enable_thinking is false %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and off %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% if off %}{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}{% endif %}"
)


def thinking_target(target: Target) -> Target:
    """``target`` (weights shared) whose tokenizer renders with THINKING_TEMPLATE."""
    import copy

    tokenizer = copy.deepcopy(target.tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    return Target(model=target.model, tokenizer=tokenizer, spec=f"{target.spec}-thinking")


def sharp_shards(root, vocab_size: int, aux_boundaries, token_ids, *, n: int = 48, length: int = 24, prompt: int = 4):
    """A tiny target directory whose head is sharpened (a learnable next-token argmax) and fp16 shards of its states:
    ``n`` sequences ``token_ids(generator)`` -> [1, length] ids, replies from position ``prompt``. (target_dir, target)."""
    import torch

    from eaglewire.core.contract import HiddenStateContract
    from eaglewire.data.shards import ShardWriter
    from eaglewire.model.boundary_capture import capture
    from eaglewire.model.target import load_target

    target_dir = save_tiny_dir(root / "target", vocab_size=vocab_size)
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    with torch.no_grad():
        target.model.lm_head.weight.mul_(20)  # a sharp next-token distribution: its argmax is learnable
    target.model.save_pretrained(target_dir)
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    contract = HiddenStateContract(aux_boundaries=tuple(aux_boundaries), target=target.fingerprint)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(root / "data", contract, source={"test": True}, dtype="fp16") as w:
        for i in range(n):
            ids = token_ids(g)
            got = capture(target, ids, contract)
            w.add(f"s{i}", ids[0], torch.arange(length) >= prompt, got.aux_hidden[0], got.last_hidden[0])
    return target_dir, target
