"""Export/import for SGLang, vLLM/speculators, SpecForge and EAGLE: round trips are the
identity, hand-written configs from public examples import to the boundaries they mean,
and what an engine cannot express is an error that says why."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire.model.checkpoint import read_draft_config, save_draft
from eaglewire.core.contract import ContractError, EngineConventionError, HiddenStateContract
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.engines import FormatError, export_draft, import_draft, infer_boundaries, sglang
from eaglewire.engines.formats import eagle as eagle_format
from eaglewire.engines.formats import specforge
from eaglewire.engines.formats import eagle3_layout
from eaglewire.engines import vllm as speculators

ROOT = Path(__file__).resolve().parents[1]


def make_native(out: Path, target, boundaries, *, draft_vocab: int | None = 512, seed: int = 0) -> Path:
    """A tiny native draft on ``boundaries`` with random weights and a random vocabulary."""
    V = target.vocab_size
    cfg = DraftConfig.from_target(target.text_config, num_aux=len(boundaries),
                                  draft_vocab_size=draft_vocab or V, vocab_size=V)
    draft = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    if draft_vocab:
        kept = torch.randperm(V, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        draft.set_vocab(kept - torch.arange(draft_vocab), t2d)
    contract = HiddenStateContract(aux_boundaries=tuple(boundaries), target=target.fingerprint)
    return save_draft(out, draft, contract, {"target": "tiny-test"})


def assert_same_draft(a: Path, b: Path) -> None:
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    ca, cb = read_draft_config(a), read_draft_config(b)
    assert ca["draft"] == cb["draft"]
    assert HiddenStateContract.from_dict(ca["contract"]) == HiddenStateContract.from_dict(cb["contract"])


# ---------------------------------------------------------------- round trips

def test_sglang_round_trip_is_identity(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    report = export_draft(native, "sglang", tmp_path / "sg", verifier_name="org/tiny")
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # for vLLM, which looks there first
    assert config["target_hidden_size"] == 64 and config["draft_vocab_size"] == 512
    assert config["vocab_size"] == chat_tiny_target.vocab_size and config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == "float32" and config["eaglewire"]["target_arch"] == "llama"
    assert report.engine_ids == [1, 3, 5]  # first id 1: every model file agrees, no note on that
    [note] = report.notes  # the recorded target 'tiny-test' is no directory: its stored dtype is unknown
    assert "stored dtype is unknown: wrote torch_dtype float32" in note
    names = set(load_file(str(tmp_path / "sg" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    back = import_draft(tmp_path / "sg", "sglang", chat_tiny_target, tmp_path / "back")
    assert back.aux_boundaries == [2, 4, 6] and back.notes == []  # the recorded contract agrees
    assert_same_draft(native, tmp_path / "back")
    assert read_draft_config(tmp_path / "back")["training"]["format"] == "sglang"


@pytest.mark.parametrize("to", ["speculators", "vllm"])
def test_speculators_round_trip_is_identity(tmp_path, chat_tiny_target, to):
    native = make_native(tmp_path / "native", chat_tiny_target, [0, 4, 7])  # the embedding and the last layer's input
    report = export_draft(native, to, tmp_path / "sp", target=chat_tiny_target, verifier_name="org/tiny")
    config = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 4, 7] == report.engine_ids
    assert (config["norm_before_residual"], config["norm_output"]) == (False, False)
    assert config["transformer_layer_config"]["vocab_size"] == chat_tiny_target.vocab_size
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 3 and config["torch_dtype"] == "float32"
    sc = config["speculators_config"]
    assert sc["verifier"] == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    assert sc["default_proposal_method"] == sc["proposal_methods"][0]["proposal_type"] == "greedy"
    tensors = load_file(str(tmp_path / "sp" / "model.safetensors"))
    assert "layers.0.self_attn.q_proj.weight" in tensors and not any(k.startswith("midlayer.") for k in tensors)
    assert torch.equal(tensors["embed_tokens.weight"], chat_tiny_target.embed_tokens.weight)
    back = import_draft(tmp_path / "sp", to, chat_tiny_target, tmp_path / "back")
    assert back.aux_boundaries == [0, 4, 7] and back.notes == []
    assert_same_draft(native, tmp_path / "back")


def test_full_vocabulary_draft_drops_and_restores_the_maps(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6], draft_vocab=None)
    export_draft(native, "speculators", tmp_path / "sp", target=chat_tiny_target, verifier_name="org/tiny")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "sp" / "model.safetensors")))
    import_draft(tmp_path / "sp", "speculators", chat_tiny_target, tmp_path / "back")
    assert_same_draft(native, tmp_path / "back")


def test_recorded_contract_beats_another_target_arch(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [3, 4, 6])
    export_draft(native, "sglang", tmp_path / "sg", target_arch="deepseek_v3")  # ids [3, 4, 6] verbatim
    back = import_draft(tmp_path / "sg", "sglang", chat_tiny_target, tmp_path / "back")  # llama.py: +1
    assert back.aux_boundaries == [3, 4, 6]
    assert any("exported this draft for [3, 4, 6]" in n for n in back.notes)
    # Without the record, the ids are read with the target's model file and the other readings named.
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    del config["eaglewire"]
    (tmp_path / "sg" / "config.json").write_text(json.dumps(config))
    bare = import_draft(tmp_path / "sg", "sglang", chat_tiny_target, tmp_path / "bare")
    assert bare.aux_boundaries == [4, 5, 7]
    assert any("deepseek_v3/glm4_moe_lite targets: boundaries [3, 4, 6]" in n for n in bare.notes)
    assert import_draft(tmp_path / "sg", "sglang", chat_tiny_target, tmp_path / "ds",
                        target_arch="deepseek_v3").aux_boundaries == [3, 4, 6]


# ---------------------------------------------------------------- per target model file

def test_sglang_export_follows_the_target_model_file(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [3, 4, 6])
    report = export_draft(native, "sglang", tmp_path / "sg")  # the contract records LlamaForCausalLM
    assert report.engine_ids == [2, 3, 5]  # llama.py adds 1 to every id
    assert "deepseek_v3/glm4_moe_lite targets: boundaries [2, 3, 5]" in report.notes[0]
    serving = (tmp_path / "sg" / "SERVING.md").read_text()
    assert report.notes[0] in serving and "sglang/srt/models/llama.py" in serving
    assert export_draft(native, "sglang", tmp_path / "ds", target_arch="deepseek_v3").engine_ids == [3, 4, 6]


def test_sglang_export_expresses_boundary_zero_on_llama_files(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [0, 3, 7])
    assert export_draft(native, "sglang", tmp_path / "sg").engine_ids == [-1, 2, 6]
    back = import_draft(tmp_path / "sg", "sglang", chat_tiny_target, tmp_path / "back")
    assert back.aux_boundaries == [0, 3, 7]  # import agrees with export about boundary 0
    with pytest.raises(ContractError, match="must be below L"):  # boundary 8 = L never reaches an engine
        make_native(tmp_path / "n8", chat_tiny_target, [2, 4, 8])
    with pytest.raises(EngineConventionError, match="without the residual"):
        export_draft(native, "sglang", tmp_path / "gemma", target_arch="gemma3")
    assert not (tmp_path / "x").exists() and not (tmp_path / "gemma").exists()


def test_four_aux_states_export_for_both_engines(tmp_path, chat_tiny_target):
    # SGLang sizes fc from the nested id list; vLLM only from num_aux_hidden_states
    native = make_native(tmp_path / "native", chat_tiny_target, [1, 3, 5, 7])
    report = export_draft(native, "sglang", tmp_path / "sg")
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert report.engine_ids == [0, 2, 4, 6] and sglang.num_aux(config) == 4
    report = export_draft(native, "vllm", tmp_path / "v", target=chat_tiny_target, verifier_name="org/tiny")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert report.engine_ids == [1, 3, 5, 7] and speculators.num_aux(config) == 4
    del config["transformer_layer_config"]["num_aux_hidden_states"]
    assert speculators.num_aux(config) == 3  # what vLLM 0.33.0 would size fc for without it
    _, _, notes = speculators.parse_config(config)
    assert any("sizes fc for 3 aux states" in n for n in notes)


def test_vllm_export_refuses_a_target_vllm_serves_no_eagle3_for(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    with pytest.raises(EngineConventionError, match="SupportsEagle3"):
        export_draft(native, "vllm", tmp_path / "v", target=chat_tiny_target, target_arch="gemma3")


def test_every_serving_md_says_how_the_other_engine_reads_it(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    export_draft(native, "sglang", tmp_path / "sg", verifier_name="org/tiny")
    text = (tmp_path / "sg" / "SERVING.md").read_text()
    assert "vLLM 0.33.0: reads the top-level `eagle_aux_hidden_state_layer_ids` [2, 4, 6]" in text
    assert "nested SGLang ids [1, 3, 5] verbatim (one layer off)" in text
    export_draft(native, "vllm", tmp_path / "v", target=chat_tiny_target, verifier_name="org/tiny")
    text = (tmp_path / "v" / "SERVING.md").read_text()
    assert "SGLang 0.5.23 cannot load it" in text and "[1, 3, 5] for this `llama` target" in text
    assert "one layer off" in text


def test_vllm_export_keeps_the_embedding_in_the_targets_stored_dtype(tmp_path, chat_tiny_target, target_dir):
    config = json.loads((target_dir / "config.json").read_text())
    bf16 = tmp_path / "bf16_target"
    bf16.mkdir()
    for f in target_dir.iterdir():
        (bf16 / f.name).symlink_to(f)
    (bf16 / "config.json").unlink()
    (bf16 / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    chat_tiny_target.spec = str(bf16)
    try:
        report = export_draft(native, "vllm", tmp_path / "v", target=chat_tiny_target)
    finally:
        chat_tiny_target.spec = "random:llama"
    tensors = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert tensors["embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["embed_tokens.weight"], chat_tiny_target.embed_tokens.weight.to(torch.bfloat16))
    assert json.loads((tmp_path / "v" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert report.files


def test_verifier_name_defaults_to_the_local_target_directory(tmp_path, chat_tiny_target, target_dir):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    config = json.loads((native / "config.json").read_text())
    config["training"]["target"] = os.path.relpath(target_dir)
    (native / "config.json").write_text(json.dumps(config))
    report = export_draft(native, "vllm", tmp_path / "v", target=chat_tiny_target)
    written = json.loads((tmp_path / "v" / "config.json").read_text())["speculators_config"]["verifier"]
    assert written["name_or_path"] == str(target_dir.resolve()) and report.notes == []


def test_serving_md_has_consistent_launch_flags(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    export_draft(native, "sglang", tmp_path / "sg", num_steps=3, verifier_name="org/tiny")
    text = (tmp_path / "sg" / "SERVING.md").read_text()
    assert "--model-path org/tiny" in text and "--speculative-algorithm EAGLE3" in text
    assert f"--speculative-draft-model-path {(tmp_path / 'sg').resolve()}" in text
    assert "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" in text
    export_draft(native, "vllm", tmp_path / "v", num_steps=3, target=chat_tiny_target)
    text = (tmp_path / "v" / "SERVING.md").read_text()
    line = next(line for line in text.splitlines() if "--speculative-config" in line)
    spec = json.loads(line.split("'")[1])
    assert spec == {"method": "eagle3", "model": str((tmp_path / "v").resolve()), "num_speculative_tokens": 3}
    assert "vllm serve tiny-test" in text


def test_speculators_export_warns_about_an_unloadable_verifier_name(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    report = export_draft(native, "speculators", tmp_path / "sp", target=chat_tiny_target)
    assert any("'tiny-test' is neither a local path nor a Hugging Face id" in n for n in report.notes)


def test_bad_export_arguments(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    with pytest.raises(ValueError, match="export format 'medusa' is not one of sglang, vllm, speculators"):
        export_draft(native, "medusa", tmp_path / "x")
    # SpecForge (alias zlab) writes DFlash drafts; an EAGLE-3 draft is told where SpecForge reads it from
    with pytest.raises(ValueError, match="SpecForge reads SGLang's EAGLE-3 layout, so export it with --to sglang"):
        export_draft(native, "specforge", tmp_path / "x")
    with pytest.raises(ValueError, match="num_steps 0"):
        export_draft(native, "sglang", tmp_path / "x", num_steps=0)
    with pytest.raises(ValueError, match="is the draft being exported"):
        export_draft(native, "sglang", native)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_draft(tmp_path / "nowhere", "sglang", tmp_path / "x")
    config = json.loads((native / "config.json").read_text())
    config["training"] = {}
    config["contract"]["target"]["weights_sha256"] = "0" * 64
    (native / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match="needs the target.*--target SPEC"):
        export_draft(native, "vllm", tmp_path / "x")
    with pytest.raises(ContractError, match="weights_sha256 recorded '0000"):
        export_draft(native, "vllm", tmp_path / "x", target=chat_tiny_target)
    report = export_draft(native, "vllm", tmp_path / "x", target=chat_tiny_target, allow={"weights_sha256"},
                          verifier_name="org/tiny")
    assert report.notes and report.notes[0].startswith("weights_sha256: recorded '0000")


# ---------------------------------------------------------------- configs written by other tools

# Hand-written after public examples (field sets as those projects publish them).
EAGLE_LLAMA31 = {  # the EAGLE reference draft for Llama-3.1-8B-Instruct (32 layers)
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "float16", "vocab_size": 128256, "draft_vocab_size": 32000,
}
SPECFORGE_LLAMA31 = {  # SpecForge's Llama-3.1-8B draft config: llama3 RoPE, no ids (defaults)
    **EAGLE_LLAMA31, "max_position_embeddings": 131072, "target_hidden_size": 4096,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
SGLANG_DEEPSEEK_V3 = {  # an EAGLE-3 draft for DeepSeek-V3 (61 layers) as SGLang serves it
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 56, "num_key_value_heads": 8,
    "head_dim": 128, "num_hidden_layers": 1, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "max_position_embeddings": 163840, "vocab_size": 129280, "draft_vocab_size": 32000,
    "target_hidden_size": 7168, "tie_word_embeddings": False,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
}
SPECULATORS_LLAMA31 = {  # a speculators 0.9 Eagle3 checkpoint for Llama-3.1-8B-Instruct
    "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
    "draft_vocab_size": 32000, "norm_before_residual": False, "norm_output": False,
    "norm_before_fc": False, "fc_norm": False, "target_hidden_size": None,
    "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
    "transformer_layer_config": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                                 "intermediate_size": 14336, "num_attention_heads": 32,
                                 "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 1,
                                 "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                           "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                           "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
                                        "architectures": ["LlamaForCausalLM"]}},
}


def test_deepseek_v3_sglang_ids_mean_boundaries_2_30_58():
    fields, ids, notes = sglang.parse_config(SGLANG_DEEPSEEK_V3)
    assert ids == [1, 29, 57] and notes == []
    assert (fields["head_dim"], fields["target_hidden_size"], fields["draft_vocab_size"]) == (128, 7168, 32000)
    for arch in ("deepseek_v3", "llama"):  # first id 1: every model file agrees
        bounds, notes = infer_boundaries("sglang", ids, 61, target_arch=arch)
        assert bounds == [2, 30, 58] and "other targets" not in notes[0]
    assert infer_boundaries("specforge", ids, 61) == ([2, 30, 58], [])


def test_sglang_ids_not_starting_at_one_are_read_per_model_file():
    bounds, notes = infer_boundaries("sglang", [2, 15, 28], 32, target_arch="llama")
    assert bounds == [3, 16, 29] and "sglang/srt/models/llama.py" in notes[0]
    assert "deepseek_v3/glm4_moe_lite targets: boundaries [2, 15, 28]" in notes[0]
    assert infer_boundaries("sglang", [2, 15, 28], 32, target_arch="deepseek_v3")[0] == [2, 15, 28]
    with pytest.raises(ContractError, match="target_arch"):
        infer_boundaries("sglang", [2, 15, 28], 32)


def test_configs_without_ids_mean_the_default_layers():
    fields, ids, notes = eagle_format.parse_config(EAGLE_LLAMA31)
    assert ids is None and notes == [] and fields["rope_theta"] == 500000.0 and fields["rope_parameters"] == {}
    bounds, notes = infer_boundaries("eagle", ids, 32)
    assert bounds == [2, 16, 29] and "hard-codes" in notes[0]
    fields, ids, _ = specforge.parse_config(SPECFORGE_LLAMA31)
    assert ids is None and fields["rope_parameters"]["rope_type"] == "llama3"
    assert fields["rope_parameters"]["factor"] == 8.0 and "rope_theta" not in fields["rope_parameters"]
    bounds, notes = infer_boundaries("specforge", ids, 32)
    assert bounds == [2, 16, 29] and "carries no aux layer ids" in notes[0]
    # SpecForge's own default ids [1, L//2-1, L-4] name the same layers.
    assert infer_boundaries("specforge", [1, 15, 28], 32) == ([2, 16, 29], [])
    assert infer_boundaries("specforge", [1, 46, 90], 94) == ([2, 47, 91], [])


def test_top_level_ids_are_invisible_to_sglang():
    config = {**EAGLE_LLAMA31, "eagle_aux_hidden_state_layer_ids": [1, 15, 28]}
    _, ids, notes = sglang.parse_config(config)
    assert ids is None and "where SGLang never looks" in notes[0]


def test_speculators_config_ids_are_boundaries():
    fields, ids, notes = speculators.parse_config(SPECULATORS_LLAMA31)
    assert ids == [2, 16, 29] and notes == [] and fields["target_hidden_size"] is None
    assert fields["vocab_size"] == 128256 and fields["rope_theta"] == 500000.0
    assert infer_boundaries("speculators", ids, 32) == ([2, 16, 29], [])
    assert infer_boundaries("vllm", [0, 16, 32], 32) == ([0, 16, 32], [])


@pytest.mark.parametrize("change, message", [
    ({"norm_before_residual": True}, "norm_before_residual is True: its residual is the normed"),
    ({"norm_output": True}, "post-norm state to the next step"),
    ({"fc_norm": True}, "normalises each aux state"),
    ({"speculators_model_type": "mtp"}, "speculators 'mtp' checkpoint"),
    ({"transformer_layer_config": {**SPECULATORS_LLAMA31["transformer_layer_config"], "model_type": "qwen3"}},
     "model_type 'qwen3'"),
])
def test_speculators_configs_eaglewire_cannot_compute(change, message):
    with pytest.raises(FormatError, match=message):
        speculators.parse_config({**SPECULATORS_LLAMA31, **change})


def test_missing_norm_before_residual_is_noted():
    config = {k: v for k, v in SPECULATORS_LLAMA31.items() if k != "norm_before_residual"}
    assert "vLLM reads a missing flag as true" in speculators.parse_config(config)[2][0]


# ---------------------------------------------------------------- checkpoints written by other tools

def test_eagle_reference_checkpoint_imports(tmp_path, chat_tiny_target):
    """pytorch_model.bin, a ``model.`` prefix, no ids: the default [2, L//2, L-3]."""
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 5])
    cfg = DraftConfig.from_dict(read_draft_config(native)["draft"])
    src = tmp_path / "eagle"
    src.mkdir()
    config = sglang.build_config(cfg, [1, 3, 4])
    for key in ("eagle_config", "target_hidden_size", "rope_parameters"):
        del config[key]
    (src / "config.json").write_text(json.dumps(config))
    state = load_file(str(native / "model.safetensors"))
    torch.save({"model." + k: v for k, v in state.items()}, src / "pytorch_model.bin")
    report = import_draft(src, "eagle", chat_tiny_target, tmp_path / "back")
    assert report.aux_boundaries == [2, 4, 5] and "hard-codes" in report.notes[0]
    assert_same_draft(native, tmp_path / "back")


