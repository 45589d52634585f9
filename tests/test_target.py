import pytest
import torch

from eaglewire.model.target import fingerprint_target, load_target, resolve_dtype
from tiny import tiny_target


def test_unknown_preset_and_missing_path():
    with pytest.raises(FileNotFoundError, match="neither a preset .*smollm2-135m"):
        load_target("no-such-model")


def test_directory_that_is_not_a_model(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_target(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_target(str(tmp_path / "weights.bin"))


def test_hf_directory_round_trip(tmp_path, chat_tiny_target):
    target = chat_tiny_target
    target.model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_target(str(tmp_path))
    target.tokenizer.save_pretrained(tmp_path)
    loaded = load_target(str(tmp_path), device="cpu", dtype="fp32")
    assert loaded.fingerprint == target.fingerprint
    ids = torch.arange(7)[None]
    torch.testing.assert_close(loaded.model(ids).logits, target.model(ids).logits)


def test_fingerprint_ignores_dtype_rounding_but_not_weights():
    a = tiny_target("llama", seed=0)
    b = tiny_target("llama", seed=0)
    b.model.to(torch.bfloat16)
    diff = a.fingerprint.differences(fingerprint_target(b.model, None))
    assert set(diff) == {"dtype"}
    c = tiny_target("llama", seed=1)
    assert "weights_sha256" in a.fingerprint.differences(c.fingerprint)


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int8")


@pytest.mark.real
def test_real_target_fingerprint(smollm2_target, smollm2_tokenizer):
    fp = smollm2_target.fingerprint
    assert fp.architecture == "LlamaForCausalLM" and fp.num_layers == 30
    assert fp.chat_template_sha256 != "none" and fp.tokenizer_sha256 != "none"


def test_a_truncated_gguf_names_the_file_and_leaves_nothing_in_the_cache(tmp_path, monkeypatch, smollm2_tokenizer):
    from eaglewire.core.errors import CorruptFileError
    from eaglewire.core.presets import TARGET_PRESETS, fetch_asset
    from eaglewire.model.target import load_tokenizer

    whole = fetch_asset(TARGET_PRESETS["smollm2-135m"].asset)  # in the cache already (smollm2_tokenizer)
    cut = tmp_path / "cut.gguf"
    with open(whole, "rb") as f:
        cut.write_bytes(f.read(3 << 20))  # a cut download: the header is whole, the tensors are not
    monkeypatch.setenv("EAGLEWIRE_CACHE", str(tmp_path / "cache"))
    for load in (load_tokenizer, load_target):
        with pytest.raises(CorruptFileError, match=rf"{cut} cannot be read .*cannot reshape.*truncated or corrupt; download"):
            load(str(cut))
    left = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert left == [], left  # no .lock, no .partial
