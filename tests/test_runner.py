"""The evaluation runner on the micro toy world: results on disk, resume, fail-fast, exactness of beta=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from omegaconf import OmegaConf

from ssd.evaluation import baselines
from ssd.evaluation import batch as batch_module
from ssd.evaluation import models as models_module
from ssd.evaluation.baselines import baseline_key
from ssd.evaluation.batch import TIMING_KEYS
from ssd.evaluation.items import utterance_seed, wrong_sentence_texts
from ssd.evaluation.metrics import bootstrap_ci, paired_speedup_ci, summarize
from ssd.evaluation.run_dir import (
    CONFIG_FILE,
    METRICS_FILE,
    QUARANTINE_FILE,
    RESULTS_FILE,
    TEST_LIST_FILE,
    read_records,
)
from ssd.evaluation.runner import evaluate
from ssd.evaluation.schema import MAX_DIRNAME, job_dirname
from ssd.evaluation.wandb_mirror import wandb_settings
from tests.fixtures_eval import compose_sweep_config, sweep_overrides


def _cfg(world, *extra: str, n_utts: int = 3, max_len: int = 25):
    return compose_sweep_config([*sweep_overrides(world, n_utts, max_len), "logger=none", *extra])


# --- pure pieces ------------------------------------------------------------------------------------


def test_utterance_seed_is_stable_and_depends_on_seed_and_utt():
    assert utterance_seed(0, "a") == utterance_seed(0, "a")
    assert len({utterance_seed(0, "a"), utterance_seed(1, "a"), utterance_seed(0, "b")}) == 3
    assert 0 <= utterance_seed(123, "x") < 2**63


def test_settings_from_a_config_composed_with_hydras_node_resolve_without_a_run():
    """The experiment driver composes with Hydra's own node (its sweeper params); the settings must still
    resolve outside a Hydra run, without that node."""
    from ssd.config import compose
    from ssd.evaluation.settings import RunSettings

    settings = RunSettings.from_config(compose("sweep", ["decoding=ar"], with_hydra=True))
    assert "hydra" not in settings.resolved and settings.resolved["output_dir"] is None


def test_read_records_sets_a_half_written_last_line_aside(tmp_path):
    path = tmp_path / RESULTS_FILE
    path.write_text(json.dumps({"utt": "a"}) + "\n" + json.dumps({"utt": "b"}) + "\n" + '{"utt": "c", "tok')
    assert [r["utt"] for r in read_records(path)] == ["a", "b"]
    assert path.read_text().endswith("}\n")  # the broken tail leaves the file, so appends stay valid JSONL
    (bad,) = [json.loads(line) for line in (tmp_path / QUARANTINE_FILE).read_text().splitlines()]
    assert bad["line"] == 3 and bad["text"] == '{"utt": "c", "tok'  # kept, not deleted
    assert read_records(tmp_path / "missing.jsonl") == []


def test_wrong_sentence_texts_never_pick_the_same_text():
    texts = ["a b", "a b", "c d", "e f"]
    wrong = wrong_sentence_texts(texts)
    assert all(w != t for w, t in zip(wrong, texts))
    assert wrong_sentence_texts(["same", "same"]) == [None, None]


def test_job_dirname_is_path_safe_and_bounded():
    assert job_dirname("beta=0,draft_len=2") == "beta=0,draft_len=2"
    assert "/" not in job_dirname("eval.corpus_root=/a/b,beta=0")
    long = ",".join(f"key{i}=value{i}" for i in range(40))
    assert len(job_dirname(long)) <= MAX_DIRNAME
    assert job_dirname(long) == job_dirname(long) != job_dirname(long + "x")
    # Two values that read alike once '/' is replaced still name two dirs.
    assert job_dirname("draft.checkpoint=a/x.pt") != job_dirname("draft.checkpoint=a_x.pt")


def test_wandb_settings_reads_lightning_style_logger_configs():
    assert wandb_settings({}) is None
    assert wandb_settings({"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger"}}) is None
    nested = {"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger", "project": "p", "offline": None}}
    assert wandb_settings(OmegaConf.create(nested))["project"] == "p"


def _record(utt, lm_time, audio_sec, errors, ref_words, sim, proposed, accepted):
    return {
        "utt": utt, "lm_time": lm_time, "audio_sec": audio_sec, "n_tokens": int(audio_sec * 25),
        "errors": errors, "ref_words": ref_words, "wer": errors / ref_words, "sim": sim,
        "target_calls": 10, "draft_calls": 30, "rounds": 10, "accepted_total": sum(accepted),
        "proposed": proposed, "accepted": accepted, "overlap_sum": [0.5 * p for p in proposed],
        "tv_sum": [0.0] * len(proposed), "finish_reason": "stop",
    }  # fmt: skip


def test_summarize_ratio_of_sums_and_per_position_rates():
    records = [
        _record("a", 1.0, 2.0, 1, 4, 0.8, [10, 8, 5], [8, 5, 2]),
        _record("b", 3.0, 2.0, 0, 6, 0.6, [10, 6], [6, 3]),
    ]
    m = summarize(records, n_resamples=100, seed=0)
    assert m["lm_rtf"] == pytest.approx(4.0 / 4.0)
    assert m["wer"] == pytest.approx(1 / 10)  # corpus WER: errors / reference words
    assert m["wer_per_utt"] == pytest.approx((0.25 + 0.0) / 2)  # mean per-utterance WER
    assert m["sim"] == pytest.approx(0.7)
    assert m["alpha_per_position"] == pytest.approx([14 / 20, 8 / 14, 2 / 5])
    assert m["beta_per_position"] == pytest.approx([0.5, 0.5, 0.5])
    assert m["acceptance_rate"] == pytest.approx(24 / 39)
    assert m["mean_accepted_length"] == pytest.approx(24 / 20)
    lo, hi = m["lm_rtf_ci"]
    assert lo <= m["lm_rtf"] <= hi and lo < hi


def test_bootstrap_ci_is_seeded_and_covers_the_mean():
    records = [{"x": float(v)} for v in np.random.default_rng(1).normal(5.0, 1.0, 200)]

    def mean(rs):
        return float(np.mean([r["x"] for r in rs]))

    first, again = bootstrap_ci(records, mean, 300, seed=7), bootstrap_ci(records, mean, 300, seed=7)
    assert first == again
    assert first[0] < mean(records) < first[1]
    assert 0.1 < first[1] - first[0] < 0.5  # ~ 2 * 1.96 / sqrt(200)


def test_the_paired_speedup_ci_covers_the_true_speedup():
    """Over simulated runs of 40 utterances (lengths vary 5-fold, each pair's ratio noisy by 10 %), the 95 %
    CI of Σ AR / Σ own covers the true 1.3 in 95 % of runs, where the percentile bootstrap of the same
    statistic covers it less often; a truth 5 % off is covered far less often (the negative control: the CI is
    narrow enough to tell a 5 % difference)."""
    from scipy.stats import binomtest

    rng = np.random.default_rng(0)
    covered = covered_off = covered_bootstrap = 0
    runs = 2000
    for _ in range(runs):
        ar = rng.lognormal(0.0, 0.5, 40)
        own = ar / 1.3 * rng.lognormal(-0.005, 0.1, 40)  # mean-one noise: E[lognormal(-σ²/2, σ)] = 1
        lo, hi = paired_speedup_ci([{"lm_time": o, "baseline_lm_time": a} for o, a in zip(own, ar)])
        covered += lo <= 1.3 <= hi
        covered_off += lo <= 1.3 * 1.05 <= hi
        resampled = rng.integers(0, 40, (400, 40))  # the percentile bootstrap, vectorised
        lo, hi = np.percentile(ar[resampled].sum(1) / own[resampled].sum(1), [2.5, 97.5])
        covered_bootstrap += lo <= 1.3 <= hi
    assert binomtest(covered, runs, 0.95).pvalue > 1e-3 and covered > covered_bootstrap
    assert covered_off / runs < 0.5


# --- the runner on the micro world --------------------------------------------------------------------


def test_evaluate_writes_results_and_resumes_without_redoing(micro_world, tmp_path):
    run_dir = tmp_path / "run"
    metrics = evaluate(_cfg(micro_world), run_dir)

    records = read_records(run_dir / RESULTS_FILE)
    assert [r["utt"] for r in records] == json_utts(run_dir / TEST_LIST_FILE)
    assert metrics["num_utterances"] == 3 == len(records)
    for key in ("lm_rtf", "wer", "wer_per_utt", "sim", "acceptance_rate", "alpha_per_position",
                "beta_per_position", "tv_per_position", "target_calls_per_token", "wer_wrong_sentence"):  # fmt: skip
        assert key in metrics
    assert metrics == json.loads((run_dir / METRICS_FILE).read_text())
    assert metrics["decoding"] == "speculative" and metrics["beta"] == 0.4 and metrics["draft_len"] == 3
    assert 0 < metrics["acceptance_rate"] < 1
    assert set(metrics["slot_accuracy"]) == {"command", "colour", "preposition", "noun", "digit", "adverb"}
    for r in records:
        assert r["audio_sec"] == pytest.approx(r["n_tokens"] / 25)
        assert 0 < r["lm_time"] and r["min_len"] <= r["n_tokens"] <= r["max_len"] == 25
        assert sum(r["accepted_per_round"]) == r["accepted_total"]
    wavs = sorted((run_dir / "audio").glob("*.wav"))
    assert len(wavs) == 2 and sf.info(str(wavs[0])).frames > 0
    assert OmegaConf.load(run_dir / CONFIG_FILE).beta == 0.4

    # Simulate a run killed while writing utterance 2: one whole record and half a line remain.
    lines = (run_dir / RESULTS_FILE).read_text().splitlines(keepends=True)
    (run_dir / RESULTS_FILE).write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    evaluate(_cfg(micro_world), run_dir)
    resumed = read_records(run_dir / RESULTS_FILE)
    assert [r["utt"] for r in resumed] == [r["utt"] for r in records]  # nothing lost, nothing twice
    assert resumed[0] == records[0]  # the finished record was kept, not redone
    # The redone utterances draw from the same per-utterance seed: the same tokens come out.
    assert [r["tokens"] for r in resumed[1:]] == [r["tokens"] for r in records[1:]]


def json_utts(path):
    return [json.loads(line)["utt"] for line in path.read_text().splitlines()]


def test_resume_refuses_a_run_dir_of_another_configuration(micro_world, tmp_path):
    run_dir = tmp_path / "run"
    evaluate(_cfg(micro_world, n_utts=2, max_len=15), run_dir)
    with pytest.raises(ValueError, match="different configuration.*beta"):
        evaluate(_cfg(micro_world, "beta=0.1", n_utts=2, max_len=15), run_dir)


@pytest.fixture
def no_decoding(monkeypatch):
    """Any decode call fails the test: fail-fast errors must come before decoding starts."""

    def forbidden(*args, **kwargs):
        raise AssertionError("decoding started before the configuration was checked")

    monkeypatch.setattr("ssd.decoding.decoders.decode_ar", forbidden)
    monkeypatch.setattr("ssd.decoding.decoders.decode_speculative", forbidden)


def test_missing_corpus_fails_fast_with_the_key(micro_world, tmp_path, no_decoding):
    cfg = _cfg(micro_world, f"eval.corpus_root={tmp_path / 'nowhere'}")
    with pytest.raises(FileNotFoundError, match="eval.corpus_root"):
        evaluate(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / RESULTS_FILE).exists()


def test_missing_asr_model_fails_fast_with_the_key(micro_world, tmp_path, no_decoding):
    models_module._LOADED.clear()
    cfg = _cfg(micro_world, "asr=whisper_base_toy", f"asr.model_dir={tmp_path / 'no_whisper'}")
    with pytest.raises(FileNotFoundError, match="model_dir"):
        evaluate(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / RESULTS_FILE).exists()


def test_missing_target_fails_fast(micro_world, tmp_path, no_decoding):
    cfg = _cfg(micro_world, f"target.model.model_dir={tmp_path / 'no_target'}")
    with pytest.raises(FileNotFoundError, match="target.model.*no_target"):
        evaluate(cfg, tmp_path / "run")


@pytest.mark.parametrize(
    "override, message",
    [
        ("draft_len=0", "draft_len=0 must be >= 1"),
        ("eval.max_len=-5", "eval.max_len=-5 must be >= 1 or null"),
        ("beta=-0.1", "beta=-0.1 must be >= 0"),
        ("theta=1.5", r"theta=1.5 must lie in \(-1, 1\)"),
        (
            "decoding.adaptive.enabled=true decoding.adaptive.min_len=5 decoding.adaptive.max_len=2",
            r"min_len \(5\) <= start \(3\) <= max_len \(2\)",
        ),
        ("eval.n_utts=0", "eval.n_utts=0 must be >= 1"),
        ("eval.batch_size=0", "eval.batch_size=0 must be >= 1"),
        ("eval.timed_utts=0", "eval.timed_utts=0 must be >= 1 or null"),
        (
            "eval.batch_invariant=true decoding.compile=true",
            "batch_invariant=true needs the eager decode path",
        ),
    ],
)
def test_out_of_range_settings_are_named_before_any_model_loads(
    micro_world,
    tmp_path,
    no_decoding,
    override,
    message,
):
    models_module._LOADED.clear()
    with pytest.raises(ValueError, match=message):
        evaluate(_cfg(micro_world, *override.split()), tmp_path / "run")
    assert not models_module._LOADED  # nothing was loaded
    assert not (tmp_path / "run" / RESULTS_FILE).exists()


def test_the_sampling_law_takes_the_loaded_targets_stop_tokens(micro_world):
    models = _models(_cfg(micro_world))
    assert (
        models.sampling.stop_tokens
        == models.target.stop_tokens
        == (micro_world.codebook, micro_world.codebook + 1, micro_world.codebook + 2)
    )


def _first_tokens(world, setting: list[str], samples: int, tokens: int = 2) -> list[tuple[int, ...]]:
    """The first `tokens` tokens of one test utterance decoded `samples` times (one seed each) through the
    runner's own decode path (`decode_items`: prompt, limits, per-row streams, the configured decoder)."""
    from dataclasses import replace

    from ssd.evaluation.items import build_test_list, prepare_item
    from ssd.evaluation.settings import RunSettings

    settings = RunSettings.from_config(_cfg(world, *setting, n_utts=1))
    models = models_module.load_models(settings)
    pair = next(build_test_list(settings.eval).itertuples(index=False))
    item = prepare_item(models, settings.seed, 0, pair, None, {})
    batch = [replace(item, seed=1000 + s) for s in range(samples)]
    with torch.inference_mode():
        result, _, _ = batch_module.decode_items(settings, models, batch, max_tokens=tokens)
    return [tuple(t) for t in result.tokens]


@pytest.mark.slow
def test_exact_speculative_decoding_through_the_runner_samples_the_targets_law(micro_world):
    """β = 0 through the runner (its prompts, limits, seeds and decoder) against AR through the runner: a
    chi-square homogeneity test on the joint law of the first two tokens of 3,000 decodes each; the same
    test rejects β = 1 (every draft token kept: the draft's law) — the negative control."""
    from ssd.evaluation.metrics import chi_square_homogeneity

    n = 3000
    ar = _first_tokens(micro_world, ["decoding=ar"], n)
    exact = _first_tokens(micro_world, ["acceptance=tolerance", "beta=0", "draft_len=2"], n)
    broken = _first_tokens(micro_world, ["acceptance=tolerance", "beta=1.0", "draft_len=2"], n)
    assert len(set(ar)) > 20  # a law with many outcomes, not one sequence
    assert chi_square_homogeneity(ar, exact, 5)["p_value"] > 1e-3
    assert chi_square_homogeneity(ar, broken, 5)["p_value"] < 1e-3


@pytest.mark.parametrize(
    "extra, mode",
    [(["acceptance=pcg", "theta=0.1"], "speculative"), (["decoding=draft_only"], "draft_only"),
     (["decoding.adaptive.enabled=true", "draft_len=1"], "speculative")],
)  # fmt: skip
def test_every_decoding_mode_runs_end_to_end(micro_world, tmp_path, extra, mode):
    metrics = evaluate(_cfg(micro_world, *extra, n_utts=1, max_len=15), tmp_path / "run")
    assert metrics["decoding"] == mode and metrics["num_utterances"] == 1
    record = read_records(tmp_path / "run" / RESULTS_FILE)[0]
    if mode == "draft_only":  # the draft alone: no verification rounds, no target calls
        # one call per token after the first, plus the call that produced the stop token if it stopped
        calls = record["n_tokens"] - (record["finish_reason"] == "max_len")
        assert record["target_calls"] == calls and record["rounds"] == 0
    elif "decoding.adaptive.enabled=true" in extra:
        assert max(record["draft_len_per_round"]) > 1  # the heuristic grew L_d from 1
    else:
        assert metrics["acceptance"] == "pcg" and 0 < metrics["acceptance_rate"] <= 1


def test_wandb_mode_is_online_only_with_a_key_or_an_explicit_choice(monkeypatch):
    """One rule for the trainer's WandbLogger and the eval mirror: never a login prompt."""
    from ssd.tracking import wandb_mode

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online" and wandb_mode(offline=True) == "offline"
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode() == "offline" and wandb_mode(mode="disabled") == "disabled"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert wandb_mode(offline=False) == "online" and wandb_mode() == "online"


# --- batched evaluation, timing, compile ----------------------------------------------------------------


def _models(cfg):
    from ssd.evaluation.settings import RunSettings

    return models_module.load_models(RunSettings.from_config(cfg))


def _without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.mark.parametrize("mode", [[], ["decoding=ar"]], ids=["speculative", "ar"])
def test_a_batched_run_writes_the_records_of_batch_1(micro_world, tmp_path, mode):
    """Ragged batches (4 items as 3 + 1), per-row seeds and limits: every record but its timing is the same
    as at batch 1 (tokens bit for bit, hence WER, SIM and acceptance); the first timed_utts items are timed
    alone, the rest carry only their share of the batched decode."""
    one = evaluate(_cfg(micro_world, *mode, "eval.batch_size=1", n_utts=4), tmp_path / "b1")
    three = evaluate(
        _cfg(micro_world, *mode, "eval.batch_size=3", "eval.timed_utts=2", n_utts=4), tmp_path / "b3"
    )
    r1, r3 = read_records(tmp_path / "b1" / RESULTS_FILE), read_records(tmp_path / "b3" / RESULTS_FILE)
    assert len(r1) == len(r3) == 4 and len({len(r["tokens"]) for r in r1}) > 1  # rows of different lengths
    # β_t overlaps and TV are float sums of laws from batched matmuls: equal to float32 rounding only.
    floats = ("overlap_sum", "tv_sum")
    assert [{k: v for k, v in r.items() if k not in floats} for r in _without_timing(r3)] == [
        {k: v for k, v in r.items() if k not in floats} for r in _without_timing(r1)
    ]
    for a, b in zip(r1, r3):
        for key in floats:
            assert (a[key] is None) == (b[key] is None) and np.allclose(a[key] or [], b[key] or [], rtol=1e-5)
    for key in ("wer", "wer_ci", "sim", "acceptance_rate", "alpha_per_position", "tokens", "slot_accuracy"):
        assert json.dumps(three[key]) == json.dumps(one[key]), key  # NaN (AR's acceptance) equals NaN
    assert [r["lm_time"] is not None for r in r3] == [True, True, False, False]
    assert all(r["lm_time"] is not None and r["decode_time_share"] == r["lm_time"] for r in r1)
    assert one["batch_size"] == 1 and three["batch_size"] == 3
    assert three["timed_utterances"] == 2 and one["timed_utterances"] == 4
    shares = [r["decode_time_share"] for r in r3]
    assert shares[0] == shares[1] == shares[2] != shares[3]  # one batched decode of 3, one of 1
    assert three["throughput_utts_per_sec"] == pytest.approx(4 / sum(shares))


def test_a_batch_that_decodes_otherwise_than_alone_is_refused(micro_world, tmp_path, monkeypatch):
    """The timed items are decoded twice (batched, then alone): tokens that differ mean the engine is not
    batch-invariant, and the run stops instead of writing records that depend on the batch."""
    decode = batch_module.decode_items

    def alone_differs(settings, m, items, max_tokens=None, decoder=None, observer=None):
        result, lo, hi = decode(settings, m, items, max_tokens, decoder, observer)
        if len(items) == 1 and max_tokens is None and decoder is None:
            result.tokens[0] = result.tokens[0][:-1]
        return result, lo, hi

    monkeypatch.setattr(batch_module, "decode_items", alone_differs)
    with pytest.raises(RuntimeError, match="not batch-invariant.*eval.batch_size=1"):
        evaluate(_cfg(micro_world, "eval.batch_size=2", "eval.timed_utts=1", n_utts=2), tmp_path / "run")
    assert not (tmp_path / "run" / RESULTS_FILE).exists()  # nothing batch-dependent was written


@pytest.mark.parametrize("batch", [1, 3])
def test_each_timed_item_is_timed_beside_its_baseline_in_alternating_order(
    micro_world, tmp_path, monkeypatch, batch
):
    """The speedup comes from pairs timed in one process: each timed item is decoded alone by the run's decoder
    and by the AR baseline, the baseline first on even items and second on odd ones (so neither side always
    runs right after the judges); speedup = Σ AR time / Σ own time over the pairs, with a bootstrap CI."""
    calls, timed_decode = [], batch_module._timed_decode

    def logged(settings, m, items, decoder=None):
        out = timed_decode(settings, m, items, decoder)
        calls.append(("baseline" if decoder is not None else "own", [it.index for it in items], out[2]))
        return out

    monkeypatch.setattr(batch_module, "_timed_decode", logged)
    metrics = evaluate(_cfg(micro_world, f"eval.batch_size={batch}", "eval.timed_utts=2"), tmp_path / "run")
    alone = [(who, items[0]) for who, items, _ in calls if len(items) == 1]
    assert alone == [("baseline", 0), ("own", 0), ("own", 1), ("baseline", 1)] + (
        [("own", 2)] if batch == 1 else []
    )
    records = read_records(tmp_path / "run" / RESULTS_FILE)
    assert [r["baseline_lm_time"] is not None for r in records] == [True, True, False]
    seconds = {(who, items[0]): s for who, items, s in calls if len(items) == 1}
    for i in (0, 1):
        assert records[i]["baseline_lm_time"] == seconds[("baseline", i)]
        assert records[i]["lm_time"] == seconds[("own", i)]
    own, ar = sum(r["lm_time"] for r in records[:2]), sum(r["baseline_lm_time"] for r in records[:2])
    assert metrics["speedup"] == pytest.approx(ar / own) and metrics["speedup_utterances"] == 2
    lo, hi = metrics["speedup_ci"]
    assert lo <= metrics["speedup"] <= hi and metrics["baseline_lm_time"] == pytest.approx(ar)


def test_the_baseline_timed_beside_a_run_must_decode_the_baseline_runs_tokens(micro_world, tmp_path):
    """The paired AR decodes are checked against the AR run the quality is compared with: a baseline run whose
    tokens differ (here: edited) means the two runs differ in more than their setting, and the run stops."""
    evaluate(_cfg(micro_world, "decoding=ar"), tmp_path / "ar")
    ok = evaluate(_cfg(micro_world, f"baseline_dir={tmp_path / 'ar'}"), tmp_path / "spec")
    assert ok["speedup_utterances"] == 3 and "wer_delta_vs_ar" in ok
    results = tmp_path / "ar" / RESULTS_FILE
    records = read_records(results)
    records[1]["tokens"] = records[1]["tokens"][:-1]
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(RuntimeError, match="other tokens than the baseline run"):
        evaluate(_cfg(micro_world, f"baseline_dir={tmp_path / 'ar'}"), tmp_path / "spec2")


# Chunks of 5 tokens (+ 2 of lookahead), so the micro world's short utterances stream in several chunks.
SMALL_CHUNKS = ("eval.streaming=true", "vocoder.token_hop_len=5", "vocoder.pre_lookahead_len=2")


def test_streaming_runs_record_first_packet_and_stalls_paired_with_ar_and_the_table_shows_them(
    micro_world, tmp_path
):
    """eval.streaming=true: every timed item (and its AR baseline beside it) streams; its record holds each chunk's
    ready time, duration, deadline and stall, the first-packet latency and the streaming RTF; the judged audio is
    the streamed audio; metrics.json has the median first-packet latency with its CI, stalls, and the paired
    median difference vs AR with its CI; the table shows them for AR and the speculative run."""
    from ssd.evaluation.tables import build_table, display_table

    sweep = tmp_path / "sweep"
    ar = evaluate(_cfg(micro_world, "decoding=ar", *SMALL_CHUNKS, max_len=30), sweep / "ar")
    spec = evaluate(_cfg(micro_world, *SMALL_CHUNKS, f"baseline_dir={sweep / 'ar'}", "eval.batch_size=2",
                         "eval.timed_utts=2", max_len=30), sweep / "spec")  # fmt: skip
    ar_records = read_records(sweep / "ar" / RESULTS_FILE)
    records = read_records(sweep / "spec" / RESULTS_FILE)
    for r in ar_records + records[:2]:
        n = len(r["chunk_ready"])
        assert n >= 2 and len(r["chunk_sec"]) == len(r["chunk_deadline"]) == len(r["chunk_stall"]) == n
        assert r["first_packet"] == r["chunk_ready"][0] > 0 and r["chunk_ready"] == sorted(r["chunk_ready"])
        assert sum(r["chunk_sec"]) == pytest.approx(r["audio_sec"])  # 640 samples a token at 16 kHz
        assert r["stall_total"] == pytest.approx(sum(r["chunk_stall"])) and r["stall_count"] >= 0
        assert r["stream_rtf"] == pytest.approx(r["chunk_ready"][-1] / r["audio_sec"])
        assert r["lm_time"] < r["chunk_ready"][-1]  # the LM time leaves the synthesis out
    assert all(r["baseline_first_packet"] > 0 for r in records[:2])
    assert records[2]["first_packet"] is None and records[2]["baseline_first_packet"] is None  # not timed
    assert all(r["vocoder_time"] > 0 for r in records)
    for m, n in ((ar, 3), (spec, 2)):
        assert m["stream_utterances"] == n and m["first_packet_median"] > 0
        lo, hi = m["first_packet_median_ci"]
        assert lo <= m["first_packet_median"] <= hi and m["stall_count"] >= 0 and m["stream_rtf"] > 0
    assert "first_packet_delta_vs_ar" not in ar and spec["first_packet_pairs"] == 2
    deltas = [r["first_packet"] - r["baseline_first_packet"] for r in records[:2]]
    assert spec["first_packet_delta_vs_ar"] == pytest.approx(np.median(deltas))
    assert len(spec["first_packet_delta_vs_ar_ci"]) == 2

    shown = display_table(build_table(sweep))
    assert list(shown["decoding"]) == ["ar", "speculative"]
    for column in (
        "first packet ms [95% CI]",
        "Δ first packet vs AR ms [95% CI]",
        "stalls n / s",
        "stream RTF",
    ):
        assert column in shown
    assert all("[" in v for v in shown["first packet ms [95% CI]"])
    assert shown["Δ first packet vs AR ms [95% CI]"].tolist()[0] == "-" and "[" in shown[
        "Δ first packet vs AR ms [95% CI]"].tolist()[1]  # fmt: skip


def test_a_run_that_does_not_stream_has_no_streaming_fields(micro_world, tmp_path):
    metrics = evaluate(_cfg(micro_world, n_utts=1, max_len=10), tmp_path / "run")
    (record,) = read_records(tmp_path / "run" / RESULTS_FILE)
    assert "first_packet" not in record and "first_packet_median" not in metrics


def test_streaming_needs_a_vocoder_that_streams(micro_world, tmp_path, monkeypatch):
    from ssd.toy_world.codec import ToyVocoder

    monkeypatch.delattr(ToyVocoder, "stream")
    with pytest.raises(ValueError, match="has no stream"):
        evaluate(_cfg(micro_world, "eval.streaming=true", n_utts=1, max_len=10), tmp_path / "run")


def test_adaptive_draft_length_runs_at_batch_1_and_says_so(micro_world, tmp_path):
    metrics = evaluate(_cfg(micro_world, "decoding.adaptive.enabled=true", "eval.batch_size=4", n_utts=2,
                            max_len=15), tmp_path / "run")  # fmt: skip
    assert metrics["batch_size"] == 1 and "adaptive" in metrics["batch_note"]
    assert metrics["timed_utterances"] == 2


def test_end_to_end_rtf_adds_the_vocoder_time(micro_world, tmp_path):
    metrics = evaluate(_cfg(micro_world, n_utts=2), tmp_path / "run")
    for r in read_records(tmp_path / "run" / RESULTS_FILE):
        assert r["vocoder_time"] > 0
        assert r["e2e_rtf"] == pytest.approx((r["lm_time"] + r["vocoder_time"]) / r["audio_sec"])
    assert metrics["e2e_rtf"] > metrics["lm_rtf"] and 0 < metrics["vocoder_share"] < 1


def test_judges_run_with_single_threaded_numpy_blas_and_torch_untouched(micro_world, tmp_path, monkeypatch):
    # OpenBLAS workers busy-wait after each call and slowed the next timed decode: judges get one BLAS thread.
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads():
        return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}

    models = _models(_cfg(micro_world))
    seen = []
    transcribe = type(models.asr).transcribe

    def recording(self, wav, sr):
        seen.append((blas_threads(), torch.get_num_threads()))
        return transcribe(self, wav, sr)

    monkeypatch.setattr(type(models.asr), "transcribe", recording)
    with threadpool_limits(2, user_api="blas"):
        before = blas_threads()
        evaluate(_cfg(micro_world, n_utts=2, max_len=10), tmp_path / "run")
        assert blas_threads() == before  # restored for the caller
    assert before and set(before.values()) == {2}  # the control: two threads outside a run
    assert seen and all(
        set(blas.values()) == {1} and threads == 1 for blas, threads in seen
    )  # eval.num_threads