def test_specforge_full_vocab_bf16_checkpoint_imports(tmp_path, chat_tiny_target):
    """No d2t/t2d (identity maps), its own embed_tokens copy, bf16 kept bit for bit."""
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6], draft_vocab=None)
    cfg = DraftConfig.from_dict(read_draft_config(native)["draft"])
    src = tmp_path / "specforge"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(sglang.build_config(cfg, [1, 3, 5])))
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(native / "model.safetensors")).items()
             if k not in ("d2t", "t2d")}
    state["embed_tokens.weight"] = chat_tiny_target.embed_tokens.weight.to(torch.bfloat16)
    save_file(state, str(src / "model.safetensors"))
    report = import_draft(src, "specforge", chat_tiny_target, tmp_path / "back")
    assert report.aux_boundaries == [2, 4, 6] and report.notes == []
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert torch.equal(back["fc.weight"], state["fc.weight"]) and back["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(back["d2t"], torch.zeros(cfg.vocab_size, dtype=torch.long)) and bool(back["t2d"].all())


def test_vocab_maps_are_completed_or_refused():
    d2t = torch.tensor([0, 1, 3])  # draft 0, 1, 2 -> target 0, 2, 5
    t2d = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    full = eagle3_layout.complete_vocab_maps
    assert torch.equal(full(d2t, None, vocab_size=6, draft_vocab_size=3, where="x")[1], t2d)
    assert torch.equal(full(None, t2d, vocab_size=6, draft_vocab_size=3, where="x")[0], d2t)
    with pytest.raises(FormatError, match="t2d disagrees with d2t read either way"):  # never rebuilt silently
        full(d2t, ~t2d, vocab_size=6, draft_vocab_size=3, where="x")
    with pytest.raises(FormatError, match="same target token"):
        full(torch.tensor([0, 0, -1]), None, vocab_size=6, draft_vocab_size=3, where="x")
    with pytest.raises(FormatError, match="the token mapping is lost"):
        full(None, None, vocab_size=6, draft_vocab_size=3, where="x")


@pytest.fixture
def sglang_export(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    export_draft(native, "sglang", tmp_path / "sg")
    return tmp_path / "sg"


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.pop("eaglewire")
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, error, message", [
    ({"vocab_size": 1000}, ContractError, "vocab_size is 1000 but target .* has 49152"),
    ({"target_hidden_size": 96}, ContractError, "target_hidden_size is 96 but target .* has 64"),
    ({"target_hidden_size": 128}, FormatError, "not a multiple of target_hidden_size 128"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}, ContractError,
     "do not fit this 8-layer target.*another target"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3]}}, ContractError,
     "fuses 3 target states .* names 2 aux layers"),
    ({"hidden_act": "gelu"}, FormatError, "hidden_act 'gelu'"),
])
def test_import_errors_name_the_problem(tmp_path, sglang_export, chat_tiny_target, changes, error, message):
    edit_config(sglang_export, **changes)
    with pytest.raises(error, match=message):
        import_draft(sglang_export, "sglang", chat_tiny_target, tmp_path / "back")


