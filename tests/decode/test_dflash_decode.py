"""A DFlash draft in the engine: greedy output is plain greedy output, sampling keeps the target's
distribution, an oracle block gets every drafted token accepted, the context is the target's tokens."""

import functools
import math

import pytest
import torch

from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.runner import make_runner
from eaglewire.decode.sampling import SamplingParams
from eaglewire.decode.tree import block_tree
from sampling_check import assert_matches, two_token_probs
from tiny import random_dflash_draft, tiny_target

SHAPES = [  # (block size, speculation)
    (4, SpecConfig.chain(1)),
    (4, SpecConfig.chain(3)),
    (8, SpecConfig.chain(5)),
    (8, SpecConfig(num_steps=4, topk=2, num_draft_tokens=8)),
    (4, SpecConfig.chain(3, min_prob=0.2)),
]


@functools.lru_cache(maxsize=None)
def target_of(arch, vocab_size):
    """Made once per module: a random target takes seconds to build on a busy machine."""
    return tiny_target(arch, initializer_range=0.2, vocab_size=vocab_size)


def prompt_of(seed, length, vocab):
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("lean, block_size, spec",  # None: the lean runner on these architectures; False: HF's
                         [(None, *shape) for shape in SHAPES] + [(False, *SHAPES[0]), (False, *SHAPES[3])])
def test_greedy_dflash_equals_plain_greedy(arch, lean, block_size, spec):
    """A tiny vocabulary makes a random block right often enough to exercise acceptance."""
    target = target_of(arch, 6)
    draft, contract = random_dflash_draft(target, block_size=block_size)
    accepted = 0
    for seed in range(3):
        prompt = prompt_of(seed, 5 + seed, 6)
        plain, _ = SpecDecoder(target, lean=lean).generate(prompt, max_new_tokens=20)
        out, stats = SpecDecoder(target, draft, contract, spec, lean=lean).generate(prompt, max_new_tokens=20)
        assert out == plain, f"seed {seed}"
        assert max(stats.verified_lengths) <= spec.num_draft_tokens
        assert len(stats.position_accepts) == spec.num_steps and stats.draft_seconds > 0
        accepted += sum(stats.accept_lengths) - stats.rounds
    assert accepted > 0


def oracle(decoder, sequence):
    """Make the decoder's DFlash block an oracle: the output at block position j names the token at
    ``position + j`` of ``sequence`` (the prompt and the plain greedy continuation), as the draft's
    alignment says it predicts. It also checks what the block is given: the anchor is the token at
    ``position`` and the context holds exactly the tokens before it."""
    drafter = decoder.drafter
    bs, V = drafter.draft.config.block_size, decoder.target.vocab_size
    anchors = []

    def draft_block(anchor_emb, mask_emb, position, ctx_kv):
        assert ctx_kv[0][0].shape[2] == position  # the context: tokens 0..position-1
        anchors.append(position)
        want = decoder.target.embed_tokens(torch.tensor([sequence[position]])).to(anchor_emb.dtype)
        torch.testing.assert_close(anchor_emb, want, rtol=0, atol=0)
        named = torch.zeros(1, bs - 1, V)
        for j in range(1, bs):
            named[0, j - 1, sequence[position + j]] = 1.0
        return named  # read by the lm_head below as logits

    drafter.draft.draft_block = draft_block
    drafter.lm_head = lambda h: 20.0 * h
    return anchors


@pytest.mark.parametrize("arch, lean", [("llama", None), ("llama", False), ("qwen3", None)])
@pytest.mark.parametrize("block_size, spec", [(4, SpecConfig.chain(3)), (8, SpecConfig.chain(7)),
                                              (8, SpecConfig.chain(2)),
                                              (4, SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))])
def test_an_oracle_block_gets_every_drafted_token_accepted(arch, lean, block_size, spec):
    target = target_of(arch, 256)
    draft, contract = random_dflash_draft(target, block_size=block_size)
    prompt, new = prompt_of(1, 7, 256), 17
    reference, _ = SpecDecoder(target, lean=lean).generate(prompt, max_new_tokens=new + block_size)
    decoder = SpecDecoder(target, draft, contract, spec, lean=lean)
    anchors = oracle(decoder, prompt + reference)
    out, stats = decoder.generate(prompt, max_new_tokens=new)
    assert out == reference[:new]
    n = spec.num_steps
    assert stats.accept_lengths == [n + 1] * math.ceil((new - 1) / (n + 1))  # every round: n drafts + the bonus
    assert stats.position_acceptance == [1.0] * n
    assert anchors == [len(prompt) + r * (n + 1) for r in range(stats.rounds)]  # each round's root, at P


