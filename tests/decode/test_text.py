"""Incremental text: the same text and the same stop as decoding the whole output every time."""

import random

from eaglewire.decode.text import IncrementalDetokenizer, StopStrings, TextStream


def sample_ids(tok, seed: int, n: int = 60) -> list[int]:
    """Real text with multi-byte characters (split over byte tokens) and some random tokens."""
    rng = random.Random(seed)
    ids = tok("Grüße, 東京! naïve café — 🙂 ok.\n  x = [1, 2]", add_special_tokens=False)["input_ids"]
    ids += [rng.randrange(len(tok)) for _ in range(n)]
    if seed % 2:
        rng.shuffle(ids)
    return ids


def test_incremental_text_equals_the_whole_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for seed in range(4):
        ids = sample_ids(tok, seed)
        for chunk in (1, 3, 7):
            detok = IncrementalDetokenizer(tok)
            deltas = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
            text = "".join(deltas) + detok.flush()
            assert text == detok.text == tok.decode(ids, skip_special_tokens=True), (seed, chunk)


def test_stop_fires_at_the_token_a_whole_decode_would(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = sample_ids(tok, 0, n=0)
    full = tok.decode(ids, skip_special_tokens=True)
    for stop in ("東京", "é —", "🙂", "[1", "\n  x", "never"):
        whole = next((j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j], skip_special_tokens=True)), None)
        stops = StopStrings(tok, [stop])
        seen = next((j for j in range(1, len(ids) + 1) if stops(ids[:j])), None)
        assert seen == whole, stop
        text = TextStream(tok, [stop])
        shown = "".join(text.push(ids[i:i + 4]) for i in range(0, len(ids), 4)) + text.finish()
        assert shown == StopStrings(tok, [stop]).cut(full), stop


def test_a_shorter_list_starts_a_new_sequence(smollm2_tokenizer):
    tok = smollm2_tokenizer
    stops = StopStrings(tok, ["b"])
    a, b = tok("aaaa b", add_special_tokens=False)["input_ids"], tok("cc", add_special_tokens=False)["input_ids"]
    assert stops(a) and not stops(b)
