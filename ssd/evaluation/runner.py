"""The evaluation runner: one run = one decoding setting over one zero-shot test list.

`evaluate(cfg, run_dir)`:
  1. builds the test list (zero-shot pairs from a LibriTTS-layout corpus, `ssd.data.libritts`) and writes
     it to the run dir; loads the judges (ASR, speaker), the target, the draft and the acceptance rule,
     the speech tokenizer and the vocoder, ONCE (and caches them for the next job of a sweep in the same
     process). Anything missing fails here, before any decoding.
  2. per utterance: prompt = prompt text + the prompt audio's speech tokens; decode with the configured
     `decoding.mode` (speculative | ar | draft_only) using a generator seeded from (seed, utt id), so
     settings are comparable utterance by utterance; the LM stage alone is timed (CUDA-synchronised,
     after one warm-up decode); vocode; WER (Whisper's English normaliser) and SIM against the PROMPT
     audio; the record is appended to `utterances.jsonl` as soon as it is complete.
  3. `metrics.json` from all records (resumed ones included), W&B mirror, a few wavs under `audio/`.

Rerunning in the same run dir resumes: finished utterances are skipped, a half-written last line is
dropped. A run dir that holds results of a different configuration is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import soundfile as sf
import torch
from omegaconf import DictConfig, open_dict

from ssd.evaluation.metrics import summarize
from ssd.evaluation.run_dir import (
    AUDIO_DIR,
    ERROR_FILE,
    METRICS_FILE,
    RunDir,
    append_record,
    read_records,
    run_inputs,
    write_error,
)
from ssd.evaluation.schema import plain, register_sweep_schema, validate_sweep_config
from ssd.evaluation.wandb_mirror import log_to_wandb

log = logging.getLogger(__name__)

WARMUP_TOKENS = 16

_LOADED: dict[str, tuple[str, Any]] = {}  # kind -> (config key, model): a sweep's jobs share models

# sweep.yaml's schema and resolver, in every process that runs a job (sweep.py imports this module;
# joblib/submitit workers import it to unpickle the task).
register_sweep_schema()

# --------------------------------------------------------------------------------------------------
# Small pieces
# --------------------------------------------------------------------------------------------------


def utterance_seed(seed: int, utt: str) -> int:
    """The per-utterance RNG seed: a hash of (seed, utt id), so every setting draws the same stream."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{utt}".encode()).digest()[:8], "little") & (2**63 - 1)


def _cached(kind: str, key_cfg: Any, build: Callable[[], Any]) -> Any:
    """The model of this kind loaded by an earlier job with the same config, else a fresh one (which
    replaces the old, so a sweep over models holds one of each kind in memory)."""
    key = json.dumps(plain(key_cfg), sort_keys=True, default=str)
    if kind not in _LOADED or _LOADED[kind][0] != key:
        _LOADED.pop(kind, None)
        _LOADED[kind] = (key, build())
    return _LOADED[kind][1]


