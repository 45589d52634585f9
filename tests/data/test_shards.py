"""Hidden-state shards: round trip, resume, contract checks, corruption, ranks."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglewire.core.contract import ContractError, HiddenStateContract, TargetFingerprint
from eaglewire.data.shards import (
    SHARD_FORMAT_VERSION, ShardDataset, ShardError, ShardWriter, shard_work)
from eaglewire.core.distributed import dist_rank_world

H, K, V = 16, 3, 100  # hidden size, aux boundaries, vocab
SOURCE = {"dataset": "fake", "max_length": 64, "regenerated": False}


def fingerprint(**changes) -> TargetFingerprint:
    fields = dict(architecture="LlamaForCausalLM", num_layers=8, hidden_size=H, vocab_size=V,
                  tokenizer_sha256="t", chat_template_sha256="c", weights_sha256="w", dtype="float32")
    return TargetFingerprint(**{**fields, **changes})


def contract(aux=(2, 4, 5), **changes) -> HiddenStateContract:
    return HiddenStateContract(aux_boundaries=tuple(aux), target=fingerprint(**changes))


def make_sequences(n: int, seed: int = 0) -> list[dict]:
    """n random sequences of lengths 1..40 with ids 'seq-0'..; hidden states in fp32."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(1, 41, (), generator=g))
        out.append({"seq_id": f"seq-{i}",
                    "input_ids": torch.randint(0, V, (t,), generator=g),
                    "loss_mask": torch.rand(t, generator=g) > 0.5,
                    "aux_hidden": torch.randn(t, K * H, generator=g) * 3,
                    "last_hidden": torch.randn(t, H, generator=g) * 3})
    return out


def write(out: Path, seqs: list[dict], *, dtype: str = "bf16", shard_tokens: int = 100,
          rank: int = 0, world_size: int = 1, c: HiddenStateContract | None = None, **storage) -> dict:
    with ShardWriter(out, c or contract(), source=SOURCE, dtype=dtype, shard_tokens=shard_tokens,
                     rank=rank, world_size=world_size, **storage) as w:
        for s in seqs:
            w.add(**s)
    return w.close()


def shard_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def by_id(ds: ShardDataset) -> dict[str, dict[str, torch.Tensor]]:
    return {sid: ds[i] for i, sid in enumerate(ds.sequence_ids)}


# ---------------------------------------------------------------- round trip

@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_round_trip_equals_input_after_dtype_rounding(tmp_path, dtype, torch_dtype):
    seqs = make_sequences(30)
    write(tmp_path, seqs, dtype=dtype)
    assert len(shard_files(tmp_path)) > 2  # several shards

    ds = ShardDataset(tmp_path, expect=contract())
    assert len(ds) == 30
    assert sorted(ds.sequence_ids) == sorted(s["seq_id"] for s in seqs)
    assert ds.num_tokens == sum(len(s["input_ids"]) for s in seqs)
    assert ds.contract == contract()
    got = by_id(ds)
    for s in seqs:
        item = got[s["seq_id"]]
        assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.bool
        assert item["aux_hidden"].dtype == torch_dtype == item["last_hidden"].dtype
        assert torch.equal(item["input_ids"], s["input_ids"])
        assert torch.equal(item["loss_mask"], s["loss_mask"])
        assert torch.equal(item["aux_hidden"], s["aux_hidden"].to(torch_dtype))
        assert torch.equal(item["last_hidden"], s["last_hidden"].to(torch_dtype))
    assert ds.lengths == [len(got[sid]["input_ids"]) for sid in ds.sequence_ids]
    assert torch.equal(ds[-1]["input_ids"], ds[len(ds) - 1]["input_ids"])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_memory_mapped_views_match_safetensors_reference(tmp_path):
    """Our own header parse reads the same tensors as safetensors' loader."""
    write(tmp_path, make_sequences(12))
    ds = ShardDataset(tmp_path)
    for j, entry in enumerate(ds.manifest["shards"]):
        ref = load_file(tmp_path / entry["file"])
        views = ds._shard(j)
        for name, tensor in ref.items():
            ours = torch.from_numpy(views[name].copy())
            if tensor.dtype == torch.bfloat16:
                ours = ours.view(torch.bfloat16)
            assert torch.equal(ours, tensor), name
        assert ds._shard(j) is views  # cached, not reopened


