"""The toy world's stage engine: a chain of stages, each cached in its own directory.

Each stage writes into `{root}/{stage}/` and, last, a `DONE.json` holding the hash of its inputs: its
config section, the world seed, its code version and the hash of the stage before it (so a change
anywhere upstream reaches everything downstream). On a rerun:
- DONE.json present with the same hash -> skipped;
- no DONE.json (an interrupted build) or a different hash -> the directory is wiped and redone.
The builder deletes only dirs it made (each is marked a toy-world stage, `ssd.files.mark_kind`, before
anything else is written) and refuses any other dir in a stage's place; one build at a time holds the root
(`.lock`, which marks it a toy world: no training or evaluation writes into it).
The engine knows no concrete stage: the toy world's stages are `ssd.toy_world.STAGES`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssd.files import RunDirLock, dir_kind, mark_kind, write_atomic

DONE_FILE = "DONE.json"
STAGE_KIND = "toy-world stage"  # marked before anything else: the builder only ever deletes dirs it made


@dataclass(frozen=True)
class StageContext:
    """What a stage's run function gets."""

    out_dir: Path  # fresh, empty: write everything here
    config: dict  # this stage's section of the toy_world config
    world: dict  # the whole toy_world config (seed, workers, other sections)
    inputs: dict[str, Path]  # directories of the stages before this one, by name
    progress: bool = True


@dataclass(frozen=True)
class Stage:
    """One build step. `run` returns a small JSON-able summary (shown in the final table)."""

    name: str
    run: Callable[[StageContext], dict]
    version: int = 1  # bump when the stage's code changes what it writes
    # Extra inputs that live in code rather than in the config (e.g. the resolved word list).
    fingerprint: Callable[[dict], Any] | None = None


@dataclass
class StageResult:
    name: str
    status: str  # "built" | "skipped"
    seconds: float
    input_hash: str
    summary: dict = field(default_factory=dict)
    out_dir: Path | None = None


def _plain(cfg: Any) -> Any:
    """A DictConfig (or anything mapping-like) as plain JSON-able python."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, DictConfig | ListConfig):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # omegaconf is a dependency; plain dicts work without it
        pass
    return cfg


def stage_hash(stage: Stage, section: dict, world: dict, upstream_hash: str) -> str:
    material = {
        "stage": stage.name,
        "version": stage.version,
        "seed": world.get("seed", 0),
        "config": section,
        "code": stage.fingerprint(section) if stage.fingerprint else None,
        "upstream": upstream_hash,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_done(stage_dir: Path) -> dict | None:
    """The DONE.json of a finished stage directory, or None (missing or unreadable: treat as unfinished)."""
    try:
        return json.loads((stage_dir / DONE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def build_stages(
    world_cfg: Mapping,
    root: str | Path,
    stages: Sequence[Stage],
    progress: bool = True,
    console=None,
) -> list[StageResult]:
    """Run `stages` in order into `root`, skipping those whose inputs are unchanged."""
    from rich.console import Console

    console = console or Console()
    world = _plain(world_cfg)
    if not isinstance(world, dict):
        raise TypeError(
            f"build_toy_world: the toy_world config must be a mapping, got {type(world).__name__}"
        )
    stages = list(stages)
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"build_toy_world: stage names repeat: {names}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with RunDirLock(root, "toy world", wait=True):  # parallel sweep jobs wait for one build
        results = _build(stages, world, root, progress, console)
    console.print(summary_table(results))
    return results


def _build(stages: Sequence[Stage], world: dict, root: Path, progress: bool, console) -> list[StageResult]:
    results: list[StageResult] = []
    upstream_hash, inputs = "", {}
    for stage in stages:
        section = world.get(stage.name) or {}
        if not isinstance(section, dict):
            raise TypeError(f"toy_world.{stage.name} must be a mapping, got {section!r}")
        h = stage_hash(stage, section, world, upstream_hash)
        out_dir = root / stage.name
        done = read_done(out_dir)
        if done is not None and done.get("input_hash") == h:
            console.print(f"[green]✓[/] {stage.name}: up to date ({out_dir})")
            results.append(StageResult(stage.name, "skipped", 0.0, h, done.get("summary", {}), out_dir))
        else:
            if out_dir.exists():
                if done is None and dir_kind(out_dir)[0] != STAGE_KIND:
                    raise FileExistsError(
                        f"{out_dir} exists but was not made by the toy-world builder (not marked a {STAGE_KIND}, "
                        f"no {DONE_FILE}); nothing was deleted. Move it away, or build the world elsewhere "
                        "(toy_world.dir=... or paths.data_dir=...)"
                    )
                why = "inputs changed" if done is not None else "no DONE.json (interrupted build)"
                console.print(f"[yellow]↻[/] {stage.name}: {why}, rebuilding from scratch")
                shutil.rmtree(out_dir)
            else:
                console.print(f"[cyan]→[/] {stage.name}: building into {out_dir}")
            out_dir.mkdir(parents=True)
            mark_kind(out_dir, STAGE_KIND)
            start = time.perf_counter()
            summary = stage.run(StageContext(out_dir, section, world, dict(inputs), progress)) or {}
            seconds = time.perf_counter() - start
            record = {
                "stage": stage.name,
                "input_hash": h,
                "upstream_hash": upstream_hash,
                "config": section,
                "summary": summary,
                "seconds": round(seconds, 2),
                "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            # Written last, atomically: its presence means the directory is complete.
            write_atomic(out_dir / DONE_FILE, json.dumps(record, indent=1, default=str))
            results.append(StageResult(stage.name, "built", seconds, h, summary, out_dir))
        upstream_hash = h
        inputs[stage.name] = out_dir
    return results


def summary_table(results: Sequence[StageResult]):
    from rich.table import Table

    table = Table(title="toy world")
    for col in ("stage", "status", "seconds", "summary"):
        table.add_column(col)
    for r in results:
        text = ", ".join(f"{k}={v}" for k, v in r.summary.items() if not isinstance(v, dict | list))
        table.add_row(r.name, r.status, f"{r.seconds:.1f}", text)
    return table
