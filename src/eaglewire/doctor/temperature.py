"""``doctor --temperature``: what the draft accepts at the temperature users sample at, beside the
greedy figures every other check gives (acc@0, the acceptance check's τ, ``--engine-url``'s served
τ, the speed ranking).

The temperature: ``--temperature T``, else the first of these the doctor is shown:
  --traffic FILE    the ``temperature`` its requests send (the most common value; a request's own
                    value wins over every engine's defaults)
  --engine-flags    llama-server's ``--temp`` / ``--temperature N`` (llama.cpp b11434 common/arg.cpp:
                    ``params.sampling.temp``, clamped at 0, the default of every request that sends
                    none, tools/server/server-schema.cpp); vLLM's ``--override-generation-config``
  the target's generation_config.json ``temperature`` (the --target directory), for the engines whose
                    requests default to it: vLLM 0.33.0 (``--generation-config auto``, its default:
                    ``ModelConfig.get_diff_sampling_param``, vllm/config/model.py; ``vllm`` turns it
                    off, a folder replaces the model's) and SGLang 0.5.23 chat completions
                    (``--sampling-defaults model``, its default: ``ModelConfig.get_default_sampling_params``,
                    sglang/srt/configs/model_config.py, applied by ``ChatCompletionRequest.to_sampling_params``;
                    ``openai`` turns it off). Neither reads ``do_sample``: a file with ``do_sample: false``
                    and a temperature samples at that temperature.
Nothing found: no check. The engines' built-in defaults (llama-server 0.8, vLLM and SGLang 1.0) hold
only for requests that send no temperature, which the doctor cannot know without ``--traffic``.

The rule. Every engine drafts a chain greedily (argmax) and accepts drafted token x with the target's
probability p_T(x) at temperature T:
  vLLM 0.33.0    ``SpeculativeConfig.draft_sample_method`` "greedy" (the default) treats the draft as
                 one-hot; ``rejection_random_sample_kernel`` (vllm/v1/sample/rejection_sampler.py), with
                 NO_DRAFT_PROBS, sets draft_prob = 1 and accepts when target_prob / draft_prob >= uniform
  SGLang 0.5.23  ``eagle_sample`` (sglang/srt/speculative/eagle_utils.py) runs
                 ``tree_speculative_sampling_target_only`` with zero draft probabilities
                 (``--speculative-use-rejection-sampling`` off by default); its kernel
                 (sgl_kernel/speculative/sampling.cuh) accepts when coin < prob_acc / threshold_acc or
                 p >= threshold_single, both 1.0 by default: p for a chain (on CPU and XPU it verifies
                 greedily whatever the request asks, ``_verify_uses_greedy``)
  llama.cpp b11434  EAGLE-3 and DFlash drafters keep no draft distribution (common/speculative.cpp:
                 "greedy drafting leaves no candidates behind, so the verifier falls back to
                 sample-and-match"), so llama-server verifies with ``common_sampler_sample_and_accept_n``
                 (common/sampling.cpp): the target samples each position, and the first sample that
                 differs from the draft ends the round
  eaglewire      ``sampling_verify`` (decode/verify.py): x with probability p(x) / sum p = p(x) for a chain
A round after last verified position t, drafting x_1..x_n, produces in expectation
    E[τ | t] = 1 + Σ_{k=1..n} Π_{j=1..k} p_T(x_j)        (the bonus or recovered token always comes)
read on the training-time unroll of the held-out sequences (``acceptance/trace.py``'s ``target_prob``,
``acceptance/simulate.py``'s ``sampled_rounds``, the rule ``eaglewire tune --temperature`` ranks by):
exact for x_1; deeper tokens are drafted and judged after the text's own tokens, which are the round's
where the earlier drafted tokens equal the text (the held-out replies stand in for what the target
samples). Every reply position is a round start; the greedy figure beside it is the same average at
T = 0 (p_0(x) = 1 where x is the target's argmax, else 0), so the difference is the temperature's.
Not modelled: top-k / top-p / min-p truncation (llama-server's defaults 40 / 0.95 / 0.05), which
raises the kept tokens' probabilities, and SGLang's ``--speculative-accept-threshold-*``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from eaglewire import engines
from eaglewire.acceptance.simulate import RoundShape, Shape, sampled_rounds, tau
from eaglewire.acceptance.trace import DraftTrace, trace_blocks, trace_text
from eaglewire.doctor.verdicts import Check, DoctorReport
from eaglewire.doctor.traffic import REQUEST_KEYS, parse_prompt, traffic_records
from eaglewire.engines.interface import PATH_RULE
from eaglewire.engines.serving.sampling_defaults import Temperature, temperature_value
from eaglewire.model.dflash_blocks import is_block_draft

NAME = "sampling"


@dataclass(frozen=True)
class SamplingSettings:
    """What the sampling check reads: where the temperature users sample at may be said, and the draft and target
    its fix names (the fields are the doctor flags of the same name, filled by ``doctor_config``)."""

    temperature: float | None
    traffic: str | None
    traffic_prompts: int
    engine: str
    engine_flags: str | None
    draft: str
    target: str  # a directory: its generation_config.json may say the temperature


# ---------------------------------------------------------------- one reader per source

def traffic_temperature(path: str | Path, limit: int) -> Temperature | None:
    """The ``temperature`` the first ``limit`` requests of a traffic file send (as ``traffic.load_traffic``
    reads them): the most common value, the others and the silent requests named; None when none sends one."""
    stated, silent, requests = Counter(), 0, 0
    for item, where in traffic_records(path):
        if not isinstance(item, (dict, str)) or parse_prompt(item, where) is None:
            continue  # no prompt: the traffic check refuses or skips it
        requests += 1
        request = item
        while isinstance(request, dict) and any(isinstance(request.get(k), dict) for k in REQUEST_KEYS):
            request = next(request[k] for k in REQUEST_KEYS if isinstance(request.get(k), dict))
        value = request.get("temperature") if isinstance(request, dict) else None
        if value is None:
            silent += 1
        else:
            stated[temperature_value(value, f"--traffic {where}")] += 1
        if requests >= limit:
            break
    if not stated:
        return None
    (value, n), *others = stated.most_common()
    notes = []
    if others:
        notes.append("others send " + ", ".join(f"{t:g} ({k})" for t, k in others) + ": measured at the most "
                     "common one")
    if silent:
        notes.append(f"{silent} send none (the engine's default applies to them)")
    return Temperature(value, f"{n} of {requests} --traffic requests", tuple(notes))


def served_temperature(settings: SamplingSettings) -> Temperature | None:
    """``--temperature``, else the traffic's requests, else the engine's launch flags and the target's
    generation config (the engine's ``sampling.launch_temperature``); None when nothing says. ValueError naming
    the source for a value that is not a temperature."""
    if settings.temperature is not None:
        return Temperature(float(settings.temperature), "--temperature")
    if settings.traffic:
        found = traffic_temperature(settings.traffic, settings.traffic_prompts)
        if found is not None:
            return found
    reader = engines.sampling_of(settings.engine).launch_temperature
    target_dir = Path(settings.target).expanduser()
    return reader(settings.engine_flags or "", target_dir if target_dir.is_dir() else None) if reader else None


# ---------------------------------------------------------------- the measurement

@dataclass
class SampledAcceptance:
    temperature: float
    chain: int  # drafted tokens per round
    tau: float  # expected τ at the temperature
    greedy_tau: float  # the same rounds at T = 0
    rounds: int  # round starts averaged (reply positions)
    sequences: int


def reply_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """loss_mask [T] bool -> [(start, end)] of each run of reply tokens (a round needs a token before it)."""
    mask = loss_mask.bool().tolist()
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((max(start, 1), i))
            start = None
    return out


def window(trace: DraftTrace, start: int, end: int, steps: int) -> DraftTrace:
    """``trace``'s first ``steps`` steps, with rounds starting from the reply token at ``start`` and
    drafting none past ``end`` (a DFlash block traces block_size - 1 steps whatever the chain)."""
    rows, cols = slice(0, steps), slice(0, end)
    return dataclasses.replace(trace, prompt_len=start, right=trace.right[rows, cols], prob=trace.prob[rows, cols],
                               prob_top=trace.prob_top[rows, cols], target_prob=trace.target_prob[rows, cols],
                               target_agrees=trace.target_agrees[rows, cols])


def at_zero(trace: DraftTrace) -> DraftTrace:
    """``trace`` read at temperature 0: a drafted token is kept exactly when it is the target's argmax."""
    return dataclasses.replace(trace, target_prob=trace.target_agrees.float())


def _trace(target, draft, layout: list[int], text: list[int], prompt_len: int, steps: int, temperature: float,
           block_len: int | None) -> DraftTrace:
    if block_len is not None:
        return trace_blocks(target, draft, layout, text, prompt_len, temperature=temperature,
                            block_lens=[block_len])[block_len]
    return trace_text(target, draft, layout, text, prompt_len, steps=steps, temperature=temperature)


def sampled_acceptance(target, draft, layout: list[int], sequences: list, *, steps: int, temperature: float,
                       engine: str | None = None) -> SampledAcceptance:
    """Expected τ of a greedy chain of ``steps`` at ``temperature`` and at 0 on ``sequences`` (the module's
    text); a DFlash draft: ``steps`` drafted from one block (llama.cpp runs a block of steps + 1)."""
    block = is_block_draft(draft)
    block_len = None
    if block:
        steps = min(steps, draft.config.block_size - 1)
        block_len = steps + 1 if engine and engines.get(engine).block_follows_shape else draft.config.block_size
    shape = Shape(steps, block=block)
    sampled: list[RoundShape] = []
    greedy: list[RoundShape] = []  # the same rounds at T = 0
    used = 0
    for seq in sequences:
        spans = [(s, e) for s, e in reply_spans(seq.loss_mask) if e - s > steps]
        if not spans:
            continue
        used += 1
        trace = _trace(target, draft, layout, seq.input_ids.tolist(), spans[0][0], steps, temperature, block_len)
        for s, e in spans:  # p_min 0: every round drafts all ``steps`` (either rule)
            at_t = window(trace, s, e, steps)
            sampled += sampled_rounds(at_t, shape, PATH_RULE)
            greedy += sampled_rounds(at_zero(at_t), shape, PATH_RULE)
    return SampledAcceptance(temperature, steps, tau(sampled), tau(greedy), len(sampled), used)


# ---------------------------------------------------------------- the check

def check_sampling(report: DoctorReport, settings: SamplingSettings, target, draft, layout: list[int],
                   sequences: list, steps: int) -> Check | None:
    """The temperature users sample at (the module's text) and, above 0, the draft's expected τ there beside
    greedy's; None (no check) when nothing says what temperature users sample at."""
    try:
        found = served_temperature(settings)
    except (ValueError, OSError) as e:
        return report.add(Check(NAME, "skip", f"cannot read the temperature users sample at: {e}",
                                fix="pass --temperature T"))
    if found is None:
        return None
    notes = list(found.notes)
    if found.value == 0:
        return report.add(Check(NAME, "ok", f"users decode greedily (T 0 from {found.source}): the greedy "
                                "figures above are theirs", notes))
    got = sampled_acceptance(target, draft, layout, sequences, steps=steps, temperature=found.value,
                             engine=settings.engine)
    engine = engines.canonical(settings.engine)
    rule = engines.sampling_of(engine).acceptance_rule
    report.sampling = {"temperature": found.value, "source": found.source, "chain": got.chain,
                       "sampled_tau": got.tau, "greedy_tau": got.greedy_tau, "rounds": got.rounds,
                       "sequences": got.sequences, "rule": rule}
    if got.rounds == 0:
        return report.add(Check(NAME, "skip", f"users sample at T {found.value:g} (from {found.source}); no "
                                f"held-out reply is long enough for a chain of {got.chain}", notes,
                                fix="raise --max-length"))
    evidence = [f"expected τ 1 + Σ_k Π_(j<=k) p_T(x_j) of a greedy chain of {got.chain}, accepted by "
                f"{rule}, over {got.rounds:,} round starts on the training-time "
                f"unroll of {got.sequences} held-out sequences; greedy: the same rounds at T 0",
                *notes,
                "acc@0, the acceptance check's τ, --engine-url's served τ and the speed ranking are greedy; "
                "top-k / top-p truncation, not modelled here, raises p_T of the kept tokens"]
    return report.add(Check(
        NAME, "warn", f"users sample at T {found.value:g} (from {found.source}); at that temperature the draft "
        f"accepts τ {got.tau:.2f} for a chain of {got.chain} vs {got.greedy_tau:.2f} greedy "
        f"({got.tau - got.greedy_tau:+.3f})", evidence,
        fix=f"rank chain shapes at this temperature: eaglewire tune --draft {settings.draft} "
            f"--target {settings.target} --engine {engine} --temperature {found.value:g}"))
