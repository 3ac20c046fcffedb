"""Sampling transforms equal the procedures they claim to be in closed form."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from ssd.decoding.sampling import SamplingConfig, distribution, sample

P_REJECT = 1e-3  # chi-square threshold used throughout the statistical tests


def cosyvoice_nucleus_loop(logits: torch.Tensor, top_p: float, top_k: int) -> set[int]:
    """CosyVoice 2's nucleus_sampling loop, written out literally as upstream walks it."""
    probs, cum, kept = logits.softmax(-1), 0.0, []
    sorted_p, order = probs.sort(descending=True, stable=True)
    for value, idx in zip(sorted_p.tolist(), order.tolist()):
        if cum < top_p and len(kept) < top_k:
            cum += value
            kept.append(idx)
        else:
            break
    return set(kept)


@pytest.mark.parametrize("seed", range(20))
def test_cosyvoice_nucleus_matches_upstream_loop(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 60, generator=g, dtype=torch.float64) * 3
    cfg = SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice")
    law = distribution(cfg, logits)[0]
    assert set(law.nonzero().flatten().tolist()) == cosyvoice_nucleus_loop(logits[0], 0.8, 25)
    kept = law > 0
    torch.testing.assert_close(law[kept], logits[0].softmax(-1)[kept] / logits[0].softmax(-1)[kept].sum())


def cosyvoice_nucleus_sorted(cfg: SamplingConfig, probs: torch.Tensor) -> torch.Tensor:
    """CosyVoice's nucleus in closed form over the whole sorted vocabulary (descending stable sort, the mass before
    a token < top_p, the first top_k): the law the top-k path must give bit for bit."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = (
        (sorted_p.cumsum(-1) - sorted_p) < cfg.top_p
        if cfg.top_p is not None
        else torch.ones_like(sorted_p).bool()
    )
    if cfg.top_k is not None:
        keep[..., cfg.top_k :] = False
    kept = probs * torch.zeros_like(keep).scatter(-1, order, keep)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cosyvoice_nucleus_equals_the_sorted_vocabulary_bit_for_bit(dtype):
    """The nucleus is found with topk, not a sort of the vocabulary; ties (quantised logits), masked ids and every
    top_k / top_p combination give the sorted closed form's law exactly, at the toy's and CosyVoice 2's sizes."""
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        vocab, rows = (7, 60, 1027, 6564)[trial % 4], 1 + trial % 8
        logits = torch.randn(rows, vocab, generator=g, dtype=dtype) * 3
        if trial % 3 == 0:
            logits = (logits * 2).round() / 2  # many equal probabilities, some at the cut
        if trial % 5 == 0:
            logits[:, : vocab // 2] = float("-inf")
        top_k, top_p = (1, 2, 5, 25, None)[trial % 5], (0.8, 0.5, None, 0.99, 0.3)[(trial // 5) % 5]
        if top_k is None and top_p is None:
            continue
        cfg = SamplingConfig(top_k=top_k, top_p=top_p, nucleus="cosyvoice")
        assert torch.equal(distribution(cfg, logits), cosyvoice_nucleus_sorted(cfg, logits.softmax(-1)))


def test_cosyvoice_nucleus_settles_a_tie_at_the_cut_by_id():
    """Four ids share the largest probability and top_k = 2 cuts among them: the stable sort takes the two lowest
    ids, whatever order topk returns equal values in."""
    logits = torch.zeros(1, 12)
    logits[0, [9, 3, 11, 6]] = 2.0
    law = distribution(SamplingConfig(top_k=2, nucleus="cosyvoice"), logits)
    assert law[0].nonzero().flatten().tolist() == [3, 6]
    law = distribution(SamplingConfig(top_k=3, top_p=0.99, nucleus="cosyvoice"), logits)
    assert law[0].nonzero().flatten().tolist() == [3, 6, 9]


def test_cosyvoice_nucleus_includes_the_crossing_token_and_caps_at_top_k():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64).log()
    law = distribution(SamplingConfig(top_p=0.6, top_k=25, nucleus="cosyvoice"), logits)
    assert (law[0] > 0).tolist() == [True, True, False, False]  # 0.5 < 0.6 so 0.3 is taken too
    law = distribution(SamplingConfig(top_p=0.99, top_k=2, nucleus="cosyvoice"), logits)
    assert (law[0] > 0).tolist() == [True, True, False, False]


@pytest.mark.parametrize("top_k,top_p", [(5, None), (None, 0.7), (8, 0.9), (3, 0.5)])
def test_hf_rule_matches_transformers_warpers(top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 40, generator=g)
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p:
        expected = TopPLogitsWarper(top_p)(None, expected)
    got = distribution(SamplingConfig(top_k=top_k, top_p=top_p, nucleus="hf"), logits)
    torch.testing.assert_close(got, expected.softmax(-1))


def test_temperature_and_greedy():
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    torch.testing.assert_close(
        distribution(SamplingConfig(temperature=0.5), logits), (logits / 0.5).softmax(-1)
    )
    assert distribution(SamplingConfig(temperature=0), logits).tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.parametrize("mode", ["mask", "resample", "mask_eos", "resample_eos"])
def test_stop_tokens_forbidden_before_min_len_only(mode):
    logits = torch.zeros(2, 6, dtype=torch.float64)
    logits[0, 4:] = 1.0  # row 0: both stop tokens in the nucleus
    cfg = SamplingConfig(stop_tokens=(4, 5), eos_mode=mode, top_k=3, nucleus="cosyvoice")
    law = distribution(cfg, logits, step=torch.tensor([0, 3]), min_len=torch.tensor([2, 2]))
    assert law[0, 4] == 0 and law[0].sum() == pytest.approx(1)
    # "*_eos" forbid EOS (the first stop token) only; the other stop token keeps its mass and ends the row
    assert (law[0, 5] == 0) == (mode in ("mask", "resample"))
    # after min_len stop tokens keep their nucleus mass (the first 3 ids under a stable sort)
    assert law[1].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0, 0, 0])


