"""The toy world: a synthetic LibriTTS-layout corpus, a toy codec, a toy target LM, a toy draft and a
quality summary, built idempotently by `build_toy_world` (scripts/build_toy_world.py).

Modules: `stages` (the engine: caching, hashing, DONE.json), `corpus` / `codec` (the flite+sox corpus,
the toy speech tokenizer and vocoder; the language itself is ssd.data.grid_language), `audio_stages`
(the corpus and codec stages) and `lm_stages` (tokens, target, draft, summary); `ensure_built` lets
the entry points build a missing world first. This package sits above ssd.data,
ssd.audio, ssd.models, ssd.training and ssd.evaluation; none of those imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ssd.toy_world.audio_stages import corpus_fingerprint, run_codec, run_corpus
from ssd.toy_world.lm_stages import (
    draft_fingerprint,
    run_draft,
    run_summary,
    run_target,
    run_tokens,
    target_fingerprint,
)
from ssd.toy_world.stages import Stage, StageResult, build_stages

# Names, versions and fingerprints are part of each stage's input hash: changing one rebuilds that stage
# and everything after it.
STAGES: list[Stage] = [
    Stage("corpus", run_corpus, version=2, fingerprint=corpus_fingerprint),
    Stage("codec", run_codec, version=2),
    Stage("tokens", run_tokens, version=1),
    Stage("target", run_target, version=1, fingerprint=target_fingerprint),
    Stage("draft", run_draft, version=1, fingerprint=draft_fingerprint),
    Stage("summary", run_summary, version=2),
]


def build_toy_world(
    world_cfg: Mapping,
    root: str | Path,
    progress: bool = True,
    console=None,
    stages: Sequence[Stage] | None = None,
) -> list[StageResult]:
    """Build the toy world (`stages`, default all of STAGES) into `root`, skipping up-to-date stages."""
    return build_stages(world_cfg, root, STAGES if stages is None else stages, progress, console)


# What a run reads from the toy world, when it uses it (sweep.py: target, eval; train_draft.py: data).
WORLD_READERS = ("target.model.model_dir", "eval.corpus_root", "data.shard_dirs", "draft.checkpoint")


def ensure_built(cfg, progress: bool = True) -> None:
    """Build `cfg.toy_world` first when the run reads a file of it that does not exist yet, saying so in one
    line (the entry points call this, so the first `python sweep.py ...` on a fresh clone just works). A
    world whose files exist is never rebuilt here: `make toy` rebuilds what a config change made stale."""
    from omegaconf import OmegaConf
    from rich.console import Console

    world = cfg.get("toy_world")
    if world is None:
        return
    root = Path(str(world.dir))
    reads = [Path(str(p)) for p in (OmegaConf.select(cfg, key, default=None) for key in WORLD_READERS) if p]
    if not any(path.is_relative_to(root) and not path.exists() for path in reads):
        return
    console = Console()
    console.print(
        f"[bold]The toy world '{world.name}' is not built yet in {root}: building it first "
        f"(about {world.get('build_minutes', '?')} min on a 2-core CPU, once; `make toy` does it on its own).[/]"
    )
    build_toy_world(world, root, progress=progress, console=console)


__all__ = ["STAGES", "build_toy_world", "ensure_built"]
