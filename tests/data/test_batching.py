from eaglewire.data.batching import pack_by_tokens


def test_batches_keep_rows_times_longest_within_the_budget():
    lengths = [1, 2, 2, 3, 5, 9, 20]
    batches = pack_by_tokens(list(range(len(lengths))), lengths, 8)
    assert [i for b in batches for i in b] == list(range(len(lengths)))  # order kept, nothing lost
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 8
    assert batches[-1] == [6]  # longer than the budget: alone
    assert batches[0] == [0, 1, 2]  # greedy: a fourth row of 3 would need 12 > 8
