"""Run-level metrics from per-utterance records, with bootstrap confidence intervals.

Every metric is a ratio of sums or a mean over utterances, so one function computes it from a list of
records and the bootstrap simply recomputes it on utterances resampled with replacement (seeded).

A record (one line of `utterances.jsonl`) carries the raw counts needed here:
  lm_time (batch-1 LM time; null for an item that was not timed), baseline_lm_time (the baseline decoder's
  batch-1 time on the same item, timed beside it in the same run; null without a baseline), vocoder_time,
  decode_time_share (its batched decode's time / the batch's rows), audio_sec, n_tokens, errors, ref_words, wer, sim, target_calls, draft_calls,
  proposed / accepted / overlap_sum / tv_sum (per draft position), rounds, accepted_total,
  and for the toy world wrong_errors / wrong_ref_words and slot_correct {slot: bool}; with a MOS judge
  (configs/mos/) nmos and mos_<key> per estimate (null where the audio could not be judged); with
  eval.streaming the timed records' streaming fields (ssd.evaluation.streaming: first_packet, stall_total,
  stall_count, stream_rtf, ..., and the paired baseline's baseline_first_packet, baseline_stall_*).

The statistics of the exactness study live here too: a two-sample chi-square homogeneity test on decoded
tokens, the repeat rate of token sequences, and paired (same utterance) differences between two runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

CI_LEVEL = 0.95


def _sum(records: Sequence[dict], key: str) -> float:
    return float(sum(r[key] for r in records if r.get(key) is not None))


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


def _timed(records: Sequence[dict]) -> list[dict]:
    """The records timed alone (batch 1): the only ones a latency is measured on."""
    return [r for r in records if r.get("lm_time") is not None]


def lm_rtf(records: Sequence[dict]) -> float:
    """LM-RTF = total LM generation time / total generated audio duration (ratio of sums), over the
    utterances timed at batch 1."""
    timed = _timed(records)
    return _ratio(_sum(timed, "lm_time"), _sum(timed, "audio_sec"))


def e2e_rtf(records: Sequence[dict]) -> float:
    """End-to-end RTF = (LM time + token-to-waveform time) / audio duration, over the batch-1 timed utterances."""
    timed = _timed(records)
    if any(r.get("vocoder_time") is None for r in timed):  # records written before vocoding was timed
        return float("nan")
    return _ratio(_sum(timed, "lm_time") + _sum(timed, "vocoder_time"), _sum(timed, "audio_sec"))


def corpus_wer(records: Sequence[dict]) -> float:
    """Total word errors / total reference words."""
    return _ratio(_sum(records, "errors"), _sum(records, "ref_words"))


def mean_utterance_wer(records: Sequence[dict]) -> float:
    """Mean of per-utterance WERs (Seed-TTS-eval style)."""
    values = [r["wer"] for r in records if r.get("wer") is not None]
    return float(np.mean(values)) if values else float("nan")


def mean_of(records: Sequence[dict], key: str) -> float:
    """Mean of a per-utterance score over the records that have it (null = not judged, left out)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def mean_sim(records: Sequence[dict]) -> float:
    """Mean speaker similarity to the prompt; utterances too short to embed (sim = null) are left out."""
    return mean_of(records, "sim")


def mos_keys(records: Sequence[dict]) -> list[str]:
    """The naturalness fields of a run's records: `nmos` first, then each `mos_<key>` (none: no MOS judge)."""
    keys = {k for r in records for k in r if k == "nmos" or k.startswith("mos_")}
    return sorted(keys, key=lambda k: (k != "nmos", k))


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


def paired_speedup(records: Sequence[dict]) -> float:
    """Σ baseline LM time / Σ LM time over utterances timed in pairs (a ratio of sums, so long utterances
    weigh as much as the time they take)."""
    return _ratio(_sum(records, "baseline_lm_time"), _sum(records, "lm_time"))


