"""Corpus -> token shards: filters, shard contents, resume, workers, the command line."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_cosyvoice_tokenizer import _write_model
from test_libritts import write_utterance

from ssd.config_files import option_node
from ssd.data.prepare import SHARD_COLUMNS, prepare_corpus
from ssd.models.text_tokenizer import write_word_tokenizer

REPO = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta long".split()


@pytest.fixture
def setup(tmp_path):
    """9 utterances, 3 of which the filters drop (too short, too long for the tokenizer, no known... text)."""
    corpus = tmp_path / "corpus"
    spec = [  # (speaker, seconds, text)
        ("1", 1.2, "alpha beta"),
        ("1", 2.0, "gamma"),
        ("1", 0.5, "alpha"),  # audio shorter than 1 s
        ("2", 1.5, "delta delta"),
        ("2", 31.0, "alpha"),  # longer than the CosyVoice tokenizer's 30 s
        ("2", 1.0, " ".join(["long"] * 12)),  # more than 10 text tokens (the test's max)
        ("3", 1.1, "beta"),
        ("3", 1.3, "gamma delta alpha"),
        ("3", 1.6, "beta beta"),
    ]
    for n, (speaker, seconds, text) in enumerate(spec):
        write_utterance(corpus, "train-clean", f"{speaker}_7_{n:06d}_000000", text, seconds, seed=n)
    model = _write_model(tmp_path / "speech_tokenizer_v2.onnx")
    tokenizer_dir = write_word_tokenizer(WORDS, tmp_path / "text_tok")
    kwargs = dict(
        text_tokenizer=tokenizer_dir,
        speech_tokenizer=option_node("speech_tokenizer", "cosyvoice2", path=str(model)),
        shard_size=2,
        num_workers=0,
        max_text_tokens=10,
        progress=False,
        log=None,
    )
    return corpus, tmp_path / "shards", kwargs


def _read_shards(out_dir):
    return {p.name: pq.read_table(p) for p in sorted(out_dir.glob("shard-*.parquet"))}


def test_shards_hold_the_filtered_tokenized_corpus(setup):
    corpus, out, kwargs = setup
    report = prepare_corpus(corpus, out, **kwargs)
    assert report.n_scanned == 9 and report.n_kept == 6
    assert report.dropped == {
        "audio shorter than 1 s": 1,
        "audio longer than the speech tokenizer's 30 s": 1,
        "more than 10 text tokens": 1,
    }
    shards = _read_shards(out)
    assert list(shards) == [f"shard-0000{i}.parquet" for i in range(3)]
    assert report.shards_written == 3 and report.shards_skipped == 0 and report.n_written_utts == 6
    rows = [r for t in shards.values() for r in t.to_pylist()]
    assert all(t.schema.names == SHARD_COLUMNS for t in shards.values())
    assert [r["utt"] for r in rows] == sorted(r["utt"] for r in rows)
    by_utt = {r["utt"]: r for r in rows}
    first = by_utt["1_7_000000_000000"]
    assert first["speaker"] == "1" and first["subset"] == "train-clean" and first["text"] == "alpha beta"
    assert first["text_tokens"] == [1, 2]  # word ids: [UNK]=0, alpha=1, beta=2
    assert first["duration"] == pytest.approx(1.2)
    for r in rows:  # 25 Hz: 4 mel frames (10 ms) per token
        assert len(r["speech_tokens"]) == int(round(r["duration"] * 100)) // 4
        assert all(0 <= t < 128 for t in r["speech_tokens"])
    assert report.speech_tokens == sum(len(r["speech_tokens"]) for r in rows)
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert len(manifest) == 9 and sum(m["drop_reason"] == "" for m in manifest) == 6
    assert json.loads((out / "summary.json").read_text())["n_kept"] == 6


def test_resume_skips_finished_shards_and_redoes_a_half_written_one(setup):
    corpus, out, kwargs = setup
    prepare_corpus(corpus, out, **kwargs)
    before = _read_shards(out)
    finished = out / "shard-00000.parquet"
    os.utime(finished, (1, 1))  # a marker: rewriting it would change the mtime
    interrupted = out / "shard-00001.parquet"
    killed = out / ".shard-00001.parquet.k1ll3d.tmp"  # the temp file of a write killed before its rename
    interrupted.rename(killed)
    with open(killed, "r+b") as f:
        f.truncate(100)
    report = prepare_corpus(corpus, out, **kwargs)
    assert report.shards_skipped == 2 and report.shards_written == 1 and report.n_written_utts == 6
    assert finished.stat().st_mtime == 1
    after = _read_shards(out)
    assert all(after[name].equals(before[name]) for name in before)
    # A complete rerun does nothing.
    assert prepare_corpus(corpus, out, **kwargs).shards_written == 0


def test_changed_settings_refuse_to_mix_into_old_shards(setup):
    corpus, out, kwargs = setup
    prepare_corpus(corpus, out, **kwargs)
    with pytest.raises(ValueError, match=r"settings \['filters'\] changed"):
        prepare_corpus(corpus, out, **{**kwargs, "max_text_tokens": 20})
    write_utterance(corpus, "train-clean", "4_7_000000_000000", "alpha", 1.5)
    with pytest.raises(ValueError, match="corpus contents"):
        prepare_corpus(corpus, out, **kwargs)


def test_unreadable_audio_is_counted_and_skipped(setup):
    corpus, out, kwargs = setup
    bad = corpus / "train-clean/3/7/3_7_000006_000000.wav"
    bad.write_bytes(b"RIFF\x00\x00 not audio")
    report = prepare_corpus(corpus, out, **kwargs)
    assert report.dropped["unreadable audio"] == 1 and report.n_kept == 5
    assert len(report.corrupt) == 1 and str(bad) in report.corrupt[0]
    assert sum(t.num_rows for t in _read_shards(out).values()) == 5


def test_bad_arguments_are_named(setup, tmp_path):
    corpus, out, kwargs = setup
    with pytest.raises(ValueError, match="unknown speech_tokenizer 'whisper': choose one of"):
        option_node("speech_tokenizer", "whisper", path="x")
    missing = option_node("speech_tokenizer", "cosyvoice2", path=str(tmp_path / "nope.onnx"))
    with pytest.raises(
        FileNotFoundError,
        match="CosyVoiceSpeechTokenizer.load not found at speech_tokenizer.path=.*nope.onnx",
    ):
        prepare_corpus(corpus, out, **{**kwargs, "speech_tokenizer": missing})
    with pytest.raises(FileNotFoundError, match="text tokenizer directory"):
        prepare_corpus(corpus, out, **{**kwargs, "text_tokenizer": tmp_path / "no_tok"})


def test_toy_codec_kind(setup, tmp_path):
    from ssd.toy_world.codec_fit import fit_codec

    corpus, out, kwargs = setup
    wavs = sorted(str(p) for p in corpus.rglob("*.wav"))[:4]
    with pytest.raises(FileNotFoundError, match="no phone alignment.*codec.features=log_mel"):
        fit_codec(wavs, {"codebook_size": 8}, seed=0, progress=False)
    cfg = {
        "features": "log_mel",  # this corpus has no flite alignments
        "codebook_size": 8,
        "pca_dim": 4,
        "decoder_max_steps": 2,
        "decoder_train_seconds": 1.0,
        "decoder_channels": 8,
    }
    fit_codec(wavs, cfg, seed=0, progress=False).save(tmp_path / "codec")
    report = prepare_corpus(
        corpus,
        out,
        **{
            **kwargs,
            "speech_tokenizer": option_node("speech_tokenizer", "toy", path=str(tmp_path / "codec")),
        },
    )
    # The toy codec has no 30 s limit: the 31 s utterance is kept.
    assert report.n_kept == 7 and "audio longer than the speech tokenizer's 30 s" not in report.dropped
    tokens = np.concatenate(
        [
            np.asarray(r, dtype=np.int64)
            for t in _read_shards(out).values()
            for r in t["speech_tokens"].to_pylist()
        ]
    )
    assert tokens.min() >= 0 and tokens.max() < 8


def test_command_line(setup, capsys):
    """The script writes the shards an in-process run writes; the zero-shot subcommand writes the list."""
    corpus, out, kwargs = setup
    script = REPO / "scripts" / "prepare_libritts.py"
    done = subprocess.run(
        [
            sys.executable, script, "tokens", str(corpus), str(out),
            "--text-tokenizer", str(kwargs["text_tokenizer"]),
            "--speech-tokenizer", "cosyvoice2", "--speech-tokenizer-path", kwargs["speech_tokenizer"]["path"],
            "--num-workers", "0", "--shard-size", "2", "--max-text-tokens", "10", "--no-progress",
        ],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "audio shorter than 1 s" in done.stdout and "kept" in done.stdout
    in_process = out.parent / "in_process"
    prepare_corpus(corpus, in_process, **kwargs)
    _assert_same_shards(out, in_process)

    main = runpy.run_path(str(script))["main"]  # the other subcommand, in process
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--speech-tokenizer" in capsys.readouterr().out
    pairs_path = out / "pairs.csv"
    main(
        [
            "zero-shot", str(corpus), str(pairs_path), "--subsets", "train-clean",
            "--n-utts", "2", "--n-speakers", "2", "--prompt-sec", "1.0", "1.25", "--target-sec", "1.4", "2.5",
        ]
    )  # fmt: skip
    assert "2 zero-shot pairs over 2 speakers" in capsys.readouterr().out
    assert len(pairs_path.read_text().splitlines()) == 3  # header + 2 pairs


def _assert_same_shards(dir_a, dir_b):
    a, b = _read_shards(dir_a), _read_shards(dir_b)
    assert len(a) == 3 and list(a) == list(b)
    assert all(a[name].equals(b[name]) for name in a)


@pytest.mark.slow  # spawning 2 workers that import torch + onnxruntime takes 10-30 s on 2 busy cores
def test_worker_processes_write_the_same_shards(setup):
    corpus, out, kwargs = setup
    prepare_corpus(corpus, out, **kwargs)
    parallel = out.parent / "parallel"
    report = prepare_corpus(corpus, parallel, **{**kwargs, "num_workers": 2})
    assert report.shards_written == 3
    _assert_same_shards(out, parallel)
