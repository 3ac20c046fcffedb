"""The DataModule over token shards: splits, dynamic batches, padding, determinism, DDP sharing."""

from __future__ import annotations

from collections import Counter

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ssd.data.prepare import SHARD_SCHEMA
from ssd.training.data import DynamicBatchSampler, TokenShardDataModule, TokenShardDataset, pad_collate

MAX_TOKENS = 300


def _write_shards(out_dir, n_utts=60, shard_size=25, seed=0):
    """Random utterances of 6 speakers (2 in dev-clean), text 1-12 tokens, speech 5-80 tokens."""
    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in range(n_utts):
        speaker = str(n % 6)
        rows.append(
            {
                "utt": f"{speaker}_1_{n:06d}",
                "speaker": speaker,
                "subset": "dev-clean" if speaker in ("4", "5") else "train-clean",
                "text": f"text {n}",
                "text_tokens": (rng.integers(1, 50, rng.integers(1, 13))).tolist(),
                "speech_tokens": (rng.integers(1, 100, rng.integers(5, 81))).tolist(),
                "duration": 1.0,
            }
        )
    for i in range(0, n_utts, shard_size):
        pq.write_table(
            pa.Table.from_pylist(rows[i : i + shard_size], schema=SHARD_SCHEMA),
            out_dir / f"shard-{i:05d}.parquet",
        )
    return {r["utt"]: r for r in rows}


@pytest.fixture
def shards(tmp_path):
    rows = _write_shards(tmp_path / "shards")
    return tmp_path / "shards", rows


def _epoch(sampler, epoch):
    sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


def test_every_utterance_once_per_epoch_within_the_budget(shards):
    shard_dir, rows = shards
    data = TokenShardDataset.from_shards(shard_dir)
    lengths = data.lengths()
    sampler = DynamicBatchSampler(lengths, MAX_TOKENS, num_buckets=4, seed=3)
    epochs = [_epoch(sampler, e) for e in range(3)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(data)))
        assert len(batches) == len(sampler)
        for b in batches:
            assert len(b) * lengths[b].max() <= MAX_TOKENS
        assert sum(len(b) > 1 for b in batches) > len(batches) // 2  # really dynamic, not size 1
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch


def test_batches_are_deterministic_per_seed_and_epoch(shards):
    lengths = TokenShardDataset.from_shards(shards[0]).lengths()
    a, b = DynamicBatchSampler(lengths, MAX_TOKENS, seed=1), DynamicBatchSampler(lengths, MAX_TOKENS, seed=1)
    assert _epoch(a, 5) == _epoch(b, 5)
    assert _epoch(a, 0) != _epoch(DynamicBatchSampler(lengths, MAX_TOKENS, seed=2), 0)
    fixed = DynamicBatchSampler(lengths, MAX_TOKENS, shuffle=False)
    assert _epoch(fixed, 0) == _epoch(fixed, 7)  # dev order never changes
    flat = [i for batch in _epoch(fixed, 0) for i in batch]
    assert list(lengths[flat]) == sorted(lengths)


def test_bucketing_groups_similar_lengths(shards):
    lengths = TokenShardDataset.from_shards(shards[0]).lengths()
    bucketed = _epoch(DynamicBatchSampler(lengths, 400, num_buckets=6), 0)
    unbucketed = _epoch(DynamicBatchSampler(lengths, 400, num_buckets=1), 0)

    def padding(batches):
        return sum(len(b) * lengths[b].max() - lengths[b].sum() for b in batches)

    assert padding(bucketed) < padding(unbucketed)


