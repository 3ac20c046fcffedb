"""Training data over the token shards of `ssd.data.prepare`: splits, dynamic batching, padding.

Batches are formed by a token budget, not a fixed size: a batch's cost is its padded size,
`len(batch) * max(text_len + speech_len)`, kept <= `max_tokens`. Utterances are grouped into
length buckets (quantiles of text + speech length) so a batch holds similar lengths; every epoch
each bucket is shuffled and packed, and the batches of all buckets are shuffled together, from a
generator seeded with (seed, epoch). Under DDP the batch list is dealt out round-robin to the
ranks; when it does not divide evenly the first batches are repeated so every rank takes the same
number of steps (as torch's DistributedSampler pads). Lightning must not inject its own sampler:
use `Trainer(use_distributed_sampler=False)`; the data module reads rank and world size from the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

SHARD_GLOB = "shard-*.parquet"


def _list_column(table: pa.Table, name: str) -> list[np.ndarray]:
    """A list<int> column as one int64 array per row (via offsets; no per-row Python objects)."""
    rows: list[np.ndarray] = []
    for chunk in table.column(name).chunks:
        offsets = chunk.offsets.to_numpy()
        values = chunk.values.to_numpy(zero_copy_only=False).astype(np.int64)
        rows.extend(values[offsets[i] : offsets[i + 1]] for i in range(len(chunk)))
    return rows


def _shard_dir_list(shard_dirs: str | Path | Sequence[str | Path]) -> list[Path]:
    return [Path(shard_dirs)] if isinstance(shard_dirs, str | Path) else [Path(d) for d in shard_dirs]


def check_text_tokenizer(shard_dirs: str | Path | Sequence[str | Path], tokenizer, n_rows: int = 16) -> None:
    """Refuse shards whose text ids are not the model's: training feeds them straight into its embedding, so
    shards of another text tokenizer (the toy shards under target=llasa) would train without any error.

    Checked on the first `n_rows` rows of the first shard of each dir that `ssd.data.prepare` wrote (a
    plan.json beside the shards; it records the tokenizer): each text, tokenized as prepare does, must give
    the row's text_tokens."""
    for d in _shard_dir_list(shard_dirs):
        plan, found = d / "plan.json", sorted(d.glob(SHARD_GLOB))
        if not plan.is_file() or not found:
            continue
        try:
            table = pq.read_table(found[0], columns=["utt", "text", "text_tokens"]).slice(0, n_rows)
        except (pa.ArrowException, OSError, KeyError):
            continue  # an unreadable shard: TokenShardDataset.from_shards names it and the fix
        for utt, text, ids in zip(*(table.column(c).to_pylist() for c in ("utt", "text", "text_tokens"))):
            if list(tokenizer(text, add_special_tokens=False).input_ids) != list(ids):
                prepared_with = json.loads(plan.read_text()).get("settings", {}).get("text_tokenizer", "?")
                raise ValueError(
                    f"{found[0]}: the text tokens of {utt} ({text!r}) are not what the target's text tokenizer "
                    f"gives: these shards were prepared with another text tokenizer ({prepared_with}). Prepare "
                    "shards for this target (scripts/prepare_libritts.py tokens --text-tokenizer <the target's "
                    "tokenizer dir>) and point data.shard_dirs at them (data=libritts reads "
                    "${paths.data_dir}/libritts_<target>)"
                )


