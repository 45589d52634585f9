import dataclasses

import pytest

from eaglewire.core.contract import (
    TARGET_ARCHS,
    ContractError,
    EngineConventionError,
    HiddenStateContract,
    TargetFingerprint,
    default_aux_boundaries,
    target_arch,
    validate_boundaries,
)
from eaglewire.engines import from_engine, to_engine
from eaglewire.engines import refusal as engine_refusal
from eaglewire.engines.sglang import FILES as SGLANG_FILES
from eaglewire.engines.sglang import ambiguity as sglang_ambiguity
from eaglewire.engines.sglang import readings_by_file as sglang_readings
from eaglewire.engines.vllm import FILES as VLLM_FILES

FP = TargetFingerprint(architecture="LlamaForCausalLM", num_layers=30, hidden_size=576,
                       vocab_size=49152, tokenizer_sha256="tok", chat_template_sha256="tmpl",
                       weights_sha256="w", dtype="float32")


def contract(bounds=(2, 15, 27), **fp_changes):
    return HiddenStateContract(aux_boundaries=tuple(bounds), target=dataclasses.replace(FP, **fp_changes))


def test_default_boundaries():
    assert default_aux_boundaries(30) == [2, 15, 27]
    assert default_aux_boundaries(32) == [2, 16, 29]
    assert default_aux_boundaries(61) == [2, 30, 58]
    with pytest.raises(ContractError, match="4-layer"):
        default_aux_boundaries(4)


def test_json_round_trip():
    c = contract((0, 3, 29))
    assert HiddenStateContract.from_json(c.to_json()) == c
    assert HiddenStateContract.from_dict(c.to_dict()).aux_boundaries == (0, 3, 29)


@pytest.mark.parametrize("bounds, message", [
    ([], "empty"),
    ([2, 31], r"31 is outside \[0, 30\]"),
    ([-1, 4], r"-1 is outside"),
    ([2, 15, 15], r"repeat \[15\]"),
    ([2, "x"], "not an integer"),
])
def test_invalid_boundaries(bounds, message):
    with pytest.raises(ContractError, match=message):
        validate_boundaries(bounds, 30)
    if bounds:
        with pytest.raises(ContractError, match=message):
            contract(bounds)


def test_non_ascending_boundaries_are_refused_with_the_sorted_fix():
    # vLLM sorts the ids and SGLang captures in layer order: [15, 2, 27] would be fed as [2, 15, 27]
    with pytest.raises(ContractError, match=r"\[15, 2, 27\] are not ascending; sort them \(--aux-boundaries 2,15,27\)"):
        validate_boundaries([15, 2, 27], 30)
    with pytest.raises(ContractError, match="not ascending"):
        contract((27, 2, 15))
    with pytest.raises(ContractError, match="not ascending"):
        HiddenStateContract.from_dict({**contract().to_dict(), "aux_boundaries": [27, 2, 15]})


def test_check_same_compares_layouts():
    with pytest.raises(ContractError, match=r"aux boundaries \[2, 15, 28\]"):
        contract((2, 15, 27)).check_same(contract((2, 15, 28)))


def test_malformed_dict():
    with pytest.raises(ContractError, match="malformed"):
        HiddenStateContract.from_dict({"aux_boundaries": [1, 2]})
    with pytest.raises(ContractError, match="version 99"):
        HiddenStateContract.from_dict({**contract().to_dict(), "version": 99})


def test_target_mismatch_names_every_field():
    with pytest.raises(ContractError) as e:
        contract().check_target(dataclasses.replace(FP, num_layers=24, weights_sha256="other"))
    assert "num_layers recorded 30" in str(e.value) and "weights_sha256" in str(e.value)
    assert "--allow-target-mismatch" in str(e.value)


def test_target_mismatch_override_and_soft_dtype():
    warnings = contract().check_target(dataclasses.replace(FP, weights_sha256="q8", dtype="bfloat16"),
                                       allow={"weights_sha256"})
    assert len(warnings) == 2 and any("dtype" in w for w in warnings)
    assert contract().check_target(FP) == []


ARCH_ENGINES = [("vllm", None), ("speculators", None), ("specforge", None)] + [
    ("sglang", a) for a in TARGET_ARCHS if a != "gemma3"]


@pytest.mark.parametrize("engine, arch", ARCH_ENGINES)
@pytest.mark.parametrize("bounds", [[2, 15, 27], [3, 10, 20, 25], [4, 16, 28], [1, 15, 29]])
def test_round_trip_every_engine(engine, arch, bounds):
    try:
        ids = to_engine(bounds, 30, engine, target_arch=arch)
    except EngineConventionError:
        return  # refusals are checked below and against the engines' code (tests/engines)
    assert from_engine(ids, 30, engine, target_arch=arch) == bounds


