"""doctor --temperature: the sampled and greedy τ from one trace per held-out sequence (DraftTrace.target_agrees)
against the earlier two traces (one at T, one at 0), side by side, alternating, in one process, on the
reference draft and SmolLM2-135M (10 held-out sequences, chain of 5, T 0.7). Both must give the same τ.

    OMP_NUM_THREADS=2 python benchmarks/experiments/doctor/doctor_sampling_trace.py
"""
import time

import torch

torch.set_num_threads(2)
from eaglewire.doctor.doctor_config import DoctorConfig
from eaglewire.doctor.verdicts import DoctorReport
from eaglewire.doctor.doctor_command import _load_sequences
from eaglewire.doctor import temperature
from eaglewire.engines.formats.foreign_draft import load_any_draft
from eaglewire.model.target import load_target
from eaglewire.acceptance.simulate import Shape, sampled_rounds, tau

target = load_target("smollm2-135m")
draft, contract, cfg, _ = load_any_draft("reference", target=target, check_native=False)
config = DoctorConfig(draft="reference")
seqs, _ = _load_sequences(config, target, contract, cfg.get("training") or {}, DoctorReport(draft="d", target="t"))
seqs = seqs[:10]
layout, steps, T = list(contract.aux_boundaries), 5, 0.7

def old():
    shape, out = Shape(steps), {T: [], 0.0: []}
    for seq in seqs:
        spans = [(s, e) for s, e in temperature.reply_spans(seq.loss_mask) if e - s > steps]
        if not spans: continue
        for t in out:
            trace = temperature._trace(target, draft, layout, seq.input_ids.tolist(), spans[0][0], steps, t, None)
            for s, e in spans:
                out[t] += sampled_rounds(temperature.window(trace, s, e, steps), shape, "eaglewire")
    return tau(out[T]), tau(out[0.0])

def new():
    got = temperature.sampled_acceptance(target, draft, layout, seqs, steps=steps, temperature=T)
    return got.tau, got.greedy_tau

for name, fn in [("old", old), ("new", new)] * 3:
    t0 = time.perf_counter(); r = fn(); print(name, f"{time.perf_counter() - t0:.2f}s", [round(x, 4) for x in r], flush=True)
