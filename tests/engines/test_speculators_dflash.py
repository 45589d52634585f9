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
from eaglewire.engines.shared import FormatError
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
    for p in model.parameters():  # norms at 1 and a fresh init would hide a swapped tensor: make each distinct
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


def test_a_pruned_vocabulary_draft_is_refused_with_what_to_do(speculators, target_dir, tmp_path):
    """speculators prunes the draft vocabulary by frequency (d2t offsets, t2d mask, its own lm_head); eaglewire's
    DFlash drafts predict over the target's head, so the import refuses it, names the flag and writes nothing."""
    d2t, t2d = speculators.vocab_mappings({i: 1000 - i for i in range(0, 256, 3)}, 64, 256)
    src = _written_by_speculators(speculators, target_dir, tmp_path / "pruned", draft_vocab_size=64, d2t=d2t, t2d=t2d)
    assert {"d2t", "t2d", "lm_head.weight"} <= set(load_file(src / "model.safetensors"))
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    with pytest.raises(FormatError, match="--draft-vocab-size 256"):
        engines.import_draft(src, "speculators", target, tmp_path / "imported")
    assert not (tmp_path / "imported").exists()