def test_sglang_reading_depends_on_the_target_model_file():
    # issue 19's case: ids [3, 15, 27] are [4, 16, 28] on llama.py, [3, 15, 27] on deepseek_v2.py
    assert from_engine([3, 15, 27], 30, "sglang", target_arch="llama") == [4, 16, 28]
    assert from_engine([3, 15, 27], 30, "sglang", target_arch="deepseek_v3") == [3, 15, 27]
    assert to_engine([3, 16, 28], 30, "sglang", target_arch="llama") == [2, 15, 27]
    assert to_engine([3, 16, 28], 30, "sglang", target_arch="DeepseekV3ForCausalLM") == [3, 16, 28]
    # the reference layout is wired alike on every file (SpecForge's ids)
    for arch in ("llama", "qwen2", "qwen3", "mistral", "deepseek_v3", "gpt_oss"):
        assert to_engine([2, 15, 27], 30, "sglang", target_arch=arch) == [1, 14, 26]
    assert from_engine([1, 29, 57], 61, "sglang", target_arch="deepseek_v3") == [2, 30, 58]
    with pytest.raises(ContractError, match="target_arch"):
        to_engine([2, 15, 27], 30, "sglang")


def test_boundary_zero_and_L_per_model_file():
    assert to_engine([0, 15, 27], 30, "sglang", target_arch="llama") == [-1, 14, 26]
    assert from_engine([-1, 14, 26], 30, "sglang", target_arch="llama") == [0, 15, 27]
    assert to_engine([0, 15, 27], 30, "sglang", target_arch="deepseek_v3") == [0, 15, 27]
    assert to_engine([2, 15, 30], 30, "sglang", target_arch="gpt_oss") == [2, 15, 30]  # verbatim when max == L
    assert to_engine([0, 15, 27], 30, "sglang", target_arch="gpt_oss") == [-1, 14, 26]
    assert to_engine([0, 3, 30], 30, "vllm") == [0, 3, 30]
    with pytest.raises(EngineConventionError, match="boundary 30"):
        to_engine([2, 15, 30], 30, "sglang", target_arch="qwen3")
    with pytest.raises(EngineConventionError, match="first id is 1"):
        to_engine([1, 15, 27], 30, "sglang", target_arch="deepseek_v3")


def test_engines_without_a_working_reading_refuse_with_the_reason():
    with pytest.raises(EngineConventionError, match="without the residual"):
        to_engine([2, 15, 27], 30, "sglang", target_arch="gemma3")
    with pytest.raises(EngineConventionError, match="SupportsEagle3"):
        to_engine([2, 15, 27], 30, "vllm", target_arch="gemma3")
    assert engine_refusal("vllm", "glm4_moe_lite") and engine_refusal("vllm", "llama") is None
    # ids naming a layer the file never captures: fewer states than fc takes
    with pytest.raises(EngineConventionError, match="captures only boundaries"):
        from_engine([1, 14, 29], 30, "sglang", target_arch="llama")


def test_every_arch_has_a_reading_in_both_engines_and_names_its_source():
    assert set(SGLANG_FILES) == set(VLLM_FILES) == set(TARGET_ARCHS)
    for f in [*SGLANG_FILES.values(), *VLLM_FILES.values()]:
        assert f.path.endswith(".py") and f.function
    assert target_arch("Qwen3ForCausalLM") == "qwen3" and target_arch("gemma3_text") == "gemma3"
    with pytest.raises(ContractError, match="'FalconForCausalLM' has no engine reading"):
        target_arch("FalconForCausalLM")


def test_sglang_readings_name_each_family_and_the_ambiguity():
    readings = sglang_readings([3, 14, 26], 30)
    assert readings["sglang 0.5.23 on llama/mistral/qwen2/qwen3 targets"] == [4, 15, 27]
    assert readings["sglang 0.5.23 on deepseek_v3/glm4_moe_lite targets"] == [3, 14, 26]
    note = sglang_ambiguity([4, 15, 27], [3, 14, 26], 30)
    assert "deepseek_v3/glm4_moe_lite targets: boundaries [3, 14, 26]" in note and "llama" not in note
    assert sglang_ambiguity([2, 15, 27], [1, 14, 26], 30) is None


