"""The engine registry's entry points, the one draft-directory reader and the export defaults."""

import dataclasses
import inspect
import json

import pytest
import torch

from eaglewire import engines
from eaglewire.model.checkpoint import read_draft, save_draft
from eaglewire.core.contract import ContractError, HiddenStateContract
from eaglewire.doctor.engine_reading import lint_flags
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.engines import ExportConfig, llamacpp, sglang, vllm
from eaglewire.engines.llamacpp import gguf


def _native(out, target, boundaries):
    V = target.vocab_size
    cfg = DraftConfig.from_target(target.text_config, num_aux=len(boundaries), draft_vocab_size=V, vocab_size=V)
    torch.manual_seed(0)
    contract = HiddenStateContract(aux_boundaries=tuple(boundaries), target=target.fingerprint)
    return save_draft(out, Eagle3Draft(cfg), contract, {"target": "tiny-test"})


def test_every_engine_is_one_spec_whose_abilities_are_its_fields():
    """An ability is a field being set, so asking for one the spec lacks is impossible to get wrong by name."""
    from eaglewire.engines import Ability

    for e in engines.ENGINES:
        assert engines.get(e.name) is e and all(engines.get(a) is e for a in e.aliases)
        assert e.can(Ability.IMPORT) == (e.importer is not None) and e.can(Ability.EXPORT) == (e.exporter is not None)
        if e.can(Ability.IMPORT):
            assert e.eagle3 is not None and e.eagle3.read_ids is not None, e.name
        assert e.can(Ability.RUN_HERE) == (e.runtime is not None or e.in_process), e.name
    with pytest.raises(TypeError, match="engines.Ability"):
        engines.get("vllm").can("export")
    assert engines.to_engine([2, 15, 27], 30, "speculators") == engines.to_engine([2, 15, 27], 30, "vllm")


def test_a_draft_whose_config_and_contract_disagree_is_refused_by_export_too(tmp_path, chat_tiny_target):
    """Export reads the draft with the same reader as load_draft, so it refuses what loading refuses."""
    src = _native(tmp_path / "d", chat_tiny_target, [1, 3, 5])
    config = json.loads((src / "config.json").read_text())
    config["draft"]["num_aux"] = 4
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ContractError, match="fuses 4 states but its contract lists 3"):
        read_draft(src)
    with pytest.raises(ContractError, match="fuses 4 states but its contract lists 3"):
        engines.export_draft(src, "sglang", tmp_path / "out", target_arch="llama")


def test_export_defaults_live_in_export_config_only():
    """No engine's export, nor the entry point, carries its own default for an ExportConfig field
    (llama.cpp's export once defaulted num_steps to 3 where the CLI said 5)."""
    settings = {f.name for f in dataclasses.fields(ExportConfig)}
    for fn in (engines.export_draft, sglang.export, vllm.export, gguf.export, llamacpp.export):
        own = [p for p in inspect.signature(fn).parameters.values() if p.name in settings]
        assert not own, (fn.__module__, [p.name for p in own])
    assert ExportConfig().num_steps == 5
    with pytest.raises(ValueError, match="num_steps 0 must be an integer >= 1"):
        ExportConfig(num_steps=0)


def test_export_settings_override_the_config(tmp_path, chat_tiny_target):
    src = _native(tmp_path / "d", chat_tiny_target, [1, 3, 5])
    engines.export_draft(src, "sglang", tmp_path / "a", target_arch="llama")
    engines.export_draft(src, "sglang", tmp_path / "b", config=ExportConfig(num_steps=2), target_arch="llama")
    assert "--speculative-num-steps 5 " in (tmp_path / "a" / "SERVING.md").read_text()
    assert "--speculative-num-steps 2 " in (tmp_path / "b" / "SERVING.md").read_text()


def test_speculators_flags_are_linted_as_vllm_reads_them():
    """``speculators`` is vLLM: its launch flags are vLLM's --speculative-config, not SGLang's flags."""
    flags = '--speculative-config \'{"method": "eagle3", "model": "d", "num_speculative_tokens": 4}\''
    got = lint_flags("speculators", flags, [2, 15, 27], 30, "llama")
    assert (got.num_steps, got.topk, got.problems) == (4, 1, [])
    assert lint_flags("speculators", "", [2, 15, 27], 30).problems[0][1].startswith("no --speculative-config")


def test_served_metrics_are_read_as_prometheus_text():
    """Timestamps and labelled samples (a space inside a label value) read right."""
    text = ('# TYPE llamacpp:spec_decode_num_drafts_total counter\n'
            'llamacpp:spec_decode_num_drafts_total 17 1700000000000\n'
            'llamacpp:requests{state="in flight"} 2\n')
    assert llamacpp.parse_metrics(text) == {"spec_decode_num_drafts_total": 17.0, 'requests{state="in flight"}': 2.0}


def test_each_engine_samples_by_its_own_spec_and_eaglewires_rule_stands_in():
    """The doctor asks an engine's ``sampling`` for its acceptance rule and launch temperature, never a table by name."""
    assert engines.sampling_of("speculators") is engines.get("vllm").sampling
    assert engines.sampling_of("vllm").launch_temperature is vllm.launch_temperature
    assert engines.sampling_of("llamacpp").launch_temperature("--temp 0.7", None).value == 0.7
    assert "SGLang" in engines.sampling_of("sglang").acceptance_rule
    own = engines.get("eaglewire").sampling
    assert own.launch_temperature is None and "sampling_verify" in own.acceptance_rule
    assert engines.sampling_of("specforge") is own  # no rule read: eaglewire's
    with pytest.raises(ValueError, match="'tensorrt' is not one of"):
        engines.sampling_of("tensorrt")
