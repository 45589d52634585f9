"""import-data: eaglewire shards -> each foreign layout -> import-data is the identity; bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglewire.cli import main
from eaglewire.core.contract import HiddenStateContract
from eaglewire.data.foreign import ForeignDataError
from eaglewire.data.import_data import ImportDataConfig, import_data
from eaglewire.data.shards import ShardDataset, ShardWriter
from eaglewire.model.target import load_target
from eaglewire.model.target_head import load_target_head
from tiny import save_tiny_dir

L, H, AUX = 8, 64, (2, 4, 5)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_dir(tmp_path_factory.mktemp("target"), num_layers=L, hidden_size=H)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(str(target_dir), device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def shards(tmp_path_factory, target) -> Path:
    """Six eaglewire sequences on boundaries AUX with their boundary-L state."""
    out = tmp_path_factory.mktemp("shards")
    contract = HiddenStateContract(aux_boundaries=AUX, target=target.fingerprint)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(out, contract, source={"test": True}, shard_tokens=40) as w:
        for i in range(6):
            t = 5 + 3 * i
            w.add(f"seq-{i}", torch.randint(0, 256, (t,), generator=g), torch.rand(t, generator=g) > 0.3,
                  torch.randn(t, len(AUX) * H, generator=g), torch.randn(t, H, generator=g) * 4)
    return out


def stored_states(item: dict) -> torch.Tensor:
    """[T, k+1, H]: the aux states then boundary L, as vLLM / speculators store them."""
    aux = item["aux_hidden"].reshape(item["aux_hidden"].shape[0], len(AUX), H)  # [T, k, H]
    return torch.cat([aux, item["last_hidden"][:, None]], dim=1)  # [T, k+1, H]


def write_vllm(ds: ShardDataset, src: Path) -> Path:
    """One safetensors file per request: hidden_states [T, n, H], token_ids [T] (the example connector)."""
    src.mkdir()
    for seq_id, item in zip(ds.sequence_ids, ds):
        save_file({"hidden_states": stored_states(item), "token_ids": item["input_ids"]},
                  str(src / f"{seq_id}.safetensors"))
    return src


def write_rows(ds: ShardDataset, path: Path) -> Path:
    with open(path, "w") as f:
        for seq_id, item in zip(ds.sequence_ids, ds):
            f.write(json.dumps({"id": seq_id, "input_ids": item["input_ids"].tolist(),
                                "loss_mask": item["loss_mask"].int().tolist()}) + "\n")
    return path


def write_speculators(ds: ShardDataset, src: Path) -> tuple[Path, Path]:
    """hs_{i}.safetensors with hidden_states [T, k+1, H] (verifier's last state last) + the rows."""
    src.mkdir()
    for i, item in enumerate(ds):
        save_file({"hidden_states": stored_states(item)}, str(src / f"hs_{i}.safetensors"))
    return src, write_rows(ds, src.parent / f"{src.name}-rows.jsonl")


def write_specforge(ds: ShardDataset, src: Path, target) -> Path:
    """torch.save dicts per sample: input_ids, loss_mask, post-norm hidden_state, aux_hidden_state [T, k*H]."""
    (src / "rows_0-6").mkdir(parents=True)
    for i, item in enumerate(ds):
        post = target.decoder.norm(item["last_hidden"].float())  # [T, H] after the final norm
        torch.save({"input_ids": item["input_ids"][None], "loss_mask": item["loss_mask"].long()[None],
                    "hidden_state": post[None], "aux_hidden_state": item["aux_hidden"][None]},
                   src / "rows_0-6" / f"data_{i}.ckpt")
    return src


def run_import(layout: str, src: Path, out: Path, target_dir: Path, **kw):
    kw.setdefault("skip_label_check", True)  # a random tiny target models no text: tests/data/test_label_check.py
    return import_data(ImportDataConfig(src=str(src), layout=layout, out=str(out), target=str(target_dir), **kw))


def same_counts(a: ShardDataset, b: ShardDataset, keys=("sequences", "tokens", "loss_tokens")) -> None:
    for key in keys:
        assert a.manifest["totals"][key] == b.manifest["totals"][key], key


@pytest.mark.parametrize("layout", ["vllm", "speculators"])
def test_round_trip_is_the_identity(layout, shards, target_dir, tmp_path):
    ds = ShardDataset(shards)
    if layout == "vllm":
        src, kw = write_vllm(ds, tmp_path / "src"), {}
    else:
        src, rows = write_speculators(ds, tmp_path / "src")
        kw = {"tokens": str(rows)}
    summary = run_import(layout, src, tmp_path / "out", target_dir, boundaries=[*AUX, L], **kw)
    back = ShardDataset(tmp_path / "out")
    assert back.contract == ds.contract == summary.contract
    same_counts(ds, back, ("sequences", "tokens") + (("loss_tokens",) if layout == "speculators" else ()))
    for a, b in zip(ds, back):
        for name in ("input_ids", "aux_hidden", "last_hidden"):
            assert torch.equal(a[name], b[name]), name
        expect_mask = a["loss_mask"] if layout == "speculators" else torch.ones_like(a["loss_mask"])
        assert torch.equal(b["loss_mask"], expect_mask)  # vLLM records no loss mask
    assert not (tmp_path / "out.partial").exists()


def test_vllm_rows_check_token_ids_and_add_the_loss_mask(shards, target_dir, tmp_path):
    ds = ShardDataset(shards)
    src, rows = write_vllm(ds, tmp_path / "src"), write_rows(ds, tmp_path / "rows.jsonl")
    lines = rows.read_text().splitlines()
    bad = json.loads(lines[1])
    bad["input_ids"][0] = (bad["input_ids"][0] + 1) % 256
    rows.write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n")
    summary = run_import("vllm", src, tmp_path / "out", target_dir, boundaries=[*AUX, L], tokens=str(rows))
    assert summary.skipped == {"token ids differ from the rows' input_ids": 1}
    back = ShardDataset(tmp_path / "out")
    assert back.manifest["source"]["skipped"] == summary.skipped
    for seq_id, b in zip(back.sequence_ids, back):
        assert torch.equal(b["loss_mask"], ds[ds.sequence_ids.index(seq_id)]["loss_mask"])


def test_specforge_post_norm_state_gives_the_same_head(shards, target_dir, target, tmp_path):
    ds = ShardDataset(shards)
    src = write_specforge(ds, tmp_path / "src", target)
    # SpecForge ids [1, 3, 4] are outputs of layers 1, 3, 4: boundaries AUX
    run_import("specforge", src, tmp_path / "out", target_dir, boundaries=list(AUX))
    back = ShardDataset(tmp_path / "out")
    assert back.contract == ds.contract
    same_counts(ds, back)
    assert "post-norm" in back.manifest["source"]["last_hidden"]
    for a, b in zip(ds, back):
        assert torch.equal(a["aux_hidden"], b["aux_hidden"])
        want, got = target.head(a["last_hidden"].float()), target.head(b["last_hidden"].float())
        assert torch.allclose(got, want, atol=0.02 * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_head_only_target_matches_a_full_load(target_dir, target):
    head = load_target_head(str(target_dir))
    assert head.fingerprint == target.fingerprint
    x = torch.randn(4, H)
    assert torch.equal(head.head(x), target.head(x))
    read = [n for n, p in head.layers.named_parameters() if not p.is_meta]
    assert len(read) == 1  # of the layers only the one tensor the fingerprint hashes was read


def test_missing_boundaries_is_a_question(shards, target_dir, tmp_path):
    src = write_vllm(ShardDataset(shards), tmp_path / "src")
    with pytest.raises(ForeignDataError, match=r"4 states stored per token, their layers not recorded: pass --boundaries"):
        run_import("vllm", src, tmp_path / "out", target_dir)
    with pytest.raises(ForeignDataError, match=r"none is boundary 8"):
        run_import("vllm", src, tmp_path / "out", target_dir, boundaries=[1, 2, 4, 5])
    with pytest.raises(ForeignDataError, match=r"names 3 states but sample .* stores 4"):
        run_import("vllm", src, tmp_path / "out", target_dir, boundaries=[2, 4, 8])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_bad_files_are_counted_skips(shards, target_dir, tmp_path):
    ds = ShardDataset(shards)
    src = write_vllm(ds, tmp_path / "src")
    truncated = src / f"{ds.sequence_ids[0]}.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    nan = ds[1]
    states = stored_states(nan)
    states[2, 1, 5] = float("nan")
    save_file({"hidden_states": states, "token_ids": nan["input_ids"]}, str(src / f"{ds.sequence_ids[1]}.safetensors"))
    summary = run_import("vllm", src, tmp_path / "out", target_dir, boundaries=[*AUX, L])
    assert summary.skipped == {"unreadable file": 1, "non-finite states": 1}
    back = ShardDataset(tmp_path / "out")
    assert back.manifest["source"]["skipped"] == summary.skipped
    assert back.sequence_ids == ds.sequence_ids[2:]


def test_nothing_readable_leaves_nothing_behind(target_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "r0.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # truncated header
    with pytest.raises(ForeignDataError, match="nothing imported .* 1 unreadable file"):
        run_import("vllm", src, tmp_path / "out", target_dir, boundaries=[*AUX, L])
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_unknown_or_wrong_layout_is_one_line(shards, target_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--from 'eagle' is not a known layout"):
        ImportDataConfig(src=".", layout="eagle", out="o", target="t")
    src = write_vllm(ShardDataset(shards), tmp_path / "src")
    code = main(["import-data", "--from", "speculators", str(src), "--out", str(tmp_path / "out"),
                 "--target", str(target_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: --from speculators:") and "hs_<i>.safetensors" in err[-1]


def test_cli_imports(shards, target_dir, tmp_path, capsys):
    src = write_vllm(ShardDataset(shards), tmp_path / "src")
    code = main(["import-data", "--from", "vllm", str(src), "--out", str(tmp_path / "out"),
                 "--target", str(target_dir), "--boundaries", "2,4,5,8", "--skip-label-check"])
    assert code == 0 and "sequences" in capsys.readouterr().out
    assert len(ShardDataset(tmp_path / "out")) == 6


def test_config_only_target_records_what_it_knows(shards, target_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((target_dir / "config.json").read_text())
    src = write_vllm(ShardDataset(shards), tmp_path / "src")
    summary = run_import("vllm", src, tmp_path / "out", config_only, boundaries=[*AUX, L])
    fp = ShardDataset(tmp_path / "out").contract.target
    assert (fp.num_layers, fp.hidden_size, fp.weights_sha256) == (L, H, "unknown")
    assert summary.unknown == ["weights_sha256", "tokenizer_sha256", "chat_template_sha256"]
    assert ShardDataset(tmp_path / "out").manifest["source"]["fingerprint_unknown"] == summary.unknown
    assert "--allow-target-mismatch weights_sha256" in summary.notes[0]


def test_train_on_imported_data_with_the_head_only(shards, target_dir, tmp_path):
    """Training on imported shards reads only the head; it trains exactly as with the full target."""
    from eaglewire.train.loop import train
    from eaglewire.train.train_config import TrainConfig

    src = write_vllm(ShardDataset(shards), tmp_path / "src")
    run_import("vllm", src, tmp_path / "data", target_dir, boundaries=[*AUX, L])
    results = []
    for head_only in (True, False):
        cfg = TrainConfig(out=str(tmp_path / f"draft-{head_only}"), target=str(target_dir), data=str(tmp_path / "data"),
                          head_only=head_only, max_steps=3, batch_tokens=64, val_sequences=1, draft_vocab_size=64,
                          eval_interval=3, save_interval=3, log_interval=1, ttt_steps=2, device="cpu",
                          skip_label_check=True)
        results.append(train(cfg, progress=False))
    assert results[0].final_eval == results[1].final_eval
    with pytest.raises(ValueError, match="--head-only trains on stored states"):
        TrainConfig(out="o", online_data="x", head_only=True)


def test_a_capture_without_boundary_L_is_for_token_labels_only(shards, target_dir, tmp_path):
    from eaglewire.data.import_data import ABSENT_LAST
    from eaglewire.doctor import DoctorConfig, run_doctor
    from eaglewire.train.loop import TrainingError, train
    from eaglewire.train.train_config import TrainConfig

    ds = ShardDataset(shards)
    src = tmp_path / "src"
    src.mkdir()
    for seq_id, item in zip(ds.sequence_ids, ds):  # the aux states only, as the seeds' [0, 3, 31, 59]
        save_file({"hidden_states": stored_states(item)[:, :len(AUX)].contiguous(), "token_ids": item["input_ids"]},
                  str(src / f"{seq_id}.safetensors"))
    with pytest.raises(ForeignDataError, match="none is boundary 8 .* or pass --no-last"):
        run_import("vllm", src, tmp_path / "out", target_dir, boundaries=list(AUX))
    summary = run_import("vllm", src, tmp_path / "out", target_dir, boundaries=list(AUX), no_last=True)
    back = ShardDataset(tmp_path / "out")
    assert back.manifest["source"]["last_hidden"] == ABSENT_LAST and "--labels tokens" in summary.notes[-1]
    for a, b in zip(ds, back):
        assert torch.equal(a["aux_hidden"], b["aux_hidden"]) and not b["last_hidden"].any()
    with pytest.raises(TrainingError, match="holds no boundary-L state"):
        train(TrainConfig(out=str(tmp_path / "d"), target=str(target_dir), data=str(tmp_path / "out"), head_only=True,
                          device="cpu"), progress=False)
    with pytest.raises(ValueError, match="pass --labels tokens"):
        run_doctor(DoctorConfig(draft="unused", target=str(target_dir), data=str(tmp_path / "out"), stored=True))
    from eaglewire.model.checkpoint import save_draft
    from eaglewire.model.draft import DraftConfig, Eagle3Draft

    target = load_target_head(str(target_dir))
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(AUX), draft_vocab_size=256,
                                                vocab_size=256))
    save_draft(tmp_path / "draft", draft, back.contract)
    report = run_doctor(DoctorConfig(draft=str(tmp_path / "draft"), target=str(target_dir), data=str(tmp_path / "out"),
                                     stored=True, labels="tokens", include_training=True))
    assert report.facts["judged tokens"] > 0 and "acc@0" in report.accuracy


def test_import_writes_fp8_states_and_topk_labels(shards, target_dir, target, tmp_path):
    """--state-dtype fp8 --labels topk:K: the aux states within e4m3 rounding, the head's top-K at labelled positions."""
    from eaglewire.data.state_codec import label_positions

    ds = ShardDataset(shards)
    src, rows = write_speculators(ds, tmp_path / "src")
    run_import("speculators", src, tmp_path / "out", target_dir, boundaries=[*AUX, L], tokens=str(rows),
               state_dtype="fp8", labels="topk:4")
    back = ShardDataset(tmp_path / "out")
    assert (back.state_dtype, back.labels_mode, back.storage.topk) == ("fp8", "topk", 4)
    for a, b in zip(ds, back):
        T, aux = a["aux_hidden"].shape[0], a["aux_hidden"].float()
        amax = aux.reshape(T, len(AUX), H).abs().amax(-1, keepdim=True)  # [T, k, 1]
        err = (b["aux_hidden"].float() - aux).reshape(T, len(AUX), H).abs()
        assert (err <= (2 ** -4 + 2 ** -9) * amax).all()  # e4m3 rounding + the bf16 read-back
        where = label_positions(a["loss_mask"])
        with torch.no_grad():
            top = torch.log_softmax(target.head(a["last_hidden"].float()[where]), -1).topk(4, -1)
        assert torch.equal(b["topk_ids"][where], top.indices) and "last_hidden" not in b
        assert torch.allclose(b["topk_logprobs"][where], top.values, atol=1e-2)  # fp16 of values down to ~-10
    with pytest.raises(ValueError, match="--labels topk:4 .* --no-last"):
        ImportDataConfig(src="s", layout="vllm", out="o", target="t", labels="topk:4", no_last=True)
    with pytest.raises(ValueError, match="--state-dtype"):
        ImportDataConfig(src="s", layout="vllm", out="o", target="t", state_dtype="fp4")


def test_topk_labels_need_the_targets_weights(shards, target_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((target_dir / "config.json").read_text())
    src = write_vllm(ShardDataset(shards), tmp_path / "src")
    with pytest.raises(ForeignDataError, match="--labels topk:4 .* must hold the weights"):
        run_import("vllm", src, tmp_path / "out", config_only, boundaries=[*AUX, L], labels="topk:4")
