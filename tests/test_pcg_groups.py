"""PCG's groups on any target: θ resolved from a requested mean group size, the group sources, the stress
test's swap (GroupSwap) and the β audit (ToleranceRule.audit, the engine's diagnostic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_models import speculative, trigram_pair
from scipy.stats import binomtest, chisquare

from ssd.decoding.acceptance import ExactRule, ToleranceRule
from ssd.decoding.pcg import Groups, GroupSwap, PCGRule
from ssd.decoding.sampling import SamplingConfig

P_REJECT = 1e-3
AUDIT_FIELDS = ToleranceRule.audit_fields


def vectors(vocab: int, dim: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed))


class FakeTarget:
    """What PCGRule.bind reads: speech embeddings, the head size and the speech vocabulary."""

    device = torch.device("cpu")

    def __init__(self, emb: torch.Tensor, stop_tokens: int = 0):
        self.emb, self.speech_token_size = emb, len(emb)
        self.vocab_size = len(emb) + stop_tokens

    def embed_speech(self, tokens):
        return self.emb[tokens]


# ---- θ from a requested mean group size ------------------------------------------------------------


@pytest.mark.parametrize("dim", [4, 64])
@pytest.mark.parametrize("mean_size", [1.5, 3.0, 8.0])
def test_a_requested_mean_group_size_is_met_on_any_embedding_space(dim, mean_size):
    rule = PCGRule(vectors=vectors(300, dim), group_size=mean_size)
    stats = rule.group_stats()
    assert stats["group_mean_size"] == pytest.approx(mean_size, abs=0.01)
    assert stats["group_theta"] == rule.theta and rule.labels()["group_size"] == mean_size


def test_one_absolute_theta_gives_other_group_sizes_on_other_spaces():
    """Negative control: the θ that gives mean size 3 on 4-dim vectors, used on 64-dim ones, is far off
    (why an absolute cosine does not transfer between targets and the size is resolved per target)."""
    theta = PCGRule(vectors=vectors(300, 4), group_size=3.0).theta
    elsewhere = PCGRule(vectors=vectors(300, 64), theta=theta).group_stats()["group_mean_size"]
    assert abs(elsewhere - 3.0) > 1.0


def test_group_size_one_is_exact_decoding_and_stop_tokens_stay_alone():
    target = FakeTarget(vectors(40, 8), stop_tokens=3)
    alone = PCGRule(group_size=1.0).bind(target)
    assert alone.groups.sizes.tolist() == [1] * 43 and alone.group_stats()["group_singleton_fraction"] == 1.0
    wide = PCGRule(group_size=6.0).bind(target)
    assert wide.group_stats()["group_mean_size"] == pytest.approx(6.0, abs=0.03)
    assert wide.groups.sizes[40:].tolist() == [1, 1, 1]  # stop tokens
    ids, mask = wide.members(torch.arange(40))
    assert int(ids[mask].max()) < 40  # no speech token's group holds a stop token


def test_bad_group_settings_name_the_key_and_the_fix():
    from ssd.toy_world.groups import MelFrames

    with pytest.raises(ValueError, match=r"acceptance.group_size=0.5.*>= 1"):
        PCGRule(group_size=0.5)
    with pytest.raises(ValueError, match=r"groups.codec_dir.*groups=embedding"):
        MelFrames(codec_dir="")


@pytest.mark.parametrize("source", ["MelFrames", "CodecCentroids"])
def test_codec_sources_group_the_toy_codecs_tokens(micro_world, source):
    import ssd.toy_world.groups as groups
    from ssd.models.cosyvoice2 import CosyVoice2LM

    target = CosyVoice2LM.from_dir(micro_world.toy / "target")
    vectors_of = getattr(groups, source)(codec_dir=str(micro_world.toy / "codec"))
    rule = PCGRule(group_size=3.0, source=vectors_of).bind(target)
    assert rule.vocab_size == target.vocab_size
    assert rule.group_stats()["group_mean_size"] == pytest.approx(3.0, abs=0.05)
    assert rule.labels()["source"] == vectors_of.name
    embedding = PCGRule(group_size=3.0).bind(target)
    assert not torch.equal(rule.groups.dense(), embedding.groups.dense())  # another grouping
    with pytest.raises(ValueError, match="codec_dir"):
        PCGRule(group_size=3.0, source=vectors_of).bind(FakeTarget(vectors(7, 4)))


# ---- the stress test's swap ------------------------------------------------------------------------


def test_group_swap_draws_a_uniform_member_of_the_tokens_group():
    swap = GroupSwap(PCGRule(vectors=vectors(30, 6), group_size=4.0))
    groups = swap.groups
    token = int(groups.groups.sizes.argmax())
    ids, mask = groups.members(torch.tensor(token))
    members = ids[mask].tolist()
    n = 4000
    drawn = np.array([swap([token], seed)[0] for seed in range(n)])
    assert set(drawn) <= set(members)
    counts = np.array([(drawn == m).sum() for m in members])
    assert chisquare(counts).pvalue > P_REJECT  # uniform over G_x, x itself included
    # Negative control: the same test refuses "x stays with probability 1/2".
    skewed = np.full(len(members), n / 2 / (len(members) - 1))
    skewed[members.index(token)] = n / 2
    assert chisquare(counts, skewed).pvalue < P_REJECT


def test_group_swap_fraction_is_one_minus_mean_inverse_size_and_keeps_stop_tokens():
    swap = GroupSwap(PCGRule(vectors=vectors(50, 6), group_size=5.0))
    tokens = list(range(50)) * 40 + [50, 51]  # 50, 51: ids beyond the speech tokens
    out = swap(tokens, seed=3)
    assert out[-2:] == [50, 51] and swap(tokens, seed=3) == out  # reproducible per seed
    changed = sum(a != b for a, b in zip(tokens[:-2], out[:-2]))
    expected = float((1 - 1 / swap.groups.groups.sizes.double()).mean())
    assert binomtest(changed, 2000, expected).pvalue > P_REJECT
    assert binomtest(changed, 2000, expected / 2).pvalue < P_REJECT  # negative control


# ---- the β audit -----------------------------------------------------------------------------------


def audit_laws(n: int, vocab: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, 1, vocab, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
    q = (torch.randn(n, 1, vocab, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
    return p, q


def test_beta_only_fraction_matches_its_closed_form():
    """Among accepted draft tokens, P(accepted only because of β) = Σ p·min(β, 1 - a)⁺ / Σ p·min(1, a + β),
    a = min(1, q/p): the audit's flag measures exactly the acceptances β adds."""
    beta, n, vocab = 0.3, 40_000, 9
    groups = PCGRule(vectors=vectors(vocab, 3), group_size=2.0)
    rule = ToleranceRule(beta, audit_groups=groups)
    p1, q1 = audit_laws(1, vocab)
    p, q = p1.expand(n, 1, -1), q1.expand(n, 2, -1)
    x = torch.multinomial(p[:, 0], 1, generator=torch.Generator().manual_seed(1))
    n_acc, _, u = rule.verify_draws(p, q, x, torch.Generator().manual_seed(2))
    fields = rule.audit(p, q[:, :1], x, u)
    kept = n_acc == 1
    flags = fields[kept, 0, AUDIT_FIELDS.index("beta_only")]
    a = ExactRule().accept_prob(p1[0], q1[0], torch.arange(vocab).unsqueeze(0))[0]
    expected = float(
        (p1[0, 0] * torch.minimum(torch.tensor(beta), 1 - a)).sum()
        / (p1[0, 0] * (a + beta).clamp(max=1)).sum()
    )
    assert binomtest(int(flags.sum()), int(kept.sum()), expected).pvalue > P_REJECT
    # Negative control: "every acceptance of a token with q < p is β's" is refused.
    naive = float(
        (p1[0, 0] * (a < 1) * (a + beta).clamp(max=1)).sum() / (p1[0, 0] * (a + beta).clamp(max=1)).sum()
    )
    assert binomtest(int(flags.sum()), int(kept.sum()), naive).pvalue < P_REJECT
    # The other fields: q(x), its ratio to max q, and the q-mass of x's group.
    qx = q1[0, 0][x[:, 0]]
    torch.testing.assert_close(fields[:, 0, AUDIT_FIELDS.index("q")], qx)
    torch.testing.assert_close(fields[:, 0, AUDIT_FIELDS.index("q_over_max")], qx / q1[0, 0].max())
    mass = groups.groups.dense() @ q1[0, 0]
    torch.testing.assert_close(fields[:, 0, AUDIT_FIELDS.index("group_q_mass")], mass[x[:, 0]])


