"""The drafter families (heads, MTP, feature, parallel block) on a tiny CosyVoice 2-format target: exactness of
speculative decoding with each (chi-square of the first three tokens against the enumerated AR law, RAS on),
the negative controls the same test must reject, batch rows decoding as alone, training outputs aligned with
the labels they claim, and checkpoints that refuse another target."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from engine_models import chi_square_fit, speculative
from fixtures_models import make_tiny_cosyvoice2_dir

from ssd.decoding.acceptance import ExactRule, ToleranceRule
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig, distribution
from ssd.drafters.block import BlockDrafter
from ssd.drafters.eagle import FeatureDrafter
from ssd.drafters.heads import HeadsDrafter
from ssd.models.cosyvoice2 import CosyVoice2LM
from ssd.models.transformer import use_batch_invariant

P_REJECT = 1e-3
N_SEQ = 20_000
SPEECH = 5  # speech tokens 0..4, stop tokens 5..7: the joint law of three tokens has few cells
FAMILIES = {
    "medusa": lambda t: HeadsDrafter(t, heads=3, kind="medusa"),
    "mtp": lambda t: HeadsDrafter(t, heads=3, kind="mtp"),
    "eagle": lambda t: FeatureDrafter(t),
    "block": lambda t: BlockDrafter(t, layers=2, block=3),
}


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> CosyVoice2LM:
    path = make_tiny_cosyvoice2_dir(
        tmp_path_factory.mktemp("drafters") / "target", seed=3, speech_tokens=SPEECH
    )
    return CosyVoice2LM.from_dir(path).eval()


def _drafter(name, target):
    torch.manual_seed(0)
    drafter = FAMILIES[name](target)
    with (
        torch.no_grad()
    ):  # random but not degenerate: the drafts must disagree with the target to test anything
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return drafter


def _law(target) -> SamplingConfig:
    return SamplingConfig(top_k=3, top_p=0.9, nucleus="cosyvoice", ras_window=10, ras_tau=0.1,
                          stop_tokens=target.stop_tokens, eos_mode="mask")  # fmt: skip


def _prompt(target, rows):
    return target.make_prompt(["bin blue at zero"] * rows, ["lay green"] * rows, [[1, 2, 4]] * rows)


def exact_law(target, law, length=3) -> dict[tuple, float]:
    """P(first `length` tokens) under AR sampling, enumerated (min_len = length: no stop token among them)."""
    out, prompt = {}, _prompt(target, 1)

    def walk(prefix: tuple, prob: float):
        if len(prefix) == length:
            out[prefix] = prob
            return
        cache, logits = target.prefill(prompt, 8)
        for token in prefix:
            logits = target.extend(cache, torch.tensor([[token]]))[:, -1]
        window = torch.tensor([[-1] * (law.window - len(prefix)) + list(prefix)])
        q = distribution(law, logits.double(), window, len(prefix), length)[0]
        for token in q.nonzero().flatten().tolist():
            walk(prefix + (token,), prob * float(q[token]))

    with torch.no_grad():
        walk((), 1.0)
    return out


@pytest.fixture(scope="module")
def ar_law(small_target):
    return exact_law(small_target, _law(small_target))


def _samples(target, drafter, rule, seed=0):
    result = speculative(target, None, _prompt(target, N_SEQ), _law(target), rule, 3, 3, 3,
                         torch.Generator().manual_seed(seed), drafter=drafter)  # fmt: skip
    return Counter(tuple(t[:3]) for t in result.tokens), result


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_drafter_family_is_exact_under_the_exact_rule_and_beta_0(small_target, ar_law, name):
    """The certificate of a drafter family: exact and β = 0 reproduce the target's RAS law; β = 0.4 does not."""
    drafter = _drafter(name, small_target)
    for rule in (ExactRule(), ToleranceRule(0.0)):
        counts, result = _samples(small_target, drafter, rule)
        assert (
            0.05 < result.stats.acceptance_rate < 0.95
        )  # the drafts really are tested, not all kept or all lost
        assert chi_square_fit(counts, ar_law)[2] > P_REJECT, (name, rule)
    counts, _ = _samples(small_target, drafter, ToleranceRule(0.4), seed=1)
    assert chi_square_fit(counts, ar_law)[2] < P_REJECT  # negative control


