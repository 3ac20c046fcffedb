"""The parallel block drafter (DFlash / DSpark style): a few decoder layers that fill a whole block of k draft
positions in ONE forward pass, conditioned on the target's hidden states.

Context: the target's features of every verified position (a low, a middle and a top layer, fused by a linear
layer and an RMSNorm) are written straight into each drafter layer's keys and values ("KV injection": the
layer's own input norm and key / value projections, RoPE at the position); the context never goes through the
layers. Block: [the token just emitted, MASK, ..., MASK] at the next k positions, attending to the whole context
and to each other (no causal mask inside the block); block position j gives the law of draft token j + 1
through the drafter's final norm and the target's speech head. One call per round whatever k; the block's own
keys are never cached, and after verification only the verified positions' features enter the context.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd.contracts import Draw, Features, TrainingOutputs
from ssd.drafters.base import Borrowed, load_trained, save_trained, scored, target_fingerprint, teacher_forced
from ssd.drafters.eagle import default_taps
from ssd.models.transformer import Backbone, Linear, RMSNorm, _rotate_half, sdpa


class BlockDrafter(nn.Module):
    """A parallel block drafter of a frozen target (`ssd.contracts.Drafter`)."""

    def __init__(self, target: Any, layers: int = 2, block: int = 4, feature_layers: list[int] | None = None,
                 checkpoint: str | Path | None = None, name: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.borrowed, self.name = Borrowed(target), name
        self.vocab_size = target.vocab_size
        features = (
            tuple(feature_layers) if feature_layers is not None else default_taps(self.borrowed.num_layers)
        )
        self.feature_layers = target.backbone.check_taps(features)
        self.taps = (
            0,
            *self.feature_layers,
        )  # 0: the input embeddings (the block's first token, in training)
        if layers < 1 or block < 1:
            raise ValueError(f"draft.layers={layers} and draft.block={block} must be >= 1")
        self.block = int(block)
        config = target.backbone.config
        hidden = config.hidden_size
        self.fuse = Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.fuse_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.mask = nn.Parameter(torch.zeros(hidden))
        self.backbone = Backbone(
            replace(config, num_layers=int(layers), vocab_size=0)
        )  # its layers + final norm
        self.backbone.reset_parameters(torch.Generator().manual_seed(0))
        self.to(device=target.device, dtype=target.dtype)
        self.backbone.init_rope(device=target.device)
        self.target_id = target_fingerprint(target)
        if checkpoint is not None:
            load_trained(checkpoint, self, "block", self.recipe, target)

    @property
    def recipe(self) -> dict:
        return {
            "layers": len(self.backbone.layers),
            "block": self.block,
            "feature_layers": list(self.feature_layers),
        }

    def module_groups(self) -> dict[str, nn.Module]:
        groups = {"fuse": self.fuse, "fuse_norm": self.fuse_norm, "norm": self.backbone.norm}
        groups.update({f"layers.{i}": layer for i, layer in enumerate(self.backbone.layers)})
        return groups

    def save(self, path: str | Path) -> Path:
        return save_trained(path, self, "block", self.recipe, self.target_id)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's features [..., n_feature_layers, H] -> the context states [..., H]."""
        return self.fuse_norm(self.fuse(taps.flatten(-2)))

    def context_keys(self, layer: int, context: torch.Tensor, positions: torch.Tensor):
        """A layer's keys and values [B, n_kv, m, D] of context states [B, m, H] at `positions` [B or 1, m]."""
        block = self.backbone.layers[layer]
        attn, (b, m, _) = block.self_attn, context.shape
        h = block.input_layernorm(context)
        k = attn.k_proj(h).view(b, m, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(b, m, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = self.backbone._rope(positions, context.dtype)
        return k * cos + _rotate_half(k) * sin, v

    def fill(self, first_embedding: torch.Tensor, k: int, start: torch.Tensor, keys, values, mask=None):
        """The block [first, MASK x (k-1)] of each row at positions start + 0..k-1, attending to its context keys
        (per layer [B, n_kv, C, D], `mask` [B, 1, ., C] over them, None: all) and to the whole block. Returns the
        final-normed states [B, k, H]."""
        b = first_embedding.shape[0]
        x = torch.cat([first_embedding[:, None], self.mask.expand(b, k - 1, -1)], 1)
        positions = start.reshape(-1, 1) + torch.arange(k, device=x.device)
        cos, sin = self.backbone._rope(positions, x.dtype)
        for i, layer in enumerate(self.backbone.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, k, attn.num_heads, attn.head_dim).transpose(1, 2)
            kb = attn.k_proj(h).view(b, k, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            vb = attn.v_proj(h).view(b, k, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
            q, kb = q * cos + _rotate_half(q) * sin, kb * cos + _rotate_half(kb) * sin
            full = None if mask is None else torch.cat([mask, mask.new_ones(*mask.shape[:-1], k)], -1)
            out = sdpa(q, torch.cat([keys[i], kb], 2), torch.cat([values[i], vb], 2), full)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, k, attn.num_heads * attn.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.backbone.norm(x)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.borrowed.target.speech_logits(normed).float()

    def start(self, prompt: Any, first: torch.Tensor, features: Features, room: int) -> BlockSession:
        return BlockSession(self, first, features, room)

    # --- training ------------------------------------------------------------------------------------
    def training_outputs(self, batch: dict, teacher: Any) -> TrainingOutputs:
        """Every anchor a (a position whose label is scored: its input is the block's first token) fills a block
        attending to the context before a; block position j is scored on the label at a + j (the target's logits
        there for KD)."""
        with torch.no_grad():
            teacher_logits, targets, features = teacher_forced(self.borrowed.target, batch, self.taps)
        mask, _, _ = scored(targets)
        steps = mask.long().cumsum(1) - 1
        out = []
        for row in range(targets.shape[0]):  # one row at a time: its anchors' blocks side by side
            anchors = mask[row].nonzero().squeeze(-1)
            length = int(anchors.max()) + 1
            context = self.context(features[row : row + 1, :length, 1:])  # [1, T, H]
            positions = torch.arange(length, device=context.device)[None]
            keys, values = zip(
                *(self.context_keys(i, context, positions) for i in range(len(self.backbone.layers)))
            )
            n = len(anchors)
            see = positions[0][None, :] < anchors[:, None]  # anchor a sees the context before a
            normed = self.fill(features[row, anchors, 0], self.block, anchors,
                               [k.expand(n, -1, -1, -1) for k in keys], [v.expand(n, -1, -1, -1) for v in values],
                               see[:, None, None, :])  # fmt: skip
            target_index = anchors[:, None] + torch.arange(self.block, device=anchors.device)  # [n, block]
            inside = target_index < length
            index = target_index.clamp(max=length - 1)
            valid = inside & mask[row, index]
            out.append((self.logits(normed[valid]), targets[row, index][valid],
                        teacher_logits[row, index][valid].float(), torch.full_like(index[valid], row),
                        steps[row, index][valid]))  # fmt: skip
        logits, labels, teacher_out, rows, label_steps = (torch.cat(parts) for parts in zip(*out))
        return TrainingOutputs(logits, labels, teacher_out, rows, label_steps)


class BlockSession:
    """One decode of a block drafter: each layer's injected context keys and values, and the pending token.
    With batch-invariant numerics (`use_batch_invariant`) every row is computed alone, as batch 1 computes it."""

    def __init__(self, drafter: BlockDrafter, first: torch.Tensor, features: Features, room: int) -> None:
        self.drafter, self.token = drafter, first
        b, config = first.shape[0], drafter.backbone.config
        shape = (b, config.num_kv_heads, features.hidden.shape[1] + room, config.head_dim)
        dtype = drafter.fuse.weight.dtype
        self.keys = [first.new_zeros(shape, dtype=dtype) for _ in drafter.backbone.layers]
        self.values = [first.new_zeros(shape, dtype=dtype) for _ in drafter.backbone.layers]
        self.lengths = [0] * b  # context positions per row (only verified ones ever enter: no rollback)
        self._inject(features.hidden, features.lengths.tolist())

    @property
    def per_row(self) -> bool:
        """Rows one at a time (batch 1 itself takes this path, so batch-invariant rows equal it bit for bit)."""
        return self.drafter.backbone.batch_invariant or len(self.lengths) == 1

    def _inject(self, hidden: torch.Tensor, counts: list[int]) -> None:
        """Write the context keys of target features [B, m, n_taps, H], the first counts[b] of row b, at each
        row's next positions."""
        rows = [[r] for r in range(len(counts))] if self.per_row else [list(range(len(counts)))]
        for group in rows:
            width = max(counts[r] for r in group)  # one row alone: exactly its own positions
            starts = torch.tensor([self.lengths[r] for r in group], device=hidden.device)
            positions = starts[:, None] + torch.arange(width, device=hidden.device)
            context = self.drafter.context(hidden[group, :width, 1:])
            index = torch.tensor(group, device=hidden.device)[:, None]
            for i in range(len(self.drafter.backbone.layers)):
                k, v = self.drafter.context_keys(i, context, positions)  # [g, n_kv, width, D]
                self.keys[i][index, :, positions] = k.transpose(1, 2)
                self.values[i][index, :, positions] = v.transpose(1, 2)
        self.lengths = [n + m for n, m in zip(self.lengths, counts)]

    def propose(self, k: int, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        drafter = self.drafter
        if k > drafter.block:
            raise ValueError(f"draft_len={k} but the block drafter fills blocks of {drafter.block}: set draft_len <= "
                             f"{drafter.block} or train it with a larger draft.block")  # fmt: skip
        embedding, device = drafter.borrowed.embed(self.token), self.token.device
        if self.per_row:  # each row over its own context: batch 1's computation
            normed = torch.cat([
                drafter.fill(embedding[r : r + 1], k, torch.tensor([n], device=device),
                             [t[r : r + 1, :, :n] for t in self.keys], [t[r : r + 1, :, :n] for t in self.values])
                for r, n in enumerate(self.lengths)
            ])  # fmt: skip
        else:
            span = max(self.lengths)
            starts = torch.tensor(self.lengths, device=device)
            see = (torch.arange(span, device=device) < starts[:, None])[:, None, None, :]
            normed = drafter.fill(embedding, k, starts, [t[:, :, :span] for t in self.keys],
                                  [t[:, :, :span] for t in self.values], see)  # fmt: skip
        logits = drafter.logits(normed)
        xs, ps = [], []
        for i in range(k):
            x, p = draw(logits[:, i], torch.stack(xs, 1) if xs else self.token[:, None][:, :0])
            xs.append(x)
            ps.append(p)
        return torch.stack(xs, 1), torch.stack(ps, 1)

    def accept(self, kept: list[int], token: torch.Tensor, features: Features) -> None:
        self._inject(features.hidden, [n + 1 for n in kept])  # the verified positions 0..n enter the context
        self.token = token