def test_import_rejects_foreign_tensors(tmp_path, sglang_export, chat_tiny_target):
    state = load_file(str(sglang_export / "model.safetensors"))
    second = {**state, "layers.1.mlp.up_proj.weight": state["fc.weight"].clone()}
    save_file(second, str(sglang_export / "model.safetensors"))
    with pytest.raises(FormatError, match="second decoder layer"):
        import_draft(sglang_export, "sglang", chat_tiny_target, tmp_path / "back")
    save_file({**state, "extra.weight": state["fc.weight"].clone()}, str(sglang_export / "model.safetensors"))
    with pytest.raises(FormatError, match=r"unexpected \['extra.weight'\]"):
        import_draft(sglang_export, "sglang", chat_tiny_target, tmp_path / "back")
    with pytest.raises(FormatError, match="not a speculators EAGLE-3 config.*--from sglang"):
        import_draft(sglang_export, "speculators", chat_tiny_target, tmp_path / "back")
    with pytest.raises(FormatError, match="already an eaglewire draft"):
        import_draft(tmp_path / "native", "sglang", chat_tiny_target, tmp_path / "back")
    with pytest.raises(ValueError, match="import format 'gguf'"):
        import_draft(sglang_export, "gguf", chat_tiny_target, tmp_path / "back")