def test_manifest_totals_and_bytes_per_token(tmp_path):
    seqs = make_sequences(20)
    totals = write(tmp_path, seqs)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    files = shard_files(tmp_path)
    tokens = sum(len(s["input_ids"]) for s in seqs)
    size = sum(f.stat().st_size for f in files)
    assert totals == manifest["totals"]
    assert totals["sequences"] == 20 and totals["tokens"] == tokens
    assert totals["loss_tokens"] == sum(int(s["loss_mask"].sum()) for s in seqs)
    assert totals["bytes"] == size and totals["bytes_per_token"] == pytest.approx(size / tokens)
    # bf16: 2 bytes x (k+1) x H per token, plus 5 bytes of ids/mask and the header
    assert 2 * (K + 1) * H + 5 <= totals["bytes_per_token"] < 2 * (K + 1) * H + 5 + 50
    assert manifest["format_version"] == SHARD_FORMAT_VERSION and manifest["dtype"] == "bf16"
    assert manifest["source"] == SOURCE and manifest["contract"] == contract().to_dict()
    assert [e["file"] for e in manifest["shards"]] == [f.name for f in files]
    for entry in manifest["shards"]:
        data = (tmp_path / entry["file"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
        assert len(entry["sequence_ids"]) == entry["num_sequences"]
        assert entry["num_tokens"] >= 100 or entry is manifest["shards"][-1]  # shard_tokens


def test_duplicate_id_in_one_run_is_stored_once(tmp_path):
    seqs = make_sequences(5)
    write(tmp_path, seqs + seqs[:2])
    assert len(ShardDataset(tmp_path)) == 5


# ---------------------------------------------------------------- resume

def test_resume_after_interrupted_writer_stores_every_sequence_once(tmp_path):
    seqs = make_sequences(40)
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, contract(), source=SOURCE, shard_tokens=100) as w:
            for s in seqs[:25]:
                w.add(**s)
            raise RuntimeError("boom")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    written = {i for e in manifest["shards"] for i in e["sequence_ids"]}
    assert 0 < len(written) < 25  # the partial buffer was not flushed
    before = {f.name: f.read_bytes() for f in shard_files(tmp_path)}
    (tmp_path / "shard-00099.safetensors.tmp").write_bytes(b"half a shard")  # a crash's leftover

    w = ShardWriter(tmp_path, contract(), source=SOURCE, shard_tokens=100)
    assert w.done_ids == written
    assert not list(tmp_path.glob("*.tmp"))
    for s in seqs:  # the caller re-adds everything
        w.add(**s)
    w.close()

    ds = ShardDataset(tmp_path)
    assert sorted(ds.sequence_ids) == sorted(s["seq_id"] for s in seqs)
    assert len(set(ds.sequence_ids)) == len(ds) == 40
    for name, data in before.items():
        assert (tmp_path / name).read_bytes() == data
    got = by_id(ds)
    for s in seqs:
        assert torch.equal(got[s["seq_id"]]["last_hidden"], s["last_hidden"].to(torch.bfloat16))


def test_resume_removes_shard_no_manifest_records(tmp_path):
    seqs = make_sequences(10)
    write(tmp_path, seqs)
    (tmp_path / "shard-00042.safetensors").write_bytes(b"finished but never recorded")
    ShardWriter(tmp_path, contract(), source=SOURCE).close()
    assert not (tmp_path / "shard-00042.safetensors").exists()
    assert len(ShardDataset(tmp_path)) == 10


def test_resume_with_foreign_aux_boundaries_names_the_field(tmp_path):
    write(tmp_path, make_sequences(5))
    with pytest.raises(ContractError, match=r"aux boundaries \[2, 4, 5\].*\[2, 3, 5\]"):
        ShardWriter(tmp_path, contract(aux=(2, 3, 5)), source=SOURCE)


def test_resume_with_other_dtype_is_refused(tmp_path):
    write(tmp_path, make_sequences(5), dtype="bf16")
    with pytest.raises(ShardError, match="stored as bf16.*--dtype bf16"):
        ShardWriter(tmp_path, contract(), source=SOURCE, dtype="fp16")


def test_resume_with_other_target_dtype_is_refused(tmp_path):
    """The target's dtype is only a warning when serving, but one store holds one capture."""
    write(tmp_path, make_sequences(5))
    with pytest.raises(ContractError, match="dtype recorded 'float32' but 'bfloat16' now"):
        ShardWriter(tmp_path, contract(dtype="bfloat16"), source=SOURCE)


# ---------------------------------------------------------------- contract checks on read

def test_reader_with_foreign_weights_names_the_field(tmp_path):
    write(tmp_path, make_sequences(5))
    with pytest.raises(ContractError, match="weights_sha256 recorded 'w' but the target has 'other'"):
        ShardDataset(tmp_path, expect=contract(weights_sha256="other"))
    with pytest.raises(ContractError, match="weights_sha256"):
        ShardDataset(tmp_path, target=fingerprint(weights_sha256="other"))
    ds = ShardDataset(tmp_path, target=fingerprint(weights_sha256="other"), allow={"weights_sha256"})
    assert len(ds) == 5


def test_reader_with_foreign_aux_boundaries_names_the_field(tmp_path):
    write(tmp_path, make_sequences(5))
    with pytest.raises(ContractError, match="aux boundaries"):
        ShardDataset(tmp_path, expect=contract(aux=(1, 4, 7)))


def test_shard_copied_in_from_a_foreign_store_is_caught(tmp_path):
    """Without sha verification, the contract in a shard's own header still catches a swap."""
    write(tmp_path / "a", make_sequences(5), shard_tokens=10**6)
    write(tmp_path / "b", make_sequences(5), shard_tokens=10**6, c=contract(weights_sha256="x"))
    (tmp_path / "a" / "shard-00000.safetensors").write_bytes(
        (tmp_path / "b" / "shard-00000.safetensors").read_bytes())
    ds = ShardDataset(tmp_path / "a", verify=False)
    with pytest.raises(ContractError, match="weights_sha256"):
        ds[0]


# ---------------------------------------------------------------- damaged stores

def test_corrupted_shard_names_the_file(tmp_path):
    write(tmp_path, make_sequences(30))
    victim = shard_files(tmp_path)[1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # flip a byte of hidden-state data
    victim.write_bytes(bytes(data))

    ds = ShardDataset(tmp_path)  # the hash is checked lazily
    first = ds.manifest["shards"][0]["num_sequences"]
    ds[0]  # an intact shard reads fine
    with pytest.raises(ShardError, match=rf"{victim.name} is corrupted.*Delete .*re-run `eaglewire prepare` "
                                         "with the same --out"):
        ds[first]
    ShardDataset(tmp_path, verify=False)[first]  # reads the damaged bytes without checking


def test_truncated_shard_names_the_file(tmp_path):
    write(tmp_path, make_sequences(30))
    victim = shard_files(tmp_path)[0]
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(ShardError, match=rf"{victim.name} has \d+ bytes but the manifest records"):
        ShardDataset(tmp_path)


def test_missing_shard_then_resume_recreates_it(tmp_path):
    seqs = make_sequences(30)
    write(tmp_path, seqs)
    victim = shard_files(tmp_path)[1]
    victim.unlink()
    with pytest.raises(ShardError, match=rf"{victim.name} is listed in the manifest but missing.*"
                                         "same --out"):
        ShardDataset(tmp_path)

    write(tmp_path, seqs)  # the resume drops the entry and redoes its sequences
    ds = ShardDataset(tmp_path)
    assert sorted(ds.sequence_ids) == sorted(s["seq_id"] for s in seqs)
    assert len(ds) == 30


def test_missing_or_empty_store_says_to_run_prepare(tmp_path):
    with pytest.raises(ShardError, match="eaglewire prepare"):
        ShardDataset(tmp_path / "nowhere")
    with pytest.raises(ShardError, match="no manifest.json.*eaglewire prepare"):
        ShardDataset(tmp_path)
    ShardWriter(tmp_path, contract(), source=SOURCE).close()
    with pytest.raises(ShardError, match="no shards"):
        ShardDataset(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ShardError, match="manifest.json is not an eaglewire shard manifest"):
        ShardDataset(tmp_path)


# ---------------------------------------------------------------- input validation

@pytest.mark.parametrize("name, shape, expected", [
    ("input_ids", (1, 5), "[T]"),
    ("loss_mask", (4,), "[5]"),
    ("aux_hidden", (5, 2 * H), f"[5, {K * H}]"),
    ("aux_hidden", (1, 5, K * H), f"[5, {K * H}]"),
    ("last_hidden", (5, H + 1), f"[5, {H}]"),
])
def test_wrong_shape_names_tensor_shape_and_expected(tmp_path, name, shape, expected):
    seq = {"seq_id": "s", "input_ids": torch.randint(0, V, (5,)), "loss_mask": torch.ones(5, dtype=torch.bool),
           "aux_hidden": torch.randn(5, K * H), "last_hidden": torch.randn(5, H)}
    seq[name] = torch.zeros(shape, dtype=seq[name].dtype)
    w = ShardWriter(tmp_path, contract(), source=SOURCE)
    message = re.escape(f"{name} of sequence 's' has shape {list(shape)}; expected {expected}")
    with pytest.raises(ValueError, match=message):
        w.add(**seq)
    assert not w._buffer


def test_token_ids_outside_vocab_are_refused(tmp_path):
    seq = make_sequences(1)[0]
    seq["input_ids"] = seq["input_ids"].clone()
    seq["input_ids"][0] = V
    with pytest.raises(ValueError, match=rf"token ids must be integers in \[0, {V}\)"):
        ShardWriter(tmp_path, contract(), source=SOURCE).add(**seq)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_hidden_states_name_the_sequence(tmp_path, bad):
    seq = make_sequences(1)[0]
    seq["aux_hidden"][0, 3] = bad
    w = ShardWriter(tmp_path, contract(), source=SOURCE)
    with pytest.raises(ShardError, match="sequence 'seq-0': aux_hidden holds 1 NaN/inf"):
        w.add(**seq)


def test_fp16_overflow_is_refused(tmp_path):
    seq = make_sequences(1)[0]
    seq["last_hidden"][0, 0] = 1e6  # finite in fp32, inf in fp16
    with pytest.raises(ShardError, match="beyond the fp16 range"):
        ShardWriter(tmp_path, contract(), source=SOURCE, dtype="fp16").add(**seq)


# ---------------------------------------------------------------- ranks

def test_two_ranks_write_one_store_that_one_reader_sees_whole(tmp_path):
    seqs = make_sequences(25)
    for rank in range(2):
        write(tmp_path, shard_work(seqs, rank, 2), rank=rank, world_size=2, shard_tokens=80)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"manifest.rank0-of-2.json", "manifest.rank1-of-2.json"} <= names
    assert "manifest.json" not in names
    assert any(n.startswith("shard-r0-") for n in names) and any(n.startswith("shard-r1-") for n in names)

    ds = ShardDataset(tmp_path, expect=contract())
    assert sorted(ds.sequence_ids) == sorted(s["seq_id"] for s in seqs)
    assert ds.manifest["totals"]["sequences"] == 25
    got = by_id(ds)
    assert all(torch.equal(got[s["seq_id"]]["input_ids"], s["input_ids"]) for s in seqs)


def test_rank_parts_with_different_contracts_are_refused(tmp_path):
    seqs = make_sequences(10)
    write(tmp_path, shard_work(seqs, 0, 2), rank=0, world_size=2)
    foreign = contract(tokenizer_sha256="t2")
    with pytest.raises(ContractError, match="tokenizer_sha256 recorded 't' but the target has 't2'"):
        ShardWriter(tmp_path, foreign, source=SOURCE, rank=1, world_size=2)  # the writer checks every part
    write(tmp_path / "elsewhere", shard_work(seqs, 1, 2), rank=1, world_size=2, c=foreign)
    for f in (tmp_path / "elsewhere").iterdir():
        f.rename(tmp_path / f.name)
    with pytest.raises(ContractError, match="manifest.rank1-of-2.json.*tokenizer_sha256 recorded 't2'"):
        ShardDataset(tmp_path)


def test_shard_work_and_dist_rank_world(monkeypatch):
    items = list(range(10))
    parts = [shard_work(items, r, 3) for r in range(3)]
    assert sorted(x for p in parts for x in p) == items and parts[1] == [1, 4, 7]
    with pytest.raises(ValueError, match="rank 3 of world_size 3"):
        shard_work(items, 3, 3)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist_rank_world() == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dist_rank_world() == (1, 4)
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="WORLD_SIZE='x'"):
        dist_rank_world()


