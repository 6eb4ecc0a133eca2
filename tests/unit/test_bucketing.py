"""generate.bucketed: the order rows are generated in, so that batches pad less."""

from sparklm.infer.generate import bucketed


def _rows(lengths):
    return [(key, 0, "p", list(range(n)), False) for key, n in enumerate(lengths)]


def test_rows_of_one_batch_keep_their_order():
    assert bucketed(_rows([9, 1, 5]), 8) == [0, 1, 2]


def test_more_than_one_batch_goes_by_length_ties_in_order():
    order = bucketed(_rows([9, 1, 5, 1, 9, 2]), 2)
    assert order == [1, 3, 5, 2, 0, 4]
    assert sorted(order) == list(range(6))  # every row once


def test_bucketing_cuts_the_padding_of_mixed_lengths():
    lengths = [3, 200, 5, 180, 4, 190, 6, 170]

    def padded(order):  # tokens computed: each batch of 2 pads to its longest prompt
        return sum(2 * max(lengths[i] for i in order[b:b + 2]) for b in range(0, len(order), 2))

    assert padded(bucketed(_rows(lengths), 2)) < 0.6 * padded(list(range(len(lengths))))
