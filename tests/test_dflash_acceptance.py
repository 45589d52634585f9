"""A DFlash draft along a text: the trace of every anchored block (from one capture) is what decoding
drafts block by block, and the doctor's counts and round replay read it with decoding's alignment."""

import pytest
import torch

from eaglewire.acceptance.trace import top_probs, trace_blocks
from eaglewire.model.boundary_capture import capture
from eaglewire.model.dflash_blocks import mask_embedding, target_lm_head
from tiny import random_dflash_draft, tiny_target

V = 6


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", initializer_range=0.2, vocab_size=V)
    draft, contract = random_dflash_draft(target, block_size=4, num_layers=2, seed=1)
    text = torch.randint(0, V, (22,), generator=torch.Generator().manual_seed(3)).tolist()
    return target, draft, list(contract.aux_boundaries), text


def fused_prefix_states(target, layout, ids):
    """[1, p, k*H] the layout's states of a prefix, captured on the prefix alone (as a decoder has them)."""
    if not ids:  # the block anchored at 0 has no context
        return torch.zeros(1, 0, len([b for b in layout if b != target.num_layers]) * target.hidden_size)
    got = capture(target, torch.tensor([ids]), [b for b in layout if b != target.num_layers])
    return got.aux_hidden.float()


def decode_block(target, draft, layout, text, p, block_len):
    """What decoding drafts at anchor p: the context cache of x_0..x_{p-1}, then one block of
    ``block_len`` tokens -> (drafted ids [J], logits [J, V])."""
    emb = target.embed_tokens(torch.tensor([text])).float()  # [1, T, H]
    mask_emb = mask_embedding(draft, target.embed_tokens, emb.device)
    with torch.no_grad():
        ctx = draft.fuse(fused_prefix_states(target, layout, text[:p]))  # [1, p, H]
        cache = draft.context_kv(ctx, torch.arange(p)[None])
        if block_len == draft.config.block_size:
            hidden = draft.draft_block(emb[:, p], mask_emb, p, cache)[0]  # [J, H]
        else:  # llama.cpp's shorter block: [anchor, mask x (block_len - 1)], all attending to all
            block = torch.cat([emb[:, p:p + 1], mask_emb.expand(1, block_len - 1, -1)], dim=1)  # [1, bl, H]
            mask = torch.ones(1, 1, block_len, p + block_len, dtype=torch.bool)
            hidden = draft.forward_blocks(block, torch.arange(p, p + block_len)[None], cache, mask)[0, 1:]
        logits = target_lm_head(target)(hidden)  # [J, V]
    return logits.argmax(-1), logits


