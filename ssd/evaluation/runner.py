"""The evaluation runner: one run = one decoding setting over one zero-shot test list.

`evaluate(cfg, run_dir)`:
  1. builds the run's settings from the config (`ssd.evaluation.settings`: every check before any model
     loads), the test list (written to the run dir) and the models (`ssd.evaluation.models`: judges, target,
     codec, the decoder bound to its drafter and rule; cached for the next job of a sweep in the process).
  2. per batch of `eval.batch_size` test items (in test-list order; `ssd.evaluation.batch`): decode with the configured decoder, row b
     drawing from its own stream seeded from (seed, utt id) (`ssd.decoding.rng.RowRandom`), so every record is
     the one batch 1 writes and settings are comparable utterance by utterance. LM-RTF is batch-1 latency
     (CUDA-synchronised, after one warm-up decode) on the first `eval.timed_utts` items: at batch 1 the decode
     itself, in bigger batches the item decoded again alone. A run that has a baseline (the AR target) decodes
     each timed item by the baseline too, right before or after it in the same process: the speedup and its
     CI come from these pairs (docs/algorithms.md §4.1). With `eval.streaming` the timed decodes (the baseline's
     too) stream: each round's verified tokens go to the vocoder's chunked session as the LM emits them, and each
     chunk's ready time is recorded (`ssd.evaluation.streaming`; §4.2). Then per item: vocode (timed:
     E2E-RTF; streamed in chunks with `eval.streaming`), WER, SIM against the PROMPT audio and NMOS
     (`ssd.evaluation.judging`); each record is appended to `utterances.jsonl` as soon as its batch is judged.
  3. `metrics.json` from all records (resumed ones included), W&B mirror, a few wavs under `audio/`.

Rerunning in the same run dir resumes: finished utterances are skipped, a half-written last line is
dropped. A run dir that holds results of a different configuration is refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import soundfile as sf
import torch
from omegaconf import DictConfig, open_dict

from ssd.evaluation.batch import (
    Timing,
    batch_invariant_numerics,
    effective_batch_size,
    evaluate_batch,
    warm_up,
)
from ssd.evaluation.items import Item, build_test_list, check_texts, prepare_item, wrong_sentence_texts
from ssd.evaluation.metrics import paired_vs_ar, summarize
from ssd.evaluation.models import EvalModels, cached, load_models
from ssd.evaluation.run_dir import (
    AUDIO_DIR,
    METRICS_FILE,
    RESULTS_FILE,
    RunDir,
    append_record,
    read_records,
    run_inputs,
    with_prompt_audio,
)
from ssd.evaluation.schema import cpu_load, register_sweep_schema
from ssd.evaluation.settings import RunSettings
from ssd.evaluation.streaming import (
    check_streaming,
)
from ssd.evaluation.wandb_mirror import log_to_wandb
from ssd.files import write_atomic
from ssd.models.transformer import use_batch_invariant

log = logging.getLogger(__name__)

# sweep.yaml's schema and resolver, in every process that runs a job (sweep.py imports this module;
# joblib/submitit workers import it to unpickle the task).
register_sweep_schema()

# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ValueError("evaluate: pass run_dir= when not running under Hydra")
    return Path(HydraConfig.get().runtime.output_dir)


def evaluate(cfg: DictConfig, run_dir: str | Path | None = None, parallel_jobs: int = 1) -> dict:
    """Run (or resume) one evaluation into `run_dir` (default: Hydra's output dir); returns the metrics.
    `parallel_jobs`: the jobs a local launcher runs beside this one (their threads share the cores): with
    eval.num_threads=null each job takes its share; an oversubscribed CPU is warned about and recorded."""
    run_dir = Path(run_dir) if run_dir is not None else hydra_run_dir()
    cfg = cfg.copy()  # the caller's config stays as given; `output_dir` (logger configs use it) = run_dir
    with open_dict(cfg):
        cfg.output_dir = str(run_dir)
    settings = RunSettings.from_config(cfg)
    baseline = cfg.get("baseline_dir")
    if baseline and not (Path(str(baseline)) / METRICS_FILE).is_file():  # now, not after hours of decoding
        raise FileNotFoundError(f"baseline_dir={baseline} has no {METRICS_FILE}: run the baseline first")
    share = max(1, (os.cpu_count() or 1) // parallel_jobs)  # each parallel job's share of the cores
    threads = settings.eval.num_threads or (share if parallel_jobs > 1 else None)
    if threads:
        torch.set_num_threads(int(threads))
    load = cpu_load(parallel_jobs, torch.get_num_threads())
    if load["oversubscribed"]:
        log.warning("%s: %s (hydra.launcher.n_jobs x eval.num_threads > cores)", run_dir, load["note"])
    with RunDir(run_dir) as run:
        run_dir = run.path
        inputs = run_inputs(settings.resolved)  # fingerprints of the model files, read once
        run.check_config(settings.resolved, inputs)
        pairs = with_prompt_audio(build_test_list(settings.eval))
        models = load_models(settings)  # fails here, before any decoding, when a path is wrong
        check_texts(models.target, pairs)
        run.check_test_list(pairs)
        run.write_config(settings.resolved, inputs)
        metrics = _run(
            settings, models, pairs, run, run_dir / AUDIO_DIR, Path(str(baseline)) if baseline else None, load
        )
    log_to_wandb(settings.resolved, run_dir, metrics, read_records(run_dir / RESULTS_FILE, repair=False),
                 run_dir / AUDIO_DIR, settings.eval.num_audio_samples)  # fmt: skip
    return metrics


def _run(settings: RunSettings, models: EvalModels, pairs, run: RunDir, audio_dir: Path, baseline: Path | None,
         load: dict) -> dict:  # fmt: skip
    """Decode and judge the test list's unfinished utterances; the metrics of all of them."""
    records = read_records(run.results)
    done = {r["utt"] for r in records}
    unknown = done - set(pairs["utt"])
    if unknown:
        raise ValueError(
            f"{run.results} holds utterances that are not in the test list: {sorted(unknown)[:5]}"
        )
    if settings.eval.streaming:
        check_streaming(models.vocoder, models.perturb)
    flag = batch_invariant_numerics(settings, models)
    for model in (models.target, models.draft):
        if isinstance(model, torch.nn.Module):
            use_batch_invariant(model, flag)
    wrong_texts = wrong_sentence_texts(pairs["text"].tolist())
    todo = [(i, p) for i, p in enumerate(pairs.itertuples(index=False)) if p.utt not in done]
    logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # one INFO line per utterance otherwise
    log.info("%s: %d utterances, %d already done, %d to go", run.path, len(pairs), len(done), len(todo))
    batch_size, batch_note = effective_batch_size(settings)
    if batch_note:
        log.warning("eval.batch_size=%s: %s", settings.eval.batch_size, batch_note)
    # Prepared prompts (speech tokens, speaker embedding, vocoder conditioning) are shared by the jobs of a sweep
    # that use the same tokenizer, speaker model and vocoder: keyed by the prompt file.
    parts = settings.parts
    prompt_cache = cached("prompts", {k: parts[k] for k in ("speech_tokenizer", "sim", "vocoder")}, dict)
    items = [prepare_item(models, settings.seed, i, p, wrong_texts[i], prompt_cache) for i, p in todo]
    timed = settings.eval.timed_utts
    timing = Timing(math.inf if timed is None else int(timed), _baseline_tokens(baseline, models))
    with single_threaded_blas():
        if items and settings.eval.warmup:
            warm_up(settings, models, items[0])
        _run_loop(settings, models, items, batch_size, timing, records, run.results, audio_dir)
    e = settings.eval
    metrics = summarize(records, e.bootstrap_resamples, settings.seed)
    metrics.update(run_labels(settings, models), batch_size=batch_size, batch_note=batch_note)
    metrics.update(parallel_jobs=load["parallel_jobs"], cpu_threads=load["threads"], cpu_cores=load["cores"],
                   oversubscribed=load["oversubscribed"], cpu_note=load["note"])  # fmt: skip
    metrics.update(group_metrics(models, records))
    if baseline is not None:
        metrics.update(speedup_vs(metrics, records, baseline, settings, models))
    run.write_metrics(metrics)
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


def _baseline_tokens(baseline_dir: Path | None, models: EvalModels) -> dict[str, list[int]]:
    """utt -> tokens of the baseline run in `baseline_dir`, when it was decoded by this run's baseline decoder
    (the paired baseline decodes must reproduce them); else {}."""
    if baseline_dir is None or models.baseline is None:
        return {}
    if json.loads((baseline_dir / METRICS_FILE).read_text()).get("decoding") != models.baseline.name:
        return {}
    return {r["utt"]: r["tokens"] for r in read_records(baseline_dir / RESULTS_FILE, repair=False)}


def _run_loop(settings: RunSettings, models: EvalModels, items: list[Item], batch_size: int, timing: Timing,
              records: list[dict], results_path: Path, audio_dir: Path) -> None:  # fmt: skip
    """Batches of `batch_size` items in test-list order; each record is appended as soon as its batch is
    judged, so an interrupted run resumes at utterance granularity."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(items), desc=f"eval {settings.decoder.name}", unit="utt", disable=not settings.progress
    )
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        for item, (record, wav) in zip(batch, evaluate_batch(settings, models, batch, timing)):
            if item.index < settings.eval.num_audio_samples and wav.size:
                write_atomic(audio_dir / f"{item.pair.utt}.wav",
                             lambda f, wav=wav: sf.write(f, wav, models.vocoder.sample_rate, format="WAV"))  # fmt: skip
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


def run_labels(settings: RunSettings, models: EvalModels) -> dict:
    """The setting of a run, as the tables show it: the decoder's labels (its own, its drafter's and its rule's
    parameters) name the setting (`setting_keys`); `reference` marks the run every other one is compared with
    (the target alone, its tokens vocoded as generated)."""
    labels = {k: float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v
              for k, v in models.decoder.labels().items()}  # fmt: skip
    setting = list(labels)
    if models.perturb is not None:  # the stress test's groups name its runs
        labels.update(models.perturb.labels())
        setting += list(models.perturb.labels())
    reference = models.decoder.baseline() is None and models.perturb is None
    return {**labels, **settings.labels, "reference": reference, "setting_keys": setting}


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


def speedup_vs(metrics: dict, records: list[dict], baseline_dir: Path, settings: RunSettings, models: EvalModels
               ) -> dict:  # fmt: skip
    """The paired differences in WER, SIM and NMOS against a finished baseline run (usually the AR target) on
    the utterances both runs share. (The speedup is timed within this run: `summarize`.)"""
    out: dict[str, Any] = {"baseline_dir": str(baseline_dir)}
    if not metrics["reference"]:
        ar_records = read_records(baseline_dir / RESULTS_FILE, repair=False)
        out.update(paired_vs_ar(ar_records, records, settings.eval.bootstrap_resamples, settings.seed))
    return out