def _instantiate(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """hydra's instantiate; a missing or unusable file (FileNotFoundError, ValueError from the loader) is
    re-raised as its own type, prefixed with the config key, so callers and users see what to fix."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if type(cause) in (FileNotFoundError, ValueError, FloatingPointError):
            raise type(cause)(f"{key}: {cause}") from err
        raise


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# Test list
# --------------------------------------------------------------------------------------------------


def build_test_list(eval_cfg: DictConfig) -> pd.DataFrame:
    """Zero-shot pairs by the rule documented in `ssd.data.libritts` (settings from the eval config)."""
    from ssd.data.libritts import make_zero_shot_pairs, scan_libritts

    root = Path(str(eval_cfg.corpus_root))
    if not root.is_dir():
        raise FileNotFoundError(
            f"eval.corpus_root={root} does not exist: point it at a LibriTTS-layout corpus "
            "(the toy world builds one: python scripts/build_toy_world.py)"
        )
    manifest = scan_libritts(root, list(eval_cfg.subsets)).manifest
    return make_zero_shot_pairs(
        manifest,
        n_utts=int(eval_cfg.n_utts),
        n_speakers=int(eval_cfg.n_speakers),
        prompt_sec=tuple(eval_cfg.prompt_sec),
        target_sec=tuple(eval_cfg.target_sec),
        seed=int(eval_cfg.pair_seed),
    )


def wrong_sentence_texts(texts: list[str]) -> list[str]:
    """For item i, the next item's text that differs from text i (cyclic): the 'ignores its text' reference."""
    out = []
    for i, text in enumerate(texts):
        other = next((texts[(i + j) % len(texts)] for j in range(1, len(texts)) if texts[(i + j) % len(texts)] != text),
                     None)  # fmt: skip
        out.append(other)
    return out


# --------------------------------------------------------------------------------------------------
# Everything a run loads once
# --------------------------------------------------------------------------------------------------


@dataclass
class EvalModels:
    target: Any
    sampling: Any
    draft: Any
    rule: Any
    speech_tokenizer: Any
    vocoder: Any
    asr: Any
    speaker: Any
    language: Any  # GridLanguage for the toy world, else None


def load_models(cfg: DictConfig) -> EvalModels:
    """The rule first (cheap, and its parameters are the likeliest to be wrong), then the judges, then the
    LM side and the codec; every check before decoding. Each part is its config group's `_target_`."""
    from ssd.data.prepare import load_speech_tokenizer

    mode = cfg.decoding.mode
    rule = _instantiate(cfg.acceptance, "acceptance") if mode == "speculative" else None
    language = None
    if cfg.eval.get("language") == "grid":
        from ssd.data.grid_language import GridLanguage

        slots_file = Path(str(cfg.eval.corpus_root)) / "language.json"  # the toy world records its language
        slots = cfg.eval.get("slots")
        if slots is None and slots_file.is_file():
            slots = json.loads(slots_file.read_text())
        language = GridLanguage(plain(slots))
    elif cfg.eval.get("language") is not None:
        raise ValueError(f"eval.language must be null or 'grid', got {cfg.eval.language!r}")
    slots = list(language.slots.values()) if language else None
    asr = _cached(
        "asr", {"asr": cfg.asr, "slots": slots}, lambda: _instantiate(cfg.asr, "asr", closed_vocabulary=slots)
    )
    speaker = _cached("sim", cfg.sim, lambda: _instantiate(cfg.sim, "sim"))
    target = _cached("target", cfg.target.model, lambda: _instantiate(cfg.target.model, "target.model"))
    sampling = _instantiate(cfg.target.sampling, "target.sampling", stop_tokens=list(target.stop_tokens))
    speech_tokenizer = _cached(
        "tok", cfg.speech_tokenizer, lambda: load_speech_tokenizer(cfg.speech_tokenizer)
    )
    vocoder = _cached("vocoder", cfg.vocoder, lambda: _instantiate(cfg.vocoder, "vocoder"))
    codebook = getattr(speech_tokenizer, "codebook_size", None)
    if codebook is not None and codebook != target.speech_token_size:
        raise ValueError(
            f"speech tokenizer at speech_tokenizer.path={cfg.speech_tokenizer.path} has {codebook} tokens but the "
            f"target ({cfg.target.name}) has speech_token_size={target.speech_token_size}: they must be one vocabulary"
        )
    draft = None
    if mode in ("speculative", "draft_only"):
        draft = _cached("draft", {"target": cfg.target.model, "draft": cfg.draft},
                        lambda: _instantiate(cfg.draft, "draft", target=target))  # fmt: skip
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"the draft ({cfg.draft.get('name')}) has {draft.vocab_size} head entries but the target "
                f"({cfg.target.name}) has {target.vocab_size}: build the draft from this target's layers"
            )
    if rule is not None:
        rule = rule.bind(target)
    return EvalModels(target, sampling, draft, rule, speech_tokenizer, vocoder, asr, speaker, language)


# --------------------------------------------------------------------------------------------------
# One utterance
# --------------------------------------------------------------------------------------------------