def test_another_targets_embedding_is_an_error_unless_allowed(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 4, 6])
    export_draft(native, "speculators", tmp_path / "sp", target=chat_tiny_target, verifier_name="org/tiny")
    state = load_file(str(tmp_path / "sp" / "model.safetensors"))
    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 0.5
    save_file(state, str(tmp_path / "sp" / "model.safetensors"))
    with pytest.raises(ContractError, match="--allow-target-mismatch weights_sha256"):
        import_draft(tmp_path / "sp", "speculators", chat_tiny_target, tmp_path / "back")
    report = import_draft(tmp_path / "sp", "speculators", chat_tiny_target, tmp_path / "back",
                          allow={"weights_sha256"})
    assert any("eaglewire uses the target's embedding" in n for n in report.notes)


# ---------------------------------------------------------------- the real peer: speculators 0.9

PEER_PYTHON = Path(os.environ.get("EAGLEWIRE_PEER_PYTHON", ROOT.parent / "peer-venv" / "bin" / "python"))


def peer_skip_reason() -> str | None:
    setup = "(set EAGLEWIRE_PEER_PYTHON; benchmarks/experiments/peers/peer_speculators_check.py says how to make one)"
    if not PEER_PYTHON.is_file():
        return f"no speculators environment at {PEER_PYTHON} {setup}"
    probe = subprocess.run([str(PEER_PYTHON), "-c", "import importlib.util as u, sys; "
                            "sys.exit(u.find_spec('speculators') is None)"], capture_output=True, timeout=60)
    if probe.returncode:
        return f"speculators is not installed for {PEER_PYTHON} {setup}"
    return None


