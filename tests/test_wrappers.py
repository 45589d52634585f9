"""*ForConditionalGeneration targets (Llava, Mistral 3, Gemma 3, Qwen2-VL, Qwen2.5-VL) run on their text
model: capture, head, fingerprint, prepare, train, doctor; other configs are refused in eaglewire's words."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from eaglewire.model.boundary_capture import capture
from eaglewire.model.target import TargetModelError, load_target, target_from_config
from eaglewire.model.target_head import load_target_head

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)
MROPE = {"type": "mrope", "mrope_section": [4, 2, 2]}  # sums to head_dim / 2


def wrapper_config(name: str):
    if name == "llava":
        return transformers.LlavaConfig(text_config=transformers.LlamaConfig(**TEXT),
                                        vision_config=transformers.CLIPVisionConfig(**VISION), image_token_index=255)
    if name == "mistral3":
        return transformers.Mistral3Config(
            text_config=transformers.MistralConfig(**TEXT), image_token_index=255,
            vision_config=transformers.PixtralVisionConfig(**VISION, head_dim=16))
    if name == "gemma3":
        return transformers.Gemma3Config(text_config=dict(**TEXT, head_dim=16), vision_config=VISION,
                                         image_token_index=255)
    if name == "qwen2_vl":
        return transformers.Qwen2VLConfig(text_config=dict(**TEXT, rope_scaling=MROPE), image_token_id=255,
                                          video_token_id=254, vision_config=dict(depth=1, embed_dim=32, hidden_size=64,
                                                                                 num_heads=2))
    if name == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(**TEXT, rope_scaling=MROPE), image_token_id=255, video_token_id=254,
            vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64))
    raise ValueError(name)


WRAPPERS = ("llava", "mistral3", "gemma3", "qwen2_vl", "qwen2_5_vl")


@pytest.mark.parametrize("name", WRAPPERS)
def test_a_wrapper_is_captured_on_its_text_model(name):
    target = target_from_config(wrapper_config(name))
    assert target.num_layers == 8 and target.hidden_size == 64 and target.vocab_size == 256
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))  # [B, T]
    got = capture(target, ids, [2, 4, 6])
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states  # text model: embedding output, then each layer (the last after the norm)
    assert torch.allclose(got.aux_hidden[..., :64], hidden[2], atol=1e-5)
    assert torch.allclose(target.head(got.last_hidden), out.logits, atol=1e-4)  # boundary L -> the wrapper's logits
    assert target.fingerprint.architecture.endswith("ForConditionalGeneration")


def save_wrapper_dir(path, name: str = "llava"):
    from tokenizers import Tokenizer, models, pre_tokenizers

    target = target_from_config(wrapper_config(name))
    target.model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(256)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "t1 t2" -> two tokens
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1")
    tok.save_pretrained(path)
    return path, target


def test_a_saved_wrapper_loads_whole_and_head_only_with_one_fingerprint(tmp_path):
    path, made = save_wrapper_dir(tmp_path / "llava")
    full, head = load_target(str(path), device="cpu"), load_target_head(str(path))
    assert full.fingerprint == head.fingerprint
    assert full.fingerprint.weights_sha256 == made.fingerprint.weights_sha256
    assert full.fingerprint.architecture == "LlavaForConditionalGeneration"
    x = torch.randn(3, 64)
    assert torch.allclose(full.head(x), head.head(x))
    assert torch.equal(full.embed_tokens.weight, head.embed_tokens.weight)


def test_llava_goes_through_prepare_train_and_the_doctor(tmp_path):
    from eaglewire.data.prepare import PrepareConfig, prepare
    from eaglewire.doctor import DoctorConfig, run_doctor
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    path, _ = save_wrapper_dir(tmp_path / "llava")
    rows = tmp_path / "chats.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"t{i} t{i + 1} t{i + 2}"},
                                                     {"role": "assistant", "content": " ".join(
                                                         f"t{(i * 7 + k) % 200}" for k in range(12))}]}) + "\n"
                            for i in range(12)))
    prepare(PrepareConfig(out=str(tmp_path / "data"), target=str(path), data=str(rows), template="plain",
                          aux_boundaries=[2, 4, 6], max_length=64), progress=False)
    result = train(TrainConfig(out=str(tmp_path / "draft"), target=str(path), data=str(tmp_path / "data"),
                               aux_boundaries=[2, 4, 6], max_steps=2, batch_tokens=128, val_sequences=2,
                               draft_vocab_size=64, ttt_steps=1, eval_interval=2, save_interval=2, device="cpu"),
                   progress=False)
    assert result.steps >= 1
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "draft"), target=str(path), data=str(tmp_path / "data"),
                                     include_training=True, engine_prompts=0, min_tokens=10, tune=False,
                                     allow_target_mismatch=["chat_template_sha256"]))  # --template plain (README)
    assert report.accuracy, report.render()
    assert not [c for c in report.checks if c.name == "identity" and c.verdict == "fail"]

    from eaglewire.core.contract import EngineConventionError
    from eaglewire.engines.registry import export_draft
    # vLLM serves Llava from llava.py, which hands the ids to its language model (a Llama here)
    exported = export_draft(tmp_path / "draft", "vllm", tmp_path / "vllm", target=load_target(str(path)),
                            verifier_name="org/llava", allow={"chat_template_sha256"})
    assert exported.engine_ids == [2, 4, 6]
    with pytest.raises(EngineConventionError, match="llava.py"):  # SGLang's llava.py captures no aux states
        export_draft(tmp_path / "draft", "sglang", tmp_path / "sglang")


def test_a_config_with_no_text_model_is_refused_in_eaglewires_words():
    config = transformers.CLIPVisionConfig(**VISION)
    with pytest.raises(TargetModelError, match=r"not a decoder-only text model.*Llava, Mistral 3") as e:
        target_from_config(config)
    assert "Unrecognized configuration class" not in str(e.value) and len(str(e.value)) < 600


@pytest.mark.parametrize("arch,family", [("LlavaForConditionalGeneration", "llama"),
                                         ("Mistral3ForConditionalGeneration", "mistral"),
                                         ("Qwen2VLForConditionalGeneration", "qwen2"),
                                         ("Qwen2_5_VLForConditionalGeneration", "qwen2"),
                                         ("Gemma3ForConditionalGeneration", "gemma3")])
def test_a_wrapper_names_its_text_models_family(arch, family):
    """What `--target-arch` would otherwise have to say (the doctor's and the contract command's readings)."""
    from eaglewire.core.contract import target_arch

    assert target_arch(arch) == family