def test_eos_modes_differ_as_upstream_versions_do():
    """mask: nucleus chosen after masking; resample: nucleus law conditioned on not-stop."""
    logits = torch.tensor([[3.0, 1.0, 0.9, 0.8]], dtype=torch.float64)
    cfg = dict(top_k=2, nucleus="cosyvoice", stop_tokens=(0,))
    masked = distribution(SamplingConfig(eos_mode="mask", **cfg), logits, step=0, min_len=1)
    resampled = distribution(SamplingConfig(eos_mode="resample", **cfg), logits, step=0, min_len=1)
    assert (masked[0] > 0).tolist() == [False, True, True, False]
    assert resampled[0].tolist() == pytest.approx([0, 1, 0, 0])  # nucleus {0, 1}, 0 refused


STOP = (5, 6, 7)  # CosyVoice 2's three stop tokens (EOS first) in a vocabulary of 8
EOS_LOGITS = torch.tensor([[1.0, 0.6, 0.2, -0.5, -1.0, 1.4, 1.1, 0.0]], dtype=torch.float64)
EOS_NUCLEUS = SamplingConfig(top_k=4, top_p=0.9, nucleus="cosyvoice")


def eos_procedure(mode: str, n: int, generator) -> torch.Tensor:
    """Before min_len, each dated upstream Qwen2LM.sampling_ids written out literally (the nucleus draw is
    CosyVoice's nucleus_sampling): redraw loops test the drawn id, masks set logits to -inf first."""
    logits = EOS_LOGITS.clone()
    if mode in ("mask", "mask_eos"):
        logits[0, list(STOP if mode == "mask" else STOP[:1])] = float("-inf")
    draws = sample(distribution(EOS_NUCLEUS, logits).expand(n, -1), generator)
    refused = list(
        STOP if mode == "resample" else STOP[:1]
    )  # "resample_eos": only `speech_token_size not in top_ids`
    if mode.startswith("resample"):
        again = torch.isin(draws, torch.tensor(refused))
        while again.any():
            draws[again] = sample(distribution(EOS_NUCLEUS, logits).expand(int(again.sum()), -1), generator)
            again = torch.isin(draws, torch.tensor(refused))
    return draws


def eos_p_value(law_mode: str, procedure_mode: str) -> float:
    g = torch.Generator().manual_seed(7)
    cfg = SamplingConfig(top_k=4, top_p=0.9, nucleus="cosyvoice", stop_tokens=STOP, eos_mode=law_mode)
    law = distribution(cfg, EOS_LOGITS, step=0, min_len=1)[0].numpy()
    n = 40_000
    observed = np.bincount(eos_procedure(procedure_mode, n, g).numpy(), minlength=law.shape[0])
    support = law > 0
    if observed[~support].sum():
        return 0.0
    return chisquare(observed[support], law[support] * n).pvalue