def our_ttt_logits(draft, target, inputs, steps: int) -> list[torch.Tensor]:
    """Our draft fed exactly as speculators feeds its own: step j sees the input ids shifted
    left by j (zero-padded) at positions + j, and the previous step's pre-norm output."""
    ids, pos = inputs["input_ids"], inputs["position_ids"]
    hidden, cache, out = draft.fuse(inputs["hidden_states"]), [], []
    with torch.no_grad():
        for j in range(steps):
            shifted = torch.cat([ids[:, j:], ids.new_zeros(1, j)], dim=1)  # [1, T]
            hidden = draft.forward_ttt(target.embed_tokens(shifted), hidden, pos + j, cache)
            out.append(draft.logits(hidden))  # [1, T, Vd]
    return out


@pytest.mark.peer
def test_speculators_model_class_agrees_both_ways(tmp_path, chat_tiny_target):
    """speculators' Eagle3DraftModel loads our export and gives our logits; a checkpoint it
    writes imports into eaglewire and gives its logits (fp32, max abs diff <= 1e-4)."""
    from eaglewire.model.checkpoint import load_draft

    reason = peer_skip_reason()
    if reason:
        pytest.skip(reason)
    target, steps = chat_tiny_target, 3
    native = make_native(tmp_path / "native", target, [0, 4, 7])
    target.model.save_pretrained(tmp_path / "verifier")  # speculators reads the verifier from disk
    export_draft(native, "speculators", tmp_path / "sp", target=target, verifier_name=str(tmp_path / "verifier"))
    g = torch.Generator().manual_seed(3)
    inputs = {"hidden_states": torch.randn(1, 12, 3 * 64, generator=g),
              "input_ids": torch.randint(0, target.vocab_size, (1, 12), generator=g),
              "position_ids": torch.arange(12)[None]}
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    check = ROOT / "benchmarks" / "experiments" / "peers" / "peer_speculators_check.py"
    run = subprocess.run([str(PEER_PYTHON), str(check),
                          "--draft", str(tmp_path / "sp"), "--inputs", str(tmp_path / "inputs.safetensors"),
                          "--out", str(tmp_path / "peer.safetensors"), "--steps", str(steps),
                          "--create", str(tmp_path / "created")],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    peer = load_file(str(tmp_path / "peer.safetensors"))

    draft, _, _ = load_draft(native)
    for j, ours in enumerate(our_ttt_logits(draft, target, inputs, steps)):
        assert (ours - peer[f"step{j}"]).abs().max() <= 1e-4, j

    created = tmp_path / "created"  # written by speculators' save_pretrained; read its ids, not our record
    config = json.loads((created / "config.json").read_text())
    config.pop("eaglewire", None)
    (created / "config.json").write_text(json.dumps(config))
    report = import_draft(created, "speculators", target, tmp_path / "imported")
    assert report.aux_boundaries == [0, 4, 7]
    imported, _, _ = load_draft(tmp_path / "imported", target=target)
    for j, ours in enumerate(our_ttt_logits(imported, target, inputs, steps)):
        assert (ours - peer[f"created_step{j}"]).abs().max() <= 1e-4, j


# ---------------------------------------------------------------- boundary order

def test_non_ascending_boundaries_are_refused_on_every_path(tmp_path, chat_tiny_target, target_dir, capsys):
    """Engines feed aux states in layer order, so [5, 2, 7] would be served as [2, 5, 7]: refused
    wherever a layout enters (capture, prepare, train, contract, export of a hand-edited draft)."""
    from eaglewire.model.boundary_capture import capture
    from eaglewire.cli import main

    with pytest.raises(ContractError, match=r"\[5, 2, 7\] are not ascending; sort them \(--aux-boundaries 2,5,7\)"):
        capture(chat_tiny_target, torch.tensor([[1, 2, 3]]), [5, 2, 7])
    common = ["--target", str(target_dir), "--aux-boundaries", "5,2,7"]
    for argv in (["prepare", *common, "--out", str(tmp_path / "p"), "--data", "x"],
                 ["train", *common, "--out", str(tmp_path / "t"), "--online-data", "x"],
                 ["contract", "--num-layers", "8", "--aux-boundaries", "5,2,7"]):
        assert main(argv) == 2, argv
        assert "sort them (--aux-boundaries 2,5,7)" in capsys.readouterr().err, argv
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 5, 7])
    config = json.loads((native / "config.json").read_text())
    config["contract"]["aux_boundaries"] = [5, 2, 7]
    (native / "config.json").write_text(json.dumps(config))
    assert main(["export", "--draft", str(native), "--to", "sglang", "--out", str(tmp_path / "sg")]) == 2
    assert "not ascending" in capsys.readouterr().err and not (tmp_path / "sg").exists()