def test_the_engine_audits_without_changing_the_decode():
    target, draft = trigram_pair(6, seed=2, draft_noise=1.5)
    cfg = SamplingConfig(stop_tokens=(5,))
    prompt = torch.tensor([[1, 3]]).expand(16, -1)
    plain = ToleranceRule(0.4)
    audited = ToleranceRule(0.4, audit_groups=PCGRule(group_size=2.0)).bind(
        FakeTarget(vectors(5, 3), stop_tokens=1)
    )
    runs = [speculative(target, draft, prompt, cfg, rule, 3, 20, 1, torch.Generator().manual_seed(0))
            for rule in (plain, audited)]  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    assert "beta_audit" not in runs[0].rows[0]
    for row in runs[1].rows:
        audit = row["beta_audit"]
        assert set(audit) == set(AUDIT_FIELDS)
        assert len(audit["beta_only"]) == sum(row["accepted"])  # one entry per kept draft token
    flags = [f for row in runs[1].rows for f in row["beta_audit"]["beta_only"]]
    assert 0 < sum(flags) < len(flags)


# ---- the runner: group statistics, the stress test, the audit in records ---------------------------

SWAP = "perturb={_target_:ssd.decoding.pcg.GroupSwap,groups:{_target_:ssd.decoding.pcg.PCGRule,group_size:3}}"
AUDIT = "++acceptance.audit_groups={_target_:ssd.decoding.pcg.PCGRule,group_size:3}"


def test_runs_record_group_stats_the_swap_and_the_audit(micro_world, tmp_path):
    from ssd.evaluation.baselines import baseline_key
    from ssd.evaluation.run_dir import RESULTS_FILE, read_records
    from ssd.evaluation.runner import evaluate
    from tests.fixtures_eval import compose_sweep_config, sweep_overrides

    def cfg(*extra):
        return compose_sweep_config([*sweep_overrides(micro_world, 3, 20), "logger=none", *extra])

    pcg = evaluate(cfg("acceptance=pcg", "acceptance.group_size=3"), tmp_path / "pcg")
    assert pcg["group_mean_size"] == pytest.approx(3.0, abs=0.05) and pcg["group_size"] == 3.0
    assert {"group_median_size", "group_singleton_fraction"} <= set(pcg) and "theta" in pcg["setting_keys"]

    ar = evaluate(cfg("decoding=ar"), tmp_path / "ar")
    assert baseline_key(cfg("decoding=ar", SWAP)) == baseline_key(cfg("decoding=ar"))  # the same AR baseline
    swapped = evaluate(cfg("decoding=ar", SWAP, f"baseline_dir={tmp_path / 'ar'}"), tmp_path / "swap")
    records = read_records(tmp_path / "swap" / RESULTS_FILE)
    plain = {r["utt"]: r for r in read_records(tmp_path / "ar" / RESULTS_FILE)}
    assert all(r["tokens"] == plain[r["utt"]]["tokens"] for r in records)  # the LM's tokens are AR's
    assert sum(r["swapped"] for r in records) == sum(
        sum(a != b for a, b in zip(r["tokens"], r["vocoded_tokens"])) for r in records
    )
    assert 0 < swapped["swap_fraction"] < 1 and "wer_delta_vs_ar" in swapped and "sim_delta_vs_ar" in swapped
    assert swapped["swap_group_size"] == 3.0 and ar.get("swap_fraction") is None

    evaluate(cfg("beta=0.4", AUDIT), tmp_path / "audit")
    for record in read_records(tmp_path / "audit" / RESULTS_FILE):
        assert len(record["beta_audit"]["beta_only"]) == sum(record["accepted"])


def test_a_pick_reads_inside_its_own_group_at_both_ends_of_the_uniforms():
    groups = Groups.from_lists([torch.tensor([4, 0, 2]), torch.tensor([1]), torch.tensor([3, 5])])
    u = torch.tensor([1 - 2**-24] * 3)  # the largest float32 below 1
    assert groups.pick(torch.tensor([0, 1, 2]), u).tolist() == [2, 1, 5]
    assert groups.pick(torch.tensor([0, 1, 2]), torch.zeros(3)).tolist() == [4, 1, 3]