def test_single_threaded_blas_covers_the_blas_a_judge_loads_later():
    # librosa loads scipy's OpenBLAS at its first mel spectrogram, inside the run: it must be limited too.
    pytest.importorskip("librosa", reason="the judges extra")
    code = (
        "import sys, numpy as np, torch\n"
        "from threadpoolctl import threadpool_info\n"
        "from ssd.evaluation.runner import single_threaded_blas\n"
        "assert 'scipy.linalg' not in sys.modules\n"
        "with single_threaded_blas():\n"
        "    import librosa\n"
        "    librosa.feature.melspectrogram(y=np.random.default_rng(0).standard_normal(16000), sr=16000)\n"
        "    blas = [i for i in threadpool_info() if i['user_api'] == 'blas']\n"
        "    print(len(blas), sorted({i['num_threads'] for i in blas}))\n"
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}  # two threads unless limited, on any machine
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    count, threads = out.stdout.split(maxsplit=1)
    assert int(count) >= 2 and threads.strip() == "[1]", out.stdout  # numpy's and scipy's, both limited


def test_decoding_compile_calls_each_models_compile_decoding(micro_world, tmp_path, monkeypatch):
    models = _models(_cfg(micro_world))
    called = []
    for model in (models.target, models.draft.model):
        monkeypatch.setattr(type(model), "compile_decoding", lambda self: called.append(self), raising=False)
    evaluate(_cfg(micro_world, "decoding.compile=true", n_utts=1, max_len=10), tmp_path / "run")
    assert models.target in called and models.draft.model in called
    assert compose_sweep_config(["decoding=ar"]).decoding.compile is False  # off unless asked


