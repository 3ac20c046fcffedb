"""LibriTTS-layout corpora: the manifest scan and the zero-shot test list.

Layout (real LibriTTS and the toy corpus alike)::

    {root}/{subset}/{speaker}/{chapter}/{speaker}_{chapter}_{...}.wav
    {root}/{subset}/{speaker}/{chapter}/{speaker}_{chapter}_{...}.normalized.txt

The utterance id is the wav's stem; its first two `_`-fields are the speaker and the chapter and must
match the directories. A manifest is a pandas DataFrame with the columns `MANIFEST_COLUMNS`, one row per
utterance, sorted by (subset, utt).

Zero-shot test list (`make_zero_shot_pairs`), the selection rule
-----------------------------------------------------------------
Every test item is a target utterance (its text is what the model must say) plus a prompt utterance of
the SAME speaker (a different utterance: its audio and text form the prompt). Deterministic in `seed`
and independent of the manifest's row order:

1. Speakers listed in `exclude_speakers` (e.g. the training manifest's speakers) are dropped.
2. Target candidates: utterances with `target_sec[0] <= duration <= target_sec[1]`.
   Prompt candidates: utterances with `prompt_sec[0] <= duration <= prompt_sec[1]`.
3. Eligible speakers have at least one target candidate and a prompt candidate other than it.
   Sorted by id, shuffled with `numpy.random.default_rng(seed)`; the first `n_speakers` are taken.
4. Each chosen speaker's target candidates (sorted by utt id) are shuffled with the same generator;
   targets are then taken round-robin, one per speaker per round (speakers in the shuffled order),
   until `n_utts` are chosen, so utterances spread as evenly over speakers as the data allows.
5. Each target gets a prompt drawn uniformly from its speaker's prompt candidates other than itself.
The paper's list (SSD, LibriTTS test-clean: 500 utterances, 37 speakers) is not public; `TEST_CLEAN`
holds the settings that mirror it. Record the written list with the results.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import soundfile as sf

MANIFEST_COLUMNS = ["utt", "speaker", "chapter", "subset", "text", "wav", "duration"]
PAIR_COLUMNS = [
    "utt", "speaker", "text", "wav", "duration",
    "prompt_utt", "prompt_text", "prompt_wav", "prompt_duration",
]  # fmt: skip
TRANSCRIPT_SUFFIX = ".normalized.txt"
LAYOUT = "{subset}/{speaker}/{chapter}/{speaker}_{chapter}_{...}.wav with a .normalized.txt beside each wav"

# Mirrors the SSD paper's LibriTTS test-clean setting (the exact list is not public; see module doc).
TEST_CLEAN = {"n_utts": 500, "n_speakers": 37, "prompt_sec": (2.0, 4.0), "target_sec": (4.0, 10.0), "seed": 0}

_COLUMN_DTYPES = {
    "utt": str,
    "speaker": str,
    "chapter": str,
    "subset": str,
    "text": str,
    "wav": str,
    "duration": float,
    "prompt_utt": str,
    "prompt_text": str,
    "prompt_wav": str,
    "prompt_duration": float,
    "prompt_audio": str,
}  # fmt: skip  (ids like "0019" must stay strings)
_MAX_LISTED = 20  # problem files named in one error message


@dataclass
class ScanResult:
    """A scanned corpus: the manifest plus the audio files skipped as unreadable ("path: reason")."""

    manifest: pd.DataFrame
    corrupt: list[str] = field(default_factory=list)


def speakable(text: str) -> bool:
    """Whether `text` has a word to say: a letter or a digit of any script (punctuation alone has none)."""
    return any(ch.isalnum() for ch in text)


def _listing(problems: list[str]) -> str:
    shown = "\n  ".join(problems[:_MAX_LISTED])
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return f"\n  {shown}{more}"


def _find_wavs(root: Path, subsets: Iterable[str] | None) -> list[Path]:
    available = sorted(p.name for p in root.iterdir() if p.is_dir())
    if subsets is None:
        subset_dirs = [root / name for name in available]
    else:
        subsets = list(subsets)
        missing = [s for s in subsets if s not in available]
        if missing:
            raise FileNotFoundError(f"subset(s) {missing} not found under {root}; available: {available}")
        subset_dirs = [root / s for s in subsets]
    wavs = sorted(wav for d in subset_dirs for wav in d.glob("*/*/*.wav"))
    if not wavs:
        elsewhere = sorted(root.rglob("*.wav"))[:3]
        hint = (
            f" Found wavs at another depth, e.g. {[str(p) for p in elsewhere]}: point root at the directory that "
            "holds the subset folders (e.g. .../LibriTTS, not .../LibriTTS/train-clean-100)."
            if elsewhere
            else ""
        )
        raise FileNotFoundError(
            f"no wavs found under {root} (subsets {subsets or available}); expected {LAYOUT}.{hint}"
        )
    return wavs


def scan_libritts(
    root: str | Path, subsets: Iterable[str] | None = None, *, skip_corrupt: bool = False
) -> ScanResult:
    """Scan a LibriTTS-layout tree into a manifest; durations come from soundfile headers (no audio read).

    Missing or empty transcripts, transcripts with no speakable word (punctuation only) and misplaced files
    raise one ValueError naming every offending file.
    Unreadable or empty audio raises too, unless `skip_corrupt`: then those files are left out and listed
    in `ScanResult.corrupt` (bulk preparation should not die on one bad file in 350k).
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"corpus root {root} does not exist or is not a directory (expected {LAYOUT})"
        )
    rows, layout_problems, corrupt = [], [], []
    for wav in _find_wavs(root, subsets):
        chapter_dir, speaker_dir, subset_dir = wav.parent, wav.parent.parent, wav.parent.parent.parent
        utt = wav.stem
        fields = utt.split("_")
        if len(fields) < 3 or fields[0] != speaker_dir.name or fields[1] != chapter_dir.name:
            layout_problems.append(
                f"{wav}: name must be {speaker_dir.name}_{chapter_dir.name}_..., as {LAYOUT}"
            )
            continue
        transcript = wav.with_name(utt + TRANSCRIPT_SUFFIX)
        if not transcript.is_file():
            layout_problems.append(f"{wav}: no transcript {transcript.name} beside it")
            continue
        text = transcript.read_text(encoding="utf-8").strip()
        if not text:
            layout_problems.append(f"{transcript}: transcript is empty")
            continue
        if not speakable(text):
            layout_problems.append(
                f"{transcript}: transcript {text[:40]!r} has no speakable word (no letter or digit)"
            )
            continue
        try:
            info = sf.info(str(wav))
            if info.frames <= 0 or info.samplerate <= 0:
                raise ValueError("no audio frames")
        except (sf.LibsndfileError, RuntimeError, ValueError) as err:
            corrupt.append(f"{wav}: {err}")
            continue
        rows.append(
            (utt, fields[0], fields[1], subset_dir.name, text, str(wav), info.frames / info.samplerate)
        )
    if layout_problems:
        raise ValueError(
            f"{len(layout_problems)} problem(s) in the corpus at {root}:{_listing(layout_problems)}"
        )
    if corrupt and not skip_corrupt:
        raise ValueError(
            f"{len(corrupt)} unreadable audio file(s) under {root} (use skip_corrupt=True to skip them):"
            f"{_listing(corrupt)}"
        )
    manifest = pd.DataFrame(rows, columns=MANIFEST_COLUMNS).sort_values(["subset", "utt"], ignore_index=True)
    if manifest["utt"].duplicated().any():
        dupes = manifest.loc[manifest["utt"].duplicated(keep=False), "wav"].tolist()
        raise ValueError(f"utterance ids occur more than once under {root}:{_listing(dupes)}")
    return ScanResult(manifest, corrupt)


