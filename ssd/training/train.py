"""`train(cfg)`: the function behind `python train_draft.py` (and the toy-world builder's LM stages).

Builds the target from `cfg.target.model`, the draft from `cfg.draft` (or trains the target itself
when `cfg.train_target`), the DataModule from `cfg.data`, loggers from `cfg.logger`, a Trainer from
`cfg.trainer`; measures dev metrics before training, trains, measures again and exports the model.
A diverged run (non-finite loss) stops with an error and exports nothing.

Every file goes through `ssd.files` (atomic, never through a link), Lightning's checkpoints included
(`SafeCheckpointIO`); every checkpoint is read with weights only.

Run directory (`cfg.output_dir`):
    checkpoints/last.ckpt          Lightning checkpoint (trainable tensors + optimizer + loop state):
                                   a rerun into the same directory resumes from it
    checkpoints/draft-best.pt      best dev alpha so far, draft format of ssd.drafters.layers.save_draft
    draft.pt | target/             the final model (draft checkpoint, or a CosyVoice 2 model dir)
    before_training.json           dev metrics before the first step (kept across resumes)
    run.json                       the target's file fingerprints + the draft recipe: a resume must match them
    metrics.json                   what train() returns (written atomically, like every JSON here)
    .lock, .ssd_kind               held by global rank 0 while a training writes the dir (a second
                                   training fails at once; other ranks and nodes share the first one's);
                                   the dir is marked a training run: no evaluation or sweep writes into it
    csv/version_N/metrics.csv      CSV log (one version per run or resume), wandb/: W&B mirror
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, OmegaConf

from ssd.drafters.base import model_outputs
from ssd.drafters.layers import describe
from ssd.files import (
    RunDirLock,
    fingerprint,
    fingerprint_changes,
    read_checkpoint,
    run_dir_path,
    write_atomic,
    write_checkpoint,
)
from ssd.tracking import wandb_mode
from ssd.training.data import check_text_tokenizer
from ssd.training.module import SpeechLMTrainingModule
from ssd.training.schema import OptimConfig, validate_train_config

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
BEFORE_FILE = "before_training.json"
RUN_FILE = "run.json"  # what the run trains (target files, draft recipe), checked when it resumes


def export_model(model: torch.nn.Module, path: str | Path, draft: bool) -> Path:
    """A drafter -> its checkpoint at `path` (`save`: trained tensors + recipe + target fingerprint); a target ->
    its own model-dir format at `path`. A model with a non-finite trained tensor is never exported."""
    broken = [k for k, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()]
    if broken:
        raise FloatingPointError(
            f"not exporting {path}: trained tensors {broken[:4]} hold NaN/inf (training diverged)"
        )
    return model.save(path) if draft else model.save_dir(path)


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoints (last.ckpt) written by `ssd.files.write_checkpoint` (atomic, never through a
    link) and read by `read_checkpoint` (weights only: a file whose unpickling would run code is refused)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        write_checkpoint(path, checkpoint)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        return read_checkpoint(path, "Lightning checkpoint")


class ExportCheckpoint(ModelCheckpoint):
    """ModelCheckpoint's when-and-which logic (monitor, top-k, every n steps) writing the model's own
    format (draft checkpoint: trainable tensors + recipe; target: model dir) instead of a Lightning
    checkpoint. Overrides only the method that writes a file (Lightning 2.x `_save_checkpoint`)."""

    def __init__(self, draft: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.draft = draft
        self.FILE_EXTENSION = ".pt" if draft else ""

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        if trainer.is_global_zero:
            export_model(trainer.lightning_module.model, filepath, self.draft)
        trainer.strategy.barrier()
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath


def build_loggers(logger_cfg: DictConfig | None) -> list[Logger]:
    """One Lightning logger per `_target_` entry of cfg.logger (`logger=none` gives none).

    A WandbLogger with `offline: null` follows ssd.tracking.wandb_mode (offline unless a key is set)."""
    loggers: list[Logger] = []
    for name, node in (logger_cfg or {}).items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ValueError(f"config logger.{name} must be a node with _target_ (a Lightning logger)")
        kwargs = {}
        if node._target_.endswith("WandbLogger") and node.get("offline") is None:
            kwargs["offline"] = wandb_mode() != "online"
        loggers.append(instantiate(node, **kwargs))
    return loggers


def build_models(cfg: DictConfig) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(model to train, frozen teacher or None)."""
    target = instantiate(cfg.target.model)
    if cfg.train_target:
        target.requires_grad_(True)
        return target, None
    return instantiate(cfg.draft, target=target), target


