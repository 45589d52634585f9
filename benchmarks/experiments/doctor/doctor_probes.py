"""Can the doctor's probe prompts tell apart the served wirings that the server's first answers cannot?

A simulated vLLM server runs the reference draft under one wiring fault at a time (every candidate the
served-wiring diagnosis knows for vLLM: layouts, orders, norm flags, d2t, the target's lm_head, another
embedding, another head; another model's rows served as a permutation none of the doctor's stand-ins is).
Greedy decoding is lossless, so the server's text is the target's own greedy text and its counters are the
fault's replay on that text: exactly what a real server wired that way reports (tests/real_vllm checks the
real one). For each fault, the doctor's diagnosis runs twice on the same first
answers: without probes, and with ``--probe-tokens`` of probing; the table says what each named.

    OMP_NUM_THREADS=2 python benchmarks/experiments/doctor/doctor_probes.py [--prompts 4] [--tokens 48] [--probe-tokens 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from simulated_server import SimulatedServer  # noqa: E402 (tests/ holds it: the tests simulate the same server)

DECLARED = [2, 15, 27]


FOREIGN_SEED = 11  # the served copy's foreign rows: a permutation none of the doctor's stand-ins (seeds 0-2) is


def served_elsewhere(faults: list, target, draft) -> list:
    """The faults with one fault per family of stand-ins (another embedding, lm_head, vocabulary's d2t), served
    with rows of FOREIGN_SEED: a served copy holds another model's rows, never one of the doctor's stand-ins."""
    from dataclasses import replace

    from eaglewire.doctor.served_tau.diagnosis import other_embedding, other_head, other_vocabulary
    from eaglewire.engines.serving.served_draft import as_served

    V, Vd = draft.config.vocab_size, draft.config.draft_vocab_size
    builds = {"another embedding": lambda: (draft, other_embedding(target, FOREIGN_SEED)),
              "another lm_head": lambda: (other_head(draft, FOREIGN_SEED), None),
              "another vocabulary's d2t": lambda: (as_served(draft, [], d2t=other_vocabulary(V, Vd, FOREIGN_SEED)
                                                             - torch.arange(Vd)), None)}
    out, seen = [], set()
    for w in faults:
        if w.stand_in:
            if w.label in seen:
                continue
            seen.add(w.label)
            w = replace(w, build=builds[w.label], stand_in=False)
        out.append(w)
    return out


def main() -> None:
    from eaglewire.core.machine import summary_line
    from eaglewire.core.presets import DEFAULT_TARGET
    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire.doctor.served_tau.diagnosis import Wiring, diagnose, field_wirings, layout_wirings, order_wirings
    from eaglewire.doctor.served_tau.served_check import ServedSettings
    from eaglewire.doctor.served_tau.probes import Prober, probe_pool
    from eaglewire.doctor.verdicts import DoctorReport
    from eaglewire.doctor.engine_reading import config_fix
    from eaglewire.engines.formats.foreign_draft import load_any_draft
    from eaglewire.core.prompts import load_prompts
    from eaglewire.decode.text import encode_prompt
    from eaglewire.model.target import load_target

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--probe-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default="", help="';'-separated fault labels")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_target(DEFAULT_TARGET, device="cpu", dtype="fp32")
    draft, contract, _, _ = load_any_draft("reference", target=target)
    L = target.num_layers
    tok = target.tokenizer
    texts = [p.text for p in load_prompts("mt-bench", args.prompts + 6)]
    first = [encode_prompt(tok, t, chat=True) for t in texts[:args.prompts]]
    held_out = [encode_prompt(tok, t, chat=True) for t in texts[args.prompts:]]
    fix = config_fix("vllm", DECLARED, L, "LlamaForCausalLM")
    faults = (layout_wirings(DECLARED, L, {}, fix) + order_wirings("vllm", DECLARED, L)
              + field_wirings("vllm", draft, target, DECLARED))
    faults = served_elsewhere(faults, target, draft)
    if args.only:
        faults = [w for w in faults if w.label in args.only.split(";")]
    trained = Wiring(tuple(DECLARED), "as trained", "", "")
    print(f"| served fault | τ served | matched, no probes | named, no probes | named with probes | probes (tokens) | "
          f"s |\n|---|---|---|---|---|---|---|")
    for fault in faults:
        server = SimulatedServer(target, draft, fault, args.tokens, args.steps)
        counts = server(first)
        as_trained = SimulatedServer(target, draft, trained, args.tokens, args.steps)(first)
        row = []
        for budget in (0, args.probe_tokens):
            report = DoctorReport("reference", DEFAULT_TARGET)
            config = DoctorConfig(draft="reference", engine="vllm", engine_url="http://simulated",
                                  probe_tokens=budget, engine_tokens=args.tokens)
            prober = Prober(server, probe_pool(target, held_out, None), budget=budget, tokens=args.tokens)
            start = time.perf_counter()
            check = diagnose(report, config.settings(ServedSettings), target, draft, DECLARED, first, counts, as_trained,
                             args.steps, [], prober)
            got = report.served["diagnosis"]
            named = got["match"]["label"] if check.verdict == "fail" and "cannot tell apart" not in check.summary \
                and got["match"] else f"{len(got['within_noise'])} left"
            row.append((len(got["within_noise"]), named, got.get("probes"), time.perf_counter() - start))
        (n0, named0, _, _), (_, named1, probes, seconds) = row
        spent = f"{len(probes['prompts'])} ({probes['tokens']})" if probes else "-"
        print(f"| {fault.label} | {counts.tau:.2f} | {n0} | {named0} | {named1} | {spent} | {seconds:.1f} |",
              flush=True)
    print(f"\n{summary_line()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; {args.prompts} first "
          f"prompts x {args.tokens} tokens, chain {args.steps}, --probe-tokens {args.probe_tokens}")


if __name__ == "__main__":
    main()
