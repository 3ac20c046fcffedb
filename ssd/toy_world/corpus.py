"""Synthesise the toy corpus in the exact LibriTTS layout with Debian's flite voices and sox.

Layout (what `ssd.data.libritts` reads for the real corpus):
    {root}/{subset}/{speaker}/{chapter}/{speaker}_{chapter}_{n:06d}_{m:06d}.wav
    ... .normalized.txt and .original.txt beside each wav
A `.phones.txt` beside each wav holds flite's phone alignment ("phone end_seconds" per line, in the
final audio's time): the toy speech tokenizer is trained on it, as CosyVoice 2's tokenizer is trained
with ASR supervision. LibriTTS readers ignore the extra file.
Speakers are flite voices with sox pitch/tempo changes (pitch shifts move the formants too, which is
what makes the speaker model tell them apart). Speakers of each subset are disjoint, so dev and test
speakers are unseen in training.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from ssd.data.grid_language import GridLanguage
from ssd.files import write_atomic

FLITE_VOICES = ("kal", "kal16", "awb", "rms", "slt")


@dataclass(frozen=True)
class ToySpeaker:
    """How one toy speaker is made: a flite voice, then sox pitch (cents) and tempo (speed factor)."""

    speaker_id: int
    voice: str
    pitch_cents: int = 0
    tempo: float = 1.0

    def __post_init__(self) -> None:
        if self.voice not in FLITE_VOICES:
            raise ValueError(
                f"ToySpeaker {self.speaker_id}: voice {self.voice!r} is not one of {FLITE_VOICES}"
            )
        if not 0.5 <= self.tempo <= 2.0:
            raise ValueError(f"ToySpeaker {self.speaker_id}: tempo {self.tempo} outside [0.5, 2.0]")


@dataclass(frozen=True)
class Utterance:
    subset: str
    speaker: ToySpeaker
    chapter: int
    paragraph: int
    sentence: int
    text: str

    @property
    def utt_id(self) -> str:
        return f"{self.speaker.speaker_id}_{self.chapter}_{self.paragraph:06d}_{self.sentence:06d}"

    def wav_path(self, root: Path) -> Path:
        spk = str(self.speaker.speaker_id)
        return root / self.subset / spk / str(self.chapter) / f"{self.utt_id}.wav"


def speaker_bank(
    voices: Sequence[str], pitch_cents: Sequence[int], tempos: Sequence[float]
) -> list[ToySpeaker]:
    """Every (voice, pitch, tempo) combination, ids 100, 101, ... in that order."""
    combos = [(v, p, t) for p in pitch_cents for t in tempos for v in voices]
    return [ToySpeaker(100 + i, v, int(p), float(t)) for i, (v, p, t) in enumerate(combos)]


def assign_speakers(
    bank: Sequence[ToySpeaker], speakers_per_subset: Mapping[str, int], seed: int
) -> dict[str, list[ToySpeaker]]:
    """Disjoint speakers per subset, drawn by a seeded shuffle of the bank."""
    needed = sum(speakers_per_subset.values())
    if needed > len(bank):
        raise ValueError(
            f"toy corpus: subsets ask for {needed} speakers but the speaker bank has {len(bank)}; "
            "add voices/pitch_cents/tempos to `speakers` or lower `subsets.*.speakers`"
        )
    order = np.random.default_rng(seed).permutation(len(bank))
    out, start = {}, 0
    for subset, n in speakers_per_subset.items():
        out[subset] = sorted((bank[i] for i in order[start : start + n]), key=lambda s: s.speaker_id)
        start += n
    return out


def plan_corpus(
    language: GridLanguage,
    subsets: Mapping[str, Mapping[str, int]],
    bank: Sequence[ToySpeaker],
    seed: int,
    sentences_per_chapter: int = 50,
) -> list[Utterance]:
    """Every utterance of the corpus (text, speaker, file name); a pure function of its arguments."""
    for subset, spec in subsets.items():
        for key in ("speakers", "utterances_per_speaker"):
            if int(spec.get(key, 0)) < 1:
                raise ValueError(f"toy corpus: subsets.{subset}.{key} must be >= 1, got {spec.get(key)}")
    assigned = assign_speakers(bank, {s: int(spec["speakers"]) for s, spec in subsets.items()}, seed)
    total = sum(int(spec["speakers"]) * int(spec["utterances_per_speaker"]) for spec in subsets.values())
    sentences = iter(language.sample(total, seed))
    plan: list[Utterance] = []
    for subset, spec in subsets.items():
        for speaker in assigned[subset]:
            for k in range(int(spec["utterances_per_speaker"])):
                chapter = speaker.speaker_id * 100 + k // sentences_per_chapter
                plan.append(
                    Utterance(
                        subset,
                        speaker,
                        chapter,
                        k % sentences_per_chapter // 10,
                        k % 10,
                        next(sentences).text,
                    )
                )
    return plan


ALIGNMENT_SUFFIX = ".phones.txt"


def synthesize(
    text: str, speaker: ToySpeaker, sample_rate: int = 16000, rms_dbfs: float = -20.0
) -> tuple[np.ndarray, list[tuple[str, float]]]:
    """One utterance as float32 mono at `sample_rate`, loudness-normalised to `rms_dbfs`, and its phone
    alignment [(phone, end_seconds), ...] (flite's segments; sox's pitch keeps durations, tempo scales them).
    """
    _require("flite", "sox")
    with tempfile.TemporaryDirectory(prefix="toy_tts_") as tmp:
        raw, out = Path(tmp) / "flite.wav", Path(tmp) / "sox.wav"
        flite = subprocess.run(
            ["flite", "-voice", speaker.voice, "-psdur", "-t", text, "-o", str(raw)],
            check=True,
            capture_output=True,
            text=True,
        )
        alignment = [(phone, end / speaker.tempo) for phone, end in _segments(flite.stdout)]
        effects: list[str] = []
        if speaker.pitch_cents:
            effects += ["pitch", str(speaker.pitch_cents)]
        if speaker.tempo != 1.0:
            effects += ["tempo", "-s", str(speaker.tempo)]
        # -D: no dither, so the same text and speaker always give the same samples.
        cmd = [
            "sox",
            "-D",
            str(raw),
            "-r",
            str(sample_rate),
            "-c",
            "1",
            "-e",
            "floating-point",
            "-b",
            "32",
            str(out),
        ]
        subprocess.run([*cmd, *effects], check=True, capture_output=True)
        wav, sr = sf.read(out, dtype="float32")
    assert sr == sample_rate, (sr, sample_rate)
    rms = float(np.sqrt(np.mean(wav**2))) + 1e-9
    wav = wav * (10 ** (rms_dbfs / 20) / rms)
    return np.clip(wav, -0.99, 0.99).astype(np.float32), alignment


def _require(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool) is None:
            raise RuntimeError(f"toy corpus needs the `{tool}` binary: apt-get install -y flite sox")


def _segments(psdur: str) -> list[tuple[str, float]]:
    """flite -psdur output ("phone:end_seconds ...") as [(phone, end_seconds), ...]."""
    return [(phone, float(end)) for phone, end in (seg.rsplit(":", 1) for seg in psdur.split())]


def flite_phones(word: str, voice: str) -> list[str]:
    """The phones flite speaks for one word (its lexicon and letter-to-sound rules), pauses dropped."""
    _require("flite")
    out = subprocess.run(["flite", "-voice", voice, "-psdur", "-t", word, "-o", "none"], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return [phone for phone, _ in _segments(out) if phone != "pau"]


def write_alignment(path: Path, alignment: Sequence[tuple[str, float]]) -> None:
    write_atomic(path, "".join(f"{phone} {end:.3f}\n" for phone, end in alignment))


def read_alignment(path: str | Path) -> list[tuple[str, float]]:
    """[(phone, end_seconds), ...] from a `.phones.txt` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no phone alignment. The toy corpus stage writes one beside each wav; rebuild the "
            "corpus (make toy) or use codec.features=log_mel, which needs none"
        )
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    bad = [r for r in rows if len(r) != 2]
    if bad or not rows:
        raise ValueError(f"{path}: expected lines 'phone end_seconds', got {bad[:1] or 'an empty file'}")
    return [(phone, float(end)) for phone, end in rows]


