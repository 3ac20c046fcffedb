"""The whole micro toy world, LM stages included, built through the real command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ssd.decoding.acceptance import ExactRule
from ssd.decoding.generate import Request, decode_ar, decode_speculative
from ssd.decoding.sampling import SamplingConfig
from ssd.drafters.layers import load_draft
from ssd.models.cosyvoice2 import CosyVoice2LM
from ssd.toy_world.stages import read_done

REPO = Path(__file__).resolve().parents[1]
STAGES = ("corpus", "codec", "tokens", "target", "draft", "summary")


def build(data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/build_toy_world.py", "toy_world=micro", f"paths.data_dir={data_dir}", "progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture(scope="module")
def full_micro_world(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    result = build(data_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return data_dir / "toy_micro", result.stdout


def test_every_stage_finishes_and_is_summarised(full_micro_world):
    root, stdout = full_micro_world
    for stage in STAGES:
        assert read_done(root / stage) is not None, stage
    summary = json.loads((root / "summary" / "summary.json").read_text())
    for key in (
        "wer_original_audio",
        "wer_resynthesis",
        "wer_generated_ar",
        "sim_generated_vs_prompt",
        "wer_generated_ar_dev",
        "sim_generated_vs_prompt_dev",
    ):
        assert summary[key] is not None and math.isfinite(summary[key]), key
    assert 0 <= summary["sim_generated_vs_prompt"] <= 1
    assert summary["target_tokens_per_s"] > 0
    assert "toy world" in stdout  # the summary table
    tokens = read_done(root / "tokens")["summary"]
    assert 0 < tokens["prompt_pairs"] < tokens["utterances"]  # same-speaker pairs in the zero-shot layout
    assert tokens["text_units"] == "phoneme"
    assert summary["n_dev_utts"] == 3  # the dev split too: unseen speakers, disjoint from test


def test_prompt_pairs_join_two_utterances_of_one_speaker(full_micro_world):
    import pyarrow.parquet as pq

    root, _ = full_micro_world
    pairs = pq.read_table(root / "tokens" / "shards" / "shard-pairs.parquet").to_pylist()
    singles = {
        r["utt"]: r for r in pq.read_table(root / "tokens" / "shards" / "shard-00000.parquet").to_pylist()
    }
    for pair in pairs:
        a, b = (singles[u] for u in pair["utt"].split("+"))
        assert a["speaker"] == b["speaker"] == pair["speaker"]
        assert pair["speech_tokens"] == a["speech_tokens"] + b["speech_tokens"]
        assert pair["text_tokens"] == a["text_tokens"] + b["text_tokens"]


def test_trained_target_and_draft_load_and_generate(full_micro_world):
    root, _ = full_micro_world
    target = CosyVoice2LM.from_dir(root / "target")
    draft = load_draft(root / "draft" / "draft.pt", target)
    prompt = target.make_prompt(["set blue at zero now"], ["lay red by one please"], [[1, 2, 3, 4, 5]])
    min_len, max_len = target.length_limits(prompt)
    sampling = SamplingConfig(
        top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10, stop_tokens=target.stop_tokens
    )
    g = torch.Generator().manual_seed(0)
    ar = decode_ar(target, Request(prompt, max_len, min_len, g), sampling)
    spec = decode_speculative(target, draft, Request(prompt, max_len, min_len, g), sampling, ExactRule(), 3)
    for result in (ar, spec):
        tokens = result.tokens[0]
        assert int(min_len[0]) <= len(tokens) <= int(max_len[0])
        assert all(0 <= t < target.speech_token_size for t in tokens)


def test_a_rebuild_skips_every_stage(full_micro_world):
    root, _ = full_micro_world
    result = build(root.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("up to date") == len(STAGES)