EOS_MODE_NAMES = ["mask", "mask_eos", "resample", "resample_eos"]


@pytest.mark.parametrize("mode", EOS_MODE_NAMES)
def test_eos_closed_form_matches_upstreams_procedure(mode):
    assert eos_p_value(mode, mode) > P_REJECT


@pytest.mark.parametrize(
    "law,procedure", [(a, b) for a in EOS_MODE_NAMES for b in EOS_MODE_NAMES if a != b], ids=str
)
def test_eos_test_rejects_every_other_mode(law, procedure):
    """Negative control: the same test tells the four dated upstream rules apart."""
    assert eos_p_value(law, procedure) < P_REJECT


@pytest.mark.parametrize("mode", EOS_MODE_NAMES)
def test_speculative_decoding_is_exact_under_each_eos_mode(mode):
    """Two stop tokens, min_len 2, CosyVoice's nucleus + RAS: speculative decoding reproduces the enumerated
    joint law of the first three tokens; its samples fail the law of another mode (negative control)."""
    from engine_models import speculative, trigram_pair
    from test_llasa_law import joint_law, p_value

    from ssd.decoding.acceptance import ExactRule

    vocab, prompt, n_seq = 6, torch.tensor([[1, 2]]), 20_000
    target, draft = trigram_pair(vocab, seed=5, draft_noise=1.5, scale=1.5)
    target.table[..., 4:] += 1.0  # stop tokens likely enough for the rules to matter
    cfgs = {
        m: SamplingConfig(
            top_k=3, top_p=0.9, nucleus="cosyvoice", ras_window=10, stop_tokens=(4, 5), eos_mode=m
        )
        for m in EOS_MODE_NAMES
    }
    g = torch.Generator().manual_seed(0)
    tokens = speculative(target, draft, prompt.expand(n_seq, -1), cfgs[mode], ExactRule(), 3, 3, 2, g).tokens
    laws = {m: joint_law(target, prompt, cfg, 3, 4, min_len=2) for m, cfg in cfgs.items()}
    assert p_value(tokens, laws[mode], 3, 4) > P_REJECT
    other = {"mask": "mask_eos", "mask_eos": "mask", "resample": "resample_eos", "resample_eos": "resample"}[
        mode
    ]
    assert p_value(tokens, laws[other], 3, 4) < P_REJECT


def test_eos_mode_names_say_which_upstream_dates_they_match():
    with pytest.raises(ValueError, match=r"'mask_eos': .*since 2026-02-11.*Got 'redraw'"):
        SamplingConfig(eos_mode="redraw")


def ras_procedure(logits, window, cfg, n, generator):
    """RAS as upstream runs it: nucleus draw, and a redraw from the full softmax
    (without the repeated id in the newer variant) when the draw sits in the window."""
    nucleus = distribution(SamplingConfig(top_k=cfg.top_k, top_p=cfg.top_p, nucleus="cosyvoice"), logits)
    probs = logits.softmax(-1)
    draws = sample(nucleus.expand(n, -1), generator)
    counts = torch.tensor([(window == y).sum().item() for y in range(logits.shape[-1])])
    repeated = counts[draws] >= cfg.ras_window * cfg.ras_tau
    out = draws.clone()
    if cfg.ras_variant == "classic":
        out[repeated] = sample(probs.expand(int(repeated.sum()), -1), generator)
    else:
        for i in repeated.nonzero().flatten().tolist():
            fallback = probs[0].clone()
            fallback[draws[i]] = 0
            out[i] = sample((fallback / fallback.sum()).unsqueeze(0), generator)[0]
    return out


def ras_p_value(law_variant: str, procedure_variant: str) -> float:
    g = torch.Generator().manual_seed(3)
    vocab, n = 8, 40_000
    logits = torch.randn(1, vocab, generator=g, dtype=torch.float64) * 1.2
    cfg = dict(top_k=4, top_p=0.9, nucleus="cosyvoice", ras_window=10, ras_tau=0.1)
    window = torch.tensor([[-1, -1, 5, 1, 1, 7, 0, 2, 2, 3]])  # includes nucleus members
    law = distribution(SamplingConfig(ras_variant=law_variant, **cfg), logits, window)[0].numpy()
    procedure = SamplingConfig(ras_variant=procedure_variant, **cfg)
    observed = np.bincount(
        ras_procedure(logits, window[window >= 0], procedure, n, g).numpy(), minlength=vocab
    )
    support = law > 0
    if observed[~support].sum():
        return 0.0
    return chisquare(observed[support], law[support] * n).pvalue