@pytest.mark.parametrize("lean", [None, False])
@pytest.mark.parametrize("use_oracle", [False, True])
def test_the_context_holds_exactly_the_tokens_the_target_processed(lean, use_oracle):
    """After generation the draft's context K/V are those of the fused target states of the tokens
    the target has in its cache, at their positions, as one prefill over them computes them. The
    tree (topk 2) makes the accepted path skip rejected siblings' rows."""
    target = target_of("llama", 256 if use_oracle else 6)
    V = target.vocab_size
    draft, contract = random_dflash_draft(target, block_size=4)
    prompt = prompt_of(2, 6, V)
    reference, _ = SpecDecoder(target, lean=lean).generate(prompt, max_new_tokens=20)
    decoder = SpecDecoder(target, draft, contract, SpecConfig(num_steps=3, topk=2, num_draft_tokens=6), lean=lean)
    if use_oracle:
        oracle(decoder, prompt + reference)
    out, stats = decoder.generate(prompt, max_new_tokens=14)
    assert out == reference[:14]
    P = decoder._target_runner.length
    assert decoder.drafter.context.length == P == len(prompt) + sum(stats.accept_lengths)
    processed = (prompt + reference)[:P]
    runner = make_runner(target, list(contract.aux_boundaries), lean=lean)
    with torch.no_grad():
        _, aux = runner.forward(torch.tensor(processed), torch.arange(P), None)  # [P, k*H]
        expected = decoder.drafter.draft.context_kv(decoder.drafter.draft.fuse(aux[None]), torch.arange(P)[None])
    for (k, v), (k_want, v_want) in zip(decoder.drafter.context.kv, expected):
        # One prefill against many verify blocks: the target's GEMMs sum in another order.
        torch.testing.assert_close(k, k_want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, v_want, rtol=1e-4, atol=1e-5)


def test_dflash_sampling_matches_the_target_distribution():
    """Two sampled tokens after a fixed prompt: 36 outcomes with exactly known probabilities (as the
    EAGLE-3 test in test_spec_decoder.py checks it). The tree's first child is a chain's token; its
    second is tried on the residual, so the one shape exercises both."""
    spec = SpecConfig(num_steps=2, topk=2, num_draft_tokens=5)
    V = 6
    target = tiny_target("llama", initializer_range=0.3, vocab_size=V, num_layers=2, hidden_size=32)
    draft, contract = random_dflash_draft(target, (0, 1), block_size=3)  # aux below L = 2
    params = SamplingParams(temperature=0.8)
    prompt = [1, 4, 2]
    exact = two_token_probs(target, prompt, params)  # [V*V]
    decoder = SpecDecoder(target, draft, contract, spec)
    n = 1500
    counts = torch.zeros(V * V)
    accepted = 0
    for seed in range(n):
        out, stats = decoder.generate(prompt, max_new_tokens=2, sampling=SamplingParams(temperature=0.8, seed=seed))
        counts[out[0] * V + out[1]] += 1
        accepted += sum(stats.accept_lengths) - stats.rounds
    assert accepted > n // 10  # the drafts were accepted often: the rejection rule was exercised
    assert_matches(counts, exact)


def test_more_steps_than_the_block_drafts_is_refused_naming_the_flag():
    target = target_of("llama", 256)
    draft, contract = random_dflash_draft(target, block_size=4)
    with pytest.raises(ValueError, match=r"--speculative-num-steps 4: .* block size 4 drafts at most 3 .* "
                                         r"--speculative-num-steps 3 or lower"):
        SpecDecoder(target, draft, contract, SpecConfig.chain(4))


