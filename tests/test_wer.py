from __future__ import annotations

import pytest

from ssd.evaluation.wer import normalize_text, score_wer, summarize_wer, utterance_wer


def test_normaliser_removes_case_punctuation_and_number_format():
    assert normalize_text("Place the Blue cup, at FOUR now!") == "place the blue cup at 4 now"
    assert utterance_wer("Place the blue cup at four now.", "place the blue cup at 4 now").errors == 0


def test_edit_counts_on_hand_checked_example():
    # ref: a b c d / hyp: a x c d e -> b->x substituted, e inserted
    u = utterance_wer("apple bottle candle doctor", "apple hammer candle doctor engine")
    assert (u.substitutions, u.deletions, u.insertions, u.ref_words) == (1, 0, 1, 4)
    assert u.wer == pytest.approx(0.5)
    d = utterance_wer("apple bottle candle doctor", "apple doctor")
    assert (d.substitutions, d.deletions, d.insertions) == (0, 2, 0)


def test_corpus_and_mean_utterance_wer_differ_when_lengths_differ():
    refs = ["place the blue apple at nine now please again soon", "red window"]
    hyps = ["place the blue apple at nine now please again", "green wagon"]
    summary = score_wer(refs, hyps)
    # utterance 1: 1 deletion / 10 words; utterance 2: 2 substitutions / 2 words
    assert summary.errors == 3 and summary.ref_words == 12
    assert summary.corpus_wer == pytest.approx(3 / 12)
    assert summary.mean_utterance_wer == pytest.approx((0.1 + 1.0) / 2)


def test_corpus_and_mean_agree_for_equal_lengths():
    summary = score_wer(["red apple", "blue wagon"], ["red apple", "blue hammer"])
    assert summary.corpus_wer == pytest.approx(summary.mean_utterance_wer) == pytest.approx(0.25)


def test_empty_hypothesis_counts_every_word_as_deleted():
    u = utterance_wer("set the red kitten", "")
    assert (u.deletions, u.ref_words, u.wer) == (4, 4, 1.0)


def test_summary_fields_aggregate_from_per_utterance_counts():
    items = [utterance_wer("one two", "one three"), utterance_wer("red blue green", "red blue green green")]
    row = items[1].as_dict()
    assert row["insertions"] == 1 and row["wer"] == pytest.approx(1 / 3)
    assert summarize_wer(items).errors == sum(u.errors for u in items)


def test_bad_input_is_reported():
    with pytest.raises(ValueError, match="has no word after normalisation"):
        utterance_wer("?!", "hello")
    with pytest.raises(ValueError, match="2 references but 1 hypotheses"):
        score_wer(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no utterances"):
        summarize_wer([])