def _decode(cfg: DictConfig, m: EvalModels, prompt, min_len, max_len, generator):
    from ssd.decoding.generate import AdaptiveDraftLength, decode_ar, decode_speculative

    mode = cfg.decoding.mode
    if mode == "ar":
        return decode_ar(m.target, prompt, m.sampling, max_len=max_len, min_len=min_len, generator=generator)
    if mode == "draft_only":
        return decode_ar(m.draft, prompt, m.sampling, max_len=max_len, min_len=min_len, generator=generator,
                         role="draft")  # fmt: skip
    adaptive = None
    if cfg.decoding.adaptive.enabled:
        a = cfg.decoding.adaptive
        adaptive = AdaptiveDraftLength(int(a.min_len), int(a.max_len), int(a.increase), int(a.decrease))
    return decode_speculative(
        m.target, m.draft, prompt, m.sampling, m.rule,
        draft_len=int(cfg.decoding.draft_len), max_len=max_len, min_len=min_len,
        adaptive=adaptive, generator=generator,
    )  # fmt: skip


def _prompt_for(cfg: DictConfig, m: EvalModels, pair: Any, prompt_cache: dict) -> tuple[Any, Any, Any, Any]:
    from ssd.audio.features import load_audio
    from ssd.contracts import VocoderPrompt

    if pair.prompt_utt not in prompt_cache:
        try:
            wav, sr = load_audio(pair.prompt_wav, None)
            if not np.abs(wav).max() > 0:
                raise ValueError("it is silent (every sample is 0)")
            tokens = np.asarray(m.speech_tokenizer.encode(wav, sr), dtype=np.int64)
            embedding = m.speaker.embed(wav, sr)
        except ValueError as err:
            raise ValueError(
                f"prompt audio {pair.prompt_wav} (utterance {pair.prompt_utt}) cannot be used: {err}. Replace or "
                "remove the file in eval.corpus_root; nothing of this run is lost, a rerun resumes"
            ) from err
        vprompt = VocoderPrompt(wav, sr, pair.prompt_text, tokens)
        prepare = getattr(m.vocoder, "prepare_prompt", None)  # optional in ssd.contracts.Vocoder
        prompt_cache[pair.prompt_utt] = (prepare(vprompt) if prepare else vprompt, embedding)
    vprompt, embedding = prompt_cache[pair.prompt_utt]
    prompt = m.target.make_prompt([pair.text], [pair.prompt_text], [vprompt.tokens.tolist()])
    min_len, max_len = (int(x) for x in (t[0] for t in m.target.length_limits(prompt)))
    if cfg.eval.get("max_len") is not None:
        max_len = min(max_len, int(cfg.eval.max_len))
        min_len = min(min_len, max_len)
    return prompt, (min_len, max_len), vprompt, embedding


def evaluate_utterance(cfg: DictConfig, m: EvalModels, pair: Any, wrong_text: str | None, prompt_cache: dict):
    """Decode, time, vocode and judge one test item; returns (record, generated waveform)."""
    from ssd.audio.speaker import similarity
    from ssd.evaluation.wer import utterance_wer

    prompt, (min_len, max_len), vprompt, prompt_embedding = _prompt_for(cfg, m, pair, prompt_cache)
    seed = utterance_seed(int(cfg.seed), pair.utt)
    generator = torch.Generator(device=m.target.device).manual_seed(seed)
    device = m.target.device
    with torch.inference_mode():
        _sync(device)
        start = time.perf_counter()
        try:
            result = _decode(cfg, m, prompt, min_len, max_len, generator)
        except FloatingPointError as err:
            raise FloatingPointError(f"utterance {pair.utt}: {err}") from err
        _sync(device)
        lm_time = time.perf_counter() - start
    tokens = result.tokens[0]
    stats = result.stats
    token_rate = getattr(m.speech_tokenizer, "token_rate", 25)
    codes = m.target.codec_tokens(tokens)
    wav = m.vocoder.vocode(np.asarray(codes, dtype=np.int64), vprompt) if codes else np.zeros(0, np.float32)
    hypothesis = m.asr.transcribe(wav, m.vocoder.sample_rate) if wav.size else ""
    scored = utterance_wer(pair.text, hypothesis)
    try:
        sim = similarity(m.speaker.embed(wav, m.vocoder.sample_rate), prompt_embedding)
    except ValueError as err:  # too short or silent to embed: recorded as missing, counted in metrics
        log.warning("%s: no SIM (%s)", pair.utt, err)
        sim = None
    record = {
        "utt": pair.utt, "speaker": pair.speaker, "prompt_utt": pair.prompt_utt, "text": pair.text,
        "seed": seed, "tokens": tokens, "n_tokens": len(tokens), "finish_reason": result.finish_reason[0],
        "min_len": min_len, "max_len": max_len,
        "lm_time": lm_time, "audio_sec": len(tokens) / token_rate,
        "rtf": lm_time / (len(tokens) / token_rate) if tokens else None,
        "time_prefill": stats.time_prefill, "time_draft": stats.time_draft,
        "time_verify": stats.time_verify, "time_accept": stats.time_accept,
        "target_calls": stats.target_calls, "draft_calls": stats.draft_calls, "rounds": stats.rounds,
        "accepted_total": sum(n for r in stats.accepted_per_round for n in r),
        "proposed": stats.proposed, "accepted": stats.accepted,
        "overlap_sum": stats.overlap_sum, "tv_sum": stats.tv_sum,
        "accepted_per_round": [r[0] if r else 0 for r in stats.accepted_per_round],
        "draft_len_per_round": stats.draft_len_per_round,
        "hypothesis": hypothesis, "errors": scored.errors, "ref_words": scored.ref_words, "wer": scored.wer,
        "sim": sim,
        # TV(output law, q) is known when the rule preserves q (0) or the engine computed it; else tv_sum is None.
        "tv_known": stats.tv_sum is not None,
    }  # fmt: skip
    if m.language is not None:
        if wrong_text is not None:
            wrong = utterance_wer(wrong_text, hypothesis)
            record.update(wrong_text=wrong_text, wrong_errors=wrong.errors, wrong_ref_words=wrong.ref_words)
        record["slot_correct"] = m.language.slot_correct(pair.text, hypothesis)
    return record, wav


