"""Training on a GPU without waiting for it: the FLOP count and MFU, the prefetching reader, the sync-free
TTT step (the unroll's dense mode against its selecting one), the chunked soft cross-entropy, ``--compile`` and
its fallback; the GPU paths through the fake CUDA device."""

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import eaglewire.train.objectives as objectives_mod
from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.data.sources import Batch
from eaglewire.model.checkpoint import load_draft
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.model.ttt import TargetSignal, counted_per_step, soft_cross_entropy, ttt_loss
from eaglewire.train import compiled as compiled_mod
from eaglewire.train.flops import (DraftShape, attention_length, eagle3_forward_flops, eagle3_train_flops,
                                   peak_flops, utilisation)
from eaglewire.train.loop import Trainer, TrainingError, train
from eaglewire.train.train_config import TrainConfig
from eaglewire.train.prefetch import InStep, Prefetcher
from fake_cuda import fake_cuda

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


# ------------------------------------------------------------------ FLOPs and MFU

def test_flops_per_token_match_a_hand_count():
    s = DraftShape(hidden_size=8, target_hidden_size=6, num_aux=3, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=4, intermediate_size=16, draft_vocab_size=10)
    fc = 2 * (3 * 6) * 8  # 288
    q, k, v, o = 16 * 8, 16 * 4, 16 * 4, 8 * 8  # q/k/v read 2H = 16
    mlp = 3 * 8 * 16
    head = 8 * 10
    attention = 4 * 5 * 8  # T = 5, heads x head_dim = 8
    per_step = 2 * (q + k + v + o + mlp) + 2 * head + attention
    assert eagle3_forward_flops(s, ttt_steps=3, seq_len=5) == fc + 3 * per_step
    assert eagle3_train_flops(s, ttt_steps=3, seq_len=5) == 3 * (fc + 3 * per_step)


def test_draft_shape_reads_a_draft_config():
    cfg = DraftConfig(hidden_size=8, target_hidden_size=6, num_aux=3, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=4, intermediate_size=16, vocab_size=32, draft_vocab_size=10)
    assert DraftShape.of(cfg).draft_vocab_size == 10 and DraftShape.of(cfg).target_hidden_size == 6


def test_attention_length_weighs_each_token_by_its_sequence():
    assert attention_length([4, 4]) == 4
    assert attention_length([1, 3]) == (1 + 9) / 4
    assert attention_length([]) == 0


def test_peak_is_known_for_named_gpus_and_unknown_elsewhere():
    assert peak_flops("NVIDIA H200", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12  # not the SXM part's
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert peak_flops("cpu", "bf16") is None and peak_flops("Some Future GPU", "bf16") is None
    use = utilisation(1000, 2.0, 1e9, device_name="cpu", dtype="fp32")
    assert use.mfu is None and "peak of cpu unknown" in use.describe() and "0.5 TFLOP/s" in use.describe()
    use = utilisation(10_000, 1.0, 1e11, device_name="NVIDIA H200", dtype="bf16")
    assert use.mfu == pytest.approx(1e15 / 989e12) and "MFU of NVIDIA H200" in use.describe()


# ------------------------------------------------------------------ the sync-free step

def tiny_draft(seed=0, vocab=40, draft_vocab=24):
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=16, target_hidden_size=16, num_aux=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=4, intermediate_size=32, vocab_size=vocab, draft_vocab_size=draft_vocab)
    draft = Eagle3Draft(cfg)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    draft.set_vocab(torch.zeros(draft_vocab, dtype=torch.long), t2d)
    return draft


