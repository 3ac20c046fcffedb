"""The idempotent toy-world builder: a chain of stages, each cached in its own directory.

Each stage writes into `{root}/{stage}/` and, last, a `DONE.json` holding the hash of its inputs: its
config section, the world seed, its code version and the hash of the stage before it (so a change
anywhere upstream reaches everything downstream). On a rerun:
- DONE.json present with the same hash -> skipped;
- no DONE.json (an interrupted build) or a different hash -> the directory is wiped and redone.
Stages: corpus, codec (here); tokens, target, draft, summary (ssd/data/toy_world_lm.py).
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

DONE_FILE = "DONE.json"


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


def build_toy_world(
    world_cfg: Mapping,
    root: str | Path,
    stages: Sequence[Stage] | None = None,
    progress: bool = True,
    console=None,
) -> list[StageResult]:
    """Run every stage in order into `root`, skipping those whose inputs are unchanged."""
    from rich.console import Console

    console = console or Console()
    world = _plain(world_cfg)
    if not isinstance(world, dict):
        raise TypeError(
            f"build_toy_world: the toy_world config must be a mapping, got {type(world).__name__}"
        )
    stages = list(STAGES if stages is None else stages)
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"build_toy_world: stage names repeat: {names}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
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
                why = "inputs changed" if done is not None else "no DONE.json (interrupted build)"
                console.print(f"[yellow]↻[/] {stage.name}: {why}, rebuilding from scratch")
                shutil.rmtree(out_dir)
            else:
                console.print(f"[cyan]→[/] {stage.name}: building into {out_dir}")
            out_dir.mkdir(parents=True)
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
            tmp = out_dir / (DONE_FILE + ".tmp")
            tmp.write_text(json.dumps(record, indent=1, default=str))
            tmp.replace(out_dir / DONE_FILE)
            results.append(StageResult(stage.name, "built", seconds, h, summary, out_dir))
        upstream_hash = h
        inputs[stage.name] = out_dir
    console.print(summary_table(results))
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


# ---- the first two stages ------------------------------------------------------------------------------


def _language(section: dict):
    from ssd.data.grid_language import GridLanguage

    return GridLanguage(section.get("language") or None)


def run_corpus(ctx: StageContext) -> dict:
    from ssd.data.toy_corpus import build_corpus, speaker_bank

    cfg = ctx.config
    for key in ("speakers", "subsets"):
        if key not in cfg:
            raise KeyError(f"toy_world.corpus.{key} is missing (see configs/toy_world/default.yaml)")
    spk = cfg["speakers"]
    bank = speaker_bank(spk["voices"], spk.get("pitch_cents", [0]), spk.get("tempos", [1.0]))
    language = _language(cfg)
    (ctx.out_dir / "language.json").write_text(json.dumps(language.slots, indent=1))
    summary = build_corpus(
        ctx.out_dir,
        language,
        cfg["subsets"],
        bank,
        seed=int(ctx.world.get("seed", 0)),
        sample_rate=int(cfg.get("sample_rate", 16000)),
        workers=int(ctx.world.get("workers", 2)),
        progress=ctx.progress,
    )
    summary.pop("per_subset")
    return {**summary, "speakers": sum(summary["speakers"].values())}


def corpus_train_subset(corpus_cfg: Mapping) -> str:
    """The subset the codec and the LMs are fitted on: the first subset named train*."""
    train = [s for s in corpus_cfg["subsets"] if str(s).startswith("train")]
    if not train:
        raise ValueError(f"toy_world.corpus.subsets has no train* subset: {list(corpus_cfg['subsets'])}")
    return train[0]


def run_codec(ctx: StageContext) -> dict:
    from ssd.audio.toy_codec import ToyCodec
    from ssd.data.toy_corpus import subset_wavs

    if "corpus" not in ctx.inputs:
        raise ValueError("toy_world: the codec stage needs the corpus stage before it")
    corpus_dir = ctx.inputs["corpus"]
    wavs = subset_wavs(corpus_dir, corpus_train_subset(ctx.world["corpus"]))
    codec = ToyCodec.fit(wavs, ctx.config, seed=int(ctx.world.get("seed", 0)), progress=ctx.progress)
    codec.save(ctx.out_dir)
    r = codec.fit_report
    return {
        "codebook_size": codec.codebook_size,
        "codebook_used": r["codebook_used"],
        "decoder_steps": r["decoder_steps"],
        "decoder_l1": r["decoder_final_l1"],
        "fit_s": r["fit_seconds"],
    }


def _lm_stage(name: str) -> Callable[[StageContext], dict]:
    """The LM stages live in ssd.data.toy_world_lm (they use training and evaluation code)."""

    def run(ctx: StageContext) -> dict:
        from ssd.data import toy_world_lm

        return getattr(toy_world_lm, f"run_{name}")(ctx)

    return run


def _composed_target(section: dict) -> dict:
    """The toy target's config (configs/target/toy.yaml + the stage's overrides) is an input too."""
    from omegaconf import OmegaConf

    from ssd.data.toy_world_lm import compose

    overrides = ["target=toy", *[str(o) for o in section.get("overrides", [])]]
    return OmegaConf.to_container(compose("train_draft", overrides).target, resolve=False)


STAGES: list[Stage] = [
    Stage("corpus", run_corpus, version=2, fingerprint=lambda section: _language(section).slots),
    Stage("codec", run_codec, version=2),
    Stage("tokens", _lm_stage("tokens"), version=1),
    Stage("target", _lm_stage("target"), version=1, fingerprint=_composed_target),
    Stage("draft", _lm_stage("draft"), version=1),
    Stage("summary", _lm_stage("summary"), version=1),
]
