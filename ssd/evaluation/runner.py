"""The evaluation runner: one run = one decoding setting over one zero-shot test list.

`evaluate(cfg, run_dir)`:
  1. builds the test list (zero-shot pairs from a LibriTTS-layout corpus, `ssd.data.libritts`) and writes
     it to the run dir; loads the judges (ASR, speaker, naturalness), the target, the draft and the
     acceptance rule, the speech tokenizer and the vocoder, ONCE (and caches them for the next job of a
     sweep in the same process). Anything missing fails here, before any decoding.
  2. per batch of `eval.batch_size` test items (in test-list order): prompt = prompt text + the prompt
     audio's speech tokens; decode with the configured `decoding.mode` (speculative | ar | draft_only),
     row b drawing from its own stream seeded from (seed, utt id) (`ssd.decoding.rng.RowRandom`), so
     every record is the one batch 1 writes and settings are comparable utterance by utterance. LM-RTF
     is batch-1 latency (CUDA-synchronised, after one warm-up decode): at batch 1 the decode itself, in
     bigger batches the first `eval.latency_utts` items decoded again alone (docs/algorithms.md §4.1).
     Then per item: vocode (timed: E2E-RTF), WER (Whisper's English normaliser), SIM against the
     PROMPT audio and the MOS judge's naturalness estimates (NMOS); each record is appended to
     `utterances.jsonl` as soon as its batch is judged.
  3. `metrics.json` from all records (resumed ones included), W&B mirror, a few wavs under `audio/`.

Rerunning in the same run dir resumes: finished utterances are skipped, a half-written last line is
dropped. A run dir that holds results of a different configuration is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import soundfile as sf
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from ssd.evaluation.metrics import paired_vs_ar, summarize
from ssd.evaluation.run_dir import (
    AUDIO_DIR,
    BASELINES_DIR,
    ERROR_FILE,
    METRICS_FILE,
    NON_RESULT_KEYS,
    RESULTS_FILE,
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
    mos: Any = None  # the naturalness judge (ssd.contracts.MOSJudge), None for mos=none
    perturb: Any = None  # `perturb` node (e.g. GroupSwap): rewrites generated tokens before vocoding


def load_models(cfg: DictConfig) -> EvalModels:
    """The rule first (cheap, and its parameters are the likeliest to be wrong), then the judges, then the
    LM side and the codec; every check before decoding. Each part is its config group's `_target_`."""
    from ssd.data.prepare import load_speech_tokenizer
    from ssd.evaluation.pairing import check_pairing

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
    mos = (
        _cached("mos", cfg.mos, lambda: _instantiate(cfg.mos, "mos")) if cfg.get("mos") is not None else None
    )
    target = _cached("target", cfg.target.model, lambda: _instantiate(cfg.target.model, "target.model"))
    sampling = _instantiate(cfg.target.sampling, "target.sampling", stop_tokens=list(target.stop_tokens))
    speech_tokenizer = _cached(
        "tok", cfg.speech_tokenizer, lambda: load_speech_tokenizer(cfg.speech_tokenizer)
    )
    vocoder = _cached("vocoder", cfg.vocoder, lambda: _instantiate(cfg.vocoder, "vocoder"))
    check_pairing(cfg, speech_tokenizer, target, vocoder)
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
    perturb = _instantiate(cfg.perturb, "perturb").bind(target) if cfg.get("perturb") else None
    return EvalModels(
        target, sampling, draft, rule, speech_tokenizer, vocoder, asr, speaker, language, mos, perturb
    )


# --------------------------------------------------------------------------------------------------
# One batch of test items
# --------------------------------------------------------------------------------------------------

# A record's batch-1 timing (None for an item of a batch that was not timed alone).
LATENCY_KEYS = ("lm_time", "rtf", "time_prefill", "time_draft", "time_verify", "time_accept", "time_diagnostics",
                "e2e_rtf")  # fmt: skip
# Record fields that depend on how the item was timed; every other field is the same at any batch size.
TIMING_KEYS = (*LATENCY_KEYS, "vocoder_time", "decode_time_share")


@dataclass
class Item:
    """One test item ready to decode: its pair, its place in the test list and everything it needs."""

    index: int
    pair: Any
    wrong_text: str | None
    vprompt: Any  # the VocoderPrompt, as the vocoder prepared it
    embedding: Any  # the prompt audio's speaker embedding (SIM reference)
    seed: int


