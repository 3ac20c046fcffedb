"""Statistical certificates of the decoding loops, with negative controls.

The joint law of the first three generated tokens under AR sampling is enumerated
exactly (float64, the same sampling transform, RAS window and EOS rule included).
Speculative decoding's samples must pass a chi-square goodness-of-fit test against
it (p > 1e-3, fixed seed, 20,000 sequences decoded as one batch), and deliberately
broken variants must FAIL the same test (p < 1e-3).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import fields

import numpy as np
import pytest
import torch
from engine_models import StaleWindowLaw, autoregressive, chi_square_fit, speculative, trigram_pair

from ssd.decoding.acceptance import ExactRule, GreedyRule, TargetOnlyRule, ToleranceRule
from ssd.decoding.generate import AdaptiveDraftLength, PaddedVerify
from ssd.decoding.sampling import SamplingConfig, distribution
from ssd.drafters.autoregressive import AutoregressiveDrafter, AutoregressiveSession

P_REJECT = 1e-3
N_SEQ = 20_000
VOCAB, EOS = 5, 4  # tokens 0..3 and a stop token
PLAIN = SamplingConfig(stop_tokens=(EOS,))
RAS = SamplingConfig(top_k=3, top_p=0.9, nucleus="cosyvoice", ras_window=10, ras_tau=0.1, stop_tokens=(EOS,))
MIN_LEN = 1
PROMPT = torch.tensor([[1, 3]])


def exact_joint_law(model, cfg, length=3) -> dict[tuple, float]:
    """P(first `length` tokens) under AR sampling; a sequence may end early at EOS."""
    law = {}

    def walk(prefix: tuple, prob: float):
        if len(prefix) == length or (prefix and prefix[-1] == EOS):
            law[prefix] = law.get(prefix, 0.0) + prob
            return
        cache, logits = model.prefill(PROMPT, 8)
        for t in prefix:
            logits = model.extend(cache, torch.tensor([[t]]))[:, -1]
        window = torch.tensor([[-1] * (cfg.window - len(prefix)) + list(prefix)]) if cfg.window else None
        q = distribution(cfg, logits.double(), window, len(prefix), MIN_LEN)[0]
        for t in range(VOCAB):
            if q[t] > 0:
                walk(prefix + (t,), prob * float(q[t]))

    walk((), 1.0)
    return law


def outcome(tokens: list[int], length=3) -> tuple:
    head = tuple(tokens[:length])
    return head if len(head) == length else head + (EOS,)


def chi_square(samples: list[list[int]], law: dict[tuple, float]) -> tuple[float, int, float]:
    """Chi-square goodness of fit (statistic, df, p) of the samples' first tokens; cells expected < 5 pooled."""
    return chi_square_fit(Counter(map(outcome, samples)), law)


def p_value(samples: list[list[int]], law: dict[tuple, float]) -> float:
    return chi_square(samples, law)[2]


def spec_samples(cfg, rule, draft_len, seed=0, max_len=3, drafter=None):
    target, draft = trigram_pair(VOCAB, seed=2, draft_noise=1.5)
    drafter = drafter(draft) if drafter else None
    g = torch.Generator().manual_seed(seed)
    return speculative(target, draft, PROMPT.expand(N_SEQ, -1), cfg, rule, draft_len, max_len, MIN_LEN, g,
                       drafter=drafter).tokens  # fmt: skip


@pytest.fixture(scope="module")
def laws():
    target, _ = trigram_pair(VOCAB, seed=2, draft_noise=1.5)
    return {"plain": exact_joint_law(target, PLAIN), "ras": exact_joint_law(target, RAS)}


CONFIGS = {"plain": PLAIN, "ras": RAS}


@pytest.mark.parametrize("name", ["plain", "ras"])
def test_ar_sampler_matches_enumerated_law(laws, name):
    target, _ = trigram_pair(VOCAB, seed=2, draft_noise=1.5)
    g = torch.Generator().manual_seed(1)
    result = autoregressive(target, PROMPT.expand(N_SEQ, -1), CONFIGS[name], 3, MIN_LEN, g)
    assert p_value(result.tokens, laws[name]) > P_REJECT


@pytest.mark.parametrize("draft_len", [1, 2, 3])
@pytest.mark.parametrize("name", ["plain", "ras"])
@pytest.mark.parametrize("rule", [ExactRule(), ToleranceRule(0.0), TargetOnlyRule()], ids=repr)
def test_speculative_matches_ar_law(laws, name, draft_len, rule):
    assert p_value(spec_samples(CONFIGS[name], rule, draft_len), laws[name]) > P_REJECT


