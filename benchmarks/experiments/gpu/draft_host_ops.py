"""What the host dispatches to draft one EAGLE-3 round on CUDA's path, counted on the CPU: a round drafted whole
(one graph) against a level at a time (a graph a level, the masks, sort and bookkeeping between them).

On a GPU each op the host dispatches outside a graph costs a launch the device waits for when the host is the
slower side -- it is, in a round of a few tiny draft steps: the H200 spent 1.56 ms a drafted level in the loop
against 0.59 ms for its graph alone. Here the fixed-width cache runs its steps eagerly (no CUDA), a call that
would replay a graph counts as one replay (with a copy of each input into the graph's buffers and a clone of each
output, as ``StepGraphs`` makes them), and every aten op outside one is counted: all of them (views cost host
time too) and those that would launch a kernel (not views). The prompt's own entries (before the rounds) are not
counted.

Random draft on a tiny random target (fp32): nearly every round drafts its full shape.

    python benchmarks/experiments/gpu/draft_host_ops.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: gpu_targets.py
from gpu_decode_probe import random_draft  # noqa: E402
from gpu_targets import VOCAB, random_target  # noqa: E402

from eaglewire.decode import kv_cache  # noqa: E402
from eaglewire.decode.eagle3_drafter import Eagle3Drafter  # noqa: E402
from eaglewire.decode.runner import LeanRunner  # noqa: E402
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder  # noqa: E402


class _Count(TorchDispatchMode):
    """Counts aten ops while ``on``; a graph replay counts as one op and hides what runs inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.on, self.inside, self.ops, self.kernels, self.replays = False, 0, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not self.inside:
            self.ops += 1
            self.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


def count_rounds(spec: SpecConfig, whole: bool, tokens: int) -> dict:
    target = random_target("tiny", torch.device("cpu"))
    L = target.num_layers
    draft, contract = random_draft(target, [2, L // 2, L - 3], torch.float32)
    decoder = SpecDecoder(target, draft, contract, spec)
    decoder.drafter = drafter = Eagle3Drafter(target, draft, spec, static=True, graphs=False)
    drafter.whole_rounds = whole and drafter.whole_rounds
    decoder._target_runner = LeanRunner(target, decoder.boundaries, static=True)
    counter = _Count()
    replay = kv_cache.StaticDraftCache.replay

    def counted_replay(self, name, tokens, fn, inputs):
        outer = counter.on and not counter.inside
        counter.inside += 1
        try:
            out = replay(self, name, tokens, fn, inputs)
        finally:
            counter.inside -= 1
        if outer:  # the replay, a copy of each input into the graph's buffers, a clone of each output
            counter.replays += 1
            counter.ops += 1 + len(inputs) + len(out)
            counter.kernels += len(inputs) + len(out)
        return out

    def counted(method):
        def run(*args, **kwargs):
            counter.on = args[-1] > 0  # propose(root, position) / extend(aux, next_tokens, start): not the prompt's
            try:
                return method(*args, **kwargs)
            finally:
                counter.on = False
        return run

    propose, extend = drafter.propose, drafter.extend
    prompt = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    kv_cache.StaticDraftCache.replay = counted_replay
    try:
        decoder.generate(prompt, max_new_tokens=8)  # warm
        counter.ops = counter.kernels = counter.replays = 0
        drafter.propose, drafter.extend = counted(propose), counted(extend)
        with counter:
            out, stats = decoder.generate(prompt, max_new_tokens=tokens)
    finally:
        kv_cache.StaticDraftCache.replay = replay
    R = stats.rounds  # every round proposes once and extends once
    return {"rounds": R, "ops": counter.ops / R, "kernels": counter.kernels / R, "replays": counter.replays / R,
            "tokens": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; per round (propose + extend), outside graph replays")
    print(f"{'config':12} {'how':16} {'aten ops':>9} {'kernels':>8} {'replays':>8}")
    for name, spec in (("chain 3", SpecConfig.chain(3)), ("tree 5/4/8", SpecConfig(num_steps=5, topk=4,
                                                                                     num_draft_tokens=8))):
        rows = {whole: count_rounds(spec, whole, args.tokens) for whole in (False, True)}
        assert rows[True]["tokens"] == rows[False]["tokens"], "the two ways must decode the same tokens"
        for whole, how in ((False, "level at a time"), (True, "whole round")):
            r = rows[whole]
            print(f"{name:12} {how:16} {r['ops']:9.1f} {r['kernels']:8.1f} {r['replays']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