def lm_prompt(m: EvalModels, items: list[Item]) -> Any:
    """The target's prompt batch for `items`, from the prompt tokens as the vocoder prepared them (so the LM
    and the vocoder condition on the same prompt tokens)."""
    return m.target.make_prompt([it.pair.text for it in items], [it.pair.prompt_text for it in items],
                                [it.vprompt.tokens.tolist() for it in items])  # fmt: skip


def decode_items(cfg: DictConfig, m: EvalModels, items: list[Item], max_tokens: int | None = None):
    """Decode `items` as one batch (ragged prompts, per-row seeds and length limits); returns
    (result, min_len [B], max_len [B]). `max_tokens` caps the length (the warm-up's short decode)."""
    from ssd.decoding.rng import RowRandom
    from ssd.models.transformer import batch_invariant

    prompt = lm_prompt(m, items)
    min_len, max_len = (torch.as_tensor(t, dtype=torch.long).cpu() for t in m.target.length_limits(prompt))
    cap = cfg.eval.get("max_len") if max_tokens is None else max_tokens
    if cap is not None:
        max_len = max_len.clamp(max=int(cap))
        min_len = torch.minimum(min_len, max_len)
    generator = RowRandom([it.seed for it in items], m.target.device)
    with batch_invariant(batch_invariant_numerics(cfg, m)):
        return _decode_rows(cfg, m, prompt, generator, min_len, max_len)


def _decode_rows(cfg, m, prompt, generator, min_len, max_len):
    from ssd.decoding.generate import AdaptiveDraftLength, decode_ar, decode_speculative

    mode = cfg.decoding.mode
    if mode == "ar":
        result = decode_ar(
            m.target, prompt, m.sampling, max_len=max_len, min_len=min_len, generator=generator
        )
    elif mode == "draft_only":
        result = decode_ar(m.draft, prompt, m.sampling, max_len=max_len, min_len=min_len, generator=generator,
                           role="draft")  # fmt: skip
    else:
        adaptive = None
        if cfg.decoding.adaptive.enabled:
            a = cfg.decoding.adaptive
            adaptive = AdaptiveDraftLength(int(a.min_len), int(a.max_len), int(a.increase), int(a.decrease))
        result = decode_speculative(
            m.target, m.draft, prompt, m.sampling, m.rule,
            draft_len=int(cfg.decoding.draft_len), max_len=max_len, min_len=min_len,
            adaptive=adaptive, generator=generator,
        )  # fmt: skip
    return result, min_len.tolist(), max_len.tolist()


def batch_invariant_numerics(cfg: DictConfig, m: EvalModels) -> bool:
    """eval.batch_invariant, where null means: on for an eager CPU target (where the per-sequence products
    cost little and make batch B equal batch 1 bit for bit), off on CUDA (where they would cost the batching)
    and on the compiled static path (whose attention is masked over the whole cache)."""
    wanted, compiled = cfg.eval.get("batch_invariant"), bool(cfg.decoding.get("compile", False))
    if wanted is None:
        return m.target.device.type == "cpu" and not compiled
    return bool(wanted)


def _timed_decode(cfg: DictConfig, m: EvalModels, items: list[Item]):
    """`decode_items` under inference mode, wall-clock timed (CUDA-synchronised); returns (result, limits, seconds)."""
    device = m.target.device
    with torch.inference_mode():
        _sync(device)
        start = time.perf_counter()
        try:
            result, min_len, max_len = decode_items(cfg, m, items)
        except FloatingPointError as err:
            raise FloatingPointError(f"utterance(s) {[it.pair.utt for it in items]}: {err}") from err
        _sync(device)
        # The engine's diagnostics (β_t overlaps, TV) are bookkeeping a deployment does not run.
        return result, (min_len, max_len), time.perf_counter() - start - result.stats.time_diagnostics


def prepare_item(
    cfg: DictConfig, m: EvalModels, index: int, pair: Any, wrong_text: str | None, prompt_cache: dict
) -> Item:
    from ssd.audio.features import load_audio
    from ssd.contracts import VocoderPrompt

    stat = Path(pair.prompt_wav).stat() if Path(pair.prompt_wav).is_file() else None
    key = (str(pair.prompt_wav), stat and (stat.st_mtime_ns, stat.st_size))
    if key not in prompt_cache:
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
        prompt_cache[key] = (prepare(vprompt) if prepare else vprompt, embedding)
    vprompt, embedding = prompt_cache[key]
    return Item(index, pair, wrong_text, vprompt, embedding, utterance_seed(int(cfg.seed), pair.utt))


