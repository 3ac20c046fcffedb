"""Everything a run loads once: the judges, the target and its sampling law, the codec, and the parts its
decoder needs (a drafter, an acceptance rule), bound into the decoder. Models are cached for the next job of a
sweep in the same process, keyed by their config node.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssd.evaluation.schema import plain
from ssd.evaluation.settings import RunSettings, instantiate_part

_LOADED: dict[str, tuple[str, Any]] = {}  # kind -> (config key, model): a sweep's jobs share models


def cached(kind: str, key_cfg: Any, build: Callable[[], Any]) -> Any:
    """The model of this kind loaded by an earlier job with the same config, else a fresh one (which
    replaces the old, so a sweep over models holds one of each kind in memory)."""
    key = json.dumps(plain(key_cfg), sort_keys=True, default=str)
    if kind not in _LOADED or _LOADED[kind][0] != key:
        _LOADED.pop(kind, None)
        _LOADED[kind] = (key, build())
    return _LOADED[kind][1]


@dataclass
class EvalModels:
    target: Any
    sampling: Any
    decoder: Any  # the run's decoder, bound to its parts (ssd.contracts.Decoder)
    speech_tokenizer: Any
    vocoder: Any
    asr: Any
    speaker: Any
    language: Any = None  # GridLanguage for the toy world, else None
    mos: Any = None  # the naturalness judge (ssd.contracts.MOSJudge), None for mos=none
    perturb: Any = None  # `perturb` node (e.g. GroupSwap): rewrites generated tokens before vocoding
    draft: Any = None  # the drafter, when the decoder needs one
    rule: Any = None  # the acceptance rule, when the decoder needs one
    baseline: Any = None  # the decoder this run is timed against, bound to the target (None for a baseline)


def load_language(settings: RunSettings) -> Any:
    """The toy language of eval.language=grid (its slots from the corpus' language.json), else None."""
    e = settings.eval
    if e.language is None:
        return None
    if e.language != "grid":
        raise ValueError(f"eval.language must be null or 'grid', got {e.language!r}")
    from ssd.data.grid_language import GridLanguage

    slots_file = Path(e.corpus_root) / "language.json"  # the toy world records its language
    slots = e.slots
    if slots is None and slots_file.is_file():
        slots = json.loads(slots_file.read_text())
    return GridLanguage(plain(slots))


def load_models(settings: RunSettings) -> EvalModels:
    """The acceptance rule first (cheap, and its parameters are the likeliest to be wrong), then the judges,
    then the LM side and the codec; every check before decoding. Each part is its config group's `_target_`."""
    from ssd.data.prepare import load_speech_tokenizer
    from ssd.evaluation.pairing import check_pairing

    parts, decoder = settings.parts, settings.decoder
    rule = instantiate_part(parts["acceptance"], "acceptance") if "acceptance" in decoder.needs else None
    language = load_language(settings)
    slots = list(language.slots.values()) if language else None
    asr = cached("asr", {"asr": parts["asr"], "slots": slots},
                 lambda: instantiate_part(parts["asr"], "asr", closed_vocabulary=slots))  # fmt: skip
    speaker = cached("sim", parts["sim"], lambda: instantiate_part(parts["sim"], "sim"))
    mos = cached("mos", parts["mos"], lambda: instantiate_part(parts["mos"], "mos")) if parts["mos"] else None
    target = cached(
        "target", parts["target.model"], lambda: instantiate_part(parts["target.model"], "target.model")
    )
    sampling = instantiate_part(
        parts["target.sampling"], "target.sampling", stop_tokens=list(target.stop_tokens)
    )
    tokenizer = cached(
        "tok", parts["speech_tokenizer"], lambda: load_speech_tokenizer(parts["speech_tokenizer"])
    )
    vocoder = cached("vocoder", parts["vocoder"], lambda: instantiate_part(parts["vocoder"], "vocoder"))
    check_pairing(settings.labels["target"], parts, tokenizer, target, vocoder)
    draft = None
    if "draft" in decoder.needs:
        draft = cached("draft", {"target": parts["target.model"], "draft": parts["draft"]},
                       lambda: instantiate_part(parts["draft"], "draft", target=target))  # fmt: skip
    bound = decoder.bind(
        target=target, **{k: v for k, v in (("draft", draft), ("acceptance", rule)) if v is not None}
    )
    perturb = instantiate_part(parts["perturb"], "perturb").bind(target) if parts["perturb"] else None
    baseline = decoder.baseline()
    if baseline is not None:
        baseline = instantiate_part(baseline, "the baseline decoder").bind(target=target)
    return EvalModels(target, sampling, bound, tokenizer, vocoder, asr, speaker, language, mos, perturb, draft,
                      getattr(bound, "rule", rule), baseline)  # fmt: skip
