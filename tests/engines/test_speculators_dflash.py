"""DFlash drafts as speculators 0.9.0's own code writes them: ``DFlashDraftModel.from_training_args`` (the
constructor its trainer calls) then ``save_pretrained``, imported by eaglewire; and eaglewire's speculators export
read back by speculators' own ``from_pretrained``.

The wheel is unpacked and imported as released; two modules its import chain names but these paths never call are
stubbed: ``loguru`` (a logger) and ``hs_connectors`` (its hidden-state transfer client, used by training data
loaders only)."""

from __future__ import annotations

import copy
import json
import logging
import sys
import types
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from eaglewire import engines
from eaglewire.engines.formats.eagle3_layout import FormatError
from eaglewire.model.checkpoint import load_draft
from eaglewire.model.target import load_target
from tiny import save_tiny_dir

pytestmark = pytest.mark.engines

L, IDS, BLOCK, MASK = 8, [2, 4, 6], 4, 5


@pytest.fixture(scope="module")
def speculators(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_eaglewire_engine_wheels",
                                                  __import__("pathlib").Path(__file__).parent / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    wheel = conftest.peer_wheels()["speculators"]
    root = tmp_path_factory.mktemp("speculators")
    zipfile.ZipFile(wheel.path).extractall(root)
    stubs = {"loguru": types.SimpleNamespace(logger=logging.getLogger("speculators.loguru")),
             "hs_connectors": types.SimpleNamespace(FileTransfer=object, HiddenStatesTransfer=object)}
    saved = {name: sys.modules.get(name) for name in stubs}
    for name, attrs in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(vars(attrs))
        sys.modules.setdefault(name, module)
    sys.path.insert(0, str(root))
    try:
        from speculators.models.dflash import DFlashDraftModel
        from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

        yield types.SimpleNamespace(DFlashDraftModel=DFlashDraftModel, vocab_mappings=build_vocab_mappings_from_distribution)
    finally:
        sys.path.remove(str(root))
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_dir(tmp_path_factory.mktemp("verifier") / "target", "qwen3", num_layers=L)


def _written_by_speculators(speculators, target_dir, out, **kwargs):
    """A DFlash draft as speculators' trainer builds it (one draft layer, the verifier's own layer config), saved."""
    from transformers import AutoConfig

    layer_config = copy.deepcopy(AutoConfig.from_pretrained(target_dir))
    layer_config.num_hidden_layers = 1
    model = speculators.DFlashDraftModel.from_training_args(
        layer_config, verifier_name_or_path=str(target_dir), block_size=BLOCK, target_layer_ids=IDS,
        mask_token_id=MASK, draft_attn_impl="sdpa", **{"draft_vocab_size": 256, **kwargs})
    verifier_owned = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    for name, p in model.named_parameters():  # norms at 1 and a fresh init would hide a swapped tensor
        if name not in verifier_owned:  # the verifier's rows, loaded by from_training_args, stay as loaded
            p.data.normal_(generator=torch.Generator().manual_seed(p.numel()))
    model.save_pretrained(out)
    return out


def test_a_draft_speculators_saved_imports_exactly(speculators, target_dir, tmp_path):
    src = _written_by_speculators(speculators, target_dir, tmp_path / "speculators")
    saved = load_file(src / "model.safetensors")
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    report = engines.import_draft(src, "speculators", target, tmp_path / "imported")
    # speculators' ids are the verifier's hidden_states indices, i.e. eaglewire's boundaries
    assert report.aux_boundaries == IDS
    draft, contract, _ = load_draft(tmp_path / "imported")
    assert contract.family == "dflash" and list(contract.aux_boundaries) == IDS
    assert draft.config.block_size == BLOCK and draft.config.mask_token_id == MASK

    # eaglewire's speculators export, read by speculators' own from_pretrained: every saved tensor unchanged
    engines.export_draft(tmp_path / "imported", "speculators", tmp_path / "again", target_arch="qwen3")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["aux_hidden_state_layer_ids"] == IDS and again["block_size"] == BLOCK
    back = speculators.DFlashDraftModel.from_pretrained(tmp_path / "again")
    state = back.state_dict()
    assert set(saved) <= set(state)
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key
    assert back.config.aux_hidden_state_layer_ids == IDS and back.config.mask_token_id == MASK


def test_a_pruned_vocabulary_draft_speculators_saved_imports_and_round_trips(speculators, target_dir, tmp_path):
    """speculators prunes the draft vocabulary by frequency (its vocab_mapping: d2t offsets, t2d mask) and saves the
    verifier head's rows as a frozen lm_head; the import keeps the maps, checks those rows are the target's, and
    the re-export reads back in speculators' from_pretrained tensor for tensor (lm_head, d2t, t2d included)."""
    d2t, t2d = speculators.vocab_mappings({i: 1000 - i for i in range(0, 256, 3)}, 64, 256)
    src = _written_by_speculators(speculators, target_dir, tmp_path / "pruned", draft_vocab_size=64, d2t=d2t, t2d=t2d)
    saved = load_file(src / "model.safetensors")
    assert {"d2t", "t2d", "lm_head.weight"} <= set(saved)
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    engines.import_draft(src, "speculators", target, tmp_path / "imported")
    draft, contract, _ = load_draft(tmp_path / "imported")
    assert draft.config.pruned and draft.config.draft_vocab_size == 64 and list(contract.aux_boundaries) == IDS
    assert torch.equal(draft.draft_to_target, torch.arange(64) + d2t) and torch.equal(draft.t2d, t2d)

    engines.export_draft(tmp_path / "imported", "speculators", tmp_path / "again", target=target, target_arch="qwen3")
    back = speculators.DFlashDraftModel.from_pretrained(tmp_path / "again")
    state = back.state_dict()
    for key, tensor in saved.items():
        assert torch.equal(state[key], tensor), key
    assert back.config.draft_vocab_size == 64


def test_a_trained_head_of_its_own_is_refused(speculators, target_dir, tmp_path):
    """An lm_head that is not the target's rows (a head trained apart from the target's) cannot be an eaglewire
    DFlash draft, which predicts with the target's head: refused, nothing written."""
    from safetensors.torch import save_file

    d2t, t2d = speculators.vocab_mappings({i: 1000 - i for i in range(0, 256, 3)}, 64, 256)
    src = _written_by_speculators(speculators, target_dir, tmp_path / "own-head", draft_vocab_size=64, d2t=d2t, t2d=t2d)
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] + 0.5
    save_file(state, src / "model.safetensors")
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    with pytest.raises(FormatError, match="not the target's head"):
        engines.import_draft(src, "speculators", target, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_vllm_reads_the_maps_as_the_export_writes_them(wheels):
    """vLLM 0.33.0's DFlash model (qwen3_dflash.py): a draft_vocab_size below the target's makes an lm_head of
    those rows and a draft_id_to_target_id loaded from ``d2t``, added to the draft ids (offsets, as written),
    logits -inf elsewhere; ``t2d`` is skipped."""
    text = wheels["vllm"].text("vllm/model_executor/models/qwen3_dflash.py")
    assert "targets = base + self.draft_id_to_target_id" in text
    assert 'name = name.replace("d2t", "draft_id_to_target_id")' in text and 'if "t2d" in name:' in text
    assert 'float("-inf")' in text and "self.config.draft_vocab_size," in text
