"""A SpeechLM run token by token as the drafter: k model calls per round, its own KV cache rolled back after
each verification.

Bookkeeping: the drafter's cache holds every emitted token but the last two, which wait in `pending` ([B, 2];
[B, 1] in round 1). A round feeds `pending` and then x_1..x_{k-1}; after the rule kept n, the cache rolls back
k - n, which leaves it just before the last kept token (x_n, or the last pending token when n = 0), and
`pending` becomes [that token, the emitted token]. One rollback by host ints per round, whatever n.
"""

from __future__ import annotations

from typing import Any

import torch

from ssd.contracts import Draw, SpeechLM


class AutoregressiveDrafter:
    """`model` (any SpeechLM: a layer subset of the target, a smaller LM) as a drafter."""

    taps: tuple[int, ...] = ()

    def __init__(self, model: SpeechLM) -> None:
        self.model = model
        self.vocab_size = model.vocab_size

    def start(self, prompt: Any, first: torch.Tensor, features: Any, room: int) -> AutoregressiveSession:
        return AutoregressiveSession(self.model, prompt, first, room)


class AutoregressiveSession:
    """One decode of an autoregressive drafter (`ssd.contracts.DraftSession`)."""

    def __init__(self, model: SpeechLM, prompt: Any, first: torch.Tensor, room: int) -> None:
        self.model = model
        self.cache, _ = model.prefill(prompt, room)
        self.pending = first.unsqueeze(-1)
        self.proposal: torch.Tensor | None = None

    def propose(self, k: int, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.extend(self.cache, self.pending)[:, -1]
        xs, ps = [], []
        for i in range(k):
            x, p = draw(logits, torch.stack(xs, 1) if xs else self.pending[:, :0])
            xs.append(x)
            ps.append(p)
            if i < k - 1:
                logits = self.model.extend(self.cache, x.unsqueeze(-1))[:, -1]
        self.proposal = torch.stack(xs, 1)
        return self.proposal, torch.stack(ps, 1)

    def accept(self, kept: list[int], token: torch.Tensor, features: Any) -> None:
        k = self.proposal.shape[1]
        self.model.rollback(self.cache, [k - n for n in kept])
        n = torch.as_tensor(kept, device=token.device)
        rows = torch.arange(token.shape[0], device=token.device)
        before = torch.where(n > 0, self.proposal[rows, (n - 1).clamp_min(0)], self.pending[:, -1])
        self.pending = torch.stack([before, token], 1)
