"""The engine's invariants: greedy speculative output == plain greedy output; sampling is lossless."""

import random

import pytest
import torch

from eaglewire.core.contract import HiddenStateContract
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.sampling import SamplingParams
from eaglewire.decode.tree import Tree
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from sampling_check import assert_matches, two_token_probs
from tiny import ARCHITECTURES, tiny_target


def random_draft(target, bounds=(2, 4, 5), seed=0):
    torch.manual_seed(seed)
    V = target.vocab_size
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(bounds), draft_vocab_size=V,
                                                vocab_size=V))
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return draft, HiddenStateContract(aux_boundaries=bounds, target=target.fingerprint)


def oracle_trees(decoder, reference, prompt_len, accept_prob, seed):
    """Replace the draft's tree builder with one that knows the greedy continuation and
    proposes it (each token right with ``accept_prob``) plus wrong siblings."""
    rng = random.Random(seed)
    V = decoder.target.vocab_size

    def build(root, P):
        done = P - prompt_len + 1  # tokens produced so far, the root included
        tokens, parents, parent = [root], [-1], 0
        for depth in range(decoder.spec.num_steps):
            right = reference[done + depth] if done + depth < len(reference) else 0
            wrong = (right + 1 + rng.randrange(V - 1)) % V  # never the right token
            main = right if rng.random() < accept_prob else wrong
            decoy = next(t for t in range(V) if t not in (right, main))
            tokens.append(main)
            parents.append(parent)
            parent = len(tokens) - 1
            if len(tokens) < decoder.spec.num_draft_tokens - (decoder.spec.num_steps - depth - 1):
                tokens.append(decoy)  # a sibling the target must reject
                parents.append(parents[parent])
        depths = [0] * len(tokens)
        for i in range(1, len(tokens)):
            depths[i] = depths[parents[i]] + 1
        return Tree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), depths=torch.tensor(depths),
                    scores=-torch.arange(len(tokens), dtype=torch.float))

    decoder.drafter.propose = build


