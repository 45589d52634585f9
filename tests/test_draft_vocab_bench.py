"""benchmarks/experiments/training/draft_vocab.py: the all-token chain acceptance it reports next to the doctor's."""

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "draft_vocab_bench",
    Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "training" / "draft_vocab.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_chain_acceptance_counts_leading_right_steps():
    # 4 start positions x 3 steps; step 2 at position 3 does not count (end of the reply).
    right = torch.tensor([[1, 0, 1, 1],
                          [1, 1, 0, 1],
                          [0, 1, 1, 1]], dtype=torch.bool)[None]  # [1, S, T]
    valid = torch.ones_like(right)
    valid[0, 2, 3] = False
    out = bench.chain_acceptance(right, valid, (1, 3))
    assert out["acc@0"] == pytest.approx(3 / 4)
    assert out["cond acc@1"] == pytest.approx(2 / 3)  # reached at 0, 2, 3; right at 0, 3
    assert out["cond acc@2"] == pytest.approx(0.0)  # reached and counted only at 0, wrong there
    assert out["tau 1"] == pytest.approx(1 + 3 / 4)
    assert out["tau 3"] == pytest.approx(1 + (2 + 0 + 1 + 2) / 4)


def test_chain_acceptance_counts_misses_where_the_step_is_invalid_at_start():
    right = torch.ones(1, 2, 3, dtype=torch.bool)
    valid = torch.ones_like(right)
    valid[0, 0, 2] = False  # not a reply position: not a start
    out = bench.chain_acceptance(right, valid, (2,))
    assert out["acc@0"] == 1.0 and out["tau 2"] == pytest.approx(3.0)