@pytest.mark.parametrize("block_len", [4, 2])
def test_the_trace_is_what_decoding_drafts_block_by_block(setup, block_len):
    """Column t of the trace is the block anchored at t + 1 decoded from a growing context cache: the
    same drafted tokens (judged against the text two plus position ahead) and the same probabilities."""
    target, draft, layout, text = setup
    trace = trace_blocks(target, draft, layout, text, 5, block_lens=[block_len])[block_len]
    J, T = block_len - 1, len(text)
    assert trace.right.shape == (J, T) and trace.block and trace.steps == J
    hits = 0
    for p in range(1, T - 1):
        drafted, logits = decode_block(target, draft, layout, text, p, block_len)
        inside = [p + j < T for j in range(1, J + 1)]
        expected = [inside[j] and int(drafted[j]) == text[p + 1 + j] for j in range(J)]
        assert trace.right[:, p - 1].tolist() == expected, p
        full, top = top_probs(logits)
        # one capture of the whole text against captures of each prefix: the same causal states,
        # computed over other shapes (summation order), so a tolerance
        torch.testing.assert_close(trace.prob[:, p - 1], full, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(trace.prob_top[:, p - 1], top, atol=1e-5, rtol=1e-4)
        hits += sum(expected)
    assert hits > 0  # some drafted tokens are right, so a shifted column would be seen


def test_greedy_target_prob_is_one_where_the_target_would_keep_the_draft(setup):
    target, draft, layout, text = setup
    trace = trace_blocks(target, draft, layout, text, 5)[4]
    logits = target.head(capture(target, torch.tensor([text]), [2]).last_hidden[0]).float()  # [T, V]
    for p in range(1, len(text) - 3):
        drafted, _ = decode_block(target, draft, layout, text, p, 4)
        for j in range(3):  # drafted position j + 1 is judged by the target at p + j
            assert float(trace.target_prob[j, p - 1]) == float(int(logits[p + j].argmax()) == int(drafted[j]))


# ------------------------------------------------------------------ rounds, costs, tune

from eaglewire.acceptance.costs import ChainProbe, EngineCosts, PlainProbe, fit_block_costs  # noqa: E402
from eaglewire.acceptance.recommend import block_shapes, predict, rank, recommend  # noqa: E402
from eaglewire.acceptance.simulate import Shape, drafted_tokens, greedy_rounds  # noqa: E402
from eaglewire.acceptance.trace import DraftTrace  # noqa: E402


def reference_rounds(target, draft, layout, text, prompt_len, n, block_len, p_min=0.0):
    """Greedy DFlash decoding whose target produced ``text``: each round's anchor is the last token the
    target produced, the block drafts from the states before it, the target keeps the leading drafts that
    match its own tokens, then its bonus. Returns the tokens each round gains. (The text need not be the
    tiny target's own greedy one, whose replies repeat one token: the rounds depend on it alone.)"""
    gained, p = [], prompt_len
    while p + n < len(text) - 1:
        drafted, logits = decode_block(target, draft, layout, text, p, block_len)
        keep = n
        if p_min > 0:  # llama.cpp: the first token whose top-10 probability falls below p_min stops it
            top = top_probs(logits)[1][:n]
            below = (top < p_min).nonzero()
            keep = int(below[0]) if len(below) else n
        m = 0
        while m < keep and int(drafted[m]) == text[p + 1 + m]:
            m += 1
        gained.append(m + 1)
        p += m + 1
    return gained


@pytest.mark.parametrize("engine, n, p_min", [("eaglewire", 3, 0.0), ("eaglewire", 2, 0.0), ("llamacpp", 2, 0.0),
                                              ("llamacpp", 3, 0.4)])
def test_simulated_block_rounds_are_decodings_own(engine, n, p_min):
    """Rounds walked over the block trace gain, round by round, what block decoding gains, and each
    runs ONE draft pass; llama.cpp's trace is that of its n_max + 1 block."""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=V)
    draft, contract = random_dflash_draft(target, block_size=4, num_layers=1, seed=2)
    layout = list(contract.aux_boundaries)
    block_len = n + 1 if engine == "llamacpp" else 4
    accepted = 0
    for seed in range(2):
        text = torch.randint(0, V, (26,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompt = text[:5 + seed]
        trace = trace_blocks(target, draft, layout, text, len(prompt), block_lens=[block_len])[block_len]
        got = greedy_rounds(trace, Shape(n, p_min, block=True), engine)
        want = reference_rounds(target, draft, layout, text, len(prompt), n, block_len, p_min)
        assert [r.gained for r in got] == want[:len(got)] and len(got) >= 4
        assert all(r.steps == 1 for r in got)
        accepted += sum(g - 1 for g in want)
    assert accepted > 0


def test_a_block_round_is_one_pass_however_many_it_keeps():
    trace = DraftTrace(prompt_len=1, right=torch.ones(3, 4, dtype=torch.bool), prob=torch.ones(3, 4),
                       prob_top=torch.tensor([[0.9] * 4, [0.2] * 4, [0.9] * 4]), target_prob=torch.ones(3, 4),
                       block=True)
    assert drafted_tokens(trace, 0, Shape(3, 0.5, block=True), "llamacpp") == (1, 1)  # stopped at position 2
    assert drafted_tokens(trace, 0, Shape(3, 0.5, n_min=2, block=True), "llamacpp") == (0, 1)  # dropped, still run
    assert drafted_tokens(trace, 0, Shape(3, block=True), "eaglewire") == (3, 1)
    chain = DraftTrace(prompt_len=1, right=trace.right, prob=trace.prob, prob_top=trace.prob_top,
                       target_prob=trace.target_prob)
    assert drafted_tokens(chain, 0, Shape(3), "eaglewire") == (3, 2)  # EAGLE-3: steps grow with the chain


def test_fit_block_costs_recovers_one_pass_per_round():
    """verify(k) = 10 + 2k ms and a pass of 3 + 0.5 n ms (llama.cpp's block grows with n_max): the fit
    reads both back, and a round's cost no longer grows by a draft step per token."""
    def run(n, rounds=50):
        return ChainProbe(n=n, rounds=rounds, decode_seconds=rounds * (10 + 2 * (n + 1) + 3 + 0.5 * n) / 1e3,
                          draft_seconds=rounds * (3 + 0.5 * n) / 1e3, steps_per_round=1)
    costs = fit_block_costs("llamacpp", PlainProbe(100, 1.2), [run(1), run(2), run(4), run(7)])
    assert costs.verify_at(5) == pytest.approx((10 + 2 * 5) / 1e3)
    assert costs.round_seconds(8, 1, n_max=7) == pytest.approx((10 + 16 + 3 + 3.5) / 1e3)
    assert costs.round_seconds(4, 1, n_max=3) == pytest.approx((10 + 8 + 3 + 1.5) / 1e3)  # read between 2 and 4
    assert costs.verify[1] > 0 and costs.to_dict()["draft_pass"]["7"] == pytest.approx(6.5e-3)
    with pytest.raises(ValueError, match="no block run"):
        fit_block_costs("llamacpp", PlainProbe(10, 1.0), [ChainProbe(2, 0, 0.0, 0.0, 1)])


def test_block_shapes_and_a_plain_verdict_with_the_tau_needed():
    assert [s.n_max for s in block_shapes(4, "eaglewire")] == [0, 1, 2, 3]
    assert len(block_shapes(4, "llamacpp", (0.0, 0.5))) == 1 + 3 * 2
    # every position right half the time: a round costs 3 plain steps, which nothing accepted here pays
    trace = DraftTrace(prompt_len=1, right=torch.rand(3, 40, generator=torch.Generator().manual_seed(0)) < 0.5,
                       prob=torch.ones(3, 40), prob_top=torch.ones(3, 40), target_prob=torch.ones(3, 40), block=True)
    costs = EngineCosts("eaglewire", plain_step=1.0, verify={1: 2.0, 4: 2.0}, draft_step=1.0)
    ranked = rank([predict(s, [trace], costs, sampled=False) for s in block_shapes(4, "eaglewire")])
    rec = recommend(ranked, "eaglewire")
    assert rec.choice.shape.plain and "round costs 3.00 plain steps" in rec.reason and "τ >=" in rec.reason
    assert {p.round_seconds for p in ranked if not p.shape.plain} == {3.0}  # one pass whatever n is


@pytest.mark.parametrize("engine", ["sglang", "eaglewire"])
def test_tune_ranks_a_dflash_drafts_block_shapes(tmp_path, target_dir, chat_tiny_target, engine):
    """`tune` on a DFlash draft ranks n = 1 .. block_size - 1 drafted tokens, a round costing one pass; a
    random draft is never recommended (plain, with the round's cost and the τ needed). SGLang is priced by its
    stated GPU model (its DFlash path is CUDA's; where it is installed here its CPU kernels refuse a tiny target)."""
    import json

    from eaglewire.cli import main
    from test_bench import write_prompts
    from tiny import save_random_dflash_draft

    draft = save_random_dflash_draft(tmp_path / "draft", chat_tiny_target, block_size=4)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    out = tmp_path / "tune.json"
    torch.set_num_threads(1)
    argv = ["tune", "--target", str(target_dir), "--draft", str(draft), "--dataset", str(prompts), "--offset", "0",
            "--num-prompts", "2", "--max-new-tokens", "12", "--engine", engine, "--out", str(out)]
    argv += ["--costs", "stated"] if engine == "sglang" else []
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(2)
    report = json.loads(out.read_text())
    shapes = [p["shape"] for p in report["ranked"]]
    assert sorted(s["n_max"] for s in shapes) == [0, 1, 2, 3] and all(s["block"] for s in shapes if s["n_max"])
    assert report["recommendation"]["shape"]["shape"]["n_max"] == 0
    assert "DFlash" in " ".join(report["costs"]["notes"])
    if engine == "eaglewire":  # verify(k) timed for every k a round can verify, one pass per round
        assert sorted(int(k) for k in report["costs"]["verify"]) == [1, 2, 3, 4] and report["costs"]["draft_step"] > 0