class SoftmaxLawDrafter:
    """Broken: wraps a drafter and proposes the argmax of the law it reports as p (not a draw from it)."""

    def __init__(self, inner):
        self.inner, self.taps, self.vocab_size = inner, inner.taps, inner.vocab_size

    def start(self, *args):
        session = self.inner.start(*args)
        propose = session.propose

        def argmax_propose(k, draw):
            def argmax(logits, earlier):
                _, law = draw(logits, earlier)
                return law.argmax(-1), law

            return propose(k, argmax)

        session.propose = argmax_propose
        return session


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mtp", "block"])
def test_a_drafter_that_does_not_sample_its_law_is_rejected(small_target, ar_law, name):
    counts, _ = _samples(small_target, SoftmaxLawDrafter(_drafter(name, small_target)), ExactRule())
    assert chi_square_fit(counts, ar_law)[2] < P_REJECT


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rows_of_a_batch_decode_as_they_would_alone(tiny_cosyvoice2_dir, name):
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    drafter = FAMILIES[name](target)
    use_batch_invariant(target)
    use_batch_invariant(drafter)
    texts, prompt_texts = ["bin blue at zero", "set red", "lay"], ["lay green", "", "set"]
    speech, seeds = [[1, 2], [], [5, 6, 7]], [1, 2, 3]
    law = SamplingConfig(top_k=10, top_p=0.9, stop_tokens=target.stop_tokens)

    def decode(rows):
        prompt = target.make_prompt(
            [texts[r] for r in rows], [prompt_texts[r] for r in rows], [speech[r] for r in rows]
        )
        return speculative(target, None, prompt, law, ExactRule(), 3, 20, 2, RowRandom([seeds[r] for r in rows]),
                           drafter=drafter)  # fmt: skip

    batch = decode([0, 1, 2])
    for r in range(3):
        alone = decode([r])
        assert alone.tokens[0] == batch.tokens[r] and alone.rows[0] == batch.rows[r], (name, r)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_outputs_score_each_label_the_drafter_is_asked_for(tiny_cosyvoice2_dir, name):
    """Every prediction's label is the token at the step it claims, and the teacher logits are the target's own
    at that step (what KD and the dev α compare with)."""
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    drafter = FAMILIES[name](target)
    speech = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    batch = {"text_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "text_lens": torch.tensor([3, 2]),
             "speech_tokens": speech, "speech_lens": torch.tensor([4, 2]), "utt": ["a", "b"]}  # fmt: skip
    out = drafter.training_outputs(batch, target)
    logits, targets = target.training_logits(
        batch["text_ids"], batch["text_lens"], speech, batch["speech_lens"]
    )
    eos = target.eos_token
    for label, row, step in zip(out.labels.tolist(), out.rows.tolist(), out.steps.tolist()):
        length = int(batch["speech_lens"][row])
        assert step <= length and label == (speech[row, step].item() if step < length else eos)
    scored = targets != -100
    per_row = [logits[r][scored[r]] for r in range(2)]  # the target's logits at its scored steps, per row
    expected = torch.stack([per_row[r][s] for r, s in zip(out.rows.tolist(), out.steps.tolist())]).float()
    torch.testing.assert_close(out.teacher, expected)
    horizons = {"medusa": 3, "mtp": 3, "eagle": 1, "block": 3}[name]
    assert set(out.steps.tolist()) <= set(range(6)) and len(out.labels) >= 7 * min(horizons, 2) - 4
    out.logits.float().logsumexp(-1).sum().backward()  # the drafter's own parameters get gradients
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_checkpoint_round_trips_and_refuses_another_target(tiny_cosyvoice2_dir, tmp_path, name):
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    drafter = _drafter(name, target)
    path = drafter.save(tmp_path / "draft.pt")
    loaded = FAMILIES[name](target).__class__
    kwargs = {"medusa": {"kind": "medusa", "heads": 3}, "mtp": {"kind": "mtp", "heads": 3}, "eagle": {},
              "block": {"layers": 2, "block": 3}}[name]  # fmt: skip
    again = loaded(target, checkpoint=path, **kwargs)
    for (key, a), (_, b) in zip(drafter.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), key
    other = CosyVoice2LM.from_dir(make_tiny_cosyvoice2_dir(tmp_path / "other", seed=7))
    with pytest.raises(ValueError, match="another target"):
        loaded(other, checkpoint=path, **kwargs)
    with pytest.raises(FileNotFoundError, match="train the drafter first"):
        loaded(target, checkpoint=tmp_path / "missing.pt", **kwargs)


def test_draft_len_beyond_what_a_drafter_was_built_for_is_named(tiny_cosyvoice2_dir):
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    law = SamplingConfig(stop_tokens=target.stop_tokens)
    for drafter, match in (
        (HeadsDrafter(target, heads=2), "2 heads"),
        (BlockDrafter(target, block=2), "blocks of 2"),
    ):
        with pytest.raises(ValueError, match=match):
            speculative(target, None, _prompt(target, 1), law, ExactRule(), 3, 10, 0, drafter=drafter)


def test_the_families_read_the_target_features_they_declare(tiny_cosyvoice2_dir):
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    layers = len(target.backbone.layers)
    assert HeadsDrafter(target).taps == (layers,)
    assert FeatureDrafter(target).taps == (0, 1, layers // 2, layers)
    assert BlockDrafter(target, feature_layers=[1, -1]).taps == (0, 1, layers)
    with pytest.raises(ValueError, match="taps"):
        FeatureDrafter(target, feature_layers=[layers + 1])