def test_speculative_and_ar_samples_agree_two_sample(laws):
    """Direct spec-vs-AR comparison (contingency chi-square), besides the fit to the law."""
    from scipy.stats import chi2_contingency

    target, _ = trigram_pair(VOCAB, seed=2, draft_noise=1.5)
    g = torch.Generator().manual_seed(5)
    ar = autoregressive(target, PROMPT.expand(N_SEQ, -1), RAS, 3, MIN_LEN, g).tokens
    spec = spec_samples(RAS, ExactRule(), 3, seed=6)
    counts = [Counter(map(outcome, group)) for group in (ar, spec)]
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c[k] for k in keys] for c in counts])
    table = table[:, table.sum(0) >= 10]
    assert chi2_contingency(table).pvalue > P_REJECT


# ---- negative controls: the same test must reject each broken variant --------------------------


class ResampleFromTarget(ExactRule):
    """Broken: on rejection draw from q instead of the residual."""

    def residual(self, p, q, x):
        return q


class SoftmaxResidual(ExactRule):
    """Broken: softmax(q - p) instead of normalize(max(0, q - p))."""

    def residual(self, p, q, x):
        return torch.softmax(q - p, dim=-1)


@pytest.mark.parametrize("rule", [ResampleFromTarget(), SoftmaxResidual(), ToleranceRule(0.4)], ids=repr)
def test_broken_rules_are_rejected(laws, rule):
    assert p_value(spec_samples(PLAIN, rule, 2), laws["plain"]) < P_REJECT


def test_ras_window_without_draft_tokens_is_rejected(laws):
    stale = StaleWindowLaw(**{f.name: getattr(RAS, f.name) for f in fields(RAS)})
    assert p_value(spec_samples(stale, ExactRule(), 3), laws["ras"]) < P_REJECT


def test_plain_top_k_verifier_is_not_exact_against_ras(laws):
    """Verifying with top-k/top-p alone (no RAS law) does not reproduce CosyVoice's sampler."""
    no_ras = SamplingConfig(top_k=3, top_p=0.9, nucleus="cosyvoice", stop_tokens=(EOS,))
    assert p_value(spec_samples(no_ras, ExactRule(), 3), laws["ras"]) < P_REJECT


class GreedySession(AutoregressiveSession):
    """Proposes the argmax of its law; `honest` reports the one-hot law it really drew from, otherwise it claims
    the law itself (the broken drafter)."""

    honest = False

    def propose(self, k, draw):
        def argmax(logits, earlier):
            _, law = draw(logits, earlier)
            token = law.argmax(-1)
            return token, torch.nn.functional.one_hot(token, law.shape[-1]).to(
                law.dtype
            ) if self.honest else law

        return super().propose(k, argmax)


class GreedyDrafter(AutoregressiveDrafter):
    honest = False

    def start(self, prompt, first, features, room):
        session = GreedySession(self.model, prompt, first, room)
        session.honest = self.honest
        return session


class HonestGreedyDrafter(GreedyDrafter):
    honest = True


def test_greedy_draft_with_softmax_p_is_rejected(laws):
    assert p_value(spec_samples(PLAIN, ExactRule(), 2, drafter=GreedyDrafter), laws["plain"]) < P_REJECT


def test_greedy_draft_with_its_true_law_is_exact(laws):
    """The fix for the control above: a greedy draft verified with its one-hot law."""
    assert p_value(spec_samples(PLAIN, ExactRule(), 2, drafter=HonestGreedyDrafter), laws["plain"]) > P_REJECT


# ---- deterministic behaviour --------------------------------------------------------------------

GREEDY = SamplingConfig(temperature=0, stop_tokens=(EOS,))


@pytest.mark.parametrize("draft_len", [1, 2, 4, 7])
@pytest.mark.parametrize("rule", [GreedyRule, ExactRule])
def test_greedy_speculative_equals_greedy_ar(draft_len, rule):
    target, draft = trigram_pair(VOCAB, seed=9, draft_noise=2.0)
    prompts = torch.tensor(list(itertools.product(range(VOCAB), repeat=2)))
    ar = autoregressive(target, prompts, GREEDY, 30, 3)
    spec = speculative(target, draft, prompts, GREEDY, rule(), draft_len, 30, 3)
    assert spec.tokens == ar.tokens
    assert spec.finish_reason == ar.finish_reason
    assert 0 < spec.stats.acceptance_rate < 1  # rows accepted different amounts


def test_rows_in_a_batch_decode_as_if_alone():
    target, draft = trigram_pair(VOCAB, seed=4, draft_noise=2.0)
    prompts = torch.tensor([[0, 1], [2, 2], [3, 0], [1, 1]])
    batch = speculative(target, draft, prompts, GREEDY, GreedyRule(), 3, 25)
    for i in range(len(prompts)):
        alone = speculative(target, draft, prompts[i : i + 1], GREEDY, GreedyRule(), 3, 25)
        assert alone.tokens[0] == batch.tokens[i]


def test_seeded_runs_reproduce_exactly():
    target, draft = trigram_pair(VOCAB, seed=4)
    prompts = PROMPT.expand(8, -1)
    runs = [speculative(target, draft, prompts, RAS, ExactRule(), 3, 40, 0, torch.Generator().manual_seed(7)).tokens
            for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1]


