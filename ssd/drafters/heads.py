"""Heads on the target's last hidden state: K of them, head i proposing the token i+1 positions ahead.

`kind="medusa"` (Medusa's residual heads): head i maps the target's final hidden state h of the last verified
position to h + SiLU(W_i h) and reads it with the target's own speech head. The heads do not see the token the
target just emitted; each guesses its position from h alone.
`kind="mtp"` (multi-token-prediction modules, as Llasa+ and DeepSeek's MTP chain them): module i takes module
i-1's state and the embedding of the token before its position (the emitted token for module 1, then the
drafted ones), fuses them (RMSNorm each, one linear layer) and adds an MLP; each module sees what was drafted.

One round costs k small per-row layers and no call of any layer stack: the drafter reads the target's last
layer output (tap -1), which the verification computes anyway. Trained with `train_draft.py draft=heads`
(configs/draft/heads*.yaml): the target frozen, its features computed in the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssd.contracts import Draw, Features, TrainingOutputs
from ssd.drafters.base import (
    Borrowed,
    at_positions,
    last_positions,
    load_trained,
    save_trained,
    scored,
    target_fingerprint,
    teacher_forced,
)
from ssd.models.transformer import Linear, RMSNorm

KINDS = ("medusa", "mtp")


class MedusaHead(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = Linear(hidden, hidden)
        nn.init.zeros_(self.proj.weight)  # starts as the target's own head: h + SiLU(0) = h
        nn.init.zeros_(self.proj.bias)

    def forward(self, h: torch.Tensor, token_embedding: torch.Tensor | None = None) -> torch.Tensor:
        return h + F.silu(self.proj(h))


class MTPModule(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm_state, self.norm_token = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.fuse = Linear(2 * hidden, hidden, bias=False)
        self.up, self.down = Linear(hidden, 2 * hidden, bias=False), Linear(2 * hidden, hidden, bias=False)
        nn.init.zeros_(self.down.weight)

    def forward(self, h: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        x = self.fuse(torch.cat([self.norm_state(h), self.norm_token(token_embedding)], -1))
        return x + self.down(F.silu(self.up(x)))


class HeadsDrafter(nn.Module):
    """Medusa heads or MTP modules on a frozen target (`ssd.contracts.Drafter`)."""

    def __init__(self, target: Any, heads: int = 3, kind: str = "medusa", checkpoint: str | Path | None = None,
                 name: str | None = None) -> None:  # fmt: skip
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"draft.kind={kind!r}: choose one of {list(KINDS)}")
        if heads < 1:
            raise ValueError(f"draft.heads={heads} must be >= 1")
        self.borrowed = Borrowed(target)
        self.kind, self.name = kind, name
        self.vocab_size = target.vocab_size
        self.taps = (self.borrowed.num_layers,)  # the last layer's output (the head's input before its norm)
        hidden, eps = self.borrowed.hidden_size, target.backbone.config.rms_norm_eps
        block = MedusaHead if kind == "medusa" else lambda h: MTPModule(h, eps)
        self.heads = nn.ModuleList(block(hidden) for _ in range(heads))
        self.to(device=target.device, dtype=target.dtype)
        self.target_id = target_fingerprint(target)
        if checkpoint is not None:
            load_trained(checkpoint, self, "heads", self.recipe, target)

    def module_groups(self) -> dict[str, nn.Module]:
        """The drafter's own parts, each trained (the target's head, norm and embedding are borrowed)."""
        return {f"heads.{i}": head for i, head in enumerate(self.heads)}

    @property
    def recipe(self) -> dict:
        return {"heads": len(self.heads), "kind": self.kind}

    def save(self, path: str | Path) -> Path:
        return save_trained(path, self, "heads", self.recipe, self.target_id)

    def start(self, prompt: Any, first: torch.Tensor, features: Features, room: int) -> HeadsSession:
        return HeadsSession(self, last_positions(features)[:, 0], first)

    def state(self, i: int, h: torch.Tensor, previous: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Head i's state: Medusa's from the target's h alone; an MTP module's from the previous module's state
        (h for the first) and the token before the position it predicts."""
        if self.kind == "medusa":
            return self.heads[i](h)
        return self.heads[i](previous, self.borrowed.embed(token))

    # --- training ------------------------------------------------------------------------------------
    def training_outputs(self, batch: dict, teacher: Any) -> TrainingOutputs:
        """Every position t with a label, for every head i whose position t+i has one too: head i's logits there
        and the target's own logits at t+i (KD). MTP's module i gets the true token at t+i (teacher forcing)."""
        with torch.no_grad():
            teacher_logits, targets, features = teacher_forced(self.borrowed.target, batch, self.taps)
        mask, _, _ = scored(targets)
        steps = mask.long().cumsum(1) - 1
        tokens = targets.clamp_min(0)  # the token at input t+1 is the label at t (ignored positions: any id)
        h = features[:, :, 0]
        state, out = h, []
        for i in range(len(self.heads)):
            shift = i + 1  # head i at position t predicts the label at t + i + 1
            valid = mask[:, :-shift] & mask[:, shift:]
            state = self.state(i, h, state, tokens.roll(-i, 1))  # module i sees the label at t + i
            logits = self.borrowed.logits(state[:, :-shift])
            out.append((logits[valid], targets[:, shift:][valid], teacher_logits[:, shift:][valid].float(),
                        valid.nonzero()[:, 0], steps[:, shift:][valid]))  # fmt: skip
        logits, labels, teacher_out, rows, label_steps = (torch.cat(parts) for parts in zip(*out))
        return TrainingOutputs(logits, labels, teacher_out, rows, label_steps)


class HeadsSession:
    """One decode of a heads drafter: the target's last verified hidden state and the token emitted after it."""

    def __init__(self, drafter: HeadsDrafter, h: torch.Tensor, token: torch.Tensor) -> None:
        self.drafter, self.h, self.token = drafter, h, token

    def propose(self, k: int, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        if k > len(self.drafter.heads):
            raise ValueError(f"draft_len={k} but the drafter has {len(self.drafter.heads)} heads: set draft_len <= "
                             f"{len(self.drafter.heads)} or train more heads (draft.heads=)")  # fmt: skip
        xs, ps, state, token = [], [], self.h, self.token
        for i in range(k):
            state = self.drafter.state(i, self.h, state, token)
            token, p = draw(
                self.drafter.borrowed.logits(state), torch.stack(xs, 1) if xs else self.token[:, None][:, :0]
            )
            xs.append(token)
            ps.append(p)
        return torch.stack(xs, 1), torch.stack(ps, 1)

    def accept(self, kept: list[int], token: torch.Tensor, features: Features) -> None:
        self.h, self.token = at_positions(features, kept)[:, 0], token