@pytest.mark.parametrize("variant", ["classic", "exclude_repeated"])
def test_ras_closed_form_matches_the_procedure(variant):
    assert ras_p_value(variant, variant) > P_REJECT


@pytest.mark.parametrize("law,procedure", [("classic", "exclude_repeated"), ("exclude_repeated", "classic")])
def test_ras_test_rejects_the_other_variant(law, procedure):
    """Negative control: the same test tells the two upstream variants apart."""
    assert ras_p_value(law, procedure) < P_REJECT


def test_ras_window_counts_only_generated_tokens_and_the_threshold():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    cfg = SamplingConfig(top_k=2, nucleus="cosyvoice", ras_window=4, ras_tau=0.5)  # repeat = 2+ times
    once = distribution(cfg, logits, torch.tensor([[0, 3, -1, -1]]))
    twice = distribution(cfg, logits, torch.tensor([[0, 3, 0, -1]]))
    nucleus = distribution(SamplingConfig(top_k=2, nucleus="cosyvoice"), logits)
    torch.testing.assert_close(once, nucleus)
    expected = nucleus.clone()
    expected[0, 0] = 0
    expected += nucleus[0, 0] * logits.softmax(-1)
    torch.testing.assert_close(twice, expected)


def test_bad_config_values_fail_clearly():
    with pytest.raises(ValueError, match="nucleus"):
        SamplingConfig(nucleus="topk")
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=1.5)


def test_resample_mode_survives_a_nucleus_of_stop_tokens_only():
    """Upstream's redraw loop would give up; the law falls back to masking those tokens."""
    logits = torch.tensor([[0.0, 0.1, 0.2, 9.0]], dtype=torch.float64)
    cfg = SamplingConfig(top_k=1, nucleus="cosyvoice", stop_tokens=(3,), eos_mode="resample")
    law = distribution(cfg, logits, step=0, min_len=2)
    masked = distribution(
        SamplingConfig(top_k=1, nucleus="cosyvoice", stop_tokens=(3,), eos_mode="mask"),
        logits,
        step=0,
        min_len=2,
    )
    torch.testing.assert_close(law, masked)
    assert law[0].tolist() == [0, 0, 1, 0]


def test_resample_fallback_is_chosen_row_by_row():
    """In one batch, a row whose nucleus is only stop tokens takes the masked law, a row past min_len keeps its
    law, and a row with other tokens in its nucleus is conditioned on them: each as it is alone."""
    cfg = SamplingConfig(
        top_k=2, top_p=0.6, nucleus="cosyvoice", ras_window=2, stop_tokens=(3,), eos_mode="resample"
    )
    logits = torch.tensor(
        [[0.0, 0.1, 0.2, 9.0], [0.0, 3.0, 2.9, 3.1], [0.0, 3.0, 2.9, 3.1]], dtype=torch.float64
    )
    window = torch.tensor([[0, -1], [0, -1], [0, -1]])
    step, min_len = torch.tensor([0, 0, 5]), torch.tensor([2, 2, 2])
    batch = distribution(cfg, logits, window, step, min_len)
    for row in range(3):
        alone = distribution(cfg, logits[row : row + 1], window[row : row + 1], step[row : row + 1],
                             min_len[row : row + 1])  # fmt: skip
        torch.testing.assert_close(batch[row : row + 1], alone, rtol=0, atol=0)
    masked = distribution(replace(cfg, eos_mode="mask"),
                          logits[:1], window[:1], step[:1], min_len[:1])  # fmt: skip
    torch.testing.assert_close(batch[:1], masked)
    # row 1: nucleus {3, 1} without the refused 3 is {1}; its masked law would take {1, 2}
    assert batch[1].tolist() == pytest.approx([0, 1, 0, 0])
    assert batch[2, 3] > 0 and batch[2, 1] > 0  # past min_len: EOS keeps its share