def _judge(cfg: DictConfig, m: EvalModels, item: Item, tokens: list[int], finish_reason: str, row: dict,
           limits: tuple[int, int]) -> tuple[dict, np.ndarray]:  # fmt: skip
    """Vocode (timed) and judge one decoded item; returns (record without the LM timing, waveform)."""
    from ssd.audio.speaker import similarity
    from ssd.evaluation.wer import utterance_wer

    pair = item.pair
    token_rate = getattr(m.speech_tokenizer, "token_rate", 25)
    # The PCG stress test (perturb): the vocoder hears other tokens than the LM generated.
    vocoded = m.perturb(tokens, item.seed) if m.perturb is not None else tokens
    codes = m.target.codec_tokens(vocoded)
    start = time.perf_counter()
    wav = (
        m.vocoder.vocode(np.asarray(codes, dtype=np.int64), item.vprompt)
        if codes
        else np.zeros(0, np.float32)
    )
    _sync(m.target.device)
    vocoder_time = time.perf_counter() - start
    hypothesis = m.asr.transcribe(wav, m.vocoder.sample_rate) if wav.size else ""
    scored = utterance_wer(pair.text, hypothesis)
    try:
        sim = similarity(m.speaker.embed(wav, m.vocoder.sample_rate), item.embedding)
    except ValueError as err:  # too short or silent to embed: recorded as missing, counted in metrics
        log.warning("%s: no SIM (%s)", pair.utt, err)
        sim = None
    accepted_per_round = list(row["accepted_per_round"])
    record = {
        "utt": pair.utt, "speaker": pair.speaker, "prompt_utt": pair.prompt_utt, "text": pair.text,
        "seed": item.seed, "tokens": tokens, "n_tokens": len(tokens), "finish_reason": finish_reason,
        "min_len": int(limits[0]), "max_len": int(limits[1]), "audio_sec": len(tokens) / token_rate,
        "vocoder_time": vocoder_time,
        "target_calls": row["target_calls"], "draft_calls": row["draft_calls"], "rounds": row["rounds"],
        "accepted_total": sum(accepted_per_round),
        "proposed": row["proposed"], "accepted": row["accepted"],
        "overlap_sum": row["overlap_sum"], "tv_sum": row["tv_sum"],
        "accepted_per_round": accepted_per_round, "draft_len_per_round": list(row["draft_len_per_round"]),
        "hypothesis": hypothesis, "errors": scored.errors, "ref_words": scored.ref_words, "wer": scored.wer,
        "sim": sim,
        # TV(output law, q) is known when the rule preserves q (0) or the engine computed it; else tv_sum is None.
        "tv_known": row["tv_sum"] is not None,
    }  # fmt: skip
    if m.mos is not None:
        record.update(mos_fields(m.mos, wav, m.vocoder.sample_rate, pair.utt))
    if m.perturb is not None:
        record.update(vocoded_tokens=vocoded, swapped=sum(a != b for a, b in zip(tokens, vocoded)))
    if row.get("beta_audit") is not None:  # the engine's β audit (per accepted draft token)
        record["beta_audit"] = row["beta_audit"]
    if m.language is not None:
        if item.wrong_text is not None:
            wrong = utterance_wer(item.wrong_text, hypothesis)
            record.update(
                wrong_text=item.wrong_text, wrong_errors=wrong.errors, wrong_ref_words=wrong.ref_words
            )
        record["slot_correct"] = m.language.slot_correct(pair.text, hypothesis)
    return record, wav


def mos_fields(judge: Any, wav: np.ndarray, sr: int, utt: str) -> dict:
    """A record's naturalness fields: `nmos` (the judge's primary estimate) and `mos_<key>` for each of
    its `keys`; all None when the audio cannot be judged (too short, silent: counted in metrics as missing)."""
    try:
        scores = judge.score(wav, sr)
    except ValueError as err:
        log.warning("%s: no MOS (%s)", utt, err)
        scores = {}
    return {"nmos": scores.get(judge.primary), **{f"mos_{k}": scores.get(k) for k in judge.keys}}


def _latency(record: dict, result, seconds: float) -> dict:
    """The batch-1 timing of one item: LM time, RTF, the engine's phase times, LM + vocoder (end to end)."""
    stats, audio = result.stats, record["audio_sec"]
    return {
        "lm_time": seconds, "rtf": seconds / audio if audio else None,
        "time_prefill": stats.time_prefill, "time_draft": stats.time_draft,
        "time_verify": stats.time_verify, "time_accept": stats.time_accept,
        "time_diagnostics": stats.time_diagnostics,
        "e2e_rtf": (seconds + record["vocoder_time"]) / audio if audio else None,
    }  # fmt: skip


