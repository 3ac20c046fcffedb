"""The toy world's LM stages: token shards, the toy target, the toy draft, and the quality summary.

They run after the corpus and codec stages (ssd.toy_world.audio_stages) and use the project's real code
paths only: shards come from `ssd.data.prepare.prepare_corpus` (the LibriTTS path), the toy target is
a CosyVoice 2-format model dir trained by `ssd.training.train.train` (the code that trains drafts),
the draft is trained by the same function, and the summary is measured by the eval runner and the
judges the sweeps use. Configs are composed by `ssd.config.compose` (train_draft.yaml, sweep.yaml),
so `target=toy`, `draft=toy`, `data=toy`, `eval=toy` mean the same thing here as on the command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from ssd.config import compose
from ssd.config_files import option_node
from ssd.files import write_atomic
from ssd.toy_world.audio_stages import corpus_language
from ssd.toy_world.codec import ToyCodec
from ssd.toy_world.corpus import flite_phones
from ssd.toy_world.stages import StageContext


def _overrides(section: dict) -> list[str]:
    """The stage section's `overrides:` list (extra key=value for the composed config)."""
    return [str(o) for o in section.get("overrides", [])]


def _target_config(section: dict):
    """The toy target's config: configs/target/toy.yaml + the stage section's overrides."""
    return compose("train_draft", ["target=toy", *_overrides(section)]).target


def target_fingerprint(section: dict) -> dict:
    """The target stage's extra input: its composed config, unresolved (a change to configs/target/toy.yaml
    rebuilds the target and everything after it)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(_target_config(section), resolve=False)


def draft_fingerprint(section: dict) -> dict:
    """The draft stage's extra input: configs/draft/toy.yaml as composed with the stage's overrides (a change
    to the draft's layers or trainable parts rebuilds the draft, whose checkpoint records that recipe)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(
        compose("train_draft", ["draft=toy", *_overrides(section)]).draft, resolve=False
    )


def run_tokens(ctx: StageContext) -> dict:
    """Token shards of the corpus (text: a word tokenizer of the toy language; speech: the toy codec)."""
    from ssd.data.prepare import prepare_corpus
    from ssd.models.text_tokenizer import write_word_tokenizer

    words = sorted({w for slot in corpus_language(ctx.world["corpus"]).slots.values() for w in slot})
    units = ctx.config.get("text_units", "word")
    if units not in ("word", "phoneme"):
        raise ValueError(f"toy_world.tokens.text_units: {units!r}; choose word or phoneme")
    lexicon = None
    if units == "phoneme":  # each word as the phones flite speaks for it (the corpus' first voice)
        voice = ctx.world["corpus"]["speakers"]["voices"][0]
        lexicon = {w: flite_phones(w, voice) for w in words}
    text_tokenizer = write_word_tokenizer(words, ctx.out_dir / "text_tokenizer", lexicon=lexicon)
    prepare_corpus(
        ctx.inputs["corpus"],
        ctx.out_dir / "shards",
        text_tokenizer=text_tokenizer,
        speech_tokenizer=option_node("speech_tokenizer", "toy", path=str(ctx.inputs["codec"])),
        num_workers=int(ctx.world.get("workers", 2)),
        progress=ctx.progress,
        log=None,
    )
    summary = json.loads((ctx.out_dir / "shards" / "summary.json").read_text())
    pairs = write_prompt_pairs(ctx.out_dir / "shards") if ctx.config.get("prompt_pairs", False) else 0
    return {"utterances": summary["n_kept"], "prompt_pairs": pairs, "speech_tokens": summary["speech_tokens"],
            "text_words": len(words), "text_units": units}  # fmt: skip


