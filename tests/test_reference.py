"""The reference draft shipped in the package (`--draft reference`)."""

import pytest
import torch
from safetensors import safe_open

from eaglewire.model.checkpoint import load_draft, read_draft_config
from eaglewire.core.presets import resolve_draft


def test_reference_is_small_fp16_and_records_its_training():
    path = resolve_draft("reference")
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= 32 * 2**20
    with safe_open(str(weights), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float16
    training = read_draft_config("reference")["training"]
    assert training["final_eval"]["val_acc_0"] > 0.25 and training["heldout_sequence_ids"]


def test_a_directory_named_like_a_preset_wins(tmp_path, monkeypatch):
    (tmp_path / "reference").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_draft("reference") == tmp_path.joinpath("reference").relative_to(tmp_path)


@pytest.mark.real
def test_reference_speculates_losslessly_on_the_default_target(smollm2_target):
    from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
    from eaglewire.decode.text import encode_prompt

    draft, contract, _ = load_draft("reference", target=smollm2_target)  # fingerprint checked
    ids = encode_prompt(smollm2_target.tokenizer, "What are the three primary colors?", chat=True)
    plain, _ = SpecDecoder(smollm2_target).generate(ids, max_new_tokens=24)
    spec = SpecDecoder(smollm2_target, draft, contract, SpecConfig(num_steps=4, topk=1, num_draft_tokens=5))
    tokens, stats = spec.generate(ids, max_new_tokens=24)
    assert tokens == plain
    assert stats.accept_length > 1.1  # a trained draft accepts some tokens; a random one ~none