def _warm_up(cfg: DictConfig, m: EvalModels, pair: Any, prompt_cache: dict) -> None:
    """One short untimed decode so lazy initialisation and caches do not land in the first timing."""
    prompt, (min_len, _), _, _ = _prompt_for(cfg, m, pair, prompt_cache)
    generator = torch.Generator(device=m.target.device).manual_seed(0)
    with torch.inference_mode():
        _decode(cfg, m, prompt, min(min_len, WARMUP_TOKENS), WARMUP_TOKENS, generator)


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ValueError("evaluate: pass run_dir= when not running under Hydra")
    return Path(HydraConfig.get().runtime.output_dir)


def evaluate(cfg: DictConfig, run_dir: str | Path | None = None) -> dict:
    """Run (or resume) one evaluation into `run_dir` (default: Hydra's output dir); returns the metrics."""
    run_dir = Path(run_dir) if run_dir is not None else hydra_run_dir()
    cfg = cfg.copy()  # the caller's config stays as given; `output_dir` (logger configs use it) = run_dir
    with open_dict(cfg):
        cfg.output_dir = str(run_dir)
    validate_sweep_config(cfg)
    baseline = cfg.get("baseline_dir")
    if baseline and not (Path(str(baseline)) / METRICS_FILE).is_file():  # now, not after hours of decoding
        raise FileNotFoundError(f"baseline_dir={baseline} has no {METRICS_FILE}: run the baseline first")
    if cfg.eval.get("num_threads"):
        torch.set_num_threads(int(cfg.eval.num_threads))
    with RunDir(run_dir) as run:
        inputs = run_inputs(cfg)  # fingerprints of the model files, read once
        run.check_config(cfg, inputs)
        pairs = build_test_list(cfg.eval)
        models = load_models(cfg)  # fails here, before any decoding, when a path is wrong
        run.check_test_list(pairs)
        run.write_config(cfg, inputs)

        records = read_records(run.results)
        done = {r["utt"] for r in records}
        unknown = done - set(pairs["utt"])
        if unknown:
            raise ValueError(
                f"{run.results} holds utterances that are not in the test list: {sorted(unknown)[:5]}"
            )
        wrong_texts = wrong_sentence_texts(pairs["text"].tolist())
        todo = [(i, p) for i, p in enumerate(pairs.itertuples(index=False)) if p.utt not in done]
        logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # one INFO line per utterance otherwise
        log.info("%s: %d utterances, %d already done, %d to go", run_dir, len(pairs), len(done), len(todo))
        n_audio = int(cfg.eval.get("num_audio_samples", 4))
        audio_dir = run_dir / AUDIO_DIR
        prompt_cache: dict = {}
        if todo and cfg.eval.get("warmup", True):
            _warm_up(cfg, models, todo[0][1], prompt_cache)
        _run_loop(cfg, models, todo, wrong_texts, prompt_cache, records, run.results, audio_dir, n_audio)

        metrics = summarize(records, int(cfg.eval.get("bootstrap_resamples", 1000)), int(cfg.seed))
        metrics.update(run_labels(cfg, models))
        if baseline:
            metrics.update(speedup_vs(metrics, Path(str(baseline))))
        run.write_metrics(metrics)
    log_to_wandb(cfg, run_dir, metrics, records, audio_dir, n_audio)
    return metrics