def paired_speedup_ci(records: Sequence[dict], level: float = CI_LEVEL) -> tuple[float, float]:
    """CI of `paired_speedup` (a ratio estimator): its linearised standard error sqrt(Σ (a_i - R o_i)² /
    (n (n - 1))) / mean(o), with a t quantile. Computed in closed form rather than by the bootstrap, which
    covers a ratio of sums over tens of utterances of unequal length a little less often than it claims
    (tests/test_runner.py simulates both)."""
    from scipy.stats import t

    a = np.array([r["baseline_lm_time"] for r in records], dtype=float)
    o = np.array([r["lm_time"] for r in records], dtype=float)
    n = len(a)
    if n < 2 or not o.sum():
        return float("nan"), float("nan")
    ratio = a.sum() / o.sum()
    se = np.sqrt(((a - ratio * o) ** 2).sum() / (n * (n - 1))) / o.mean()
    half = float(t.ppf(0.5 + level / 2, n - 1) * se)
    return float(ratio - half), float(ratio + half)


def summarize(records: Sequence[dict], n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The metrics.json summary of one run (see the module docstring for the record fields)."""
    if not records:
        raise ValueError("summarize: no utterance records (did every utterance fail?)")
    out: dict[str, Any] = {"num_utterances": len(records)}
    for name, fn in (
        ("lm_rtf", lm_rtf),
        ("e2e_rtf", e2e_rtf),
        ("wer", corpus_wer),
        ("wer_per_utt", mean_utterance_wer),
        ("sim", mean_sim),
        *((key, partial(mean_of, key=key)) for key in mos_keys(records)),
    ):
        out[name] = fn(records)
        out[f"{name}_ci"] = list(bootstrap_ci(records, fn, n_resamples, seed))
    if "nmos" in out:
        out["nmos_missing"] = sum(r.get("nmos") is None for r in records)
    tokens = _sum(records, "n_tokens")
    proposed = sum(sum(r.get("proposed") or []) for r in records)
    accepted = sum(sum(r.get("accepted") or []) for r in records)
    rounds = _sum(records, "rounds")
    timed = _timed(records)
    lm_time, vocoder_time = _sum(timed, "lm_time"), _sum(timed, "vocoder_time")
    decode_time = _sum(records, "decode_time_share")
    out.update(
        {
            "lm_time": lm_time,
            "audio_sec": _sum(records, "audio_sec"),
            "tokens": int(tokens),
            "timed_utterances": len(timed),  # timed at batch 1: LM-RTF and E2E-RTF are over these
            "tokens_per_sec": _ratio(_sum(timed, "n_tokens"), lm_time),  # batch 1
            "vocoder_share": _ratio(vocoder_time, lm_time + vocoder_time) if vocoder_time else float("nan"),
            # Throughput of the decode as run (batched when eval.batch_size > 1), LM stage only.
            "throughput_utts_per_sec": _ratio(len(records), decode_time),
            "throughput_tokens_per_sec": _ratio(tokens, decode_time),
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
    paired = [r for r in records if r.get("baseline_lm_time") is not None and r.get("lm_time")]
    if paired:  # timed beside the baseline in this run: the speedup, its CI, and what the pairs cost
        out["speedup"] = paired_speedup(paired)
        out["speedup_ci"] = list(paired_speedup_ci(paired))
        out["speedup_utterances"] = len(paired)
        out["baseline_lm_time"] = _sum(paired, "baseline_lm_time")
    out.update(streaming_metrics(records, n_resamples, seed))
    if any("wrong_errors" in r for r in records):
        out["wer_wrong_sentence"] = wrong_sentence_wer(records)
        out["wer_wrong_sentence_ci"] = list(bootstrap_ci(records, wrong_sentence_wer, n_resamples, seed))
    slot_records = [r["slot_correct"] for r in records if r.get("slot_correct")]
    if slot_records:
        out["slot_accuracy"] = {
            slot: float(np.mean([s[slot] for s in slot_records])) for slot in slot_records[0]
        }
    return out


def median_of(records: Sequence[dict], key: str) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return float(np.median(values)) if values else float("nan")


def median_paired_difference(records: Sequence[dict], key: str = "first_packet") -> float:
    """Median over utterances of (own - baseline) `key`, both timed on the same item in the same process."""
    diffs = [r[key] - r[f"baseline_{key}"] for r in records]
    return float(np.median(diffs)) if diffs else float("nan")


def streaming_metrics(records: Sequence[dict], n_resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """A streamed run's summary over its timed records (none without eval.streaming): the median first-packet
    latency with a bootstrap CI; stalls (total seconds, late chunks, utterances with any); streaming RTF (Σ last
    chunk's ready time / Σ audio); and against the baseline decoded beside each item: the median paired
    difference in first-packet latency with a bootstrap CI (percentile, utterances resampled), and the baseline's
    median and stalls on the same items."""
    streamed = [r for r in records if r.get("first_packet") is not None]
    if not streamed:
        return {}
    out: dict[str, Any] = {
        "stream_utterances": len(streamed),
        "first_packet_median": median_of(streamed, "first_packet"),
        "first_packet_median_ci": list(
            bootstrap_ci(streamed, partial(median_of, key="first_packet"), n_resamples, seed)
        ),  # fmt: skip
        "first_packet_mean": float(np.mean([r["first_packet"] for r in streamed])),
        "stall_total": _sum(streamed, "stall_total"),
        "stall_count": int(_sum(streamed, "stall_count")),
        "stalled_utterances": sum(bool(r["stall_count"]) for r in streamed),
        "stream_rtf": _ratio(
            sum(r["chunk_ready"][-1] for r in streamed), sum(sum(r["chunk_sec"]) for r in streamed)
        ),
        "chunks_per_utterance": float(np.mean([len(r["chunk_ready"]) for r in streamed])),
    }
    paired = [r for r in streamed if r.get("baseline_first_packet") is not None]
    if paired:
        out.update({
            "first_packet_delta_vs_ar": median_paired_difference(paired),
            "first_packet_delta_vs_ar_ci": list(bootstrap_ci(paired, median_paired_difference, n_resamples, seed)),
            "first_packet_faster_fraction": float(np.mean([r["first_packet"] < r["baseline_first_packet"]
                                                           for r in paired])),
            "baseline_first_packet_median": median_of(paired, "baseline_first_packet"),
            "baseline_stall_total": _sum(paired, "baseline_stall_total"),
            "baseline_stall_count": int(_sum(paired, "baseline_stall_count")),
            "first_packet_pairs": len(paired),
        })  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# Statistics of the exactness study
# --------------------------------------------------------------------------------------------------


def chi_square_homogeneity(a: Sequence, b: Sequence, min_cell: int = 5) -> dict[str, float]:
    """Two-sample chi-square test that samples `a` and `b` (hashable outcomes) come from one law.

    Outcomes seen fewer than `min_cell` times in both samples together are pooled into one cell (the
    chi-square approximation needs expected counts of about 5). Returns statistic, dof, p-value, cells."""
    from scipy.stats import chi2_contingency

    count_a, count_b = Counter(a), Counter(b)
    cells = sorted(set(count_a) | set(count_b), key=lambda c: (-(count_a[c] + count_b[c]), str(c)))
    frequent = [c for c in cells if count_a[c] + count_b[c] >= min_cell]
    rare = [c for c in cells if count_a[c] + count_b[c] < min_cell]
    table = np.array(
        [
            [count_a[c] for c in frequent] + [sum(count_a[c] for c in rare)],
            [count_b[c] for c in frequent] + [sum(count_b[c] for c in rare)],
        ]
    )
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return {"statistic": 0.0, "dof": 0, "p_value": 1.0, "cells": int(table.shape[1])}
    statistic, p_value, dof, _ = chi2_contingency(table, correction=False)
    return {
        "statistic": float(statistic),
        "dof": int(dof),
        "p_value": float(p_value),
        "cells": int(table.shape[1]),
    }


def repeat_rate(samples: Sequence[tuple[int, ...]]) -> float:
    """Fraction of sequences in which a token repeats an earlier one: only there can RAS act (a nucleus
    draw of a token already in its window is replaced by a draw from the full law), so only there can a
    verifier without RAS be told from the target."""
    return float(np.mean([len(set(s)) < len(s) for s in samples])) if samples else 0.0


def paired_differences(
    ar_records: Sequence[dict], spec_records: Sequence[dict], n_resamples: int = 1000, seed: int = 0
) -> list[dict[str, Any]]:
    """Speculative minus AR on the same utterances (records matched by `utt`): corpus WER (points of %)
    and mean SIM (and mean NMOS when both runs judged naturalness), with paired bootstrap 95% CIs. One
    dict per metric."""
    ar = {r["utt"]: r for r in ar_records}
    pairs = [(ar[r["utt"]], r) for r in spec_records if r["utt"] in ar]
    if len(pairs) < 2:
        raise ValueError("the AR and speculative runs share fewer than 2 utterances: nothing to pair")

    def wer_diff(ps):
        def wer(side):
            return sum(p[side]["errors"] for p in ps) / max(1, sum(p[side]["ref_words"] for p in ps))

        return wer(1) - wer(0)

    def sim_diff(ps):
        both = [(a["sim"], s["sim"]) for a, s in ps if a.get("sim") is not None and s.get("sim") is not None]
        return float(np.mean([s - a for a, s in both])) if both else float("nan")

    def nmos_diff(ps):
        both = [
            (a["nmos"], s["nmos"]) for a, s in ps if a.get("nmos") is not None and s.get("nmos") is not None
        ]
        return float(np.mean([s - a for a, s in both])) if both else float("nan")

    metrics = [("WER (points of %)", wer_diff, 100.0), ("SIM", sim_diff, 1.0)]
    if any("nmos" in p[0] and "nmos" in p[1] for p in pairs):  # both runs had a MOS judge
        metrics.append(("NMOS", nmos_diff, 1.0))
    rows = []
    for name, fn, scale in metrics:
        lo, hi = bootstrap_ci(pairs, fn, n_resamples, seed)
        value = fn(pairs)
        rows.append({"metric": name, "speculative - AR": value * scale, "95% CI lo": lo * scale,
                     "95% CI hi": hi * scale, "CI contains 0": bool(lo <= 0 <= hi), "pairs": len(pairs)})  # fmt: skip
    return rows


def paired_vs_ar(
    ar_records: Sequence[dict], records: Sequence[dict], n_resamples: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """`paired_differences` as metrics: wer_delta_vs_ar (points of %) and sim_delta_vs_ar, each with its
    paired 95% CI (`<key>_ci`), nmos_delta_vs_ar when both runs judged naturalness, and the number of
    utterances paired."""
    wer, sim, *nmos = paired_differences(ar_records, records, n_resamples, seed)
    extra = {}
    if nmos:
        extra = {"nmos_delta_vs_ar": nmos[0]["speculative - AR"],
                 "nmos_delta_vs_ar_ci": [nmos[0]["95% CI lo"], nmos[0]["95% CI hi"]]}  # fmt: skip
    return {
        **extra,
        "wer_delta_vs_ar": wer["speculative - AR"],
        "wer_delta_vs_ar_ci": [wer["95% CI lo"], wer["95% CI hi"]],
        "sim_delta_vs_ar": sim["speculative - AR"],
        "sim_delta_vs_ar_ci": [sim["95% CI lo"], sim["95% CI hi"]],
        "paired_utterances": wer["pairs"],
    }
