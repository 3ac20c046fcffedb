"""The one place that composes the project's Hydra configs outside an entry point.

The configs live in `configs/` at the repo root and ship inside the package as `ssd.configs`
(`ssd/configs` links to them), so `compose("sweep", [...])` gives what `python sweep.py ...` sees,
from a checkout or from an installed wheel alike. Override-string helpers live here too: the
experiment driver and the toy-world builder both turn config values into command-line overrides.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, open_dict

from ssd.config_files import CONFIG_MODULE, check_choices


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