def test_stop_token_mid_block_ends_the_sequence_and_nothing_leaks():
    """Target and draft agree (draft == target): whole blocks are accepted, EOS included."""
    target, _ = trigram_pair(VOCAB, seed=3)
    g = torch.Generator().manual_seed(0)
    result = speculative(target, target, PROMPT.expand(500, -1), PLAIN, ExactRule(), 5, 50, 2, g)
    assert result.stats.acceptance_rate == 1.0
    assert all(EOS not in t for t in result.tokens)
    stopped = [t for t, r in zip(result.tokens, result.finish_reason) if r == "stop"]
    assert len(stopped) > 400 and min(map(len, stopped)) >= 2  # min_len respected
    ar = autoregressive(target, PROMPT.expand(500, -1), PLAIN, 50, 2, g)
    # Same length distribution as AR (EOS ends both at the same law).
    assert abs(np.mean([len(t) for t in result.tokens]) - np.mean([len(t) for t in ar.tokens])) < 0.5


@pytest.mark.parametrize("max_len", [1, 2, 5, 9])
def test_max_len_is_respected_exactly(max_len):
    target, _ = trigram_pair(VOCAB, seed=3)
    no_stop = SamplingConfig()  # a fixed-length decode (min_len = max_len) needs no stop token
    result = speculative(target, target, PROMPT.expand(16, -1), no_stop, ExactRule(), 4, max_len, max_len,
                         torch.Generator().manual_seed(0))  # fmt: skip
    assert all(len(t) == max_len for t in result.tokens)
    assert set(result.finish_reason) == {"max_len"}


def test_per_row_length_limits():
    target, draft = trigram_pair(VOCAB, seed=3)
    result = speculative(target, draft, PROMPT.expand(3, -1), SamplingConfig(), ExactRule(), 3,
                         torch.tensor([2, 7, 11]), torch.tensor([2, 7, 11]), torch.Generator().manual_seed(0))  # fmt: skip
    assert [len(t) for t in result.tokens] == [2, 7, 11]


def test_adaptive_draft_length_moves_with_acceptance():
    target, draft = trigram_pair(VOCAB, seed=3, draft_noise=0.0)  # draft == target: all accepted
    result = speculative(target, draft, PROMPT, SamplingConfig(), ExactRule(), AdaptiveDraftLength(2, 1, 8), 60,
                         60, torch.Generator().manual_seed(0))  # fmt: skip
    assert result.stats.draft_len_per_round[:4] == [2, 4, 6, 8]
    target, draft = trigram_pair(VOCAB, seed=3, draft_noise=6.0)  # bad draft: shrinks
    result = speculative(target, draft, PROMPT, SamplingConfig(), ExactRule(), AdaptiveDraftLength(5, 1, 8), 60,
                         60, torch.Generator().manual_seed(0))  # fmt: skip
    assert min(result.stats.draft_len_per_round) == 1


def test_statistics_are_consistent():
    target, draft = trigram_pair(VOCAB, seed=3, draft_noise=1.0)
    result = speculative(target, draft, PROMPT.expand(64, -1), SamplingConfig(), ToleranceRule(0.3), 3, 40, 40,
                         torch.Generator().manual_seed(0))  # fmt: skip
    s = result.stats
    assert s.tokens == sum(map(len, result.tokens)) == 64 * 40
    assert s.target_calls == s.rounds and s.draft_calls == 3 * s.rounds
    assert s.proposed[0] == sum(len(r) for r in s.accepted_per_round)
    assert s.accepted[0] == s.proposed[1]  # position i+1 is reached iff i was kept
    assert all(0 < b <= 1 for b in s.overlap_per_position)
    assert all(t > 0.01 for t in s.tv_per_position)  # β > 0 moves the law


def test_measured_acceptance_matches_the_overlap_it_estimates():
    """For the exact rule P(accept) = E[Σ min(p, q)]: the logged β_t predicts the measured α."""
    target, draft = trigram_pair(VOCAB, seed=3, draft_noise=1.0)
    s = speculative(target, draft, PROMPT.expand(256, -1), SamplingConfig(), ExactRule(), 3, 40, 40,
                    torch.Generator().manual_seed(0)).stats  # fmt: skip
    assert s.tv_per_position == [0.0, 0.0, 0.0]  # exact rules are not tracked
    for measured, predicted, n in zip(s.alpha_per_position, s.overlap_per_position, s.proposed):
        assert abs(measured - predicted) < 4 * (0.25 / n) ** 0.5


@pytest.mark.parametrize("verify_rows", [4, 8])
def test_padded_verification_changes_nothing_but_the_cost(verify_rows):
    target, draft = trigram_pair(VOCAB, seed=3)
    runs = [
        speculative(model, draft, PROMPT.expand(32, -1), RAS, ExactRule(), 3, 30, 2, torch.Generator().manual_seed(0)
                    ).tokens
        for model in (target, PaddedVerify(target, verify_rows))
    ]  # fmt: skip
    assert runs[0] == runs[1]
