import copy
import json

import pytest
import torch

import eaglewire.train.loop as train_mod
import eaglewire.train.objectives as objectives_mod
from eaglewire.model.checkpoint import load_draft
from eaglewire.core.contract import ContractError
from eaglewire.data.prepare import PrepareConfig, prepare
from eaglewire.model.target import Target
from eaglewire.train.loop import TrainingError, batch_plan, lr_lambda, split_indices, train
from eaglewire.train.train_config import TrainConfig
from tiny import tiny_target

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


@pytest.fixture(scope="module")
def conversations_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("conv") / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(24):
            question = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(5))
            answer = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(12))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def config(tmp_path, conversations_file, **kw):
    base = dict(out=str(tmp_path / "draft"), online_data=str(conversations_file), ttt_steps=2,
                draft_vocab_size=64, batch_tokens=256, val_sequences=4, eval_interval=1000,
                save_interval=3, log_interval=1, lr=3e-3, warmup_steps=1, max_length=64, device="cpu",
                dtype="fp32")  # the same arithmetic on every machine (auto is bf16 where the CPU has it)
    base.update(kw)
    return TrainConfig(**base)


def losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if not r.get("eval")]


@pytest.fixture(scope="module")
def confident_target(chat_tiny_target):
    """A random target with a sharp next-token distribution, so its argmax is learnable."""
    model = copy.deepcopy(chat_tiny_target.model)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return Target(model=model, tokenizer=chat_tiny_target.tokenizer, spec="confident-tiny")


def test_online_training_learns_and_writes_a_checkpoint(tmp_path, conversations_file, confident_target):
    # The full vocabulary: a random target's argmax rarely falls among the few data tokens.
    result = train(config(tmp_path, conversations_file, epochs=6, draft_vocab_size=len(confident_target.tokenizer)),
                   target=confident_target, progress=False)
    rows = [r for r in map(json.loads, open(tmp_path / "draft" / "metrics.jsonl")) if not r.get("eval")]
    assert result.finished and result.steps == len(rows)
    first, last = rows[:5], rows[-5:]
    assert sum(r["loss"] for r in last) < 0.8 * sum(r["loss"] for r in first)  # it learns
    assert sum(r["acc_0"] for r in last) / 5 > sum(r["acc_0"] for r in first) / 5 + 0.05
    draft, contract, meta = load_draft(tmp_path / "draft", target=confident_target)
    assert contract.aux_boundaries == (2, 4, 5)  # [2, L//2, L-3] of the 8-layer target
    assert meta["training"]["heldout_sequence_ids"] and (tmp_path / "draft" / "training.png").stat().st_size > 0
    assert "val_acc_0" in result.final_eval
    assert result.final_eval["val_vocab_coverage"] == 1.0  # the full vocabulary covers everything


def test_interrupted_and_resumed_run_reproduces_losses(tmp_path, conversations_file, chat_tiny_target, monkeypatch):
    full = config(tmp_path / "a", conversations_file, epochs=3)
    train(full, target=chat_tiny_target, progress=False)
    reference = losses(tmp_path / "a" / "draft" / "metrics.jsonl")

    real_unroll, calls = objectives_mod.ttt_loss, {"n": 0}

    def crash_at_step_5(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # killed after the checkpoint of step 3, before step 5 finished
        return real_unroll(*args, **kwargs)

    monkeypatch.setattr(objectives_mod, "ttt_loss", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "b", conversations_file, epochs=3), target=chat_tiny_target, progress=False)
    monkeypatch.setattr(objectives_mod, "ttt_loss", real_unroll)
    with pytest.raises(TrainingError, match="--resume"):
        train(config(tmp_path / "b", conversations_file, epochs=3), target=chat_tiny_target, progress=False)
    train(config(tmp_path / "b", conversations_file, epochs=3, resume=True), target=chat_tiny_target, progress=False)
    resumed = losses(tmp_path / "b" / "draft" / "metrics.jsonl")
    # Steps 1-4 were logged before the crash; the resume from step 3's checkpoint drops step 4's row and redoes it.
    assert resumed == pytest.approx(reference, rel=1e-6)
    rows = [json.loads(line) for line in open(tmp_path / "b" / "draft" / "metrics.jsonl")]
    steps = [r["step"] for r in rows if not r.get("eval")]
    assert steps == list(range(1, len(reference) + 1))


def test_truncate_metrics_keeps_the_rows_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"eval": true, "step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')  # cut row
    train_mod.truncate_metrics(path, 2)
    assert path.read_text() == '{"step": 1}\n{"eval": true, "step": 1}\n{"step": 2}\n'
    train_mod.truncate_metrics(path, 0)  # a fresh run keeps nothing of one that never saved a checkpoint
    assert path.read_text() == ""
    train_mod.truncate_metrics(tmp_path / "none.jsonl", 3)
    assert not (tmp_path / "none.jsonl").exists()


def test_a_second_train_into_one_out_is_refused(tmp_path, conversations_file, chat_tiny_target):
    from eaglewire.core.locks import DirectoryLocked
    from test_locks import held_elsewhere

    with held_elsewhere(tmp_path / "draft") as pid:
        with pytest.raises(DirectoryLocked, match=f"pid {pid}"):
            train(config(tmp_path, conversations_file, max_steps=1), target=chat_tiny_target, progress=False)


def test_stop_at_step_keeps_the_schedule_and_resumes(tmp_path, conversations_file, chat_tiny_target):
    full = train(config(tmp_path / "a", conversations_file, max_steps=5), target=chat_tiny_target, progress=False)
    part = train(config(tmp_path / "b", conversations_file, max_steps=5, stop_at_step=2),
                 target=chat_tiny_target, progress=False)
    assert (part.steps, part.finished) == (2, False)
    rest = train(config(tmp_path / "b", conversations_file, max_steps=5, resume=True),
                 target=chat_tiny_target, progress=False)
    assert (rest.steps, rest.finished) == (5, True)
    assert losses(tmp_path / "b" / "draft" / "metrics.jsonl") == pytest.approx(
        losses(tmp_path / "a" / "draft" / "metrics.jsonl"), rel=1e-6)
    assert full.finished


def test_resume_of_a_run_that_predates_a_config_field_reads_its_default(tmp_path, conversations_file,
                                                                        chat_tiny_target):
    train(config(tmp_path, conversations_file, max_steps=3, stop_at_step=1), target=chat_tiny_target, progress=False)
    state_file = tmp_path / "draft" / "train_state.pt"
    state = torch.load(state_file, weights_only=False)
    del state["config"]["grad_accum"]  # as written before --grad-accum existed
    torch.save(state, state_file)
    rest = train(config(tmp_path, conversations_file, max_steps=3, resume=True), target=chat_tiny_target,
                 progress=False)
    assert (rest.steps, rest.finished) == (3, True)
    with pytest.raises(TrainingError, match="grad_accum was 1, now 2"):
        train(config(tmp_path, conversations_file, max_steps=3, grad_accum=2, resume=True),
              target=chat_tiny_target, progress=False)


def test_resume_with_other_settings_is_refused(tmp_path, conversations_file, chat_tiny_target):
    train(config(tmp_path, conversations_file, max_steps=3), target=chat_tiny_target, progress=False)
    with pytest.raises(TrainingError, match="lr was 0.003, now 0.001"):
        train(config(tmp_path, conversations_file, max_steps=3, lr=1e-3, resume=True),
              target=chat_tiny_target, progress=False)


def test_init_draft_continues_from_its_weights_and_keeps_its_heldout_split(tmp_path, conversations_file,
                                                                          chat_tiny_target):
    train(config(tmp_path / "a", conversations_file, max_steps=3), target=chat_tiny_target, progress=False)
    start, _, _ = load_draft(tmp_path / "a" / "draft")
    seen = {}
    real_unroll = objectives_mod.ttt_loss

    def first_weights(draft, *args, **kwargs):
        seen.setdefault("fc", draft.fc.weight.detach().clone())
        return real_unroll(draft, *args, **kwargs)

    cont = config(tmp_path / "b", conversations_file, max_steps=2, init_draft=str(tmp_path / "a" / "draft"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(objectives_mod, "ttt_loss", first_weights)
        train(cont, target=chat_tiny_target, progress=False)
    assert torch.equal(seen["fc"], start.fc.weight)  # the first step ran on the stored weights
    lineage = load_draft(tmp_path / "b" / "draft")[2]["training"]["init_draft"]
    assert [(r["draft"], r["steps"]) for r in lineage] == [(str(tmp_path / "a" / "draft"), 3)]
    with pytest.raises(TrainingError, match="held out .* that this run trains on"):
        train(config(tmp_path / "c", conversations_file, max_steps=2, seed=5, init_draft=str(tmp_path / "a" / "draft")),
              target=chat_tiny_target, progress=False)
    with pytest.raises(ContractError, match="aux boundaries"):
        train(config(tmp_path / "d", conversations_file, max_steps=2, aux_boundaries=[1, 3, 6],
                     init_draft=str(tmp_path / "a" / "draft")), target=chat_tiny_target, progress=False)


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, conversations_file, chat_tiny_target,
                                                                 monkeypatch):
    real_unroll, calls = objectives_mod.ttt_loss, {"n": 0}

    def nan_at_step_4(*args, **kwargs):
        calls["n"] += 1
        loss, counts = real_unroll(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 4 else loss), counts

    monkeypatch.setattr(objectives_mod, "ttt_loss", nan_at_step_4)
    with pytest.raises(TrainingError, match=r"loss is nan at step 3 .*sequences \["):
        train(config(tmp_path, conversations_file, epochs=3), target=chat_tiny_target, progress=False)
    load_draft(tmp_path / "draft", target=chat_tiny_target)  # the step-3 checkpoint is intact


def test_offline_shards_from_another_target_are_refused(tmp_path, conversations_file, chat_tiny_target):
    prepare(PrepareConfig(out=str(tmp_path / "shards"), data=str(conversations_file), max_length=64,
                          batch_tokens=256), target=chat_tiny_target, progress=False)
    other = tiny_target("llama", seed=1, vocab_size=len(chat_tiny_target.tokenizer),
                        tokenizer=chat_tiny_target.tokenizer)
    with pytest.raises(ContractError, match="weights_sha256"):
        train(TrainConfig(out=str(tmp_path / "d"), data=str(tmp_path / "shards"), device="cpu"), target=other,
              progress=False)
    result = train(TrainConfig(out=str(tmp_path / "d2"), data=str(tmp_path / "shards"), device="cpu", ttt_steps=2,
                               draft_vocab_size=64, max_steps=2, val_sequences=2, batch_tokens=256),
                   target=chat_tiny_target,
                   progress=False)
    assert result.steps == 2


@pytest.mark.parametrize("kw, message", [
    (dict(ttt_steps=0), "ttt_steps must be >= 1"),
    (dict(data="x"), "exactly one of --data"),
    (dict(loss_decay=0), "loss_decay"),
])
def test_bad_config(tmp_path, conversations_file, kw, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, conversations_file, **kw)


def test_draft_vocab_larger_than_target(tmp_path, conversations_file, chat_tiny_target):
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        train(config(tmp_path, conversations_file, draft_vocab_size=10**6), target=chat_tiny_target, progress=False)


def test_batch_plan_covers_every_sequence_once_within_budget():
    lengths = [5, 40, 17, 9, 33, 60, 2, 21] * 10
    plan = batch_plan(list(range(80)), lengths, 100, seed=3)
    assert sorted(i for b in plan for i in b) == list(range(80))
    assert all(len(b) * max(lengths[i] for i in b) <= 100 for b in plan)
    assert plan == batch_plan(list(range(80)), lengths, 100, seed=3)


def test_split_and_schedule():
    train_idx, val_idx = split_indices(100, 8, seed=0)
    assert len(val_idx) == 8 and not set(train_idx) & set(val_idx)
    assert lr_lambda(0, 10, 100) == pytest.approx(0.1)
    assert lr_lambda(10, 10, 100) == pytest.approx(1.0)
    assert lr_lambda(100, 10, 100) == pytest.approx(0.0)


def test_incomplete_shards_are_refused_unless_allowed(tmp_path, conversations_file, chat_tiny_target, caplog):
    shards = tmp_path / "shards"
    prepare(PrepareConfig(out=str(shards), data=str(conversations_file), max_length=64, batch_tokens=256),
            target=chat_tiny_target, progress=False)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["status"].update(complete=False, conversations=300)  # as a run stopped early leaves it
    (shards / "manifest.json").write_text(json.dumps(manifest))
    base = dict(data=str(shards), device="cpu", ttt_steps=2, draft_vocab_size=64, max_steps=1,
                val_sequences=2, batch_tokens=256)
    with pytest.raises(ValueError, match=r"incomplete.*24 sequences from the 300 conversations planned"):
        train(TrainConfig(out=str(tmp_path / "d"), **base), target=chat_tiny_target, progress=False)
    result = train(TrainConfig(out=str(tmp_path / "d2"), allow_incomplete_data=True, **base),
                   target=chat_tiny_target, progress=False)
    assert result.steps == 1 and "INCOMPLETE DATA" in caplog.text


# ---------------------------------------------------------------- compact shards (fp8 aux, top-K labels)

@pytest.fixture(scope="module")
def stored_three_ways(tmp_path_factory, conversations_file, chat_tiny_target):
    """The same conversations prepared as bf16 + last state, bf16 + top-V labels, fp8 + top-32 labels."""
    root = tmp_path_factory.mktemp("compact")
    V = len(chat_tiny_target.tokenizer)
    out = {}
    for name, kw in (("hidden", {}), ("topk_all", dict(labels=f"topk:{V}")),
                     ("compact", dict(state_dtype="fp8", labels="topk:32"))):
        prepare(PrepareConfig(out=str(root / name), data=str(conversations_file), max_length=64, batch_tokens=256,
                              **kw), target=chat_tiny_target, progress=False)
        out[name] = root / name
    return out


def offline(out, data, **kw):
    base = dict(out=str(out), data=str(data), device="cpu", ttt_steps=2, draft_vocab_size=64, val_sequences=4,
                batch_tokens=256, eval_interval=1000, save_interval=2, log_interval=1, lr=3e-3, warmup_steps=1,
                dtype="fp32")
    return TrainConfig(**{**base, **kw})


def test_topk_labels_of_the_whole_vocab_train_as_the_last_state_does(tmp_path, stored_three_ways, chat_tiny_target):
    """With K = V the stored top-K is the target's whole distribution, so the loss is the hidden path's.
    Not bit-equal: the hidden path rounds the last state to bf16 before the head, the top-K path the
    log-probabilities to fp16 after it, and the runs' updates then differ by that much (measured:
    3e-6 relative over 4 steps), hence a tolerance of 1e-4."""
    V = len(chat_tiny_target.tokenizer)  # the whole vocabulary: every target argmax counts in both runs
    for name in ("hidden", "topk_all"):
        train(offline(tmp_path / name, stored_three_ways[name], max_steps=4, draft_vocab_size=V),
              target=chat_tiny_target, progress=False)
    hidden, topk = (losses(tmp_path / name / "metrics.jsonl") for name in ("hidden", "topk_all"))
    assert len(hidden) == 4 and topk == pytest.approx(hidden, rel=1e-4)
    assert topk != hidden  # the two paths did run (rounding differs)


def test_fp8_topk_shards_train_resume_exactly_and_keep_the_vocabulary(tmp_path, stored_three_ways,
                                                                      chat_tiny_target):
    data = stored_three_ways["compact"]
    full = train(offline(tmp_path / "a", data, max_steps=5), target=chat_tiny_target, progress=False)
    part = train(offline(tmp_path / "b", data, max_steps=5, stop_at_step=2), target=chat_tiny_target,
                 progress=False)
    rest = train(offline(tmp_path / "b", data, max_steps=5, resume=True), target=chat_tiny_target, progress=False)
    assert (full.finished, part.steps, rest.steps, rest.finished) == (True, 2, 5, True)
    assert losses(tmp_path / "b" / "metrics.jsonl") == pytest.approx(losses(tmp_path / "a" / "metrics.jsonl"),
                                                                     rel=1e-6)
    # the draft vocabulary comes from the stored tokens, which top-K shards keep as they are
    train(offline(tmp_path / "h", stored_three_ways["hidden"], max_steps=1), target=chat_tiny_target, progress=False)
    compact, _, _ = load_draft(tmp_path / "a", target=chat_tiny_target)
    hidden, _, _ = load_draft(tmp_path / "h", target=chat_tiny_target)
    assert torch.equal(compact.d2t, hidden.d2t) and int(compact.t2d.sum()) == 64


def test_dflash_training_learns_resumes_exactly_and_records_its_family(tmp_path, conversations_file, confident_target,
                                                                       monkeypatch):
    """`--family dflash` trains through the same loop: it learns, its checkpoint records the family and
    loads as a DFlash draft, and an interrupted run resumes to the same losses (anchors drawn from the
    saved generator)."""
    from eaglewire.model.dflash import DFlashDraft

    kw = dict(family="dflash", block_size=4, draft_layers=1, anchors_per_sequence=8, epochs=4,
              draft_vocab_size=None)  # the whole vocabulary (the helper's 64 is an EAGLE-3 size)
    result = train(config(tmp_path / "a", conversations_file, **kw), target=confident_target, progress=False)
    reference = losses(tmp_path / "a" / "draft" / "metrics.jsonl")
    assert sum(reference[-3:]) < 0.8 * sum(reference[:3])
    assert {"val_acc_0", "val_acc_1", "val_acc_2"} <= set(result.final_eval) and "val_acc_3" not in result.final_eval
    draft, contract, meta = load_draft(tmp_path / "a" / "draft", target=confident_target)
    assert isinstance(draft, DFlashDraft) and contract.family == "dflash" and draft.config.block_size == 4
    assert meta["architectures"] == ["DFlashDraft"]

    real, calls = objectives_mod.block_loss, {"n": 0}

    def crash_at_step_5(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(objectives_mod, "block_loss", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "b", conversations_file, **kw), target=confident_target, progress=False)
    monkeypatch.setattr(objectives_mod, "block_loss", real)
    train(config(tmp_path / "b", conversations_file, resume=True, **kw), target=confident_target, progress=False)
    assert losses(tmp_path / "b" / "draft" / "metrics.jsonl") == pytest.approx(reference, rel=1e-6)


def test_a_mask_token_that_occurs_in_the_data_is_refused(tmp_path, conversations_file, confident_target):
    tok = confident_target.tokenizer
    used = tok(" alpha", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(ValueError, match="mask token .* occurs"):
        train(config(tmp_path, conversations_file, family="dflash", mask_token_id=used), target=confident_target,
              progress=False)


def test_a_draft_inherits_the_template_switch_its_data_was_rendered_with(tmp_path, conversations_file,
                                                                          chat_tiny_target):
    """Offline, the draft's contract records the data's chat_template_kwargs; online, the template's
    defaults ({}) it renders with. A draft trained on another switch is refused as --init-draft."""
    from eaglewire.data.remote_regenerate import RemoteConfig
    from tiny import thinking_target

    target = thinking_target(chat_tiny_target)
    prepare(PrepareConfig(out=str(tmp_path / "shards"), data=str(conversations_file), max_length=64, batch_tokens=256,
                          remote=RemoteConfig(enable_thinking=False)), target=target, progress=False)
    offline = dict(data=str(tmp_path / "shards"), online_data=None, max_steps=1)
    train(config(tmp_path / "off", conversations_file, **offline), target=target, progress=False)
    assert load_draft(tmp_path / "off" / "draft")[1].chat_template_kwargs == {"enable_thinking": False}
    train(config(tmp_path / "on", conversations_file, max_steps=1), target=target, progress=False)
    assert load_draft(tmp_path / "on" / "draft")[1].chat_template_kwargs == {}
    with pytest.raises(ContractError, match="--no-enable-thinking"):
        train(config(tmp_path / "again", conversations_file, **offline, init_draft=str(tmp_path / "on" / "draft")),
              target=target, progress=False)


# ---------------------------------------------------------------- precision (--dtype) and curves (--report-to)

def _record_autocast(monkeypatch):
    """Wrap the TTT unroll to note whether the draft's forward ran under CPU bf16 autocast."""
    real, seen = objectives_mod.ttt_loss, []

    def unroll(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)
        return real(*args, **kwargs)

    monkeypatch.setattr(objectives_mod, "ttt_loss", unroll)
    return seen


def test_bf16_training_autocasts_the_draft_keeps_fp32_weights_and_records_it(tmp_path, conversations_file,
                                                                             chat_tiny_target, monkeypatch):
    seen = _record_autocast(monkeypatch)
    fp32 = train(config(tmp_path / "a", conversations_file, max_steps=3), target=chat_tiny_target, progress=False)
    assert seen and not any(seen)
    seen.clear()
    trainer = train_mod.Trainer(config(tmp_path / "b", conversations_file, max_steps=3, dtype="bf16"),
                                target=chat_tiny_target)
    bf16 = trainer.run(progress=False)
    assert seen and all(seen)  # every forward (training and evaluation) under autocast
    assert all(p.dtype == torch.float32 for p in trainer.draft.parameters())  # fp32 master weights
    meta = json.loads((tmp_path / "b" / "draft" / "config.json").read_text())
    assert meta["training"]["precision"]["dtype"] == "bf16"
    assert meta["training"]["precision"]["requested"] == "bf16"
    # The same run in another precision: bf16 rounds each matmul (8-bit mantissa, ~0.4%), over
    # 3 steps of lr 3e-3 the losses move by less than 5%; a wrong loss (not fp32, not masked) by more.
    assert losses(tmp_path / "b" / "draft" / "metrics.jsonl") == pytest.approx(
        losses(tmp_path / "a" / "draft" / "metrics.jsonl"), rel=5e-2)
    assert bf16.final_eval["val_loss"] == pytest.approx(fp32.final_eval["val_loss"], rel=5e-2)


@pytest.mark.parametrize("native, want", [(True, "bf16"), (False, "fp32")])
def test_auto_follows_the_cpu_and_says_which_it_chose(tmp_path, conversations_file, chat_tiny_target, monkeypatch,
                                                      caplog, native, want):
    import eaglewire.core.machine as machine

    monkeypatch.setattr(machine, "native_bf16", lambda flags=None: native)
    seen = _record_autocast(monkeypatch)
    with caplog.at_level("INFO", logger="eaglewire.core.precision"):
        train(config(tmp_path, conversations_file, max_steps=1, dtype="auto"), target=chat_tiny_target, progress=False)
    assert all(seen) == native and any(seen) == native
    assert f"train computes in {want} (--dtype auto)" in caplog.text
    assert ("no native bf16" in caplog.text) == (not native)
    recorded = json.loads((tmp_path / "draft" / "config.json").read_text())["training"]["precision"]
    assert (recorded["dtype"], recorded["requested"]) == (want, "auto")


def test_report_to_tensorboard_writes_the_curves(tmp_path, conversations_file, chat_tiny_target):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(config(tmp_path, conversations_file, max_steps=4, eval_interval=2, report_to="tensorboard"),
          target=chat_tiny_target, progress=False)
    runs = tmp_path / "draft" / "runs"
    assert list(runs.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(runs))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/acc_0", "train/acc_1", "train/cond_acc_1", "train/learning_rate",
            "train/tokens_per_s", "train/tokens", "eval/loss", "eval/acc_0", "eval/vocab_coverage"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]
    rows = [r for r in map(json.loads, open(tmp_path / "draft" / "metrics.jsonl")) if not r.get("eval")]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows])
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_report_to_tensorboard_without_the_package_fails_at_start_naming_it(tmp_path, conversations_file,
                                                                             chat_tiny_target, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setattr(train_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target first"))
    with pytest.raises(RuntimeError, match=r"--report-to tensorboard needs the tensorboard package.*"
                                           r"pip install 'eaglewire\[tensorboard\]'"):
        train(config(tmp_path, conversations_file, max_steps=1, report_to="tensorboard"), progress=False)
    assert not (tmp_path / "draft" / "runs").exists()


def test_a_resumed_run_purges_the_steps_it_redoes_from_its_curves(tmp_path, conversations_file, chat_tiny_target,
                                                                   monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    real_unroll, calls = objectives_mod.ttt_loss, {"n": 0}

    def crash_at_step_5(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # steps 1-4 logged, the last checkpoint at step 3
        return real_unroll(*args, **kwargs)

    kw = dict(max_steps=6, report_to="tensorboard")
    monkeypatch.setattr(objectives_mod, "ttt_loss", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, conversations_file, **kw), target=chat_tiny_target, progress=False)
    monkeypatch.setattr(objectives_mod, "ttt_loss", real_unroll)
    train(config(tmp_path, conversations_file, resume=True, **kw), target=chat_tiny_target, progress=False)
    events = EventAccumulator(str(tmp_path / "draft" / "runs"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]  # step 4 once: the redone one
    rows = [r for r in map(json.loads, open(tmp_path / "draft" / "metrics.jsonl")) if not r.get("eval")]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows])


def test_val_data_validates_on_other_shards_and_trains_on_all_of_data(tmp_path, stored_three_ways, chat_tiny_target):
    """--val-data: the held-out figures come from other shards (the quickstart's: the target's own replies), and
    --data is trained on whole; shards with other labels are refused."""
    from eaglewire.train.loop import Trainer

    hidden = stored_three_ways["hidden"]
    trainer = Trainer(offline(tmp_path / "d", hidden, val_data=str(hidden), val_sequences=3), target=chat_tiny_target)
    assert trainer.train_idx == list(range(len(trainer.source.sequence_ids))) and trainer.val_idx == [0, 1, 2]
    assert trainer.val_source is not trainer.source
    result = train(offline(tmp_path / "d2", hidden, val_data=str(hidden), val_sequences=3, max_steps=2),
                   target=chat_tiny_target, progress=False)
    recorded = json.loads((tmp_path / "d2" / "config.json").read_text())["training"]
    assert result.steps == 2 and "val_loss" in result.final_eval and len(recorded["heldout_sequence_ids"]) == 3
    with pytest.raises(TrainingError, match="same --labels"):
        Trainer(offline(tmp_path / "d3", hidden, val_data=str(stored_three_ways["compact"])), target=chat_tiny_target)


def test_early_stop_reason_on_a_made_up_loss_curve():
    from eaglewire.train.loop import early_stop_reason

    evals = [{"step": 10 * (i + 1), "val_loss": v} for i, v in enumerate([3.0, 2.5, 2.4, 2.45, 2.41, 2.5])]
    assert early_stop_reason(evals, 0) is None  # off
    assert early_stop_reason(evals[:4], 2) is None  # one evaluation since the low
    assert early_stop_reason(evals, 4) is None  # three since the low at step 30
    said = early_stop_reason(evals, 3)
    assert said and "2.4000 (step 30)" in said and "3 evaluation(s)" in said
    assert early_stop_reason(evals[:5] + [{"step": 60, "val_loss": 2.3}], 3) is None  # a new low


def test_early_stop_ends_the_run_when_the_held_out_loss_stops_falling(tmp_path, conversations_file,
                                                                      chat_tiny_target, monkeypatch):
    """A held-out loss that never falls (evaluate patched to a constant) stops the run after --early-stop
    evaluations, saying why; the run is not 'finished' and a resume stays stopped."""
    monkeypatch.setattr(train_mod.Trainer, "evaluate", lambda self, draft: {"val_loss": 1.0, "val_acc_0": 0.0})
    cfg = config(tmp_path, conversations_file, epochs=4, eval_interval=1, early_stop=2)
    result = train(cfg, target=chat_tiny_target, progress=False)
    assert not result.finished and result.steps == 3 and "has not fallen below" in result.stop_reason
    again = train(config(tmp_path, conversations_file, epochs=4, eval_interval=1, early_stop=2, resume=True),
                  target=chat_tiny_target, progress=False)
    assert again.steps == 3 and again.stop_reason == result.stop_reason
    on = train(config(tmp_path, conversations_file, epochs=4, eval_interval=1, early_stop=0, resume=True),
               target=chat_tiny_target, progress=False)
    assert on.finished and on.steps > 3 and on.stop_reason is None  # --early-stop 0 on resume: trained on
