"""The typed shape of `configs/train_draft.yaml`, registered in Hydra's ConfigStore.

Hydra already rejects a command-line override of a key that does not exist
(`max_step=5`, `optim.lrr=1`: "Key 'lrr' is not in struct"). This schema also catches what
struct mode lets through: typos in YAML files (an experiment file writing `optim: {lrr: 1}`),
appended keys (`+optim.lrr=1`) and wrong types (`max_steps=abc`), at compose time. `check_schema`
does it for the sweep's schema too, naming the nearest existing keys.
Groups (target, draft, data, trainer, logger) are `_target_` nodes: their keys are checked
against the called class's signature by `check_target_kwargs` before anything is built.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_method
from omegaconf import MISSING, DictConfig, OmegaConf

SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class OptimConfig:
    """AdamW + warmup, then cosine / linear decay to min_lr_ratio·lr (or constant) over max_steps."""

    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-8
    warmup_steps: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0


@dataclass
class TrainConfig:
    """Top level of train_draft.yaml (see the comments there)."""

    target: Any = MISSING
    draft: Any = None
    data: Any = MISSING
    trainer: Any = MISSING
    logger: Any = field(default_factory=dict)
    paths: Any = MISSING
    toy_world: Any = None  # the toy world that target=toy reads (configs/toy_world/)
    output_dir: str = MISSING
    seed: int = 0
    max_steps: int = 1000
    val_every_steps: int = 100
    optim: OptimConfig = field(default_factory=OptimConfig)
    kd_weight: float = 0.0
    kd_temperature: float = 1.0
    agreement_sampling: bool = True
    train_target: bool = False
    ckpt_path: str | None = None


SCHEMA_NAME = "train_schema"


def register_schema() -> None:
    """Make `train_schema` available to the defaults list of train_draft.yaml."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def check_schema(cfg: DictConfig, schema: type, what: str) -> DictConfig:
    """`cfg` merged into the typed `schema` (its `hydra` node left out): a key the schema does not know (a typo,
    or a key added with `+`) or a value of the wrong type raises ValueError naming the key and the nearest
    existing ones. Returns the merged config."""
    body = OmegaConf.to_container(cfg, resolve=False)
    body.pop("hydra", None)
    typed = OmegaConf.structured(schema)
    try:
        # Merge plain containers: a node already typed by the schema would carry keys Hydra's `+` added.
        return OmegaConf.merge(typed, body)
    except Exception as err:  # omegaconf raises several error types; all mean "fix the config"
        key = str(getattr(err, "full_key", "") or "")
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(typed, parent) if parent else typed
        known = list(node.keys()) if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(name, known, n=3) if name and name not in known else []
        hint = (f". Did you mean {' or '.join(repr(f'{parent}.{c}' if parent else c) for c in close)}? An "
                "existing key is set without '+'" if close else "")  # fmt: skip
        raise ValueError(
            f"{what} config does not match {schema.__module__}.{schema.__qualname__}: "
            f"{str(err).splitlines()[0]}{hint}"
        ) from err


def validate_train_config(cfg: DictConfig) -> DictConfig:
    """Merge cfg into the schema (a config composed without Hydra, e.g. by the toy-world builder,
    gets the same checks) and check the values Hydra cannot type-check; returns the merged config."""
    merged = check_schema(cfg, TrainConfig, "train")
    problems = []
    if merged.optim.schedule not in SCHEDULES:
        problems.append(f"optim.schedule={merged.optim.schedule!r} is not one of {list(SCHEDULES)}")
    if not 0.0 <= merged.kd_weight <= 1.0:
        problems.append(f"kd_weight={merged.kd_weight} must be in [0, 1]")
    if merged.kd_temperature <= 0:
        problems.append(f"kd_temperature={merged.kd_temperature} must be > 0")
    if merged.max_steps < 1 or merged.val_every_steps < 1:
        problems.append(
            f"max_steps={merged.max_steps} and val_every_steps={merged.val_every_steps} must be >= 1"
        )
    if merged.optim.warmup_steps < 0 or merged.optim.lr <= 0:
        problems.append(f"optim.lr={merged.optim.lr} must be > 0 and optim.warmup_steps >= 0")
    if merged.train_target and merged.kd_weight > 0:
        problems.append("kd_weight > 0 needs a teacher: it is for drafts (train_target=false)")
    if not merged.train_target and merged.draft is None:
        problems.append("draft is null: choose a draft config (draft=toy) or set train_target=true")
    if problems:
        raise ValueError("invalid train config: " + "; ".join(problems))
    for key in ("target.model", "draft", "data", "trainer"):
        node = OmegaConf.select(merged, key)
        if isinstance(node, DictConfig) and "_target_" in node:
            check_target_kwargs(node, key)
    for name, node in (merged.logger or {}).items():
        if isinstance(node, DictConfig) and "_target_" in node:
            check_target_kwargs(node, f"logger.{name}")
    return merged


# Keys a node may carry besides the callable's arguments.
_NON_ARGUMENT_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_", "name"}


def check_target_kwargs(node: DictConfig, where: str, supplied: tuple[str, ...] = ()) -> None:
    """Raise when a `_target_` node has a key its callable does not accept (before building anything).

    `name` is allowed as a label (draft configs carry one). Callables taking **kwargs accept anything."""
    target = get_method(node._target_) if not isinstance(node._target_, type) else node._target_
    try:
        signature = inspect.signature(target.__init__ if inspect.isclass(target) else target)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in node if k not in params and k not in _NON_ARGUMENT_KEYS and k not in supplied]
    if unknown:
        valid = [k for k in params if k not in ("self", "args", "kwargs")]
        raise ValueError(f"config {where}: unknown key(s) {unknown} for {node._target_}; valid keys: {valid}")
