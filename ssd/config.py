"""The one place that composes the project's Hydra configs outside an entry point.

The configs live in `configs/` at the repo root and ship inside the package as `ssd.configs`
(`ssd/configs` links to them), so `compose("sweep", [...])` gives what `python sweep.py ...` sees,
from a checkout or from an installed wheel alike. Override-string helpers live here too: the
experiment driver and the toy-world builder both turn config values into command-line overrides.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from ssd.config_files import CONFIG_MODULE


def register() -> None:
    """Resolvers and schemas the configs name; idempotent. Every process that composes a config (entry
    points, joblib/submitit workers unpickling a task, the library's `compose`) calls it."""
    from ssd.evaluation.schema import register_sweep_schema
    from ssd.training.schema import register_schema

    register_schema()
    register_sweep_schema()


def compose(config_name: str, overrides: Sequence[str] = (), with_hydra: bool = False) -> DictConfig:
    """configs/<config_name>.yaml composed with `overrides`, as the entry point would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()  # a caller inside a Hydra app (the toy world's stages) has one already
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = hydra_compose(config_name, overrides=list(overrides), return_hydra_config=True)
        check_choices(cfg, cfg.hydra.runtime.choices)
    if not with_hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    return cfg


def check_choices(cfg: DictConfig, choices: Mapping[str, str | None]) -> None:
    """Refuse a config group option that does not exist (`asr=whispr`): Hydra skips a missing option of an
    `optional` defaults entry without a word. A group's default named after the target (`asr: ${target}`) is
    left to the run's own check, which says which group to choose. Needs an initialized Hydra (inside an app
    or `compose`); a no-op elsewhere."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return
    loader = GlobalHydra.instance().config_loader()
    target = OmegaConf.select(cfg, "target.name", default=None)
    problems = []
    for group, option in choices.items():
        if group.startswith("hydra") or option is None or option == target:
            continue
        valid = loader.get_group_options(group)
        if valid and option not in valid:
            close = difflib.get_close_matches(option, valid, n=1)
            guess = f" did you mean {group}={close[0]}?" if close else ""
            problems.append(f"{group}={option}: no such option (no configs/{group}/{option}.yaml);{guess} "
                            f"choose one of {valid}")  # fmt: skip
    if problems:
        raise ValueError("; ".join(problems))


class NoLinkedHydraFiles(Callback):
    """Hydra callback: Hydra writes its own files into a run dir (`.hydra/*.yaml`, the job's log, a sweep's
    multirun.yaml) before any ssd code runs, with no care for links; refuse a run or sweep dir where one of
    them would be written through a symbolic link (SystemExit: Hydra turns a callback's Exception into a
    warning). A multirun checks the job dirs already there (a rerun's)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._refuse(config, [Path(config.hydra.run.dir)])

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ssd.files import refuse_links

        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = [d for d in sweep_dir.iterdir() if d.is_dir()] if sweep_dir.is_dir() else []
        try:
            refuse_links(sweep_dir / "multirun.yaml")
        except ValueError as err:
            raise SystemExit(str(err)) from None
        self._refuse(config, jobs)

    @staticmethod
    def _refuse(config: DictConfig, run_dirs: list[Path]) -> None:
        from ssd.files import refuse_links

        subdir = config.hydra.output_subdir
        names = [f"{config.hydra.job.name}.log"]
        names += [f"{subdir}/{n}" for n in ("config.yaml", "hydra.yaml", "overrides.yaml")] if subdir else []
        try:
            for run_dir in run_dirs:
                for name in names:
                    refuse_links(run_dir / name)
        except ValueError as err:
            raise SystemExit(str(err)) from None


# ---- override strings ------------------------------------------------------------------------------


def override_key(override: str) -> str:
    """'eval.n_utts=4' -> 'eval.n_utts'; '+x=1' -> 'x'; '~x' -> 'x'."""
    return override.split("=", 1)[0].lstrip("+~")


def override_value(value: Any) -> str:
    """A config value as Hydra override text (lists as [a,b], None as null)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def as_overrides(values: Any) -> list[str]:
    """{key: value} (a config node or dict) as `key=value` overrides."""
    plain = OmegaConf.to_container(values, resolve=True) if isinstance(values, DictConfig) else values
    return [f"{k}={override_value(v)}" for k, v in (plain or {}).items()]


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; for a key given twice the later one wins (Hydra refuses duplicates)."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            merged.pop(override_key(override), None)
            merged[override_key(override)] = override
    return list(merged.values())
