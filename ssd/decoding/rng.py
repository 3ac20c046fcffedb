"""Per-row random streams: what row b draws depends only on its own seed and on how much it has drawn.

torch.Generator gives a batch ONE stream, so the numbers row b sees depend on the batch it sits in;
batched evaluation must reproduce batch 1 token for token. Here every row has a counter-based stream
(splitmix64 of seed + counter, written with int64 tensor ops because torch has no per-row generator):
no host sync, any device, and the same numbers for row b whatever batch it is decoded in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 that has its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MUL1
    z = (z ^ _shift_right(z, 27)) * _MUL2
    return z ^ _shift_right(z, 31)


class RowRandom:
    """One random stream per batch row, seeded by `seeds` (one int per row)."""

    def __init__(self, seeds: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> None:
        seeds = [int(s) for s in torch.as_tensor(seeds).reshape(-1).tolist()]
        self.seeds = tuple(seeds)
        self.keys = _mix(torch.tensor([_signed(s & _MASK64) for s in seeds], dtype=torch.long, device=device))
        self.row_ids = torch.arange(len(seeds), device=self.keys.device)  # rules index rows with it
        self.drawn = 0  # numbers drawn per row so far (host-side: advancing it needs no sync)
        self._block: _Block | None = None

    @classmethod
    def from_generator(cls, generator: torch.Generator | None, batch: int, device=None) -> RowRandom:
        """Row streams seeded from a torch.Generator (or torch's global RNG when None)."""
        # drawn on the generator's own device (a CUDA generator cannot drive a CPU draw)
        on = generator.device if generator is not None else "cpu"
        seeds = torch.randint(0, 2**62, (batch,), generator=generator, device=on)
        return cls(seeds, device)

    @classmethod
    def of(cls, source: RowRandom | torch.Generator | None, batch: int, device=None) -> RowRandom:
        """`source` as row streams for `batch` rows: a RowRandom as it is (its batch must match), a
        torch.Generator (or None: torch's global RNG) seeds fresh streams."""
        if not isinstance(source, RowRandom):
            return cls.from_generator(source, batch, device)
        if source.batch != batch:
            raise ValueError(
                f"the RowRandom has {source.batch} row streams but the batch has {batch} rows: give one seed per row"
            )
        if device is not None and source.keys.device.type != torch.device(device).type:
            raise ValueError(
                f"the RowRandom lives on {source.keys.device} but the decode runs on {device}: build it with "
                f"RowRandom(seeds, device={str(device)!r})"
            )
        return source

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    def rows(self, index: torch.Tensor | Sequence[int]) -> RowRandom:
        """The streams of a subset of rows, at the same position (a copy: drawing from it does not advance this one)."""
        sub = RowRandom.__new__(RowRandom)
        index = torch.as_tensor(index, dtype=torch.long, device=self.keys.device)
        sub.seeds = tuple(self.seeds[i] for i in index.tolist())
        sub.keys, sub.drawn, sub._block = self.keys[index], self.drawn, None
        sub.row_ids = torch.arange(len(index), device=sub.keys.device)
        return sub

    def bits(self, n: int) -> torch.Tensor:
        """[B, n] int64 of 64 random bits each; advances every row's stream by n."""
        return self._take(n, None)

    def uniform(self, n: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[B, n] uniform in [0, 1), with as many random bits as `dtype` holds (24 or 53)."""
        return self._take(n, dtype)

    def _take(self, n: int, dtype: torch.dtype | None) -> torch.Tensor:
        """The next n numbers of every row (bits, or uniforms of `dtype`), from a block mixed ahead of time.
        The stream is counter-based, so a block of BLOCK counters mixed at once holds exactly the numbers that
        one-at-a-time mixing gives; a decode draws a few numbers per step, and mixing them one call at a time
        cost ~20 small tensor ops each (what a CPU decode step is made of)."""
        block = self._block
        if block is None or not block.start <= self.drawn or self.drawn + n > block.start + block.size:
            block = self._block = _Block(self.keys, self.drawn, max(n, BLOCK))
        offset = self.drawn - block.start
        self.drawn += n
        return block.get(dtype)[:, offset : offset + n]


# Counters mixed at once per row stream: ~17 rounds of the rule that draws most (PCG: 2k + 3T + 2 per round).
BLOCK = 1024


class _Block:
    """Counters start + 1 .. start + size of every row, mixed at once; their uniforms converted per dtype on
    first use."""

    def __init__(self, keys: torch.Tensor, start: int, size: int) -> None:
        self.start, self.size = start, size
        counter = torch.arange(start + 1, start + size + 1, device=keys.device, dtype=torch.long)
        self.converted: dict[torch.dtype | None, torch.Tensor] = {
            None: _mix(keys[:, None] + counter * _GOLDEN)
        }

    def get(self, dtype: torch.dtype | None) -> torch.Tensor:
        if dtype not in self.converted:
            self.converted[dtype] = _uniform(self.converted[None], dtype)
        return self.converted[dtype]


def _uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mantissa = 53 if dtype == torch.float64 else 24
    return _shift_right(bits, 64 - mantissa).to(dtype) / float(1 << mantissa)
