"""The test list of a run and its items: zero-shot pairs from a LibriTTS-layout corpus, each with its prompt
prepared once (speech tokens, speaker embedding, the vocoder's conditioning) and its own random seed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ssd.evaluation.schema import EvalConfig


def utterance_seed(seed: int, utt: str) -> int:
    """The per-utterance RNG seed: a hash of (seed, utt id), so every setting draws the same stream."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{utt}".encode()).digest()[:8], "little") & (2**63 - 1)


def build_test_list(e: EvalConfig) -> pd.DataFrame:
    """Zero-shot pairs by the rule documented in `ssd.data.libritts` (settings from the eval config)."""
    from ssd.data.libritts import make_zero_shot_pairs, scan_libritts

    root = Path(str(e.corpus_root))
    if not root.is_dir():
        raise FileNotFoundError(
            f"eval.corpus_root={root} does not exist: point it at a LibriTTS-layout corpus "
            "(the toy world builds one: python scripts/build_toy_world.py)"
        )
    manifest = scan_libritts(root, list(e.subsets)).manifest
    return make_zero_shot_pairs(manifest, n_utts=int(e.n_utts), n_speakers=int(e.n_speakers),
                                prompt_sec=tuple(e.prompt_sec), target_sec=tuple(e.target_sec),
                                seed=int(e.pair_seed))  # fmt: skip


def check_texts(target: Any, pairs: pd.DataFrame) -> None:
    """Refuse test texts and prompt texts with words the target's text tokenizer does not know (a word-level
    tokenizer turns them into its unknown token, and the model would be asked to say nothing there)."""
    from ssd.models.text_tokenizer import unknown_words

    tokenizer = getattr(target, "tokenizer", None)
    texts = {utt: f"{t} {p}" for utt, t, p in zip(pairs["utt"], pairs["text"], pairs["prompt_text"])}
    unknown = unknown_words(tokenizer, texts.values()) if tokenizer is not None else []
    if unknown:
        utts = [u for u, text in texts.items() if set(unknown_words(tokenizer, [text]))]
        raise ValueError(
            f"the target's text tokenizer does not know the word(s) {unknown[:10]} of utterance(s) {utts[:5]}: "
            "they would reach the model as its unknown token. Evaluate texts in the target's vocabulary (the toy "
            "target knows only its language's words), or choose another target (target=...)"
        )


def wrong_sentence_texts(texts: list[str]) -> list[str | None]:
    """For item i, the next item's text that differs from text i (cyclic): the 'ignores its text' reference."""
    out = []
    for i, text in enumerate(texts):
        others = (texts[(i + j) % len(texts)] for j in range(1, len(texts)))
        out.append(next((other for other in others if other != text), None))
    return out


@dataclass
class Item:
    """One test item ready to decode: its pair, its place in the test list and everything it needs."""

    index: int
    pair: Any
    wrong_text: str | None
    vprompt: Any  # the VocoderPrompt, as the vocoder prepared it
    embedding: Any  # the prompt audio's speaker embedding (SIM reference)
    seed: int


def prepare_item(
    m: Any, seed: int, index: int, pair: Any, wrong_text: str | None, prompt_cache: dict
) -> Item:
    """The item of test-list entry `index`; its prompt audio is read, tokenised, embedded and prepared for the
    vocoder once per file (`prompt_cache`, shared by a sweep's jobs with the same codec and judges)."""
    from ssd.audio.features import load_audio
    from ssd.contracts import VocoderPrompt

    stat = Path(pair.prompt_wav).stat() if Path(pair.prompt_wav).is_file() else None
    key = (str(pair.prompt_wav), stat and (stat.st_mtime_ns, stat.st_size))
    if key not in prompt_cache:
        try:
            wav, sr = load_audio(pair.prompt_wav, None)
            if not np.abs(wav).max() > 0:
                raise ValueError("it is silent (every sample is 0)")
            tokens = np.asarray(m.speech_tokenizer.encode(wav, sr), dtype=np.int64)
            embedding = m.speaker.embed(wav, sr)
        except ValueError as err:
            raise ValueError(
                f"prompt audio {pair.prompt_wav} (utterance {pair.prompt_utt}) cannot be used: {err}. Replace or "
                "remove the file in eval.corpus_root; nothing of this run is lost, a rerun resumes"
            ) from err
        vprompt = VocoderPrompt(wav, sr, pair.prompt_text, tokens)
        prepare = getattr(m.vocoder, "prepare_prompt", None)  # optional in ssd.contracts.Vocoder
        prompt_cache[key] = (prepare(vprompt) if prepare else vprompt, embedding)
    vprompt, embedding = prompt_cache[key]
    return Item(index, pair, wrong_text, vprompt, embedding, utterance_seed(seed, pair.utt))