class TokenShardDataset(Dataset):
    """Utterances held in memory: utt, speaker, subset, text_tokens, speech_tokens."""

    def __init__(
        self, utts: Sequence[str], speakers: Sequence[str], subsets: Sequence[str], text_tokens, speech_tokens
    ):
        self.utts, self.speakers, self.subsets = list(utts), list(speakers), list(subsets)
        self.text_tokens, self.speech_tokens = list(text_tokens), list(speech_tokens)

    @classmethod
    def from_shards(cls, shard_dirs: str | Path | Sequence[str | Path]) -> TokenShardDataset:
        dirs = _shard_dir_list(shard_dirs)
        files = []
        for d in dirs:
            found = sorted(d.glob(SHARD_GLOB))
            if not found:
                raise FileNotFoundError(
                    f"no {SHARD_GLOB} files in {d}: write them with scripts/prepare_libritts.py tokens"
                )
            files.extend(found)
        tables = []
        for f in files:
            try:
                table = pq.read_table(f)
            except (pa.ArrowException, OSError) as err:
                raise ValueError(
                    f"shard {f} is not a readable parquet file ({err}); delete it and rerun "
                    "scripts/prepare_libritts.py tokens (finished shards are kept, this one is rewritten)"
                ) from err
            missing = {"utt", "speaker", "subset", "text_tokens", "speech_tokens"} - set(table.column_names)
            if missing:
                raise ValueError(
                    f"shard {f} lacks column(s) {sorted(missing)}; rewrite it with ssd.data.prepare"
                )
            tables.append(table.select(["utt", "speaker", "subset", "text_tokens", "speech_tokens"]))
        table = pa.concat_tables(tables)
        dataset = cls(
            table.column("utt").to_pylist(),
            table.column("speaker").to_pylist(),
            table.column("subset").to_pylist(),
            _list_column(table, "text_tokens"),
            _list_column(table, "speech_tokens"),
        )
        if len(set(dataset.utts)) != len(dataset.utts):
            raise ValueError(f"utterance ids repeat across the shards in {[str(d) for d in dirs]}")
        return dataset

    def subset(self, indices: Sequence[int]) -> TokenShardDataset:
        return TokenShardDataset(
            [self.utts[i] for i in indices],
            [self.speakers[i] for i in indices],
            [self.subsets[i] for i in indices],
            [self.text_tokens[i] for i in indices],
            [self.speech_tokens[i] for i in indices],
        )

    def lengths(self) -> np.ndarray:
        """text + speech tokens per utterance: the batching cost."""
        return np.array(
            [len(t) + len(s) for t, s in zip(self.text_tokens, self.speech_tokens)], dtype=np.int64
        )

    def __len__(self) -> int:
        return len(self.utts)

    def __getitem__(self, index: int) -> dict:
        return {
            "utt": self.utts[index],
            "text_ids": self.text_tokens[index],
            "speech_tokens": self.speech_tokens[index],
        }


def pad_collate(items: Sequence[dict]) -> dict:
    """Right-pad with 0: {"utt": list, "text_ids" [B, Tt], "text_lens" [B], "speech_tokens" [B, Ts], "speech_lens" [B]}."""
    batch: dict = {"utt": [item["utt"] for item in items]}
    for key, lens_key in (("text_ids", "text_lens"), ("speech_tokens", "speech_lens")):
        seqs = [torch.as_tensor(item[key], dtype=torch.long) for item in items]
        batch[key] = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
        batch[lens_key] = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    return batch


