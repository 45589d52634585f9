import dataclasses

import pytest

from eaglewire.contract import (
    ContractError,
    EngineConventionError,
    HiddenStateContract,
    TargetFingerprint,
    default_aux_boundaries,
    from_engine,
    sglang_ambiguity,
    sglang_readings,
    to_engine,
    validate_boundaries,
)

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
    c = contract((0, 3, 30))
    assert HiddenStateContract.from_json(c.to_json()) == c
    assert HiddenStateContract.from_dict(c.to_dict()).aux_boundaries == (0, 3, 30)


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


def test_order_is_kept_and_matters():
    assert contract((27, 2, 15)).aux_boundaries == (27, 2, 15)
    with pytest.raises(ContractError, match=r"aux boundaries \[27, 2, 15\]"):
        contract((2, 15, 27)).check_same(contract((27, 2, 15)))


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


@pytest.mark.parametrize("engine", ["vllm", "speculators", "specforge", "sglang"])
@pytest.mark.parametrize("bounds", [[2, 15, 27], [3, 10, 20, 25], [27, 2, 15]])
def test_round_trip_every_engine(engine, bounds):
    ids = to_engine(bounds, 30, engine)
    assert from_engine(ids, 30, engine) == bounds


def test_known_conventions():
    # SpecForge and SGLang name the same physical layers "output of layer i".
    assert to_engine([2, 15, 27], 30, "specforge") == [1, 14, 26]
    assert to_engine([2, 15, 27], 30, "sglang") == [1, 14, 26]
    assert to_engine([0, 3, 30], 30, "vllm") == [0, 3, 30]
    # DeepSeek-V3 (61 layers) SGLang example ids [1, 29, 57] mean boundaries [2, 30, 58].
    assert from_engine([1, 29, 57], 61, "sglang") == [2, 30, 58]
    assert from_engine([1, 29, 57], 61, "sglang", sglang_rule="plus_one_if_first_is_one") == [2, 30, 58]
    assert from_engine(None, 30, "sglang") == [2, 15, 27]
    assert from_engine([5, 6, 7], 30, "eagle") == [2, 15, 27]


def test_sglang_new_rule_reads_other_ids_verbatim():
    assert sglang_readings([3, 14, 26]) == {"always_plus_one": [4, 15, 27],
                                            "plus_one_if_first_is_one": [3, 14, 26]}
    assert to_engine([4, 15, 27], 30, "sglang", sglang_rule="plus_one_if_first_is_one") == [4, 15, 27]
    note = sglang_ambiguity([4, 15, 27], [3, 14, 26])
    assert "since mid-2026 capture boundaries [3, 14, 26]" in note
    assert "before mid-2026 wire it right" in note
    assert sglang_ambiguity([2, 15, 27], [1, 14, 26]) is None


@pytest.mark.parametrize("engine, bounds, message", [
    ("sglang", [0, 3, 27], "boundary 0"),
    ("sglang", [2, 15, 30], "boundary 30"),
    ("specforge", [0, 3, 27], "boundary 0"),
    ("specforge", [2, 15, 30], "post-norm"),
    ("eagle", [3, 15, 27], "hard-codes"),
])
def test_inexpressible_layouts_fail_loudly(engine, bounds, message):
    with pytest.raises(EngineConventionError, match=message) as e:
        to_engine(bounds, 30, engine)
    if engine == "sglang":
        assert "vLLM" in str(e.value)  # says what to do instead


def test_sglang_new_rule_cannot_start_at_one():
    with pytest.raises(EngineConventionError, match="boundary 1"):
        to_engine([1, 15, 27], 30, "sglang", sglang_rule="plus_one_if_first_is_one")


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
