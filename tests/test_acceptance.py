"""Analytic certificates: each rule's one-step output law, in float64, is the intended law;
and each rule's sampler draws from that law (one-step chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ssd.decoding.acceptance import (
    ExactRule,
    GreedyRule,
    SyntheticRule,
    TargetOnlyRule,
    ToleranceRule,
    TypicalRule,
)
from ssd.decoding.pcg import PCGRule
from ssd.decoding.sequences import UNSETTLED

P_REJECT = 1e-3
VOCAB = 7


def laws(seed: int, n: int = 16, vocab: int = VOCAB, sharp: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * sharp).softmax(-1)
    q = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * sharp).softmax(-1)
    q[:, 0] = 0  # a token the target forbids (e.g. a masked stop token)
    return p, q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("rule", [ExactRule(), ToleranceRule(beta=0.0), TargetOnlyRule()], ids=repr)
@pytest.mark.parametrize("seed", range(3))
def test_exact_rules_output_the_target_law(rule, seed):
    p, q = laws(seed)
    torch.testing.assert_close(rule.output_law(p, q), q, rtol=0, atol=1e-12)


def test_target_only_is_exact_for_a_deterministic_draft():
    _, q = laws(5)
    p = torch.nn.functional.one_hot(torch.arange(q.shape[0]) % VOCAB, VOCAB).to(q.dtype)
    torch.testing.assert_close(TargetOnlyRule().output_law(p, q), q, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.1, 0.4, 1.0])
def test_tolerance_law_is_the_papers_closed_form(beta):
    p, q = laws(1)
    a = torch.clamp(q / p + beta, max=1.0)
    residual = (q - p).clamp_min(0)
    expected = p * a + (1 - (p * a).sum(-1, keepdim=True)) * residual / residual.sum(-1, keepdim=True)
    law = ToleranceRule(beta).output_law(p, q)
    torch.testing.assert_close(law, expected, rtol=0, atol=1e-12)
    assert (0.5 * (law - q).abs().sum(-1) > 1e-3).all()  # β > 0 really moves the law


def test_tolerance_drift_grows_with_beta():
    p, q = laws(2)
    tv = [
        float((0.5 * (ToleranceRule(b).output_law(p, q) - q).abs().sum(-1)).mean())
        for b in (0, 0.2, 0.4, 0.8)
    ]
    assert tv[0] == pytest.approx(0, abs=1e-12) and tv == sorted(tv)


def test_greedy_rule_outputs_the_target_argmax():
    p, q = laws(3)
    law = GreedyRule().output_law(p, q)
    assert law.argmax(-1).tolist() == q.argmax(-1).tolist()
    torch.testing.assert_close(law.max(-1).values, torch.ones(len(q), dtype=q.dtype))


def test_synthetic_and_typical_laws():
    p, q = laws(4)
    torch.testing.assert_close(SyntheticRule(0.7).output_law(p, q), 0.7 * p + 0.3 * q)
    rule = TypicalRule(epsilon=0.3, delta=0.5)
    entropy = -(q * q.clamp_min(1e-300).log()).sum(-1, keepdim=True)
    keep = (q > torch.minimum(torch.full_like(entropy, 0.3), 0.5 * torch.exp(-entropy))).to(q.dtype)
    expected = p * keep + (1 - (p * keep).sum(-1, keepdim=True)) * q
    torch.testing.assert_close(rule.output_law(p, q), expected)


# ---- the sampler draws from the certified law -------------------------------------------------


def one_step_p_value(rule, p, q, n=30_000, seed=0):
    """Verify k=1 draft tokens drawn from p; the emitted token must follow rule.output_law."""
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(p.expand(n, -1), 1, generator=g)
    p3 = p.expand(n, 1, -1)
    q3 = torch.stack([q, q], 0).unsqueeze(0).expand(n, 2, -1)  # bonus position irrelevant: take 1st token
    n_acc, y = rule.verify(p3, q3, x, g)
    first = torch.where(n_acc == 1, x[:, 0], y)
    observed = np.bincount(first.numpy(), minlength=p.shape[-1])
    law = rule.output_law(p.unsqueeze(0), q.unsqueeze(0))[0].numpy()
    support = law > 1e-12
    if observed[~support].sum():
        return 0.0
    return chisquare(observed[support], law[support] / law[support].sum() * n).pvalue


@pytest.mark.parametrize(
    "rule",
    [ExactRule(), ToleranceRule(0.3), TargetOnlyRule(), TypicalRule(0.2, 0.5), SyntheticRule(0.6)],
    ids=repr,
)
def test_rule_sampler_follows_its_law(rule):
    p, q = laws(7, n=1)
    assert one_step_p_value(rule, p[0], q[0]) > P_REJECT


def test_one_step_test_rejects_a_wrong_law():
    """Negative control: the sampler of β = 0.3 does not pass as the exact law."""
    p, q = laws(7, n=1)

    class Mislabelled(ToleranceRule):
        def output_law(self, p, q):
            return ExactRule().output_law(p, q)

    assert one_step_p_value(Mislabelled(0.3), p[0], q[0]) < P_REJECT


# ---- PCG: the emitted GROUP follows the target's coarse-grained law ---------------------------


def pcg_setup(vocab=12, theta=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, 4, generator=g)
    rule = PCGRule(theta=theta, vectors=emb)
    p, q = laws(seed, n=1, vocab=vocab, sharp=2.0)
    return rule, emb, p[0], q[0]


def coarse_reference(emb, theta, law):
    """Q_c by the definition, with plain loops: groups over cosine > θ, equal mass split."""
    e = torch.nn.functional.normalize(emb.double(), dim=-1)
    cos = e @ e.T
    vocab = len(emb)
    groups = [[u for u in range(vocab) if u == v or cos[u, v] > theta] for v in range(vocab)]
    m = [sum(u in g for g in groups) for u in range(vocab)]
    return torch.tensor([sum(float(law[u]) / m[u] for u in g) for g in groups], dtype=torch.float64)


def test_pcg_groups_and_coarse_law_match_the_definition():
    rule, emb, p, q = pcg_setup()
    assert 1 < rule.groups.sizes.float().mean() < len(emb)  # overlapping, non-trivial groups
    torch.testing.assert_close(rule.coarse_law(q.unsqueeze(0))[0], coarse_reference(emb, 0.3, q))
    assert rule.coarse_law(q.unsqueeze(0)).sum() == pytest.approx(1.0)


def test_pcg_group_law_is_the_coarse_target_law():
    rule, emb, p, q = pcg_setup()
    torch.testing.assert_close(
        rule.group_law(p.unsqueeze(0), q.unsqueeze(0))[0], coarse_reference(emb, 0.3, q), rtol=0, atol=1e-12
    )


def pcg_group_p_value(rule, p, q, expected, n=30_000):
    g = torch.Generator().manual_seed(11)
    x = torch.multinomial(p.expand(n, -1), 1, generator=g)
    n_acc, _, groups = rule.verify_groups(p.expand(n, 1, -1).float(), q.expand(n, 2, -1).float(), x, g)
    observed = np.bincount(groups.numpy(), minlength=len(p))
    support = expected.numpy() > 1e-12
    return chisquare(observed[support], expected.numpy()[support] * n).pvalue


def test_pcg_sampler_emits_groups_from_the_coarse_target_law():
    rule, emb, p, q = pcg_setup()
    rule.thinning_trials = 2  # exercise both thinning and the enumerated fallback (settle)
    assert pcg_group_p_value(rule, p, q, coarse_reference(emb, 0.3, q)) > P_REJECT


def test_pcg_group_test_rejects_the_draft_coarse_law():
    """Negative control: the same test refuses P_c as the emitted law."""
    rule, emb, p, q = pcg_setup()
    assert pcg_group_p_value(rule, p, q, coarse_reference(emb, 0.3, p)) < P_REJECT


def test_pcg_sampler_token_law_matches_its_closed_form():
    rule, _, p, q = pcg_setup()
    assert one_step_p_value(rule, p, q) > P_REJECT


def test_pcg_accepts_more_than_exact_with_wide_groups():
    rule, _, p, q = pcg_setup(theta=0.0)
    exact_accept = torch.minimum(p, q).sum()
    pc, qc = rule.coarse_law(p.unsqueeze(0)), rule.coarse_law(q.unsqueeze(0))
    assert torch.minimum(pc, qc).sum() > exact_accept


def test_every_shipped_rule_config_builds_its_rule_and_labels_its_runs():
    from hydra.utils import instantiate

    from ssd.config import compose
    from ssd.config_files import group_options

    labels = {}
    for option in group_options("acceptance"):
        cfg = compose("sweep", [f"acceptance={option}", "beta=0.2", "theta=0.3"])
        rule = instantiate(cfg.acceptance)
        labels[rule.name] = rule.labels()
    assert labels["tolerance"] == {"beta": 0.2}
    assert labels["pcg"] == {"theta": 0.3, "group_size": None, "source": "embedding"}
    assert labels["exact"] == labels["greedy"] == labels["target_only"] == {}
    assert set(labels) == {"exact", "tolerance", "greedy", "target_only", "typical", "synthetic", "pcg"}


def test_pcg_takes_its_groups_from_the_target_it_is_bound_to():
    emb = torch.eye(4).repeat_interleave(2, 0) + 0.01 * torch.randn(
        8, 4, generator=torch.Generator().manual_seed(0)
    )

    class Target:
        vocab_size, device = 8, torch.device("cpu")

        def embed_speech(self, tokens):
            return emb[tokens]

    bound = PCGRule(theta=0.9).bind(Target())
    direct = PCGRule(theta=0.9, vectors=emb)
    assert torch.equal(bound.groups.dense(), direct.groups.dense()) and bound.groups.sizes.tolist() == [2] * 8


def _rules_for_streams():
    rule, *_ = pcg_setup()
    return [ExactRule(), ToleranceRule(beta=0.4), GreedyRule(), TargetOnlyRule(), TypicalRule(), rule]


@pytest.mark.parametrize("rule", _rules_for_streams(), ids=repr)
def test_verify_draws_a_fixed_count_per_row_and_a_row_verifies_as_alone(rule):
    """Whatever the verdicts (rows here accept 0..k), every row consumes its stream by the same count,
    and row b's verdict in a batch equals its verdict alone: what batched decoding relies on."""
    from ssd.decoding.rng import RowRandom

    k, n = 3, 64
    vocab = rule.vocab_size if isinstance(rule, PCGRule) else VOCAB
    p, q = laws(4, n=n * (k + 1), vocab=vocab)
    p, q = p.float().reshape(n, k + 1, vocab)[:, :k], q.float().reshape(n, k + 1, vocab)
    x = torch.multinomial(p.reshape(-1, vocab), 1, generator=torch.Generator().manual_seed(0)).reshape(n, k)
    seeds = list(range(100, 100 + n))
    if isinstance(rule, PCGRule):
        rule.thinning_trials = 1  # some rows then need the enumerated fallback (`settle`)

    def verify(rows, streams):
        n_acc, token = rule.verify(p[rows], q[rows], x[rows], streams)
        unsettled = token == UNSETTLED
        return n_acc, rule.settle(token) if bool(unsettled.any()) else token, unsettled

    batch_rng = RowRandom(seeds)
    n_acc, token, unsettled = verify(slice(None), batch_rng)
    assert len(set(n_acc.tolist())) > 1  # the verdicts differ between rows
    assert not (token == UNSETTLED).any()
    for b in (*range(4), 17, n - 1, *unsettled.nonzero().flatten().tolist()[:3]):
        alone = RowRandom([seeds[b]])
        n_b, token_b, _ = verify(slice(b, b + 1), alone)
        assert (n_b.item(), token_b.item()) == (n_acc[b].item(), token[b].item())
        assert alone.drawn == batch_rng.drawn
    if isinstance(rule, PCGRule):
        assert unsettled.any() and batch_rng.drawn == 2 * k + 3 * rule.thinning_trials + 2