class DynamicBatchSampler:
    """Length-bucketed batches under a padded-token budget; deterministic per (seed, epoch); DDP-aware.

    shuffle=False gives one fixed order (for dev): sorted by length, packed, not shuffled.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        num_buckets: int = 10,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.size and self.lengths.max() > max_tokens:
            longest = int(self.lengths.argmax())
            raise ValueError(
                f"utterance #{longest} has {self.lengths[longest]} text+speech tokens, more than max_tokens="
                f"{max_tokens}: raise max_tokens or filter long utterances out"
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for num_replicas={num_replicas}")
        self.max_tokens, self.num_buckets, self.shuffle = max_tokens, max(1, num_buckets), shuffle
        self.seed, self.num_replicas, self.rank, self.epoch = seed, num_replicas, rank, 0
        self._cached: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Called at every epoch start (by Lightning through `.sampler`); batches depend on (seed, epoch)."""
        self.epoch = epoch

    @property
    def sampler(self) -> DynamicBatchSampler:
        # Lightning calls set_epoch on `dataloader.batch_sampler.sampler`, not on the batch sampler itself.
        return self

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        batches, current, longest = [], [], 0
        for index in order:
            length = int(self.lengths[index])
            if current and max(longest, length) * (len(current) + 1) > self.max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(int(index))
            longest = max(longest, length)
        if current:
            batches.append(current)
        return batches

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over all ranks, before dealing out."""
        if not self.shuffle:
            return self._pack(np.argsort(self.lengths, kind="stable"))
        rng = np.random.default_rng([self.seed, self.epoch])
        by_length = np.argsort(self.lengths, kind="stable")
        batches = []
        for bucket in np.array_split(by_length, min(self.num_buckets, max(1, len(by_length)))):
            batches.extend(self._pack(rng.permutation(bucket)))
        return [batches[i] for i in rng.permutation(len(batches))]

    def _rank_batches(self) -> list[list[int]]:
        if self._cached is not None and self._cached[0] == self.epoch:  # len() and iter() share one packing
            return self._cached[1]
        batches = self.all_batches()
        if self.num_replicas > 1 and batches:
            padded = -(-len(batches) // self.num_replicas) * self.num_replicas
            batches = (batches * (padded // len(batches) + 1))[:padded]
            batches = batches[self.rank :: self.num_replicas]
        self._cached = (self.epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._rank_batches())

    def __len__(self) -> int:
        return len(self._rank_batches())


class TokenShardDataModule(L.LightningDataModule):
    """Train/dev DataLoaders over prepared token shards.

    Split: `dev_subsets` (e.g. ["dev-clean"]) puts those subsets in dev and the rest (or `train_subsets`)
    in train; without it, a `dev_fraction` of the SPEAKERS (chosen by `seed`) is held out as dev.
    """

    def __init__(
        self,
        shard_dirs: str | Path | Sequence[str | Path],
        max_tokens: int = 8000,
        dev_subsets: Sequence[str] | None = None,
        train_subsets: Sequence[str] | None = None,
        dev_fraction: float = 0.05,
        num_buckets: int = 10,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        if not 0.0 <= dev_fraction < 1.0:
            raise ValueError(f"dev_fraction must be in [0, 1), got {dev_fraction}")
        self.shard_dirs = shard_dirs
        self.max_tokens, self.dev_subsets, self.train_subsets = max_tokens, dev_subsets, train_subsets
        self.dev_fraction, self.num_buckets, self.seed, self.num_workers = (
            dev_fraction,
            num_buckets,
            seed,
            num_workers,
        )
        self.train_set: TokenShardDataset | None = None
        self.dev_set: TokenShardDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = TokenShardDataset.from_shards(self.shard_dirs)
        subsets = np.array(data.subsets)
        if self.dev_subsets is not None:
            available = sorted(set(data.subsets))
            wanted = list(self.dev_subsets) + list(self.train_subsets or [])
            missing = [s for s in wanted if s not in available]
            if missing:
                raise ValueError(
                    f"subset(s) {missing} not in the shards of {self.shard_dirs}; available: {available}"
                )
            is_dev = np.isin(subsets, list(self.dev_subsets))
            is_train = (
                ~is_dev
                if self.train_subsets is None
                else np.isin(subsets, list(self.train_subsets)) & ~is_dev
            )
        else:
            if self.train_subsets is not None:
                raise ValueError(
                    "train_subsets needs dev_subsets (or leave both unset for a by-speaker split)"
                )
            speakers = sorted(set(data.speakers))
            n_dev = int(round(self.dev_fraction * len(speakers)))
            n_dev = max(1, n_dev) if self.dev_fraction > 0 else 0
            if n_dev >= len(speakers):
                raise ValueError(
                    f"dev_fraction={self.dev_fraction} of {len(speakers)} speakers leaves no training speaker"
                )
            rng = np.random.default_rng(self.seed)
            dev_speakers = {speakers[i] for i in rng.permutation(len(speakers))[:n_dev]}
            is_dev = np.array([s in dev_speakers for s in data.speakers], dtype=bool)
            is_train = ~is_dev
        self.train_set = data.subset(np.flatnonzero(is_train))
        self.dev_set = data.subset(np.flatnonzero(is_dev))
        if len(self.train_set) == 0:
            raise ValueError(
                f"the training split of {self.shard_dirs} is empty (check dev_subsets / train_subsets)"
            )

    def _ddp(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def _loader(self, dataset: TokenShardDataset, shuffle: bool) -> DataLoader:
        world_size, rank = self._ddp()
        sampler = DynamicBatchSampler(
            dataset.lengths(), self.max_tokens, self.num_buckets, shuffle, self.seed, world_size, rank
        )
        return DataLoader(
            dataset, batch_sampler=sampler, collate_fn=pad_collate, num_workers=self.num_workers
        )

    def train_dataloader(self) -> DataLoader:
        self.setup()
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        return self._loader(self.dev_set, shuffle=False) if len(self.dev_set) else []