def test_dataset_pickles_for_dataloader_workers(tmp_path):
    write(tmp_path, make_sequences(8))
    ds = ShardDataset(tmp_path)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._open == {}
    assert torch.equal(clone[3]["aux_hidden"], ds[3]["aux_hidden"])
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert [item["input_ids"].shape[0] for item in loader] == ds.lengths


def test_resume_with_another_source_is_refused(tmp_path):
    write(tmp_path, make_sequences(3))
    with pytest.raises(ShardError, match=r"max_length: recorded 64, now 16.*--overwrite"):
        ShardWriter(tmp_path, contract(), source={**SOURCE, "max_length": 16})
    assert json.loads((tmp_path / "manifest.json").read_text())["source"] == SOURCE


def test_status_is_recorded_and_read_back(tmp_path):
    from eaglewire.data.shards import incomplete_reason

    with ShardWriter(tmp_path, contract(), source=SOURCE, shard_tokens=1) as w:
        w.set_status(complete=False, conversations=5)
        for s in make_sequences(2):
            w.add(**s)
    reason = incomplete_reason(ShardDataset(tmp_path).manifest)
    assert reason is not None and "2 sequences from the 5 conversations" in reason
    ShardWriter(tmp_path, contract(), source=SOURCE).set_status(complete=True)
    assert incomplete_reason(ShardDataset(tmp_path).manifest) is None
    write(tmp_path / "plain", make_sequences(2))  # no status (another writer): taken as complete
    assert incomplete_reason(ShardDataset(tmp_path / "plain").manifest) is None