def write_prompt_pairs(shard_dir: Path) -> int:
    """Add same-speaker utterance pairs (text a + text b, speech a + speech b) as extra rows.

    Zero-shot inference feeds [prompt text + text, prompt speech] and continues; a tiny LM trained
    on single utterances only never saw that layout (measured on the toy world: generation WER
    100 % with a prompt vs 89 % without). Pairs put the inference layout in the training data.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ssd.data.prepare import SHARD_SCHEMA

    table = pa.concat_tables(pq.read_table(p) for p in sorted(shard_dir.glob("shard-*.parquet")))
    rows = sorted(table.to_pylist(), key=lambda r: (r["subset"], r["speaker"], r["utt"]))
    pairs = [
        {"utt": f"{a['utt']}+{b['utt']}", "speaker": a["speaker"], "subset": a["subset"],
         "text": f"{a['text']} {b['text']}", "text_tokens": a["text_tokens"] + b["text_tokens"],
         "speech_tokens": a["speech_tokens"] + b["speech_tokens"], "duration": a["duration"] + b["duration"]}
        for a, b in zip(rows, rows[1:]) if (a["subset"], a["speaker"]) == (b["subset"], b["speaker"])
    ]  # fmt: skip
    write_atomic(shard_dir / "shard-pairs.parquet",
                 lambda f: pq.write_table(pa.Table.from_pylist(pairs, schema=SHARD_SCHEMA), f))  # fmt: skip
    return len(pairs)


def _train(ctx: StageContext, overrides: list[str]) -> dict:
    from ssd.training.train import train

    cfg = compose(
        "train_draft",
        [
            f"output_dir={ctx.out_dir / 'run'}",
            f"data.shard_dirs={ctx.inputs['tokens'] / 'shards'}",
            f"seed={int(ctx.world.get('seed', 0))}",
            "logger=csv",
            *overrides,
            *_overrides(ctx.config),
        ],
    )
    return train(cfg)


def run_target(ctx: StageContext) -> dict:
    """Write a random-weight toy target in the CosyVoice 2 format, then train all of it."""
    from ssd.models.checkpoints import write_cosyvoice2_dir

    target_cfg = _target_config(ctx.config)
    codebook = ToyCodec.load(ctx.inputs["codec"]).codebook_size
    if codebook != int(target_cfg.speech_token_size):
        raise ValueError(
            f"toy codec has {codebook} tokens but configs/target/toy.yaml says speech_token_size="
            f"{target_cfg.speech_token_size}: make them equal (and its stop_tokens = that + 0, 1, 2)"
        )
    from omegaconf import OmegaConf

    init = write_cosyvoice2_dir(
        ctx.out_dir / "init",
        OmegaConf.to_container(target_cfg.architecture, resolve=True),
        codebook,
        ctx.inputs["tokens"] / "text_tokenizer",
        seed=int(ctx.world.get("seed", 0)),
    )
    metrics = _train(ctx, ["train_target=true", "kd_weight=0", f"target.model.model_dir={init}"])
    trained = ctx.out_dir / "run" / "target"
    for item in trained.iterdir():  # the stage dir itself is the model dir (configs/target/toy.yaml)
        shutil.move(str(item), ctx.out_dir / item.name)
    shutil.rmtree(ctx.out_dir / "init")
    return _scalars(metrics, ("dev/loss", "dev/acc", "before/dev/loss", "global_step"))


def run_draft(ctx: StageContext) -> dict:
    """Train the toy draft (configs/draft/toy.yaml) against the trained toy target."""
    metrics = _train(ctx, ["draft=toy", f"target.model.model_dir={ctx.inputs['target']}"])
    write_atomic(ctx.out_dir / "draft.pt", (ctx.out_dir / "run" / "draft.pt").read_bytes())
    return _scalars(
        metrics,
        (
            "dev/alpha_target_sampling",
            "before/dev/alpha_target_sampling",
            "dev/alpha_softmax",
            "dev/top1_agreement",
        ),
    )


def _scalars(metrics: dict, keys) -> dict:
    return {k.replace("/", "_"): round(float(metrics[k]), 4) for k in keys if metrics.get(k) is not None}


def naturalness_ordering(scores: dict[str, dict[str, dict]], n_resamples: int, seed: int) -> dict:
    """MOS of original audio, codec resynthesis and AR generations on the same utterances.

    `scores`: {kind: {utt: record fields}} for kinds original_audio, resynthesis, generated_ar. Returns,
    with bootstrap 95% CIs, each kind's mean of every MOS field (`nmos_<kind>`, `mos_sig_<kind>`, ...) and
    the paired NMOS differences along the expected order, original - resynthesis and resynthesis -
    generated (`nmos_<a>_minus_<b>`, over the utterances both have scored). `nmos_order_holds`: both
    differences >= 0; `nmos_order_resolved`: both CIs above 0 (the judge separates the three)."""
    from ssd.evaluation.metrics import bootstrap_ci, mean_of, mos_keys

    out: dict = {}
    for kind, by_utt in scores.items():
        records = list(by_utt.values())
        for key in mos_keys(records):
            out[f"{key}_{kind}"] = mean_of(records, key)
            out[f"{key}_{kind}_ci"] = list(
                bootstrap_ci(records, lambda rs, k=key: mean_of(rs, k), n_resamples, seed)
            )
        out[f"nmos_missing_{kind}"] = sum(r.get("nmos") is None for r in records)

    def mean_difference(pairs):
        return float(np.mean([a - b for a, b in pairs])) if pairs else float("nan")

    resolved = []
    for a, b in (("original_audio", "resynthesis"), ("resynthesis", "generated_ar")):
        pairs = [(scores[a][u]["nmos"], scores[b][u]["nmos"]) for u in scores[a]
                 if u in scores[b] and scores[a][u].get("nmos") is not None and scores[b][u].get("nmos") is not None]  # fmt: skip
        key = f"nmos_{a}_minus_{b}"
        out[key], out[f"{key}_ci"] = (
            mean_difference(pairs),
            list(bootstrap_ci(pairs, mean_difference, n_resamples, seed)),
        )
        out[f"{key}_pairs"] = len(pairs)
        resolved.append(out[f"{key}_ci"][0] > 0)
    out["nmos_order_holds"] = bool(
        out["nmos_original_audio_minus_resynthesis"] >= 0 and out["nmos_resynthesis_minus_generated_ar"] >= 0
    )
    out["nmos_order_resolved"] = all(resolved)
    return out


def run_summary(ctx: StageContext) -> dict:
    """Quality of the toy world, measured as the sweeps measure it, on the test split:
    judge floor (original audio), resynthesis ceiling (codec round trip), AR generations of the
    toy target (WER next to its wrong-sentence baseline, per-slot accuracy, SIM, tokens/s), draft α,
    and the MOS judge's naturalness of the three (`naturalness_ordering`)."""
    from ssd.data.libritts import save_table
    from ssd.evaluation.items import build_test_list, wrong_sentence_texts
    from ssd.evaluation.judging import mos_fields
    from ssd.evaluation.models import load_models
    from ssd.evaluation.run_dir import RESULTS_FILE, read_records
    from ssd.evaluation.runner import evaluate
    from ssd.evaluation.settings import RunSettings
    from ssd.evaluation.wer import summarize_wer, utterance_wer

    root = ctx.inputs["corpus"].parent
    overrides = [
        f"paths.data_dir={root.parent}",
        f"target.model.model_dir={ctx.inputs['target']}",
        f"draft.checkpoint={ctx.inputs['draft'] / 'draft.pt'}",
        f"eval.corpus_root={ctx.inputs['corpus']}",
        f"speech_tokenizer.path={ctx.inputs['codec']}",
        f"vocoder.codec_dir={ctx.inputs['codec']}",
        "decoding=ar",
        "logger=none",
        f"progress={str(ctx.progress).lower()}",
        *_overrides(ctx.config),
    ]
    cfg = compose("sweep", overrides)
    ar = evaluate(cfg, run_dir=ctx.out_dir / "ar")
    # The dev split (unseen speakers, disjoint from test): where the toy world's levers were chosen.
    # eval=toy_dev is a group choice, applied before the summary's values; its speakers are the world's.
    dev_cfg = compose(
        "sweep", [*overrides, "eval=toy_dev", f"eval.n_speakers={ctx.world['eval']['dev_speakers']}"]
    )
    dev = evaluate(dev_cfg, run_dir=ctx.out_dir / "ar_dev")

    # Floor and ceiling on the same test utterances, with the same judge and the same vocoder
    # conditioning (the pair's prompt utterance) as the generations get.
    from ssd.audio.features import load_audio
    from ssd.contracts import VocoderPrompt

    settings = RunSettings.from_config(cfg)
    pairs = build_test_list(settings.eval)
    models = load_models(settings)
    # Other judges (asr config names) score the same original and resynthesised audio, side by side.
    extra = {name: load_models(RunSettings.from_config(compose("sweep", [*overrides, f"asr={name}"]))).asr
             for name in ctx.config.get("extra_judges", [])}  # fmt: skip
    rows, floor, ceiling = [], [], []
    extra_scores = {name: {"original": [], "resynthesised": []} for name in extra}
    naturalness = {"original_audio": {}, "resynthesis": {}}  # utt -> the MOS judge's record fields
    for pair, wrong_text in zip(pairs.itertuples(index=False), wrong_sentence_texts(pairs["text"].tolist())):
        wav, sr = load_audio(pair.wav, None)
        prompt_wav, prompt_sr = load_audio(pair.prompt_wav, None)
        encode = models.speech_tokenizer.encode
        vprompt = VocoderPrompt(
            prompt_wav, prompt_sr, pair.prompt_text, np.asarray(encode(prompt_wav, prompt_sr))
        )
        resynth = models.vocoder.vocode(np.asarray(encode(wav, sr)), vprompt)
        hyp_orig = models.asr.transcribe(wav, sr)
        hyp_resynth = models.asr.transcribe(resynth, models.vocoder.sample_rate)
        floor.append(utterance_wer(pair.text, hyp_orig))
        ceiling.append(utterance_wer(pair.text, hyp_resynth))
        rows.append({"utt": pair.utt, "text": pair.text, "original": hyp_orig, "resynthesised": hyp_resynth,
                     "resynth_vs_wrong_text": utterance_wer(wrong_text, hyp_resynth).wer})  # fmt: skip
        for name, asr in extra.items():
            for kind, audio, rate in (
                ("original", wav, sr),
                ("resynthesised", resynth, models.vocoder.sample_rate),
            ):
                hyp = asr.transcribe(audio, rate)
                extra_scores[name][kind].append(utterance_wer(pair.text, hyp))
                rows[-1][f"{kind}_{name}"] = hyp
        if models.mos is not None:
            naturalness["original_audio"][pair.utt] = mos_fields(models.mos, wav, sr, pair.utt)
            naturalness["resynthesis"][pair.utt] = mos_fields(
                models.mos, resynth, models.vocoder.sample_rate, pair.utt
            )
    save_table(pd.DataFrame(rows), ctx.out_dir / "floor_ceiling.jsonl")
    draft_done = json.loads((ctx.inputs["draft"] / "DONE.json").read_text())["summary"]
    summary = {
        "n_test_utts": len(pairs),
        "wer_original_audio": summarize_wer(floor).corpus_wer,
        "wer_resynthesis": summarize_wer(ceiling).corpus_wer,
        "wer_resynthesis_vs_wrong_text": float(np.mean([r["resynth_vs_wrong_text"] for r in rows])),
        "wer_generated_ar": ar.get("wer"),
        "wer_generated_vs_wrong_text": ar.get("wer_wrong_sentence"),
        "slot_accuracy_generated": ar.get("slot_accuracy"),
        "sim_generated_vs_prompt": ar.get("sim"),
        "n_dev_utts": dev.get("num_utterances"),
        "wer_generated_ar_dev": dev.get("wer"),
        "wer_generated_vs_wrong_text_dev": dev.get("wer_wrong_sentence"),
        "slot_accuracy_generated_dev": dev.get("slot_accuracy"),
        "sim_generated_vs_prompt_dev": dev.get("sim"),
        "target_tokens_per_s": ar.get("tokens_per_sec"),
        "draft_alpha_dev": draft_done.get("dev_alpha_target_sampling"),
        "draft_alpha_dev_before_training": draft_done.get("before_dev_alpha_target_sampling"),
        **{
            f"wer_{kind}_{name}": summarize_wer(scores[kind]).corpus_wer
            for name, scores in extra_scores.items()
            for kind in ("original", "resynthesised")
        },  # fmt: skip
    }
    if models.mos is not None:
        naturalness["generated_ar"] = {r["utt"]: r for r in read_records(ctx.out_dir / "ar" / RESULTS_FILE)}
        summary.update(naturalness_ordering(naturalness, settings.eval.bootstrap_resamples, settings.seed),
                       mos_judge=cfg.mos._target_)  # fmt: skip
    write_atomic(ctx.out_dir / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary
