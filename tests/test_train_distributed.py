"""Data parallel training: two gloo ranks on CPU train one draft, exactly as one process
that accumulates the same micro-batches."""

import json
import os
import socket

import torch
import torch.multiprocessing as mp

WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, data, out, grad_accum, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from eaglewire.model.target import load_tokenizer
    from eaglewire.train.loop import Trainer
    from eaglewire.train.train_config import TrainConfig
    from tiny import tiny_target

    tok = load_tokenizer("smollm2-135m")
    target = tiny_target("llama", vocab_size=len(tok), tokenizer=tok, initializer_range=0.2)
    config = TrainConfig(out=out, online_data=data, ttt_steps=2, draft_vocab_size=len(tok), batch_tokens=256,
                         grad_accum=grad_accum, val_sequences=2, max_steps=3, max_length=96, device="cpu",
                         eval_interval=1000, log_interval=1, lr=3e-3, warmup_steps=1,
                         dtype="fp32")  # spawned ranks miss conftest's fp32 pin: said here, the same on every CPU
    trainer = Trainer(config, target)
    trainer.run(progress=False)
    results[rank] = [p.detach().clone() for p in trainer.draft.parameters()]
    if world > 1:
        torch.distributed.destroy_process_group()


def _chats(path):
    # Replies of different lengths: micro-batches count different numbers of positions, so only
    # a loss normalised over the whole step makes the two layouts agree.
    with open(path, "w") as f:
        for i in range(32):
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(WORDS[i % 8:] + WORDS[:i % 8])},
                                             {"role": "assistant", "content": " ".join(WORDS[(i * 3) % 8:] * (1 + i % 3))}]}) + "\n")
    return str(path)


def _train(tmp_path, name, world, grad_accum):
    args = (world, _free_port(), _chats(tmp_path / "chats.jsonl"), str(tmp_path / name), grad_accum)
    if world == 1:  # one process: this one (a spawn costs its imports, ~6 s), its environment and threads restored
        results, environ, threads = {}, dict(os.environ), torch.get_num_threads()
        try:
            _rank_main(0, *args, results)
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
    else:
        results = mp.Manager().dict()
        mp.spawn(_rank_main, args=(*args, results), nprocs=world)
    metrics = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    return dict(results), [m for m in metrics if not m.get("eval")]


def test_two_ranks_train_as_one_process_accumulating_their_micro_batches(tmp_path):
    ranks, ranks_log = _train(tmp_path, "ranks", world=2, grad_accum=1)
    alone, alone_log = _train(tmp_path, "alone", world=1, grad_accum=2)
    # Each rank saw other micro-batches; only summed gradients keep their weights identical.
    assert len(ranks) == 2 and all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1]))
    assert [m["step"] for m in ranks_log] == [m["step"] for m in alone_log] == [1, 2, 3]
    for r, a in zip(ranks_log, alone_log):
        assert r["tokens"] == a["tokens"]
        assert a["loss"] > 0 and abs(r["loss"] - a["loss"]) < 1e-4 * a["loss"], (r, a)
    for r, a in zip(ranks[0], alone[0]):
        torch.testing.assert_close(r, a, rtol=1e-4, atol=1e-6)
