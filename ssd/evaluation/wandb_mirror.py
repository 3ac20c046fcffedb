"""The W&B mirror of an evaluation run: summary metrics, α/β per draft position and a table of utterances
with a few wavs. The run dir stays the source of truth; W&B is never the only copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ssd.evaluation.schema import plain
from ssd.tracking import wandb_mode


def wandb_settings(logger_cfg: Any) -> dict | None:
    """The W&B settings in a logger config, or None when it does not log to W&B.

    Accepts a Lightning WandbLogger config (flat or under a `wandb:` key) or `{backend: wandb, ...}`.
    """
    node = plain(logger_cfg) or {}
    if not isinstance(node, dict):
        return None
    section = node.get("wandb", node)
    if not isinstance(section, dict):
        return None
    target = str(section.get("_target_", ""))
    if "wandb" not in target.lower() and section.get("backend") != "wandb":
        return None
    return {k: section.get(k) for k in ("project", "entity", "group", "tags", "offline", "mode", "save_dir")}


def _wandb_run_names() -> tuple[str | None, str | None]:
    """(group, name): runs of one sweep share the sweep dir's name as group."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    if str(hc.mode) == "RunMode.MULTIRUN":
        return Path(hc.sweep.dir).name, hc.job.override_dirname or f"job{hc.job.num}"
    return None, Path(hc.runtime.output_dir).name


def log_to_wandb(
    config: dict, run_dir: Path, metrics: dict, records: list[dict], audio_dir: Path, n_audio: int
) -> None:
    """Mirror one finished run (no-op unless config["logger"] logs to W&B); the first n_audio wavs of
    audio_dir. config: the run's resolved config, as plain data."""
    settings = wandb_settings(config.get("logger"))
    if settings is None:
        return
    import wandb

    group, name = _wandb_run_names()
    run = wandb.init(
        project=settings.get("project") or "ssd",
        entity=settings.get("entity"),
        group=settings.get("group") or group,
        name=name,
        tags=settings.get("tags"),
        job_type="eval",
        mode=wandb_mode(settings.get("offline"), settings.get("mode")),
        dir=str(settings.get("save_dir") or run_dir),
        config=config,
        reinit="finish_previous",
    )
    try:
        run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float, str))})
        for i, (alpha, beta) in enumerate(zip(metrics["alpha_per_position"], metrics["beta_per_position"])):
            run.summary[f"alpha_pos{i + 1}"], run.summary[f"beta_pos{i + 1}"] = alpha, beta
        columns = ["utt", "text", "hypothesis", "wer", "sim", "n_tokens", "rtf", "audio"]
        table = wandb.Table(columns=columns)
        for i, r in enumerate(records):
            wav_path = audio_dir / f"{r['utt']}.wav"
            audio = wandb.Audio(str(wav_path)) if i < n_audio and wav_path.is_file() else None
            table.add_data(
                r["utt"], r["text"], r["hypothesis"], r["wer"], r["sim"], r["n_tokens"], r["rtf"], audio
            )
        run.log({"utterances": table})
    finally:
        run.finish()
