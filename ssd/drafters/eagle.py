"""The feature drafter (EAGLE-3 style): one decoder layer that runs autoregressively over the target's hidden
states and the embedded tokens, reading the target's speech head.

At every position t of the context the drafter's input is fuse(the target's features at t, from a low, a middle
and a top layer) paired with the embedding of the token at t + 1 (one linear layer over the pair); its output
after its own final norm gives, through the target's head, the law of the token at t + 2. Drafting a round:
the first token from the last verified position, then k - 1 steps on its own output features (the target has
none yet for draft positions). After verification the speculative positions are dropped and the verified ones
enter with the target's true features, so the drafter's cache always mirrors the target's.

Training (`training_outputs`) unrolls the drafter on its own outputs for `train_steps` steps, as EAGLE-3's
"training-time test": step s at position t reads step s-1's output at t - 1, attends to the true context
before t - s + 1 and to its own chain, and predicts the same label as step 1 there; the loss covers every step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd.contracts import Draw, Features, TrainingOutputs
from ssd.drafters.base import (
    Borrowed,
    load_trained,
    save_trained,
    scored,
    target_fingerprint,
    teacher_forced,
)
from ssd.models.transformer import Backbone, Linear, sdpa


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and top features (after 1, L/2 and L layers), as EAGLE-3 fuses three levels."""
    return (min(1, num_layers), max(1, num_layers // 2), num_layers)


class FeatureDrafter(nn.Module):
    """EAGLE-style feature drafter of a frozen target (`ssd.contracts.Drafter`)."""

    def __init__(self, target: Any, feature_layers: list[int] | None = None, train_steps: int = 3,
                 checkpoint: str | Path | None = None, name: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.borrowed, self.name = Borrowed(target), name
        self.vocab_size = target.vocab_size
        layers = self.borrowed.num_layers
        features = tuple(feature_layers) if feature_layers is not None else default_taps(layers)
        self.feature_layers = target.backbone.check_taps(features)
        self.taps = (0, *self.feature_layers)  # 0: the input embeddings (each context position's own token)
        self.train_steps = int(train_steps)
        if self.train_steps < 1:
            raise ValueError(f"draft.train_steps={train_steps} must be >= 1")
        hidden = self.borrowed.hidden_size
        self.fuse = Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.pair = Linear(2 * hidden, hidden, bias=False)  # [feature ; embedding of the next token]
        self.backbone = Backbone(
            replace(target.backbone.config, num_layers=1, vocab_size=0)
        )  # a layer + final norm
        self.backbone.reset_parameters(torch.Generator().manual_seed(0))
        self.to(device=target.device, dtype=target.dtype)
        self.backbone.init_rope(device=target.device)
        self.target_id = target_fingerprint(target)
        if checkpoint is not None:
            load_trained(checkpoint, self, "eagle", self.recipe, target)

    @property
    def recipe(self) -> dict:
        return {"feature_layers": list(self.feature_layers), "train_steps": self.train_steps}

    def module_groups(self) -> dict[str, nn.Module]:
        return {"fuse": self.fuse, "pair": self.pair, "layer": self.backbone}

    def save(self, path: str | Path) -> Path:
        return save_trained(path, self, "eagle", self.recipe, self.target_id)

    def inputs(self, feature: torch.Tensor, next_token_embedding: torch.Tensor) -> torch.Tensor:
        return self.pair(torch.cat([feature, next_token_embedding], -1))

    def fused(self, taps: torch.Tensor) -> torch.Tensor:
        """[..., n_feature_layers, H] of the target -> the drafter's feature [..., H]."""
        return self.fuse(taps.flatten(-2))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.borrowed.target.speech_logits(normed).float()

    def start(self, prompt: Any, first: torch.Tensor, features: Features, room: int) -> FeatureSession:
        return FeatureSession(self, first, features, room)

    # --- training ------------------------------------------------------------------------------------
    def training_outputs(self, batch: dict, teacher: Any) -> TrainingOutputs:
        """Step s of the unrolled drafter at every position t whose next position has a label: its logits for
        that label, the target's own there (KD)."""
        with torch.no_grad():
            teacher_logits, targets, features = teacher_forced(self.borrowed.target, batch, self.taps)
        embeddings, fused = features[:, :, 0], self.fused(features[:, :, 1:])
        length = targets.shape[1]
        next_embedding = torch.cat([embeddings[:, 1:], embeddings[:, -1:]], 1)  # the token at t + 1
        mask, _, _ = scored(targets)
        steps = mask.long().cumsum(1) - 1
        positions = torch.arange(length, device=targets.device)
        lengths = torch.where(mask, positions + 1, 0).max(1).values  # a row's positions end at its EOS label
        chain_inputs, outputs, out = [], None, []
        for step in range(self.train_steps):
            previous = (
                fused if step == 0 else torch.cat([outputs[:, :1], outputs[:, :-1]], 1)
            )  # s-1's output at t-1
            chain_inputs.append(self.inputs(previous, next_embedding))
            hidden, normed = self._unrolled(torch.cat(chain_inputs, 1), lengths, step, length)
            outputs = hidden
            valid = mask[:, 1:] & (torch.arange(length - 1, device=targets.device) >= step)
            logits = self.logits(normed[:, :-1])
            out.append((logits[valid], targets[:, 1:][valid], teacher_logits[:, 1:][valid].float(),
                        valid.nonzero()[:, 0], steps[:, 1:][valid]))  # fmt: skip
        logits, labels, teacher_out, rows, label_steps = (torch.cat(parts) for parts in zip(*out))
        return TrainingOutputs(logits, labels, teacher_out, rows, label_steps)

    def _unrolled(self, x: torch.Tensor, lengths: torch.Tensor, step: int, length: int):
        """The layer over the chains 0..step laid end to end [B, (step+1)·T, H]: chain s at position t sees
        chain 0 up to t - s and chain s' at t - (s - s') for 0 < s' <= s. Returns chain `step`'s (pre-norm
        output, normed output) [B, T, H]."""
        device = x.device
        chains = step + 1
        position = torch.arange(length, device=device).repeat(chains)
        chain = torch.arange(chains, device=device).repeat_interleave(length)
        q_pos, k_pos = position[:, None], position[None, :]
        q_chain, k_chain = chain[:, None], chain[None, :]
        attend = ((k_chain == 0) & (k_pos <= q_pos - q_chain)) | ((k_chain > 0) & (k_chain <= q_chain)
                                                                  & (k_pos == q_pos - (q_chain - k_chain)))  # fmt: skip
        valid = k_pos < lengths[:, None, None].to(device)  # [B, 1, K]
        mask = (attend[None] & valid)[:, None]  # [B, 1, Q, K]
        mask = mask | torch.eye(mask.shape[-1], dtype=torch.bool, device=device)  # padded queries: themselves
        cos, sin = self.backbone._rope(position[None], x.dtype)
        hidden = self.backbone.layers[0](x, cos, sin, lambda q, k, v: sdpa(q, k, v, mask))
        hidden = hidden[:, step * length :]
        return hidden, self.backbone.norm(hidden)


class FeatureSession:
    """One decode of a feature drafter: its one-layer KV cache over (feature, next token) pairs."""

    def __init__(self, drafter: FeatureDrafter, first: torch.Tensor, features: Features, room: int) -> None:
        self.drafter = drafter
        self.cache = drafter.backbone.new_cache(first.shape[0], features.hidden.shape[1] + room, taps=(1,))
        first_embedding, lengths = drafter.borrowed.embed(first), features.lengths.tolist()
        # With batch-invariant numerics each row's pairs are computed at its own length, as batch 1 computes them.
        groups = (
            [[b] for b in range(len(lengths))]
            if drafter.backbone.batch_invariant
            else [list(range(len(lengths)))]
        )
        rows = []
        for group in groups:
            hidden = features.hidden[group, : max(lengths[b] for b in group)]
            nexts = torch.cat([hidden[:, 1:, 0], hidden[:, -1:, 0]], 1)
            nexts[torch.arange(len(group)), torch.tensor([lengths[b] for b in group]) - 1] = first_embedding[
                group
            ]
            rows.extend(
                drafter.inputs(drafter.fused(hidden[:, :, 1:]), nexts)
            )  # the last pair: the first token
        inputs = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        normed = drafter.backbone.forward_cached(inputs, self.cache, features.lengths)
        self.cache.mark_prompt()
        self._keep(normed, features.lengths - 1)

    def _keep(self, normed: torch.Tensor, index: torch.Tensor) -> None:
        """The drafter's output at each row's position `index`: its normed state (the law of the next draft token)
        and its own feature (what the next draft position reads)."""
        rows = torch.arange(normed.shape[0], device=normed.device)
        self.normed = normed[rows, index]
        self.feature = self.cache.features.hidden[rows, index, 0]

    def propose(self, k: int, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        drafter, xs, ps = self.drafter, [], []
        normed, feature = self.normed, self.feature
        for i in range(k):
            x, p = draw(
                drafter.logits(normed),
                torch.stack(xs, 1) if xs else normed.new_empty(normed.shape[0], 0).long(),
            )
            xs.append(x)
            ps.append(p)
            if i < k - 1:
                inputs = drafter.inputs(feature, drafter.borrowed.embed(x))[:, None]
                normed = drafter.backbone.forward_cached(inputs, self.cache)[:, 0]
                feature = self.cache.features.hidden[:, 0, 0]
        self.drafted, self.proposal = k - 1, torch.stack(xs, 1)
        return self.proposal, torch.stack(ps, 1)

    def accept(self, kept: list[int], token: torch.Tensor, features: Features) -> None:
        drafter = self.drafter
        self.cache.rollback(self.drafted)
        k = self.proposal.shape[1]
        n = torch.as_tensor(kept, device=token.device)
        rows = torch.arange(token.shape[0], device=token.device)
        nexts = torch.cat([self.proposal, token[:, None]], 1)
        nexts[rows, n] = token  # the token after verified position j: x_{j+1}, or the emitted one at j = n
        pairs = drafter.inputs(drafter.fused(features.hidden[:, :, 1:]), drafter.borrowed.embed(nexts))
        self._keep(drafter.backbone.forward_cached(pairs, self.cache), n)
        self.cache.rollback([k - m for m in kept])