@pytest.mark.parametrize("arch, lean", [(a, None) for a in ARCHITECTURES] + [("llama", False)])
@pytest.mark.parametrize("accept_prob", [0.0, 0.7, 1.0])
def test_greedy_speculation_equals_plain_greedy(arch, lean, accept_prob):
    target = tiny_target(arch, initializer_range=0.2)
    draft, contract = random_draft(target)
    for seed in range(2):
        prompt = torch.randint(0, 256, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = SpecDecoder(target, lean=lean).generate(prompt, max_new_tokens=16)
        decoder = SpecDecoder(target, draft, contract, SpecConfig(num_steps=4, topk=2, num_draft_tokens=9), lean=lean)
        oracle_trees(decoder, plain, len(prompt), accept_prob, seed)
        out, stats = decoder.generate(prompt, max_new_tokens=16)
        assert out == plain, f"{arch} seed {seed}"
        if accept_prob == 1.0:
            assert stats.accept_length == pytest.approx(5.0, abs=0.6)  # 4 drafts + bonus per round
        if accept_prob == 0.0:
            assert stats.accept_length == 1.0


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("spec", [SpecConfig(num_steps=3, topk=1, num_draft_tokens=4),
                                  SpecConfig(num_steps=3, topk=3, num_draft_tokens=8),
                                  SpecConfig(num_steps=3, topk=1, num_draft_tokens=4, min_prob=0.15),
                                  SpecConfig(num_steps=3, topk=3, num_draft_tokens=8, min_prob=0.15)])
def test_real_draft_chain_and_tree_equal_plain_greedy(arch, spec):
    """The draft's own trees (KV cache, tree masks, positions) never change greedy output.
    A tiny vocabulary makes random drafts right often enough to exercise acceptance."""
    target = tiny_target(arch, initializer_range=0.2, vocab_size=6)
    draft, contract = random_draft(target)
    accepted, verified = 0, []
    for seed in range(2):
        prompt = torch.randint(0, 6, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain, _ = SpecDecoder(target).generate(prompt, max_new_tokens=16)
        out, stats = SpecDecoder(target, draft, contract, spec).generate(prompt, max_new_tokens=16)
        assert out == plain
        accepted += sum(stats.accept_lengths) - stats.rounds
        verified += stats.verified_lengths
    assert accepted > 0
    if spec.min_prob == 0:
        assert set(verified) == {spec.num_draft_tokens}  # SGLang's fixed shape
    else:  # the least path probability shapes every round: some shorter, none longer
        assert min(verified) < spec.num_draft_tokens and max(verified) <= spec.num_draft_tokens


def test_stops_at_stop_token_and_limit():
    target = tiny_target("llama", initializer_range=0.2)
    prompt = [1, 2, 3]
    plain, stats = SpecDecoder(target).generate(prompt, max_new_tokens=10)
    assert len(plain) == 10 and stats.finish_reason == "length"
    out, stats = SpecDecoder(target).generate(prompt, max_new_tokens=10, stop_token_ids={plain[3]})
    assert out == plain[:plain.index(plain[3]) + 1] and stats.finish_reason == "stop"
    with pytest.raises(ValueError, match="prompt is empty"):
        SpecDecoder(target).generate([], max_new_tokens=3)


@pytest.mark.parametrize("min_prob", [0.0, 0.3])
def test_speculative_sampling_matches_the_target_distribution(min_prob):
    """Two sampled tokens after a fixed prompt: 36 outcomes with exactly known probabilities
    (also when the least path probability prunes the tree)."""
    V = 6
    target = tiny_target("llama", initializer_range=0.3, vocab_size=V, num_layers=2, hidden_size=32)
    draft, contract = random_draft(target, bounds=(0, 1))  # aux below L = 2
    params = SamplingParams(temperature=0.8)
    prompt = [1, 4, 2]
    exact = two_token_probs(target, prompt, params)  # [V*V]
    decoder = SpecDecoder(target, draft, contract, SpecConfig(num_steps=2, topk=2, num_draft_tokens=5,
                                                              min_prob=min_prob))
    n = 1500
    counts = torch.zeros(V * V)
    for seed in range(n):
        out, _ = decoder.generate(prompt, max_new_tokens=2,
                                  sampling=SamplingParams(temperature=0.8, seed=seed))
        counts[out[0] * V + out[1]] += 1
    assert_matches(counts, exact)


@pytest.mark.parametrize("lean", [None, False])
def test_a_decoder_serves_request_after_request(lean):
    """The target runner is made once and reset per request: a second, different prompt and
    then the first again decode exactly as on fresh decoders."""
    target = tiny_target("llama", initializer_range=0.2)
    draft, contract = random_draft(target)
    spec = SpecConfig(num_steps=3, topk=2, num_draft_tokens=5)
    prompts = [[5, 9, 17, 3], [100, 2, 8, 8, 41, 7, 1]]
    fresh = [SpecDecoder(target, draft, contract, spec, lean=lean).generate(p, max_new_tokens=12)[0] for p in prompts]
    decoder = SpecDecoder(target, draft, contract, spec, lean=lean)
    assert [decoder.generate(p, max_new_tokens=12)[0] for p in prompts + prompts[:1]] == fresh + fresh[:1]


@pytest.mark.parametrize("spec", [SpecConfig.chain(3), SpecConfig(num_steps=3, topk=3, num_draft_tokens=8)])
def test_static_runner_decodes_as_plain(spec):
    """The static forward (what CUDA graphs replay) inside the loop: chains and trees give plain greedy output."""
    from eaglewire.decode.runner import LeanRunner

    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    draft, contract = random_draft(target)
    prompt = [1, 4, 2, 5, 0, 3]
    plain, _ = SpecDecoder(target).generate(prompt, max_new_tokens=20)
    decoder = SpecDecoder(target, draft, contract, spec)
    decoder._target_runner = LeanRunner(target, decoder.boundaries, max_length=8, static=True)  # grows mid-way
    out, stats = decoder.generate(prompt, max_new_tokens=20)
    assert out == plain and sum(stats.accept_lengths) > stats.rounds


SPECS = [SpecConfig.chain(3), SpecConfig(num_steps=3, topk=3, num_draft_tokens=8),
         SpecConfig(num_steps=3, topk=3, num_draft_tokens=8, min_prob=0.05)]


def static_drafter(target, draft, spec, device, *, width, graphs, whole_rounds=True):
    """An EAGLE-3 drafter over the fixed-width cache (``width`` columns first), its steps replayed from graphs or
    run eagerly, a round drafted whole or a level at a time."""
    from eaglewire.decode.eagle3_drafter import Eagle3Drafter
    from eaglewire.decode.kv_cache import StaticDraftCache

    drafter = Eagle3Drafter(target, draft, spec, static=True, graphs=graphs)
    drafter.cache = StaticDraftCache(drafter.draft, width, torch.device(device), torch.float32, graphs=graphs)
    drafter.whole_rounds = whole_rounds and drafter.whole_rounds
    return drafter


@pytest.mark.parametrize("spec", SPECS)
def test_static_draft_cache_drafts_as_the_growing_one(spec):
    """The draft's fixed-width cache (what CUDA graphs replay; here eagerly, from a width that must grow), a round
    drafted whole (no floor) or a level at a time (``--draft-min-prob``), drafts the same trees as the growing
    one: the same accept lengths and output, request after request."""
    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    draft, contract = random_draft(target)
    prompts = [[1, 4, 2, 5, 0, 3], [2, 2, 5, 1]]
    growing = SpecDecoder(target, draft, contract, spec)
    static = SpecDecoder(target, draft, contract, spec)
    static.drafter = static_drafter(target, draft, spec, "cpu", width=4, graphs=False)
    assert static.drafter.whole_rounds == (spec.min_prob == 0)
    for prompt in prompts:
        want, want_stats = growing.generate(prompt, max_new_tokens=20)
        got, got_stats = static.generate(prompt, max_new_tokens=20)
        assert got == want and got_stats.accept_lengths == want_stats.accept_lengths
    assert sum(got_stats.accept_lengths) > got_stats.rounds and static.drafter.cache.k.shape[2] > 4


@pytest.mark.parametrize("spec", SPECS[:2])
def test_a_whole_round_drafts_the_level_at_a_time_candidates_exactly(spec, monkeypatch):
    """A round drafted whole (``draft_round``: one graph on CUDA) and a level at a time over the same fixed-width
    cache run the same kernels on the same inputs: the same candidates, scores to the bit, round after round."""
    from eaglewire.decode import eagle3_drafter

    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    draft, contract = random_draft(target)
    seen = {True: [], False: []}
    read, grow = eagle3_drafter.read_candidates, eagle3_drafter.grow_tree
    for whole in (True, False):  # the whole round reads its packed candidates, the level-at-a-time one grows them
        monkeypatch.setattr(eagle3_drafter, "read_candidates", lambda packed, _w=whole: seen[_w].append(read(packed))
                            or seen[_w][-1])
        monkeypatch.setattr(eagle3_drafter, "grow_tree", lambda *a, _w=whole, **kw: seen[_w].append(grow(*a, **kw))
                            or seen[_w][-1])
        decoder = SpecDecoder(target, draft, contract, spec)
        decoder.drafter = static_drafter(target, draft, spec, "cpu", width=64, graphs=False, whole_rounds=whole)
        decoder.generate([1, 4, 2, 5, 0, 3], max_new_tokens=20)
    assert len(seen[True]) == len(seen[False]) > 3 and seen[True] == seen[False]


def graphs_draft_as_eagerly(spec: SpecConfig) -> None:
    """On CUDA a round (without a floor: the whole round; with one: each level's draft step, its head's
    log-softmax and top-k) replays its graph, and the target's steps theirs: the same kernels as eagerly, so the
    same trees, accept lengths and output as the eager static caches, and plain greedy output (fp32)."""
    from eaglewire.decode.runner import LeanRunner

    target = tiny_target("llama", initializer_range=0.2, vocab_size=6)
    prompts = [[1, 4, 2, 5, 0, 3], [2, 2, 5, 1]]
    target.model.to("cuda")
    try:
        plain = [SpecDecoder(target).generate(p, max_new_tokens=20)[0] for p in prompts]  # on the same device
        draft, contract = random_draft(target)
        graphs = SpecDecoder(target, draft, contract, spec)
        eager = SpecDecoder(target, draft, contract, spec)
        eager.drafter = static_drafter(target, draft, spec, "cuda", width=64, graphs=False)
        eager._target_runner = LeanRunner(target, eager.boundaries, static=True)
        eager._target_runner.graphs = None
        for prompt, want_plain in zip(prompts, plain):
            want, want_stats = eager.generate(prompt, max_new_tokens=20)
            got, got_stats = graphs.generate(prompt, max_new_tokens=20)
            assert got == want == want_plain and got_stats.accept_lengths == want_stats.accept_lengths
        assert sum(got_stats.accept_lengths) > got_stats.rounds
        cache = graphs.drafter.cache
        step = f"round {spec.num_steps}x{spec.topk}" if spec.min_prob == 0 else f"level top-{spec.topk}"
        assert cache.use_graphs and graphs.drafter.whole_rounds == (spec.min_prob == 0) and len(cache.graphs[step]) > 0
        assert graphs._target_runner.graphs is not None and len(graphs._target_runner.graphs) > 1  # steps, verifies
    finally:
        target.model.to("cpu")


@pytest.mark.parametrize("spec", SPECS)
def test_draft_levels_and_steps_replayed_from_graphs_on_the_stand_in_for_cuda(spec):
    """The CUDA path, graphs and all, on the CPU's stand-in (fake_cuda's graphs replay the captured calls into
    the captured buffers and refuse a host read inside a capture): no fallback, the eager output."""
    from fake_cuda import fake_cuda

    with fake_cuda(graphs=True):
        graphs_draft_as_eagerly(spec)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the stand-in's test covers the path")
@pytest.mark.parametrize("spec", SPECS)
def test_draft_levels_replayed_from_graphs_draft_as_eagerly_on_cuda(spec):
    graphs_draft_as_eagerly(spec)