# ---------------------------------------------------------------- compact states: fp8 aux, top-K labels

TOPK = 5
HEAD = torch.nn.Linear(H, V, bias=False)  # a stand-in for the target head: [n, H] -> [n, V]


def compact(**kw) -> dict:
    return dict(state_dtype="fp8", labels=f"topk:{TOPK}", labels_head=HEAD, **kw)


def test_fp8_aux_and_topk_labels_read_back(tmp_path):
    seqs = make_sequences(30)
    seqs[0]["loss_mask"][:] = True  # the first token under the mask labels nothing (no token before it)
    write(tmp_path, seqs, **compact())
    assert len(shard_files(tmp_path)) > 2
    ds = ShardDataset(tmp_path, expect=contract())
    assert (ds.state_dtype, ds.labels_mode, ds.storage.topk) == ("fp8", "topk", TOPK)
    got = by_id(ds)
    for s in seqs:
        item = got[s["seq_id"]]
        assert "last_hidden" not in item and item["aux_hidden"].dtype == torch.bfloat16
        T = len(s["input_ids"])
        amax = s["aux_hidden"].reshape(T, K, H).abs().amax(-1, keepdim=True)  # [T, K, 1]
        err = (item["aux_hidden"].float() - s["aux_hidden"]).reshape(T, K, H).abs()
        # e4m3 rounding (2^-4 of amax, see test_state_codec) plus the bf16 read-back (2^-9 of the value)
        assert (err <= (2 ** -4 + 2 ** -9) * amax).all()
        rows = torch.zeros(T, dtype=torch.bool)
        rows[:-1] = s["loss_mask"][1:]
        with torch.no_grad():
            want = torch.log_softmax(HEAD(s["last_hidden"][rows]), -1).topk(TOPK, -1)
        assert item["topk_ids"].shape == item["topk_logprobs"].shape == (T, TOPK)
        assert torch.equal(item["topk_ids"][rows], want.indices)
        assert torch.equal(item["topk_logprobs"][rows], want.values.half().float())  # stored in fp16
        assert not item["topk_ids"][~rows].any() and not item["topk_logprobs"][~rows].any()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["state_dtype"], manifest["labels"], manifest["dtype"]) == ("fp8", f"topk:{TOPK}", "bf16")
    assert sum(e["num_label_rows"] for e in manifest["shards"]) == sum(int(s["loss_mask"][1:].sum()) for s in seqs)
    tensors = load_file(shard_files(tmp_path)[0])
    assert set(tensors) == {"input_ids", "loss_mask", "offsets", "aux_hidden", "aux_scale", "topk_logprobs",
                            "topk_ids"}
    assert tensors["topk_ids"].dtype == torch.uint16  # V = 100 fits two bytes


