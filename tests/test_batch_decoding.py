"""Batched decoding is batch-invariant: row b of a batch gets exactly the tokens and the per-row statistics
it gets decoded alone with the same seed (per-row random streams, a fixed count of draws per round).
Also: diagnostics outside the timed phases, and what a rule claims about TV (one host sync per round:
tests/test_compile.py, on the project's own models)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_models import TrigramCache, TrigramLM, autoregressive, speculative, trigram_pair

import ssd.decoding.observe as observe
from ssd.decoding.acceptance import ExactRule, GreedyRule, ToleranceRule
from ssd.decoding.generate import AdaptiveDraftLength
from ssd.decoding.observe import Instruments
from ssd.decoding.pcg import PCGRule
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig

VOCAB, EOS = 8, 7
LAW = SamplingConfig(top_k=5, ras_window=4, ras_tau=0.5, stop_tokens=(EOS,))
PROMPTS = [[1, 3, 2, 5, 0], [4], [2, 2, 6]]  # ragged
SEEDS = [11, 12345, 2**40 + 7]
MAX_LEN = [30, 9, 21]
MIN_LEN = [3, 0, 5]


class RaggedTrigramLM(TrigramLM):
    """TrigramLM whose prompt is a list of token lists of different lengths (each row its own length)."""

    def prefill(self, prompt: list[list[int]], max_new_tokens: int, taps=()):
        width = max(map(len, prompt)) + max_new_tokens
        tokens = torch.full((len(prompt), width), self.vocab_size, dtype=torch.long)
        for b, row in enumerate(prompt):
            tokens[b, : len(row)] = torch.tensor(row)
        cache = TrigramCache(tokens, torch.tensor([len(row) for row in prompt]))
        return cache, self._logits(cache, cache.lengths)


def _models(draft_noise: float = 1.0):
    target, draft = trigram_pair(VOCAB, seed=5, draft_noise=draft_noise)
    return RaggedTrigramLM(target.table), RaggedTrigramLM(draft.table)


def _assert_batch_equals_alone(decode):
    batch = decode(PROMPTS, SEEDS, MAX_LEN, MIN_LEN)
    alone = [decode([PROMPTS[b]], [SEEDS[b]], [MAX_LEN[b]], [MIN_LEN[b]]) for b in range(len(PROMPTS))]
    assert len({len(t) for t in batch.tokens}) > 1  # the rows really are ragged in output too
    for b, single in enumerate(alone):
        assert batch.tokens[b] == single.tokens[0], f"row {b}"
        assert batch.finish_reason[b] == single.finish_reason[0], f"row {b}"
        assert batch.rows[b] == single.rows[0], f"row {b}"
    return batch


# Both ways of refusing a stop token before min_len: the laws skip that step once no active row is short of
# its min_len, and a row past it must get the same law before and after that.
EOS_MODES = ["mask", "resample"]


@pytest.mark.parametrize("eos_mode", EOS_MODES)
def test_ar_rows_decode_as_they_would_alone(eos_mode):
    target, _ = _models()
    law = replace(LAW, eos_mode=eos_mode)

    def decode(prompts, seeds, max_len, min_len):
        return autoregressive(
            target, prompts, law, torch.tensor(max_len), torch.tensor(min_len), RowRandom(seeds)
        )

    batch = _assert_batch_equals_alone(decode)
    assert [r["tokens"] for r in batch.rows] == [len(t) for t in batch.tokens]


RULES = {
    "exact": ExactRule,
    "tolerance": lambda: ToleranceRule(beta=0.4),
    "pcg": lambda: PCGRule(
        theta=0.2, vectors=torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(1))
    ),
    # One thinning trial: many rejections are settled after the sync, also in rows that have finished.
    "pcg, settled": lambda: PCGRule(
        theta=0.2,
        vectors=torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(1)),
        thinning_trials=1,
    ),
}


@pytest.mark.parametrize("eos_mode", EOS_MODES)
@pytest.mark.parametrize("name", list(RULES))
def test_speculative_rows_decode_as_they_would_alone(name, eos_mode):
    target, draft = _models()
    rule, law = RULES[name](), replace(LAW, eos_mode=eos_mode)

    def decode(prompts, seeds, max_len, min_len):
        return speculative(target, draft, prompts, law, rule, 3, torch.tensor(max_len), torch.tensor(min_len),
                           RowRandom(seeds))  # fmt: skip

    batch = _assert_batch_equals_alone(decode)
    rounds = [r["rounds"] for r in batch.rows]
    assert len(set(rounds)) > 1 and batch.stats.rounds == max(rounds)  # rows finished at different rounds
    assert 0 < batch.stats.acceptance_rate < 1
    if name.startswith("pcg"):
        assert int(rule.groups.sizes.max()) > 1  # real groups, not one token each


def test_batch_level_stats_are_the_sums_of_the_rows():
    target, draft = _models()
    result = speculative(target, draft, PROMPTS, LAW, ToleranceRule(0.4), 3, torch.tensor(MAX_LEN), 0,
                         RowRandom(SEEDS))  # fmt: skip
    s, rows = result.stats, result.rows
    assert s.tokens == sum(r["tokens"] for r in rows) == sum(map(len, result.tokens))
    for key in ("proposed", "accepted", "overlap_sum", "tv_sum"):
        assert getattr(s, key) == pytest.approx([sum(v) for v in zip(*(r[key] for r in rows))], rel=1e-12)
    for r in rows:
        assert (
            r["target_calls"] == r["rounds"] == len(r["accepted_per_round"]) == len(r["draft_len_per_round"])
        )
        assert r["draft_calls"] == sum(r["draft_len_per_round"])
        assert r["proposed"][0] == r["rounds"] and sum(r["accepted"]) == sum(r["accepted_per_round"])
    assert sorted(n for r in rows for n in r["accepted_per_round"]) == sorted(
        n for r in s.accepted_per_round for n in r
    )


def test_batch_of_one_rows_equal_the_stats():
    target, draft = _models()
    result = speculative(target, draft, PROMPTS[:1], LAW, ToleranceRule(0.4), 3, 30, 0, RowRandom(SEEDS[:1]))
    row, s = result.rows[0], result.stats
    assert row["rounds"] == s.rounds and row["target_calls"] == s.target_calls
    assert row["draft_calls"] == s.draft_calls and row["tokens"] == s.tokens
    for key in ("proposed", "accepted", "overlap_sum", "tv_sum", "draft_len_per_round"):
        assert row[key] == getattr(s, key), key
    assert [[n] for n in row["accepted_per_round"]] == s.accepted_per_round


def test_a_different_seed_changes_the_row_negative_control():
    """The equality above is not vacuous: the same row with another seed decodes differently."""
    target, draft = _models()

    def decode(seed):
        return speculative(target, draft, PROMPTS[:1], LAW, ExactRule(), 3, 30, 0, RowRandom([seed])).tokens[
            0
        ]

    assert decode(SEEDS[0]) == decode(SEEDS[0]) != decode(SEEDS[0] + 1)


def test_adaptive_draft_length_refuses_a_batch():
    target, draft = _models()
    adaptive = AdaptiveDraftLength(start=2, min_len=1, max_len=6)
    with pytest.raises(
        ValueError, match="adaptive draft length shares one k across the batch.*fixed draft_len"
    ):
        speculative(target, draft, PROMPTS, LAW, ExactRule(), adaptive, 10, 0, RowRandom(SEEDS))
    single = speculative(target, draft, PROMPTS[:1], LAW, ExactRule(), adaptive, 30, 0, RowRandom(SEEDS[:1]))
    assert len(single.rows[0]["proposed"]) == 6 and len(set(single.stats.draft_len_per_round)) > 1


def test_diagnostics_run_outside_the_timed_phases(monkeypatch):
    """Every output_law (TV) call sits in the diagnostics phase: a deployment phase was closed right before it,
    and the lap after it is 'diagnostics'."""
    events = []
    lap = observe._Clock.lap
    monkeypatch.setattr(
        observe._Clock, "lap", lambda self, phase: (events.append(phase), lap(self, phase))[1]
    )
    rule = ToleranceRule(0.4)
    output_law = rule.output_law
    rule.output_law = lambda p, q: (events.append("output_law"), output_law(p, q))[1]
    target, draft = _models()
    result = speculative(target, draft, PROMPTS, LAW, rule, 3, torch.tensor(MAX_LEN), 0, RowRandom(SEEDS))
    calls = [i for i, e in enumerate(events) if e == "output_law"]
    assert len(calls) == result.stats.rounds
    assert all(events[i - 1] in ("accept", "draft") and events[i + 1] == "diagnostics" for i in calls)
    s = result.stats
    assert s.time_diagnostics > 0
    assert s.time_total == s.time_prefill + s.time_draft + s.time_verify + s.time_accept

    events.clear()
    quiet = speculative(target, draft, PROMPTS, LAW, rule, 3, torch.tensor(MAX_LEN), 0, RowRandom(SEEDS),
                        Instruments(diagnostics=False))  # fmt: skip
    assert "output_law" not in events and "diagnostics" not in events
    assert (
        quiet.stats.time_diagnostics == 0.0 and quiet.stats.tv_sum is None and quiet.stats.overlap_sum is None
    )
    assert all(r["tv_sum"] is None and r["overlap_sum"] is None for r in quiet.rows)
    assert quiet.tokens == result.tokens  # diagnostics draw no random numbers and change nothing


def test_greedy_at_temperature_one_does_not_claim_tv_zero():
    """Greedy verification equals greedy AR, which is NOT a sample of q at temperature 1: its per-step TV to q
    is 1 - max q (0.1-0.4 for these models), not the 0 an "exact" flag used to claim."""
    assert GreedyRule.deterministic and not GreedyRule.preserves_target_law
    assert ExactRule.preserves_target_law and not ToleranceRule(0.4).preserves_target_law
    assert ToleranceRule(0.0).preserves_target_law
    target, draft = _models()
    result = speculative(target, draft, PROMPTS, SamplingConfig(), GreedyRule(), 3, 20, 20, RowRandom(SEEDS))
    tv = result.stats.tv_per_position
    assert all(t > 0.05 for t in tv) and sum(tv) / len(tv) > 0.15, tv
    # Without diagnostics the TV is missing, never 0.
    quiet = speculative(target, draft, PROMPTS, SamplingConfig(), GreedyRule(), 3, 20, 20, RowRandom(SEEDS),
                        Instruments(diagnostics=False))  # fmt: skip
    assert quiet.stats.tv_sum is None and all(t != t for t in quiet.stats.tv_per_position)  # NaN
    # A rule that preserves q reports TV 0 (known by construction, not computed).
    exact = speculative(target, draft, PROMPTS, SamplingConfig(), ExactRule(), 3, 20, 20, RowRandom(SEEDS))
    assert exact.stats.tv_sum == [0.0, 0.0, 0.0]


def test_a_torch_generator_still_seeds_the_decode():
    target, draft = _models()

    def decode(seed):
        return speculative(target, draft, PROMPTS, LAW, ExactRule(), 3, 15, 0, torch.Generator().manual_seed(seed)
                           ).tokens  # fmt: skip

    assert decode(0) == decode(0) != decode(1)
    with pytest.raises(ValueError, match="3 rows: give one seed per row"):
        autoregressive(_models()[0], PROMPTS, LAW, 5, 0, RowRandom([1, 2]))
