"""The real vLLM serving a DFlash draft (``"method": "dflash"``) on SmolLM2: two server starts for the module
(the export as written, and a copy whose checkpoint ships another model's embed_tokens).

The draft is trained here, in about two minutes: five prompts ask SmolLM2 to repeat a pattern, the assistant
reply starting with two repeats; the data is SmolLM2's own greedy continuation of them (eaglewire's plain
decoding, fp32), captured once (``prepare``) and learned by a one-layer DFlash draft with blocks of 4 over the
reply tokens' vocabulary (the target's head rows of them: a pruned speculators DFlash export, d2t and lm_head
rows). vLLM then serves the same prompts at a chain of BLOCK - 1 (its DFlash drafts
``num_speculative_tokens`` tokens from one block):

(a) the greedy outputs are eaglewire's plain greedy outputs of the fp32 target, token for token (no second
server start for vLLM's plain outputs: fp32 on both sides, on text the target is sure of; the EAGLE-3 module
shows vLLM's plain outputs are its speculative ones); (b) the τ vLLM's own counters report is the doctor's
replay of the draft on those outputs (``served.replay_served``, which runs a DFlash draft's blocks) and
eaglewire's own DFlash decoding of the same prompts at the same block shape; (c) a served copy shipping another
model's embed_tokens (vLLM then embeds the block, its mask token too, with those rows) is served far below the
replay, and the doctor, given the user's export, names another embedding and the one fix: serve the export.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from eaglewire.engines import export_draft
from eaglewire.engines.interface import RunSettings, Shape
from real_vllm.test_vllm_served import _group_gone

pytestmark = [pytest.mark.vllm, pytest.mark.real]

BLOCK = 4
CHAIN = BLOCK - 1  # vLLM drafts num_speculative_tokens from one block of 1 + num_speculative_tokens
NEW_TOKENS = 40
# Prompts whose greedy continuation SmolLM2-135M-Instruct keeps long (patterns, a degenerate repeat, prose)
PATTERNS = (["red", "green", "blue"], ["cat", "dog", "bird", "fish"], ["rock", "paper", "scissors"],
            ["spring", "summer", "autumn", "winter"], ["apple", "banana", "cherry"])


@pytest.fixture(scope="module", autouse=True)
def installed(vllm_installation):
    """Skip before any other fixture loads the target, where vLLM is absent."""
    return vllm_installation


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smollm2_target):
    """(the DFlash draft's directory, the prompts it was trained on: [(prompt ids, plain greedy output)])."""
    from eaglewire.core.tokens import stop_token_ids
    from eaglewire.data.prepare import PrepareConfig, prepare
    from eaglewire.decode.spec_decoder import SpecDecoder
    from eaglewire.model.checkpoint import load_draft
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    root = tmp_path_factory.mktemp("vllm-dflash")
    tok = smollm2_target.tokenizer
    stop = set(stop_token_ids(tok, smollm2_target.model))
    plain = SpecDecoder(smollm2_target)
    rows, prompts = [], {}
    for i, words in enumerate(PATTERNS):
        user = {"role": "user", "content": "Repeat this pattern: " + " ".join(words)}
        start = " ".join(words * 2)
        ids = tok(tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False) + start,
                  add_special_tokens=False)["input_ids"]
        out, _ = plain.generate(ids, max_new_tokens=NEW_TOKENS, stop_token_ids=stop)
        rows.append({"messages": [user, {"role": "assistant",
                                         "content": start + tok.decode([t for t in out if t not in stop])}]})
        prompts[str(i)] = (ids, out)  # prepare's sequence ids are the conversations' indices
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare(PrepareConfig(out=str(root / "data"), data=str(root / "chats.jsonl"), max_length=256,
                          batch_tokens=2048, storage_dtype="fp16", device="cpu", dtype="fp32"),
            target=smollm2_target, progress=False)
    # the whole data set is one batch: 150 steps reach acc ~0.9 at every block position
    train(TrainConfig(out=str(root / "draft"), target="smollm2-135m", data=str(root / "data"), family="dflash",
                      block_size=BLOCK, draft_layers=1, anchors_per_sequence=16, draft_vocab_size=64, epochs=150,
                      lr=5e-3, warmup_steps=2, batch_tokens=2048, val_sequences=1, eval_interval=10_000,
                      save_interval=10_000, device="cpu", dtype="fp32"), target=smollm2_target, progress=False)
    _, _, meta = load_draft(root / "draft", target=smollm2_target)
    held = set(meta["training"]["heldout_sequence_ids"])  # one conversation, whose tokens the vocabulary may miss
    kept = [v for k, v in prompts.items() if k not in held]
    assert len(kept) == len(PATTERNS) - 1
    return root / "draft", kept


