"""A DFlash draft exported through llama.cpp's own converter loads in the real llama-server (build 11434)
unedited, with ``dflash.target_layers`` = the contract's boundaries, and drafts."""

from __future__ import annotations

import pytest

from eaglewire.engines import llamacpp as engine

pytestmark = pytest.mark.llamacpp

BOUNDS = [2, 15, 27]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, smollm2_target, smollm2_tokenizer):
    if engine.find_server() is None or engine.find_tree() is None:
        pytest.skip(f"llama-server is not installed: {engine.INSTALL_HINT}")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (eaglewire[llamacpp])")
    from tiny import save_random_dflash_draft

    from eaglewire.engines import export_draft
    from eaglewire.model.dflash import default_mask_token_id

    root = tmp_path_factory.mktemp("dflash-gguf")
    mask = default_mask_token_id(smollm2_tokenizer, smollm2_target.vocab_size)
    native = save_random_dflash_draft(root / "native", smollm2_target, BOUNDS, block_size=4, mask_token_id=mask)
    report = export_draft(native, "llamacpp", root / "out", outtype="f16", target_outtype="f32")
    return root / "out", report


def test_the_dflash_gguf_loads_unedited_with_the_contracts_layers(exported, smollm2_tokenizer):
    from eaglewire.decode.text import encode_prompt

    out, report = exported
    meta = engine.read_gguf_metadata(out / "draft-f16.gguf")
    assert meta["general.architecture"] == "dflash"
    assert engine.draft_layers(meta) == report.aux_boundaries == BOUNDS
    serving = (out / "SERVING.md").read_text()
    assert "--spec-type draft-dflash" in serving and "--spec-draft-n-max 3" in serving
    config = engine.ServerConfig(model=out / "target-f32.gguf", draft=out / "draft-f16.gguf", n_max=3,
                                 spec_type="draft-dflash")
    with engine.LlamaServer(engine.require_server(), config, log_path=out / "server.log") as server:
        answer = engine.complete(server.url, encode_prompt(smollm2_tokenizer, "Name a colour.", chat=True),
                                 n_predict=8)
    log = (out / "server.log").read_text()
    assert "adding speculative implementation 'draft-dflash'" in log and "n_extract=3" in log
    assert answer["timings"]["draft_n"] > 0  # the draft is in use
