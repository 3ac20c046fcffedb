"""The experiment driver: `reproduce(name, out_root, overrides)` runs an experiment end to end.

It runs every sweep as a subprocess of the repo's `sweep.py` (and its study, e.g. `train_draft.py` for
draft_training) into `<out_root>/<name>/runs/`, then writes into `<out_root>/<name>/` the tables (md, csv,
tex; `ssd.evaluation.tables.write_table`), the figures (PNG), `command.txt`, `git_commit.txt`,
`machine.txt` and `summary.md`. Every number written is computed from the run files; the paper's numbers
come from the experiment config. Rerunning resumes: the runner skips finished utterances, train.py resumes
from its last checkpoint and a finished training is not redone.

`overrides` (e.g. `paths.data_dir=...`, `draft.checkpoint=...`, `eval.n_utts=4`) apply to every command
whose config has their root key; they do not name job dirs (only the grid does).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ssd.config import compose
from ssd.config_files import as_overrides, group_options, merge_overrides, override_key, override_value
from ssd.evaluation.provenance import CommandLog, git_description, machine_description
from ssd.evaluation.report import aggregate
from ssd.evaluation.run_dir import BASELINES_DIR, METRICS_FILE
from ssd.evaluation.selection import matched_speed, select_on_dev
from ssd.evaluation.tables import display_table, paper_table, to_markdown, write_table
from ssd.experiments import STUDIES, StudyResult
from ssd.files import write_atomic

log = logging.getLogger(__name__)


@cache
def repo_root() -> Path:
    """The checkout whose `sweep.py` and `train_draft.py` the driver runs (the only place that finds it)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "sweep.py").is_file() or not (root / "train_draft.py").is_file():
        raise RuntimeError(
            f"the experiment driver runs the repo's sweep.py and train_draft.py, but the `ssd` package at "
            f"{root / 'ssd'} is not inside a checkout of the project (no {root / 'sweep.py'}): run it from "
            "a git checkout (pip install -e .)"
        )
    return root


def default_out() -> Path:
    """experiments/results in the checkout."""
    return repo_root() / "experiments" / "results"


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