def test_compact_bytes_per_token(tmp_path):
    """fp8 aux (1 byte + 4 bytes of scale per boundary) and K labels of 2 + 2 bytes at labelled positions."""
    seqs = make_sequences(20)
    totals = write(tmp_path, seqs, shard_tokens=10_000, **compact())
    tokens = sum(len(s["input_ids"]) for s in seqs)
    labelled = sum(int(s["loss_mask"][1:].sum()) for s in seqs)
    payload = tokens * (5 + K * H + 4 * K) + labelled * TOPK * 4 + 8 * (len(seqs) + 1)
    assert payload < totals["bytes"] < payload + 1000  # the rest is the safetensors header
    assert ShardDataset(tmp_path).storage.token_bytes(contract()) == 5 + K * H + 4 * K + TOPK * 4


def test_fp8_aux_with_hidden_labels_keeps_the_last_state(tmp_path):
    seqs = make_sequences(6)
    write(tmp_path, seqs, state_dtype="fp8")
    ds = ShardDataset(tmp_path)
    assert (ds.state_dtype, ds.labels_mode) == ("fp8", "hidden")
    for s, (sid, item) in zip(seqs, sorted(by_id(ds).items(), key=lambda kv: int(kv[0].split("-")[1]))):
        assert torch.equal(item["last_hidden"], s["last_hidden"].to(torch.bfloat16))


