"""The toy world's first two stages: the corpus (LibriTTS layout, ssd.toy_world.corpus) and the toy codec
fitted on its training split (ssd.toy_world.codec)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from ssd.data.grid_language import GridLanguage
from ssd.files import write_atomic
from ssd.toy_world.codec_fit import fit_codec
from ssd.toy_world.corpus import build_corpus, speaker_bank, subset_wavs
from ssd.toy_world.stages import StageContext


def corpus_language(corpus_cfg: Mapping) -> GridLanguage:
    """The language a corpus section names (`language:` slots, or null for the default)."""
    return GridLanguage(corpus_cfg.get("language") or None)


def corpus_fingerprint(corpus_cfg: Mapping) -> dict[str, tuple[str, ...]]:
    """The corpus stage's code input: the resolved word list (the default lives in code, not config)."""
    return corpus_language(corpus_cfg).slots


def run_corpus(ctx: StageContext) -> dict:
    cfg = ctx.config
    for key in ("speakers", "subsets"):
        if key not in cfg:
            raise KeyError(f"toy_world.corpus.{key} is missing (see configs/toy_world/default.yaml)")
    spk = cfg["speakers"]
    bank = speaker_bank(spk["voices"], spk.get("pitch_cents", [0]), spk.get("tempos", [1.0]))
    language = corpus_language(cfg)
    write_atomic(ctx.out_dir / "language.json", json.dumps(language.slots, indent=1))
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
    if "corpus" not in ctx.inputs:
        raise ValueError("toy_world: the codec stage needs the corpus stage before it")
    corpus_dir = ctx.inputs["corpus"]
    wavs = subset_wavs(corpus_dir, corpus_train_subset(ctx.world["corpus"]))
    codec = fit_codec(wavs, ctx.config, seed=int(ctx.world.get("seed", 0)), progress=ctx.progress)
    codec.save(ctx.out_dir)
    r = codec.fit_report
    return {
        "codebook_size": codec.codebook_size,
        "codebook_used": r["codebook_used"],
        "decoder_steps": r["decoder_steps"],
        "decoder_l1": r["decoder_final_l1"],
        "fit_s": r["fit_seconds"],
    }
