"""Data parallel training: two gloo ranks on CPU end with identical drafts."""

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


def _rank_main(rank, world, port, data, out, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from eaglewire.target import load_tokenizer
    from eaglewire.train import TrainConfig, Trainer
    from tiny import tiny_target

    tok = load_tokenizer("smollm2-135m")
    target = tiny_target("llama", vocab_size=len(tok), tokenizer=tok, initializer_range=0.2)
    config = TrainConfig(out=out, online_data=data, ttt_steps=2, draft_vocab_size=64, batch_tokens=128,
                         val_sequences=2, max_steps=3, max_length=48, device="cpu", eval_interval=1000,
                         log_interval=1)
    trainer = Trainer(config, target)
    trainer.run(progress=False)
    # Each rank saw other batches; only averaged gradients keep their weights identical.
    results[rank] = [float(p.detach().double().sum()) for p in trainer.draft.parameters()]
    torch.distributed.destroy_process_group()


def test_two_ranks_train_one_draft(tmp_path):
    data = tmp_path / "chats.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(WORDS[i % 8:] + WORDS[:i % 8])},
                                             {"role": "assistant", "content": " ".join(WORDS[(i * 3) % 8:])}]}) + "\n")
    results = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, _free_port(), str(data), str(tmp_path / "draft"), results), nprocs=2)
    assert len(results) == 2 and results[0] == results[1]
    metrics = [json.loads(line) for line in open(tmp_path / "draft" / "metrics.jsonl")]
    assert [m["step"] for m in metrics if not m.get("eval")] == [1, 2, 3]
