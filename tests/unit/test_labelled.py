"""Labelled records as pure functions (data/labelled.py): class names, the stratified split's rule, encoding with
the tokenizer's own special tokens (truncated or windowed), and the classifier's figures (model/tasks.py)."""

from __future__ import annotations

import random

import pytest

from sparklm.data import labelled
from sparklm.registry import CLASSES, NO_LABELS, VALUES
from sparklm.tasks.classify import classify_figures


def test_label_cells_become_class_names_or_values():
    assert [CLASSES.read(v) for v in ("pos ", 1, 1.0, True, "", "  ", None, float("nan"), 2.5, [1])] == \
        ["pos", "1", "1", "true", None, None, None, None, "2.5", None]
    assert [VALUES.read(v) for v in (" 2.5", 1, "1e3", True, "", "abc", None, float("nan"), "inf", [1], 10**400)] == \
        ["2.5", "1.0", "1000.0", None, None, None, None, None, None, None, None]
    assert NO_LABELS.read("pos") is None and not NO_LABELS.labelled


def test_a_label_kind_says_its_column_split_and_figures():
    """What both prepare engines ask of a dataset's labels (registry.py): classes are int64 ids split per class and
    counted per id; values are float32 targets hash-split, summed up as rows, mean, std, min and max (mergeable
    tallies of each written part)."""
    assert (CLASSES.column, CLASSES.stratified, VALUES.column, VALUES.stratified) == ("int64", True, "float32", False)
    assert CLASSES.encode(["b", "a", "b"], {"a": 0, "b": 1}) == [1, 0, 1]
    assert CLASSES.tally(CLASSES.tally(None, [1, 0, 1]), [1]) == [[0, 1], [1, 3]]
    parts = [VALUES.tally(None, [1.0, 2.0]), VALUES.tally(VALUES.tally(None, [3.0]), [6.0])]
    f = VALUES.figures(parts)
    assert f == {"rows": 4, "mean": 3.0, "std": pytest.approx(1.8708287), "min": 1.0, "max": 6.0}
    assert VALUES.figures([]) == {"rows": 0}


def test_classes_are_ordered_numerically_or_alphabetically():
    assert labelled.ordered(["10", "2", "1", "2"]) == ["1", "2", "10"]
    assert labelled.ordered(["b", "a", "10"]) == ["10", "a", "b"]


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.1, 0.5])
def test_the_stratified_split_takes_each_class_share_by_hash_whatever_the_order(fraction):
    rng = random.Random(1)
    records = [(rng.getrandbits(64) - 2**63, rng.choice("abc")) for _ in range(500)] + [(7, "lonely")]
    by_label: dict[str, list[int]] = {}
    for key, label in records:
        by_label.setdefault(label, []).append(key)
    cut = labelled.thresholds(by_label, fraction)
    shuffled = records[:]
    rng.shuffle(shuffled)
    cut_again = labelled.thresholds({k: list(reversed(v)) for k, v in by_label.items()}, fraction)
    assert cut == cut_again  # the order of the records does not matter
    for label, keys in by_label.items():
        val = [k for k in keys if labelled.split_of("auto", k, label, cut) == "validation"]
        assert len(val) == labelled.validation_count(len(keys), fraction)
        if val:  # the smallest hashes of the class
            assert sorted(keys)[:len(val)] == sorted(val)
    assert "lonely" not in cut  # a class of one stays in train
    assert labelled.split_of("validation", 2**62, "a", cut) == "validation"
    assert labelled.split_of("train", -(2**63), "a", cut) == "train"


def test_validation_counts_round_and_keep_every_class_scored():
    assert [labelled.validation_count(n, 0.1) for n in (0, 1, 2, 5, 10, 14, 15, 100)] == [0, 0, 1, 1, 1, 1, 2, 10]
    assert labelled.validation_count(10, 0.0) == 0 and labelled.validation_count(3, 0.9) == 2


def _wordpiece():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *"abcdefghij"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return tok


def test_texts_are_framed_padded_truncated_and_counted():
    enc = labelled.encode(_wordpiece(), ["a b", "a b c d e f g h"], None, seq_len=6, window=False, overlap=0, pad_id=0)
    assert enc.input_ids.tolist() == [[2, 4, 5, 3, 0, 0], [2, 4, 5, 6, 7, 3]]
    assert enc.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert enc.source.tolist() == [0, 1] and enc.truncated == 1 and enc.dropped == 4 and enc.token_type_ids is None


def test_long_texts_are_cut_into_windows_that_cover_every_token():
    text = " ".join("abcdefghij")
    enc = labelled.encode(_wordpiece(), [text, "a"], None, seq_len=6, window=True, overlap=1, pad_id=0)
    rows = enc.input_ids.tolist()
    assert all(r[0] == 2 for r in rows) and enc.source.tolist() == [0, 0, 0, 1] and enc.truncated == 1
    seen = [t for r, s in zip(rows, enc.source) if s == 0 for t in r if t not in (0, 2, 3)]
    assert sorted(set(seen)) == list(range(4, 14))  # every token in some window
    assert rows[0][1:5] == [4, 5, 6, 7] and rows[1][1] == 7  # the next window starts one token back (overlap 1)


def test_pairs_carry_segment_ids():
    enc = labelled.encode(_wordpiece(), ["a b"], ["c"], seq_len=8, window=False, overlap=0, pad_id=0)
    assert enc.input_ids.tolist() == [[2, 4, 5, 3, 6, 3, 0, 0]]
    assert enc.token_type_ids.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0]]


def test_a_sequence_with_no_room_for_text_is_refused():
    from sparklm.infra.errors import SparklmError

    with pytest.raises(SparklmError, match="no room"):
        labelled.encode(_wordpiece(), ["a"], None, seq_len=2, window=False, overlap=0, pad_id=0)


def test_classifier_figures_from_a_confusion_matrix():
    # true a: 3 right, 1 as b; true b: 2 right; c never seen nor predicted
    cm = [3, 1, 0, 0, 2, 0, 0, 0, 0]
    f = classify_figures([6.0, 6, 5, *cm], ["a", "b", "c"])
    assert f["accuracy"] == pytest.approx(5 / 6) and f["loss"] == pytest.approx(1.0) and f["examples"] == 6
    pa, ra = 3 / 3, 3 / 4
    pb, rb = 2 / 3, 2 / 2
    f1 = [2 * p * r / (p + r) for p, r in ((pa, ra), (pb, rb))]
    assert f["macro_f1"] == pytest.approx(sum(f1) / 2)
    assert f["per_class"]["a"]["recall"] == pytest.approx(ra) and f["per_class"]["b"]["precision"] == pytest.approx(pb)
    assert "c" not in f["per_class"] and f["confusion"]["matrix"] == [[3, 1, 0], [0, 2, 0], [0, 0, 0]]
    assert classify_figures([0.0, 0, 0, *cm], ["a", "b", "c"]) == {}