@pytest.fixture(scope="module")
def draft(trained, smollm2_target):
    from eaglewire.model.checkpoint import load_draft

    draft, contract, _ = load_draft(trained[0], target=smollm2_target)
    return draft, contract


@pytest.fixture(scope="module")
def served(tmp_path_factory, vllm_installation, trained):
    """vLLM serving the draft's export at a chain of CHAIN: (files, counts, one request's answer, totals, log)."""
    from eaglewire.engines.vllm import measure_served
    from eaglewire.engines.vllm.server import RUNTIME

    draft_dir, prompts = trained
    work = tmp_path_factory.mktemp("vllm-dflash-served")
    settings = RunSettings(install=str(vllm_installation.python))
    files = RUNTIME.files(str(draft_dir), "smollm2-135m", work, settings, export=export_draft)
    log = work / "dflash.log"
    with RUNTIME.serve(files, Shape(n_max=CHAIN), settings, log_path=log) as server:
        pgid, record = server._proc.pid, server.record
        counts = measure_served(server.url, [p for p, _ in prompts], max_new_tokens=NEW_TOKENS)
        answer = server.generate(prompts[0][0], max_new_tokens=NEW_TOKENS, temperature=0.0, seed=0)
        totals = server.draft_totals()
    assert _group_gone(pgid), f"vLLM's processes (group {pgid}) outlived the server: see {log}"
    return files, counts, answer, totals, log, record


def test_the_dflash_export_is_served_as_a_dflash_block_draft(served, draft):
    files, counts, answer, totals, log, record = served
    _, contract = draft
    config = json.loads((files.draft / "config.json").read_text())
    assert files.family == "dflash" and config["speculators_model_type"] == "dflash"
    assert config["draft_vocab_size"] == 64 and (config["aux_hidden_state_layer_ids"]
                                                 == list(contract.aux_boundaries) == [2, 15, 27])
    spec = json.loads(record["command"][record["command"].index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(files.draft), "num_speculative_tokens": CHAIN}
    text = log.read_text()
    assert "Resolved architecture: DFlashDraftModel" in text
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in text
    assert counts.source == "per-request" and len(counts.accepted_per_pos) == CHAIN
    assert counts.draft_tokens == CHAIN * counts.drafts  # a fixed k a round
    assert set(answer.stats.verified_lengths) <= {1, CHAIN + 1}
    assert totals is not None and totals.rounds >= counts.drafts


def test_greedy_outputs_are_the_fp32_targets_plain_outputs(served, trained):
    _, counts, answer, _, _, _ = served
    _, prompts = trained
    # eaglewire's plain greedy decoding of the fp32 target (vLLM serves it in fp32 too): a near-tie would round
    # apart in two engines' kernels, so a mismatch here names the token where they part
    for (prompt, plain), got in zip(prompts, counts.outputs):
        first = next((i for i, (a, b) in enumerate(zip(plain, got)) if a != b), None)
        assert got == plain, f"vLLM parts from eaglewire's plain output at token {first} ({len(got)} vs {len(plain)})"
    assert answer.tokens == prompts[0][1]


def test_served_tau_is_the_replay_and_eaglewires_own_block_decoding(served, trained, draft, smollm2_target):
    from eaglewire.core.tokens import stop_token_ids
    from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
    from eaglewire.doctor.verdicts import DoctorReport
    from eaglewire.doctor.served_tau.served_check import chain_length, replay_served, served_check

    _, counts, _, _, _, _ = served
    _, prompts = trained
    dflash, contract = draft
    ids = [p for p, _ in prompts]
    replayed = replay_served(smollm2_target, dflash, list(contract.aux_boundaries), ids, counts.outputs,
                             chain_length(counts, CHAIN))
    decoder = SpecDecoder(smollm2_target, dflash, contract, SpecConfig.chain(CHAIN))
    stop = set(stop_token_ids(smollm2_target.tokenizer, smollm2_target.model))
    own, lengths = [], []
    with torch.inference_mode():
        for p in ids:
            out, stats = decoder.generate(p, max_new_tokens=NEW_TOKENS, stop_token_ids=stop)
            own.append(out)
            lengths += stats.accept_lengths
    ours = sum(lengths) / len(lengths)
    print(f"DFlash, chain {CHAIN}: served τ {counts.tau:.3f} ({counts.drafts} steps, per position "
          f"{counts.accepted_per_pos}), replayed τ {replayed.tau:.3f} ({replayed.drafts} rounds, "
          f"{replayed.accepted_per_pos}), eaglewire's decoding τ {ours:.3f} ({len(lengths)} rounds)")
    assert own == counts.outputs  # lossless in both engines
    assert replayed.text_agreement >= 0.98
    assert counts.tau > 1.5, counts
    assert counts.tau == pytest.approx(replayed.tau, abs=0.1), (counts.accepted_per_pos, replayed.accepted_per_pos)
    assert counts.tau == pytest.approx(ours, abs=0.1)
    assert served_check(counts, replayed, DoctorReport(draft="dflash", target="smollm2-135m")).verdict == "ok"


def test_vllm_reads_the_export_as_a_dflash_block_of_the_trained_size(served):
    """The export's own SERVING.md line launches the trained block: num_speculative_tokens = block_size - 1."""
    files = served[0]
    text = (files.draft / "SERVING.md").read_text()
    spec = {"method": "dflash", "model": os.fspath(files.draft.resolve()), "num_speculative_tokens": CHAIN}
    assert f"--speculative-config '{json.dumps(spec)}'" in text


FOREIGN_SEED = 11  # another model's rows: the target's permuted, by a seed none of the doctor's stand-ins (0-2) uses


@pytest.fixture(scope="module")
def foreign(tmp_path_factory, vllm_installation, served, trained, draft, smollm2_target):
    """vLLM serving a copy of the export whose checkpoint also ships embed_tokens.weight of another model (the
    target's rows permuted), the doctor's served check against it with the user's export as --engine-config."""
    import shutil

    from safetensors.torch import load_file, save_file

    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire.doctor.measure import Sequence
    from eaglewire.doctor.verdicts import DoctorReport
    from eaglewire.doctor.served_tau.served_check import ServedSettings, check_served
    from eaglewire.engines.interface import ServedFiles
    from eaglewire.engines.vllm.server import RUNTIME

    files = served[0]
    draft_dir, prompts = trained
    dflash, contract = draft
    copy = tmp_path_factory.mktemp("vllm-dflash-foreign") / "another-embedding"
    shutil.copytree(files.draft, copy)
    [weights] = copy.glob("*.safetensors")
    tensors = load_file(weights)
    assert not any(k.endswith("embed_tokens.weight") for k in tensors)  # the export shares the target's
    rows = smollm2_target.embed_tokens.weight.detach().float().cpu()  # [V, H]
    tensors["embed_tokens.weight"] = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(
        FOREIGN_SEED))].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    ids = [p for p, _ in prompts]
    sequences = [Sequence(f"p{i}", torch.tensor(p + [0]), torch.arange(len(p) + 1) >= len(p))
                 for i, p in enumerate(ids)]
    settings = RunSettings(install=str(vllm_installation.python))
    with RUNTIME.serve(ServedFiles(target=files.target, draft=copy, family=files.family), Shape(n_max=CHAIN), settings,
                       log_path=copy / "vllm.log") as server:
        pgid = server._proc.pid
        report = DoctorReport(str(draft_dir), "smollm2-135m")
        config = DoctorConfig(draft=str(draft_dir), engine="vllm", engine_url=server.url, engine_prompts=len(ids),
                              engine_tokens=NEW_TOKENS, engine_config=str(files.draft / "config.json"))
        check_served(report, config.settings(ServedSettings), smollm2_target, dflash, list(contract.aux_boundaries), sequences, CHAIN)
    assert _group_gone(pgid), f"vLLM's processes (group {pgid}) outlived the server: see {copy / 'vllm.log'}"
    return files, copy, report


