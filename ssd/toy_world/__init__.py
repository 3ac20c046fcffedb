"""The toy world: a synthetic LibriTTS-layout corpus, a toy codec, a toy target LM, a toy draft and a
quality summary, built idempotently by `build_toy_world` (scripts/build_toy_world.py).

Modules: `stages` (the engine: caching, hashing, DONE.json), `language` / `corpus` / `codec` (the toy
language, the flite+sox corpus, the toy speech tokenizer and vocoder), `audio_stages` (the corpus and
codec stages) and `lm_stages` (tokens, target, draft, summary). This package sits above ssd.data,
ssd.audio, ssd.models, ssd.training and ssd.evaluation; none of those imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from ssd.toy_world.audio_stages import corpus_fingerprint, run_codec, run_corpus
from ssd.toy_world.lm_stages import run_draft, run_summary, run_target, run_tokens, target_fingerprint
from ssd.toy_world.stages import Stage, StageResult, build_stages

# Names, versions and fingerprints are part of each stage's input hash: changing one rebuilds that stage
# and everything after it.
STAGES: list[Stage] = [
    Stage("corpus", run_corpus, version=2, fingerprint=corpus_fingerprint),
    Stage("codec", run_codec, version=2),
    Stage("tokens", run_tokens, version=1),
    Stage("target", run_target, version=1, fingerprint=target_fingerprint),
    Stage("draft", run_draft, version=1),
    Stage("summary", run_summary, version=1),
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


__all__ = ["STAGES", "build_toy_world"]
