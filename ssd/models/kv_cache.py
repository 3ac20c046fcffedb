"""The static KV cache of `ssd.models.transformer.Backbone`: preallocated buffers with per-row lengths
(gpt-fast style), so rollback is `lengths -= n` and rows of one batch sit at different lengths."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ssd.contracts import Features


@dataclass
class KVCache:
    """Static KV buffers for all layers and the per-row number of valid positions.

    `static` marks a cache made for the static decode path (`Backbone.static_step`): its capacity is
    fixed at creation and its steps and rollbacks never read a value back to the host. An eager cache
    slices its buffers by Python ints, so it keeps `lengths` as ints beside the tensor (`host_lengths`)
    while every update is one it can follow on the host (a block of k, a rollback by ints), and reads
    the device only after one it cannot.
    """

    # One tensor per layer, [B, n_kv_heads, capacity, head_dim]: per-layer tensors (not one stacked
    # buffer) let inductor write the static step's new entries in place instead of copying the layer.
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor  # LongTensor [B]: positions 0..lengths[b]-1 of row b are valid
    prompt_lengths: torch.Tensor  # LongTensor [B]: rollback never goes below these
    static: bool = False
    taps: tuple[int, ...] = ()  # hidden states each call keeps in `features` (ssd.contracts.SpeechLM)
    features: Features | None = None  # the taps' hidden states at the positions the latest call added
    generation: int = 0  # static caches: which prefill of the shared buffers this cache is
    # (lengths tensor, the same as ints): valid while `lengths` is still that very tensor, so code that
    # assigns `lengths` directly only costs the next read a sync, never a stale value.
    _host: tuple[torch.Tensor, list[int]] | None = field(default=None, repr=False)
    _host_prompt: list[int] | None = field(default=None, repr=False)

    def keep_features(self, hidden: torch.Tensor | None, counts: torch.Tensor | int) -> None:
        """The latest call's tapped hidden states [B, k, len(taps), H], valid up to `counts` per row."""
        if hidden is None:
            self.features = None
            return
        lengths = torch.as_tensor(counts, device=hidden.device).expand(hidden.shape[0])
        self.features = Features(hidden, lengths)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def _known_host_lengths(self) -> list[int] | None:
        return self._host[1] if self._host is not None and self._host[0] is self.lengths else None

    def host_lengths(self) -> list[int]:
        """`lengths` as Python ints: free while the host could follow every update, else one host sync."""
        known = self._known_host_lengths()
        if known is None:
            known = self.lengths.tolist()
            self._host = (self.lengths, known)
        return known

    def _set_lengths(self, lengths: torch.Tensor, host: list[int] | None) -> None:
        self.lengths = lengths
        self._host = None if host is None else (lengths, host)

    def mark_prompt(self) -> None:
        """The current lengths are the prompt: rollback never goes below them (read once, at prefill,
        on an eager cache; never on a static one)."""
        self.prompt_lengths = self.lengths.clone()
        self._host_prompt = None if self.static else list(self.host_lengths())

    def advance(self, n: torch.Tensor | int) -> None:
        """lengths += n (an int: the same block for every row, followed on the host; or a tensor [B])."""
        if isinstance(n, int):
            known = self._known_host_lengths()
            self._set_lengths(self.lengths + n, None if known is None else [h + n for h in known])
        else:
            self._set_lengths(self.lengths + n.to(self.lengths.device), None)

    def ensure_capacity(self, needed: int) -> None:
        """Grow the buffers (rare: only when a caller extends past what prefill reserved)."""
        if needed <= self.capacity:
            return
        if self.static:
            raise ValueError(
                f"a static KV cache cannot grow (capacity {self.capacity}, {needed} positions needed): "
                "reserve the room at prefill (max_new_tokens)"
            )
        new_capacity = max(needed, self.capacity + 64)
        for layers in (self.k, self.v):
            for i, old in enumerate(layers):
                shape = list(old.shape)
                shape[2] = new_capacity
                layers[i] = old.new_zeros(shape)
                layers[i][:, :, : old.shape[2]] = old

    def rollback(self, n: torch.Tensor | int | list[int]) -> None:
        """Forget the last n positions of each row (n: int, ints [B] or LongTensor [B]). Ints let an
        eager cache check and follow the rollback on the host; a static cache takes either without a sync."""
        known = self._known_host_lengths()
        host = None
        if known is not None and not isinstance(n, torch.Tensor):
            host = [h - m for h, m in zip(known, [n] * len(known) if isinstance(n, int) else n, strict=True)]
        if isinstance(n, list):
            n = torch.as_tensor(n, dtype=self.lengths.dtype, device=self.lengths.device)
        new_lengths = self.lengths - n
        if self.static:
            # No host sync: on CUDA a violation is a device-side assert that surfaces at the next sync.
            torch._assert_async(
                (new_lengths >= self.prompt_lengths).all(),
                "rollback would cut into the prompt (a row was rolled back past its prompt length)",
            )
        elif (
            any(h < p for h, p in zip(host, self._host_prompt))
            if host is not None and self._host_prompt is not None
            else bool((new_lengths < self.prompt_lengths).any())
        ):
            raise ValueError(
                f"rollback by {n.tolist() if isinstance(n, torch.Tensor) else n} would cut into the prompt "
                f"(lengths {self.lengths.tolist()}, prompt lengths {self.prompt_lengths.tolist()})"
            )
        self._set_lengths(new_lengths, host)