def evaluate_batch(cfg: DictConfig, m: EvalModels, items: list[Item], latency_utts: float):
    """Decode `items` at once, then vocode and judge each; returns [(record, waveform)] in item order.

    LM-RTF stays batch-1 latency, measured on the items among the first `latency_utts` of the test list: a
    batch of one is its own timing; in a bigger batch they are decoded again alone (timed), and their
    tokens must equal the batched ones. Every record holds `decode_time_share` (the batched decode's time / its rows: the
    throughput numbers)."""
    result, (min_lens, max_lens), seconds = _timed_decode(cfg, m, items)
    out = []
    for b, item in enumerate(items):
        tokens = result.tokens[b]
        record, wav = _judge(cfg, m, item, tokens, result.finish_reason[b], result.rows[b],
                             (min_lens[b], max_lens[b]))  # fmt: skip
        record.update(dict.fromkeys(LATENCY_KEYS), decode_time_share=seconds / len(items))
        if item.index < latency_utts and len(items) == 1:
            record.update(_latency(record, result, seconds))
        elif item.index < latency_utts:
            alone, _, alone_seconds = _timed_decode(cfg, m, [item])
            if alone.tokens[0] != tokens:
                fix = ("eval.batch_invariant=true (per-sequence numerics) or " if not batch_invariant_numerics(cfg, m)
                       else "")  # fmt: skip
                raise RuntimeError(
                    f"utterance {item.pair.utt}: decoded alone it gives other tokens than in a batch of "
                    f"{len(items)} ({len(alone.tokens[0])} vs {len(tokens)} tokens): the engine is not "
                    f"batch-invariant here; run with {fix}eval.batch_size=1"
                )
            record.update(_latency(record, alone, alone_seconds))
        out.append((record, wav))
    return out


def _warm_up(cfg: DictConfig, m: EvalModels, item: Item) -> None:
    """One short untimed decode so lazy initialisation and caches do not land in the first timing."""
    with torch.inference_mode():
        decode_items(cfg, m, [replace(item, seed=0)], max_tokens=WARMUP_TOKENS)


def effective_batch_size(cfg: DictConfig) -> tuple[int, str | None]:
    """(batch size the run decodes with, why it differs from eval.batch_size or None). Adaptive draft
    length shares one k across the batch, so a row's rounds would depend on its neighbours: batch 1."""
    wanted = int(cfg.eval.get("batch_size", 1))
    if wanted > 1 and cfg.decoding.mode == "speculative" and cfg.decoding.adaptive.enabled:
        return (
            1,
            "decoding.adaptive.enabled: the draft length is shared by a batch, so adaptive runs decode at batch 1",
        )
    return wanted, None


def compile_decoding(cfg: DictConfig, m: EvalModels) -> None:
    """decoding.compile=true: compile the decoding steps of the target (and the draft) before any timing."""
    if not cfg.decoding.get("compile", False):
        return
    for role, model, key in (("target", m.target, "target.model"), ("draft", m.draft, "draft")):
        if model is None:
            continue
        method = getattr(model, "compile_decoding", None)
        if method is None:
            raise ValueError(
                f"decoding.compile=true but the {role} ({key}._target_={OmegaConf.select(cfg, key + '._target_')}) "
                "has no compile_decoding(): set decoding.compile=false, or give the class that method"
            )
        method()


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
        compile_decoding(cfg, models)
        wrong_texts = wrong_sentence_texts(pairs["text"].tolist())
        todo = [(i, p) for i, p in enumerate(pairs.itertuples(index=False)) if p.utt not in done]
        logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # one INFO line per utterance otherwise
        log.info("%s: %d utterances, %d already done, %d to go", run_dir, len(pairs), len(done), len(todo))
        batch_size, batch_note = effective_batch_size(cfg)
        if batch_note:
            log.warning("eval.batch_size=%s: %s", cfg.eval.batch_size, batch_note)
        n_audio = int(cfg.eval.get("num_audio_samples", 4))
        # Prepared prompts (speech tokens, speaker embedding, vocoder conditioning) are shared by the jobs of
        # a sweep that use the same tokenizer, speaker model and vocoder: keyed by the prompt file.
        prompt_cache = _cached(
            "prompts", {"tok": cfg.speech_tokenizer, "sim": cfg.sim, "vocoder": cfg.vocoder}, dict
        )
        items = [prepare_item(cfg, models, i, p, wrong_texts[i], prompt_cache) for i, p in todo]
        with single_threaded_blas():
            if items and cfg.eval.get("warmup", True):
                _warm_up(cfg, models, items[0])
            _run_loop(cfg, models, items, batch_size, records, run.results, run_dir / AUDIO_DIR, n_audio)

        metrics = summarize(records, int(cfg.eval.get("bootstrap_resamples", 1000)), int(cfg.seed))
        metrics.update(run_labels(cfg, models), batch_size=batch_size, batch_note=batch_note)
        metrics.update(group_metrics(models, records))
        if baseline:
            metrics.update(speedup_vs(metrics, records, Path(str(baseline)), cfg))
        run.write_metrics(metrics)
    log_to_wandb(cfg, run_dir, metrics, records, run_dir / AUDIO_DIR, n_audio)
    return metrics