def test_manifest_without_storage_keys_reads_as_hidden_labels(tmp_path):
    """Shards written before --state-dtype / --labels existed."""
    write(tmp_path, make_sequences(5))
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["state_dtype"], manifest["labels"]
    path.write_text(json.dumps(manifest))
    ds = ShardDataset(tmp_path)
    assert (ds.state_dtype, ds.labels_mode) == ("bf16", "hidden") and "last_hidden" in ds[0]


@pytest.mark.parametrize("first, then, message", [
    (dict(), compact(), r"stored as bf16 but bf16, aux fp8, labels topk:5 is asked; pass --state-dtype bf16 "
                        r"--labels hidden"),
    (compact(), dict(state_dtype="fp8"), "pass --labels topk:5"),
])
def test_resume_with_other_storage_is_refused(tmp_path, first, then, message):
    write(tmp_path, make_sequences(5), **first)
    with pytest.raises(ShardError, match=message):
        ShardWriter(tmp_path, contract(), source=SOURCE, **then)


def test_topk_labels_need_the_head_and_a_valid_k(tmp_path):
    with pytest.raises(ValueError, match="needs the target's head"):
        ShardWriter(tmp_path, contract(), source=SOURCE, labels="topk:4")
    with pytest.raises(ValueError, match=f"exceeds the target vocabulary \\({V}\\)"):
        ShardWriter(tmp_path, contract(), source=SOURCE, labels=f"topk:{V + 1}", labels_head=HEAD)
    with pytest.raises(ValueError, match="--state-dtype bf16 or fp8"):
        ShardWriter(tmp_path, contract(), source=SOURCE, state_dtype="fp16")


def test_label_rows_that_disagree_with_the_loss_mask_are_caught(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    write(tmp_path, make_sequences(5), shard_tokens=10_000, **compact())
    path = shard_files(tmp_path)[0]
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    tensors["loss_mask"][1:] = 1 - tensors["loss_mask"][1:]  # same shapes and size, other labelled positions
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ShardError, match="loss mask labels .* positions but the manifest records .* label rows"):
        ShardDataset(tmp_path, verify=False)[0]