def test_vllm_feeds_foreign_ids_in_layer_order(tmp_path, chat_tiny_target):
    native = make_native(tmp_path / "native", chat_tiny_target, [2, 5, 7])
    export_draft(native, "vllm", tmp_path / "v", target=chat_tiny_target, verifier_name="org/tiny")
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    del config["eaglewire"]
    config["eagle_aux_hidden_state_layer_ids"] = [5, 2, 7]  # written by another tool
    (tmp_path / "v" / "config.json").write_text(json.dumps(config))
    back = import_draft(tmp_path / "v", "vllm", chat_tiny_target, tmp_path / "back")
    assert back.aux_boundaries == [2, 5, 7] and any("vLLM sorts the ids" in n for n in back.notes)


def test_a_d2t_written_as_absolute_ids_is_read_as_ids_loudly_or_refused():
    """SGLang, vLLM and speculators read d2t as offsets (target = draft id + d2t); a checkpoint that
    wrote the target ids themselves used to be kept as offsets whenever every id still fit."""
    V, Vd = 100, 20
    kept = torch.cat([torch.arange(0, 10), torch.arange(40, 50)])  # adjacent ids, as a frequency vocab has
    offsets = kept - torch.arange(Vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    full = eagle3_layout.complete_vocab_maps
    d2t, got_t2d, notes = full(offsets, t2d, vocab_size=V, draft_vocab_size=Vd, where="x")
    assert torch.equal(d2t, offsets) and torch.equal(got_t2d, t2d) and notes == []
    for given_t2d in (t2d, None):  # t2d agrees with the absolute reading; without it, d2t climbs strictly
        d2t, got_t2d, notes = full(kept, given_t2d, vocab_size=V, draft_vocab_size=Vd, where="x")
        assert torch.equal(d2t, offsets) and torch.equal(got_t2d, t2d)
        assert len(notes) == 1 and "absolute target ids" in notes[0] and "d2t - arange" in notes[0]
    assert eagle3_layout.read_d2t(offsets, None, vocab_size=V, where="x").kind == "offsets"
    other = torch.zeros(V, dtype=torch.bool)
    other[50:70] = True
    with pytest.raises(FormatError, match="t2d disagrees with d2t read either way"):
        full(kept, other, vocab_size=V, draft_vocab_size=Vd, where="x")
