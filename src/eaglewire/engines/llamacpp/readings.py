"""What llama.cpp (build ``BUILD``) reads: a draft's ids (``extract_layers``: it copies the *input*
of layer i for id i, so ids are boundaries verbatim, exactly ``NUM_AUX``, boundaries 0..L-1), the
target architectures whose graph exposes layer inputs (the states an EAGLE-3 draft reads), and
the GGUF types its converter writes.
"""

from __future__ import annotations

import re
from pathlib import Path

from eaglewire.core.contract import EngineConventionError, default_aux_boundaries

NAME = "llamacpp"
NUM_AUX = 3  # llama.cpp (build 11434) fuses exactly three target states
DRAFT_OUTTYPES = ("q8_0", "f16", "bf16", "f32")
TARGET_OUTTYPES = ("f32", "f16", "bf16", "q8_0", "none")
GGUF_ARCH = "eagle3"


def check_expressible(boundaries: list[int], num_layers: int) -> None:
    if len(boundaries) != NUM_AUX:
        raise EngineConventionError(
            f"llama.cpp fuses exactly {NUM_AUX} target states (extract_layers); this layout has "
            f"{len(boundaries)} ({list(boundaries)}). Retrain on 3 boundaries (e.g. "
            f"{default_aux_boundaries(num_layers)}), or serve with vLLM, SGLang or eaglewire")
    if num_layers in boundaries:
        raise EngineConventionError(
            f"llama.cpp cannot capture boundary {num_layers} (the last layer's pre-norm output of a "
            f"{num_layers}-layer target): it copies the input of layer i for id i, and there is no layer "
            f"{num_layers}. Retrain without it, or serve with vLLM or eaglewire")


def to_ids(boundaries: list[int], num_layers: int, arch: str | None = None) -> list[int]:
    check_expressible(boundaries, num_layers)
    return list(boundaries)


def to_boundaries(ids: list[int], num_layers: int, arch: str | None = None) -> list[int]:
    check_expressible(ids, num_layers)
    return list(ids)


def reads_export(engine: str, *, boundaries: list[int], ids: list[int], num_layers: int,
                 target_arch: str | None) -> list[str]:
    """SERVING.md lines: how llama.cpp reads the directory another ``engine``'s export wrote."""
    return ["- llama.cpp reads neither this config nor its ids: give it eaglewire's llama.cpp export of the "
            "native draft."]


def layer_input_archs(tree: Path) -> set[str]:
    """llama.cpp architecture names whose graph records layer inputs (``t_layer_inp``), the
    states an EAGLE-3 draft reads, read from the source tree: model files that set it, the
    model classes whose graph they define or reuse, and the architectures mapped to those."""
    models = tree / "src" / "models"
    classes = set()
    for path in models.glob("*.cpp"):
        text = path.read_text(errors="replace")
        if "t_layer_inp" in text:
            classes |= set(re.findall(r"\b(llama_model_\w+)::graph\b", text))
    header = (models / "models.h").read_text(errors="replace")
    for block in re.split(r"\n(?=struct llama_model_)", header):
        m = re.match(r"struct (llama_model_\w+)", block)
        reuse = re.search(r"using graph = (llama_model_\w+)::graph", block)
        if m and reuse and reuse.group(1) in classes:
            classes.add(m.group(1))
    mapping = (tree / "src" / "llama-model.cpp").read_text(errors="replace")
    archs, pending = [], []
    for line in mapping[mapping.index("llama_model_mapping"):].splitlines():
        case = re.search(r"case (LLM_ARCH_\w+):", line)
        if case:
            pending.append(case.group(1))
            continue
        new = re.search(r"return new (llama_model_\w+)", line)
        if new:
            archs += pending if new.group(1) in classes else []
            pending = []
        if line.startswith("}"):
            break
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+),\s*\"([^\"]+)\"", (tree / "src" / "llama-arch.cpp").read_text()))
    return {names[a] for a in archs if a in names}


# At build 11434 (installation.BUILD; layer_input_archs of its tree; a test checks the two agree when the tree is here).
EAGLE3_TARGET_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan-dense", "hunyuan_vl", "lfm2", "lfm2moe", "llama",
    "llama-embed", "mimo2", "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "nemotron_h_moe",
    "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp"})

