"""The capture path of `prepare` (issue 52): packed batches encoded where they are computed, shard files from
chunks, the writer thread; each against the one-sequence-at-a-time path it replaces, byte for byte."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file as safetensors_save_file

from eaglewire.data.capture_writer import WriterThread, to_host
from eaglewire.data.conversations import TokenizedConversation
from eaglewire.data.prepare import PrepareConfig, capture_batch, capture_plan, prepare
from eaglewire.data.shard_file import save_file
from eaglewire.data.shards import ShardError, ShardWriter
from eaglewire.data.state_codec import Storage, encode_states, label_positions
from eaglewire.model.boundary_capture import capture, capture_packed
from fake_cuda import fake_cuda
from test_shards import K, SOURCE, V, contract, make_sequences, shard_files
from tiny import tiny_target


def files_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in shard_files(d)}


def encoded(storage: Storage, seqs: list[dict], head=None):
    """``seqs`` (make_sequences) packed and encoded as capture_batch does: (ids, lengths, input_ids, loss_mask,
    stored, checks, label_rows)."""
    lengths = [len(s["input_ids"]) for s in seqs]
    aux = torch.cat([s["aux_hidden"] for s in seqs])  # [N, kH]
    last = torch.cat([s["last_hidden"] for s in seqs])  # [N, H]
    mask = torch.cat([s["loss_mask"] for s in seqs]).to(torch.uint8)  # [N]
    rows = None
    if storage.labels_mode == "topk":
        starts = torch.tensor([0, *lengths]).cumsum(0)
        rows = [label_positions(s["loss_mask"]).nonzero()[:, 0] + int(a) for s, a in zip(seqs, starts)]
    stored, checks = encode_states(storage, aux, last, K, label_rows=rows, head=head)
    return ([s["seq_id"] for s in seqs], lengths, torch.cat([s["input_ids"] for s in seqs]).to(torch.int32), mask,
            stored, checks, None if rows is None else [len(r) for r in rows])


# ---------------------------------------------------------------- shard files

def test_shard_file_is_safetensors_bytes_from_chunks_hashed_as_written(tmp_path):
    g = torch.Generator().manual_seed(0)
    whole = {"aux_hidden": torch.randn(9, 6, generator=g).bfloat16(), "offsets": torch.arange(4),
             "loss_mask": torch.randint(0, 2, (9,), dtype=torch.uint8, generator=g),
             "input_ids": torch.randint(0, 50, (9,), dtype=torch.int32, generator=g),
             "aux_scale": torch.rand(9, 2, generator=g), "topk_ids": torch.zeros(0, 4, dtype=torch.uint16),
             "q": torch.randn(9, 3, generator=g).to(torch.float8_e4m3fn), "h": torch.randn(9, 2).half()}
    chunks = {k: [v[:4], v[4:]] if v.shape[0] == 9 else v for k, v in whole.items()}
    meta = {"contract": json.dumps({"é": "\n"})}  # one key: safetensors' own order is then fixed too
    safetensors_save_file(whole, tmp_path / "ref.safetensors", metadata=meta)
    digest = save_file(chunks, tmp_path / "ours.safetensors", metadata=meta)
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()
    assert digest == hashlib.sha256(ours).hexdigest()


def test_shard_file_metadata_is_written_in_one_order(tmp_path):
    t = {"x": torch.arange(3)}
    save_file(t, tmp_path / "a", metadata={"b": "1", "a": "2", "c": "3"})
    save_file(t, tmp_path / "b", metadata={"c": "3", "a": "2", "b": "1"})
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    with safe_open(tmp_path / "a", "pt") as f:
        assert f.metadata() == {"a": "2", "b": "1", "c": "3"} and f.get_tensor("x").equal(t["x"])


# ---------------------------------------------------------------- packed batches == one sequence at a time

STORAGES = [dict(dtype="bf16"), dict(dtype="fp16"), dict(dtype="bf16", state_dtype="fp8"),
            dict(dtype="bf16", labels="topk:4")]


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: "-".join(s.values()))
def test_encoded_batches_write_the_shards_of_one_add_at_a_time(tmp_path, storage):
    head = torch.nn.Linear(16, V)  # H = 16
    seqs = make_sequences(23)
    seqs[7]["seq_id"] = "seq-3"  # a duplicate id is skipped, as add skips it

    kw = dict(source=SOURCE, shard_tokens=100, labels_head=head, **storage)
    with torch.no_grad(), ShardWriter(tmp_path / "one", contract(), **kw) as w:
        for s in seqs:
            w.add(**s)
    with torch.no_grad(), ShardWriter(tmp_path / "packed", contract(), **kw) as w:
        for part in (seqs[:5], seqs[5:6], seqs[6:23]):  # batches cut across shards
            w.add_encoded(*encoded(w.storage, part, head))
    one, packed = files_bytes(tmp_path / "one"), files_bytes(tmp_path / "packed")
    assert len(one) > 3 and one == packed
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "packed")]
    assert manifests[0]["shards"] == manifests[1]["shards"]


@pytest.mark.parametrize("where, bad, message", [
    ("aux_hidden", float("nan"), "sequence 'seq-2': aux_hidden holds 1 NaN/inf"),
    ("last_hidden", float("inf"), "sequence 'seq-2': last_hidden holds 1 NaN/inf"),
    ("last_hidden", 1e6, "sequence 'seq-2': last_hidden reaches |x| = 1e+06, beyond the fp16 range"),
])
def test_an_encoded_batch_refuses_as_add_does_and_keeps_what_came_before(tmp_path, where, bad, message):
    seqs = make_sequences(4)
    seqs[2][where][0, 1] = bad
    with ShardWriter(tmp_path, contract(), source=SOURCE, dtype="fp16", shard_tokens=1) as w:
        with pytest.raises(ShardError, match=re.escape(message)):
            w.add_encoded(*encoded(w.storage, seqs))
    assert sorted(w.done_ids) == ["seq-0", "seq-1"]


def test_token_ids_outside_the_vocabulary_are_refused_in_a_batch(tmp_path):
    seqs = make_sequences(3)
    seqs[1]["input_ids"][0] = V
    w = ShardWriter(tmp_path, contract(), source=SOURCE)
    with pytest.raises(ValueError, match=rf"input_ids of sequence 'seq-1' \(torch.int32, values .*\[0, {V}\)"):
        w.add_encoded(*encoded(w.storage, seqs))


# ---------------------------------------------------------------- capture on the device

def test_packed_capture_is_the_padded_capture_without_padding():
    target = tiny_target("llama")
    lengths = [7, 12, 3]
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    padded = capture(target, ids, [2, 5])
    packed = capture_packed(target, ids, lengths, [2, 5])
    assert packed.aux_hidden.shape == (sum(lengths), 2 * target.hidden_size)
    for name in ("aux_hidden", "last_hidden"):
        want = torch.cat([getattr(padded, name)[r, :n] for r, n in enumerate(lengths)])
        assert torch.equal(getattr(packed, name), want)
    with pytest.raises(ValueError, match="lengths"):
        capture_packed(target, ids, [13, 1, 1], [2, 5])


def test_capture_plan_sizes_batches_for_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert capture_plan(None, 1024, cpu) == (8192, 64)  # as before: the same shards on the CPU
    assert capture_plan(None, 1024, cuda) == (16384, 512)
    assert capture_plan(None, 20000, cuda)[0] == 20000  # one sequence fits
    assert capture_plan(2048, 1024, cuda)[0] == 2048  # the flag wins
    with pytest.raises(ValueError, match=r"batch_tokens \(100\) must be >= max_length"):
        PrepareConfig(out="o", batch_tokens=100, max_length=200)


def test_a_batch_staged_on_cuda_reaches_the_writer_from_host_memory(tmp_path, chat_tiny_target):
    seqs = [TokenizedConversation(id=f"c{i}", input_ids=list(range(5 + i, 15 + 3 * i)),
                                  loss_mask=[0] * 4 + [1] * (6 + 2 * i), num_assistant_turns=1,
                                  num_tokens_before_truncation=10 + 2 * i) for i in range(3)]
    c = chat_contract(chat_tiny_target)
    with ShardWriter(tmp_path / "cpu", c, source=SOURCE) as w:
        capture_batch(chat_tiny_target, c, seqs, w.storage).commit(w)
    target = copy.deepcopy(chat_tiny_target)
    with fake_cuda():
        target.model.to("cuda")
        with ShardWriter(tmp_path / "cuda", c, source=SOURCE) as w:
            staged = capture_batch(target, c, seqs, w.storage)
            assert staged.ready is not None  # the copies are queued, not waited for
            assert all(x.device.type == "cpu" for x in [*staged.stored.values(), staged.checks])
            staged.commit(w)
    assert files_bytes(tmp_path / "cpu") == files_bytes(tmp_path / "cuda")


def chat_contract(target):
    from eaglewire.core.contract import HiddenStateContract

    return HiddenStateContract(aux_boundaries=(1, 3, 5), target=target.fingerprint)


def test_to_host_on_the_cpu_hands_the_tensors_over():
    x = {"a": torch.arange(3)}
    host, ready = to_host(x)
    assert ready is None and host["a"] is x["a"]


# ---------------------------------------------------------------- the writer thread

def test_the_writer_thread_runs_jobs_in_order_and_raises_a_failure_in_the_caller():
    done = []
    with WriterThread(depth=1) as background:
        for i in range(5):
            background.submit(lambda i=i: done.append(i))
    assert done == list(range(5))

    def fail():
        raise OSError(28, "No space left on device")

    background = WriterThread(depth=1)
    background.submit(fail)
    background.submit(lambda: done.append("dropped"))  # after a failure nothing more is written
    with pytest.raises(OSError, match="No space left"):
        background.close()
    assert "dropped" not in done


def test_the_writer_thread_finishes_queued_work_when_the_run_stops():
    release, done = threading.Event(), []
    with pytest.raises(KeyboardInterrupt):
        with WriterThread(depth=2) as background:
            background.submit(release.wait)
            background.submit(lambda: done.append(1))
            release.set()
            raise KeyboardInterrupt
    assert done == [1]


def test_prepare_on_cuda_writes_the_cpu_shards(tmp_path, chat_tiny_target):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?" * (1 + i % 3)},
        {"role": "assistant", "content": f"It is {2 * i}." * (1 + i % 4)}]}) + "\n" for i in range(9)))
    kw = dict(data=str(data), max_length=64, batch_tokens=256, shard_tokens=64)
    prepare(PrepareConfig(out=str(tmp_path / "cpu"), **kw), target=chat_tiny_target, progress=False)
    target = copy.deepcopy(chat_tiny_target)
    with fake_cuda():
        target.model.to("cuda")
        prepare(PrepareConfig(out=str(tmp_path / "cuda"), device="cuda", **kw), target=target, progress=False)
    cpu, cuda = files_bytes(tmp_path / "cpu"), files_bytes(tmp_path / "cuda")
    assert len(cpu) > 2 and cpu == cuda
