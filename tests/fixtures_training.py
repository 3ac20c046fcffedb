"""A micro training world: a tiny random CosyVoice 2 target and learnable synthetic token shards.

The `training_world` fixture is registered for every test by tests/conftest.py (`pytest_plugins`):
take it by parameter name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures_models import TINY_SPEECH_TOKENS, make_tiny_cosyvoice2_dir


def write_micro_shards(out_dir: Path, n_utts: int = 64, seed: int = 0) -> Path:
    """Learnable synthetic shards in SHARD_SCHEMA (what ssd.data.prepare writes): each text token w
    is spoken as the run 3w, 3w+1, 3w+2; 8 speakers, two of them in dev-clean."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ssd.data.prepare import SHARD_SCHEMA

    rng = np.random.default_rng(seed)
    rows = []
    for n in range(n_utts):
        speaker = str(n % 8)
        words = rng.integers(0, 20, rng.integers(2, 6))
        speech = np.concatenate([[3 * w, 3 * w + 1, 3 * w + 2] for w in words]) % TINY_SPEECH_TOKENS
        rows.append(
            {"utt": f"{speaker}_1_{n:06d}", "speaker": speaker,
             "subset": "dev-clean" if speaker in ("6", "7") else "train-clean-100", "text": "x",
             "text_tokens": words.tolist(), "speech_tokens": speech.tolist(), "duration": 1.0}
        )  # fmt: skip
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(0, n_utts, 32):
        table = pa.Table.from_pylist(rows[i : i + 32], schema=SHARD_SCHEMA)
        pq.write_table(table, out_dir / f"shard-{i // 32:05d}.parquet")
    return out_dir


@pytest.fixture(scope="session")
def training_world(tmp_path_factory) -> dict[str, Path]:
    """{"target": a tiny CosyVoice 2 dir, "shards": a dir of micro shards}, built once per session."""
    root = tmp_path_factory.mktemp("micro_world")
    return {
        "target": make_tiny_cosyvoice2_dir(root / "target"),
        "shards": write_micro_shards(root / "shards"),
    }