def test_a_served_copy_with_another_embedding_is_named_and_the_one_fix_is_to_serve_the_users_export(foreign):
    files, copy, report = foreign
    checks = {c.name: c for c in report.checks}
    assert report.served.get("tau") is not None, report.render()  # the server answered
    print(f"another embedding: served τ {report.served['tau']:.3f} vs replayed {report.served['replayed_tau']:.3f}")
    assert "Detected EAGLE model with distinct embed_tokens" in (copy / "vllm.log").read_text()  # vLLM read them
    assert report.served["tau"] < report.served["replayed_tau"] - 0.3, report.served
    check = checks["served wiring"]
    diagnosis = report.served["diagnosis"]
    print(check.summary, "\nfix:", check.fix, "\nprobes:", diagnosis["probes"])
    load = f"make the server load {files.draft / 'config.json'}"
    assert check.verdict == "fail" and "another embedding" in diagnosis["within_noise"], diagnosis
    if len(diagnosis["within_noise"]) == 1:
        assert diagnosis["match"]["label"] == "another embedding", diagnosis
        assert check.fix.startswith(load), check.fix
    else:  # on an Intel Xeon with AMX, fc's columns in another order accept alike on every probe of the pool:
        # the set is said, why the probes stopped, and serving the user's export is among its fixes
        assert diagnosis["probes"]["stopped"] in check.summary, check.summary
        assert load in check.fix and "embed_tokens" in check.fix, check.fix
