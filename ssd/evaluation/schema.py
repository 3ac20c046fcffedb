"""The typed shape of `configs/sweep.yaml`, registered in Hydra's ConfigStore (as `sweep_schema`).

Hydra then rejects, when the config is composed, a key that does not exist (`eval.n_uts=4`, also
inside YAML files) and a value of the wrong type (`draft_len=abc`, `eval.max_len=x`). The ranges
Hydra cannot check (`eval.max_len=-5`, β < 0, θ outside (-1, 1)) are checked by `validate_sweep_config`, and
the decoder checks its own (`draft_len=0`, `adaptive.min_len > max_len`) when it is built; the runner does
both first, before any model loads (`ssd.evaluation.settings`). Swappable parts (decoding, target, draft,
acceptance, groups, speech_tokenizer, vocoder, asr, sim, mos) are `_target_` nodes: their keys are checked
against the called class's signature.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from ssd.training.schema import check_schema, check_target_kwargs

SCHEMA_NAME = "sweep_schema"
MAX_DIRNAME = 120


def job_dirname(override_dirname: str) -> str:
    """A multirun job's dir name from its overrides: '/' cannot nest dirs, and a name too long for the file
    system keeps its first characters. Either way a hash of the overrides as given is appended, so two jobs
    never share a dir (`a/x.pt` and `a_x.pt` differ); still a pure function, so reruns resume."""
    name = override_dirname.replace("/", "_") or "default"
    if name == override_dirname and len(name) <= MAX_DIRNAME:
        return name
    return name[: MAX_DIRNAME - 11] + "-" + hashlib.sha1(override_dirname.encode()).hexdigest()[:10]


@dataclass
class EvalConfig:
    """A zero-shot test list (ssd.data.libritts.make_zero_shot_pairs) and how it is judged."""

    name: str = MISSING
    split: str | None = None
    corpus_root: str = MISSING
    subsets: list[str] = field(default_factory=lambda: ["test-clean"])
    n_utts: int = 500
    n_speakers: int = 37
    prompt_sec: list[float] = field(default_factory=lambda: [2.0, 4.0])
    target_sec: list[float] = field(default_factory=lambda: [4.0, 10.0])
    pair_seed: int = 0
    language: str | None = None  # null | grid (the toy language: wrong-sentence WER, per-slot accuracy)
    slots: Any = None
    max_len: int | None = None  # cap on generated tokens (null = the target's own rule)
    batch_size: int = 1  # test items decoded at once; every record equals batch 1's (per-row seeds)
    # The first N items are timed at batch 1 (LM-RTF), each paired with the baseline decoded in the same process
    # (the speedup and its CI); null: every item.
    timed_utts: int | None = 40
    # Row-by-row numerics, so batch B equals batch 1 bit for bit; null: on CPU only.
    batch_invariant: bool | None = None
    warmup: bool = True
    # Timed decodes stream: verified tokens reach the vocoder in chunks as the LM emits them (first-packet latency,
    # stalls, streaming RTF; docs/algorithms.md §4.2). The judged audio is the streamed audio.
    streaming: bool = False
    num_audio_samples: int = 4
    bootstrap_resamples: int = 1000
    num_threads: int | None = None


@dataclass
class SweepConfig:
    """Top level of sweep.yaml (see the comments there)."""

    target: Any = MISSING
    draft: Any = None
    acceptance: Any = None
    groups: Any = None  # PCG's token vectors (configs/groups/), interpolated into the rules that group tokens
    decoding: Any = MISSING  # the decoder (configs/decoding/: ssd.decoding.decoders)
    eval: EvalConfig = field(default_factory=EvalConfig)
    speech_tokenizer: Any = None
    vocoder: Any = None
    asr: Any = None
    sim: Any = None
    mos: Any = None  # the naturalness judge (configs/mos/); null = none
    logger: Any = field(default_factory=dict)
    paths: Any = MISSING
    beta: float = 0.4
    theta: float = 0.4
    draft_len: int = 3
    seed: int = 0
    output_dir: str | None = MISSING  # the run dir (Hydra sets it; None where none is named yet)
    baseline_dir: str | None = None
    auto_baseline: bool = True  # a multirun job without decoding=ar runs/reuses the AR baseline (baselines/)
    progress: bool = True
    reproduce: Any = None  # the experiment driver's notes (configs/experiment/)
    toy_world: Any = None  # the toy world that target=toy reads (configs/toy_world/)
    perturb: Any = None  # tokens rewritten before vocoding (PCG's stress test: ssd.decoding.pcg.GroupSwap)


def jobs_that_fit(threads: int | None, cores: int | None = None) -> int:
    """How many parallel jobs of `threads` threads each (null: every core) a machine of `cores` cores holds."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // int(threads or cores))