def _run_loop(
    cfg, models, todo, wrong_texts, prompt_cache, records, results_path, audio_dir, n_audio
) -> None:
    from tqdm.auto import tqdm

    bar = tqdm(todo, desc=f"eval {cfg.decoding.mode}", unit="utt", disable=not cfg.get("progress", True))
    for index, pair in bar:
        record, wav = evaluate_utterance(cfg, models, pair, wrong_texts[index], prompt_cache)
        if index < n_audio and wav.size:
            audio_dir.mkdir(exist_ok=True)
            sf.write(audio_dir / f"{pair.utt}.wav", wav, models.vocoder.sample_rate)
        append_record(results_path, record)
        records.append(record)
        lm_time, audio = sum(r["lm_time"] for r in records), sum(r["audio_sec"] for r in records)
        proposed = sum(sum(r["proposed"]) for r in records)
        postfix = {"RTF": f"{lm_time / audio:.3f}" if audio else "-"}
        if proposed:
            postfix["alpha"] = f"{sum(sum(r['accepted']) for r in records) / proposed:.3f}"
        bar.set_postfix(postfix)
    bar.close()


def run_labels(cfg: DictConfig, models: EvalModels) -> dict:
    """The setting of a run, as the tables show it: `setting_keys` names the keys that identify the
    decoding setting (the rule declares its own parameters: `AcceptanceRule.labels()`)."""
    mode = cfg.decoding.mode
    labels = {
        "decoding": mode,
        "target": cfg.target.name,
        "eval": cfg.eval.name,
        "split": cfg.eval.get("split"),
    }
    setting = ["decoding"]
    if mode != "ar":
        labels["draft"] = cfg.draft.get("name")
    if mode == "speculative":
        rule = models.rule
        rule_labels = {k: float(v) if isinstance(v, int | float) else v for k, v in rule.labels().items()}
        labels.update(acceptance=getattr(rule, "name", type(rule).__name__), **rule_labels,
                      draft_len=int(cfg.decoding.draft_len), adaptive=bool(cfg.decoding.adaptive.enabled))  # fmt: skip
        setting += ["acceptance", *rule_labels, "draft_len", "adaptive"]
    return {**labels, "setting_keys": setting}


def speedup_vs(metrics: dict, baseline_dir: Path) -> dict:
    """Speedup = baseline LM-RTF / this run's LM-RTF (baseline: a finished run dir, usually decoding=ar)."""
    baseline = json.loads(
        (baseline_dir / METRICS_FILE).read_text()
    )  # its presence is checked before decoding
    return {"baseline_dir": str(baseline_dir), "speedup": baseline["lm_rtf"] / metrics["lm_rtf"]}


# --------------------------------------------------------------------------------------------------
# The sweep's task function
# --------------------------------------------------------------------------------------------------


def run_job(cfg: DictConfig) -> dict | None:
    """`evaluate` for a Hydra job. In a multirun a failure is written to `error.json` in the job's dir and
    logged, and the sweep goes on (Hydra would otherwise stop at the first exception); a single run raises."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = hydra_run_dir()
    try:
        return evaluate(cfg, run_dir)
    except Exception as err:
        if str(HydraConfig.get().mode) != "RunMode.MULTIRUN":
            raise
        write_error(run_dir, f"{type(err).__name__}: {err}", traceback.format_exc())
        log.error("job %s FAILED (%s: %s); see %s. The sweep continues with the other jobs.",
                  run_dir, type(err).__name__, err, run_dir / ERROR_FILE)  # fmt: skip
        return None