def single_threaded_blas():
    """A context in which numpy's and scipy's BLAS run on one thread (torch's threads are untouched). An
    OpenBLAS worker busy-waits after each call (librosa's mel filterbank in DNSMOS, resemblyzer's), so it
    took a core from the decode timed next: 1.3x slower on 2 cores (`python scripts/bench_judge_isolation.py`).
    It limits the BLAS libraries loaded when it is entered: after the judges are loaded, and after scipy's
    own OpenBLAS, which librosa loads only at its first mel spectrogram (inside the first job otherwise)."""
    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS)
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    torch_dir = str(Path(torch.__file__).parent)
    blas = [lib.filepath for lib in controller.lib_controllers
            if lib.user_api == "blas" and not lib.filepath.startswith(torch_dir)]  # fmt: skip
    return controller.select(filepath=blas).limit(limits=1)


def _run_loop(cfg, models, items, batch_size, records, results_path, audio_dir, n_audio) -> None:
    """Batches of `batch_size` items in test-list order; each record is appended as soon as its batch is
    judged, so an interrupted run resumes at utterance granularity."""
    from tqdm.auto import tqdm

    latency = cfg.eval.get("latency_utts")
    latency_utts = math.inf if batch_size == 1 or latency is None else int(latency)  # items timed alone
    bar = tqdm(total=len(items), desc=f"eval {cfg.decoding.mode}", unit="utt",
               disable=not cfg.get("progress", True))  # fmt: skip
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        for item, (record, wav) in zip(batch, evaluate_batch(cfg, models, batch, latency_utts)):
            if item.index < n_audio and wav.size:
                audio_dir.mkdir(exist_ok=True)
                sf.write(audio_dir / f"{item.pair.utt}.wav", wav, models.vocoder.sample_rate)
            append_record(results_path, record)
            records.append(record)
        bar.update(len(batch))
        timed = [r for r in records if r.get("lm_time") is not None]
        lm_time, audio = sum(r["lm_time"] for r in timed), sum(r["audio_sec"] for r in timed)
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
    if models.perturb is not None:  # the stress test's groups name its runs
        labels.update(models.perturb.labels())
        setting += list(models.perturb.labels())
    return {**labels, "setting_keys": setting}


def group_metrics(models: EvalModels, records: list[dict]) -> dict:
    """PCG's groups (the rule's, or the stress test's): mean / median size, singleton fraction, resolved θ;
    and for the stress test the fraction of generated tokens the vocoder heard swapped."""
    out = {}
    groups = models.rule if hasattr(models.rule, "group_stats") else None
    if models.perturb is not None:
        groups = models.perturb.groups
        n_tokens = sum(r["n_tokens"] for r in records)
        out["swap_fraction"] = sum(r["swapped"] for r in records) / n_tokens if n_tokens else None
    if groups is not None:
        out.update(groups.group_stats())
    return out


def speedup_vs(metrics: dict, records: list[dict], baseline_dir: Path, cfg: DictConfig) -> dict:
    """Speedup = baseline LM-RTF / this run's LM-RTF (baseline: a finished run dir, usually decoding=ar),
    and the paired differences in WER and SIM on the utterances both runs share."""
    baseline = json.loads(
        (baseline_dir / METRICS_FILE).read_text()
    )  # its presence is checked before decoding
    out = {"baseline_dir": str(baseline_dir), "speedup": baseline["lm_rtf"] / metrics["lm_rtf"]}
    if cfg.decoding.mode != "ar" or cfg.get("perturb"):
        ar_records = read_records(baseline_dir / RESULTS_FILE, repair=False)
        out.update(
            paired_vs_ar(ar_records, records, int(cfg.eval.get("bootstrap_resamples", 1000)), int(cfg.seed))
        )
    return out