def _dev_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(v) for k, v in (results[0] if results else {}).items() if k.startswith("dev/")}


def _final_line(model_is_draft: bool, before: dict[str, float], after: dict[str, float]) -> str:
    def pair(key: str) -> str:
        then = before.get(key)
        return f"{after[key]:.3f}" + (f" (before training: {then:.3f})" if then is not None else "")

    if model_is_draft and "dev/alpha_softmax" in after:
        line = f"draft dev alpha (sum min(p,q), softmax): {pair('dev/alpha_softmax')}"
        if "dev/alpha_target_sampling" in after:
            line += f"; with the target's sampling transform: {pair('dev/alpha_target_sampling')}"
        return line + f"; top-1 agreement {pair('dev/top1_agreement')}"
    return f"{'draft' if model_is_draft else 'target'} dev CE: {pair('dev/ce')}; token accuracy {pair('dev/acc')}"


def run_identity(cfg: DictConfig, model: torch.nn.Module) -> dict[str, Any]:
    """What a resumed training must share with the run it continues: the target's files and the recipe of
    what is trained (a longer max_steps or another lr is a legitimate resume; another model is not)."""
    recipe = None if cfg.train_target else model.recipe
    recipe = asdict(recipe) if is_dataclass(recipe) else recipe
    return {
        "train_target": bool(cfg.train_target),
        "draft_recipe": json.loads(json.dumps(recipe)) if recipe else None,  # tuples -> lists, as stored
        "target_files": fingerprint(str(cfg.target.model.model_dir)),
    }


def check_resume_identity(output_dir: Path, identity: dict[str, Any], resuming: bool) -> None:
    """Refuse to continue a run dir trained with another target or recipe; record the identity otherwise."""
    path = output_dir / RUN_FILE
    saved = json.loads(path.read_text()) if path.is_file() else None
    if resuming and saved is not None:
        problems = [f"{k}: {saved.get(k)} then, {identity[k]} now" for k in ("train_target", "draft_recipe")
                    if saved.get(k) != identity[k]]  # fmt: skip
        changes = fingerprint_changes(
            {"target": saved.get("target_files") or {}}, {"target": identity["target_files"]}
        )
        problems += [f"target model files changed: {c}" for c in changes]
        if problems:
            raise ValueError(
                f"{output_dir} holds a training of another model ({'; '.join(problems)}): resuming would mix "
                "them; choose a new output_dir (hydra.run.dir=...) or restore the original settings"
            )
    write_atomic(path, json.dumps(identity, indent=1))


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train a draft (or, with train_target=true, the target) as configured; see the module doc.

    Returns the dev metrics after training (`dev/...`), before training (`before/dev/...`),
    `global_step` and `export_path` (the final draft.pt or target dir)."""
    cfg = validate_train_config(cfg)
    output_dir = run_dir_path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with training_dir_lock(output_dir):
        return _train(cfg, output_dir)


def is_global_rank_zero(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is global rank 0 of its training, from what the launchers set before Lightning's
    trainer exists: RANK (torchrun), else NODE_RANK / LOCAL_RANK (Lightning's own launcher; each node's first
    process has no LOCAL_RANK yet, but a NODE_RANK from the user or the cluster), else SLURM_PROCID (srun)."""
    if "RANK" in env:
        return int(env["RANK"]) == 0
    if "SLURM_PROCID" in env and "LOCAL_RANK" not in env and "NODE_RANK" not in env:
        return int(env["SLURM_PROCID"]) == 0
    return int(env.get("NODE_RANK", env.get("GROUP_RANK", 0))) == 0 and int(env.get("LOCAL_RANK", 0)) == 0


def training_dir_lock(output_dir: Path) -> contextlib.AbstractContextManager:
    """The run dir's lock, held by global rank 0 only: every other process of the same training (other
    GPUs, other nodes on a shared filesystem) runs inside it; a second training fails at once."""
    return RunDirLock(output_dir, "training run") if is_global_rank_zero() else contextlib.nullcontext()


