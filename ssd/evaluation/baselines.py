"""The AR baseline a sweep's jobs share, and the sweep's task function.

Every decoder names the baseline it is measured against (`Decoder.baseline()`, the target alone); a multirun
job runs it once per sweep into `<sweep dir>/baselines/<key>/` (or reuses it), so its metrics and the sweep's
table carry the speedup and the paired differences in WER, SIM and NMOS.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import traceback
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from ssd.evaluation.run_dir import (
    BASELINES_DIR,
    ERROR_FILE,
    METRICS_FILE,
    NON_RESULT_KEYS,
    run_inputs,
    write_error,
)
from ssd.evaluation.runner import evaluate, hydra_run_dir

log = logging.getLogger(__name__)

# Keys that cannot change what the baseline computes (besides the run-dir bookkeeping of NON_RESULT_KEYS): the
# parts and knobs of the setting's own decoding, and the stress test's perturbation.
_NOT_BASELINE_KEYS = ("draft", "acceptance", "groups", "beta", "theta", "draft_len", "reproduce", "decoding",
                      "perturb")  # fmt: skip


def _as_baseline(cfg: DictConfig, decoding: dict) -> DictConfig:
    """`cfg` decoded by `decoding`, every setting-only key at its default."""
    from ssd.evaluation.schema import SweepConfig

    defaults = OmegaConf.structured(SweepConfig)
    body = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items()
            if k not in (*_NOT_BASELINE_KEYS, *NON_RESULT_KEYS)}  # fmt: skip
    body.update(
        decoding=decoding, draft=None, acceptance=None, groups=None, beta=defaults.beta, theta=defaults.theta,
        draft_len=defaults.draft_len, logger={}, progress=bool(cfg.get("progress", True)),
    )  # fmt: skip
    return OmegaConf.merge(defaults, body)


def baseline_config(cfg: DictConfig) -> DictConfig | None:
    """The run the setting of `cfg` is compared with (None for a baseline itself): the same target and
    sampling, codec, judges, test list and seeds, decoded by the decoder's baseline; every setting-only key at
    its default, so every setting of a sweep names one run. A perturbed baseline decoder (perturb=) is compared
    with its plain run."""
    decoding = instantiate(cfg.decoding).baseline()
    if decoding is None:
        if cfg.get("perturb") is None:
            return None
        decoding = OmegaConf.to_container(cfg.decoding, resolve=True)
    return _as_baseline(cfg, decoding)


def baseline_key(cfg: DictConfig) -> str:
    """A dir name for the baseline of `cfg`: target, eval and a hash of everything that decides its output (its
    resolved config and the fingerprints of the model files it reads)."""
    base = baseline_config(cfg) or _as_baseline(cfg, OmegaConf.to_container(cfg.decoding, resolve=True))
    # Resolved without the run-dir bookkeeping, which names where a run writes (Hydra's output dir), not what.
    kept = [k for k in base if k not in ("output_dir", *NON_RESULT_KEYS)]
    resolved = OmegaConf.to_container(OmegaConf.masked_copy(base, kept), resolve=True)
    inputs = run_inputs(resolved)
    text = json.dumps({"config": resolved, "inputs": inputs}, sort_keys=True, default=str)
    return f"ar-{cfg.target.name}-{cfg.eval.name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def parallel_jobs(launcher: DictConfig | None) -> int:
    """The jobs a Hydra launcher runs at once on this machine: joblib's n_jobs (-1: every core), else 1 (the
    basic launcher runs one at a time; a cluster launcher gives each job its own node)."""
    if launcher is None or "JoblibLauncher" not in str(launcher.get("_target_", "")):
        return 1
    n, cores = int(launcher.get("n_jobs") or 1), os.cpu_count() or 1
    return max(1, cores + 1 + n if n < 0 else n)


def ensure_baseline(cfg: DictConfig, root: Path, jobs: int = 1) -> Path:
    """The finished baseline of `cfg` under `root` (run now, or reused): concurrent jobs of a sweep wait for the
    one that runs it (a lock on `root`) and then reuse its results."""
    from ssd.files import RunDirLock

    run_dir = root / baseline_key(cfg)
    if not (run_dir / METRICS_FILE).is_file():
        with RunDirLock(root, "AR baselines", wait=True):
            if not (run_dir / METRICS_FILE).is_file():
                log.info("AR baseline for the speedup column: %s", run_dir)
                evaluate(baseline_config(cfg), run_dir, jobs)
    return run_dir


def run_job(cfg: DictConfig) -> dict | None:
    """`evaluate` for a Hydra job. In a multirun a job that is not its own baseline (and has no baseline_dir)
    first runs, or reuses, its baseline in `<sweep dir>/baselines/` (auto_baseline=false: not). A failure is
    written to `error.json` in the job's dir and logged, and the sweep goes on (Hydra would otherwise stop at
    the first exception); a single run raises."""
    from hydra.core.hydra_config import HydraConfig

    from ssd.evaluation.settings import RunSettings

    run_dir = hydra_run_dir()
    multirun = str(HydraConfig.get().mode) == "RunMode.MULTIRUN"
    jobs = parallel_jobs(HydraConfig.get().launcher) if multirun else 1
    try:
        compared = cfg.get("perturb") or instantiate(cfg.decoding).baseline() is not None
        if multirun and compared and not cfg.get("baseline_dir") and cfg.get("auto_baseline"):
            RunSettings.from_config(cfg)  # a bad setting fails before its baseline is computed
            baseline = ensure_baseline(cfg, Path(HydraConfig.get().sweep.dir) / BASELINES_DIR, jobs)
            cfg = cfg.copy()
            with open_dict(cfg):
                cfg.baseline_dir = str(baseline)
        return evaluate(cfg, run_dir, jobs)
    except Exception as err:
        if not multirun:
            raise
        write_error(run_dir, f"{type(err).__name__}: {err}", traceback.format_exc())
        log.error("job %s FAILED (%s: %s); see %s. The sweep continues with the other jobs.",
                  run_dir, type(err).__name__, err, run_dir / ERROR_FILE)  # fmt: skip
        return None