def load_experiment(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The sweep config of experiment `name` (with its `hydra` and `reproduce` nodes), checked."""
    names = group_options("experiment")
    if name not in names:
        raise ValueError(f"unknown experiment {name!r}: choose one of {names} (configs/experiment/)")
    driver_only = [
        o for o in overrides if override_key(o).split(".")[0] == "reproduce"
    ]  # e.g. smaller studies
    cfg = compose(
        "sweep", [f"experiment={name}", *applicable(overrides, "sweep"), *driver_only], with_hydra=True
    )
    spec = cfg.get("reproduce")
    where = f"configs/experiment/{name}.yaml"
    if spec is None or not spec.get("title"):
        raise ValueError(f"{where}: needs a `reproduce:` node with a title (see ssd/experiments/__init__.py)")
    if spec.get("study") is not None and spec.study not in STUDIES:
        raise ValueError(
            f"{where}: reproduce.study must name a registered study ({sorted(STUDIES)}, "
            f"ssd.experiments.STUDIES) or be absent, got {spec.study!r}"
        )
    if not cfg.hydra.sweeper.get("params"):
        raise ValueError(f"{where}: hydra.sweeper.params (the experiment's grid) is empty")
    return cfg


_ROOT_KEYS: dict[str, set[str]] = {}


def applicable(overrides: Sequence[str], config_name: str) -> list[str]:
    """The overrides whose root key exists in configs/<config_name> (hydra.* always applies; `reproduce.*`
    is the driver's own and never reaches a sweep or a training)."""
    if config_name not in _ROOT_KEYS:
        _ROOT_KEYS[config_name] = (set(compose(config_name).keys()) | {"hydra"}) - {"reproduce"}
    return [o for o in overrides if override_key(o).split(".")[0].split("/")[0] in _ROOT_KEYS[config_name]]


# --------------------------------------------------------------------------------------------------
# Subprocess commands
# --------------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    env.setdefault("WANDB_MODE", "offline")
    return env


def run_command(argv: Sequence[str], commands: CommandLog, log_path: Path) -> None:
    """Run one entry point from the repo root, its output appended to `log_path`; raise if it fails."""
    line = commands.add(argv)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as out:
        out.write(f"\n$ {line}\n")
        out.flush()
        done = subprocess.run(list(argv), cwd=repo_root(), env=_env(), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"command failed (exit {done.returncode}): {line}\nsee {log_path}")


def sweep_argv(name: str, sweep_dir: Path, grid: Sequence[str], world: Sequence[str], exclude: Sequence[str]):
    """`python sweep.py -m experiment=<name> <grid> <world>` into `sweep_dir`; world keys do not name dirs."""
    keys = list(dict.fromkeys([*exclude, *(override_key(o) for o in world)]))
    return [
        sys.executable, str(repo_root() / "sweep.py"), "-m", f"experiment={name}", *grid, *world,
        f"hydra.sweep.dir={sweep_dir}", f"hydra.job.config.override_dirname.exclude_keys={override_value(keys)}",
    ]  # fmt: skip


@dataclass
class Experiment:
    """One experiment being reproduced: its config, its results dir and how it runs commands (what a
    study gets)."""

    name: str
    cfg: DictConfig  # the sweep config with the `reproduce` node (load_experiment)
    out_dir: Path  # <out_root>/<name>
    world: list[str]  # overrides of every sweep
    train_world: list[str]  # overrides of train_draft.py
    exclude: list[str]  # keys that never name job dirs
    commands: CommandLog

    @property
    def runs(self) -> Path:
        return self.out_dir / "runs"

    def script(self, name: str) -> str:
        """The path of one of the repo's entry points (e.g. 'train_draft.py')."""
        return str(repo_root() / name)

    def run(self, argv: Sequence[str], log_name: str = "sweep") -> None:
        """run_command, output into runs/logs/<log_name>.log."""
        run_command(argv, self.commands, self.runs / "logs" / f"{log_name}.log")

    def sweep(self, sweep_dir: Path, grid: Sequence[str] = (), world: Sequence[str] | None = None) -> None:
        """The experiment's sweep with `grid` (default: its own) into `sweep_dir`."""
        self.run(sweep_argv(self.name, sweep_dir, grid, self.world if world is None else world, self.exclude))


def run_sweeps(experiment: Experiment, sweep_dir: Path, world: Sequence[str] | None = None) -> None:
    """The experiment's grid, its extra grids and the AR baseline, all into `sweep_dir`."""
    spec = experiment.cfg.reproduce
    experiment.sweep(sweep_dir, [], world)
    for grid in spec.get("extra_grids") or []:
        experiment.sweep(sweep_dir, ["hydra.sweeper.params=null", *as_overrides(grid)], world)
    # The grid's jobs ran the AR baseline into baselines/ already (auto_baseline), unless they all were AR.
    if spec.get("baseline") and not any((sweep_dir / BASELINES_DIR).glob(f"*/{METRICS_FILE}")):
        experiment.sweep(sweep_dir, ["hydra.sweeper.params=null", "decoding=ar"], world)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def _copy_figures(sweep_dir: Path, out_dir: Path, suffix: str = "") -> list[str]:
    names = []
    for fig in sorted(sweep_dir.glob("fig_*.png")):
        target = out_dir / f"{fig.stem}{suffix}.png"
        write_atomic(target, fig.read_bytes())
        names.append(target.name)
    return names


def reproduce(
    name: str,
    out_root: str | Path | None = None,
    overrides: Sequence[str] = (),
    train_overrides: Sequence[str] = (),
) -> Path:
    """Run experiment `name` end to end (resuming) and write its results dir (under `out_root`, default
    experiments/results); returns that dir."""
    cfg = load_experiment(name, overrides)
    spec = cfg.reproduce
    out_dir = Path(out_root or default_out()).resolve() / name
    runs = out_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "machine.txt", machine_description())
    write_atomic(out_dir / "git_commit.txt", git_description(repo_root()))
    world = applicable(overrides, "sweep")
    if not any(override_key(o) == "logger" for o in world):
        world.insert(0, "logger=none")  # W&B start-up costs seconds per job; pass logger=wandb to mirror
    world = merge_overrides(["~reproduce"], world)  # the driver's notes are not part of a run's config
    experiment = Experiment(
        name, cfg, out_dir, world, train_world=[*applicable(overrides, "train_draft"), *train_overrides],
        exclude=[*cfg.hydra.job.config.override_dirname.exclude_keys, "experiment"],
        commands=CommandLog(out_dir / "command.txt", repo_root()),
    )  # fmt: skip

    run_sweeps(experiment, runs / "test")
    study = STUDIES[spec.study](experiment) if spec.get("study") else StudyResult()
    test = aggregate(runs / "test")
    if study.columns is not None:
        test = test.merge(study.columns, on="run", how="left")
    shown = write_table(test, out_dir, "table")
    figures = _copy_figures(runs / "test", out_dir)
    sections = [f"## Toy world, test split (this run)\n\n{to_markdown(shown)}"]

    if spec.get("dev"):
        dev_world = merge_overrides(list(spec.dev), world)
        run_sweeps(experiment, runs / "dev", dev_world)
        dev = aggregate(runs / "dev")
        dev_shown = write_table(dev, out_dir, "table_dev")
        figures += _copy_figures(runs / "dev", out_dir, "_dev")
        text, chosen = select_on_dev(dev, test)
        section = "## Held-out choice (dev split -> test split)\n\n" + text
        if chosen is not None:
            section += "\n" + to_markdown(display_table(chosen))
        sections.append(section + f"\n\nDev split, every setting:\n\n{to_markdown(dev_shown)}")
    if spec.get("match"):
        match = OmegaConf.to_container(spec.match, resolve=True)
        by = match.get("by", "speedup")
        text, matched = matched_speed(test, match["reference"], match["candidates"], by)
        shown_matched = to_markdown(display_table(matched)) if matched is not None else ""
        sections.append(f"## Matched {by.replace('_', ' ')}\n\n" + text + shown_matched)
    sections += study.sections
    figures += study.figures
    if spec.get("notes"):
        sections.append(f"## Where and why this run differs from the paper\n\n{spec.notes}\n")

    paper = OmegaConf.to_container(spec.paper, resolve=True) if spec.get("paper") is not None else None
    summary = [
        f"# {spec.title}\n",
        f"Produced by `python scripts/reproduce.py {name}` (commands: command.txt; commit: git_commit.txt; "
        f"machine: machine.txt). Every number below except the paper's is computed from the run files under "
        f"runs/. A speedup is Σ AR LM time / Σ LM time over the utterances each job timed beside the AR target in "
        f"its own process, with a 95 % CI over utterances (the ratio estimator's, docs/algorithms.md §4.1): wall "
        f"clock on this machine, never a GPU "
        f"number.\n",
        f"## The paper\n\n{paper_table(paper)}",
        *sections,
        "## Files\n\n" + "\n".join(f"- {f}" for f in ["table.md", "table.csv", *figures]) + "\n",
    ]
    write_atomic(out_dir / "summary.md", "\n".join(summary))
    return out_dir