def check_checkpoint_loads_safely(path: str | Path) -> None:
    """Read the checkpoint a training resumes from before anything else: weights only (`read_checkpoint`:
    a file whose unpickling would run code is refused, as is a truncated one, each naming the file). mmap
    reads only the pickle, not the tensor data."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path={path} is not a checkpoint file")
    try:
        read_checkpoint(path, "Lightning checkpoint (last.ckpt)", mmap=True)
    except ValueError as err:
        raise ValueError(
            f"not resuming: {err}. Resume only from a last.ckpt this code wrote; to start over, delete it (or "
            "choose a new output_dir)"
        ) from None


def _train(cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    model, teacher = build_models(cfg)
    # Seed after the models are loaded: some loaders re-seed global RNGs (docs/targets.md §2.4).
    L.seed_everything(cfg.seed, workers=True)
    rank_zero_info(describe(model))

    sampling = None
    if cfg.agreement_sampling and teacher is not None and cfg.target.get("sampling") is not None:
        sampling = instantiate(cfg.target.sampling, stop_tokens=list(teacher.stop_tokens))
    draft = not cfg.train_target
    module = SpeechLMTrainingModule(
        model,
        teacher,
        outputs=None if draft else partial(model_outputs, model),
        optim=OmegaConf.to_object(cfg.optim) if isinstance(cfg.optim, DictConfig) else OptimConfig(),
        max_steps=cfg.max_steps,
        kd_weight=cfg.kd_weight,
        kd_temperature=cfg.kd_temperature,
        agreement_sampling=sampling,
    )
    datamodule = instantiate(cfg.data)
    target = teacher if teacher is not None else model
    if getattr(target, "tokenizer", None) is not None and getattr(datamodule, "shard_dirs", None) is not None:
        check_text_tokenizer(datamodule.shard_dirs, target.tokenizer)
    loggers = build_loggers(cfg.logger)
    ckpt_dir = output_dir / CHECKPOINT_DIR
    monitor = ("dev/alpha_softmax", "max") if draft and teacher is not None else ("dev/ce", "min")
    callbacks = [
        # last.ckpt (resume): every validation, and explicitly after the last step.
        ModelCheckpoint(dirpath=ckpt_dir, filename=LAST_CHECKPOINT.removesuffix(".ckpt"), save_top_k=1,
                        every_n_train_steps=cfg.val_every_steps, enable_version_counter=False),
        ExportCheckpoint(draft, dirpath=ckpt_dir, filename=f"{'draft' if draft else 'target'}-best",
                         monitor=monitor[0], mode=monitor[1], save_top_k=1, enable_version_counter=False),
    ]  # fmt: skip
    if loggers:  # Lightning refuses a LearningRateMonitor without a logger (logger=none)
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(RichProgressBar())
    trainer: L.Trainer = instantiate(
        cfg.trainer,
        plugins=[SafeCheckpointIO()],
        max_steps=cfg.max_steps,
        val_check_interval=cfg.val_every_steps,
        check_val_every_n_epoch=None,  # validation counts global steps, across epochs
        logger=loggers or False,
        callbacks=callbacks,
        default_root_dir=str(output_dir),
        use_distributed_sampler=False,  # the DataModule's batch sampler deals batches to ranks
    )
    for logger in loggers:
        logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    last = ckpt_dir / LAST_CHECKPOINT
    ckpt_path = cfg.ckpt_path or (str(last) if last.is_file() else None)
    if ckpt_path is not None:
        check_checkpoint_loads_safely(ckpt_path)
    if trainer.is_global_zero:
        check_resume_identity(output_dir, run_identity(cfg, model), resuming=ckpt_path is not None)
    before_path = output_dir / BEFORE_FILE
    if ckpt_path is None or not before_path.is_file():
        # fit() loads ckpt_path later: this measures the model as built, i.e. before any training.
        before = _dev_metrics(trainer.validate(module, datamodule=datamodule, verbose=False))
        if trainer.is_global_zero:
            write_atomic(before_path, json.dumps(before, indent=1))
    else:
        rank_zero_info(f"resuming from {ckpt_path}")
        before = json.loads(before_path.read_text())

    # Frozen modules are in eval mode on purpose (SpeechLMTrainingModule.train); Lightning warns about it.
    warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    trainer.save_checkpoint(last)
    after = _dev_metrics(trainer.validate(module, datamodule=datamodule, verbose=False))

    export_path = output_dir / ("draft.pt" if draft else "target")
    metrics: dict[str, Any] = {**after, **{f"before/{k}": v for k, v in before.items()}}
    metrics.update(global_step=trainer.global_step, export_path=str(export_path))
    if trainer.is_global_zero:
        export_model(model, export_path, draft)
        write_atomic(output_dir / "metrics.json", json.dumps(metrics, indent=1))
        for logger in loggers:
            logger.log_metrics({f"final/{k}": v for k, v in after.items()}, step=trainer.global_step)
            logger.save()
            if isinstance(logger, WandbLogger):
                logger.experiment.finish()  # the next train() in this process starts a new run
    rank_zero_info(_final_line(draft, before, after))
    return metrics
