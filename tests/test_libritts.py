"""LibriTTS-layout scan and the zero-shot test list."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import soundfile as sf

from ssd.data.libritts import (
    MANIFEST_COLUMNS,
    PAIR_COLUMNS,
    load_table,
    make_zero_shot_pairs,
    save_table,
    scan_libritts,
)


def write_utterance(
    root: Path, subset: str, utt: str, text: str, seconds: float, sr: int = 16000, seed: int = 0
):
    """One LibriTTS-style utterance: a wav (tone + noise, PCM16) and its .normalized.txt."""
    speaker, chapter = utt.split("_")[:2]
    folder = root / subset / speaker / chapter
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * sr))) / sr
    wav = 0.3 * np.sin(2 * np.pi * (150 + 10 * seed) * t) + 0.02 * rng.standard_normal(t.size)
    sf.write(folder / f"{utt}.wav", wav.astype(np.float32), sr, subtype="PCM_16")
    (folder / f"{utt}.normalized.txt").write_text(text + "\n", encoding="utf-8")
    return folder / f"{utt}.wav"


def write_tiny_corpus(root: Path) -> Path:
    """train-clean: speakers 11, 12; test-clean: speakers 21, 22, 23 (3 utts each: 3 s, 5 s, 6 s)."""
    for speaker in ("11", "12"):
        for n, seconds in enumerate((1.5, 2.0)):
            write_utterance(
                root, "train-clean", f"{speaker}_100_{n:06d}_000000", f"train {speaker} {n}", seconds, seed=n
            )
    for speaker in ("21", "22", "23"):
        for n, seconds in enumerate((3.0, 5.0, 6.0)):
            write_utterance(
                root,
                "test-clean",
                f"{speaker}_200_{n:06d}_000001",
                f"test {speaker} words {n}",
                seconds,
                seed=n,
            )
    return root


@pytest.fixture
def corpus(tmp_path):
    return write_tiny_corpus(tmp_path / "LibriTTS")


def test_scan_builds_the_manifest(corpus):
    manifest = scan_libritts(corpus).manifest
    assert list(manifest.columns) == MANIFEST_COLUMNS and len(manifest) == 13
    row = manifest.set_index("utt").loc["22_200_000001_000001"]
    assert (row.speaker, row.chapter, row.subset, row.text) == ("22", "200", "test-clean", "test 22 words 1")
    assert row.duration == pytest.approx(5.0)
    assert Path(row.wav) == corpus / "test-clean/22/200/22_200_000001_000001.wav"
    assert list(manifest["subset"].unique()) == ["test-clean", "train-clean"]  # sorted by (subset, utt)
    only_train = scan_libritts(corpus, subsets=["train-clean"]).manifest
    assert set(only_train["speaker"]) == {"11", "12"}


def test_scan_layout_errors_name_what_to_fix(tmp_path, corpus):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        scan_libritts(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="subset.*dev-clean.*available"):
        scan_libritts(corpus, subsets=["dev-clean"])
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    with pytest.raises(
        FileNotFoundError, match=r"no wavs found.*expected \{subset\}/\{speaker\}/\{chapter\}"
    ):
        scan_libritts(empty)
    # Pointing at a subset instead of the corpus root: the error says so.
    with pytest.raises(FileNotFoundError, match="point root at the directory that holds the subset folders"):
        scan_libritts(corpus / "test-clean" / "21")


def test_missing_and_empty_transcripts_are_named(corpus):
    (corpus / "test-clean/21/200/21_200_000000_000001.normalized.txt").unlink()
    (corpus / "test-clean/22/200/22_200_000002_000001.normalized.txt").write_text("  \n")
    with pytest.raises(ValueError, match="2 problem") as err:
        scan_libritts(corpus)
    assert "21_200_000000_000001.wav: no transcript 21_200_000000_000001.normalized.txt" in str(err.value)
    assert "22_200_000002_000001.normalized.txt: transcript is empty" in str(err.value)


def test_misplaced_file_is_named(corpus):
    write_utterance(corpus, "test-clean", "21_200_000009_000001", "misplaced", 3.0)
    (corpus / "test-clean/21/200/21_200_000009_000001.wav").rename(
        corpus / "test-clean/21/200/99_200_000009.wav"
    )
    with pytest.raises(ValueError, match="99_200_000009.wav: name must be 21_200_"):
        scan_libritts(corpus)


def test_corrupt_audio_raises_or_is_skipped_and_listed(corpus):
    bad = corpus / "test-clean/23/200/23_200_000001_000001.wav"
    bad.write_bytes(b"RIFF\x00\x00garbage")
    with pytest.raises(ValueError, match="(?s)1 unreadable audio.*23_200_000001_000001.wav"):
        scan_libritts(corpus)
    result = scan_libritts(corpus, skip_corrupt=True)
    assert len(result.manifest) == 12 and "23_200_000001_000001" not in set(result.manifest["utt"])
    assert len(result.corrupt) == 1 and result.corrupt[0].startswith(str(bad))


def _pairs_corpus(root: Path) -> pd.DataFrame:
    """Header-only durations are what the scan reads, so a manifest of fake rows tests the selection."""
    rows = []
    for s in range(8):
        for n in range(6 + s):  # speakers have 6..13 utterances
            duration = 3.0 if n % 3 == 0 else 4.0 + n % 7  # prompts of 3 s, targets of 5..10 s
            rows.append((f"{s}_1_{n:06d}", str(s), "1", "test", f"text {s} {n}", f"/x/{s}_{n}.wav", duration))
    rows.append(("8_1_000000", "8", "1", "test", "lonely", "/x/8.wav", 5.0))  # no prompt: never eligible
    return pd.DataFrame(rows, columns=MANIFEST_COLUMNS)


def test_zero_shot_pairs_follow_the_rule(tmp_path):
    manifest = _pairs_corpus(tmp_path)
    pairs = make_zero_shot_pairs(
        manifest, n_utts=25, n_speakers=5, prompt_sec=(2.5, 3.5), target_sec=(4, 10), seed=1
    )
    assert list(pairs.columns) == PAIR_COLUMNS and len(pairs) == 25
    assert pairs["speaker"].nunique() == 5 and "8" not in set(pairs["speaker"])
    assert pairs["utt"].is_unique
    by_utt = manifest.set_index("utt")
    assert (by_utt.loc[pairs["utt"], "speaker"].to_numpy() == pairs["speaker"].to_numpy()).all()
    assert (by_utt.loc[pairs["prompt_utt"], "speaker"].to_numpy() == pairs["speaker"].to_numpy()).all()
    assert (pairs["prompt_utt"] != pairs["utt"]).all()
    assert pairs["duration"].between(4, 10).all() and pairs["prompt_duration"].between(2.5, 3.5).all()
    # Round-robin: a speaker gives fewer targets than the busiest one only once its supply is used up.
    counts = pairs["speaker"].value_counts()
    supply = manifest[manifest["duration"].between(4, 10)].groupby("speaker").size()
    for speaker, count in counts.items():
        assert count >= counts.max() - 1 or count == supply[speaker]
    assert (pairs["text"] == by_utt.loc[pairs["utt"], "text"].to_numpy()).all()


def test_zero_shot_pairs_are_deterministic_and_seed_dependent():
    manifest = _pairs_corpus(Path("."))
    kwargs = dict(n_utts=20, n_speakers=4, prompt_sec=(2.5, 3.5), target_sec=(4, 10))
    first = make_zero_shot_pairs(manifest, seed=7, **kwargs)
    shuffled = manifest.sample(frac=1.0, random_state=3)  # row order must not matter
    pd.testing.assert_frame_equal(first, make_zero_shot_pairs(shuffled, seed=7, **kwargs))
    other = make_zero_shot_pairs(manifest, seed=8, **kwargs)
    assert not first[["utt", "prompt_utt"]].equals(other[["utt", "prompt_utt"]])


def test_zero_shot_speakers_are_unseen_in_training(corpus, tmp_path):
    manifest = scan_libritts(corpus).manifest
    train = manifest[manifest["subset"] == "train-clean"]
    # Train speakers 11/12 have prompts (1.5-2 s) but no targets; let them have targets too, then exclude.
    write_utterance(corpus, "train-clean", "11_100_000009_000000", "long train", 5.0)
    manifest = scan_libritts(corpus).manifest
    pairs = make_zero_shot_pairs(
        manifest,
        n_utts=6,
        n_speakers=3,
        prompt_sec=(1.0, 3.5),
        target_sec=(4, 10),
        exclude_speakers=train["speaker"],
    )
    assert set(pairs["speaker"]) == {"21", "22", "23"} and len(pairs) == 6
    assert set(pairs["prompt_utt"]) <= {f"{s}_200_000000_000001" for s in ("21", "22", "23")}
    for suffix in (".jsonl", ".csv"):
        path = save_table(pairs, tmp_path / f"pairs{suffix}")
        pd.testing.assert_frame_equal(load_table(path), pairs)


def test_zero_shot_shortfalls_are_explained():
    manifest = _pairs_corpus(Path("."))
    with pytest.raises(ValueError, match="only 8 speaker"):
        make_zero_shot_pairs(manifest, n_utts=10, n_speakers=9, prompt_sec=(2.5, 3.5))
    with pytest.raises(ValueError, match="have only .* target utterance"):
        make_zero_shot_pairs(manifest, n_utts=500, n_speakers=2, prompt_sec=(2.5, 3.5))
    with pytest.raises(ValueError, match="lacks column"):
        make_zero_shot_pairs(manifest.drop(columns=["wav"]), n_utts=1, n_speakers=1)
    with pytest.raises(ValueError, match="unsupported table format"):
        save_table(manifest, "pairs.txt")
