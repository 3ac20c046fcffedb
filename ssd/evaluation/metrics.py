"""Run-level metrics from per-utterance records, with bootstrap confidence intervals.

Every metric is a ratio of sums or a mean over utterances, so one function computes it from a list of
records and the bootstrap simply recomputes it on utterances resampled with replacement (seeded).

A record (one line of `utterances.jsonl`) carries the raw counts needed here:
  lm_time, audio_sec, n_tokens, errors, ref_words, wer, sim, target_calls, draft_calls,
  proposed / accepted / overlap_sum / tv_sum (per draft position), rounds, accepted_total,
  and for the toy world wrong_errors / wrong_ref_words and slot_correct {slot: bool}.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

CI_LEVEL = 0.95


def _sum(records: Sequence[dict], key: str) -> float:
    return float(sum(r[key] for r in records if r.get(key) is not None))


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def lm_rtf(records: Sequence[dict]) -> float:
    """LM-RTF = total LM generation time / total generated audio duration (ratio of sums)."""
    return _ratio(_sum(records, "lm_time"), _sum(records, "audio_sec"))


def corpus_wer(records: Sequence[dict]) -> float:
    """Total word errors / total reference words."""
    return _ratio(_sum(records, "errors"), _sum(records, "ref_words"))


def mean_utterance_wer(records: Sequence[dict]) -> float:
    """Mean of per-utterance WERs (Seed-TTS-eval style)."""
    values = [r["wer"] for r in records if r.get("wer") is not None]
    return float(np.mean(values)) if values else float("nan")


def mean_sim(records: Sequence[dict]) -> float:
    """Mean speaker similarity to the prompt; utterances too short to embed (sim = null) are left out."""
    values = [r["sim"] for r in records if r.get("sim") is not None]
    return float(np.mean(values)) if values else float("nan")


def wrong_sentence_wer(records: Sequence[dict]) -> float:
    """Corpus WER of each hypothesis scored against ANOTHER utterance's text: the 'ignores the text' level."""
    return _ratio(_sum(records, "wrong_errors"), _sum(records, "wrong_ref_words"))


def _per_position(records: Sequence[dict], key: str) -> list[float]:
    """Σ_utts key[i] / Σ_utts proposed[i] for each draft position i."""
    width = max((len(r.get("proposed") or []) for r in records), default=0)
    num, den = np.zeros(width), np.zeros(width)
    for r in records:
        values, proposed = r.get(key) or [], r.get("proposed") or []
        num[: len(values)] += values
        den[: len(proposed)] += proposed
    return [float(n / d) if d else float("nan") for n, d in zip(num, den)]


def bootstrap_ci(
    records: Sequence[dict],
    statistic: Callable[[Sequence[dict]], float],
    n_resamples: int = 1000,
    seed: int = 0,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """Percentile bootstrap CI of `statistic`, resampling utterances with replacement (seeded)."""
    if len(records) < 2 or n_resamples < 1:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(n_resamples):
        idx = rng.integers(0, len(records), len(records))
        value = statistic([records[i] for i in idx])
        if not math.isnan(value):
            values.append(value)
    if not values:
        return float("nan"), float("nan")
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi)


def summarize(records: Sequence[dict], n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The metrics.json summary of one run (see the module docstring for the record fields)."""
    if not records:
        raise ValueError("summarize: no utterance records (did every utterance fail?)")
    out: dict[str, Any] = {"num_utterances": len(records)}
    for name, fn in (
        ("lm_rtf", lm_rtf),
        ("wer", corpus_wer),
        ("wer_per_utt", mean_utterance_wer),
        ("sim", mean_sim),
    ):
        out[name] = fn(records)
        out[f"{name}_ci"] = list(bootstrap_ci(records, fn, n_resamples, seed))
    tokens = _sum(records, "n_tokens")
    proposed = sum(sum(r.get("proposed") or []) for r in records)
    accepted = sum(sum(r.get("accepted") or []) for r in records)
    rounds = _sum(records, "rounds")
    out.update(
        {
            "lm_time": _sum(records, "lm_time"),
            "audio_sec": _sum(records, "audio_sec"),
            "tokens": int(tokens),
            "tokens_per_sec": _ratio(tokens, _sum(records, "lm_time")),
            "target_calls_per_token": _ratio(_sum(records, "target_calls"), tokens),
            "draft_calls_per_token": _ratio(_sum(records, "draft_calls"), tokens),
            "acceptance_rate": _ratio(accepted, proposed),
            # Draft tokens kept per verification round (the paper's "mean accepted length").
            "mean_accepted_length": _ratio(_sum(records, "accepted_total"), rounds),
            "alpha_per_position": _per_position(records, "accepted"),
            "beta_per_position": _per_position(records, "overlap_sum"),
            "tv_per_position": _per_position(records, "tv_sum")
            if all(r.get("tv_known", True) for r in records)
            else [float("nan")] * len(_per_position(records, "tv_sum")),
            "finished_by_stop": float(np.mean([r.get("finish_reason") == "stop" for r in records])),
            "sim_missing": sum(r.get("sim") is None for r in records),
        }
    )
    if any("wrong_errors" in r for r in records):
        out["wer_wrong_sentence"] = wrong_sentence_wer(records)
        out["wer_wrong_sentence_ci"] = list(bootstrap_ci(records, wrong_sentence_wer, n_resamples, seed))
    slot_records = [r["slot_correct"] for r in records if r.get("slot_correct")]
    if slot_records:
        out["slot_accuracy"] = {
            slot: float(np.mean([s[slot] for s in slot_records])) for slot in slot_records[0]
        }
    return out
