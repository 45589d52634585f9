"""`tune --concurrency`: the schedule's choice on made-up costs (where speculation stops paying, within noise is
plain), and the command end to end on a tiny target: a schedule file that `serve --schedule` takes here."""

import json

import pytest

from eaglewire.concurrency.measurement import StepCost, predict, schedule_from
from eaglewire.cli import main
from eaglewire.concurrency.schedule import Schedule, schedule_key
from eaglewire.decode.spec_config import SpecConfig
from eaglewire.decode.load import load_decode_target
from test_bench import draft_dir, write_prompts  # noqa: F401  (fixtures)

CHAIN1, CHAIN3 = SpecConfig.chain(1), SpecConfig.chain(3)


def costs_of(table: dict[tuple[int, str], float], spread: float = 0.0) -> dict[tuple[int, str], StepCost]:
    """Made-up step costs (ms), each as 16 steps spread +-``spread`` around it."""
    return {k: StepCost([ms / 1e3 * (1 + spread * ((i % 4) - 1.5) / 1.5) for i in range(16)])
            for k, ms in table.items()}


def test_the_schedule_speculates_while_it_pays_and_serves_plain_above():
    """A verify nearly free at batch 1 and dearer as the batch fills, tau 1.7 (chain 1) and 2.5 (chain 3): chain 3
    at 1, chain 1 at 2-4, plain at 8 -- the crossover is 4."""
    taus = {"chain 1": 1.7, "chain 3": 2.5}
    table = {(1, "plain"): 10, (1, "chain 1"): 12, (1, "chain 3"): 16,
             (2, "plain"): 11, (2, "chain 1"): 15, (2, "chain 3"): 24,
             (4, "plain"): 13, (4, "chain 1"): 20, (4, "chain 3"): 40,
             (8, "plain"): 16, (8, "chain 1"): 30, (8, "chain 3"): 70}
    predictions = predict(costs_of(table), taus, [CHAIN1, CHAIN3], [1, 2, 4, 8])
    schedule = schedule_from(predictions)
    assert [schedule.shape_for(b) for b in (1, 2, 3, 4, 5, 8, 64)] == [CHAIN3, CHAIN1, CHAIN1, CHAIN1, None, None, None]
    assert schedule.crossover == 4
    chain3_at_1 = next(p for p in predictions if p.batch == 1 and p.shape == CHAIN3)
    assert chain3_at_1.speedup == pytest.approx(2.5 * 10 / 16)  # 2.5 tokens in 16 ms against 1 in 10


def test_a_gain_within_the_noise_is_plain():
    """Chain 1 predicts 1.04x plain, but the steps' spread is wider than that: not kept."""
    table = {(1, "plain"): 10, (1, "chain 1"): 16.3}
    quiet = schedule_from(predict(costs_of(table), {"chain 1": 1.7}, [CHAIN1], [1]))
    noisy = schedule_from(predict(costs_of(table, spread=0.3), {"chain 1": 1.7}, [CHAIN1], [1]))
    assert quiet.shape_for(1) == CHAIN1 and noisy.shape_for(1) is None


def test_tune_concurrency_writes_a_schedule_serve_takes_here(tmp_path, target_dir, draft_dir, capsys, one_thread):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    out = tmp_path / "schedule.json"
    argv = ["tune", "--target", str(target_dir), "--draft", str(draft_dir), "--dataset", str(prompts), "--offset", "0",
            "--num-prompts", "2", "--max-new-tokens", "12", "--concurrency", "1,2,4", "--shapes", "1,1,2;2,2,4,0.1",
            "--schedule-out", str(out)]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "schedule: " in shown and "batch" in shown and f"--schedule {out}" in shown
    schedule = Schedule.load(out)
    assert json.loads(out.read_text())["key"]["engine"].startswith("eaglewire ")
    schedule.check_key(schedule_key(load_decode_target(str(target_dir)), draft_dir))  # serve's check passes here


def test_concurrency_flags_are_checked(capsys):
    assert main(["tune", "--draft", "reference", "--concurrency", "4,2"]) == 2
    assert "ascending batch sizes" in capsys.readouterr().err
    assert main(["tune", "--draft", "reference", "--schedule-out", "s.json"]) == 2
    assert "give --concurrency too" in capsys.readouterr().err
    assert main(["tune", "--draft", "reference", "--concurrency", "1,2", "--shapes", "3,1"]) == 2
    assert "is not steps,topk,draft-tokens[,min-prob]" in capsys.readouterr().err


def test_bench_concurrency_runs_plain_shapes_and_the_schedule_at_each_load(tmp_path, target_dir, draft_dir, capsys,
                                                                           one_thread):
    """bench --concurrency 1,3: plain, a chain and tune's schedule at each load; every output is plain's (fp32),
    the schedule drafts only where it says, the table, concurrency.json and concurrency.png are written."""
    from eaglewire.concurrency.schedule import ScheduleRange

    target = load_decode_target(str(target_dir), dtype="fp32")
    schedule_path = tmp_path / "schedule.json"
    Schedule([ScheduleRange(1, CHAIN3), ScheduleRange(2, None)], schedule_key(target, draft_dir)).save(schedule_path)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 5)
    out = tmp_path / "report"
    argv = ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--dataset", str(prompts),
            "--configs", "1,0,0,0;1,3,1,4", "--max-new-tokens", "10", "--warmup", "1", "--dtype", "fp32",
            "--concurrency", "1,3", "--schedule", str(schedule_path), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert "vs plain" in shown and "schedule" in shown
    rows = json.loads((out / "concurrency.json").read_text())["rows"]
    assert [(r["name"], r["clients"]) for r in rows] == [(n, c) for c in (1, 3) for n in ("1,0,0,0", "1,3,1,4", "schedule")]
    assert all(r["same_as_plain"] == 5 and r["requests"] == 5 for r in rows)
    by = {(r["name"], r["clients"]): r for r in rows}
    assert by[("schedule", 1)]["speculative_steps"] == by[("schedule", 1)]["steps"] > 0  # one at a time: drafts
    assert by[("schedule", 3)]["speculative_steps"] < by[("schedule", 3)]["steps"]  # 3 at once: plain
    assert by[("1,0,0,0", 3)]["steps"] < by[("1,0,0,0", 1)]["steps"]  # batched: fewer steps for the same tokens
    assert (out / "concurrency.png").stat().st_size > 0


def test_bench_concurrency_flags_are_checked(capsys):
    assert main(["bench", "--concurrency", "1,4", "--configs", "1,5,1,6", "--draft", "reference"]) == 2
    assert "list 1,0,0,0 in --configs" in capsys.readouterr().err
    assert main(["bench", "--schedule", "s.json"]) == 2
    assert "give --concurrency too" in capsys.readouterr().err