def save_table(table: pd.DataFrame, path: str | Path) -> Path:
    """Write a manifest or pair list as JSONL (`.jsonl`) or CSV (`.csv`), atomically (`ssd.files.write_atomic`)."""
    from ssd.files import write_atomic

    path = Path(path)
    if path.suffix == ".jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in table.to_dict(orient="records"))
    elif path.suffix == ".csv":
        text = table.to_csv(index=False)
    else:
        raise ValueError(f"{path}: unsupported table format '{path.suffix}' (use .jsonl or .csv)")
    return write_atomic(path, text)


def load_table(path: str | Path) -> pd.DataFrame:
    """Read a table written by `save_table`; ids stay strings."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"table {path} not found")
    if path.suffix == ".jsonl":
        return pd.read_json(path, lines=True, dtype=_COLUMN_DTYPES)
    if path.suffix == ".csv":
        return pd.read_csv(path, dtype=_COLUMN_DTYPES)
    raise ValueError(f"{path}: unsupported table format '{path.suffix}' (use .jsonl or .csv)")


def make_zero_shot_pairs(
    manifest: pd.DataFrame,
    n_utts: int,
    n_speakers: int,
    prompt_sec: tuple[float, float] = (2.0, 4.0),
    target_sec: tuple[float, float] = (4.0, 10.0),
    seed: int = 0,
    exclude_speakers: Iterable[str] = (),
) -> pd.DataFrame:
    """Zero-shot test list: `n_utts` targets over `n_speakers` speakers, each with a same-speaker prompt.

    The selection rule is the module docstring's. Returns a DataFrame with `PAIR_COLUMNS`, sorted by
    (speaker, utt). Raises ValueError naming the shortfall when the corpus cannot supply the request.
    """
    missing = [c for c in ("utt", "speaker", "text", "wav", "duration") if c not in manifest.columns]
    if missing:
        raise ValueError(f"manifest lacks column(s) {missing}; build it with scan_libritts")
    for name, (lo, hi) in (("prompt_sec", prompt_sec), ("target_sec", target_sec)):
        if not 0 <= lo <= hi:
            raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
    if n_utts < 1 or n_speakers < 1:
        raise ValueError(f"n_utts and n_speakers must be >= 1, got {n_utts}, {n_speakers}")

    excluded = {str(s) for s in exclude_speakers}
    pool = manifest[~manifest["speaker"].astype(str).isin(excluded)].sort_values("utt", ignore_index=True)
    is_target = pool["duration"].between(*target_sec)
    is_prompt = pool["duration"].between(*prompt_sec)
    targets_by_speaker: dict[str, list[int]] = {}
    prompts_by_speaker: dict[str, list[int]] = {}
    for idx, speaker in enumerate(pool["speaker"].astype(str)):
        if is_target.iat[idx]:
            targets_by_speaker.setdefault(speaker, []).append(idx)
        if is_prompt.iat[idx]:
            prompts_by_speaker.setdefault(speaker, []).append(idx)

    def has_prompt_for(speaker: str, target: int) -> bool:
        return any(p != target for p in prompts_by_speaker.get(speaker, []))

    eligible = sorted(s for s, ts in targets_by_speaker.items() if any(has_prompt_for(s, t) for t in ts))
    if len(eligible) < n_speakers:
        raise ValueError(
            f"only {len(eligible)} speaker(s) have a target of {target_sec} s and a different prompt of "
            f"{prompt_sec} s (after excluding {len(excluded)} training speaker(s)); asked for n_speakers={n_speakers}"
        )
    rng = np.random.default_rng(seed)
    speakers = [eligible[i] for i in rng.permutation(len(eligible))[:n_speakers]]
    queues = {}
    for s in speakers:
        usable = [t for t in targets_by_speaker[s] if has_prompt_for(s, t)]
        queues[s] = [usable[i] for i in rng.permutation(len(usable))]
    available = sum(len(q) for q in queues.values())
    if available < n_utts:
        raise ValueError(
            f"the {n_speakers} chosen speakers have only {available} target utterance(s) of {target_sec} s "
            f"with a prompt; asked for n_utts={n_utts}"
        )
    chosen: list[tuple[str, int]] = []
    for round_idx in range(max(len(q) for q in queues.values())):
        for s in speakers:
            if len(chosen) < n_utts and round_idx < len(queues[s]):
                chosen.append((s, queues[s][round_idx]))

    rows = []
    for speaker, target in chosen:
        prompts = [p for p in prompts_by_speaker[speaker] if p != target]
        prompt = prompts[int(rng.integers(len(prompts)))]
        t, p = pool.iloc[target], pool.iloc[prompt]
        rows.append(
            (t["utt"], speaker, t["text"], t["wav"], float(t["duration"]),
             p["utt"], p["text"], p["wav"], float(p["duration"]))
        )  # fmt: skip
    return pd.DataFrame(rows, columns=PAIR_COLUMNS).sort_values(["speaker", "utt"], ignore_index=True)