def cpu_load(parallel_jobs: int, threads: int, cores: int | None = None) -> dict[str, Any]:
    """What a run's timings share the CPU with: its parallel jobs (a local launcher's), each one's threads, the
    cores, and whether jobs x threads oversubscribe them (then every speed column is unreliable)."""
    cores = cores or os.cpu_count() or 1
    busy = parallel_jobs * threads > cores
    note = f"{parallel_jobs} parallel job(s) x {threads} thread(s) on {cores} core(s)"
    return {"parallel_jobs": parallel_jobs, "threads": threads, "cores": cores, "oversubscribed": busy,
            "note": note + (": oversubscribed, speed columns unreliable" if busy else "")}  # fmt: skip


def plain(node: Any) -> Any:
    """A config node as plain python (interpolations resolved); anything else as it is."""
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def register_sweep_schema() -> None:
    """What sweep.yaml names: `sweep_schema` in its defaults list, the `ssd.job_dirname` resolver
    (configs/hydra/default.yaml names job dirs with it) and `ssd.jobs_that_fit` (the joblib launcher's
    n_jobs); idempotent."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=SweepConfig)
    if not OmegaConf.has_resolver("ssd.job_dirname"):
        OmegaConf.register_new_resolver("ssd.job_dirname", job_dirname)
    if not OmegaConf.has_resolver("ssd.jobs_that_fit"):
        OmegaConf.register_new_resolver("ssd.jobs_that_fit", jobs_that_fit)


def validate_sweep_config(cfg: DictConfig, needs: tuple[str, ...] = ()) -> None:
    """Every range the types cannot express, in one error that names each key and what it must be; `needs`:
    the config groups the decoder decodes with (they must be set). A key the schema does not know (`+drafr_len=5`)
    is refused first."""
    check_schema(cfg, SweepConfig, "sweep")
    problems = []
    for key in needs:
        if cfg.get(key) is None:
            problems.append(f"{key} is null: the decoding ({cfg.decoding._target_}) needs one ({key}=<option of "
                            f"configs/{key}/>)")  # fmt: skip
    for key in ("speech_tokenizer", "vocoder", "asr", "sim"):
        if cfg.get(key) is None:
            problems.append(
                f"{key} is not set and target={cfg.target.name} brings none (no configs/{key}/{cfg.target.name}.yaml): "
                f"choose one ({key}=<option of configs/{key}/>)"
            )
    if cfg.beta < 0:
        problems.append(f"beta={cfg.beta} must be >= 0")
    if not -1 < cfg.theta < 1:
        problems.append(f"theta={cfg.theta} must lie in (-1, 1) (a cosine threshold)")
    e = cfg.eval
    if e.max_len is not None and e.max_len < 1:
        problems.append(f"eval.max_len={e.max_len} must be >= 1 or null")
    for key in ("n_utts", "n_speakers"):
        if e[key] < 1:
            problems.append(f"eval.{key}={e[key]} must be >= 1")
    for key in ("prompt_sec", "target_sec"):
        lo_hi = list(e[key])
        if len(lo_hi) != 2 or not 0 <= lo_hi[0] <= lo_hi[1]:
            problems.append(f"eval.{key}={lo_hi} must be [min, max] seconds with 0 <= min <= max")
    mode = cfg.asr.get("vocabulary_mode") if isinstance(cfg.get("asr"), DictConfig) else None
    if e.language is None and mode is not None:
        problems.append(
            f"asr.vocabulary_mode={mode} needs the language's words, and eval.language=null gives none: set "
            "asr.vocabulary_mode=null (an open vocabulary) or eval.language=grid"
        )
    if e.batch_size < 1:
        problems.append(f"eval.batch_size={e.batch_size} must be >= 1")
    if e.timed_utts is not None and e.timed_utts < 1:
        problems.append(f"eval.timed_utts={e.timed_utts} must be >= 1 or null (null: time every item)")
    if e.batch_invariant and cfg.decoding.get("compile", False):
        problems.append(
            "eval.batch_invariant=true needs the eager decode path (per-row attention), and decoding.compile=true "
            "takes the static one: set one of them to false"
        )
    if e.bootstrap_resamples < 0 or e.num_audio_samples < 0:
        problems.append("eval.bootstrap_resamples and eval.num_audio_samples must be >= 0")
    if problems:
        raise ValueError("invalid sweep config: " + "; ".join(problems))
    for key in PART_NODES:
        node = OmegaConf.select(cfg, key)
        if isinstance(node, DictConfig) and "_target_" in node:
            check_target_kwargs(node, key, supplied=_SUPPLIED.get(key, ()))


# The `_target_` nodes of a run's parts, and the arguments the runner passes itself beside a node's keys.
PART_NODES = (
    "decoding",
    "target.model",
    "draft",
    "acceptance",
    "speech_tokenizer",
    "vocoder",
    "asr",
    "sim",
    "mos",
)
_SUPPLIED = {"draft": ("target",), "asr": ("closed_vocabulary",)}