# transformers architecture -> the llama.cpp architecture its converter writes (common targets).
HF_TO_LLAMACPP_ARCH = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe", "Qwen3NextForCausalLM": "qwen3next",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3", "OlmoForCausalLM": "olmo", "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite", "Glm4ForCausalLM": "glm4", "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2", "KimiK2ForCausalLM": "deepseek2", "GptOssForCausalLM": "gpt-oss",
    "Lfm2ForCausalLM": "lfm2", "MiniMaxM2ForCausalLM": "minimax-m2", "NemotronHForCausalLM": "nemotron_h",
    "Mistral3ForConditionalGeneration": "mistral3",
    "Qwen2VLForConditionalGeneration": "qwen2vl", "Qwen2_5_VLForConditionalGeneration": "qwen2vl",  # conversion/qwenvl.py
}


def llamacpp_arch(architecture: str) -> str | None:
    """The llama.cpp architecture of a target named by its transformers class (or already by
    its GGUF name); None when unknown."""
    if architecture in HF_TO_LLAMACPP_ARCH:
        return HF_TO_LLAMACPP_ARCH[architecture]
    return architecture if re.fullmatch(r"[a-z0-9_\-]+", architecture) else None


def refusal(arch: str | None) -> str | None:
    """Why llama.cpp (build 11434) feeds no EAGLE-3 draft for a target of ``arch`` (None: it does, or it cannot
    be told which llama.cpp architecture the target converts to)."""
    name = llamacpp_arch(arch) if arch else None
    if name is None or name in EAGLE3_TARGET_ARCHS:
        return None
    return (f"llama.cpp build 11434 converts it to {name}, whose graph records no layer inputs (t_layer_inp), and "
            "aborts at load")


# What llama.cpp's converter (conversion/llama.py LlamaModel.set_gguf_parameters / prepare_tensors, build
# BUILD) takes from an EAGLE-3 config.json and its tensors into the draft GGUF, which
# src/models/eagle3.cpp then computes with: missing norm flags are false (as eaglewire trains), d2t
# offsets become absolute target ids in the GGUF, a missing d2t means the target's whole vocabulary.
CONVERTER = "conversion/llama.py LlamaModel.set_gguf_parameters / prepare_tensors"


def converter_reads(config: dict, *, num_layers: int) -> dict:
    """The GGUF values the converter writes for ``config``: norm_before_residual, norm_before_fc,
    target_layers and target_hidden_size (None: the target config's), d2t's meaning."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return {"norm_before_residual": bool(config.get("norm_before_residual", False)),
            "norm_before_fc": bool(config.get("norm_before_fc", False)),
            "target_layers": list(ids) if ids else default_aux_boundaries(num_layers),
            "target_hidden_size": config.get("target_hidden_size"),
            "d2t": "offsets in, absolute target ids in the GGUF (d2t + arange)"}


# ---------------------------------------------------------------- DFlash (--spec-type draft-dflash)
# Build 11434: the converter (conversion/qwen.py DFlashModel.set_gguf_parameters) writes GGUF
# ``dflash.target_layers = [i + 1 for i in dflash_config.target_layer_ids]`` for z-lab's layout (DSparkModel
# first normalises speculators-style configs: target_layer_ids = [i - 1 for i in aux_hidden_state_layer_ids], so
# their GGUF layers are aux_hidden_state_layer_ids), and the runtime (common/speculative.cpp
# common_speculative_impl_draft_dflash: llama_set_embeddings_layer_inp(ctx_tgt, target_layer_ids[k])) reads the
# INPUT of each of those layers: GGUF layers = boundaries, any number of them (src/models/dflash.cpp sizes fc for
# target_layers.size()). llama.cpp registers no DFlashSpeculator architecture: a speculators DFlash directory
# does not convert.
DFLASH_GGUF_ARCH = "dflash"
DFLASH_CONVERTER = "conversion/qwen.py DFlashModel.set_gguf_parameters"


def dflash_to_ids(boundaries: list[int], num_layers: int, arch: str | None = None) -> list[int]:
    """GGUF ``dflash.target_layers`` for ``boundaries``: the boundaries (inputs of those layers)."""
    if num_layers in boundaries:
        raise EngineConventionError(
            f"llama.cpp's DFlash draft reads the input of layer i for target layer i, and a {num_layers}-layer target "
            f"has no layer {num_layers}: boundary {num_layers} cannot be fed. Retrain without it, or serve with vLLM "
            "or eaglewire")
    return list(boundaries)


def dflash_to_boundaries(ids: list[int], num_layers: int, arch: str | None = None) -> list[int]:
    return dflash_to_ids(list(ids), num_layers)


def converter_dflash_layers(config: dict) -> list[int] | None:
    """The ``dflash.target_layers`` the converter writes for a z-lab config (None: it writes none and
    llama.cpp refuses the GGUF: "DFlash model requires 'target_layers'")."""
    ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    return [int(i) + 1 for i in ids] if ids else None