def test_ddp_ranks_split_the_batches(shards):
    lengths = TokenShardDataset.from_shards(shards[0]).lengths()
    full = _epoch(DynamicBatchSampler(lengths, MAX_TOKENS, seed=4), 2)
    for world in (2, 3):
        per_rank = [
            _epoch(DynamicBatchSampler(lengths, MAX_TOKENS, seed=4, num_replicas=world, rank=r), 2)
            for r in range(world)
        ]
        assert len({len(batches) for batches in per_rank}) == 1  # same number of steps on every rank
        dealt = [b for rank_batches in per_rank for b in rank_batches]
        assert {tuple(b) for b in dealt} == {tuple(b) for b in full}  # the same batches, dealt out
        assert len(dealt) == -(-len(full) // world) * world  # padded by repeating < world batches
        assert Counter(i for b in dealt for i in b).keys() == set(range(len(lengths)))
    one_batch = DynamicBatchSampler([3, 4], MAX_TOKENS, num_buckets=1, num_replicas=3, rank=2)
    assert [sorted(b) for b in one_batch] == [[0, 1]]  # fewer batches than ranks: every rank gets a step
    with pytest.raises(ValueError, match="rank 2 out of range"):
        DynamicBatchSampler(lengths, MAX_TOKENS, num_replicas=2, rank=2)


def test_collate_pads_with_zero_and_reports_lengths(shards):
    shard_dir, rows = shards
    data = TokenShardDataset.from_shards(shard_dir)
    batch = pad_collate([data[i] for i in (0, 7, 13)])
    assert batch["utt"] == [data.utts[i] for i in (0, 7, 13)]
    for key, lens_key, column in (
        ("text_ids", "text_lens", "text_tokens"),
        ("speech_tokens", "speech_lens", "speech_tokens"),
    ):
        tensor, lens = batch[key], batch[lens_key]
        assert tensor.dtype == lens.dtype == torch.long and tensor.shape == (3, int(lens.max()))
        for row, utt in enumerate(batch["utt"]):
            original = rows[utt][column]
            assert lens[row] == len(original)
            assert tensor[row, : len(original)].tolist() == original
            assert (tensor[row, len(original) :] == 0).all()


def test_split_by_subset_and_by_speaker(shards):
    shard_dir, rows = shards
    by_subset = TokenShardDataModule(shard_dir, MAX_TOKENS, dev_subsets=["dev-clean"])
    by_subset.setup()
    assert set(by_subset.dev_set.speakers) == {"4", "5"} and set(by_subset.train_set.speakers) == {
        "0",
        "1",
        "2",
        "3",
    }
    assert len(by_subset.train_set) + len(by_subset.dev_set) == len(rows)

    def dev_speakers(seed):
        module = TokenShardDataModule(shard_dir, MAX_TOKENS, dev_fraction=0.34, seed=seed)
        module.setup()
        assert not set(module.dev_set.speakers) & set(module.train_set.speakers)
        return set(module.dev_set.speakers)

    assert len(dev_speakers(0)) == 2 and dev_speakers(0) == dev_speakers(0)
    assert any(dev_speakers(s) != dev_speakers(0) for s in range(1, 6))

    with pytest.raises(ValueError, match=r"subset\(s\) \['test-clean'\] not in the shards"):
        TokenShardDataModule(shard_dir, dev_subsets=["test-clean"]).setup()
    with pytest.raises(ValueError, match="leaves no training speaker"):
        TokenShardDataModule(shard_dir, dev_fraction=0.99).setup()


def test_bad_inputs_are_named(shards, tmp_path):
    with pytest.raises(FileNotFoundError, match="no shard-\\*.parquet files in .*empty"):
        TokenShardDataset.from_shards(tmp_path / "empty")
    lengths = TokenShardDataset.from_shards(shards[0]).lengths()
    with pytest.raises(ValueError, match="more than max_tokens=50"):
        DynamicBatchSampler(lengths, 50)


class _Recorder(L.LightningModule):
    """Records the utterances of every training batch, per epoch."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: dict[int, list[str]] = {}

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch["utt"])
        return (self.weight * batch["speech_tokens"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_reshuffles_each_epoch_and_covers_the_train_split(shards):
    shard_dir, rows = shards
    module = TokenShardDataModule(shard_dir, MAX_TOKENS, dev_subsets=["dev-clean"], seed=0)
    recorder = _Recorder()
    trainer = L.Trainer(
        max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(recorder, datamodule=module)
    train_utts = sorted(u for u, r in rows.items() if r["subset"] == "train-clean")
    assert sorted(recorder.seen[0]) == sorted(recorder.seen[1]) == train_utts
    assert recorder.seen[0] != recorder.seen[1]
