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


def _export_pruned(root, target, tokenizer, ids):
    """A random DFlash draft over the target ids ``ids`` only, exported through llama.cpp's converter (f16)."""
    from tiny import pruned_dflash_draft, random_dflash_draft

    from eaglewire.engines import export_draft
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.dflash import default_mask_token_id

    mask = default_mask_token_id(tokenizer, target.vocab_size)
    whole, contract = random_dflash_draft(target, BOUNDS, block_size=4, mask_token_id=mask, perturb_norms=True)
    draft = pruned_dflash_draft(whole, ids)
    save_draft(root / "native", draft, contract, {"target": target.spec})
    return export_draft(root / "native", "llamacpp", root / "out", target=target, outtype="f16",
                        target_outtype="f32")


def _need_llamacpp(server: bool = True) -> None:
    if engine.find_tree() is None or (server and engine.find_server() is None):
        pytest.skip(f"llama.cpp is not installed: {engine.INSTALL_HINT}")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (eaglewire[llamacpp])")


def test_a_pruned_dflash_gguf_carries_its_target_ids_and_the_heads_rows(tmp_path, smollm2_target, smollm2_tokenizer):
    """llama.cpp's converter writes d2t as absolute ids and the target head's rows as output.weight."""
    import torch

    from eaglewire.engines.llamacpp.gguf import gguf_tensor

    _need_llamacpp(server=False)
    ids = torch.arange(0, smollm2_target.vocab_size, 96)  # [512]: every 96th id
    report = _export_pruned(tmp_path, smollm2_target, smollm2_tokenizer, ids)
    draft_file = tmp_path / "out" / "draft-f16.gguf"
    meta = engine.read_gguf_metadata(draft_file)
    assert meta["general.architecture"] == "dflash" and engine.draft_layers(meta) == report.aux_boundaries == BOUNDS
    assert (gguf_tensor(draft_file, "d2t") == ids.numpy()).all()
    rows = torch.from_numpy(gguf_tensor(draft_file, "output.weight").astype("float32"))  # [512, H] in f16
    head = smollm2_target.model.get_output_embeddings().weight.detach()[ids]
    torch.testing.assert_close(rows, head, rtol=1e-3, atol=1e-3)  # f16 rounding of the target's rows
    assert "512 of the target's tokens" in (tmp_path / "out" / "SERVING.md").read_text()
    from eaglewire.doctor.checks import vocab_check

    assert vocab_check("llamacpp", str(draft_file), ids).verdict == "ok"
    assert vocab_check("llamacpp", str(draft_file), ids + 1).verdict == "fail"  # served for another draft's vocabulary
    assert vocab_check("llamacpp", str(draft_file), None).verdict == "fail"  # for a whole-vocabulary draft


def test_llama_server_drafts_a_pruned_dflash_gguf_in_the_target_ids(tmp_path, smollm2_target, smollm2_tokenizer):
    """A draft whose vocabulary is the one token plain decoding repeats most always proposes that token: llama-server
    accepts some of its drafts only if it scatters the draft's one row to that token's id (read through d2t; row 0
    read as token 0 would never be accepted), and the output stays plain decoding's."""
    import collections

    import torch

    from eaglewire.decode.text import encode_prompt
    from eaglewire.model.target import resolve_target_path

    _need_llamacpp()
    out = tmp_path / "out"
    prompt = encode_prompt(smollm2_tokenizer, "List five colours, one per line.", chat=True)
    target_gguf = engine.target_gguf(resolve_target_path(smollm2_target.spec), "LlamaForCausalLM", "f32",
                                     tree=engine.require_tree())  # cached: the export links the same file
    with engine.LlamaServer(engine.require_server(), engine.plain_server_config(target_gguf, slots=1, threads=2),
                            log_path=tmp_path / "plain.log") as server:
        plain = engine.complete(server.url, prompt, n_predict=32)["tokens"]
    repeated, count = collections.Counter(plain[1:]).most_common(1)[0]
    assert count >= 2 and repeated != 0, plain
    _export_pruned(tmp_path, smollm2_target, smollm2_tokenizer, torch.tensor([repeated]))
    config = engine.ServerConfig(model=out / "target-f32.gguf", draft=out / "draft-f16.gguf", n_max=3,
                                 spec_type="draft-dflash")
    with engine.LlamaServer(engine.require_server(), config, log_path=tmp_path / "server.log") as server:
        answer = engine.complete(server.url, prompt, n_predict=32)
    assert answer["tokens"] == plain
    assert answer["timings"]["draft_n"] > 0 and answer["timings"]["draft_n_accepted"] > 0