# --------------------------------------------------------------------------------------------------
# The AR baseline a sweep shares
# --------------------------------------------------------------------------------------------------

# Keys that cannot change what decoding=ar computes (besides the run-dir bookkeeping of NON_RESULT_KEYS).
_NOT_AR_KEYS = ("draft", "acceptance", "beta", "theta", "draft_len", "reproduce", "decoding", "perturb")


def baseline_config(cfg: DictConfig) -> DictConfig:
    """The decoding=ar run a setting is compared with: the same target and sampling, codec, judges, test
    list and seeds; every speculative-only key at its default, so every setting of a sweep names one run."""
    from ssd.evaluation.schema import SweepConfig

    defaults = OmegaConf.structured(SweepConfig)
    body = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items()
            if k not in (*_NOT_AR_KEYS, *NON_RESULT_KEYS)}  # fmt: skip
    body.update(
        decoding={"mode": "ar", "compile": bool(cfg.decoding.get("compile", False))},
        draft=None, acceptance=None, beta=defaults.beta, theta=defaults.theta, draft_len=defaults.draft_len,
        logger={}, progress=bool(cfg.get("progress", True)),
    )  # fmt: skip
    return OmegaConf.merge(defaults, body)


def baseline_key(cfg: DictConfig) -> str:
    """A dir name for the AR baseline of `cfg`: target, eval and a hash of everything that decides its
    output (its resolved config and the fingerprints of the model files it reads)."""
    ar = baseline_config(cfg)
    resolved = {k: v for k, v in OmegaConf.to_container(ar, resolve=True).items()
                if k not in ("output_dir", *NON_RESULT_KEYS)}  # fmt: skip
    text = json.dumps({"config": resolved, "inputs": run_inputs(ar)}, sort_keys=True, default=str)
    return f"ar-{cfg.target.name}-{cfg.eval.name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def ensure_baseline(cfg: DictConfig, root: Path) -> Path:
    """The finished AR baseline of `cfg` under `root` (run now, or reused): concurrent jobs of a sweep wait
    for the one that runs it (a lock on `root`) and then reuse its results."""
    from ssd.files import RunDirLock

    run_dir = root / baseline_key(cfg)
    if not (run_dir / METRICS_FILE).is_file():
        with RunDirLock(root, "AR baseline", wait=True):
            if not (run_dir / METRICS_FILE).is_file():
                log.info("AR baseline for the speedup column: %s", run_dir)
                evaluate(baseline_config(cfg), run_dir)
    return run_dir


# --------------------------------------------------------------------------------------------------
# The sweep's task function
# --------------------------------------------------------------------------------------------------


def run_job(cfg: DictConfig) -> dict | None:
    """`evaluate` for a Hydra job. In a multirun a job without decoding=ar (and no baseline_dir) first runs,
    or reuses, its AR baseline in `<sweep dir>/baselines/` (`ensure_baseline`; auto_baseline=false: not),
    so its metrics and the sweep's table carry the speedup and the paired WER difference. A failure is written to `error.json` in the job's dir and
    logged, and the sweep goes on (Hydra would otherwise stop at the first exception); a single run raises."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = hydra_run_dir()
    multirun = str(HydraConfig.get().mode) == "RunMode.MULTIRUN"
    try:
        if (
            multirun
            and (cfg.decoding.mode != "ar" or cfg.get("perturb"))  # a perturbed AR run is compared with AR
            and not cfg.get("baseline_dir")
            and cfg.get("auto_baseline")
        ):
            validate_sweep_config(cfg)  # a bad setting fails before its baseline is computed
            baseline = ensure_baseline(cfg, Path(HydraConfig.get().sweep.dir) / BASELINES_DIR)
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.baseline_dir = str(baseline)
        return evaluate(cfg, run_dir)
    except Exception as err:
        if not multirun:
            raise
        write_error(run_dir, f"{type(err).__name__}: {err}", traceback.format_exc())
        log.error("job %s FAILED (%s: %s); see %s. The sweep continues with the other jobs.",
                  run_dir, type(err).__name__, err, run_dir / ERROR_FILE)  # fmt: skip
        return None