def test_decoding_compile_without_the_method_is_named(micro_world, tmp_path, monkeypatch, no_decoding):
    models = _models(_cfg(micro_world))
    owner = next(
        c for c in type(models.target).__mro__ if "compile_decoding" in vars(c)
    )  # the defining class
    monkeypatch.delattr(owner, "compile_decoding")
    with pytest.raises(
        ValueError,
        match="decoding.compile=true.*CosyVoice2LM has no compile_decoding.*decoding.compile=false",
    ):
        evaluate(_cfg(micro_world, "decoding.compile=true", n_utts=1), tmp_path / "run")


def test_the_ar_baseline_key_ignores_the_speculative_setting_only(micro_world):
    key = baseline_key(_cfg(micro_world))
    for same in (["beta=0"], ["draft_len=5"], ["acceptance=pcg"], ["decoding.adaptive.enabled=true"]):
        assert baseline_key(_cfg(micro_world, *same)) == key, same
    for other in (["seed=1"], ["target.sampling.top_k=5"]):
        assert baseline_key(_cfg(micro_world, *other)) != key, other
    assert baseline_key(_cfg(micro_world, n_utts=5)) != key


def test_concurrent_jobs_run_the_shared_baseline_once(micro_world, tmp_path, monkeypatch):
    """Two jobs of a parallel sweep ask for the same AR baseline at once: one runs it under the lock, the
    other waits and reuses its metrics.json (the lock is a flock, so two threads contend like two processes)."""
    import threading
    import time

    calls = []

    def slow_ar_run(cfg, run_dir, jobs=1):
        calls.append(cfg.decoding._target_)
        time.sleep(0.5)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / METRICS_FILE).write_text("{}")

    monkeypatch.setattr(baselines, "evaluate", slow_ar_run)
    cfgs = [_cfg(micro_world, "beta=0"), _cfg(micro_world, "beta=0.4", "draft_len=2")]
    found = []
    threads = [
        threading.Thread(target=lambda c=c: found.append(baselines.ensure_baseline(c, tmp_path)))
        for c in cfgs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (
        calls == ["ssd.decoding.decoders.Autoregressive"]
        and len(set(found)) == 1
        and (found[0] / METRICS_FILE).is_file()
    )