def test_known_conventions():
    assert to_engine([2, 15, 27], 30, "specforge") == [1, 14, 26]
    assert from_engine(None, 30, "sglang") == [2, 15, 27]
    assert from_engine([5, 6, 7], 30, "eagle") == [2, 15, 27]
    assert from_engine([27, 2, 15], 30, "vllm") == [2, 15, 27]  # vLLM sorts


@pytest.mark.parametrize("engine, bounds, message", [
    ("specforge", [0, 3, 27], "boundary 0"),
    ("specforge", [2, 15, 30], "post-norm"),
    ("eagle", [3, 15, 27], "hard-codes"),
])
def test_inexpressible_layouts_fail_loudly(engine, bounds, message):
    with pytest.raises(EngineConventionError, match=message):
        to_engine(bounds, 30, engine)


def test_unknown_engine():
    with pytest.raises(ContractError, match="unknown engine 'tgi'"):
        to_engine([2, 15, 27], 30, "tgi")
    with pytest.raises(ContractError, match="unknown engine 'tgi'"):
        from_engine(None, 30, "tgi")


def test_llamacpp_takes_boundaries_verbatim_three_and_below_L():
    assert to_engine([0, 15, 27], 30, "llamacpp") == [0, 15, 27]
    assert from_engine([2, 15, 27], 30, "llamacpp") == [2, 15, 27]
    with pytest.raises(EngineConventionError, match="exactly 3"):
        to_engine([2, 15], 30, "llamacpp")
    with pytest.raises(EngineConventionError, match="boundary 30"):
        to_engine([2, 15, 30], 30, "llamacpp")


def test_family_is_recorded_for_drafts_and_compared_between_drafts():
    """A draft's contract records its family and reads it back; data (family None) matches a draft of
    either family, while two drafts of different families do not wire alike."""
    data = HiddenStateContract(aux_boundaries=(1, 3), target=FP)
    assert "family" not in data.to_dict()
    dflash = data.for_family("dflash")
    assert HiddenStateContract.from_dict(dflash.to_dict()).family == "dflash"
    dflash.check_same(data)
    data.check_same(dflash)
    with pytest.raises(ContractError, match="dflash draft but a eagle3 one"):
        data.for_family("eagle3").check_same(dflash)
    with pytest.raises(ContractError, match="family 'medusa'"):
        data.for_family("medusa")


def test_chat_template_kwargs_are_recorded_only_when_set_and_older_contracts_still_load():
    """The chat-template switches the data was rendered with round-trip; a contract without them (every
    manifest and checkpoint written before) loads with None, and {} (the template's defaults) is kept
    apart from None (not recorded)."""
    old = contract().to_dict()
    assert "chat_template_kwargs" not in old
    assert HiddenStateContract.from_dict(old).chat_template_kwargs is None
    off = dataclasses.replace(contract(), chat_template_kwargs={"enable_thinking": False})
    assert HiddenStateContract.from_json(off.to_json()) == off
    assert off.to_dict()["chat_template_kwargs"] == {"enable_thinking": False}
    defaults = dataclasses.replace(contract(), chat_template_kwargs={})
    assert HiddenStateContract.from_dict(defaults.to_dict()).chat_template_kwargs == {}
    with pytest.raises(ContractError, match="not a JSON object"):
        dataclasses.replace(contract(), chat_template_kwargs=["enable_thinking"])
    with pytest.raises(ContractError, match="scalar value"):
        dataclasses.replace(contract(), chat_template_kwargs={"enable_thinking": [True]})


def test_a_draft_and_data_rendered_with_other_template_switches_do_not_match():
    """Both recorded and different: an error naming both and the flag that fixes it; either one unrecorded
    (older data or drafts): nothing to compare; allowed explicitly: a warning."""
    on = dataclasses.replace(contract(), chat_template_kwargs={"enable_thinking": True})
    off = dataclasses.replace(contract(), chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ContractError, match=r'rendered with chat_template_kwargs \{"enable_thinking": false\}, '
                                            r'chat_template_kwargs \{"enable_thinking": true\} expected.*'
                                            r"--enable-thinking"):
        on.check_same(off, what="data")
    assert off.check_same(contract()) == []  # the data records no switch
    assert contract().check_same(on) == []
    on.check_same(dataclasses.replace(off, chat_template_kwargs={"enable_thinking": True}))
    [warning] = on.check_same(off, allow={"chat_template_kwargs"})
    assert "enable_thinking" in warning
    with pytest.raises(ContractError, match="--no-enable-thinking"):
        off.check_same(on)