def _write_utterance(args: tuple[Utterance, str, int]) -> float:
    utt, root, sample_rate = args
    path = utt.wav_path(Path(root))
    path.parent.mkdir(parents=True, exist_ok=True)
    wav, alignment = synthesize(utt.text, utt.speaker, sample_rate)
    write_atomic(path, lambda f: sf.write(f, wav, sample_rate, subtype="PCM_16", format="WAV"))
    write_alignment(path.with_suffix(ALIGNMENT_SUFFIX), alignment)
    write_atomic(path.with_suffix(".normalized.txt"), utt.text + "\n")
    write_atomic(path.with_suffix(".original.txt"), utt.text + "\n")
    return len(wav) / sample_rate


def build_corpus(
    root: str | Path,
    language: GridLanguage,
    subsets: Mapping[str, Mapping[str, int]],
    bank: Sequence[ToySpeaker],
    seed: int,
    sample_rate: int = 16000,
    workers: int = 2,
    progress: bool = True,
) -> dict:
    """Synthesise the whole corpus into `root` and write `speakers.json`; returns a summary dict."""
    from tqdm.auto import tqdm

    root = Path(root)
    plan = plan_corpus(language, subsets, bank, seed)
    jobs = [(utt, str(root), sample_rate) for utt in plan]
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            durations = list(
                tqdm(
                    pool.map(_write_utterance, jobs, chunksize=8),
                    total=len(jobs),
                    desc="corpus",
                    disable=not progress,
                )
            )
    else:
        durations = [_write_utterance(j) for j in tqdm(jobs, desc="corpus", disable=not progress)]
    speakers: dict[str, list[dict]] = {}
    for utt in plan:
        entry = asdict(utt.speaker)
        if entry not in speakers.setdefault(utt.subset, []):
            speakers[utt.subset].append(entry)
    write_atomic(root / "speakers.json", json.dumps(speakers, indent=1))
    per_subset = {s: sum(1 for u in plan if u.subset == s) for s in subsets}
    return {
        "utterances": len(plan),
        "hours": round(sum(durations) / 3600, 4),
        "mean_seconds": round(float(np.mean(durations)), 3) if durations else 0.0,
        "per_subset": per_subset,
        "speakers": {s: len(v) for s, v in speakers.items()},
    }


def subset_wavs(root: str | Path, subset: str) -> list[Path]:
    """The wav files of one subset, sorted (what the codec is fitted on)."""
    return sorted((Path(root) / subset).glob("*/*/*.wav"))