def tiny_inputs(B=3, T=9, vocab=40, draft_vocab=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(B, T, 16, generator=g)
    aux = torch.randn(B, T, 48, generator=g)
    loss_mask = torch.rand(B, T, generator=g) < 0.7
    argmax = torch.randint(0, vocab, (B, T), generator=g)  # some outside the draft vocabulary
    probs = torch.softmax(3 * torch.randn(B, T, draft_vocab, generator=g), -1)
    return emb, aux, loss_mask, TargetSignal(probs=probs, argmax=argmax, in_vocab=argmax < draft_vocab)


class HostReads(TorchDispatchMode):
    """Ops that make a CUDA host wait for the device: a scalar read, or a shape that depends on values."""

    SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"}  # (the fake device hides copies)

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        bool_index = name.startswith("aten::index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) or [])
        if name in self.SYNCS or bool_index:
            self.reads.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_matches_log_softmax_forward_and_backward(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 11, generator=g)).to(dtype).requires_grad_()
    p = torch.softmax(torch.randn(7, 11, generator=g), -1)
    p[2] = 0  # a position with no target mass
    grad = torch.randn(7, generator=g)
    ce = soft_cross_entropy(logits, p, chunk=3)  # chunks of 3, 3, 1 rows
    (ce * grad).sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = -(p * F.log_softmax(logits.float(), -1)).sum(-1)
    (ref * grad).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    assert ce.dtype == torch.float32 and ours.dtype == dtype
    torch.testing.assert_close(ce, ref, **tol)
    torch.testing.assert_close(ours.float(), logits.grad.float(), **tol)


def test_dense_unroll_reads_nothing_and_equals_the_selecting_one():
    emb, aux, loss_mask, signal = tiny_inputs()
    K = 3
    normalizers = torch.tensor([5.0, 4.0, 3.0], dtype=torch.float64)
    reference = tiny_draft()
    with HostReads() as reads_ref:
        loss_ref, counts_ref = ttt_loss(reference, emb, aux, loss_mask, signal, ttt_steps=K, decay=0.8,
                                        normalizers=normalizers)
    loss_ref.backward()
    draft = tiny_draft()
    with HostReads() as reads:
        loss, counts = ttt_loss(draft, emb, aux, loss_mask, signal, ttt_steps=K, decay=0.8, normalizers=normalizers,
                                dense=True)
        loss.backward()
        counted = counted_per_step(loss_mask, signal.in_vocab, K)
    assert reads.reads == [] and reads_ref.reads  # the watcher sees the selecting unroll's reads
    torch.testing.assert_close(loss, loss_ref)
    assert counts.shape == counts_ref.shape == (K, 5) and counts.dtype == counts_ref.dtype == torch.float64
    torch.testing.assert_close(counts, counts_ref, rtol=1e-6, atol=0)  # loss sums: fp32, other order
    assert counts[:, 1:].tolist() == counts_ref[:, 1:].tolist()  # the counts themselves: exactly
    for (name, p), q in zip(draft.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert counted.tolist() == counts_ref[:, 1].tolist()


# ------------------------------------------------------------------ prefetching

def fake_batch(indices):
    ids = torch.tensor([indices])  # [1, n]
    return Batch(input_ids=ids, loss_mask=ids > 0, aux_hidden=ids[..., None].float(), last_hidden=None)


def test_prefetcher_hands_out_the_plan_in_order_and_stops_early():
    plan = [[i, i + 1] for i in range(0, 40, 2)]
    with Prefetcher(fake_batch, plan, torch.device("cpu"), depth=2) as ahead:
        got = [b.input_ids.tolist() for b in ahead]
    assert got == [[p] for p in plan] == [b.input_ids.tolist() for b in InStep(fake_batch, plan, torch.device("cpu"))]
    ahead = Prefetcher(fake_batch, plan, torch.device("cpu"), depth=1)
    next(ahead)
    ahead.close()  # the thread, blocked on a full queue, ends


def test_prefetcher_raises_a_read_error_at_its_batch():
    def load(indices):
        if indices == [3]:
            raise OSError("shard 3 is unreadable")
        return fake_batch(indices)

    with Prefetcher(load, [[1], [2], [3], [4]], torch.device("cpu")) as ahead:
        assert next(ahead).input_ids.tolist() == [[1]] and next(ahead).input_ids.tolist() == [[2]]
        with pytest.raises(OSError, match="shard 3"):
            next(ahead)
    with pytest.raises(ValueError, match="prefetch depth must be >= 1, got 0"):
        Prefetcher(load, [], torch.device("cpu"), depth=0)


# ------------------------------------------------------------------ training

@pytest.fixture(scope="module")
def shards(tmp_path_factory, chat_tiny_target):
    root = tmp_path_factory.mktemp("speed")
    with open(root / "chats.jsonl", "w") as f:
        for i in range(24):
            q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(5))
            a = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(12))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    prepare(PrepareConfig(out=str(root / "shards"), data=str(root / "chats.jsonl"), max_length=64, batch_tokens=256),
            target=chat_tiny_target, progress=False)
    return root / "shards"


def config(tmp_path, shards, name="draft", **kw):
    base = dict(out=str(tmp_path / name), data=str(shards), ttt_steps=2, draft_vocab_size=64, batch_tokens=256,
                val_sequences=4, eval_interval=1000, save_interval=3, log_interval=2, lr=3e-3, warmup_steps=1,
                device="cpu", dtype="fp32", epochs=2, skip_label_check=True)
    base.update(kw)
    return TrainConfig(**base)


def rows(path):
    return [r for r in map(json.loads, open(path / "metrics.jsonl")) if not r.get("eval")]


def test_prefetch_and_the_sync_free_step_train_as_before(tmp_path, shards, chat_tiny_target):
    plain = train(config(tmp_path, shards, "plain", prefetch=0, sync_free="off"), target=chat_tiny_target,
                  progress=False)
    ahead = train(config(tmp_path, shards, "ahead"), target=chat_tiny_target, progress=False)
    free = train(config(tmp_path, shards, "free", sync_free="on"), target=chat_tiny_target, progress=False)
    assert [r["loss"] for r in rows(tmp_path / "ahead")] == [r["loss"] for r in rows(tmp_path / "plain")]
    assert plain.train_tokens == ahead.train_tokens == free.train_tokens and plain.steps == free.steps
    for a, b in zip(rows(tmp_path / "free"), rows(tmp_path / "plain")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["acc_0"] == b["acc_0"] and a["cond_acc_1"] == b["cond_acc_1"]
    # MFU beside tokens/s: achieved TFLOP/s on the CPU, no MFU (its peak is unknown)
    assert all(r["tflops"] > 0 and "mfu" not in r for r in rows(tmp_path / "ahead"))
    assert ahead.throughput["tokens_per_s"] > 0 and ahead.throughput["mfu"] is None


def test_sync_free_steps_stop_at_the_first_non_finite_loss_before_saving(tmp_path, shards, chat_tiny_target,
                                                                         monkeypatch):
    real, calls = objectives_mod.ttt_loss, {"n": 0}

    def nan_at_step_4(*args, **kwargs):
        calls["n"] += 1
        loss, counts = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 4 else loss), counts

    monkeypatch.setattr(objectives_mod, "ttt_loss", nan_at_step_4)
    # log every 2 steps, save every 3: step index 3 is read at step 4, before the step-6 save
    with pytest.raises(TrainingError, match=r"loss is nan at step 3 .*sequences \["):
        train(config(tmp_path, shards, sync_free="on", epochs=3), target=chat_tiny_target, progress=False)
    assert calls["n"] == 4
    load_draft(tmp_path / "draft", target=chat_tiny_target)  # the step-3 checkpoint is intact


def test_sync_free_is_eagle3s():
    with pytest.raises(ValueError, match="--sync-free on is EAGLE-3's step; family 'dflash'"):
        TrainConfig(out="x", data="y", family="dflash", sync_free="on")
    with pytest.raises(ValueError, match="prefetch must be >= 0"):
        TrainConfig(out="x", data="y", prefetch=-1)


def test_compile_trains_as_eager_and_falls_back_when_compiling_fails(tmp_path, shards, chat_tiny_target,
                                                                    monkeypatch, caplog):
    train(config(tmp_path, shards, "eager", epochs=1), target=chat_tiny_target, progress=False)
    real = compiled_mod.compile_layer
    monkeypatch.setattr(compiled_mod, "compile_layer", lambda draft, precision: real(draft, precision, backend="eager"))
    train(config(tmp_path, shards, "compiled", epochs=1, compile=True), target=chat_tiny_target, progress=False)
    assert [r["loss"] for r in rows(tmp_path / "compiled")] == pytest.approx([r["loss"] for r in rows(tmp_path / "eager")])

    def broken(fn, **kw):
        def fails(*a, **k):
            raise RuntimeError("no compiler here\nmore detail")
        return fails

    monkeypatch.setattr(compiled_mod, "compile_layer", real)
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="eaglewire.train.compiled"):
        train(config(tmp_path, shards, "fallback", epochs=1, compile=True), target=chat_tiny_target, progress=False)
    assert "torch.compile of the draft's layer failed, training eager: RuntimeError: no compiler here" in caplog.text
    assert [r["loss"] for r in rows(tmp_path / "fallback")] == [r["loss"] for r in rows(tmp_path / "eager")]


def test_train_on_fake_cuda_steps_without_reading_the_device(tmp_path, shards, chat_tiny_target, monkeypatch):
    real_step, reads = Trainer._train_step, []

    def watched(self, *args, **kwargs):
        with HostReads() as mode:
            out = real_step(self, *args, **kwargs)
        reads.extend(mode.reads)
        return out

    monkeypatch.setattr(Trainer, "_train_step", watched)
    with fake_cuda():
        result = train(config(tmp_path, shards, device="cuda", dtype="fp32", log_interval=1000, save_interval=1000,
                              epochs=1), target=chat_tiny_target, progress=False)
    assert result.steps > 2 and result.throughput["tflops"] > 0
    assert reads == []
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["training"]["steps"] == result.steps