def test_a_block_tree_is_each_positions_best_tokens():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 2.5], [0.0, 0.0, 4.0]]), -1)  # [n 3, V 3]
    chain = block_tree(7, logprobs, 1, 4)
    assert chain.tokens.tolist() == [7, 1, 2, 2] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.depths.tolist() == [0, 1, 2, 3]
    assert chain.scores[-1] == pytest.approx(float(logprobs.max(-1).values.sum()))
    cut = block_tree(7, logprobs, 1, 4, min_score=float(logprobs[0, 1] + logprobs[1, 2]) - 1e-6)
    assert cut.tokens.tolist() == [7, 1, 2]  # the third token's path falls below the floor
    tree = block_tree(7, logprobs, 2, 5)
    assert len(tree) == 5
    top2 = logprobs.topk(2, dim=-1).indices  # [n, 2]
    for i in range(1, len(tree)):  # every node: one of its position's two best tokens, scored along its path
        d, parent, tok = int(tree.depths[i]), int(tree.parents[i]), int(tree.tokens[i])
        assert int(tree.depths[parent]) == d - 1 and tok in top2[d - 1].tolist()
        assert float(tree.scores[i]) == pytest.approx(float(tree.scores[parent]) + float(logprobs[d - 1, tok]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_static_block_pass_is_the_growing_contexts(arch):
    """The fixed-width context and its block pass (what a CUDA graph replays) give the block the growing context's
    log-probabilities, round after round, and the same context K/V, also across a growth of its buffer. fp32; the
    static pass attends over the whole buffer through a bias, another SDPA call and summation order (so close,
    not equal)."""
    from eaglewire.decode.dflash_drafter import DFlashDrafter, StaticDFlashContext

    target = target_of(arch, 256)
    draft, contract = random_dflash_draft(target, block_size=4)
    prompt = prompt_of(3, 9, 256)
    runner = make_runner(target, list(contract.aux_boundaries))
    with torch.no_grad():
        _, aux = runner.forward(torch.tensor(prompt), torch.arange(len(prompt)), None)  # [P, k*H]
    shape = dict(num_steps=3, topk=1, num_draft_tokens=4, min_score=-math.inf, steps_flag="--steps")
    growing = DFlashDrafter(target, draft, **shape, static=False)
    static = DFlashDrafter(target, draft, **shape, static=True)
    static.context = StaticDFlashContext(static.draft, 4, target.device, static.dtype)  # outgrown below
    growing.start(aux[:5])
    static.start(aux[:5], capacity=6)  # 6 + a block: 10 columns, then the rounds need 11 and 13
    for lo, hi in ((5, 5), (5, 7), (7, 9)):  # the tokens each round's target processed, then the next root
        for drafter in (growing, static):
            if hi > lo:
                drafter.extend(aux[lo:hi], None, lo)
        root = prompt[hi] if hi < len(prompt) else 11
        torch.testing.assert_close(static.block_logprobs(root, hi), growing.block_logprobs(root, hi),
                                   rtol=1e-4, atol=1e-5)
    assert static.context.length == growing.context.length == 9 and static.context.width >= 13
    for layer, (k, v) in enumerate(growing.context.kv):
        torch.testing.assert_close(static.context.k[layer, :, :, :9], k, rtol=0, atol=0)  # written, not computed again
        torch.testing.assert_close(static.context.v[layer, :, :, :9], v, rtol=0, atol=0)


def dflash_graphs_draft_as_eagerly(spec: SpecConfig) -> None:
    """On CUDA a DFlash round's block pass replays one graph over the static context (and the target's steps
    theirs): the same kernels as the eager static pass, so the same trees, accept lengths and output, which is
    plain greedy output (fp32)."""
    from eaglewire.decode.dflash_drafter import StaticDFlashContext
    from eaglewire.decode.runner import LeanRunner

    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    prompts = [prompt_of(seed, 5 + seed, 6) for seed in range(3)]
    target.model.to("cuda")
    try:
        plain = [SpecDecoder(target).generate(p, max_new_tokens=20)[0] for p in prompts]  # on the same device
        draft, contract = random_dflash_draft(target, block_size=4)
        graphs = SpecDecoder(target, draft, contract, spec)
        eager = SpecDecoder(target, draft, contract, spec)
        eager.drafter.graphs = None  # the static context's block pass, run eagerly
        eager._target_runner = LeanRunner(target, eager.boundaries, static=True)
        eager._target_runner.graphs = None
        accepted = 0
        for prompt, want_plain in zip(prompts, plain):
            want, want_stats = eager.generate(prompt, max_new_tokens=20)
            got, got_stats = graphs.generate(prompt, max_new_tokens=20)
            assert got == want == want_plain and got_stats.accept_lengths == want_stats.accept_lengths
            accepted += sum(got_stats.accept_lengths) - got_stats.rounds
        assert accepted > 0  # drafts were kept: the blocks' trees were compared, not just the roots
        assert isinstance(graphs.drafter.context, StaticDFlashContext) and len(graphs.drafter.graphs) == 1
    finally:
        target.model.to("cpu")


@pytest.mark.parametrize("spec", [SpecConfig.chain(3), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)])
def test_dflash_block_passes_replayed_from_a_graph_on_the_stand_in_for_cuda(spec):
    """The CUDA path on the CPU's stand-in (its graphs replay the captured calls into the captured buffers and
    refuse a host read inside a capture): no fallback, the eager output."""
    from fake_cuda import fake_cuda

    with fake_cuda(graphs=True):
        dflash_graphs_draft_as_eagerly(spec)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the stand-in's test covers the path")
@pytest.mark.parametrize("spec", [SpecConfig.chain(3), SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)])
def test_dflash_block_passes_replayed_from_a_graph_draft_as_eagerly_on_cuda(spec):
    dflash_graphs_draft_as_eagerly(spec)
